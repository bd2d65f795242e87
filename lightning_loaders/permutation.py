"""A keyed bijection of ``range(n)``: a shuffle that costs O(1) memory for any ``n``.

A balanced Feistel network permutes the smallest even-bit domain ``2**(2k) >= n``; cycle-walking
(re-applying the network to values that land outside ``range(n)``) restricts it to ``range(n)``.
Because the domain is below ``4 * n``, walking takes fewer than four rounds per value on average.
"""

from __future__ import annotations

import numpy as np

from lightning_loaders._hashing import mix64, mix64_array

__all__ = ["KeyedPermutation"]

_ROUNDS = 6


class KeyedPermutation:
    """``perm[i]`` for a pseudo-random permutation of ``range(n)`` chosen by ``key``.

    Indexing accepts an int or an integer array and is vectorised; nothing of size ``n`` is ever
    built, so a permutation of ``10**9`` samples costs as little as one of ``10**3``.
    """

    __slots__ = ("_half_bits", "_half_mask", "_keys", "n")

    def __init__(self, n: int, key: int) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        self._half_bits = (bits + 1) // 2
        self._half_mask = np.uint64((1 << self._half_bits) - 1)
        self._keys = tuple(mix64(key, r) for r in range(_ROUNDS))

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, positions: int | np.ndarray) -> np.ndarray:
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= self.n):
            raise IndexError(f"positions must lie in [0, {self.n})")
        out = self._encrypt(pos.astype(np.uint64))
        outside = out >= np.uint64(self.n)
        while outside.any():
            out[outside] = self._encrypt(out[outside])
            outside = out >= np.uint64(self.n)
        return out.astype(np.int64)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        shift = np.uint64(self._half_bits)
        left = x >> shift
        right = x & self._half_mask
        for key in self._keys:
            left, right = right, left ^ (mix64_array(key, right) & self._half_mask)
        return (left << shift) | right
