"""Worker processes: a crashed worker is replaced without losing or repeating a batch, a stalled
one is named, and no worker or shared-memory segment outlives its loader, however the training
ends (normal end, ``del``, an exception, Ctrl-C, SIGTERM)."""

from __future__ import annotations

import logging
import multiprocessing
import os
import random
import signal
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Callable, Iterator
from multiprocessing import forkserver, popen_fork
from pathlib import Path
from typing import Any

import numpy as np
import psutil
import pytest
import torch
from torch.utils.data import Dataset

from lightning_loaders import ResumableLoader, sample_context, worker_info
from lightning_loaders.engines import workers
from lightning_loaders.engines.pool import WorkerLost
from lightning_loaders.errors import WorkerCrashedError, WorkerTimeoutError
from lightning_loaders.sources.shards import SequenceSource
from lightning_loaders.testing import run_epochs
from tests.conftest import IndexDataset, loader_processes
from tests.ddp_harness import REPO
from tests.lightning_harness import RecordingModule, make_trainer
from tests.scripts.chaos_train import TrainingZygote, read_log

LOGGER = "lightning_loaders.loaders.worker_loader"


def indices(batch) -> list[int]:
    return batch["index"].tolist()


def _shm_of(pids: set[int]) -> list[str]:
    """Shared-memory segments torch created for any of ``pids`` that still exist."""
    return [name for name in os.listdir("/dev/shm")
            if name.startswith("torch_") and int(name.split("_")[1]) in pids]


def _assert_all_gone(processes: list[psutil.Process], timeout: float = 20) -> None:
    deadline = time.monotonic() + timeout
    alive = processes
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.1)
    assert not alive, f"worker processes outlived the loader: {alive}"
    assert not _shm_of({p.pid for p in processes} | {os.getpid()})


def _reference(n: int, epochs: int, **kwargs) -> list[list[list[int]]]:
    loader = ResumableLoader(IndexDataset(n), batch_size=4, shuffle=True, seed=6, **kwargs)
    return run_epochs(loader, range(epochs), key=indices)


# -- the process pool itself ---------------------------------------------------------------


class WorkerSeeds:
    """``fetcher[r]``: torch's ``WorkerInfo`` fields and a draw of each global RNG."""

    def __getitem__(self, request: int) -> tuple[Any, ...]:
        info = torch.utils.data.get_worker_info()
        assert info is not None and info.dataset is self  # the worker's copy
        return (info.id, info.num_workers, info.seed, random.random(),
                float(np.random.rand()), float(torch.rand(())), torch.get_num_threads())


def test_workers_are_set_up_as_torchs_are() -> None:
    pool = workers.ProcessPool(WorkerSeeds(), range(2), num_workers=2, seed=1000)
    first, second = list(pool)
    pool.close()
    assert first[:3] == (0, 2, 1000) and second[:3] == (1, 2, 1001)  # base seed + worker id
    assert first[6] == second[6] == 1  # one intra-op thread, as in torch's workers
    for draws in zip(first[3:6], second[3:6], strict=True):  # each worker seeded differently
        assert draws[0] != draws[1]
    again = workers.ProcessPool(WorkerSeeds(), range(2), num_workers=2, seed=1000)
    assert list(again) == [first, second]  # the same seeds again
    again.close()


class Slow:
    """``fetcher[r]`` takes ``delay`` s and appends ``r`` to ``log`` (a file)."""

    def __init__(self, log: Path, delay: float) -> None:
        self.log, self.delay = log, delay

    def __getitem__(self, request: int) -> int:
        time.sleep(self.delay)
        with self.log.open("a") as out:
            out.write(f"{request}\n")
        return request


def test_close_drops_the_requests_no_worker_started(tmp_path) -> None:
    log = tmp_path / "fetched.txt"
    pool = workers.ProcessPool(Slow(log, 0.5), range(100), num_workers=2, prefetch_factor=4,
                               seed=0)
    it = iter(pool)
    assert next(it) == 0
    pool.close()
    fetched = log.read_text().split()
    assert len(fetched) <= 4, fetched  # 0, and at most the one each worker was in
    assert loader_processes() == []


def test_a_killed_worker_is_reported_lost_with_its_exit() -> None:
    pool = workers.ProcessPool(Slow(Path(os.devnull), 0.05), range(20), num_workers=2, seed=0)
    it = iter(pool)
    assert next(it) == 0
    victim = pool.workers[1].process
    os.kill(victim.pid, signal.SIGKILL)
    with pytest.raises(WorkerLost) as caught:
        list(it)
    assert caught.value.workers == [(1, victim.pid, -signal.SIGKILL)]
    pool.close()
    assert loader_processes() == []


