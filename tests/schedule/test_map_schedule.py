"""MapSchedule's requests: the plan read a block at a time equals the plan read batch by batch."""

import numpy as np
import pytest

from lightning_loaders.orders.base import ShuffledOrder
from lightning_loaders.schedule.map_schedule import MapSchedule


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
