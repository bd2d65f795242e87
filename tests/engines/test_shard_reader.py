"""A slot's reader checks the shards against their declared lengths, the empty ones too,
reads each sample once, and keeps a seeking source's draws exact across resumes."""

import random
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from lightning_loaders import (
    GeneratorSource,
    RecordFiles,
    ResumableLoader,
    ShardedSource,
    write_records,
)
from lightning_loaders.errors import SampleFetchError
from lightning_loaders.testing import check_resume_at_every_step, run_epochs

SHARDS = [(0, 3), (3, 3), (3, 7), (7, 7)]  # 3, 0, 4 and 0 samples
TRUE = [3, 0, 4, 0]


def _ranges(shard: tuple[int, int]) -> Iterator[int]:
    yield from range(*shard)


def _loader(shards: list[tuple[int, int]], lengths: list[int] | None, workers: int,
            shuffle: bool, policy: str = "keep") -> ResumableLoader:
    return ResumableLoader(GeneratorSource(_ranges, shards, lengths=lengths), batch_size=2,
                           num_workers=workers, shuffle=shuffle, shuffle_buffer=3 * shuffle,
                           seed=2, last_batch=policy, collate_fn=list)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("liar", [1, 3])
def test_a_shard_declared_empty_that_is_not_is_refused(workers, shuffle, liar) -> None:
    """Its samples were dropped in silence (no piece of the plan read it), wherever the
    shard stands in the order; really empty shards and unknown lengths still read all."""
    for lengths in (TRUE, None):
        loader = _loader(SHARDS, lengths, workers, shuffle)
        for batches in run_epochs(loader, range(2), key=tuple):
            assert sorted(i for batch in batches for i in batch) == list(range(7))
        loader.close()
    shards = list(SHARDS)
    shards[liar] = (10, 12)
    for policy in ("keep", "drop", "pad", "rollover"):
        loader = _loader(shards, TRUE, workers, shuffle, policy)
        # every epoch; under rollover, every pass over the shards (it may end in the next epoch)
        for epochs in ([0, 1],) if policy == "rollover" else ([0], [1]):
            with pytest.raises(SampleFetchError, match=rf"shard {liar} goes on past its "
                                                       r"declared length \(0\).*shard_lengths"):
                run_epochs(loader, epochs)
        loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_epoch_checks_the_shards_declared_empty_ahead(workers) -> None:
    check_resume_at_every_step(lambda: _loader(SHARDS, TRUE, workers, True), 2, key=tuple)
    shards = [(0, 4), (10, 12), (4, 8)]  # shard 1 is declared empty
    loader = _loader(shards, [4, 0, 4], workers, False)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    loader.close()
    resumed = _loader(shards, [4, 0, 4], workers, False)
    resumed.load_state_dict(state)
    with pytest.raises(SampleFetchError, match=r"shard 1 goes on past its declared length"):
        list(resumed)
    resumed.close()


class _CountingDecode:
    """Decodes a record to its int, appending a byte to a file per call (across processes)."""

    def __init__(self, path: str) -> None:
        self.path = path

    def __call__(self, payload: bytes) -> int:
        with open(self.path, "ab") as file:
            file.write(b".")
        return int(payload)


@pytest.mark.parametrize("policy", ["keep", "drop"])
@pytest.mark.parametrize("per_shard", [64, 70])  # slots end on a full batch, on a short one
def test_a_slot_that_ended_is_not_read_again_for_the_requests_past_its_end(
        tmp_path, policy, per_shard) -> None:
    """With unknown lengths, the requests sent past a slot's end before the main process
    heard of it rebuilt the slot's reader and read its whole stream again to reach them: 2
    workers decoded 512 samples for an epoch of 256."""
    paths = []
    for shard in range(4):
        paths.append(str(tmp_path / f"{shard}.rec"))
        write_records(paths[-1], [str(shard * 100 + i).encode() for i in range(per_shard)])
    count = tmp_path / "decoded"
    loader = ResumableLoader(RecordFiles(paths, decode=_CountingDecode(str(count))),
                             batch_size=16, num_workers=2, last_batch=policy, collate_fn=list)
    kept = 4 * per_shard if policy == "keep" else 4 * per_shard // 32 * 32  # 2 slots of 2 shards
    for batches in run_epochs(loader, range(2), key=tuple):
        assert sum(map(len, batches)) == kept
    loader.close()
    assert count.stat().st_size == 2 * 4 * per_shard  # each sample decoded once per epoch


def _drawing(shard: tuple[int, int], start: int = 0) -> Iterator[tuple[int, float, float, float]]:
    """A seekable shard whose samples draw from the global RNGs (an augmentation)."""
    for i in range(shard[0] + start, shard[1]):
        yield i, random.random(), float(np.random.random()), torch.rand(()).item()


def _drawing_twice(shard: tuple[int, int], start: int = 0) -> Iterator[tuple[int, float]]:
    for i in range(shard[0] + start, shard[1]):
        yield i, random.random() + random.random()


def _drawing_decode(payload: bytes) -> tuple[int, float, float]:
    return int(payload), float(np.random.random()), torch.rand(()).item()