def test_a_result_that_cannot_be_pickled_is_an_error_naming_the_worker() -> None:
    class Unpicklable:
        def __getitem__(self, request: int) -> Any:
            return lambda: request

    pool = workers.ProcessPool(Unpicklable(), range(2), num_workers=1, seed=0)
    with pytest.raises(Exception, match="in DataLoader worker process 0, pickling its result"):
        next(iter(pool))
    pool.close()


def test_a_planned_batch_that_cannot_be_pickled_names_the_batch_and_epoch() -> None:
    class Unpicklable(Dataset[Any]):
        def __len__(self) -> int:
            return 8

        def __getitem__(self, index: int) -> Any:
            return threading.Lock()

    loader = ResumableLoader(Unpicklable(), batch_size=2, num_workers=1, collate_fn=list)
    loader.set_epoch(3)
    with pytest.raises(TypeError, match="pickling its result for batch 0 of epoch 3 on rank 0"):
        next(iter(loader))
    loader.close()


@pytest.fixture
def stops_the_fork_server() -> Iterator[None]:
    """Stop the fork server a test started: Python keeps one per process, and a later user
    (``bench_throughput``) would otherwise get it without the modules it asks to preload."""
    yield
    forkserver._forkserver._stop()


@pytest.mark.parametrize("method", ["forkserver", "spawn"])
@pytest.mark.parametrize("ring", [True, False])
def test_workers_started_by_any_method_deliver_the_same_stream(method: str, ring: bool,
                                                               stops_the_fork_server) -> None:
    loader = ResumableLoader(IndexDataset(24), batch_size=4, num_workers=2, shuffle=True, seed=6,
                             multiprocessing_context=method)
    loader.shared_ring = ring
    expected = _reference(24, 1, num_workers=0)[0]
    assert [indices(batch) for batch in loader] == expected
    loader.close()
    assert loader_processes() == []


def test_idle_workers_started_by_a_fork_server_keep_serving(stops_the_fork_server) -> None:
    """A fork server is the workers' parent: idle past ``WATCH_S`` (a slow training step, a
    pause between epochs), they must not take it for their parent's death and exit."""
    loader = ResumableLoader(IndexDataset(16), batch_size=4, num_workers=2,
                             multiprocessing_context="forkserver")
    first = [indices(batch) for batch in loader]
    processes = [worker.process for worker in loader._pool.workers]
    time.sleep(2 * workers.WATCH_S)
    assert all(process.is_alive() for process in processes)
    assert [indices(batch) for batch in loader] == first
    assert loader.worker_restarts == 0
    assert [worker.process for worker in loader._pool.workers] == processes
    loader.close()


def _pool_then_wait(log: Path) -> None:
    pool = workers.ProcessPool(Slow(log, 0.0), range(4), num_workers=2, seed=0)
    assert len(list(pool)) == 4
    log.write_text(" ".join(str(w.process.pid) for w in pool.workers))
    threading.Event().wait()


def test_workers_exit_when_their_parent_is_killed(tmp_path) -> None:
    log = tmp_path / "pids.txt"
    parent = multiprocessing.get_context("fork").Process(target=_pool_then_wait, args=(log,))
    parent.start()
    deadline = time.monotonic() + 30
    while not log.exists() or not log.read_text().startswith(tuple("123456789")):
        assert time.monotonic() < deadline and parent.is_alive()
        time.sleep(0.05)
    pids = [int(pid) for pid in log.read_text().split()]
    children = [psutil.Process(pid) for pid in pids]
    os.kill(parent.pid, signal.SIGKILL)
    parent.join()
    _assert_all_gone(children)


_FORK_MID_EPOCH = textwrap.dedent("""
    import gc, os, sys, time
    import torch
    from lightning_loaders import ResumableLoader

    class Slow(torch.utils.data.Dataset):
        def __len__(self): return 32
        def __getitem__(self, i): time.sleep(0.005); return i

    loader = ResumableLoader(Slow(), batch_size=4, num_workers=2, backend=sys.argv[1],
                             max_worker_restarts=0)
    got = []
    for k, batch in enumerate(loader):
        got += batch.tolist()
        if k == 2:
            start = time.monotonic()
            pid = os.fork()
            if pid == 0:  # a process the user forks: it cleans up and exits normally
                gc.collect()
                loader.close()
                sys.exit(0)
            os.waitpid(pid, 0)
            print(f"child {time.monotonic() - start:.1f}")
    assert sorted(got) == list(range(32)), got
    print("ok")
""")


