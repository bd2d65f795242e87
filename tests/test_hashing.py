import hashlib

import numpy as np
import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from lightning_loaders import DynamicWeightedSampler, Mix, ResumableLoader
from lightning_loaders.hashing import checked_seed, digest, mix64, mix64_after, seed32

words = st.lists(st.integers(-(2**70), 2**70), max_size=5)


@given(words, words)
def test_mix64_after_continues_a_hashed_prefix(prefix: list[int], rest: list[int]) -> None:
    assert mix64_after(mix64(*prefix), *rest) == mix64(*prefix, *rest)


@given(words)
def test_hashes_fit_their_widths(values: list[int]) -> None:
    assert 0 <= mix64(*values) < 2**64
    assert 0 <= seed32(*values) < 2**32


def test_every_value_and_its_place_matter() -> None:
    hashes = {mix64(), mix64(0), mix64(1), mix64(0, 1), mix64(1, 0), mix64(0, 0)}
    assert len(hashes) == 6


@pytest.mark.parametrize(("seed", "error", "match"), [
    (1.7, TypeError, "seed must be an int, got 1.7"), ("12", TypeError, "got '12'"),
    (True, TypeError, "got True"), (2**64, ValueError, "wrap around"),
    (-(2**63) - 1, ValueError, "must lie in")])
def test_a_seed_the_hashes_cannot_keep_apart_is_refused(seed, error, match) -> None:
    """``2**64`` used to give seed 0's order, ``1.7`` seed 1's, in silence."""
    for build in (lambda: ResumableLoader(list(range(4)), shuffle=True, seed=seed),
                  lambda: Mix([[1, 2], [3]], [1, 1], seed=seed),
                  lambda: DynamicWeightedSampler(torch.ones(3), seed=seed)):
        with pytest.raises(error, match=match):
            build()
    assert checked_seed(2**64 - 1) == 2**64 - 1 and checked_seed(-(2**63)) == -(2**63)


def test_a_generator_that_is_no_torch_generator_is_refused_by_name() -> None:
    """Its initial seed keys the order; ``generator=5`` used to fail in an ``AttributeError``
    that named nothing."""
    with pytest.raises(TypeError, match="generator must be a torch.Generator .* got int"):
        ResumableLoader(list(range(4)), shuffle=True, generator=5)


@pytest.mark.parametrize("array", [
    np.arange(10), np.arange(12, dtype=np.int32).reshape(3, 4).T, np.array(5), np.zeros(0),
    np.array(["ab", "c"]), np.linspace(0, 1, 7)[::2],
    np.array([True, False]), np.array(["2026-11-25"], dtype="datetime64[D]")],
    ids=["int64", "transposed", "0-d", "empty", "strings", "strided", "bools", "dates"])
def test_an_arrays_digest_hashes_its_bytes_then_its_dtype(array: np.ndarray) -> None:
    """Read without a copy (half the time at 10^7 values), and what saved fingerprints hold."""
    data = np.ascontiguousarray(array)
    whole = hashlib.blake2b(data.tobytes() + str(data.dtype).encode(), digest_size=8)
    assert digest(array) == whole.hexdigest()


def test_an_object_arrays_digest_is_the_same_in_every_process() -> None:
    """An object array's bytes are pointers, new in every process (a fingerprint holding its
    digest was refused by the next run): it is hashed by its values."""
    import subprocess
    import sys

    code = ("import numpy as np; from lightning_loaders.hashing import digest; "
            "print(digest(np.array([1, 'x', None], dtype=object)))")
    runs = {subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                           check=True).stdout.strip() for _ in range(2)}
    assert runs == {digest(np.array([1, "x", None], dtype=object))}
    assert digest(np.array([1, "y", None], dtype=object)) not in runs
