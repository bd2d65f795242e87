import gc
import json
import os
import pickle
import signal
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from lightning_loaders import ResumableLoader, worker_info
from lightning_loaders.errors import SampleFetchError, StateMismatchError, WorkerCrashedError
from lightning_loaders.loaders.convert import make_resumable
from lightning_loaders.loaders.iterable import ResumableIterableLoader
from lightning_loaders.loaders.map_style import MapStyleLoader
from lightning_loaders.sources.shards import (
    GeneratorSource,
    LineFiles,
    RecordFiles,
    SequenceSource,
    write_records,
)
from lightning_loaders.state import abandoned
from lightning_loaders.testing import (
    check_resume_at_every_step,
    checkpoint_roundtrip,
    run_epochs,
    set_epoch,
)
from tests.conftest import IndexDataset, loader_processes
from tests.ddp_harness import REPO, run_ddp
from tests.lightning_harness import check_trainer_resume

LENGTHS = [7, 23, 4, 0, 15, 11]  # uneven, one empty shard
TOTAL = sum(LENGTHS)
SCRIPT = REPO / "tests" / "scripts" / "iterable_fit.py"


def _ids(lengths: list[int]) -> list[list[int]]:
    starts = [sum(lengths[:i]) for i in range(len(lengths))]
    return [list(range(s, s + n)) for s, n in zip(starts, lengths, strict=True)]


def decode(payload: bytes) -> dict[str, torch.Tensor]:
    sample = json.loads(payload)
    return {"index": torch.tensor(sample["id"]), "x": torch.tensor([sample["id"] / 10.0])}


