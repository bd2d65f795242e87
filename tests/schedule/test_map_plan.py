from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_loaders.schedule.map_plan import EpochPlan, rollover_span

plans = st.builds(
    lambda n, bs, w, policy, start_frac: (n, bs, w, policy, int(start_frac * n)),
    st.integers(1, 200), st.integers(1, 9), st.integers(1, 6),
    st.sampled_from(["keep", "drop", "pad"]), st.floats(0, 1),
)


def _make(n: int, bs: int, w: int, policy: str, start: int) -> EpochPlan | None:
    try:
        return EpochPlan(start, n, bs, w, policy)  # type: ignore[arg-type]
    except ValueError:
        return None


@settings(max_examples=400, deadline=None)
@given(plans)
def test_every_rank_gets_the_same_number_of_non_empty_batches(args) -> None:
    plan = _make(*args)
    if plan is None:
        return
    for batch in range(plan.num_batches):
        sizes = [len(plan.positions(batch, r)) for r in range(plan.world_size)]
        assert min(sizes) >= 1 and max(sizes) <= plan.batch_size
        assert max(sizes) - min(sizes) <= 1


@settings(max_examples=400, deadline=None)
@given(plans)
def test_coverage_matches_the_policy(args) -> None:
    plan = _make(*args)
    if plan is None:
        return
    n, start = plan.stop, plan.start
    seen = Counter(
        int(p) for b in range(plan.num_batches) for r in range(plan.world_size)
        for p in plan.positions(b, r)
    )
    remaining = set(range(start, n))
    if plan.last_batch == "keep":
        assert set(seen) == remaining and max(seen.values(), default=1) == 1
    elif plan.last_batch == "drop":
        g = plan.global_batch_size
        assert max(seen.values(), default=1) == 1 and set(seen) <= remaining
        assert len(seen) == (n - start) // g * g
    else:
        assert remaining <= set(seen)
        assert sum(seen.values()) == plan.num_batches * plan.global_batch_size


@settings(max_examples=300, deadline=None)
@given(plans, st.integers(0, 5))
def test_even_positions_are_positions_a_block_at_a_time(args, first) -> None:
    plan = _make(*args)
    if plan is None:
        return
    even = plan.even_batches
    assert 0 <= even <= plan.num_batches <= even + 2
    for rank in range(plan.world_size):
        block = plan.even_positions(min(first, even), even, rank)
        assert block.shape == (even - min(first, even), plan.batch_size)
        for row, batch in enumerate(range(min(first, even), even)):
            assert block[row].tolist() == plan.positions(batch, rank).tolist()
    with pytest.raises(IndexError):
        plan.even_positions(0, even + 1, 0)


@settings(max_examples=300, deadline=None)
@given(plans)
def test_consumed_positions_are_a_prefix(args) -> None:
    """After b global batches exactly [start, consumed(b)) was read: elastic resume's basis."""
    plan = _make(*args)
    if plan is None or plan.last_batch == "pad":
        return
    read: set[int] = set()
    for b in range(plan.num_batches):
        read |= {int(p) for r in range(plan.world_size) for p in plan.positions(b, r)}
        assert read == set(range(plan.start, plan.consumed(b + 1))) or plan.last_batch == "drop"
        if plan.last_batch == "drop":
            assert read == set(range(plan.start, plan.start + (b + 1) * plan.global_batch_size))


def test_keep_rebalances_a_tail_shorter_than_the_world() -> None:
    plan = EpochPlan(0, 17, 4, 4, "keep")  # 16 + 1: one leftover for four ranks
    assert plan.num_batches == 2
    assert [len(plan.positions(1, r)) for r in range(4)] == [1, 1, 1, 1]
    assert [len(plan.positions(0, r)) for r in range(4)] == [4, 3, 3, 3]


def test_keep_refuses_what_would_need_an_empty_batch() -> None:
    with pytest.raises(ValueError, match="pad"):
        EpochPlan(0, 3, 1, 2, "keep")
    with pytest.raises(ValueError, match="non-empty"):
        EpochPlan(0, 3, 4, 4, "keep")


def test_pad_wraps_to_the_start_of_the_epoch() -> None:
    plan = EpochPlan(0, 5, 2, 2, "pad")
    assert plan.positions(1, 0).tolist() == [4, 0]
    assert plan.positions(1, 1).tolist() == [1, 2]


@given(st.integers(1, 100), st.integers(1, 30))
def test_rollover_epochs_tile_the_stream(n: int, g: int) -> None:
    spans = [rollover_span(e, n, g) for e in range(6)]
    assert spans[0][0] == 0
    for (_, stop), (start, _) in zip(spans, spans[1:], strict=False):
        assert stop == start
    for start, stop in spans:
        assert start % g == 0 and stop % g == 0
    assert all(abs((stop - start) - n) < g for start, stop in spans)


@given(st.integers(1, 100), st.integers(1, 30), st.integers(1, 30), st.integers(0, 3))
def test_rollover_epochs_cut_anew_from_an_origin_tile_the_rest_of_the_stream(
        n: int, g: int, other: int, ended: int) -> None:
    """A resume at the end of epoch ``ended`` under another global batch size cuts the stream
    anew from where that epoch ended: its leftovers open the next epoch whole."""
    origin = (ended + 1, rollover_span(ended, n, g)[1])
    spans = [rollover_span(e, n, other, origin) for e in range(ended + 1, ended + 6)]
    assert spans[0][0] == origin[1]
    for (_, stop), (start, _) in zip(spans, spans[1:], strict=False):
        assert stop == start
    for epoch, (start, stop) in enumerate(spans, ended + 1):
        assert (start - origin[1]) % other == 0 and (stop - origin[1]) % other == 0
        assert (epoch + 1) * n - other < stop <= (epoch + 1) * n
    assert rollover_span(3, n, g, (0, 0)) == rollover_span(3, n, g)
