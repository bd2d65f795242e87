"""Epoch ownership shared by every schedule (``EpochOwner``)."""

import pytest

from lightning_loaders import ResumableLoader
from lightning_loaders.orders.base import SequentialOrder
from lightning_loaders.schedule.epochs import following_epoch, trainer_moved_on
from lightning_loaders.schedule.map_schedule import MapSchedule


@pytest.mark.parametrize(("current", "trainer", "owner", "expected"), [
    (None, None, None, 0),   # a fresh loader starts at 0
    (None, 3, None, 3),      # ... or at the trainer's epoch
    (2, 2, 2, 3),            # finished epoch 2 under trainer epoch 2: the next one
    (2, 1, 2, 3),            # a stale (earlier) trainer epoch is ignored (#21938)
    (2, 5, 2, 5),            # the trainer moved on: its epoch
    (0, 3, None, 3),         # set_epoch first called after an epoch read without it
    (2, 1, None, 1),         # ... chooses its epoch, as for a DataLoader's sampler
    (0, 0, None, 0),         # ... also the one read (a batch looked at before fit)
])
def test_the_following_epoch(current, trainer, owner, expected) -> None:
    assert following_epoch(current, trainer, owner) == expected


def test_the_trainer_moved_on_only_past_the_owner() -> None:
    assert trainer_moved_on(3, 2, 2) and not trainer_moved_on(2, 2, 2)
    assert not trainer_moved_on(None, 2, 2) and not trainer_moved_on(3, None, None)


def test_without_an_owner_the_trainer_moved_on_past_the_current_epoch() -> None:
    """An epoch begun under no ``set_epoch``: the first one declared later than it wins, as
    ``sampler.set_epoch(3)`` chooses epoch 3's order for a ``DataLoader``."""
    assert trainer_moved_on(3, None, 0) and not trainer_moved_on(0, None, 0)
    loader = ResumableLoader(list(range(12)), batch_size=4, shuffle=True, seed=1)
    orders = [[b.tolist() for b in loader] for _ in range(4)]
    fresh = ResumableLoader(list(range(12)), batch_size=4, shuffle=True, seed=1)
    assert [b.tolist() for b in fresh] == orders[0]
    fresh.set_epoch(3)
    assert [b.tolist() for b in fresh] == orders[3]


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
