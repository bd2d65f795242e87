import re
from collections import Counter
from itertools import product

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


def _deals(start: int, n: int, size: int, world: int, merged: bool = False,
           policy: str = "keep") -> bool:
    """Whether a plan of ``[start, n)`` is accepted and has a batch (what a loader needs)."""
    try:
        plan = EpochPlan(start, n, size, world, policy, merge_short_tail=merged)  # type: ignore[arg-type]
    except ValueError:
        return False
    return plan.num_batches > 0


def test_a_keep_refusal_names_exactly_the_fixes_that_deal_the_epoch() -> None:
    """3 samples on 4 ranks suggested 'drop' (no batch left) and a batch_size >= 2 (refused
    again), and 3 on 2 ranks in batches of 1 'the 1 samples left after 1 full global batches'
    with no world size. Every refusal (1-24 samples, batches of 1-3, 1-8 ranks, evaluation or
    not, from every start) names the samples, and a fix is named if and only if it deals them:
    'pad', 'drop', a batch_size >= 2, evaluation=True, and the world sizes, each one tried
    (at a resume: those that deal both the rest and the next epoch)."""
    refused = 0
    for n, size, world, merged in product(range(1, 25), (1, 2, 3), range(1, 9), (False, True)):
        for start in range(n):
            try:
                EpochPlan(start, n, size, world, "keep", merge_short_tail=merged)
                continue
            except ValueError as exc:
                message = str(exc)
            refused += 1
            what = f"the {n - start} samples? left" if start else f"the epoch's {n} samples?"
            assert re.search(f"from {what}( \\(.*\\))? with batch_size={size};", message), message
            named = re.search(r"(?:at most (\d+) ranks?|a world size dividing .*\(([\d, or]+) "
                              r"ranks?\))(, or from a checkpoint at an epoch's end)?$", message)
            assert named, message
            sizes = (set(range(1, int(named[1]) + 1)) if named[1] else
                     {int(w) for w in re.findall(r"\d+", named[2])})
            works = {w for w in range(1, n + 3)
                     if _deals(start, n, size, w, merged) and _deals(0, n, size, w, merged)}
            assert sizes == works, message
            assert not re.search(r"\b1 (ranks|samples|full rounds)\b", message), message
            if start:
                assert "; resume on " in message and named[3], message
                assert not re.search("pad|drop|evaluation|batch_size >=", message), message
                continue
            fixes = {"'pad'": not merged and _deals(0, n, size, world, merged, "pad"),  # reads
                     # a sample twice where evaluation reads each once
                     "'drop'": _deals(0, n, size, world, merged, "drop"),
                     "a batch_size >= 2": all(_deals(0, n, other, world, merged)
                                              for other in range(2, n + 2)),
                     "evaluation=True": _deals(0, n, size, world, True)}
            for fix, deals in fixes.items():
                assert (fix in message) == deals, (fix, message)
    assert refused > 500


def test_fewer_samples_than_ranks_or_one_left_name_the_world_sizes_that_deal_them() -> None:
    """The reviewer's cases: 3 samples on 4 ranks (batches of 1 or 2, evaluation) and on 2
    ranks in batches of 1."""
    for size, merged, ranks in ((1, False, "a world size dividing the epoch's 3 (1 or 3 ranks)"),
                                (2, False, "at most 3 ranks"), (1, True, "at most 3 ranks")):
        fix = f"evaluate on {ranks}" if merged else f"use last_batch='pad', or {ranks}"
        with pytest.raises(ValueError, match=re.escape(
                "last_batch='keep' cannot give each of 4 ranks a non-empty last batch from the "
                f"epoch's 3 samples with batch_size={size}; {fix}") + "$"):
            EpochPlan(0, 3, size, 4, "keep", merge_short_tail=merged)
    with pytest.raises(ValueError, match=re.escape(
            "from the epoch's 3 samples (1 full round of 2 batches leaves 1) with batch_size=1; "
            "use last_batch='pad' or 'drop', a batch_size >= 2, evaluation=True, or a world "
            "size dividing the epoch's 3 (1 or 3 ranks)") + "$"):
        EpochPlan(0, 3, 1, 2, "keep")
    with pytest.raises(ValueError, match=re.escape(
            "from the 16 samples left (5 full rounds of 3 batches leave 1) with batch_size=1; "
            "resume on a world size dividing both the 16 samples left and the epoch's 18 (1 "
            "or 2 ranks), or from a checkpoint at an epoch's end") + "$"):
        EpochPlan(2, 18, 1, 3, "keep")


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
