"""The plan of an epoch of an iterable dataset: every rank gets the same number of batches,
and the shards are read as the last-batch policy says."""

from collections import Counter

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from lightning_loaders.schedule.shard_plan import (
    PlanConfig,
    delivered_counts,
    plan_epoch,
    shard_order,
)

layouts = st.builds(
    lambda lengths, w, k, b, policy, strided, seed: (lengths, w, k, b, policy, strided, seed),
    st.lists(st.integers(0, 25), min_size=1, max_size=7), st.integers(1, 4), st.integers(1, 3),
    st.integers(1, 5), st.sampled_from(["keep", "drop", "pad"]), st.booleans(),
    st.integers(0, 3),
)


def _config(lengths, batch_size, policy, strided, seed, shuffle=True) -> PlanConfig:
    if strided:
        lengths = [sum(lengths)]
    return PlanConfig(tuple(lengths), len(lengths), strided, batch_size, policy, shuffle, seed)


def _read(piece) -> list[tuple[int, int]]:
    return [(piece.shard, p) for p in range(piece.start, piece.stop, piece.step)]


@settings(max_examples=300, deadline=None)
@given(layouts)
def test_known_lengths_give_every_rank_the_same_batches_and_the_policy_coverage(args) -> None:
    lengths, world, slots, size, policy, strided, seed = args
    config = _config(lengths, size, policy, strided, seed)
    if sum(config.lengths) == 0:
        return
    try:
        layout = plan_epoch(config, 1, world, slots)
    except ValueError:
        return
    assert layout.sizes is not None and layout.num_batches > 0
    read = []
    for rank in range(world):
        rank_sizes = layout.sizes[rank]
        assert sum(len(s) for s in rank_sizes) == layout.num_batches
        for pieces, sizes in zip(layout.pieces[rank], rank_sizes, strict=True):
            slot_read = [position for piece in pieces for position in _read(piece)]
            assert len(slot_read) == sum(sizes)
            assert all(1 <= s <= size for s in sizes)
            if policy != "keep":
                assert all(s == size for s in sizes)
            read += slot_read
    everything = {(shard, p) for shard, n in enumerate(config.lengths) for p in range(n)}
    if policy == "keep":
        assert sorted(read) == sorted(everything)
    elif policy == "drop":
        assert len(read) == len(set(read)) and set(read) <= everything
    else:
        assert set(read) == everything


def test_rollover_epochs_read_the_stream_once_and_carry_leftovers_over() -> None:
    config = _config([7, 23, 4, 15, 11], 4, "rollover", False, 3)
    read: list[tuple[int, int]] = []
    for epoch in range(4):
        layout = plan_epoch(config, epoch, 2, 2)
        for rank in range(2):
            for pieces in layout.pieces[rank]:
                read += [position for piece in pieces for position in _read(piece)]
    # 4 epochs of 60 samples in global batches of 8: 240 samples, each read exactly 4 times.
    assert Counter(read) == {(s, p): 4 for s, n in enumerate([7, 23, 4, 15, 11])
                             for p in range(n)}


def test_unknown_lengths_deal_out_every_shard_once_ranks_first() -> None:
    config = PlanConfig(None, 11, False, 4, "keep", True, 5)
    layout = plan_epoch(config, 2, 3, 2)
    dealt = [[piece.shard for slot in rank for piece in slot] for rank in layout.pieces]
    assert sorted(s for rank in dealt for s in rank) == list(range(11))
    assert sorted(len(rank) for rank in dealt) == [3, 4, 4]
    with pytest.raises(ValueError, match="every rank needs a shard"):
        plan_epoch(config, 0, 12, 1)


def testshard_order_is_seeded_and_reshuffled_every_epoch() -> None:
    config = PlanConfig(None, 20, False, 4, "keep", True, 5)
    orders = [shard_order(config, epoch).tolist() for epoch in range(3)]
    assert all(sorted(order) == list(range(20)) for order in orders)
    assert orders[0] != orders[1] != orders[2]
    assert shard_order(config, 1).tolist() == orders[1]
    other_seed = PlanConfig(None, 20, False, 4, "keep", True, 6)
    assert shard_order(other_seed, 0).tolist() != orders[0]
    unshuffled = PlanConfig(None, 20, False, 4, "keep", False, 5)
    assert shard_order(unshuffled, 3).tolist() == list(range(20))


def testdelivered_counts_follow_the_round_robin_order() -> None:
    batches = [3, 1, 2]
    order = [(k, w) for k in range(3) for w in range(3) if k < batches[w]]
    for delivered in range(len(order) + 1):
        assert delivered_counts(batches, delivered) == [
            sum(1 for _, w in order[:delivered] if w == slot) for slot in range(3)]


def test_rollover_reads_each_shard_declared_empty_once_a_cycle_as_an_empty_piece() -> None:
    """The reader opens an empty piece to check the shard is empty (its samples, if it has
    any, would be lost in silence): each such shard is in one slot per pass, first or last
    of the order too."""
    lengths = [0, 7, 23, 0, 4, 15, 11, 0]
    for shuffle in (False, True):
        config = PlanConfig(tuple(lengths), len(lengths), False, 4, "rollover", shuffle, 3)
        empty: Counter[int] = Counter()
        for epoch in range(4):  # 4 passes over the 60 samples in global batches of 8
            layout = plan_epoch(config, epoch, 2, 2)
            empty.update(piece.shard for rank in layout.pieces for pieces in rank
                         for piece in pieces if piece.start == piece.stop)
        assert empty == {0: 4, 3: 4, 7: 4}
