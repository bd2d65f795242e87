"""Side-by-side benchmarks of lightning-loaders against torch ``DataLoader`` and its peers.

Run ``python -m benchmarks.run_all`` (or ``make bench``); ``--quick`` uses small sizes.
"""
