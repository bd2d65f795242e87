"""The few collectives the loaders use, each a no-op without an initialised process group.

Every rank must call a collective at the same point (as Lightning does when it checkpoints or
reaches the same step); without a process group they answer for this process alone.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist

__all__ = ["agree_min", "agree_range", "all_gather", "gather_by_rank", "group_size"]


def group_size() -> int:
    """The world size of the initialised default process group, else 1."""
    if dist.is_available() and dist.is_initialized():
        return int(dist.get_world_size())
    return 1


def all_gather(value: Any) -> list[Any]:
    """Every rank's ``value`` in rank order (``[value]`` without a process group)."""
    size = group_size()
    if size == 1:
        return [value]
    gathered: list[Any] = [None] * size
    dist.all_gather_object(gathered, value)
    return gathered


def gather_by_rank(value: Any, rank: int, world_size: int) -> list[Any]:
    """Every rank's ``value`` in rank order; without a process group of ``world_size`` ranks,
    only this rank's (the others ``None``)."""
    if world_size > 1 and group_size() == world_size:
        return all_gather(value)
    out: list[Any] = [None] * world_size
    out[rank] = value
    return out


def agree_min(value: int) -> int:
    """The minimum of ``value`` over all ranks (one small ``all_reduce``)."""
    tensor = torch.tensor([value], dtype=torch.int64, device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


def agree_range(*values: int) -> list[tuple[int, int]]:
    """The minimum and the maximum of each of ``values`` over all ranks (one small
    ``all_reduce``): a value is the same on every rank where they are equal."""
    tensor = torch.tensor([*values, *(-value for value in values)], dtype=torch.int64,
                          device=_device())
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    low = tensor.tolist()
    return [(low[i], -low[len(values) + i]) for i in range(len(values))]


def _device() -> torch.device:
    """Where a reduced tensor must live: NCCL reduces on the GPU only."""
    if dist.get_backend() == "nccl":
        return torch.device("cuda", torch.cuda.current_device())
    return torch.device("cpu")
