"""Which dataset indices each rank reads: for putting evaluation and prediction outputs back in
dataset order.

The plan is a pure function, so any process can compute what any rank reads in any epoch
without communication: ``batch_indices(loader, rank=r)``. ``expose_batch_indices`` also hands
them to Lightning, whose ``BasePredictionWriter`` then receives each batch's ``batch_indices``.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TypeVar, overload

import numpy as np
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper

from lightning_loaders.loaders.map_style import MapStyleLoader
from lightning_loaders.loaders.resumable import ResumableLoader
from lightning_loaders.schedule.map_schedule import MapSchedule

__all__ = ["batch_indices", "expose_batch_indices"]

_Loader = TypeVar("_Loader", bound=ResumableLoader)


def batch_indices(loader: ResumableLoader, epoch: int | None = None,
                  rank: int | None = None) -> list[np.ndarray]:
    """Dataset indices of every batch ``rank`` reads in a full ``epoch``, batch by batch.

    Defaults: this process's rank, and the epoch being delivered (0 before the first batch).
    Orders whose indices change within an epoch (a re-weighted ``DynamicWeightedSampler``) are
    only described for the weights they hold now. Takes a ``ResumableLoader`` (what users
    hold) over a map-style dataset; an iterable one raises ``TypeError``.
    """
    schedule = _map_style(loader, "batch_indices").schedule
    own_rank, world_size = schedule.placement
    rank = own_rank if rank is None else rank
    epoch = (schedule.epoch or 0) if epoch is None else epoch
    return [_batch(schedule, epoch, world_size, rank, b)
            for b in range(schedule.plan_for(epoch, world_size).num_batches)]


def expose_batch_indices(loader: _Loader) -> _Loader:
    """Give ``loader`` the ``batch_sampler`` through which Lightning's prediction loop learns
    the dataset indices of each delivered batch (``BasePredictionWriter``'s ``batch_indices``).

    Returns ``loader``; an iterable dataset's loader raises ``TypeError``, as in
    ``batch_indices``.
    """
    mapped = _map_style(loader, "expose_batch_indices")
    # Past the guard that refuses, as DataLoader does, user changes to built loaders.
    object.__setattr__(loader, "batch_sampler",
                       _DeliveredIndices(mapped.schedule, mapped.delivery_order()))
    return loader


def _map_style(loader: ResumableLoader, caller: str) -> MapStyleLoader:
    """``loader``, refused unless it reads a map-style dataset: an iterable dataset's samples
    have no dataset indices."""
    if not isinstance(loader, MapStyleLoader):
        raise TypeError(f"{caller} needs a ResumableLoader over a map-style dataset, got a "
                        f"{type(loader).__name__}: an iterable dataset's samples have no "
                        "dataset indices")
    return loader


def _batch(schedule: MapSchedule, epoch: int, world_size: int, rank: int,
           batch: int) -> np.ndarray:
    if schedule.last_batch == "rollover":
        raise ValueError("batch_indices does not describe last_batch='rollover' loaders, whose "
                         "batches span two epochs")
    positions = schedule.plan_for(epoch, world_size).positions(batch, rank)
    return schedule.order.indices(epoch, positions)


class _SeenBatches(Sequence[list[int]]):
    """The indices of the batches delivered so far in the current epoch, computed on access;
    ``order``: the planned batch of each delivery (``None``: delivered in plan order)."""

    def __init__(self, schedule: MapSchedule, order: list[int] | None) -> None:
        self._schedule = schedule
        self._order = order

    def __len__(self) -> int:
        if self._order is not None:
            return len(self._order)
        return self._schedule.batches if self._schedule.epoch is not None else 0

    @overload
    def __getitem__(self, batch: int) -> list[int]: ...

    @overload
    def __getitem__(self, batch: slice) -> list[list[int]]: ...

    def __getitem__(self, batch: int | slice) -> list[int] | list[list[int]]:
        if isinstance(batch, slice):
            return [self[b] for b in range(*batch.indices(len(self)))]
        if not -len(self) <= batch < len(self):
            raise IndexError(f"batch {batch} not delivered yet ({len(self)} so far)")
        schedule = self._schedule
        rank, world_size = schedule.placement
        assert schedule.epoch is not None
        batch %= len(self)
        planned = batch if self._order is None else self._order[batch]
        return _batch(schedule, schedule.epoch, world_size, rank, planned).tolist()


class _DeliveredIndices(_IndexBatchSamplerWrapper):
    """What Lightning's prediction loop looks for on ``loader.batch_sampler``; it only reads
    ``seen_batch_indices``. (The base initialiser wraps a real batch sampler: not called.)"""

    def __init__(self, schedule: MapSchedule, order: list[int] | None) -> None:
        self.seen_batch_indices = _SeenBatches(schedule, order)  # type: ignore[assignment]
        self._iterator = None

    def __len__(self) -> int:
        return len(self.seen_batch_indices)
