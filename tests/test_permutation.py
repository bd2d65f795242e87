import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_loaders import KeyedPermutation


@settings(max_examples=200, deadline=None)
@given(n=st.integers(1, 3000), key=st.integers(0, 2**64 - 1))
def test_is_a_bijection_of_range_n(n: int, key: int) -> None:
    values = KeyedPermutation(n, key)[np.arange(n)]
    assert np.array_equal(np.sort(values), np.arange(n))


def test_key_changes_the_order_and_is_deterministic() -> None:
    a = KeyedPermutation(1000, 1)[np.arange(1000)]
    assert np.array_equal(a, KeyedPermutation(1000, 1)[np.arange(1000)])
    assert not np.array_equal(a, KeyedPermutation(1000, 2)[np.arange(1000)])
    assert not np.array_equal(a, np.arange(1000))


def test_huge_n_costs_nothing_up_front() -> None:
    perm = KeyedPermutation(10**12, 7)
    values = perm[np.array([0, 1, 10**12 - 1])]
    assert ((0 <= values) & (values < 10**12)).all()
    assert len(set(values.tolist())) == 3


def test_rejects_positions_outside_range() -> None:
    with pytest.raises(IndexError):
        KeyedPermutation(10, 0)[np.array([10])]
    with pytest.raises(ValueError):
        KeyedPermutation(0, 0)
