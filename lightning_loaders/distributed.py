"""Rank and world size, resolved lazily (at first use, not at construction)."""

from __future__ import annotations

import os

import torch.distributed as dist

__all__ = ["resolve_rank_world"]


def resolve_rank_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` from, in order: explicit arguments, an initialised process group,
    the ``RANK``/``WORLD_SIZE`` environment, else ``(0, 1)``."""
    if (rank is None) != (world_size is None):
        raise ValueError(f"give both rank and world_size or neither (got rank={rank}, "
                         f"world_size={world_size})")
    if rank is None or world_size is None:
        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        elif "WORLD_SIZE" in os.environ:
            world_size = int(os.environ["WORLD_SIZE"])
            rank = int(os.environ.get("RANK", os.environ.get("LOCAL_RANK", 0)))
        else:
            rank, world_size = 0, 1
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, got rank={rank}, world_size={world_size}")
    return rank, world_size
