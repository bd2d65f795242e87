"""A batch sampler whose batches differ in size (bucketing by length, token budgets), through the
loader: its batches as it makes them, dealt whole over the ranks, resumable at every batch and
on another world size, with a number of batches that may change from epoch to epoch."""

from collections import Counter
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_loaders import ResumableLoader, make_resumable
from lightning_loaders.testing import (
    Snapshot,
    check_resume_at_every_step,
    checkpoint_roundtrip,
    run_epochs,
    set_epoch,
)
from tests import buckets
from tests.buckets import LengthBuckets, dealt, flat, length
from tests.conftest import IndexDataset

N, EPOCHS = 37, 3


def indices(batch: Any) -> list[int]:
    return batch["index"].tolist()


def make(rank: int | None = None, world: int | None = None, **kwargs: Any) -> ResumableLoader:
    return ResumableLoader(IndexDataset(N), batch_sampler=LengthBuckets(N), seed=3, rank=rank,
                           world_size=world, **kwargs)


def sampler_epochs(epochs: int = EPOCHS) -> list[list[list[int]]]:
    return buckets.sampler_epochs(N, epochs)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_one_process_reads_what_a_dataloader_reads(num_workers: int) -> None:
    expected = sampler_epochs()
    assert len({len(batch) for batch in expected[0]}) > 2  # many sizes,
    assert len({len(epoch) for epoch in expected}) > 1  # and epochs of different lengths
    loader = make(num_workers=num_workers)
    lengths = []
    for epoch in range(EPOCHS):
        set_epoch(loader, epoch)
        lengths.append(len(loader))
        assert [indices(batch) for batch in loader] == expected[epoch]
    assert lengths == [len(epoch) for epoch in expected]
    converted = make_resumable(DataLoader(IndexDataset(N), batch_sampler=LengthBuckets(N)))
    assert run_epochs(converted, range(EPOCHS), key=indices) == expected


@pytest.mark.parametrize("options", [{}, {"num_workers": 2}, {"rank": 1, "world": 2},
                                     {"rank": 0, "world": 3, "last_batch": "pad"},
                                     {"rank": 1, "world": 2, "last_batch": "drop"}],
                         ids=["one", "workers", "two-ranks", "three-ranks-pad", "two-drop"])
def test_resume_at_every_step_is_exact(options: dict[str, Any]) -> None:
    check_resume_at_every_step(lambda: make(**options), epochs=EPOCHS, key=indices)


def test_a_state_resumes_under_another_num_workers() -> None:
    snapshots: list[Snapshot] = []
    full = run_epochs(make(num_workers=2), range(EPOCHS), indices, snapshots)
    for snap in snapshots[::5]:
        resumed = make()
        resumed.load_state_dict(checkpoint_roundtrip(snap.state))
        got = flat(run_epochs(resumed, range(snap.epoch + snap.last_of_epoch, EPOCHS), indices))
        assert got == full[snap.epoch][snap.batch:] + flat(full[snap.epoch + 1:])


def ranks_read(world: int, epochs: int = EPOCHS, **kwargs: Any) -> list[list[list[list[int]]]]:
    """Per rank, per epoch, the batches it reads."""
    return [run_epochs(make(r, world, **kwargs), range(epochs), indices) for r in range(world)]


@pytest.mark.parametrize("world", [2, 3, 4])
@pytest.mark.parametrize("last_batch", ["keep", "drop", "pad"])
def test_ranks_read_the_samplers_batches_whole_with_equal_counts(world: int,
                                                                 last_batch: str) -> None:
    expected = sampler_epochs()
    ranks = ranks_read(world, last_batch=last_batch)
    for epoch, batches in enumerate(expected):
        assert [rank[epoch] for rank in ranks] == dealt(batches, world, last_batch)
        assert len({len(rank[epoch]) for rank in ranks}) == 1
        read = Counter(i for rank in ranks for i in flat(rank[epoch]))
        if last_batch == "keep":
            assert read == Counter(range(N))
        else:
            assert max(read.values()) == 1 if last_batch == "drop" else set(read) == set(range(N))


def test_evaluation_reads_every_sample_once_with_equal_counts() -> None:
    ranks = ranks_read(4, epochs=1, evaluation=True)
    assert len({len(rank[0]) for rank in ranks}) == 1
    assert Counter(i for rank in ranks for batch in rank[0] for i in batch) == Counter(range(N))


def _rest(loaders: list[ResumableLoader], epochs: range) -> list[list[list[list[int]]]]:
    return [run_epochs(loader, epochs, indices) for loader in loaders]


def test_a_two_rank_state_resumes_on_one_rank_from_the_first_unread_batch() -> None:
    expected = sampler_epochs()
    snapshots: list[Snapshot] = []
    run_epochs(make(0, 2), range(EPOCHS), indices, snapshots)
    for snap in snapshots:
        resumed = make(0, 1)
        resumed.load_state_dict(checkpoint_roundtrip(snap.state))
        first = snap.epoch + snap.last_of_epoch
        got = run_epochs(resumed, range(first, EPOCHS), indices)
        rest = [] if snap.last_of_epoch else [expected[snap.epoch][2 * snap.batch:]]
        assert got == rest + expected[snap.epoch + 1:], (snap.epoch, snap.batch)


