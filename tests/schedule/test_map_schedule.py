"""MapSchedule's requests: the plan read a block at a time equals the plan read batch by batch."""

import re
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch

from lightning_loaders import DynamicWeightedSampler, Mix, ResumableLoader
from lightning_loaders.errors import StateMismatchError
from lightning_loaders.orders.base import ShuffledOrder
from lightning_loaders.orders.drawn import DrawnBatchOrder
from lightning_loaders.schedule.map_schedule import MapSchedule
from lightning_loaders.testing import checkpoint_roundtrip
from tests.buckets import LengthBuckets, sampler_epochs


def _expected(schedule: MapSchedule) -> list[tuple[int, list[int], list[int], list[int]]]:
    """(batch, sample epochs, positions, indices) of every remaining batch, one by one."""
    plan, epoch, rank = schedule.plan, schedule.epoch, schedule.placement[0]
    assert plan is not None and epoch is not None
    n = schedule.dataset_len
    rows = []
    for batch in range(schedule.batches, plan.num_batches):
        stream = plan.positions(batch, rank)
        epochs, positions = ((stream // n, stream % n) if schedule.last_batch == "rollover"
                             else (np.full_like(stream, epoch), stream))
        indices = [int(schedule.order.indices(int(e), np.array([p]))[0])
                   for e, p in zip(epochs, positions, strict=True)]
        rows.append((batch, epochs.tolist(), positions.tolist(), indices))
    return rows


@pytest.mark.parametrize("world_size", [1, 3])
@pytest.mark.parametrize("last_batch", ["keep", "drop", "pad", "rollover"])
def test_requests_from_any_cursor_follow_the_plan(monkeypatch, last_batch: str,
                                                  world_size: int) -> None:
    # blocks of 2 batches
    monkeypatch.setattr("lightning_loaders.schedule.map_schedule._BLOCK_SAMPLES", 8)
    for epoch in range(3):
        for rank in range(world_size):
            schedule = MapSchedule(ShuffledOrder(101, seed=3), 4, last_batch, seed=3, rank=rank,
                                   world_size=world_size)
            schedule.set_epoch(epoch)
            schedule.begin_epoch()
            while schedule.remaining:
                got = [(r.batch, r.sample_epochs.tolist(), r.positions.tolist(),
                        r.indices.tolist()) for r in schedule.requests()]
                assert got == _expected(schedule)
                assert all(r.epoch == epoch and r.rank == rank for r in schedule.requests())
                schedule.delivered()


def _mixed() -> tuple[Any, Callable[[], None]]:
    mix = Mix([list(range(40)), list(range(100, 140))], [1, 1], samples_per_epoch=64,
              batch_size=4)
    return ResumableLoader(mix, batch_size=4, seed=1), lambda: mix.set_weights([0, 1])


def _reweighted() -> tuple[Any, Callable[[], None]]:
    sampler = DynamicWeightedSampler(torch.ones(10))
    loader = ResumableLoader(list(range(10)), batch_size=2, sampler=sampler)
    return loader, lambda: sampler.set_weights(torch.tensor([1.0] + [0.0] * 9))


@pytest.mark.parametrize("make", [_mixed, _reweighted], ids=["Mix", "DynamicWeightedSampler"])
def test_a_restored_state_saved_again_before_its_first_batch_keeps_new_weights(make) -> None:
    """Weights changed between ``load_state_dict()`` and the first batch (a curriculum callback,
    then a checkpoint before training goes on) are in the state saved then, as the live loader
    uses them: it returned the loaded state as it was, and resumed on the old weights."""
    first, _ = make()
    batches = iter(first)
    for _ in range(3):
        next(batches)
    saved = checkpoint_roundtrip(first.state_dict())
    live, reweight = make()
    live.load_state_dict(saved)
    reweight()
    again = checkpoint_roundtrip(live.state_dict())
    resumed, _ = make()
    resumed.load_state_dict(again)
    assert [b.tolist() for b in resumed] == [b.tolist() for b in live]


@pytest.mark.parametrize("make", [_mixed, _reweighted], ids=["Mix", "DynamicWeightedSampler"])
@pytest.mark.parametrize("part", [None, [1], "x"])
def test_an_order_state_that_is_not_a_dict_is_refused_at_load(make, part: Any) -> None:
    """parts['order']=None raised AttributeError from the order's load_state_dict."""
    saved, _ = make()
    batches = iter(saved)
    next(batches)
    state = saved.state_dict()
    state["parts"]["order"] = part
    loader, _ = make()
    with pytest.raises(StateMismatchError, match=rf"corrupted loader state: parts\['order'\]="
                                                 rf"{re.escape(repr(part))} is not a dict"):
        loader.load_state_dict(state)
    assert loader.state_dict()["batches"] == 0, "a refused state changes nothing"


def test_len_is_the_epoch_a_trainer_is_about_to_declare() -> None:
    """Lightning reads ``len()`` before ``set_epoch``: a fresh schedule, a finished epoch and a
    state restored at its epoch's end all answer for the epoch it is about to declare."""
    counts = [len(epoch) for epoch in sampler_epochs(37, 4)]
    assert len(set(counts)) > 1

    def schedule() -> MapSchedule:
        order = DrawnBatchOrder(LengthBuckets(37), seed=0)
        return MapSchedule(order, order.batch_size, "keep", seed=0, rank=0, world_size=1)

    fresh = schedule()
    assert [fresh.num_batches(upcoming=e) for e in range(4)] == counts
    read = schedule()
    read.set_epoch(1)
    read.begin_epoch()
    while read.remaining:
        assert read.num_batches() == counts[1]
        read.delivered()
    assert (read.num_batches(), read.num_batches(upcoming=3)) == (counts[2], counts[3])
    restored = schedule()
    restored.load_state_dict(checkpoint_roundtrip(read.state_dict()))
    assert restored.num_batches() == counts[2]
    assert restored.num_batches(upcoming=3) == counts[3]
