"""Counter-based 64-bit mixing: the only source of randomness in every plan.

Everything random in this package is a pure function of integers (seed, epoch, position, ...)
hashed here, so results never depend on global RNG state, worker count or call order.
"""

from __future__ import annotations

import hashlib
import numbers
from typing import Any

import numpy as np

_MASK64 = (1 << 64) - 1
_GOLDEN = 0x9E3779B97F4A7C15
_INITIAL = 0x6A09E667F3BCC909  # mix64() of nothing


def checked_seed(seed: Any, name: str = "seed") -> int:
    """``seed`` as an int, refused unless it is one (not a bool, float or string) that the
    64-bit hashes keep apart from every other: ``-2**63 <= seed < 2**64``."""
    if isinstance(seed, bool) or not isinstance(seed, numbers.Integral):
        raise TypeError(f"{name} must be an int, got {seed!r} ({type(seed).__name__})")
    if not -(1 << 63) <= int(seed) <= _MASK64:
        raise ValueError(f"{name} must lie in [-2**63, 2**64), got {seed}: larger seeds wrap "
                         "around onto smaller ones")
    return int(seed)


def mix64(*values: int) -> int:
    """Hash any number of integers into one well-mixed 64-bit integer (splitmix64 chain)."""
    return mix64_after(_INITIAL, *values)


def mix64_after(state: int, *values: int) -> int:
    """``mix64(*prefix, *values)`` from ``state = mix64(*prefix)``: a prefix shared by several
    hashes is hashed once."""
    for value in values:
        state = _splitmix64((state ^ (value & _MASK64)) + _GOLDEN)
    return state


def _splitmix64(z: int) -> int:
    z = (z + _GOLDEN) & _MASK64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & _MASK64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & _MASK64
    return z ^ (z >> 31)


def mix64_array(key: int, values: np.ndarray) -> np.ndarray:
    """Vectorised ``splitmix64(key ^ value)`` over a uint64 array (wrapping arithmetic)."""
    z = values.astype(np.uint64, copy=True)
    z ^= np.uint64(key & _MASK64)
    z += np.uint64(_GOLDEN)
    z ^= z >> np.uint64(30)
    z *= np.uint64(0xBF58476D1CE4E5B9)
    z ^= z >> np.uint64(27)
    z *= np.uint64(0x94D049BB133111EB)
    z ^= z >> np.uint64(31)
    return z


def seed32(*values: int) -> int:
    """A 32-bit seed for APIs that take one (``random.seed``, ``np.random.seed``)."""
    return mix64(*values) & 0xFFFFFFFF


def digest(value: Any) -> str:
    """A short content hash (16 hex digits) for fingerprints: a numpy array by its bytes (an
    object array by its values' ``repr``) and dtype, anything else by its ``repr`` (lists of
    names, lengths, configurations)."""
    if not isinstance(value, np.ndarray):
        return hashlib.blake2b(repr(value).encode(), digest_size=8).hexdigest()
    data = np.ascontiguousarray(value)
    hasher = hashlib.blake2b(digest_size=8)
    # an object array's bytes are pointers, new in every process: its values' repr instead
    hasher.update(repr(data.tolist()).encode() if data.dtype.hasobject
                  else data.reshape(-1).view(np.uint8).data)
    hasher.update(str(data.dtype).encode())  # as hashing bytes + dtype at once, without a copy
    return hasher.hexdigest()
