"""Errors in user code reach the main process named, typed and with their traceback; and
``on_error="skip"`` leaves failing samples out deterministically, across resumes."""

from __future__ import annotations

import os
import pickle
import threading

import numpy as np
import pytest
import torch

from lightning_loaders import ResumableLoader, sample_context
from lightning_loaders.errors import (
    LoaderError,
    SampleFetchError,
    StateMismatchError,
    WorkerCrashedError,
    WorkerInitError,
    WorkerTimeoutError,
)
from lightning_loaders.orders.base import ShuffledOrder
from lightning_loaders.testing import Snapshot, check_resume_at_every_step, run_epochs
from tests.conftest import IndexDataset


def indices(batch) -> list[int]:
    return batch["index"].tolist()


def _explode(index: int) -> None:
    """A transform that fails on one record."""
    raise KeyError(f"no such record: {index}")


class FailsInEpochOne(IndexDataset):
    """Sample ``bad`` fails, but only in epoch 1 (its transform raises)."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, index: int):
        if index == self.bad and sample_context().epoch == 1:
            _explode(index)
        return super().__getitem__(index)


@pytest.mark.parametrize("workers", [0, 2])
def test_a_failing_sample_is_named_with_index_position_epoch_worker_rank_and_cause(workers):
    n, seed, position = 20, 3, 10  # position 10: global batch 1 (2 ranks x 3), rank 1's share
    bad = int(ShuffledOrder(n, seed).indices(1, np.arange(n))[position])
    loader = ResumableLoader(FailsInEpochOne(n, bad), batch_size=3, shuffle=True, seed=seed,
                             rank=1, world_size=2, num_workers=workers)
    run_epochs(loader, [0])
    iterator = iter(loader)
    next(iterator)
    with pytest.raises(SampleFetchError) as info:
        next(iterator)
    error = info.value
    assert (error.index, error.position, error.epoch, error.batch, error.rank) == (
        bad, position, 1, 1, 1)
    assert isinstance(error.__cause__, KeyError) and error.cause_type == "KeyError"
    message = str(error)
    assert f"KeyError in sample index {bad} (epoch position {position}, batch 1) of epoch 1" \
        in message and "on rank 1" in message and f"no such record: {bad}" in message
    if workers:
        assert error.worker in (0, 1) and error.pid != os.getpid()
        assert f"in worker {error.worker} (pid {error.pid})" in message
        assert "Original traceback in worker" in message and "_explode" in message
        assert "_explode" in error.worker_traceback
    else:
        assert error.worker is None and "in the main process" in message
        assert error.__cause__.__traceback__ is not None  # the live traceback, chained
    state = loader.state_dict()
    assert (state["epoch"], state["batches"]) == (1, 1), "the cursor stays on the failed batch"
    with pytest.raises(SampleFetchError) as again:  # a retry asks for the same batch
        next(iterator)
    assert (again.value.index, again.value.batch) == (bad, 1)
    loader.close()


@pytest.mark.parametrize("error", [SampleFetchError, WorkerInitError, WorkerCrashedError,
                                   WorkerTimeoutError])
def test_every_error_is_a_loader_error_and_a_runtime_error(error: type) -> None:
    assert issubclass(error, LoaderError) and issubclass(error, RuntimeError)


def test_errors_survive_pickling_with_their_attributes() -> None:
    error = SampleFetchError("boom", index=3, position=4, epoch=5, batch=6, rank=1, worker=2,
                             pid=77, cause_type="KeyError", worker_traceback="tb")
    copy = pickle.loads(pickle.dumps(error))
    assert str(copy) == "boom" and vars(copy) == vars(error)


class _Unpicklable(Exception):
    def __reduce__(self):
        raise TypeError("this exception cannot cross processes")


class RaisesUnpicklable(IndexDataset):
    def __getitem__(self, index: int):
        if index == 2:
            raise _Unpicklable("locked resource")
        return super().__getitem__(index)


def test_an_unpicklable_exception_from_a_worker_is_still_named_with_its_traceback() -> None:
    with ResumableLoader(RaisesUnpicklable(6), batch_size=2, num_workers=1) as loader:
        with pytest.raises(SampleFetchError) as info:
            list(loader)
    cause = info.value.__cause__  # rebuilt from its type and args, without __reduce__
    assert type(cause) is _Unpicklable and cause.args == ("locked resource",)
    assert info.value.cause_type == "_Unpicklable"
    assert "_Unpicklable in sample index 2" in str(info.value)
    assert "locked resource" in info.value.worker_traceback
    assert info.value.loader_fields["worker_traceback"] == info.value.worker_traceback


class _Coded(KeyError):
    """An error whose ``__init__`` takes more than the message: it pickles, and fails to
    unpickle (``_Coded("boom")`` is called)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


