"""Random orders that are not a single shuffle: with replacement, repeated shuffles, subsets and
weights (the resumable equivalents of torch's ``RandomSampler``, ``SubsetRandomSampler`` and
``WeightedRandomSampler``).

Each draw is a pure function of ``(seed, epoch, position)`` through counter-based hashing, so an
order holds no per-epoch state beyond what it is configured with, every rank computes the same
epoch, and a resume is a jump. Weights and subset indices are the user's data: fingerprints carry
a digest of them, never the arrays.
"""

from __future__ import annotations

from typing import Any

import numpy as np

from lightning_loaders.hashing import digest, mix64, mix64_array
from lightning_loaders.orders.permutation import KeyedPermutation

__all__ = [
    "ReplacementOrder",
    "RepeatedShuffleOrder",
    "SubsetOrder",
    "WeightedOrder",
    "check_weights",
    "weighted_draws",
]

# Stream tags keep the hashes of different orders independent for the same (seed, epoch).
_REPLACEMENT, _REPEATED, _SUBSET, _WEIGHTED, _WEIGHTED_KEYS = range(1, 6)


def uniform(key: int, positions: np.ndarray) -> np.ndarray:
    """Uniform floats in ``[0, 1)`` (53 bits), one per position, keyed by ``key``."""
    bits = mix64_array(key, np.asarray(positions, dtype=np.int64).astype(np.uint64))
    return (bits >> np.uint64(11)).astype(np.float64) * (1.0 / (1 << 53))


def check_weights(weights: Any, length: int | None = None) -> np.ndarray:
    """``weights`` as a float64 array, refusing what no sampler can draw from."""
    if hasattr(weights, "detach"):
        weights = weights.detach().cpu().numpy()
    array = np.array(weights, dtype=np.float64)
    if array.ndim != 1 or array.size == 0:
        raise ValueError(f"weights must be a non-empty 1-d sequence, got shape {array.shape}")
    if length is not None and array.size != length:
        raise ValueError(f"weights must have one entry per sample: got {array.size}, expected "
                         f"{length}")
    if not np.isfinite(array).all() or (array < 0).any():
        bad = int(np.flatnonzero(~np.isfinite(array) | (array < 0))[0])
        raise ValueError(f"weights must be finite and >= 0, got weights[{bad}]={array[bad]}")
    if array.sum() <= 0:
        raise ValueError("weights must not all be zero")
    return array


def weighted_draws(cumulative: np.ndarray, last_positive: int, key: int,
                   positions: np.ndarray) -> np.ndarray:
    """Draws with replacement: the index whose cumulative-weight interval holds each uniform."""
    targets = uniform(key, positions) * cumulative[-1]
    chosen = np.searchsorted(cumulative, targets, side="right")
    # Rounding can put a target exactly on the total; that draw belongs to the last real weight.
    return np.minimum(chosen, last_positive).astype(np.int64)


def _check_sizes(n: int, num_samples: int) -> None:
    if n < 1 or num_samples < 1:
        raise ValueError(f"need n >= 1 and num_samples >= 1, got n={n}, "
                         f"num_samples={num_samples}")


def _check_positions(positions: np.ndarray, length: int) -> np.ndarray:
    pos = np.asarray(positions, dtype=np.int64)
    if pos.size and (pos.min() < 0 or pos.max() >= length):
        raise IndexError(f"positions must lie in [0, {length})")
    return pos


class ReplacementOrder:
    """``RandomSampler(replacement=True, num_samples=m)``: ``m`` uniform draws from ``range(n)``
    per epoch."""

    def __init__(self, n: int, num_samples: int, seed: int) -> None:
        _check_sizes(n, num_samples)
        self.n, self.num_samples, self.seed = n, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        pos = _check_positions(positions, self.num_samples)
        bits = mix64_array(mix64(self.seed, epoch, _REPLACEMENT), pos.astype(np.uint64))
        return (bits % np.uint64(self.n)).astype(np.int64)

    @property
    def fingerprint(self) -> str:
        return f"replacement(n={self.n}, num_samples={self.num_samples})"


