"""Epoch ownership shared by every schedule (``EpochOwner``)."""

import pytest

from lightning_loaders import ResumableLoader
from lightning_loaders.orders.base import SequentialOrder
from lightning_loaders.schedule.epochs import following_epoch, trainer_moved_on
from lightning_loaders.schedule.map_schedule import MapSchedule
from lightning_loaders.sources.shards import SequenceSource
from lightning_loaders.testing import checkpoint_roundtrip, set_epoch


@pytest.mark.parametrize(("current", "trainer", "owner", "finished", "expected"), [
    (None, None, None, True, 0),  # a fresh loader starts at 0
    (None, 3, None, True, 3),     # ... or at the trainer's epoch
    (2, 2, 2, True, 3),           # finished epoch 2 under trainer epoch 2: the next one
    (2, 1, 2, True, 3),           # a stale (earlier) trainer epoch is ignored (#21938)
    (2, 5, 2, True, 5),           # the trainer moved on: its epoch
    (0, 3, None, True, 3),        # set_epoch first called after an epoch read without it
    (2, 1, None, True, 3),        # ... never goes back
    (0, 0, None, False, 0),       # ... the one left unfinished (a look before fit) starts over
    (0, 0, None, True, 1),        # ... but one read to its end is not read again
    (0, 0, 0, False, 1),          # declared before: a new iter() is the next epoch
])
def test_the_following_epoch(current, trainer, owner, finished, expected) -> None:
    assert following_epoch(current, trainer, owner, finished) == expected


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


def test_an_epoch_read_to_its_end_without_set_epoch_is_not_read_again() -> None:
    """Restored at its end and declared again (a stale ``set_epoch``, #21938), or declared
    after its resumed tail was read: the next epoch comes, not the finished one again."""
    def make() -> ResumableLoader:
        return ResumableLoader(list(range(8)), batch_size=2, shuffle=True, seed=0)

    reference = make()
    orders = [[b.tolist() for b in reference] for _ in range(3)]
    saved = make()
    assert [b.tolist() for b in saved] == orders[0]
    restored = make()
    restored.set_epoch(0)
    restored.load_state_dict(saved.state_dict())
    assert [b.tolist() for b in restored] == orders[1]
    next(iter(saved))  # a batch of epoch 1
    resumed = make()
    resumed.load_state_dict(saved.state_dict())
    resumed.set_epoch(0)
    assert [b.tolist() for b in resumed] == orders[1][1:]
    resumed.set_epoch(1)
    assert [b.tolist() for b in resumed] == orders[2]


@pytest.mark.parametrize("iterable", [False, True])
def test_an_epoch_resumed_from_a_fresh_state_begins_under_the_trainers_epoch(
        iterable: bool) -> None:
    """A fresh loader's state (saved before any batch), restored, then read through epoch 0
    under ``set_epoch(0)``: its state at that epoch's end said no trainer epoch, so restored
    with ``set_epoch(0)`` again (a restart at the epoch's end) it read epoch 1 where the
    loader never restored waits for epoch 1's ``set_epoch``. Both now save epoch 0's owner."""
    def make() -> ResumableLoader:
        data = list(range(10))
        dataset = SequenceSource([data[:5], data[5:]]) if iterable else data
        return ResumableLoader(dataset, batch_size=4, shuffle=True, seed=1)

    def ended_epoch_0(loader: ResumableLoader) -> dict:
        set_epoch(loader, 0)
        assert len(list(loader)) == 3
        return checkpoint_roundtrip(loader.state_dict())

    fresh = make().state_dict()
    twin = make()
    twin.load_state_dict(checkpoint_roundtrip(fresh))
    saved = {"live": ended_epoch_0(make()), "twin": ended_epoch_0(twin)}
    assert saved["twin"]["trainer_epoch"] == saved["live"]["trainer_epoch"] == 0
    for state in saved.values():
        restarted = make()
        restarted.load_state_dict(state)
        set_epoch(restarted, 0)
        assert list(restarted) == []
