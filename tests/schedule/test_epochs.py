"""Epoch ownership shared by every schedule (``EpochOwner``)."""

import pytest

from lightning_loaders.orders.base import SequentialOrder
from lightning_loaders.schedule.epochs import following_epoch, trainer_moved_on
from lightning_loaders.schedule.map_schedule import MapSchedule


@pytest.mark.parametrize(("current", "trainer", "owner", "expected"), [
    (None, None, None, 0),   # a fresh loader starts at 0
    (None, 3, None, 3),      # ... or at the trainer's epoch
    (2, 2, 2, 3),            # finished epoch 2 under trainer epoch 2: the next one
    (2, 1, 2, 3),            # a stale (earlier) trainer epoch is ignored (#21938)
    (2, 5, 2, 5),            # the trainer moved on: its epoch
])
def test_the_following_epoch(current, trainer, owner, expected) -> None:
    assert following_epoch(current, trainer, owner) == expected


def test_the_trainer_moved_on_only_past_the_owner() -> None:
    assert trainer_moved_on(3, 2) and not trainer_moved_on(2, 2)
    assert not trainer_moved_on(None, 2) and not trainer_moved_on(3, None)


def test_a_state_that_fails_to_apply_stays_pending_for_a_corrected_retry() -> None:
    saved = MapSchedule(SequentialOrder(10), 2, "rollover", seed=0, rank=0, world_size=2)
    saved.begin_epoch()
    saved.delivered()
    state = saved.state_dict()
    restored = MapSchedule(SequentialOrder(10), 2, "rollover", seed=0, rank=0, world_size=1)
    restored.load_state_dict(state)
    with pytest.raises(ValueError, match="rollover.*another world size"):
        restored.begin_epoch()
    assert restored.state_dict() == state  # still pending: nothing was started
