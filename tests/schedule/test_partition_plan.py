"""Canonical partitions: where the shards declared empty are read (to check they are)."""

from collections import Counter

from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_loaders.schedule.partition_plan import partition_epoch
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
