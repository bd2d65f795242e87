"""BoundaryPlan: a batch sampler's batches of different sizes dealt whole over the ranks."""

from collections import Counter

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_loaders.schedule.boundary_plan import BoundaryPlan


def bounds_of(sizes: list[int]) -> np.ndarray:
    return np.concatenate(([0], np.cumsum(sizes))).astype(np.int64)


plans = st.builds(
    lambda sizes, w, policy, first_frac: (sizes, w, policy, int(first_frac * len(sizes))),
    st.lists(st.integers(1, 6), min_size=1, max_size=30), st.integers(1, 5),
    st.sampled_from(["keep", "drop", "pad"]), st.floats(0, 1),
)


def _make(sizes: list[int], w: int, policy: str, first: int) -> BoundaryPlan | None:
    try:
        return BoundaryPlan(bounds_of(sizes), first, w, policy)  # type: ignore[arg-type]
    except ValueError:
        return None


def _batch(plan: BoundaryPlan, index: int) -> list[int]:
    return list(range(int(plan.bounds[index]), int(plan.bounds[index + 1])))


@settings(max_examples=400, deadline=None)
@given(plans)
def test_every_rank_gets_the_same_number_of_non_empty_batches(args) -> None:
    plan = _make(*args)
    if plan is None:
        return
    for batch in range(plan.num_batches):
        assert min(len(plan.positions(batch, r)) for r in range(plan.world_size)) >= 1


@settings(max_examples=400, deadline=None)
@given(plans)
def test_whole_global_batches_are_the_samplers_batches_in_order(args) -> None:
    plan = _make(*args)
    if plan is None:
        return
    sizes, w, _, first = args
    full = (len(sizes) - first) // w
    for g in range(min(full, plan.num_batches)):
        for r in range(w):
            got = plan.positions(g, r).tolist()
            own = _batch(plan, first + g * w + r)
            assert got[:len(own)] == own and len(got) - len(own) in (0, 1)


@settings(max_examples=400, deadline=None)
@given(plans)
def test_coverage_matches_the_policy(args) -> None:
    plan = _make(*args)
    if plan is None:
        return
    sizes, w, policy, first = args
    seen = Counter(int(p) for b in range(plan.num_batches) for r in range(w)
                   for p in plan.positions(b, r))
    remaining = set(range(plan.start, plan.stop))
    if policy == "keep":
        assert set(seen) == remaining and max(seen.values(), default=1) == 1
    elif policy == "drop":
        assert max(seen.values(), default=1) == 1
        assert set(seen) == set(range(plan.start, int(plan.bounds[first + plan.num_batches * w])))
    else:
        assert remaining <= set(seen)
        rest = (len(sizes) - first) % w
        padding = [_batch(plan, i % len(sizes)) for i in range(w - rest)] if rest else []
        if rest:
            assert [plan.positions(plan.num_batches - 1, r).tolist()
                    for r in range(rest, w)] == padding


@settings(max_examples=300, deadline=None)
@given(plans)
def test_consumed_positions_are_a_prefix_at_a_batch_boundary(args) -> None:
    plan = _make(*args)
    if plan is None:
        return
    for g in range(plan.num_batches + 1):
        read = {int(p) for b in range(g) for r in range(plan.world_size)
                for p in plan.positions(b, r) if p >= plan.start}
        consumed = plan.consumed(g)
        assert consumed in plan.bounds
        if plan.last_batch == "keep" or g < plan.num_batches:
            assert read == set(range(plan.start, consumed))


@settings(max_examples=300, deadline=None)
@given(plans, st.integers(1, 5))
def test_the_rest_from_any_cursor_on_another_world_size_is_read_exactly_once(args, w2) -> None:
    plan = _make(*args)
    if plan is None or plan.last_batch != "keep":
        return
    for g in range(plan.num_batches + 1):
        position = plan.consumed(g)
        try:
            rest = BoundaryPlan.from_position(plan.bounds, position, w2)
        except ValueError:  # fewer samples left than ranks, nothing to join
            continue
        read = Counter(int(p) for b in range(g) for r in range(plan.world_size)
                       for p in plan.positions(b, r))
        read.update(int(p) for b in range(rest.num_batches) for r in range(w2)
                    for p in rest.positions(b, r))
        assert read == Counter(range(plan.start, plan.stop))


def test_one_rank_reads_every_batch_as_it_is() -> None:
    sizes = [3, 1, 4, 1, 5]
    plan = BoundaryPlan(bounds_of(sizes), 0, 1)
    assert plan.num_batches == 5 and plan.even_batches == 0
    assert [plan.positions(b, 0).tolist() for b in range(5)] == [
        _batch(plan, b) for b in range(5)]


def test_the_tail_is_split_dropped_or_padded() -> None:
    sizes = [2, 3, 1, 4, 2, 3, 5]  # 3 whole global batches of 2, then [5]
    keep = BoundaryPlan(bounds_of(sizes), 0, 2, "keep")
    assert keep.num_batches == 4
    assert [keep.positions(3, r).tolist() for r in range(2)] == [[15, 16, 17], [18, 19]]
    drop = BoundaryPlan(bounds_of(sizes), 0, 2, "drop")
    assert drop.num_batches == 3 and drop.consumed(3) == 20
    pad = BoundaryPlan(bounds_of(sizes), 0, 2, "pad")
    assert [pad.positions(3, r).tolist() for r in range(2)] == [[15, 16, 17, 18, 19], [0, 1]]


def test_a_tail_with_fewer_samples_than_ranks_joins_the_last_global_batch() -> None:
    sizes = [2, 2, 2, 1]  # one whole global batch of 3, then a tail of one sample
    plan = BoundaryPlan(bounds_of(sizes), 0, 3, "keep")
    assert plan.num_batches == 1
    assert [plan.positions(0, r).tolist() for r in range(3)] == [[0, 1, 6], [2, 3], [4, 5]]


def test_keep_refuses_an_epoch_with_fewer_samples_than_ranks() -> None:
    with pytest.raises(ValueError, match=r"2 samples left.*\(in 2 batches\).*or at most 2 ranks"):
        BoundaryPlan(bounds_of([1, 1]), 0, 3, "keep")


def test_a_position_inside_a_batch_is_refused() -> None:
    assert BoundaryPlan.from_position(bounds_of([2, 3]), 2, 1).first == 1
    with pytest.raises(ValueError, match="position 3 is not where one of the epoch's 2"):
        BoundaryPlan.from_position(bounds_of([2, 3]), 3, 1)
