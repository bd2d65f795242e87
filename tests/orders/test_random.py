from collections import Counter

import numpy as np
import pytest
import torch

from lightning_loaders.orders.random import (
    RepeatedShuffleOrder,
    ReplacementOrder,
    SubsetOrder,
    WeightedOrder,
    check_weights,
)


def epoch(order, e: int) -> list[int]:
    return order.indices(e, np.arange(len(order))).tolist()


def test_replacement_draws_uniformly_and_independently_per_epoch() -> None:
    order = ReplacementOrder(10, 20_000, seed=1)
    draws = epoch(order, 0)
    counts = Counter(draws)
    assert set(counts) == set(range(10))
    assert max(abs(c - 2000) for c in counts.values()) < 200  # ~4.5 sigma
    assert draws != epoch(order, 1)
    assert draws == epoch(ReplacementOrder(10, 20_000, seed=1), 0)
    assert draws != epoch(ReplacementOrder(10, 20_000, seed=2), 0)


def test_any_positions_give_the_same_draws_as_the_whole_epoch() -> None:
    for order in (ReplacementOrder(7, 40, 3), RepeatedShuffleOrder(7, 40, 3),
                  SubsetOrder([5, 2, 9, 11], 3), WeightedOrder([1, 0, 2, 5], 9, True, 3),
                  WeightedOrder([1, 0, 2, 5, 1], 3, False, 3)):
        whole = order.indices(4, np.arange(len(order)))
        picked = np.array([len(order) - 1, 0, 2])
        assert order.indices(4, picked).tolist() == whole[picked].tolist()
        with pytest.raises(IndexError):
            order.indices(0, np.array([len(order)]))


def test_repeated_shuffle_lays_whole_permutations_end_to_end() -> None:
    order = RepeatedShuffleOrder(6, 15, seed=2)
    draws = epoch(order, 0)
    assert sorted(draws[:6]) == sorted(draws[6:12]) == list(range(6))
    assert draws[:6] != draws[6:12]
    assert len(set(draws[12:])) == 3
    assert len(set(epoch(RepeatedShuffleOrder(6, 4, seed=2), 0))) == 4


def test_subset_is_a_new_permutation_of_the_subset_every_epoch() -> None:
    subset = [3, 8, 1, 20, 7, 13]
    order = SubsetOrder(subset, seed=4)
    first, second = epoch(order, 0), epoch(order, 1)
    assert sorted(first) == sorted(second) == sorted(subset)
    assert first != second
    with pytest.raises(ValueError, match="no indices"):
        SubsetOrder([], seed=0)


@pytest.mark.parametrize("make", [np.array, torch.tensor], ids=["int64 array", "tensor"])
def test_subset_copies_the_indices(make) -> None:
    """The user's array edited in place does not reach an order already made (the loader
    makes a new one between epochs): it used to, mid-epoch, for an int64 array."""
    subset = make([3, 8, 1, 20])
    order = SubsetOrder(subset, seed=4)
    first = epoch(order, 0)
    subset[:] = make([5, 6, 7, 9])
    assert epoch(order, 0) == first


def test_weighted_with_replacement_follows_the_weights_and_never_draws_a_zero() -> None:
    weights = np.array([1.0, 0.0, 3.0, 6.0])
    draws = epoch(WeightedOrder(weights, 30_000, True, seed=5), 0)
    counts = Counter(draws)
    assert 1 not in counts
    for index, weight in enumerate(weights):
        assert abs(counts[index] / 30_000 - weight / 10) < 0.015


def test_weighted_without_replacement_is_successive_sampling() -> None:
    weights = np.array([4.0, 0.0, 1.0, 3.0, 2.0])
    firsts = Counter()
    for e in range(4000):
        draws = epoch(WeightedOrder(weights, 4, False, seed=6), e)
        assert len(set(draws)) == 4 and 1 not in draws
        firsts[draws[0]] += 1
    for index, weight in enumerate(weights):  # the first draw is proportional to the weights
        assert abs(firsts[index] / 4000 - weight / 10) < 0.03
    with pytest.raises(ValueError, match="num_samples=5 without replacement from 4"):
        WeightedOrder(weights, 5, False, seed=0)


def test_fingerprints_change_with_the_data_but_carry_no_array() -> None:
    a = WeightedOrder(np.ones(1000), 10, True, 0).fingerprint
    b = WeightedOrder(np.r_[np.ones(999), 2.0], 10, True, 0).fingerprint
    assert a != b and len(a) < 120
    assert SubsetOrder([1, 2], 0).fingerprint != SubsetOrder([2, 1], 0).fingerprint


@pytest.mark.parametrize(
    ("weights", "match"),
    [([1.0, -1.0], r"weights\[1\]=-1.0"), ([np.nan], "finite"), ([0.0, 0.0], "all be zero"),
     ([[1.0]], "1-d"), ([], "non-empty")],
)
def test_bad_weights_are_refused_with_the_value(weights, match) -> None:
    with pytest.raises(ValueError, match=match):
        check_weights(weights)
    with pytest.raises(ValueError, match="got 2, expected 3"):
        check_weights([1.0, 2.0], 3)
