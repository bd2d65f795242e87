"""Sample orders: which dataset index sits at each position of an epoch.

An order is a pure function of ``(epoch, position)``; the plan decides which positions a rank
reads in which batch. Orders hold no per-epoch state, so resuming is a jump, never a replay.
"""

from __future__ import annotations

from typing import Protocol, runtime_checkable

import numpy as np

from lightning_loaders._hashing import mix64
from lightning_loaders.permutation import KeyedPermutation

__all__ = ["SampleOrder", "SequentialOrder", "ShuffledOrder"]


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
    """``shuffle=True``: a new permutation of ``range(n)`` per epoch, keyed by (seed, epoch)."""

    def __init__(self, n: int, seed: int) -> None:
        self.n = n
        self.seed = seed
        self._epoch = -1
        self._perm: KeyedPermutation | None = None

    def __len__(self) -> int:
        return self.n

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        if self._perm is None or epoch != self._epoch:
            self._perm = KeyedPermutation(self.n, mix64(self.seed, epoch))
            self._epoch = epoch
        return self._perm[positions]

    @property
    def fingerprint(self) -> str:
        return "shuffled"