class RaisesCoded(IndexDataset):
    def __getitem__(self, index: int):
        if index == 3:
            raise _Coded("boom", 42)
        return super().__getitem__(index)


def test_the_cause_from_a_worker_keeps_its_type_when_its_init_takes_more_than_the_message(
        ) -> None:
    with ResumableLoader(RaisesCoded(6), batch_size=2, num_workers=1) as loader:
        with pytest.raises(_Coded) as info:
            list(loader)
    cause = info.value.__cause__
    assert type(cause) is _Coded and cause.args == ("boom",) and cause.code == 42
    assert info.value.code == 42 and info.value.index == 3


class _Holding(Exception):
    """An error that keeps what it failed on: an attribute that does not pickle."""

    def __init__(self, message: str) -> None:
        super().__init__(message)
        self.connection = threading.Lock()


class RaisesHolding(IndexDataset):
    def __getitem__(self, index: int):
        if index == 3:
            raise _Holding("HTTP 503")
        return super().__getitem__(index)


@pytest.mark.parametrize("backend", ["process", "thread"])
def test_an_error_holding_what_does_not_pickle_keeps_its_type_and_sample(backend: str) -> None:
    """A process sends it without that attribute (it used to send only a ``TypeError`` about
    pickling); a thread sends nothing, so the original stays whole, its cause too."""
    with ResumableLoader(RaisesHolding(6), batch_size=2, num_workers=2,
                         backend=backend) as loader:
        with pytest.raises(_Holding) as info:
            list(loader)
    error = info.value
    assert isinstance(error, SampleFetchError) and error.index == 3 and error.worker is not None
    assert "_Holding in sample index 3" in str(error) and "HTTP 503" in str(error)
    if backend == "thread":
        assert isinstance(error.__cause__, _Holding) and error.connection is not None
    else:
        assert not hasattr(error, "connection")


class ParseError(Exception):
    """Its ``__str__`` raises on a record that is not UTF-8."""

    def __str__(self) -> str:
        return "bad record " + self.args[0].decode()


class Unprintable(IndexDataset):
    def __getitem__(self, index: int):
        if index == 5:
            raise ParseError(b"\xff\xfe")
        return super().__getitem__(index)


@pytest.mark.parametrize(("backend", "workers"), [("process", 0), ("process", 2), ("thread", 2)])
@pytest.mark.parametrize("on_error", ["raise", "skip"])
def test_an_error_whose_str_raises_keeps_its_type_and_sample(backend, workers, on_error) -> None:
    """Our message said ``{exc}``: formatting it raised, and the user's error was lost."""
    with ResumableLoader(Unprintable(8), batch_size=2, num_workers=workers, backend=backend,
                         on_error=on_error) as loader:
        if on_error == "skip":
            assert [i for batch in loader for i in indices(batch)] == [0, 1, 2, 3, 4, 6, 7]
            assert loader.skipped[0].error == "ParseError: <exception str() failed>"
            return
        with pytest.raises(ParseError) as info:
            list(loader)
    assert info.value.index == 5 and "ParseError in sample index 5" in str(info.value)
    assert "<exception str() failed>" in str(info.value)


def _bad_collate(samples):
    raise ValueError("ragged shapes")


class BatchedFails(IndexDataset):
    """Fetches whole batches with ``__getitems__``; samples 5 and 6 fail."""

    def __getitem__(self, index: int):
        if index in (5, 6):
            raise OSError(f"corrupt file {index}")
        return super().__getitem__(index)

    def __getitems__(self, batch: list[int]):
        return [self[i] for i in batch]


