"""Loaders: the delivery core and the loaders users construct, each a configuration of a
schedule and an engine; ``make_resumable`` for existing ``DataLoader``s."""