@pytest.fixture(scope="module")
def record_files(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("records")
    paths = []
    for shard, ids in enumerate(_ids(LENGTHS)):
        paths.append(root / f"part{shard}.rec")
        write_records(paths[-1], [json.dumps({"id": i, "pad": "x" * (i % 7)}).encode()
                                  for i in ids])
    return paths


@pytest.fixture(scope="module")
def line_files(tmp_path_factory) -> list[Path]:
    root = tmp_path_factory.mktemp("lines")
    paths = []
    for shard, ids in enumerate(_ids(LENGTHS)):
        paths.append(root / f"part{shard}.txt")
        paths[-1].write_text("".join(f"{i}\n" for i in ids))
    return paths


class Counting(IterableDataset):
    """A plain iterable dataset (no shards): ``0, 1, ..., n - 1``; sized or not."""

    def __init__(self, n: int, sized: bool = True) -> None:
        self.n, self.sized = n, sized
        self.epochs: list[int] = []

    def __iter__(self):
        return iter(range(self.n))

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("unsized")
        return self.n

    def set_epoch(self, epoch: int) -> None:
        self.epochs.append(epoch)


class UnknownLengths(SequenceSource):
    @property
    def shard_lengths(self) -> None:
        return None


def flat(batch) -> list[int]:
    if isinstance(batch, dict):
        batch = batch["index"]
    return batch.tolist() if isinstance(batch, torch.Tensor) else list(batch)


def samples(epoch: list[list[int]]) -> list[int]:
    return sorted(i for batch in epoch for i in batch)


def test_resumable_loader_returns_the_iterable_loader_for_iterable_datasets() -> None:
    for dataset in (SequenceSource([[1, 2, 3]]), Counting(5)):
        loader = ResumableLoader(dataset, batch_size=2, seed=1, shuffle_buffer=0)
        assert type(loader) is ResumableIterableLoader and loader.seed == 1
        assert isinstance(loader, ResumableLoader)
        assert make_resumable(loader) is loader
    map_style = ResumableLoader(IndexDataset(4), batch_size=2)
    assert type(map_style) is MapStyleLoader and isinstance(map_style, ResumableLoader)
    assert [flat(b) for b in ResumableLoader(SequenceSource([[1, 2, 3]]), batch_size=2)] == [
        [1, 2], [3]]


# -- the plan -----------------------------------------------------------------------------------

# -- resume -------------------------------------------------------------------------------------

# (dataset, lengths known, num_workers, options); with workers, bigger batches keep the number
# of snapshots (each resumed loader starts its workers) small.
CASES = {
    "records, known, shuffled": ("records", True, 0, {"shuffle": True}),
    "records, known, 2 workers, buffer": ("records", True, 2, {
        "shuffle": True, "shuffle_buffer": 5, "batch_size": 9}),
    "records, unknown, 2 workers, buffer": ("records", False, 2, {
        "shuffle": True, "shuffle_buffer": 5, "batch_size": 9}),
    "lines, unknown, drop": ("lines", False, 0, {"shuffle": True, "last_batch": "drop"}),
    "sequences, known, pad": ("sequences", True, 0, {"last_batch": "pad"}),
    "sequences, known, rollover": ("sequences", True, 0, {"shuffle": True,
                                                          "last_batch": "rollover"}),
    "plain, sized, 2 workers": ("plain", True, 2, {"batch_size": 9}),
    "plain, unsized, buffer": ("plain", False, 0, {"shuffle": True, "shuffle_buffer": 6}),
}


def _dataset(kind: str, known: bool, record_files, line_files):
    if kind == "records":
        return RecordFiles(record_files, lengths="scan" if known else None, decode=decode)
    if kind == "lines":
        return LineFiles(line_files, lengths="scan" if known else None, decode=int)
    if kind == "sequences":
        return (SequenceSource if known else UnknownLengths)(_ids(LENGTHS))
    return Counting(TOTAL, sized=known)


@pytest.mark.parametrize("case", CASES)
def test_resume_at_every_step_is_exact(case, record_files, line_files) -> None:
    kind, known, workers, options = CASES[case]
    options = {"batch_size": 4, **options}
    size = options["batch_size"]

    def make() -> ResumableIterableLoader:
        return ResumableLoader(_dataset(kind, known, record_files, line_files), seed=11,
                               num_workers=workers, **options)

    full = check_resume_at_every_step(make, epochs=2, key=flat)
    policy = options.get("last_batch", "keep")
    everything = list(range(TOTAL))
    for epoch in full:
        if policy == "keep":
            assert samples(epoch) == everything
        if policy == "drop":
            assert all(len(b) == size for b in epoch) and len(set(samples(epoch))) == len(
                samples(epoch))
        if policy == "pad":
            assert set(samples(epoch)) == set(everything) and all(len(b) == size for b in epoch)
    if policy == "rollover":
        assert sorted(samples(full[0]) + samples(full[1])) == sorted(
            (everything * 2)[:len(samples(full[0]) + samples(full[1]))])
    if options.get("shuffle"):
        assert [i for b in full[0] for i in b] != [i for b in full[1] for i in b]
    loader = make()
    if known and policy != "rollover":
        assert len(loader) == len(full[0]) == len(full[1])
    else:
        with pytest.raises(TypeError):
            len(loader)


def test_stream_does_not_depend_on_prefetching_pinning_or_persistence(record_files) -> None:
    runs = []
    for kwargs in ({"num_workers": 2}, {"num_workers": 2, "prefetch_factor": 1},
                   {"num_workers": 2, "persistent_workers": False, "prefetch_factor": 4}):
        loader = ResumableLoader(RecordFiles(record_files, decode=decode), batch_size=3,
                                 shuffle=True, shuffle_buffer=4, seed=2, **kwargs)
        runs.append(run_epochs(loader, range(2), key=flat))
        loader.close()
    assert runs[0] == runs[1] == runs[2]
    one = ResumableLoader(RecordFiles(record_files, decode=decode), batch_size=3, shuffle=True,
                          seed=2, num_workers=1)
    zero = ResumableLoader(RecordFiles(record_files, decode=decode), batch_size=3, shuffle=True,
                           seed=2, num_workers=0)
    assert run_epochs(one, range(2), key=flat) == run_epochs(zero, range(2), key=flat)
    one.close()


@pytest.mark.parametrize("policy", ["keep", "drop", "pad"])
@pytest.mark.parametrize("plain", [False, True])
def test_ranks_get_equal_batch_counts_and_disjoint_shares(policy, plain) -> None:
    world = 3
    ranks = []
    for rank in range(world):
        dataset = Counting(TOTAL) if plain else SequenceSource(_ids(LENGTHS))
        loader = ResumableLoader(dataset, batch_size=4, shuffle=not plain, seed=4,
                                 last_batch=policy, rank=rank, world_size=world)
        ranks.append(run_epochs(loader, range(2), key=flat))
        assert len(loader) == len(ranks[-1][0]) == len(ranks[-1][1])
    for epoch in range(2):
        assert len({len(r[epoch]) for r in ranks}) == 1
        read = [i for r in ranks for b in r[epoch] for i in b]
        if policy == "keep":
            assert sorted(read) == list(range(TOTAL))
        if policy == "drop":
            assert len(read) == len(set(read)) == len(ranks[0][epoch]) * 4 * world
        if policy == "pad":
            assert set(read) == set(range(TOTAL)) and len(read) == len(ranks[0][epoch]) * 12


def test_evaluation_merges_fewer_leftovers_than_ranks_into_the_first_ranks() -> None:
    sizes = []
    for rank in range(3):
        loader = ResumableLoader(SequenceSource([list(range(10))]), batch_size=1,
                                 evaluation=True, rank=rank, world_size=3)
        sizes.append([len(flat(b)) for b in loader])
    assert sizes == [[1, 1, 2], [1, 1, 1], [1, 1, 1]]
    with pytest.raises(ValueError, match="evaluation=True"):
        len(ResumableLoader(SequenceSource([list(range(10))]), batch_size=1, rank=0,
                            world_size=3))


# -- state and epochs ---------------------------------------------------------------------------


def test_state_is_tiny_with_known_lengths_and_holds_every_slot_without(record_files) -> None:
    known = ResumableLoader(RecordFiles(record_files, lengths="scan", decode=decode),
                            batch_size=4, num_workers=2)
    next(iter(known))
    state = known.state_dict()
    assert "positions" not in state["parts"]["slots"] and len(pickle.dumps(state)) < 1024
    known.close()
    unknown = ResumableLoader(RecordFiles(record_files, decode=decode), batch_size=4,
                              num_workers=2)
    iterator = iter(unknown)
    for _ in range(3):
        next(iterator)
    slots = unknown.state_dict()["parts"]["slots"]["positions"]
    assert len(slots) == 1 and len(slots[0]) == 2
    batches, emitted, _, _, offset, reader_state, exhausted = slots[0][0]
    assert (batches, emitted, exhausted) == (2, 8, False)
    assert reader_state["position"] == offset and reader_state["offset"] > 0
    unknown.close()


def _partial_state(make, batches: int, epoch: int = 0):
    loader = make()
    set_epoch(loader, epoch)
    iterator = iter(loader)
    for _ in range(batches):
        next(iterator)
    state = loader.state_dict()
    loader.close()
    return state


@pytest.mark.parametrize("known", [False, True])
def test_mid_epoch_resume_with_another_configuration_is_refused_with_the_reason(known) -> None:
    """Unknown lengths, and known lengths with last_batch='rollover', plan per slot."""
    def make(workers: int = 0, world: int = 1):
        source = SequenceSource(_ids(LENGTHS)) if known else UnknownLengths(_ids(LENGTHS))
        return ResumableLoader(source, batch_size=4, shuffle=True, num_workers=workers,
                               rank=0, world_size=world,
                               last_batch="rollover" if known else "keep")

    state = _partial_state(make, 3)
    for other in (make(workers=2), make(world=2)):
        other.load_state_dict(state)
        with pytest.raises(StateMismatchError,
                           match="cannot resume mid-epoch.*canonical partitions"):
            next(iter(other))
        other.close()


def test_at_an_epoch_boundary_any_configuration_resumes() -> None:
    def make(workers: int):
        return ResumableLoader(SequenceSource(_ids(LENGTHS)), batch_size=4, shuffle=True,
                               seed=9, num_workers=workers)

    done = make(0)
    run_epochs(done, [0])
    resumed = make(2)
    resumed.load_state_dict(done.state_dict())
    expected = run_epochs(make(0), range(2), key=flat)[1]  # the saved partitions go on
    assert [flat(b) for b in resumed] == expected
    resumed.close()


def _rollover(rank: int, world: int, workers: int = 0, batch_size: int = 4
              ) -> ResumableIterableLoader:
    return ResumableLoader(SequenceSource(_ids(LENGTHS)), batch_size=batch_size, shuffle=True,
                           seed=7, last_batch="rollover", num_workers=workers, rank=rank,
                           world_size=world)


def _rollover_stream(epochs: int) -> list[int]:
    """The samples of ``_rollover``'s first epochs' orders, end to end."""
    epochs_read = run_epochs(_rollover(0, 1, batch_size=1), range(epochs), key=flat)
    return [i for epoch in epochs_read for batch in epoch for i in batch]


@pytest.mark.parametrize(("world", "workers"), [(3, 0), (1, 2)])
@pytest.mark.parametrize("held", [False, True])
def test_rollover_resumed_at_an_epoch_end_on_another_world_size_carries_its_leftovers(
        world: int, workers: int, held: bool) -> None:
    """The 4 samples 2 ranks (global batches of 8) carried over from epoch 0 open epoch 1 on
    ``world`` ranks, and the stream goes on in that world size's global batches: the epochs
    read the epochs' orders laid end to end, each sample once (the new layout's leftovers
    were planned instead: 2 -> 3 and 2 -> 1 ranks lost 56-59). ``held``: the state a trainer
    that fetched epoch 1's first batch but did not use it saves (batch 0 of epoch 1)."""
    states, read = [], [[] for _ in range(3)]  # samples of epochs 0-2, all ranks
    for rank in range(2):
        loader = _rollover(rank, 2)
        read[0] += samples(run_epochs(loader, [0], key=flat)[0])
        if held:
            set_epoch(loader, 1)
            next(iter(loader))
            states.append(loader.schedule.state_dict(held=1))
        else:
            states.append(loader.state_dict())
        loader.close()
    assert states[0] == states[1] and states[0]["batches"] == (0 if held else 7)

    def resumed(rank: int = 0) -> ResumableIterableLoader:
        loader = _rollover(rank, world, workers)
        loader.load_state_dict(checkpoint_roundtrip(states[0]))
        return loader

    for rank in range(world):
        loader = resumed(rank)
        for epoch, batches in zip((1, 2), run_epochs(loader, [1, 2], key=flat), strict=True):
            read[epoch] += samples(batches)
        loader.close()
    stream = _rollover_stream(3)
    position = 0
    for epoch in read:
        assert sorted(epoch) == sorted(stream[position:position + len(epoch)])
        position += len(epoch)
    assert len(read[0]) == 56 and TOTAL + 4 - 4 * world < len(read[1]) <= TOTAL + 4
    assert 3 * TOTAL - 4 * world < position <= 3 * TOTAL
    if not held:  # the resumed run's states resume exactly on its layout (its cuts are saved;
        # the check declares epochs from 0, the epoch a state at epoch 0's end began under)
        check_resume_at_every_step(resumed, epochs=3, key=flat)


def test_rollover_abandoned_on_2_ranks_begins_the_next_epoch_on_3_where_2_would() -> None:
    """A state left for good in its epoch (a validation pass stopped early) begins the next
    epoch where the saving run's would begin, after its epoch's leftovers, on any world size
    (on 3 ranks it began at 3 ranks' own cut, past 4 samples of the stream)."""
    states = []
    for rank in range(2):
        loader = _rollover(rank, 2)
        set_epoch(loader, 0)
        next(iter(loader))
        states.append(abandoned(loader.state_dict()))
        loader.close()
    read = []
    for rank in range(3):
        loader = _rollover(rank, 3)
        loader.load_state_dict(checkpoint_roundtrip(states[0]))
        set_epoch(loader, 1)
        read += [i for batch in loader for i in flat(batch)]
        loader.close()
    assert sorted(read) == sorted(_rollover_stream(2)[56:116])  # 2 ranks' epoch 0 ends at 56


@pytest.mark.parametrize(("declared", "saved_world", "workers"),
                         [(None, 4, 0), (None, 4, 2), (None, 2, 0), (4, 4, 0), (4, 2, 0)])
def test_rollover_state_before_an_epoch_with_no_batch_resumes_in_that_epoch(
        declared: int | None, saved_world: int, workers: int) -> None:
    """60 samples on 4 ranks in batches of 20 (global batches of 80): epochs 0 and 4 have no
    batch. The state of a loader not yet iterated (batch 0 of epoch 0, not ended) was resumed
    as if epoch 0 had ended: the twin read epochs 1-4 as epochs 0-3. It reads epoch 0 first,
    as the loader does (saved on 2 ranks too: as a loader on 4 ranks begins). After
    ``set_epoch(4)`` before the save, the same epoch declared again kept the cursor already."""
    first = declared or 0

    def make(world: int = 4) -> ResumableIterableLoader:
        loader = _rollover(1, world, workers, batch_size=20)
        if declared is not None:
            set_epoch(loader, declared)
        return loader

    def restored() -> ResumableIterableLoader:
        loader = _rollover(1, 4, workers, batch_size=20)
        loader.load_state_dict(checkpoint_roundtrip(state))
        return loader

    state = make(saved_world).state_dict()
    live, twin = make(), restored()
    expected = run_epochs(live, range(first, first + 5), key=flat)
    assert [len(epoch) for epoch in expected] == [0, 1, 1, 1, 0]
    assert run_epochs(twin, range(first, first + 5), key=flat) == expected
    live.close()
    twin.close()
    if declared is None:  # and the twin's own states resume exactly
        check_resume_at_every_step(restored, epochs=5, key=flat)


def test_a_corrupted_rollover_origin_is_refused_on_load() -> None:
    loader = _rollover(0, 1)
    run_epochs(loader, [0])
    state = loader.state_dict()
    state["parts"]["slots"]["origin"] = [1, 61]  # past the 60 samples before epoch 1
    with pytest.raises(StateMismatchError, match=r"corrupted.*'origin'.*got \[1, 61\]"):
        _rollover(0, 1).load_state_dict(state)


def test_restored_cursor_wins_over_a_stale_set_epoch_and_yields_to_a_later_one() -> None:
    def make():
        return ResumableLoader(UnknownLengths(_ids(LENGTHS)), batch_size=4, shuffle=True,
                               shuffle_buffer=3, seed=4)

    expected = run_epochs(make(), range(4), key=flat)
    state = _partial_state(make, 2, epoch=2)
    stale = make()
    stale.load_state_dict(state)
    set_epoch(stale, 0)
    assert [flat(b) for b in stale] == expected[2][2:]
    moved_on = make()
    moved_on.load_state_dict(state)
    set_epoch(moved_on, 3)
    assert [flat(b) for b in moved_on] == expected[3]


def test_a_cursor_after_the_last_batch_starts_the_next_epoch_even_with_unknown_lengths() -> None:
    def make():
        return ResumableLoader(UnknownLengths(_ids(LENGTHS)), batch_size=4, shuffle=True, seed=4)

    expected = run_epochs(make(), range(2), key=flat)
    state = _partial_state(make, len(expected[0]))  # no StopIteration seen yet
    assert state["parts"]["slots"]["ended"]
    resumed = make()
    resumed.load_state_dict(state)
    assert [flat(b) for b in resumed] == expected[1]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_state_after_the_last_batch_dropping_a_short_one_starts_the_next_epoch(workers
                                                                                ) -> None:
    """With unknown lengths ``"drop"`` leaves a short batch unread, so the state after the
    epoch's last batch says it has not ended; resumed, the next epoch still follows at once
    (not an empty epoch first), unless the epoch is declared again after the restore."""
    def make():
        return ResumableLoader(UnknownLengths(_ids([7, 6])), batch_size=4, shuffle=True,
                               seed=4, num_workers=workers, last_batch="drop")

    expected = run_epochs(make(), range(3), key=flat)
    state = _partial_state(make, len(expected[0]))
    assert not state["parts"]["slots"]["ended"]
    resumed = make()
    resumed.load_state_dict(state)
    assert [[flat(b) for b in resumed], [flat(b) for b in resumed]] == expected[1:]
    assert resumed.epoch == 2
    resumed.close()
    draining = make()
    draining.load_state_dict(state)
    set_epoch(draining, 0)
    assert [flat(b) for b in draining] == []
    assert [flat(b) for b in draining] == expected[1] and draining.epoch == 1
    draining.close()


def test_iter_alone_starts_nothing_and_close_leaves_no_process(record_files) -> None:
    loader = ResumableLoader(RecordFiles(record_files, decode=decode), batch_size=4,
                             num_workers=2)
    for _ in range(3):
        iter(loader)
    assert loader_processes() == [] and loader.epoch is None
    next(iter(loader))
    assert loader.epoch == 0 and len(loader_processes()) == 2
    loader.close()
    assert loader_processes() == []
    _start_and_drop(record_files)
    gc.collect()
    assert loader_processes() == []


def _start_and_drop(record_files) -> None:
    """A loader whose workers run when it goes out of scope (in its own frame: on Python 3.11
    ``_lightning.find_prefetcher`` snapshots the calling frames' locals, which holds a loader
    created in the same frame until that frame returns)."""
    dropped = ResumableLoader(RecordFiles(record_files, decode=decode), batch_size=4,
                              num_workers=2)
    next(iter(dropped))
    assert len(loader_processes()) == 2


def test_unknown_lengths_on_several_ranks_need_a_process_group() -> None:
    loader = ResumableLoader(UnknownLengths(_ids(LENGTHS)), batch_size=4, rank=0, world_size=2)
    with pytest.raises(RuntimeError, match="process group"):
        next(iter(loader))


def test_a_plain_dataset_hears_the_epoch() -> None:
    dataset = Counting(12)
    loader = ResumableLoader(dataset, batch_size=4)
    run_epochs(loader, range(3))
    assert dataset.epochs == [0, 1, 2]


@pytest.mark.parametrize(
    ("dataset", "kwargs", "match"),
    [
        (SequenceSource([[1]]), {"sampler": [0]}, "no sampler"),
        (UnknownLengths([[1]]), {"last_batch": "rollover"}, "rollover"),
        (Counting(5), {"last_batch": "rollover"}, "rollover"),
        (UnknownLengths([[1]]), {"last_batch": "pad"}, "needs known lengths"),
        (Counting(5), {"shuffle": True}, "shuffle_buffer"),
        (SequenceSource([[1]]), {"on_error": "skip"}, "on_error"),
        (SequenceSource([[1]]), {"shuffle_buffer": -1}, "shuffle_buffer"),
        (SequenceSource([[1]]), {"sync_interval": 0}, "sync_interval"),
        (SequenceSource([[], []]), {}, "empty"),
        (SequenceSource([[1]]), {"batch_size": 0}, "batch_size"),
    ],
)
def test_impossible_settings_fail_at_construction(dataset, kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        ResumableLoader(dataset, **kwargs)


class _Lying(SequenceSource):
    @property
    def shard_lengths(self) -> list[int]:
        return [len(s) + 2 for s in self.sequences]


class _Broken(SequenceSource):
    def open_shard(self, index, start=0, state=None):
        for i, sample in enumerate(super().open_shard(index, start, state)):
            if index == 1 and start + i == 3:
                raise KeyError("bad record")
            yield sample


def _fails_to_start(worker_id: int) -> None:
    raise FileNotFoundError(2, "no such file", "index")


@pytest.mark.parametrize(("workers", "backend"), [(0, "process"), (2, "process"), (2, "thread")])
def test_errors_name_the_shard_slot_and_epoch(workers: int, backend: str) -> None:
    """From a worker too, with its fields and cause (they used to arrive as text alone)."""
    loader = ResumableLoader(_Lying([[1, 2], [3]]), batch_size=2, num_workers=workers,
                             backend=backend)
    with pytest.raises(Exception, match=r"shard \d ended at sample \d, but its declared length"):
        list(loader)
    loader.close()
    broken = ResumableLoader(_Broken([[0, 1], list(range(10, 20))]), batch_size=2,
                             num_workers=workers, backend=backend)
    with pytest.raises(KeyError, match=r"KeyError in sample 3 of shard 1 \(stream position 5, "
                                        r"batch \d of slot \d\) of epoch 0, in (the main process|"
                                        r"worker \d \(pid \d+\)) on rank 0: 'bad record'") as info:
        list(broken)
    error = info.value
    assert isinstance(error, SampleFetchError) and isinstance(error.__cause__, KeyError)
    assert (error.epoch, error.rank, error.cause_type) == (0, 0, "KeyError")
    assert (error.index, error.position) == (None, 5)  # the sample that raised, not its batch's
    assert (error.worker is None) == (workers == 0)
    broken.close()
    if workers:
        starting = ResumableLoader(_Broken([[0, 1]]), batch_size=2, num_workers=workers,
                                   backend=backend, worker_init_fn=_fails_to_start)
        with pytest.raises(FileNotFoundError, match="worker_init_fn of worker") as failed:
            list(starting)
        assert failed.value.errno == 2 and failed.value.rank == 0
        assert failed.value.worker in range(workers)


class _FailsAt(IterableDataset):
    """A plain stream of ``0 .. n - 1`` whose element ``bad`` raises."""

    def __init__(self, n: int, bad: int) -> None:
        self.n, self.bad = n, bad

    def __iter__(self) -> Iterator[int]:
        for i in range(self.n):
            if i == self.bad:
                raise KeyError(f"bad {i}")
            yield i


@pytest.mark.parametrize(("workers", "backend", "bad"), [
    (0, "process", 17), (0, "process", 16), (2, "process", 17), (3, "process", 17),
    (2, "thread", 17)])
def test_a_failing_stream_sample_is_named_not_its_batch(workers: int, backend: str, bad: int
                                                        ) -> None:
    """Its position in the stream, also when a slot skips the other slots' samples (they
    raise in its read too) or reads one ahead to know whether its stream ends (16, at the
    end of a batch without workers)."""
    loader = ResumableLoader(_FailsAt(40, bad), batch_size=4, num_workers=workers,
                             backend=backend)
    with pytest.raises(KeyError, match=rf"KeyError in sample {bad} of the _FailsAt stream "
                                        r"\(batch \d of slot \d\) of epoch 0") as info:
        list(loader)
    loader.close()
    assert (info.value.index, info.value.position) == (None, bad)


def _one_fails(shard: int) -> Iterator[int]:
    """Samples ``0 .. 7``; in the shard described ``1``, sample 1 raises."""
    for i in range(8):
        if shard == 1 and i == 1:
            raise KeyError(f"bad {i}")
        yield i


def test_a_failing_shard_sample_is_named_where_its_position_is_known() -> None:
    """Past a shard of unknown length, a sample has no stream position; and a shard opened
    mid-way that raises before its first sample names where it was read from (the source may
    have raised skipping to it)."""
    unknown = ResumableLoader(GeneratorSource(_one_fails, shards=[0, 1]), batch_size=2)
    with pytest.raises(KeyError, match=r"KeyError in sample 1 of shard 1 \(batch 4 of slot "
                                       r"0\) of epoch 0") as info:
        list(unknown)
    assert info.value.position is None
    split = GeneratorSource(_one_fails, shards=[1], lengths=[8])
    with pytest.raises(KeyError, match=r"sample 1 of shard 0 \(stream position 1, ") as first:
        list(ResumableLoader(split, batch_size=2, rank=0, world_size=2))
    assert first.value.position == 1
    with pytest.raises(KeyError, match=r"\(shard 0, reading from sample 4\)") as skipping:
        list(ResumableLoader(split, batch_size=2, rank=1, world_size=2))  # reads from 4
    assert skipping.value.position is None


@pytest.mark.parametrize(("workers", "before"), [(0, 16), (2, 16), (3, 12)])
def test_every_batch_before_a_failing_sample_is_delivered(workers: int, before: int) -> None:
    """A slot reads one sample past a full batch to know whether its stream ends there; an
    error in that read belongs to its next batch, so the full one is delivered first, as
    without workers. Slot ``k`` of ``w`` takes samples ``k, k + w, ...``: with 2 workers the
    first batch that needs sample 17 is slot 0's third (16, 18, ...), with 3 its second."""
    loader = ResumableLoader(_FailsAt(40, 17), batch_size=4, num_workers=workers)
    delivered: list[int] = []
    with pytest.raises(KeyError, match="bad 17"):
        for batch in loader:
            delivered += batch.tolist()
    loader.close()
    assert sorted(delivered) == list(range(before))


class _KillsItsWorkerOnce(SequenceSource):
    """Opening shard 3 the first time (in a worker) kills that worker, as the OOM killer would."""

    def __init__(self, sequences, marker: Path, known: bool) -> None:
        super().__init__(sequences)
        self.marker, self.known = marker, known

    @property
    def shard_lengths(self):
        return super().shard_lengths if self.known else None

    def open_shard(self, index, start=0, state=None):
        if index == 3 and get_worker_info() is not None and not self.marker.exists():
            self.marker.touch()
            os.kill(os.getpid(), signal.SIGKILL)
        return super().open_shard(index, start, state)


@pytest.mark.parametrize("known", [True, False])
def test_a_killed_worker_is_replaced_and_the_stream_goes_on_exactly(known, tmp_path) -> None:
    def make(marker: Path, **kwargs):
        return ResumableLoader(_KillsItsWorkerOnce(_ids([9, 14, 6, 11, 8]), marker, known),
                               batch_size=3, shuffle=True, shuffle_buffer=4, seed=2,
                               num_workers=2, **kwargs)

    (tmp_path / "no-kill").touch()
    expected = run_epochs(make(tmp_path / "no-kill"), range(2), key=flat)
    crashing = make(tmp_path / "kill")
    assert run_epochs(crashing, range(2), key=flat) == expected
    assert crashing.worker_restarts == 1
    crashing.close()
    strict = make(tmp_path / "kill-again", max_worker_restarts=0)
    with pytest.raises(WorkerCrashedError, match="SIGKILL.*max_worker_restarts=0") as info:
        run_epochs(strict, range(1))
    assert info.value.signal == "SIGKILL"
    assert loader_processes() == []


def test_repr_says_where_the_loader_is(record_files) -> None:
    loader = ResumableLoader(RecordFiles(record_files, decode=decode), batch_size=4)
    next(iter(loader))
    text = repr(loader)
    for part in ("RecordFiles(6 shards, samples=unknown)", "rank=0/1", "epoch=0", "batches=1"):
        assert part in text


# -- under a real Trainer -----------------------------------------------------------------------


@pytest.mark.parametrize(("known", "workers"), [(True, 2), (False, 0)])
def test_trainer_resumes_from_every_step(known, workers, record_files, tmp_path) -> None:
    def make():
        return ResumableLoader(RecordFiles(record_files[:3], lengths="scan" if known else None,
                                           decode=decode),
                               batch_size=8, shuffle=True, shuffle_buffer=4, seed=5,
                               num_workers=workers)

    full = check_trainer_resume(make, tmp_path, max_epochs=2, batch_idx=known)
    epochs = [[b for e, _, b in full if e == epoch] for epoch in range(2)]
    assert all(samples(e) == list(range(sum(LENGTHS[:3]))) for e in epochs)


def test_trainer_trains_a_plain_iterable_through_the_fallback(tmp_path) -> None:
    def make():
        return ResumableLoader(Counting(30, sized=False), batch_size=4, shuffle=True,
                               shuffle_buffer=5, seed=1)

    full = check_trainer_resume(make, tmp_path, max_epochs=2, steps=[1, 5, 8, 9, 13],
                                batch_idx=False)
    assert [sorted(i for e, _, b in full if e == epoch for i in b) for epoch in range(2)] == [
        list(range(30))] * 2


@pytest.mark.skipif(sys.platform != "linux", reason="gloo DDP on CPU")
def test_ddp_two_ranks_cover_every_record_once_with_equal_counts_and_resume(
        tmp_path, record_files) -> None:
    """Real 2-rank gloo DDP under ``Trainer(strategy="ddp")``: uneven record files with known
    lengths and 2 workers per rank, and the same files with unknown lengths."""
    data = tmp_path / "data"
    data.mkdir()
    for path in record_files:
        (data / path.name).write_bytes(path.read_bytes())
    runs = run_ddp(SCRIPT, [str(data), str(tmp_path / "ckpt"), "--run", "known:2",
                            "--run", "unknown:0", "--resumes", "2"], tmp_path / "out")
    for run in ("known:2", "unknown:0"):
        ranks = [rank_runs[run] for rank_runs in runs]
        for epoch in range(2):
            counts = [sum(1 for e, _ in rank["seen"] if e == epoch) for rank in ranks]
            read = [i for rank in ranks for e, ids in rank["seen"] if e == epoch for i in ids]
            assert counts[0] == counts[1] > 0, f"{run}: unequal batch counts {counts}"
            if run == "known:2":
                assert counts == [ranks[0]["len"]] * 2 == [8, 8]
                assert sorted(read) == list(range(TOTAL)), "every record exactly once"
            else:
                assert ranks[0]["len"] is None
                assert len(read) == len(set(read)) and set(read) <= set(range(TOTAL))
        for rank in ranks:
            full = [ids for _, ids in rank["seen"]]
            assert len(rank["resumes"]) >= 3
            for step, after in rank["resumes"].items():
                assert after == full[int(step):], f"{run}: resume from step {step} diverged"


@pytest.mark.skipif(sys.platform != "linux", reason="gloo DDP on CPU")
def test_ddp_state_after_an_epoch_dropping_short_batches_resumes_into_the_next_epoch(
        tmp_path) -> None:
    """Real 2-rank gloo DDP, a plain loop: the ranks agree on the epoch's end at run time and
    ``"drop"`` leaves a short batch unread, so rank 0's state after epoch 0's last batch says
    it has not ended; both ranks resume straight into epoch 1 (no empty epoch, no hang)."""
    script = REPO / "tests" / "scripts" / "iterable_epoch_end_ddp.py"
    runs = run_ddp(script, ["--workers", "0", "--workers", "2"], tmp_path / "out")
    for workers, per_epoch in (("0", 6), ("2", 12)):
        for rank in runs:
            run = rank[workers]
            assert [len(epoch) for epoch in run["full"]] == [per_epoch] * 3
            assert not run["ended"]
            assert run["resumed"] == [[run["full"][1], 1], [run["full"][2], 2]]


class _Growing(IterableDataset):
    """A plain stream whose ``len()`` is changed between epochs."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return iter(range(self.n))


def test_an_iterable_whose_len_changes_between_epochs_is_refused_not_cut() -> None:
    """Its epochs are planned from ``len()`` once: a longer stream would be cut at the old
    length in silence; the next epoch is refused, naming the fix."""
    data = _Growing(6)
    loader = ResumableLoader(data, batch_size=2)
    assert sorted(i for batch in loader for i in batch.tolist()) == list(range(6))
    data.n = 10
    with pytest.raises(ValueError, match="_Growing's len\\(\\) changed from 6 to 10.*new loader"):
        list(loader)


class _Connected(SequenceSource):
    """A source whose shards are read through a per-worker resource that ``worker_init_fn``
    opens on the worker's copy (torch's ``get_worker_info().dataset``)."""

    connection: str | None = None

    def open_shard(self, index: int, start: int = 0, state: Any = None) -> Iterator[Any]:
        return ((self.connection, sample) for sample in super().open_shard(index, start, state))


def _connect(worker_id: int) -> None:
    get_worker_info().dataset.connection = f"conn-{worker_id}"


def test_worker_init_fn_configures_the_workers_copy_of_a_source() -> None:
    """As with ``DataLoader``, ``get_worker_info().dataset`` in ``worker_init_fn`` is the
    worker's copy of the source, so what it sets there is what the worker reads with."""
    loader = ResumableLoader(_Connected([list(range(4)), list(range(4, 8))]), batch_size=None,
                             num_workers=2, worker_init_fn=_connect)
    seen = [item for item in loader]
    assert sorted(sample for _, sample in seen) == list(range(8))
    assert {connection for connection, _ in seen} == {"conn-0", "conn-1"}


class _Range(IterableDataset[int]):
    """torch's ``get_worker_info()`` examples' dataset: the ids from ``start`` to ``end``, each
    with whether it was read through a ``connection`` (which a ``worker_init_fn`` may open)."""

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end = start, end
        self.connection: str | None = None

    def __iter__(self) -> Iterator[Any]:
        return ((self.connection is not None, i) for i in range(self.start, self.end))


def _split_range(worker_id: int) -> None:
    """torch's second example: each worker narrows its copy to its part."""
    info = get_worker_info()
    dataset = info.dataset
    per_worker = -(-(dataset.end - dataset.start) // info.num_workers)
    dataset.start += info.id * per_worker
    dataset.end = min(dataset.start + per_worker, dataset.end)


def _split_range_through_worker_info(worker_id: Any) -> None:
    dataset, per_worker = worker_id.dataset, -(-(worker_id.dataset.end) // worker_id.num_workers)
    dataset.start, dataset.end = worker_id * per_worker, min((worker_id + 1) * per_worker, 10)


def _open_range(worker_id: int) -> None:
    get_worker_info().dataset.connection = f"conn-{worker_id}"


@pytest.mark.parametrize(("init", "backend"), [(_split_range, "process"),
                                                (_split_range_through_worker_info, "process"),
                                                (_split_range_through_worker_info, "thread")])
def test_a_plain_stream_split_in_worker_init_fn_is_refused_not_thinned(init, backend) -> None:
    """Every worker reads a plain stream whole and keeps its share: split per worker first,
    each would keep a share of its part, and half the samples would be lost in silence."""
    loader = ResumableLoader(_Range(0, 10), batch_size=None, num_workers=2,
                             worker_init_fn=init, backend=backend)
    with pytest.raises(ValueError, match=r"begins with another sample in worker slot 1 than in "
                                         r"slot 0 .*worker_init_fn that splits"):
        list(loader)
    loader.close()


def _cap_worker_one(worker_id: int) -> None:
    """A per-worker cap that leaves the first samples alone: worker 1's copy ends at 12."""
    if worker_id == 1:
        info = worker_info()
        assert info is not None
        info.dataset.end = 12


def _capped_loader(kind: str) -> Any:
    """23 ids of unknown length over 2 workers, worker 1's copy capped at 12 (``kind``:
    ``"backend, last_batch, shuffle_buffer"``, or ``make_resumable``)."""
    if kind == "make_resumable":
        return make_resumable(DataLoader(_Range(0, 23), batch_size=4, num_workers=2,
                                         worker_init_fn=_cap_worker_one))
    backend, last_batch, buffer = kind.split(", ")
    return ResumableLoader(_Range(0, 23), batch_size=4, num_workers=2, backend=backend,
                           last_batch=last_batch, shuffle_buffer=int(buffer),
                           worker_init_fn=_cap_worker_one)


@pytest.mark.parametrize("kind", ["process, keep, 0", "thread, drop, 4", "make_resumable"])
def test_a_plain_stream_cut_short_in_one_worker_is_refused_not_thinned(kind: str) -> None:
    """Worker 1's copy of a plain stream ends at 12 of 23 past the same first samples: it took
    every 2nd sample, so 13, 15, ..., 21 were lost in every epoch, in silence (18 of 23
    delivered). The slots' ends are compared: each must end within one stride of the others."""
    loader = _capped_loader(kind)
    with pytest.raises(ValueError, match=r"stream ends earlier in worker slot 1 than in slot 0 "
                                         r"\(epoch 0\): slot 1's copy had no sample at stream "
                                         r"position 1[13], while slot 0 read position .*"
                                         r"worker_init_fn that changes the stream"):
        list(loader)
    loader.close()


def test_a_plain_stream_cut_short_in_one_worker_is_refused_on_resume() -> None:
    """A state saved mid-epoch by workers that read one stream, resumed where worker 1's
    copy ends early, is refused as the resumed slots read on."""
    whole = ResumableLoader(_Range(0, 23), batch_size=4, num_workers=2)
    batches = iter(whole)
    next(batches)
    state = whole.state_dict()
    whole.close()
    capped = ResumableLoader(_Range(0, 23), batch_size=4, num_workers=2,
                             worker_init_fn=_cap_worker_one)
    capped.load_state_dict(state)
    with pytest.raises(ValueError, match="stream ends earlier in worker slot 1 than in slot 0"):
        list(capped)
    capped.close()


def test_worker_init_fn_opens_a_resource_on_the_workers_copy_of_a_plain_stream() -> None:
    loader = ResumableLoader(_Range(0, 10), batch_size=None, num_workers=2,
                             worker_init_fn=_open_range)
    seen = list(loader)
    assert sorted(i for _, i in seen) == list(range(10))
    assert all(connected for connected, _ in seen)
    loader.close()