class RepeatedShuffleOrder:
    """``RandomSampler(replacement=False, num_samples=m)`` with ``m != n``: whole permutations of
    ``range(n)`` laid end to end, the last one cut short (as torch does)."""

    def __init__(self, n: int, num_samples: int, seed: int) -> None:
        _check_sizes(n, num_samples)
        self.n, self.num_samples, self.seed = n, num_samples, seed

    def __len__(self) -> int:
        return self.num_samples

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        pos = _check_positions(positions, self.num_samples)
        blocks, offsets = np.divmod(pos, self.n)
        out = np.empty_like(pos)
        for block in np.unique(blocks):
            mask = blocks == block
            perm = KeyedPermutation(self.n, mix64(self.seed, epoch, _REPEATED, int(block)))
            out[mask] = perm[offsets[mask]]
        return out

    @property
    def fingerprint(self) -> str:
        return f"repeated-shuffle(n={self.n}, num_samples={self.num_samples})"


class SubsetOrder:
    """``SubsetRandomSampler(indices)``: a new permutation of the subset in every epoch. The
    indices are copied: an edit of the user's array in place reaches the order when the loader
    reads the sampler again between epochs, never in the middle of one."""

    def __init__(self, indices: Any, seed: int) -> None:
        if hasattr(indices, "detach"):  # a tensor, as check_weights reads one
            indices = indices.detach().cpu().numpy()
        subset = np.array(indices, dtype=np.int64).reshape(-1)
        if subset.size == 0:
            raise ValueError("SubsetRandomSampler has no indices: an epoch would be empty")
        self.subset, self.seed = subset, seed
        self._digest = digest(subset)

    def __len__(self) -> int:
        return int(self.subset.size)

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        perm = KeyedPermutation(self.subset.size, mix64(self.seed, epoch, _SUBSET))
        return self.subset[perm[positions]]

    @property
    def fingerprint(self) -> str:
        return f"subset(len={self.subset.size}, indices={self._digest})"


class WeightedOrder:
    """``WeightedRandomSampler(weights, num_samples, replacement)``.

    With replacement every position is an independent draw (inverse CDF over the cumulative
    weights). Without replacement an epoch is the successive-sampling order of exponential keys
    ``-log(u_i) / w_i`` (Efraimidis-Spirakis), the distribution of ``torch.multinomial`` without
    replacement; that epoch is computed once (O(n)) and cached.
    """

    def __init__(self, weights: Any, num_samples: int, replacement: bool, seed: int) -> None:
        self.weights = check_weights(weights)
        positive = int(np.count_nonzero(self.weights))
        if num_samples < 1:
            raise ValueError(f"num_samples must be >= 1, got {num_samples}")
        if not replacement and num_samples > positive:
            raise ValueError(f"cannot draw num_samples={num_samples} without replacement from "
                             f"{positive} samples with a positive weight")
        self.num_samples, self.replacement, self.seed = num_samples, replacement, seed
        self._cumulative = np.cumsum(self.weights)
        self._last_positive = int(np.flatnonzero(self.weights)[-1])
        self._digest = digest(self.weights)
        self._epoch: int | None = None
        self._epoch_order: np.ndarray | None = None

    def __len__(self) -> int:
        return self.num_samples

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        pos = _check_positions(positions, self.num_samples)
        if self.replacement:
            return weighted_draws(self._cumulative, self._last_positive,
                                  mix64(self.seed, epoch, _WEIGHTED), pos)
        if self._epoch != epoch or self._epoch_order is None:
            self._epoch_order = self._successive(epoch)
            self._epoch = epoch
        return self._epoch_order[pos]

    def _successive(self, epoch: int) -> np.ndarray:
        n = self.weights.size
        u = uniform(mix64(self.seed, epoch, _WEIGHTED_KEYS), np.arange(n))
        keys = np.full(n, np.inf)
        drawable = self.weights > 0
        keys[drawable] = -np.log1p(-u[drawable]) / self.weights[drawable]  # exponential(w_i)
        return np.argsort(keys, kind="stable")[: self.num_samples].astype(np.int64)

    @property
    def fingerprint(self) -> str:
        return (f"weighted(n={self.weights.size}, num_samples={self.num_samples}, "
                f"replacement={self.replacement}, weights={self._digest})")
