import tracemalloc

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_loaders.hashing import mix64
from lightning_loaders.orders.base import ShuffledOrder
from lightning_loaders.orders.permutation import KeyedPermutation


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 3000), key=st.integers(0, 2**64 - 1))
def test_is_a_bijection_of_range_n(n: int, key: int) -> None:
    values = KeyedPermutation(n, key)[np.arange(n)]
    assert np.array_equal(np.sort(values), np.arange(n))


@settings(max_examples=50, deadline=None)
@given(n=st.one_of(st.integers(1, 2**32), st.integers(2**32 + 1, 2**62)),
       key=st.integers(0, 2**64 - 1), seed=st.integers(0, 2**32 - 1))
def test_inverse_undoes_it_at_any_size(n: int, key: int, seed: int) -> None:
    """perm.inverse(perm[p]) == p: the network is injective, so a bijection, in 32-bit and
    64-bit words alike, even where range(n) cannot be enumerated."""
    perm = KeyedPermutation(n, key)
    positions = np.random.default_rng(seed).integers(0, n, 200)
    values = perm[positions]
    assert ((0 <= values) & (values < n)).all()
    assert np.array_equal(perm.inverse(values), positions)


def test_key_changes_the_order_and_is_deterministic() -> None:
    a = KeyedPermutation(1000, 1)[np.arange(1000)]
    assert np.array_equal(a, KeyedPermutation(1000, 1)[np.arange(1000)])
    assert not np.array_equal(a, KeyedPermutation(1000, 2)[np.arange(1000)])
    assert not np.array_equal(a, np.arange(1000))


@pytest.mark.parametrize("n", [100_000, 2**17, 2**17 + 1])
def test_looks_like_a_uniform_shuffle(n: int) -> None:
    """No obvious structure: adjacent positions land about n/3 apart (as in a uniform random
    permutation), values do not follow positions, and low bits are not preserved."""
    positions = np.arange(n)
    for key in range(3):
        values = KeyedPermutation(n, key)[positions]
        assert 0.31 < np.abs(np.diff(values)).mean() / n < 0.36
        assert abs(np.corrcoef(positions, values)[0, 1]) < 0.02
        assert abs(np.mean((values ^ positions) & 1) - 0.5) < 0.01
        assert len(np.unique(np.diff(values))) > 0.6 * n  # no repeated stride


def test_first_position_is_uniform_over_keys() -> None:
    firsts = np.array([KeyedPermutation(100, key)[0] for key in range(5000)])
    counts = np.bincount(firsts // 10, minlength=10)
    assert counts.min() > 400 and counts.max() < 600  # 500 expected per decile


def test_huge_n_costs_nothing_up_front() -> None:
    perm = KeyedPermutation(10**12, 7)
    values = perm[np.array([0, 1, 10**12 - 1])]
    assert ((0 <= values) & (values < 10**12)).all()
    assert len(set(values.tolist())) == 3


def test_keeps_the_shape_of_its_input() -> None:
    perm = KeyedPermutation(50, 3)
    grid = np.arange(12).reshape(3, 4)
    assert perm[grid].shape == (3, 4)
    assert np.array_equal(perm[grid].ravel(), perm[np.arange(12)])
    assert perm[7].shape == () and int(perm[7]) == int(perm[np.array([7])][0])


def test_rejects_positions_outside_range() -> None:
    with pytest.raises(IndexError, match=r"\[0, 10\)"):
        KeyedPermutation(10, 0)[np.array([10])]
    with pytest.raises(IndexError):
        KeyedPermutation(10, 0)[np.array([-1])]
    with pytest.raises(IndexError):
        KeyedPermutation(10, 0).inverse(np.array([10]))
    with pytest.raises(ValueError):
        KeyedPermutation(0, 0)


# -- ShuffledOrder serves the permutation of each epoch from a cached chunk -----------------


def _expected(n: int, seed: int, epoch: int, positions: np.ndarray) -> np.ndarray:
    return KeyedPermutation(n, mix64(seed, epoch))[positions]


@pytest.mark.parametrize("positions", [
    np.arange(0, 256), np.arange(65_500, 65_600), np.arange(199_990, 200_000),
    np.array([5, 150_000, 3]), np.array([70_000, 3]), np.array([3, 70_000]),
    np.array([65_536, 65_535]), np.arange(10).reshape(2, 5), np.array([], dtype=np.int64),
    np.arange(60_000, 70_000), np.arange(131_000, 140_000, 3), np.array([3, 70_000, 5, 66_000]),
    np.arange(0, 140_000, 7),
], ids=lambda p: f"{p.size}@{p.ravel()[:1]}")
def test_shuffled_order_matches_its_permutation(positions: np.ndarray) -> None:
    order = ShuffledOrder(200_000, seed=4)
    for epoch in (0, 1, 0):
        got = order.indices(epoch, positions)
        assert got.shape == positions.shape
        assert np.array_equal(got, _expected(200_000, 4, epoch, positions))


def test_shuffled_order_epochs_and_seeds_differ() -> None:
    order = ShuffledOrder(1000, seed=0)
    epochs = [order.indices(e, np.arange(1000)) for e in range(3)]
    assert all(np.array_equal(np.sort(e), np.arange(1000)) for e in epochs)
    assert not np.array_equal(epochs[0], epochs[1])
    assert not np.array_equal(epochs[0], ShuffledOrder(1000, seed=1).indices(0, np.arange(1000)))


def test_shuffled_order_rejects_positions_outside_range() -> None:
    order = ShuffledOrder(100, seed=0)
    for bad in (np.array([100]), np.array([-1]), np.array([5, -1]), np.array([5, 100])):
        with pytest.raises(IndexError):
            order.indices(0, bad)


def _traced_peak(n: int) -> int:
    order = ShuffledOrder(n, seed=0)
    tracemalloc.start()
    for start in range(0, 256 * 300, 256):
        order.indices(0, np.arange(start, start + 256) % n)
    order.indices(0, np.array([n - 1]))
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return peak


def test_shuffled_order_memory_does_not_grow_with_n() -> None:
    small, huge = _traced_peak(10**6), _traced_peak(10**12)
    assert huge < 4 * 2**20, f"{huge} bytes for n=10**12"
    assert huge < 3 * small, (small, huge)