@pytest.mark.parametrize("backend", ["process", "thread"])
def test_a_process_forked_from_the_owner_never_stops_its_workers(backend: str) -> None:
    """A child of ``os.fork()`` has copies of the pools: closing them, or exiting (atexit,
    multiprocessing's termination of its daemon children), must leave the owner's workers
    alone, and a child never waits for threads it does not have."""
    done = subprocess.run([sys.executable, "-c", _FORK_MID_EPOCH, backend], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and done.stdout.endswith("ok\n"), (
        done.stdout + done.stderr[-3000:])
    assert float(done.stdout.split()[1]) < 5 and "Exception ignored" not in done.stderr


# -- crash recovery ------------------------------------------------------------------------


@pytest.mark.parametrize(("when", "persistent"), [
    ("mid-epoch", True), ("mid-epoch", False), ("both workers", True), ("between epochs", True),
])
def test_a_killed_worker_is_replaced_and_no_batch_is_lost_or_repeated(persistent, when, caplog):
    expected = _reference(40, 2)
    loader = ResumableLoader(IndexDataset(40), batch_size=4, shuffle=True, seed=6,
                             num_workers=2, persistent_workers=persistent)
    got: list[list[list[int]]] = []
    killed: list[int] = []
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        for epoch in range(2):
            loader.sampler.set_epoch(epoch)
            got.append([])
            iterator = iter(loader)
            if when == "between epochs" and epoch == 1:
                # the persistent workers idle between epochs
                killed.append(loader_processes()[0].pid)
                os.kill(killed[-1], signal.SIGKILL)
            for batch in iterator:
                got[-1].append(indices(batch))
                if epoch == 0 and len(got[-1]) == 3 and when != "between epochs":
                    workers = loader_processes()
                    for process in workers if when == "both workers" else workers[:1]:
                        killed.append(process.pid)
                        process.send_signal(signal.SIGKILL)
    assert got == expected
    restarts = [r.getMessage() for r in caplog.records if "restarting 2 workers" in r.getMessage()]
    assert loader.worker_restarts == len(restarts) == 1
    assert "was killed by SIGKILL" in restarts[0]
    assert any(f"(pid {pid})" in restarts[0] for pid in killed)
    assert "DataLoader worker 0 " in restarts[0] or "DataLoader worker 1 " in restarts[0]
    loader.close()
    assert loader_processes() == []


class ExitsOncePerEpoch(IndexDataset):
    """The worker fetching sample 5 exits (code 3) the first time it does so in each epoch."""

    def __init__(self, n: int, marks: Path) -> None:
        super().__init__(n)
        self.marks = marks

    def __getitem__(self, index: int):
        mark = self.marks / f"epoch{sample_context().epoch}"
        if index == 5 and not mark.exists():
            mark.touch()
            os._exit(3)
        return super().__getitem__(index)


def test_restarts_are_bounded_per_epoch_and_the_stream_stays_exact(tmp_path, caplog) -> None:
    loader = ResumableLoader(ExitsOncePerEpoch(30, tmp_path), batch_size=4, shuffle=True,
                             seed=6, num_workers=2, max_worker_restarts=1)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = run_epochs(loader, range(3), key=indices)
    assert got == _reference(30, 3)
    warnings = [r.getMessage() for r in caplog.records if "restarting" in r.getMessage()]
    assert len(warnings) == loader.worker_restarts == 3
    assert all("exited with code 3" in w and "restart 1 of at most 1" in w for w in warnings)
    loader.close()


class AlwaysExits(IndexDataset):
    def __getitem__(self, index: int):
        if index == 5:
            os._exit(3)
        return super().__getitem__(index)


def test_a_crash_that_repeats_gives_up_after_max_worker_restarts() -> None:
    loader = ResumableLoader(AlwaysExits(12), batch_size=4, num_workers=2,
                             max_worker_restarts=2)
    iterator = iter(loader)
    assert indices(next(iterator)) == [0, 1, 2, 3]
    with pytest.raises(WorkerCrashedError) as info:
        next(iterator)
    error = info.value
    assert (error.exitcode, error.signal, error.restarts, error.batch, error.epoch) == (
        3, None, 2, 1, 0)
    assert error.worker in (0, 1) and error.pid not in (None, os.getpid())
    assert "exited with code 3" in str(error) and "gave up after 2 restarts" in str(error)
    assert "says why on stderr" in str(error) and "memory" not in str(error)
    assert "spawn" not in str(error)  # forked workers import nothing
    assert loader.state_dict()["batches"] == 1
    assert loader_processes() == []


def test_spawned_workers_that_keep_exiting_point_at_importing_the_main_module(
        stops_the_fork_server) -> None:
    loader = ResumableLoader(AlwaysExits(12), batch_size=4, num_workers=1,
                             max_worker_restarts=1, multiprocessing_context="forkserver")
    with pytest.raises(WorkerCrashedError, match=r"exited with code 3 .* gave up after 1 "
                       r"restarts.*says why on stderr.*'spawn' or 'forkserver' first imports "
                       r"the main module"):
        list(loader)
    loader.close()


def test_with_recovery_off_a_killed_worker_raises_at_once_naming_worker_pid_and_signal() -> None:
    loader = ResumableLoader(IndexDataset(40), batch_size=4, num_workers=2,
                             max_worker_restarts=0)
    iterator = iter(loader)
    next(iterator)
    victim = loader_processes()[0]
    victim.send_signal(signal.SIGKILL)
    with pytest.raises(WorkerCrashedError) as info:
        for _ in range(10):
            next(iterator)
    error = info.value
    assert (error.pid, error.signal, error.exitcode, error.restarts) == (
        victim.pid, "SIGKILL", -signal.SIGKILL, 0)
    message = str(error)
    assert f"DataLoader worker {error.worker} (pid {victim.pid}) was killed by SIGKILL" in message
    assert "max_worker_restarts=0" in message
    assert loader_processes() == []


# -- a worker wedged at its fork ----------------------------------------------------------


class _WedgesOnStart(multiprocessing.context.ForkProcess):
    """A forked process; the ``wedge``-th one started blocks forever before its target runs,
    as a child does that inherited a lock another thread held at the fork (gh-112275)."""

    started = 0
    wedge = 1

    def start(self) -> None:  # in the parent
        type(self).started += 1
        self.wedged = type(self).started == type(self).wedge
        super().start()

    def run(self) -> None:  # in the child
        if self.wedged:
            threading.Event().wait()
        super().run()


class WedgingContext(multiprocessing.context.ForkContext):
    Process = _WedgesOnStart


@pytest.fixture
def wedging(monkeypatch) -> WedgingContext:
    monkeypatch.setattr(workers, "START_S", 0.5)
    monkeypatch.setattr(_WedgesOnStart, "started", 0)
    monkeypatch.setattr(_WedgesOnStart, "wedge", 1)
    return WedgingContext()


def _wedge_case(kind: str, **kwargs) -> tuple[ResumableLoader, Callable[[Any], list[int]]]:
    """A loader over 40 samples, map-style or sharded, and how to read a batch's samples."""
    if kind == "map-style":
        return ResumableLoader(IndexDataset(40), batch_size=4, shuffle=True, seed=6,
                               **kwargs), indices
    shards = SequenceSource([list(range(0, 13)), list(range(13, 20)), list(range(20, 40))])
    return ResumableLoader(shards, batch_size=4, shuffle=True, shuffle_buffer=4, seed=6,
                           **kwargs), torch.Tensor.tolist


@pytest.mark.parametrize(("kind", "wedge"), [("map-style", 1), ("map-style", 2), ("sharded", 1)])
def test_a_worker_that_never_starts_is_restarted_and_nothing_is_lost(wedging, kind, wedge,
                                                                      caplog, monkeypatch):
    monkeypatch.setattr(_WedgesOnStart, "wedge", wedge)
    reference, key = _wedge_case(kind, num_workers=2)
    loader, _ = _wedge_case(kind, num_workers=2, multiprocessing_context=wedging, timeout=10)
    with caplog.at_level(logging.WARNING, logger=LOGGER):
        got = run_epochs(loader, range(2), key=key)
    assert got == run_epochs(reference, range(2), key=key)
    reference.close()
    restarts = [r.getMessage() for r in caplog.records if "restarting 2 workers" in r.getMessage()]
    assert loader.worker_restarts == len(restarts) == 1
    assert f"DataLoader worker {wedge - 1} " in restarts[0]
    assert "did not start within 0.5 s of its fork" in restarts[0]
    assert _WedgesOnStart.started == 4  # the first two, then two after the restart
    loader.close()
    assert loader_processes() == []


def test_with_recovery_off_a_worker_that_never_starts_raises_and_is_killed(wedging) -> None:
    loader = ResumableLoader(IndexDataset(40), batch_size=4, num_workers=2,
                             multiprocessing_context=wedging, max_worker_restarts=0, timeout=10)
    with pytest.raises(WorkerCrashedError) as info:
        next(iter(loader))
    error = info.value
    assert (error.worker, error.batch, error.epoch, error.restarts) == (0, 0, 0, 0)
    assert f"DataLoader worker 0 (pid {error.pid}) did not start within 0.5 s" in str(error)
    assert not psutil.pid_exists(error.pid) or psutil.Process(error.pid).status() == \
        psutil.STATUS_ZOMBIE
    assert loader_processes() == []


# -- Ctrl-C at a worker's fork -------------------------------------------------------------


class _CtrlCAfterFork(popen_fork.Popen):
    """A fork followed, in the parent, by Ctrl-C (a real SIGINT) at the ``at``-th fork (from
    0), before ``Process.start()`` has recorded the child or returned."""

    forks = 0
    at = 0

    def _launch(self, process_obj: Any) -> None:
        super()._launch(process_obj)  # returns in the parent only
        type(self).forks += 1
        if type(self).forks == type(self).at + 1:
            os.kill(os.getpid(), signal.SIGINT)


class _InterruptedAtFork(multiprocessing.context.ForkProcess):
    @staticmethod
    def _Popen(process_obj: Any) -> _CtrlCAfterFork:
        return _CtrlCAfterFork(process_obj)


class InterruptingContext(multiprocessing.context.ForkContext):
    Process = _InterruptedAtFork


@pytest.mark.parametrize("worker", [0, 1])
def test_a_ctrl_c_right_after_a_workers_fork_leaves_no_worker_behind(worker, ctrl_c,
                                                                      monkeypatch) -> None:
    """The worker whose fork Ctrl-C follows was not yet the pool's: ``close()`` never stopped
    it, and it slept until the training process exited. The ``KeyboardInterrupt`` comes once
    it is registered, every worker started is stopped, and the loader then reads the epoch."""
    monkeypatch.setattr(_CtrlCAfterFork, "forks", 0)
    monkeypatch.setattr(_CtrlCAfterFork, "at", worker)
    reference = _reference(40, 1, num_workers=0)
    loader = ResumableLoader(IndexDataset(40), batch_size=4, shuffle=True, seed=6,
                             num_workers=2, multiprocessing_context=InterruptingContext())
    with pytest.raises(KeyboardInterrupt):
        next(iter(loader))
    assert _CtrlCAfterFork.forks == worker + 1
    assert loader_processes() == []
    assert run_epochs(loader, range(1), key=indices) == reference
    loader.close()
    assert loader_processes() == []


def test_workers_started_by_spawn_are_not_timed(monkeypatch) -> None:
    """A spawned child imports everything afresh (seconds) and cannot inherit a held lock."""
    monkeypatch.setattr(workers, "START_S", 0.0)
    loader = ResumableLoader(IndexDataset(8), batch_size=4, num_workers=2,
                             multiprocessing_context="spawn")
    assert [indices(batch) for batch in loader] == [[0, 1, 2, 3], [4, 5, 6, 7]]
    assert loader.worker_restarts == 0
    loader.close()


# -- timeout -------------------------------------------------------------------------------


class StallsInWorkerOne(IndexDataset):
    def __getitem__(self, index: int):
        info = worker_info()
        if info is not None and info.id == 1:
            time.sleep(1.5)
        return super().__getitem__(index)


def test_a_timeout_names_the_worker_that_stalled() -> None:
    loader = ResumableLoader(StallsInWorkerOne(20), batch_size=2, num_workers=2, timeout=0.5)
    iterator = iter(loader)
    assert indices(next(iterator)) == [0, 1]  # from worker 0
    pids = {p.pid for p in loader_processes()}
    with pytest.raises(WorkerTimeoutError) as info:
        next(iterator)  # batch 1 is worker 1's
    error = info.value
    assert (error.worker, error.batch, error.epoch, error.timeout) == (1, 1, 0, 0.5)
    assert error.pid in pids
    assert f"DataLoader worker 1 (pid {error.pid}) stalled: batch 1 of epoch 0" in str(error)
    assert loader_processes() == []


class MarksAfterAStall(IndexDataset):
    """Sample 2 sleeps, then leaves a mark: the mark says whether its fetch was waited for."""

    def __init__(self, n: int, mark: str) -> None:
        super().__init__(n)
        self.mark = mark

    def __getitem__(self, index: int):
        if index == 2:
            time.sleep(2.0)
            open(self.mark, "w").close()
        return super().__getitem__(index)


def test_a_stalled_worker_is_killed_at_once_not_waited_for(tmp_path) -> None:
    """The error comes at ``timeout``, not after the stalled fetch ends (close() would
    otherwise wait for it, up to JOIN_S)."""
    mark = tmp_path / "fetched"
    loader = ResumableLoader(MarksAfterAStall(8, str(mark)), batch_size=2, num_workers=2,
                             timeout=0.5)
    iterator = iter(loader)
    next(iterator)
    with pytest.raises(WorkerTimeoutError):
        next(iterator)
    assert not mark.exists()
    assert loader_processes() == []


# -- shutdown ------------------------------------------------------------------------------


@pytest.fixture
def file_system_sharing() -> Iterator[None]:
    """Tensors from workers in named /dev/shm files, so that a leak would be visible."""
    before = torch.multiprocessing.get_sharing_strategy()
    torch.multiprocessing.set_sharing_strategy("file_system")
    yield
    torch.multiprocessing.set_sharing_strategy(before)


def test_workers_stop_at_epoch_end_unless_persistent_and_on_close(file_system_sharing) -> None:
    transient = ResumableLoader(IndexDataset(16), batch_size=4, num_workers=2,
                                persistent_workers=False)
    assert len(list(transient)) == 4 and loader_processes() == []

    loader = ResumableLoader(IndexDataset(16), batch_size=4, num_workers=2)
    batches = list(loader)
    workers = loader_processes()
    assert len(workers) == 2, "persistent workers wait for the next epoch"
    del batches
    loader.close()
    _assert_all_gone(workers)

    with ResumableLoader(IndexDataset(16), batch_size=4, num_workers=2) as loader:
        next(iter(loader))
        workers = loader_processes()
    _assert_all_gone(workers)


def test_del_stops_the_workers_mid_epoch(file_system_sharing) -> None:
    loader = ResumableLoader(IndexDataset(16), batch_size=4, num_workers=2)
    iterator = iter(loader)
    batch = next(iterator)
    workers = loader_processes()
    assert len(workers) == 2
    del loader, iterator, batch
    _assert_all_gone(workers, timeout=5)


class FailsAtStep(RecordingModule):
    def training_step(self, batch, batch_idx):
        if batch_idx == 2:
            raise ValueError("the model failed")
        return super().training_step(batch, batch_idx)


def test_a_trainer_stops_the_workers_at_the_end_of_fit_and_on_an_exception(tmp_path) -> None:
    loader = ResumableLoader(IndexDataset(20), batch_size=4, num_workers=2)
    make_trainer(tmp_path, 2).fit(RecordingModule(), loader)
    assert loader_processes() == [], "fit's teardown must stop the workers (the loader lives on)"
    with pytest.raises(ValueError, match="the model failed"):
        make_trainer(tmp_path, 2).fit(FailsAtStep(), loader)
    assert loader_processes() == []
    assert not _shm_of({os.getpid()})


@pytest.fixture(scope="module")
def zygote() -> Iterator[TrainingZygote]:
    forks = TrainingZygote()
    yield forks
    forks.close()


@pytest.mark.parametrize(("how", "trainer", "status"), [
    ("ctrl-c", True, 1),  # Lightning exits with 1 after a KeyboardInterrupt
    ("sigterm", True, 1),  # Lightning raises SIGTERMException after the step
    ("sigterm", False, -signal.SIGTERM),  # a plain loop dies at once: its workers notice
])
def test_no_worker_outlives_a_training_process_stopped_by_a_signal(zygote, tmp_path, how,
                                                                  trainer, status) -> None:
    log = tmp_path / "steps.jsonl"
    pid = zygote.start(kind="map", out=str(tmp_path), log=str(log), epochs=100,
                       trainer=trainer, step_sleep=0.02)
    while len(read_log(log)) < 5:
        time.sleep(0.01)
    tree = [psutil.Process(pid), *psutil.Process(pid).children(recursive=True)]
    assert len(tree) == 3, "the training process and its 2 workers"
    if how == "ctrl-c":
        os.killpg(pid, signal.SIGINT)  # what a terminal sends the foreground process group
    else:
        os.kill(pid, signal.SIGTERM)
    assert zygote.wait(pid) == status, (tmp_path / f"output-{pid}.txt").read_text()
    _assert_all_gone(tree)