@pytest.mark.parametrize("workers", [0, 1])
def test_batch_level_failures_name_the_call_and_the_batch(workers) -> None:
    loader = ResumableLoader(IndexDataset(8), batch_size=4, collate_fn=_bad_collate,
                             num_workers=workers)
    with pytest.raises(SampleFetchError) as info:
        list(loader)
    assert info.value.index is None and info.value.batch == 0
    assert "ValueError in collate_fn of batch 0 (dataset indices [0, 1, 2, 3])" in str(info.value)
    with pytest.raises(SampleFetchError, match=r"OSError in __getitems__ of batch 1 "):
        list(ResumableLoader(BatchedFails(8), batch_size=4, num_workers=workers))
    loader.close()


def _failing_init(worker) -> None:
    if worker.id == 1:
        raise OSError("cannot open the database")


def test_worker_init_fn_errors_name_the_worker_and_keep_the_cursor() -> None:
    loader = ResumableLoader(IndexDataset(12), batch_size=2, num_workers=2,
                             worker_init_fn=_failing_init, rank=0, world_size=1)
    loader.set_epoch(3)
    iterator = iter(loader)
    next(iterator)  # batch 0 comes from worker 0; batch 1 from worker 1, which failed
    with pytest.raises(WorkerInitError) as info:
        next(iterator)
    error = info.value
    assert (error.worker, error.rank, error.epoch, error.cause_type) == (1, 0, 3, "OSError")
    assert isinstance(error, OSError), "except OSError: around the loop catches it, as torch's"
    assert isinstance(error.__cause__, OSError) and error.pid != os.getpid()
    assert "OSError in worker_init_fn of worker 1 (pid" in str(error)
    assert "on rank 0, starting epoch 3: cannot open the database" in str(error)
    assert "_failing_init" in error.worker_traceback
    assert loader.state_dict()["batches"] == 1
    # A retry starts new workers from the cursor: batch 1 now falls to worker 0, batch 2 to the
    # new worker 1, whose worker_init_fn fails again.
    assert indices(next(iterator)) == [2, 3]
    with pytest.raises(WorkerInitError) as again:
        next(iterator)
    assert again.value.worker == 1 and loader.state_dict()["batches"] == 2
    loader.close()


# -- on_error="skip" -----------------------------------------------------------------------


def _bad(index: int) -> bool:
    return index % 7 == 3


class SomeFail(IndexDataset):
    def __getitem__(self, index: int):
        if _bad(index):
            raise ValueError(f"corrupt sample {index}")
        return super().__getitem__(index)


class SomeFailBatched(SomeFail):
    def __getitems__(self, batch: list[int]):
        return [self[i] for i in batch]


class SomeFailBatchedOnly(torch.utils.data.Dataset):
    """Only ``__getitems__`` (``DataLoader`` never calls ``__getitem__`` then): skipping asks
    it again for each sample of a failing batch."""

    def __init__(self, n: int) -> None:
        self.inner = SomeFail(n)

    def __len__(self) -> int:
        return len(self.inner)

    def __getitems__(self, batch: list[int]):
        return [self.inner[i] for i in batch]


def _skipping(dataset, workers: int = 0, **kwargs) -> ResumableLoader:
    return ResumableLoader(dataset, batch_size=4, shuffle=True, seed=2, num_workers=workers,
                           on_error="skip", **kwargs)


@pytest.mark.parametrize("dataset", [SomeFail, SomeFailBatched, SomeFailBatchedOnly])
@pytest.mark.parametrize("workers", [0, 2])
def test_skip_leaves_out_exactly_the_failing_samples_and_reports_them(dataset, workers) -> None:
    n = 30
    with _skipping(dataset(n), workers) as loader:
        batches = run_epochs(loader, range(2), key=indices)
        expected_skips = [i for e in range(2) for i in
                          ShuffledOrder(n, 2).indices(e, np.arange(n)).tolist() if _bad(i)]
        assert loader.skipped_indices == expected_skips
        assert loader.num_skipped == len(expected_skips) == 8
        assert all(s.error.startswith("ValueError: corrupt sample") for s in loader.skipped)
        assert loader.state_dict()["parts"]["skipped"] == 8
    for epoch in batches:
        assert sorted(i for b in epoch for i in b) == [i for i in range(n) if not _bad(i)]
        assert len(epoch) == len(loader) and min(len(b) for b in epoch) < 4


