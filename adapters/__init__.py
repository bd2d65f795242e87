"""Adapters: NVIDIA DALI pipelines and FFCV loaders on the shared schedule (heavy dependencies
imported lazily)."""