DRAWING_SHARDS = [(0, 5), (5, 9), (9, 13), (13, 20)]
DRAWING_LENGTHS = [5, 4, 4, 7]


def _collate_drawing(samples: list[Any]) -> list[Any]:
    """The batch and a draw of its own (a collate_fn that augments)."""
    return [*samples, random.random()]


def _drawing_loader(source: ShardedSource[Any], workers: int, policy: str, window: int,
                    partitions: int | None = None, backend: str = "process") -> ResumableLoader:
    return ResumableLoader(source, batch_size=2, num_workers=workers, last_batch=policy,
                           shuffle_buffer=window, partitions=partitions, seed=3,
                           backend=backend, collate_fn=_collate_drawing)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("policy", ["keep", "drop"])
@pytest.mark.parametrize(("lengths", "window"), [(None, 1), (None, 3), (DRAWING_LENGTHS, 3)])
def test_a_seeking_source_that_draws_resumes_exactly(workers, policy, lengths, window) -> None:
    """A seekable source draws under each batch's seeding, but the samples read for a later
    batch drew under the batch reading them: with unknown lengths the next batch's first
    sample (read ahead to know whether the slot ended), and a shuffle window's samples, so a
    resume after batch 1 drew other values (0.799 for sample 2 where the run drew 0.473).
    A reader opened to resume over canonical partitions read its first window in the batch's
    fetch, whose collate_fn then drew after the window's seeding (0.462 for batch 4 where
    the run drew 0.617, resumed after batch 3 with 2 workers)."""
    source = GeneratorSource(_drawing, DRAWING_SHARDS, lengths=lengths, seekable=True)
    check_resume_at_every_step(lambda: _drawing_loader(source, workers, policy, window), 2)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("policy", ["keep", "drop"])
@pytest.mark.parametrize("window", [1, 3])
def test_a_file_source_whose_decode_draws_resumes_exactly(tmp_path, workers, policy,
                                                          window) -> None:
    paths = []
    for shard, (first, stop) in enumerate(DRAWING_SHARDS):
        paths.append(str(tmp_path / f"{shard}.rec"))
        write_records(paths[-1], [str(i).encode() for i in range(first, stop)])
    source = RecordFiles(paths, decode=_drawing_decode)
    check_resume_at_every_step(lambda: _drawing_loader(source, workers, policy, window), 2)


@pytest.mark.parametrize("window", [1, 3])
def test_a_seeking_source_draws_the_same_under_partitions_for_any_workers(window) -> None:
    """Canonical partitions make the stream the same for every ``num_workers``: the draws
    too, and a resume under them is exact."""
    source = GeneratorSource(_drawing, DRAWING_SHARDS, lengths=DRAWING_LENGTHS, seekable=True)
    runs = []
    for workers in (0, 2):
        def make(workers: int = workers) -> ResumableLoader:
            return _drawing_loader(source, workers, "keep", window, partitions=2)
        runs.append(check_resume_at_every_step(make, 2))
    assert runs[0] == runs[1]
    assert len({sample[1] for batches in runs[0] for batch in batches
                for sample in batch[:-1]}) == 40


@pytest.mark.parametrize("lengths", [None, DRAWING_LENGTHS])
@pytest.mark.parametrize("window", [1, 3])
def test_a_seeking_source_that_draws_reads_the_same_on_threads_as_in_processes(
        lengths, window) -> None:
    """A seeking source draws under each batch's seeding of the global RNGs, which worker
    threads left alone: on threads it drew from the training process's RNGs, other values
    in every run, and a resume after batch 1 diverged. A thread holds them for its fetch
    (the warning says the threads read one at a time), seeded as a worker process seeds
    them: samples, draws (the collate_fn's too) and every resume are those of processes."""
    source = GeneratorSource(_drawing, DRAWING_SHARDS, lengths=lengths, seekable=True)

    def make(backend: str) -> ResumableLoader:
        return _drawing_loader(source, 2, "keep", window, backend=backend)

    with pytest.warns(UserWarning, match="worker threads: GeneratorSource .*one at a time"):
        threads = check_resume_at_every_step(lambda: make("thread"), 2)
    assert threads == run_epochs(make("process"), range(2))


def test_a_resumed_shuffle_window_leaves_the_training_loops_rngs_alone() -> None:
    """Without workers, a resumed slot reads its shuffle window before the batch's fetch
    seeds the RNGs, and it drew from the training loop's: what the loop drew next depended on
    how much the source drew."""
    drawn = []
    for fn in (_drawing, _drawing_twice):
        source = GeneratorSource(fn, DRAWING_SHARDS, seekable=True)
        loader = _drawing_loader(source, 0, "keep", 3)
        it = iter(loader)
        next(it)
        state = loader.state_dict()
        resumed = _drawing_loader(source, 0, "keep", 3)
        resumed.load_state_dict(state)
        random.seed(0)
        np.random.seed(0)
        torch.manual_seed(0)
        loop = []
        for _ in resumed:
            loop.append((random.random(), float(np.random.random()), torch.rand(()).item()))
        drawn.append(loop)
    assert drawn[0] == drawn[1]
