"""Rank, world size and device, resolved lazily (at first use, not at construction)."""

from __future__ import annotations

import numbers
import os
from typing import Any

import torch
import torch.distributed as dist

__all__ = ["placement_settled", "resolve_device", "resolve_rank_world"]


def resolve_rank_world(rank: int | None = None, world_size: int | None = None) -> tuple[int, int]:
    """``(rank, world_size)`` from, in order: explicit arguments, an initialised process group,
    the ``RANK``/``WORLD_SIZE`` environment, else ``(0, 1)``."""
    if (rank is None) != (world_size is None):
        raise ValueError(f"give both rank and world_size or neither (got rank={rank}, "
                         f"world_size={world_size})")
    source = "got"
    if rank is None or world_size is None:
        if dist.is_available() and dist.is_initialized():
            rank, world_size = dist.get_rank(), dist.get_world_size()
        elif "WORLD_SIZE" in os.environ:
            rank_name = "RANK" if "RANK" in os.environ else "LOCAL_RANK"
            source = "the environment says"
            world_size = _env_int("WORLD_SIZE")
            rank = _env_int(rank_name) if rank_name in os.environ else 0
        else:
            rank, world_size = 0, 1
    for name, value in (("rank", rank), ("world_size", world_size)):
        if isinstance(value, bool) or not isinstance(value, numbers.Integral):
            raise TypeError(f"{name} must be an int, got {value!r} ({type(value).__name__})")
    if world_size < 1 or not 0 <= rank < world_size:
        raise ValueError(f"need 0 <= rank < world_size, {source} rank={rank}, "
                         f"world_size={world_size}")
    return int(rank), int(world_size)


def placement_settled(rank: int | None = None, world_size: int | None = None) -> bool:
    """Whether ``resolve_rank_world(rank, world_size)`` reads a source rather than falling
    back to ``(0, 1)``: explicit arguments, an initialised process group or the environment.
    A fallback may change (a loader read before ``Trainer.fit`` starts DDP)."""
    return (rank is not None or (dist.is_available() and dist.is_initialized())
            or "WORLD_SIZE" in os.environ)


def _env_int(name: str) -> int:
    try:
        return int(os.environ[name])
    except ValueError:
        raise ValueError(f"the environment variable {name}={os.environ[name]!r} is not an "
                         "int") from None


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
