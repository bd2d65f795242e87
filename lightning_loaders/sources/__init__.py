"""Sources: what iterable data is. The sharded-source protocol, the ready sources for the
formats users have, and packed storage for copy-on-access-safe metadata."""
