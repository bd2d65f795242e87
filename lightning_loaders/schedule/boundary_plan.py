"""The global batch plan over a batch sampler's own batches, when they differ in size.

A batch sampler that buckets by length or fills a token budget makes batches of its own sizes,
and their number may change from epoch to epoch. They are dealt whole: global batch ``g``
holds the epoch's batches ``g * world_size .. g * world_size + world_size - 1`` and rank ``r``
reads the ``r``-th of them, exactly as the sampler made it. Every rank has the same number of
batches, and after ``g`` global batches the consumed positions are those of the epoch's first
``g * world_size`` batches, whatever the world size was: elastic resume continues from that
batch. ``BoundaryPlan`` answers what ``EpochPlan`` answers, so the schedule reads either.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

import numpy as np

__all__ = ["BoundaryPlan"]


@dataclass(frozen=True, eq=False)
class BoundaryPlan:
    """An epoch's batches, from batch ``first`` on, dealt whole to ``world_size`` ranks.

    Attributes:
        bounds: where each batch of the epoch begins among its positions, then the epoch's
            end (``bounds[b]:bounds[b + 1]`` are batch ``b``'s positions; ``bounds[0] == 0``).
        first: the first batch still to read (0, or where an elastic resume continues).
        world_size: number of ranks sharing each global batch.
        last_batch: what becomes of the *tail*, the fewer than ``world_size`` batches left
            after the last whole global batch: ``"keep"`` splits its samples as evenly as
            possible over the ranks (never an empty batch: fewer samples than ranks join the
            last whole global batch instead, one each on its first ranks), ``"drop"`` drops
            them, ``"pad"`` gives each rank left without one a batch from the epoch's start,
            in order (as ``EpochPlan`` wraps positions).
    """

    bounds: np.ndarray
    first: int
    world_size: int
    last_batch: Literal["keep", "drop", "pad"] = "keep"

    @classmethod
    def from_position(cls, bounds: np.ndarray, position: int, world_size: int,
                      last_batch: Literal["keep", "drop", "pad"] = "keep") -> BoundaryPlan:
        """The plan of the rest of the epoch from ``position``, where a batch begins (what
        ``consumed`` says of a plan on any world size)."""
        first = int(np.searchsorted(bounds, position))
        if first >= len(bounds) or int(bounds[first]) != position:
            raise ValueError(f"position {position} is not where one of the epoch's "
                             f"{len(bounds) - 1} batches begins")
        return cls(bounds, first, world_size, last_batch)

    def __post_init__(self) -> None:
        if self.world_size < 1:
            raise ValueError(f"world_size must be >= 1, got {self.world_size}")
        if self.bounds.ndim != 1 or len(self.bounds) < 2 or self.bounds[0] != 0:
            raise ValueError("bounds must be the cumulative sizes of at least one batch, from 0")
        if not 0 <= self.first < len(self.bounds):
            raise ValueError(f"first={self.first} outside the epoch's {len(self.bounds) - 1} "
                             "batches")
        full, rest = self._rounds()
        _, samples = self._tail()
        if self.last_batch == "keep" and 0 < samples < self.world_size and full == 0:
            ranks = f"{samples} rank" + "s" * (samples > 1)
            raise ValueError(
                f"last_batch='keep' cannot give each of {self.world_size} ranks a non-empty "
                f"batch from the {samples} samples left of the batch sampler's epoch (in "
                f"{rest} batches); use last_batch='pad', or at most {ranks}")

    @property
    def start(self) -> int:
        """First position still to read."""
        return int(self.bounds[self.first])

    @property
    def stop(self) -> int:
        """End of the epoch's positions."""
        return int(self.bounds[-1])

    @property
    def num_batches(self) -> int:
        """Batches per rank (equal on every rank)."""
        full, rest = self._rounds()
        if rest == 0 or self.last_batch == "drop" or self._merges_tail():
            return full
        return full + 1

    def consumed(self, batches: int) -> int:
        """The position up to which the epoch is read after ``batches`` global batches: where
        the epoch's batch ``first + batches * world_size`` begins."""
        if batches >= self.num_batches:
            return self.stop
        return int(self.bounds[self.first + batches * self.world_size])

    @property
    def even_batches(self) -> int:
        """None: the batches differ in size, so none is planned a block at a time."""
        return 0

    def even_positions(self, first: int, stop: int, rank: int) -> np.ndarray:
        """As ``EpochPlan.even_positions``; only the empty block exists here."""
        if first != stop:
            raise IndexError(f"batches [{first}, {stop}) outside the even batches [0, 0)")
        return np.zeros((0, 0), dtype=np.int64)

    def positions(self, batch: int, rank: int) -> np.ndarray:
        """Epoch positions (int64) that ``rank`` reads in ``batch``."""
        if not 0 <= batch < self.num_batches:
            raise IndexError(f"batch {batch} outside [0, {self.num_batches})")
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside [0, {self.world_size})")
        full, rest = self._rounds()
        if batch < full:
            own = self._batch(self.first + batch * self.world_size + rank)
            begin, samples = self._tail()
            if batch == full - 1 and self._merges_tail() and rank < samples:
                return np.append(own, np.int64(begin + rank))
            return own
        if self.last_batch == "pad":
            epoch_batches = len(self.bounds) - 1
            index = (self.first + full * self.world_size + rank if rank < rest
                     else (rank - rest) % epoch_batches)
            return self._batch(index)
        begin, samples = self._tail()
        share, extra = divmod(samples, self.world_size)
        first = begin + rank * share + min(rank, extra)
        return np.arange(first, first + share + (rank < extra), dtype=np.int64)

    def _batch(self, index: int) -> np.ndarray:
        """The positions of the epoch's batch ``index``."""
        return np.arange(self.bounds[index], self.bounds[index + 1], dtype=np.int64)

    def _rounds(self) -> tuple[int, int]:
        """Whole global batches, and batches in the tail."""
        return divmod(len(self.bounds) - 1 - self.first, self.world_size)

    def _tail(self) -> tuple[int, int]:
        """First position and number of samples of the tail."""
        full, _ = self._rounds()
        begin = int(self.bounds[self.first + full * self.world_size])
        return begin, self.stop - begin

    def _merges_tail(self) -> bool:
        """Under ``"keep"``, a tail with fewer samples than ranks joins the last whole global
        batch (one sample each on its first ranks), which splitting it could not avoid
        giving a rank an empty batch."""
        _, samples = self._tail()
        return (self.last_batch == "keep" and 0 < samples < self.world_size
                and self._rounds()[0] > 0)