@pytest.mark.filterwarnings("ignore:elastic resume from world size 1 to 2")
def test_a_one_rank_state_resumes_on_two_ranks_dealing_the_rest() -> None:
    expected = sampler_epochs()
    fresh = ranks_read(2)
    snapshots: list[Snapshot] = []
    run_epochs(make(0, 1), range(EPOCHS), indices, snapshots)
    for snap in snapshots:
        state = checkpoint_roundtrip(snap.state)
        loaders = [make(r, 2) for r in range(2)]
        for loader in loaders:
            loader.load_state_dict(state)
        first = snap.epoch + snap.last_of_epoch
        if len(flat(expected[snap.epoch][snap.batch:])) == 1:  # one sample for two ranks
            with pytest.raises(ValueError, match="the 1 samples left.*or at most 1 rank$"):
                next(iter(loaders[0]))
            continue
        ranks = _rest(loaders, range(first, EPOCHS))
        assert [rank[1:] if not snap.last_of_epoch else rank for rank in ranks] == [
            rank[snap.epoch + 1:] for rank in fresh]
        if snap.last_of_epoch:
            continue
        rest = expected[snap.epoch][snap.batch:]
        assert [rank[0] for rank in ranks] == dealt(rest, 2), (snap.epoch, snap.batch)
        assert Counter(i for rank in ranks for i in flat(rank[0])) == Counter(flat(rest))


def test_len_follows_the_epoch_in_view() -> None:
    """The epoch being read, else the one about to start: after ``set_epoch``, after an epoch's
    end, after a restored state (mid-epoch: its epoch; at its end: the next)."""
    expected = sampler_epochs(EPOCHS + 1)
    loader = make()
    assert len(loader) == len(expected[0])
    states = []
    for epoch in range(EPOCHS):
        set_epoch(loader, epoch)
        assert len(loader) == len(expected[epoch])
        batches = iter(loader)
        next(batches)
        states.append(loader.state_dict())
        assert len(loader) == len(expected[epoch])
        assert len(loader.sampler) == N
        list(batches)
        assert len(loader) == len(expected[epoch + 1])
    for epoch, state in enumerate([*states, loader.state_dict()]):
        resumed = make()
        resumed.load_state_dict(state)
        assert len(resumed) == len(expected[epoch]), epoch


class _Shrinking(LengthBuckets):
    """Leaves out the last ``epoch % 3`` samples of its permutation: epochs differ in indices."""

    def __iter__(self):
        kept = self.n - self.epoch % 3
        return iter([[i for i in batch if i < kept] for batch in super().__iter__()
                     if any(i < kept for i in batch)])


def test_epochs_with_different_numbers_of_indices_are_read_whole() -> None:
    def shrinking(rank: int = 0, world: int = 1) -> ResumableLoader:
        return ResumableLoader(IndexDataset(N), batch_sampler=_Shrinking(N), seed=3, rank=rank,
                               world_size=world)

    full = check_resume_at_every_step(shrinking, epochs=EPOCHS, key=indices)
    assert [sorted(flat(epoch)) for epoch in full] == [list(range(N - e % 3))
                                                        for e in range(EPOCHS)]
    ranks = [run_epochs(shrinking(r, 2), range(EPOCHS), indices) for r in range(2)]
    for epoch in range(EPOCHS):
        assert sorted(i for rank in ranks for i in flat(rank[epoch])) == list(
            range(N - epoch % 3))


def _refused(make_loader: Callable[[], ResumableLoader], match: str) -> None:
    with pytest.raises(ValueError, match=match):
        run_epochs(make_loader(), range(1))


def test_what_cannot_be_planned_is_refused_with_the_fix() -> None:
    _refused(lambda: make(last_batch="rollover"),
             "'rollover' needs batches of one size.*use last_batch='keep', 'drop' or 'pad'")
    _refused(lambda: make_resumable(DataLoader(IndexDataset(N), batch_sampler=LengthBuckets(N)),
                                    batch_size=4),
             "batch_size=4 would cut anew the batch sampler's batches.*leave batch_size out")
    _refused(lambda: ResumableLoader(IndexDataset(3), batch_sampler=[[0], [1, 2]], rank=0,
                                     world_size=4),
             "'keep' cannot give each of 4 ranks.*the 3 samples.*'pad', or at most 3 ranks")
    _refused(lambda: ResumableLoader(IndexDataset(3), batch_sampler=[[0], [1, 2]], rank=0,
                                     world_size=4, last_batch="drop"),
             "'drop' leaves no batch: epoch 0 of the batch sampler has 2 batches")


class _StatefulBudget(torch.utils.data.Sampler[list[int]]):
    """Token budgets drawn from its own numpy generator, with ``state_dict``: each draw moves
    the generator on, so an epoch depends on the draws before it."""

    def __init__(self) -> None:
        self.rng = np.random.default_rng(0)

    def __iter__(self):
        budget = int(self.rng.integers(6, 14))
        batches, batch, tokens = [], [], 0
        for i in self.rng.permutation(N).tolist():
            if batch and tokens + length(i) > budget:
                batches.append(batch)
                batch, tokens = [], 0
            batch.append(i)
            tokens += length(i)
        return iter([*batches, batch])

    def state_dict(self) -> dict:
        return {"rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.rng.bit_generator.state = state["rng"]


@pytest.mark.parametrize("world", [1, 2])
def test_a_stateful_batch_samplers_own_state_resumes_with_the_cursor(world: int) -> None:
    def stateful() -> ResumableLoader:
        return ResumableLoader(IndexDataset(N), batch_sampler=_StatefulBudget(), seed=3,
                               rank=world - 1, world_size=world)

    full = check_resume_at_every_step(stateful, epochs=EPOCHS, key=indices)
    assert len({len(epoch) for epoch in full}) > 1
