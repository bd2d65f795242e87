"""Sample orders: which dataset index sits at each position of an epoch.

An order is a pure function of ``(epoch, position)``; the plan decides which positions a rank
reads in which batch. Orders hold no per-epoch state (only memos of what they computed), so
resuming is a jump, never a replay.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from lightning_loaders.hashing import mix64
from lightning_loaders.orders.permutation import KeyedPermutation

__all__ = ["BatchedOrder", "EpochSizedOrder", "SampleOrder", "SequentialOrder", "ShuffledOrder"]

_CHUNK_BITS = 16
_CHUNK = 1 << _CHUNK_BITS


@runtime_checkable
class SampleOrder(Protocol):
    """The dataset indices of an epoch, position by position."""

    def __len__(self) -> int:
        """Positions per epoch."""
        ...

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        """Dataset indices (int64) at ``positions`` of ``epoch``."""
        ...

    @property
    def fingerprint(self) -> str:
        """A short description that changes whenever the order would change (checked on resume)."""
        ...


@runtime_checkable
class BatchedOrder(SampleOrder, Protocol):
    """An order made of a batch sampler's batches, which may differ in size from epoch to
    epoch (``DrawnBatchOrder``)."""

    batch_size: int
    """The size of the batches of an epoch planned as positions cut into equal batches."""

    def batch_bounds(self, epoch: int) -> np.ndarray | None:
        """Where each batch of ``epoch`` begins among its positions, then the epoch's end
        (``None``: the epoch is cut into batches of ``batch_size``)."""
        ...


@runtime_checkable
class EpochSizedOrder(SampleOrder, Protocol):
    """An order whose epochs may differ in length: a drawn sampler whose ``len()`` follows its
    ``set_epoch`` (a curriculum reading more of the dataset every epoch). ``len()`` is the
    length the order was built with; each epoch is planned with its own."""

    def epoch_len(self, epoch: int) -> int:
        """Positions of ``epoch``."""
        ...


class SequentialOrder:
    """``0, 1, ..., n - 1`` in every epoch (``shuffle=False``)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        return np.asarray(positions, dtype=np.int64)

    @property
    def fingerprint(self) -> str:
        return "sequential"


class ShuffledOrder:
    """``shuffle=True``: a new permutation of ``range(n)`` per epoch, keyed by (seed, epoch).

    Plans read ascending positions, so the permutation is computed a chunk of ``2**16``
    aligned positions at a time and the last chunk is kept: a block of batches then costs one
    small gather instead of a pass of the Feistel network. Memory stays fixed (512 KiB at most)
    whatever ``n`` is; other positions (unsorted, or over more than two chunks) are computed
    directly.
    """

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.seed = seed
        # Memos, each replaced by one assignment so concurrent callers never see a torn pair.
        self._perm: tuple[int, KeyedPermutation] | None = None
        self._chunk: tuple[int, int, np.ndarray] | None = None  # (epoch, chunk, values)

    def __len__(self) -> int:
        return self.n

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        pos = np.asarray(positions, dtype=np.int64)
        perm = self._permutation(epoch)
        if pos.ndim != 1 or not pos.size:
            return perm[pos]
        first, last = int(pos[0]) >> _CHUNK_BITS, int(pos[-1]) >> _CHUNK_BITS
        if not 0 <= first <= last <= first + 1 or not 0 <= pos[-1] < self.n:
            return perm[pos]
        # Ascending positions across at most two chunks: each segment is read from its chunk.
        # A position outside its segment's chunk (unsorted input) falls back to the direct path.
        ends = [len(pos)]
        if last > first:
            ends.insert(0, int(np.searchsorted(pos, last << _CHUNK_BITS)))
        out = np.empty_like(pos)
        begin = 0
        for chunk, end in zip(range(first, last + 1), ends, strict=True):
            values = self._chunk_values(epoch, chunk, perm)
            offsets = pos[begin:end] - (chunk << _CHUNK_BITS)
            if offsets.size and offsets.view(np.uint64).max() >= len(values):
                return perm[pos]
            out[begin:end] = values[offsets]
            begin = end
        return out

    def _chunk_values(self, epoch: int, chunk: int, perm: KeyedPermutation) -> np.ndarray:
        """The permutation over chunk ``chunk`` of ``epoch`` (the last one computed is kept)."""
        memo = self._chunk
        if memo is None or memo[0] != epoch or memo[1] != chunk:
            start = chunk << _CHUNK_BITS
            stop = min(start + _CHUNK, self.n)
            memo = self._chunk = (epoch, chunk, perm[np.arange(start, stop, dtype=np.int64)])
        return memo[2]

    def _permutation(self, epoch: int) -> KeyedPermutation:
        memo = self._perm
        if memo is None or memo[0] != epoch:
            memo = self._perm = (epoch, KeyedPermutation(self.n, mix64(self.seed, epoch)))
        return memo[1]

    @property
    def fingerprint(self) -> str:
        return "shuffled"
