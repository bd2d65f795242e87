"""Canonical partitions: where the shards declared empty are read (to check they are), and
what a refused deal of the epoch's rest says."""

import re
from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_loaders.schedule.partition_plan import advanced, deal, partition_epoch
from lightning_loaders.schedule.shard_plan import PlanConfig


@settings(max_examples=200, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=8).filter(lambda ls: 0 in ls and any(ls)),
       st.integers(1, 5), st.integers(1, 4), st.sampled_from(["keep", "drop", "pad"]),
       st.booleans(), st.integers(0, 3))
def test_each_shard_declared_empty_is_an_empty_piece_of_one_partition_read(
        lengths, partitions, size, policy, shuffle, epoch) -> None:
    """A shard declared empty that is not would lose its samples in silence: the partition
    reader opens its empty piece to check. The last partition read holds those at the end of
    the order, and under ``"drop"`` those past what the epoch reads."""
    config = PlanConfig(tuple(lengths), len(lengths), False, size, policy, shuffle, 1)
    plan = partition_epoch(config, epoch, partitions)
    if not plan.items:
        return
    empty = Counter(piece.shard for pieces, length in zip(plan.pieces, plan.lengths, strict=True)
                    if length for piece in pieces if piece.start == piece.stop)
    assert empty == {shard: 1 for shard, n in enumerate(lengths) if n == 0}
    assert [sum(map(len, pieces)) for pieces in plan.pieces] == list(plan.lengths)


def _deals(config: PlanConfig, partitions: int, world: int, first: int = 0, skip: int = 0
           ) -> bool:
    try:
        deal(config, 0, partitions, world, first, skip)
    except ValueError:
        return False
    return True


@settings(max_examples=300, deadline=None)
@given(st.lists(st.integers(0, 9), min_size=1, max_size=6).filter(any), st.integers(1, 4),
       st.integers(1, 3), st.booleans(), st.integers(1, 4), st.integers(1, 8),
       st.integers(1, 12))
def test_a_refused_resume_names_the_samples_left_and_exactly_the_world_sizes_that_deal_them(
        lengths, partitions, size, merged, saved, steps, world) -> None:
    """An elastic resume that ``"keep"`` cannot deal names the samples left (not the few
    that its last round would hold) and the world sizes that deal both them and the next
    epoch: 18 samples in batches of 1, 2 read on 2 ranks, left 16 that 3 ranks could not
    deal and 2 could, where the message said 'the 1 samples left' and 'at most 1 ranks'."""
    config = PlanConfig(tuple(lengths), len(lengths), False, size, "keep", True, 1,
                        merge_short_tail=merged)
    if not _deals(config, partitions, saved):
        return
    dealt = deal(config, 0, partitions, saved)
    read = sum(s[2] for batches in dealt for batch in batches[:steps] for s in batch)
    first, skip = advanced(config, 0, partitions, 0, 0, read)
    left = sum(lengths) - read
    if not first or _deals(config, partitions, world, first, skip):
        return
    with pytest.raises(ValueError) as refused:
        deal(config, 0, partitions, world, first, skip)
    message = str(refused.value)
    assert re.search(rf"from the {left} samples? left( \(.*\))? with batch_size={size};",
                     message), message
    named = re.search(r"resume on (at most (\d+) ranks?|a world size dividing .*\(([\d, or]+) "
                      r"ranks?\)), or from a checkpoint at an epoch's end$", message)
    assert named, message
    sizes = (set(range(1, int(named[2]) + 1)) if named[2] else
             {int(n) for n in re.findall(r"\d+", named[3])})
    works = {n for n in range(1, left + 3)
             if _deals(config, partitions, n, first, skip) and _deals(config, partitions, n)}
    assert sizes == works, message
    assert not re.search(r"\b1 (ranks|samples)\b", message), message


def test_eighteen_samples_in_batches_of_one_read_two_then_refused_on_three_ranks() -> None:
    """The reviewer's case: 16 of 18 samples left, 3 ranks refused, 1 or 2 named."""
    config = PlanConfig((7, 11), 2, False, 1, "keep", True, 1)
    first, skip = advanced(config, 0, 2, 0, 0, 2)
    with pytest.raises(ValueError, match=re.escape(
            "from the 16 samples left (5 full rounds of 3 batches leave 1) with batch_size=1; "
            "resume on a world size dividing both the 16 samples left and the epoch's 18 (1 "
            "or 2 ranks), or from a checkpoint at an epoch's end")):
        deal(config, 0, 2, 3, first, skip)


@pytest.mark.parametrize(("size", "merged", "ranks"), [
    (1, False, "a world size dividing the epoch's 3 (1 or 3 ranks)"),
    (1, True, "at most 3 ranks"), (2, False, "at most 3 ranks"), (2, True, "at most 3 ranks")])
def test_an_epoch_with_fewer_samples_than_ranks_is_refused_with_fixes_that_work(
        size: int, merged: bool, ranks: str) -> None:
    """3 samples on 4 ranks: the refusal suggested 'drop' (which keeps no batch), a
    batch_size >= 2 (or one leaving a sample per rank) and evaluation=True (refused with the
    same advice), none of which deals them; it names 'pad' and the world sizes that do."""
    config = PlanConfig((3,), 1, False, size, "keep", True, 1, merge_short_tail=merged)
    fix = f"evaluate on {ranks}" if merged else f"use last_batch='pad', or {ranks}"
    with pytest.raises(ValueError, match=re.escape(
            f"from the epoch's 3 samples with batch_size={size}; {fix}") + "$") as refused:
        deal(config, 0, 1, 4)
    assert not re.search("drop|evaluation|batch_size (>=|that)", str(refused.value))
    for other in (PlanConfig((3,), 1, False, size, "drop", True, 1),
                  PlanConfig((3,), 1, False, 2, "keep", True, 1),
                  PlanConfig((3,), 1, False, size, "keep", True, 1, merge_short_tail=True)):
        assert not _deals(other, 1, 4)
    assert _deals(PlanConfig((3,), 1, False, size, "pad", True, 1), 1, 4)
    named = {1, 3} if ranks.endswith("(1 or 3 ranks)") else {1, 2, 3}
    assert {world for world in range(1, 5) if _deals(config, 1, world)} == named


def test_an_epoch_of_one_sample_batches_is_refused_with_the_world_sizes_that_deal_it() -> None:
    """18 samples in batches of 1 on 4 ranks: 4 full rounds leave 2, fewer than the ranks;
    the refusal names the world sizes dividing 18 beside the other fixes, and each deals."""
    config = PlanConfig((7, 11), 2, False, 1, "keep", True, 1)
    with pytest.raises(ValueError, match=re.escape(
            "from the epoch's 18 samples (4 full rounds of 4 batches leave 2) with "
            "batch_size=1; use last_batch='pad' or 'drop', a batch_size >= 2, evaluation=True, "
            "or a world size dividing the epoch's 18 (1, 2, 3, 6, 9 or 18 ranks)") + "$"):
        deal(config, 0, 2, 4)
    assert {world for world in range(1, 20) if _deals(config, 2, world)} == {1, 2, 3, 6, 9, 18}