def test_skipping_is_deterministic_and_a_resume_skips_the_same_samples() -> None:
    def make() -> ResumableLoader:
        return _skipping(SomeFail(30))

    full = check_resume_at_every_step(make, epochs=2, key=indices)
    assert full == run_epochs(_skipping(SomeFail(30), workers=2), range(2), key=indices)
    snapshots: list[Snapshot] = []
    run_epochs(make(), range(2), key=indices, snapshots=snapshots)
    delivered = [b for e in full for b in e]
    plan = [b for e in run_epochs(_skipping(IndexDataset(30)), range(2), key=indices) for b in e]
    for k, snap in enumerate(snapshots):  # the saved count: the skips before the cursor
        assert snap.state["parts"]["skipped"] == sum(
            len(planned) - len(got) for planned, got in zip(plan[:k + 1], delivered[:k + 1],
                                                            strict=True))
    resumed = make()
    resumed.load_state_dict(snapshots[5].state)
    run_epochs(resumed, range(2))
    assert resumed.num_skipped == 8, "the count carries over a resume"
    assert len(resumed.skipped) < 8, "the records are this process's history"


class WholeBatchFails(IndexDataset):
    def __getitem__(self, index: int):
        if index in (2, 3):
            raise RuntimeError("both samples of batch 1 are corrupt")
        return super().__getitem__(index)


@pytest.mark.parametrize("workers", [0, 1])
def test_a_batch_with_every_sample_skipped_is_not_delivered_but_counted(workers) -> None:
    def make() -> ResumableLoader:
        return ResumableLoader(WholeBatchFails(8), batch_size=2, num_workers=workers,
                               on_error="skip")

    full = check_resume_at_every_step(make, epochs=1, key=indices)
    assert full == [[[0, 1], [4, 5], [6, 7]]]
    with make() as loader:
        iterator = iter(loader)
        next(iterator)
        next(iterator)
        assert loader.state_dict()["batches"] == 3 and loader.num_skipped == 2


@pytest.mark.parametrize("workers", [0, 1])
def test_on_several_ranks_a_batch_with_every_sample_skipped_is_refused(workers) -> None:
    """Left out, it would leave that rank a batch short of the others: a DDP step would
    wait for it forever. The rank whose batch still has samples delivers it."""
    def make(rank: int) -> ResumableLoader:
        return ResumableLoader(WholeBatchFails(8), batch_size=2, num_workers=workers,
                               on_error="skip", rank=rank, world_size=2)

    assert [indices(b) for b in make(0)] == [[0, 1], [4, 5]]
    with make(1) as loader:
        with pytest.raises(SampleFetchError, match=r"every sample of batch 0 \(epoch 0\) "
                           r"failed on rank 1.*index 3: RuntimeError.*wait for it") as caught:
            next(iter(loader))
        assert (caught.value.batch, caught.value.rank, caught.value.cause_type) == (
            0, 1, "RuntimeError")
        assert loader.state_dict()["batches"] == 0 and loader.num_skipped == 0


def test_skip_still_raises_collate_errors() -> None:
    with pytest.raises(SampleFetchError, match="collate_fn"):
        list(ResumableLoader(SomeFail(10), batch_size=4, on_error="skip",
                             collate_fn=_bad_collate))


def test_a_corrupted_skip_count_in_a_state_is_refused() -> None:
    loader = _skipping(SomeFail(10))
    state = loader.state_dict()
    with pytest.raises(StateMismatchError, match=r"parts\['skipped'\]=-1"):
        loader.load_state_dict({**state, "parts": {**state["parts"], "skipped": -1}})
    assert loader.num_skipped == 0
