"""A keyed bijection of ``range(n)``: a shuffle that costs O(1) memory for any ``n``.

A six-round Feistel network permutes the smallest power-of-two domain ``2**B >= n``, split into
halves of ``ceil(B/2)`` and ``floor(B/2)`` bits (an unbalanced network, so the domain stays below
``2 * n``); cycle-walking (re-applying the network to values that land outside ``range(n)``)
restricts it to ``range(n)``, at fewer than two network passes per value on average.

Each round is ``half ^= top bits of ((other_half ^ key_r) * multiplier_r)``: three vectorised
integer operations with a keyed odd multiplier, in 32-bit words when ``n <= 2**32``. The
permutation is a statistically good shuffle, not a cryptographic one.
"""

from __future__ import annotations

from collections.abc import Callable

import numpy as np

from lightning_loaders.hashing import mix64, mix64_array

__all__ = ["KeyedPermutation"]

_ROUNDS = 6  # even: the halves end with the widths they started with


class KeyedPermutation:
    """``perm[i]`` for a pseudo-random permutation of ``range(n)`` chosen by ``key``.

    Indexing accepts an int or an integer array (any shape) and is vectorised; nothing of size
    ``n`` is ever built, so a permutation of ``10**9`` samples costs as little as one of
    ``10**3``. Per index it costs a few nanoseconds on large arrays; per call, about thirty numpy
    operations, so callers that read contiguous positions should ask for many at once (as
    ``ShuffledOrder`` does).
    """

    __slots__ = ("_dtype", "_last", "_lo_bits", "_lo_mask", "_rounds", "n")

    def __init__(self, n: int, key: int) -> None:
        if n < 1:
            raise ValueError(f"a permutation needs n >= 1, got {n}")
        self.n = n
        bits = max(2, (n - 1).bit_length())
        lo_bits = bits // 2
        hi_bits = bits - lo_bits
        word = 32 if bits <= 32 else 64
        dtype = np.uint32 if word == 32 else np.uint64
        self._dtype = dtype
        self._last = dtype(n - 1)  # compared with ``>``: n == 2**32 still fits 32 bits
        self._lo_bits = dtype(lo_bits)
        self._lo_mask = dtype((1 << lo_bits) - 1)
        # Per round: a key and an odd multiplier, all hashed from ``key`` in one vectorised call.
        constants = mix64_array(mix64(key), np.arange(2 * _ROUNDS, dtype=np.uint64))
        constants = (constants >> np.uint64(64 - word)).astype(dtype)
        constants[1::2] |= dtype(1)
        self._rounds = tuple(
            (constants[2 * r], constants[2 * r + 1], dtype(word - (lo_bits if r % 2 else hi_bits)))
            for r in range(_ROUNDS)
        )

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, positions: int | np.ndarray) -> np.ndarray:
        return self._walk(positions, "positions", self._encrypt)

    def inverse(self, values: int | np.ndarray) -> np.ndarray:
        """Positions holding ``values``: ``perm.inverse(perm[p]) == p`` (where in the epoch a
        dataset index comes)."""
        return self._walk(values, "values", self._decrypt)

    def _walk(self, x: int | np.ndarray, name: str,
              network: Callable[[np.ndarray], np.ndarray]) -> np.ndarray:
        """Apply ``network`` until every value lands in ``range(n)`` (cycle-walking)."""
        arr = np.asarray(x, dtype=np.int64)
        if arr.size and (arr.min() < 0 or arr.max() >= self.n):
            raise IndexError(f"{name} must lie in [0, {self.n}), got values in "
                             f"[{arr.min()}, {arr.max()}]")
        out = network(arr.ravel().astype(self._dtype))
        outside = np.flatnonzero(out > self._last)
        while outside.size:
            walked = network(out[outside])
            out[outside] = walked
            outside = outside[walked > self._last]
        return out.astype(np.int64).reshape(arr.shape)

    def _encrypt(self, x: np.ndarray) -> np.ndarray:
        """One pass of the Feistel network over the power-of-two domain (a bijection of it)."""
        hi = x >> self._lo_bits
        lo = x & self._lo_mask
        tmp = np.empty_like(x)
        for key, multiplier, shift in self._rounds:
            np.bitwise_xor(lo, key, out=tmp)
            tmp *= multiplier
            tmp >>= shift
            hi ^= tmp
            hi, lo = lo, hi
        hi <<= self._lo_bits
        hi |= lo
        return hi

    def _decrypt(self, x: np.ndarray) -> np.ndarray:
        """The inverse of ``_encrypt``: the rounds undone in reverse order."""
        hi = x >> self._lo_bits
        lo = x & self._lo_mask
        tmp = np.empty_like(x)
        for key, multiplier, shift in reversed(self._rounds):
            np.bitwise_xor(hi, key, out=tmp)
            tmp *= multiplier
            tmp >>= shift
            lo ^= tmp
            hi, lo = lo, hi
        hi <<= self._lo_bits
        hi |= lo
        return hi
