"""Rank, world size and device, resolved lazily (at first use, not at construction)."""

from __future__ import annotations

import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["resolve_device", "resolve_rank_world"]


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


def resolve_device(trainer: Any = None, device: torch.device | str | None = None) -> torch.device:
    """The device a GPU pipeline should use on this process.

    From, in order: an explicit ``device``; the trainer's ``strategy.root_device`` (right even
    when ``devices=[2, 3]`` makes ``local_rank`` differ from the CUDA index); ``cuda:LOCAL_RANK``
    when CUDA is available; else the CPU.
    """
    if device is not None:
        return torch.device(device)
    if trainer is not None:
        return torch.device(trainer.strategy.root_device)
    if torch.cuda.is_available():
        return torch.device("cuda", int(os.environ.get("LOCAL_RANK", 0)))
    return torch.device("cpu")
