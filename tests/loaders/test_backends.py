"""``backend="process" | "thread" | "auto"``: the same stream, per-sample RNG and state under
every backend and worker count; worker context, errors, timeout, ``on_error`` and shutdown
keep their meaning under threads; ``auto`` never changes the data."""

from __future__ import annotations

import gc
import os
import random
import threading
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import IterableDataset, get_worker_info

from lightning_loaders import AutotuneConfig, ResumableLoader, sample_rng, worker_info
from lightning_loaders.engines import threads
from lightning_loaders.errors import SampleFetchError, WorkerTimeoutError
from lightning_loaders.sources.shards import (
    GeneratorSource,
    RecordFiles,
    SequenceSource,
    write_records,
)
from lightning_loaders.testing import check_resume_at_every_step, run_epochs, to_plain
from tests.conftest import loader_processes
from tests.lightning_harness import check_trainer_resume

BACKENDS = ["process", "thread", "auto"]
WORKERS = [0, 1, 2, 3]


class RngDataset(torch.utils.data.Dataset[dict[str, Any]]):
    """Sample ``i``: its index and a draw from ``sample_rng()`` (the per-sample RNG)."""

    def __init__(self, n: int, slow: int = 0, pause: float = 0.02) -> None:
        self.n = n
        self.slow = slow  # every slow-th sample sleeps a little (out-of-order delivery)
        self.pause = pause

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        if self.slow and index % self.slow == 0:
            time.sleep(self.pause)
        return {"index": index, "draw": int(sample_rng().integers(1 << 30))}


def _pool_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("lightning_loaders worker")]


def _map_loader(backend: str, workers: int, **kwargs: Any) -> ResumableLoader:
    options: dict[str, Any] = {"batch_size": 4, "shuffle": True, "seed": 5}
    options.update(kwargs)
    dataset = RngDataset(options.pop("n", 30), options.pop("slow", 0))
    return ResumableLoader(dataset, num_workers=workers,
                           backend=backend, **options)


def _epochs(loader: ResumableLoader, epochs: int = 2) -> list[list[Any]]:
    try:
        return run_epochs(loader, range(epochs))
    finally:
        loader.close()


@pytest.fixture(scope="module")
def map_reference() -> dict[str, list[list[Any]]]:
    return {"batched": _epochs(_map_loader("process", 0)),
            "unbatched": _epochs(_map_loader("process", 0, batch_size=None, n=9))}


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("backend", BACKENDS)
def test_map_style_stream_and_sample_rng_are_the_same_for_every_backend(
        backend: str, workers: int, map_reference: dict[str, list[list[Any]]]) -> None:
    assert _epochs(_map_loader(backend, workers)) == map_reference["batched"]
    unbatched = _map_loader(backend, workers, batch_size=None, n=9)
    assert _epochs(unbatched) == map_reference["unbatched"]
    assert _pool_threads() == []


class MixedDtypes(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Samples whose tensors differ in dtype within a batch: ``halves`` is an int for most
    samples and ``i + 0.5`` (float32) for some, after an int in its batch; ``precise`` is
    float32 or float64."""

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        half = torch.tensor([index + 0.5]) if index % 4 == 1 else torch.tensor([index])
        precise = torch.tensor([index / 3], dtype=torch.float64 if index % 2 else torch.float32)
        return {"halves": half, "precise": precise}


def _typed(batch: dict[str, torch.Tensor]) -> dict[str, Any]:
    return {key: (str(value.dtype), value.flatten().tolist()) for key, value in batch.items()}


@pytest.mark.parametrize("workers", [1, 2])
@pytest.mark.parametrize("backend", ["process", "thread"])
def test_samples_of_mixed_dtypes_collate_as_in_the_main_process(backend: str,
                                                                 workers: int) -> None:
    """``default_collate`` promotes mixed dtypes in the main process (``torch.stack``), but in
    a torch worker process it stacks into the first sample's dtype: 1.5 after an int became 1,
    and float64 values were rounded to float32. Every backend and worker count now gives the
    main process's values."""
    expected = [_typed(b) for b in ResumableLoader(MixedDtypes(), batch_size=4)]
    assert expected[0]["halves"] == ("torch.float32", [0.0, 1.5, 2.0, 3.0])
    assert expected[0]["precise"][0] == "torch.float64"
    loader = ResumableLoader(MixedDtypes(), batch_size=4, num_workers=workers, backend=backend)
    assert [_typed(b) for b in loader] == expected
    loader.close()


@pytest.mark.parametrize("workers", [1, 3])
@pytest.mark.parametrize("backend", BACKENDS)
def test_out_of_order_delivers_each_batch_once_and_resumes_exactly(
        backend: str, workers: int, map_reference: dict[str, list[list[Any]]]) -> None:
    expected = map_reference["batched"]
    states: list[dict[str, Any]] = []
    loader = _map_loader(backend, workers, in_order=False, slow=5)
    first: list[Any] = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        got = []
        for batch in loader:
            got.append(to_plain(batch))
            if epoch == 0:
                states.append(loader.state_dict())
        assert _sorted(got) == _sorted(expected[epoch])
        first.append(got)
    loader.close()
    for step, state in enumerate(states[:-1]):
        resumed = _map_loader(backend, workers, in_order=False, slow=5)
        resumed.load_state_dict(state)
        rest = _epochs(resumed, 1)[0]
        assert _sorted(first[0][:step + 1] + rest) == _sorted(expected[0]), step


def _sorted(batches: list[Any]) -> list[Any]:
    return sorted(batches, key=repr)


class SplitsByWorker(IterableDataset[int]):
    """A plain iterable dataset that splits itself by worker (torch's documented pattern)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Any:
        info = get_worker_info()
        if info is None:
            return iter(range(self.n))
        return iter(range(info.id, self.n, info.num_workers))

    def __len__(self) -> int:
        return self.n


class UnknownLengths(SequenceSource[int]):
    @property
    def shard_lengths(self) -> None:
        return None


def _iterable(kind: str) -> Any:
    shards = [list(range(s * 10, s * 10 + n)) for s, n in enumerate([7, 5, 9, 6])]
    if kind == "known":
        return SequenceSource(shards)
    if kind == "unknown":
        return UnknownLengths(shards)
    return SplitsByWorker(27)


def _iterable_loader(kind: str, backend: str, workers: int) -> ResumableLoader:
    return ResumableLoader(_iterable(kind), batch_size=3, shuffle=kind != "plain", seed=2,
                           num_workers=workers, backend=backend)


@pytest.mark.parametrize("workers", WORKERS)
@pytest.mark.parametrize("kind", ["known", "unknown", "plain"])
def test_iterable_stream_is_the_same_for_every_backend(kind: str, workers: int) -> None:
    expected = _epochs(_iterable_loader(kind, "process", workers))
    assert sorted(i for batch in expected[0] for i in batch) == sorted(
        i for shard in ([list(range(27))] if kind == "plain" else _iterable(kind).sequences)
        for i in shard)
    for backend in ("thread", "auto"):
        assert _epochs(_iterable_loader(kind, backend, workers)) == expected, backend
    assert _pool_threads() == []
    assert "RANK" not in os.environ and "WORLD_SIZE" not in os.environ  # the view is undone


def test_resume_at_every_step_under_threads() -> None:
    check_resume_at_every_step(lambda: _map_loader("thread", 2, n=18), epochs=2)
    check_resume_at_every_step(lambda: _iterable_loader("unknown", "thread", 2), epochs=2)
    check_resume_at_every_step(lambda: _iterable_loader("plain", "thread", 2), epochs=1)
    _no_threads_after_collection()  # the check drops its loaders without closing them


def _no_threads_after_collection() -> None:
    gc.collect()
    for _ in range(200):
        if not _pool_threads():
            return
        time.sleep(0.05)
    assert _pool_threads() == []


@pytest.mark.parametrize(("saved", "resumed"), [("process", "thread"), ("thread", "process")])
def test_a_state_saved_under_one_backend_resumes_under_another(saved: str, resumed: str
                                                              ) -> None:
    for make in (lambda b: _map_loader(b, 2), lambda b: _iterable_loader("known", b, 2)):
        full = _epochs(make(saved))
        loader = make(saved)
        loader.sampler.set_epoch(0)
        it = iter(loader)
        head = [to_plain(next(it)) for _ in range(3)]
        state = loader.state_dict()
        loader.close()
        other = make(resumed)
        other.load_state_dict(state)
        rest = run_epochs(other, range(0, 2))
        other.close()
        assert head + rest[0] == full[0] and rest[1] == full[1]


class Introspects(torch.utils.data.Dataset[dict[str, Any]]):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> dict[str, Any]:
        info = worker_info()
        return {"index": index, "worker": -1 if info is None else info.id,
                "backend": "" if info is None else info.backend,
                "torch_info": get_worker_info() is not None,
                "thread": threading.current_thread().name,
                "seed": torch.initial_seed() % 2**63}  # collated as int64


def test_worker_info_is_the_threads_and_torchs_is_none_under_threads() -> None:
    inits: list[tuple[int, str, Any, str]] = []

    def init(info: Any) -> None:
        inits.append((info.id, info.backend, info.dataset, threading.current_thread().name))
        assert worker_info() is info

    dataset = Introspects()
    torch.manual_seed(1234)
    loader = ResumableLoader(dataset, batch_size=2, num_workers=3, backend="thread",
                             worker_init_fn=init)
    batches = _epochs(loader, 1)[0]
    assert sorted(inits, key=lambda i: i[0]) == [
        (w, "thread", dataset, f"lightning_loaders worker {w}") for w in range(3)]
    for b, batch in enumerate(batches):
        assert batch["worker"] == [b % 3] * 2 and batch["backend"] == ["thread"] * 2
        assert batch["thread"] == [f"lightning_loaders worker {b % 3}"] * 2
        assert batch["torch_info"] == [False, False]  # as in the main process
        assert batch["seed"] == [1234, 1234]  # threads leave the global RNGs alone
    assert worker_info() is None  # the main thread is no worker
    assert torch.initial_seed() == 1234


class Fails(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> int:
        if index == 7:
            raise KeyError(f"no sample {index}")
        return index


@pytest.mark.parametrize("workers", [1, 2])
def test_a_user_exception_has_the_same_type_and_message_under_threads(workers: int) -> None:
    errors = {}
    for backend in ("process", "thread"):
        loader = ResumableLoader(Fails(), batch_size=2, num_workers=workers, backend=backend)
        with pytest.raises(KeyError) as caught:
            _epochs(loader, 1)
        errors[backend] = caught.value
    process, thread = errors["process"], errors["thread"]
    assert type(process) is type(thread) and isinstance(thread, SampleFetchError)
    for name in ("index", "position", "epoch", "batch", "worker", "rank", "cause_type"):
        assert getattr(process, name) == getattr(thread, name), name
    assert thread.index == 7 and thread.worker == 3 % workers and thread.pid == os.getpid()
    assert str(process).split(" (pid")[0] == str(thread).split(" (pid")[0]
    assert f"in worker {3 % workers} (pid" in str(thread)
    _no_threads_after_collection()  # left to end their fetch, as an error leaves the loop


class Stalls(torch.utils.data.Dataset[int]):
    release = threading.Event()

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> int:
        if index == 5:
            self.release.wait(20)
        return index


def test_timeout_raises_worker_timeout_error_naming_the_thread() -> None:
    loader = ResumableLoader(Stalls(), batch_size=2, num_workers=2, backend="thread",
                             timeout=0.5)
    it = iter(loader)
    assert [next(it).tolist() for _ in range(2)] == [[0, 1], [2, 3]]
    with pytest.raises(WorkerTimeoutError) as caught:
        next(it)
    assert caught.value.worker == 0 and caught.value.batch == 2
    assert (f"DataLoader worker thread 0 (named 'lightning_loaders worker 0', in pid "
            f"{os.getpid()}) stalled" in str(caught.value))
    Stalls.release.set()
    _no_threads_after_collection()


class SlowThenFails(torch.utils.data.Dataset[int]):
    """Sample 0 fails at once; samples 2 and 3 (another worker's batch) take 30 s, unless
    ``release`` is set; with ``stall``, every sample does."""

    release = threading.Event()
    stall = False

    def __len__(self) -> int:
        return 8

    def __getitem__(self, index: int) -> int:
        if index == 0 and not self.stall:
            raise KeyError(index)
        if index in (2, 3) or self.stall:
            self.release.wait(30)
        return index


@pytest.mark.parametrize("backend", ["process", "thread"])
@pytest.mark.parametrize("stall", [False, True], ids=["error", "every-worker-stalled"])
def test_an_error_comes_without_waiting_for_the_other_workers_fetches(backend: str,
                                                                      stall: bool) -> None:
    """The workers are stopped before the error is raised, but not waited for: processes are
    killed, threads left to end their fetch. A ``KeyError`` (or a ``timeout=1``) is raised long
    before the other worker's 30 s sample ends, or ``close()``'s 5 s grace for processes."""
    dataset = SlowThenFails()
    dataset.stall = stall
    dataset.release.clear()
    loader = ResumableLoader(dataset, batch_size=2, num_workers=2, backend=backend,
                             timeout=1.0 if stall else 0)
    start = time.monotonic()
    with pytest.raises(WorkerTimeoutError if stall else KeyError):
        next(iter(loader))
    assert time.monotonic() - start < 4.0
    dataset.release.set()  # the threads left to end their fetch end it now
    del loader
    _no_threads_after_collection()


@pytest.mark.parametrize("backend", ["process", "thread"])
def test_a_break_takes_workers_that_are_not_persistent_with_it(backend: str) -> None:
    """With ``persistent_workers=False`` the workers live as long as the epoch's iterator, as
    with ``DataLoader``: dropped at a ``break``, it stops them; the next epoch starts anew."""
    def workers() -> list[Any]:
        return loader_processes() if backend == "process" else _pool_threads()

    def gone() -> bool:
        deadline = time.monotonic() + 10
        while workers() and time.monotonic() < deadline:
            time.sleep(0.05)
        return workers() == []

    loader = _map_loader(backend, 2, persistent_workers=False)
    for k, _ in enumerate(loader):
        if k == 1:
            assert workers()
            break
    assert gone()
    assert len(list(loader)) == len(loader)  # the next epoch, whole, on new workers
    assert gone()


class SomeFail(torch.utils.data.Dataset[int]):
    def __len__(self) -> int:
        return 20

    def __getitem__(self, index: int) -> int:
        if index % 6 == 1:
            raise ValueError(f"bad {index}")
        return index


def test_on_error_skip_under_threads_equals_processes() -> None:
    seen = {}
    for backend in ("process", "thread"):
        loader = ResumableLoader(SomeFail(), batch_size=3, shuffle=True, seed=1,
                                 num_workers=2, backend=backend, on_error="skip")
        seen[backend] = (_epochs(loader, 1), loader.skipped_indices, loader.num_skipped)
    assert seen["thread"] == seen["process"]
    assert seen["thread"][1] and seen["thread"][2] == len(seen["thread"][1])


def test_close_joins_every_thread() -> None:
    loader = _map_loader("thread", 3)
    it = iter(loader)
    next(it)
    assert len(_pool_threads()) == 3
    loader.close()
    assert _pool_threads() == []
    with _map_loader("thread", 2) as other:
        _epochs(other, 1)
    assert _pool_threads() == []


def test_num_workers_0_is_the_main_process_for_every_backend() -> None:
    for backend in BACKENDS:
        loader = _map_loader(backend, 0)
        assert loader.backend_in_use == "main"
        _epochs(loader, 1)
        assert _pool_threads() == []


def test_the_backend_is_checked_and_shown() -> None:
    with pytest.raises(ValueError, match=r"backend must be one of \('process', 'thread', "
                                         r"'auto'\), got 'threads'"):
        _map_loader("threads", 2)
    assert "backend" not in repr(_map_loader("process", 2))
    assert "backend='thread'" in repr(_map_loader("thread", 2))
    auto = _map_loader("auto", 2)
    assert auto.backend_in_use is None and "backend='auto' (measuring)" in repr(auto)


def test_auto_switching_to_processes_mid_epoch_keeps_the_stream(
        monkeypatch: pytest.MonkeyPatch, map_reference: dict[str, list[list[Any]]]) -> None:
    monkeypatch.setattr(threads, "choose_backend", lambda *_: "process")
    loader = _map_loader("auto", 2)
    assert _epochs(loader) == map_reference["batched"]
    assert loader.backend_in_use == "process" and loader.worker_restarts == 0
    assert "backend='auto' (process)" in repr(loader)
    assert _pool_threads() == []
    iterable = _iterable_loader("unknown", "auto", 2)
    assert _epochs(iterable) == _epochs(_iterable_loader("unknown", "process", 2))
    assert iterable.backend_in_use == "process"


class Counted(RngDataset):
    """Keeps the indices fetched in this process (by threads; a worker process keeps its own
    copy of the list), and says in each sample whether a thread fetched it."""

    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.fetched: list[int] = []

    def __getitem__(self, index: int) -> dict[str, Any]:
        self.fetched.append(index)
        return {**super().__getitem__(index), "thread": threads.thread_worker() is not None}


def test_auto_switching_to_processes_throws_away_nothing_the_threads_fetched(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(threads, "choose_backend", lambda *_: "process")
    dataset = Counted(80)
    loader = ResumableLoader(dataset, batch_size=4, shuffle=True, seed=5, num_workers=2,
                             backend="auto")
    samples = [(int(i), bool(t)) for batch in loader
               for i, t in zip(batch["index"], batch["thread"], strict=True)]
    loader.close()
    assert loader.backend_in_use == "process" and sorted(i for i, _ in samples) == list(range(80))
    from_threads = [i for i, thread in samples if thread]
    assert 4 * 2 * 2 <= len(from_threads) < 80  # the probe's batches, then processes
    assert sorted(dataset.fetched) == sorted(from_threads)  # every fetch by a thread delivered


def test_auto_keeps_threads_for_work_that_releases_the_gil(
        map_reference: dict[str, list[list[Any]]]) -> None:
    loader = _map_loader("auto", 2, slow=1)  # every sample sleeps: threads overlap fully
    loader.dataset.pause = 0.05
    assert _epochs(loader) == map_reference["batched"]
    assert loader.backend_in_use == "thread"


class Computes(RngDataset):
    """Sample ``i`` after ``seconds`` of pure-Python CPU time (it waits for nothing), noting
    which thread of this process fetched it (worker processes note theirs in their copy)."""

    def __init__(self, n: int, seconds: float) -> None:
        super().__init__(n)
        self.seconds = seconds
        self.threads: list[str] = []

    def __getitem__(self, index: int) -> dict[str, Any]:
        self.threads.append(threading.current_thread().name)
        deadline = time.thread_time() + self.seconds
        while time.thread_time() < deadline:
            pass
        return super().__getitem__(index)


@pytest.mark.parametrize("tuned", [False, True], ids=["2 workers", "num_workers=auto"])
def test_auto_takes_processes_for_computing_work_that_crosses_cheaply_trying_no_threads(
        tuned: bool, map_reference: dict[str, list[list[Any]]]) -> None:
    """12 ms of computing per batch, a crossing of a fraction of a millisecond: after two
    fetches alone (on a thread, or in the main process under ``num_workers="auto"``)
    ``backend="auto"`` takes processes, with no thread ever fetching busy."""
    dataset = Computes(30, seconds=0.003)
    workers: Any = AutotuneConfig(max_workers=2, probe=2, window=2, warmup=0, high_wait=0.0,
                                  saturated=None, min_window_s=0.0) if tuned else 2
    loader = ResumableLoader(dataset, batch_size=4, shuffle=True, seed=5, num_workers=workers,
                             backend="auto")
    assert _epochs(loader) == map_reference["batched"]
    auto = loader._auto
    assert auto is not None and auto.backend == "process"
    assert len(auto.serial) == 2 and auto.concurrent == []
    in_pool = [name for name in dataset.threads if name.startswith("lightning_loaders worker")]
    assert len(in_pool) == (0 if tuned else 2 * 4)  # the two batches fetched alone, if any
    assert ("MainThread" in dataset.threads) is tuned


class FailsFirst(RngDataset):
    """Samples below ``bad`` raise; the others sleep 1 ms (I/O-like: threads overlap)."""

    def __init__(self, n: int, bad: int) -> None:
        super().__init__(n)
        self.bad = bad

    def __getitem__(self, index: int) -> dict[str, Any]:
        if index < self.bad:
            raise ValueError(f"sample {index} is corrupt")
        time.sleep(0.001)
        return super().__getitem__(index)


@pytest.mark.parametrize("workers", [2, "auto"])
def test_auto_times_only_batches_it_fetched_not_skipped_ones(workers: Any) -> None:
    """The first two batches have every sample skipped: they come back at once, and timed
    as fetches alone they would make threads look slow next to them."""
    loader = ResumableLoader(FailsFirst(30, bad=6), batch_size=3, num_workers=workers,
                             backend="auto", on_error="skip")
    delivered = sorted(int(i) for batch in loader for i in batch["index"])
    loader.close()
    assert delivered == list(range(6, 30)) and loader.num_skipped == 6
    auto = loader._auto
    assert auto is not None and auto.serial and min(auto.serial) >= 3 * 0.001


def _unpicklable() -> Any:
    return lambda: None


class Unpicklable(RngDataset):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.hook = _unpicklable()


def test_auto_stays_on_threads_for_a_dataset_processes_cannot_receive() -> None:
    loader = ResumableLoader(Unpicklable(8), batch_size=2, num_workers=2, backend="auto",
                             multiprocessing_context="spawn")
    assert loader.backend_in_use == "thread"
    with pytest.raises(ValueError, match="cannot be pickled"):
        ResumableLoader(Unpicklable(8), batch_size=2, num_workers=2, backend="process",
                        multiprocessing_context="spawn")
    threaded = ResumableLoader(Unpicklable(8), batch_size=2, num_workers=2, backend="thread",
                               multiprocessing_context="spawn")
    assert len(_epochs(threaded, 1)[0]) == 4


def test_global_rngs_under_threads_are_not_reseeded_per_batch() -> None:
    random.seed(7)
    expected = [random.random() for _ in range(3)]
    random.seed(7)
    _epochs(ResumableLoader(Introspects(), batch_size=2, num_workers=2, backend="thread"), 1)
    assert [random.random() for _ in range(3)] == expected


def test_a_trainer_fits_and_resumes_with_threads(tmp_path: Path) -> None:
    check_trainer_resume(lambda: _map_loader("thread", 2, n=16), tmp_path, max_epochs=2,
                         steps=[1, 4, 5, 7])
    assert _pool_threads() == []


def test_threads_persist_across_epochs_unless_asked_not_to(
        map_reference: dict[str, list[list[Any]]]) -> None:
    loader = _map_loader("thread", 2)
    loader.sampler.set_epoch(0)
    list(loader)
    first = _pool_threads()
    loader.sampler.set_epoch(1)
    list(loader)
    assert _pool_threads() == first and len(first) == 2
    loader.close()
    once = _map_loader("thread", 2, persistent_workers=False)
    for epoch in range(2):
        once.sampler.set_epoch(epoch)
        assert [to_plain(b) for b in once] == map_reference["batched"][epoch]
        assert _pool_threads() == []


def test_pin_memory_under_threads_without_an_accelerator_warns_and_keeps_the_stream(
        map_reference: dict[str, list[list[Any]]]) -> None:
    if torch.accelerator.is_available():
        pytest.skip("checks the behaviour without an accelerator")
    loader = _map_loader("thread", 2, pin_memory=True)
    with pytest.warns(UserWarning, match="no accelerator"):
        assert _epochs(loader) == map_reference["batched"]


class _Locked(IterableDataset[int]):
    """A plain stream holding a lock: it cannot be copied for each thread."""

    def __init__(self) -> None:
        self.lock = threading.Lock()

    def __iter__(self):
        yield from range(8)


def test_a_plain_stream_that_cannot_be_copied_per_thread_is_refused_with_the_fix() -> None:
    loader = ResumableLoader(_Locked(), batch_size=2, num_workers=2, backend="thread")
    with pytest.raises(TypeError, match="copy per thread.*_Locked cannot be copied.*"
                                        "backend='process'"):
        next(iter(loader))
    loader.close()
    processes = ResumableLoader(_Locked(), batch_size=2, num_workers=2)  # each has its copy
    assert sorted(i for batch in processes for i in batch.tolist()) == list(range(8))


class _Tagged(torch.utils.data.Dataset[int]):
    """``worker_init_fn`` tags each worker's dataset: per-worker state, as an open file is."""

    worker = -1

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> int:
        time.sleep(0.001)
        return self.worker


def _tag(worker_id: int) -> None:
    worker = worker_info()
    assert worker is not None
    worker.dataset.worker = worker_id


def test_auto_starts_on_processes_where_threads_would_share_what_workers_own() -> None:
    """Threads share one dataset (state a ``worker_init_fn`` sets there) and the process's
    RNGs and environment (a plain stream is opened under them); ``auto`` must not change what
    the workers see, so it takes processes for these."""
    tags = {}
    for backend in ("process", "thread", "auto"):
        loader = ResumableLoader(_Tagged(), batch_size=2, num_workers=2, backend=backend,
                                 worker_init_fn=_tag)
        tags[backend] = sorted({tag for batch in loader for tag in batch.tolist()})
        assert loader.backend_in_use == ("thread" if backend == "thread" else "process")
        loader.close()
    assert tags["auto"] == tags["process"] == [0, 1] and len(tags["thread"]) == 1
    plain = ResumableLoader(_Locked(), batch_size=2, num_workers=2, backend="auto")
    assert plain.backend_in_use == "process"
    assert sorted(i for batch in plain for i in batch.tolist()) == list(range(8))


def _shard(shard: int) -> list[int]:
    return list(range(10 * shard, 10 * shard + 10))


def _records(directory: Path) -> list[Path]:
    paths = [directory / f"{shard}.rec" for shard in range(4)]
    for shard, path in enumerate(paths):
        write_records(path, (str(row).encode() for row in _shard(shard)))
    return paths


SOURCES = {  # a source, and whether auto must take processes for it at once
    "drawing generator": (lambda _: GeneratorSource(_shard, range(4), lengths=[10] * 4), True),
    "rng_free generator": (lambda _: GeneratorSource(_shard, range(4), lengths=[10] * 4,
                                                     rng_free=True), False),
    "records, a decode": (lambda d: RecordFiles(_records(d), lengths="scan", decode=int), True),
    "records": (lambda d: RecordFiles(_records(d), lengths="scan"), False),
}


@pytest.mark.parametrize("name", list(SOURCES))
def test_auto_takes_processes_for_a_source_that_may_draw_from_the_global_rngs(
        tmp_path: Path, name: str) -> None:
    """A source that may draw from the global RNGs (not ``rng_free``) reads under RNG states
    of its own or, when it seeks, under each batch's seeding (threads would take turns at
    them): ``auto`` takes processes for it at once, and probes threads only for a source that
    never draws."""
    make, processes = SOURCES[name]
    loader = ResumableLoader(make(tmp_path), batch_size=2, num_workers=2, backend="auto")
    assert (loader.backend_in_use == "process") is processes  # chosen before any probe
    assert sorted(int(i) for batch in loader for i in batch) == list(range(40))
    loader.close()


class _Stream(IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(8))


def test_threads_over_data_read_under_rng_states_of_its_own_are_warned_about(
        tmp_path: Path) -> None:
    """Threads share the global RNGs with the training loop: a plain stream, a source that
    reads under RNG states of its own or one that seeks and may draw (under each batch's
    seeding) takes them while a thread reads (one at a time), so the training loop's draws
    meanwhile are lost; the warning names the way out."""
    drawing = GeneratorSource(_shard, range(4), lengths=[10] * 4)
    seeking = SOURCES["records, a decode"][0](tmp_path)
    for dataset in (_Stream(), drawing, seeking):
        with pytest.warns(UserWarning, match="worker threads: .*training loop draws .*"
                                             "backend='process'"):
            ResumableLoader(dataset, batch_size=2, num_workers=2, backend="thread").close()
    quiet = GeneratorSource(_shard, range(4), lengths=[10] * 4, rng_free=True)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        for backend in ("thread", "process", "auto"):
            ResumableLoader(quiet, batch_size=2, num_workers=2, backend=backend).close()
        ResumableLoader(drawing, batch_size=2, num_workers=2, backend="auto").close()


@pytest.mark.parametrize("backend", ["process", "thread"])
def test_a_forked_copy_starts_workers_of_its_own(backend: str) -> None:
    """A process forked while the loader holds persistent workers (Lightning's ``ddp_fork``
    after a notebook read the loader) reads its next epoch with workers of its own: it used
    the owner's (processes: both streams broke; threads: the copy hung). The owner's stream
    is untouched, and the copy's exit prints nothing about the owner's threads."""
    import json
    import subprocess
    import sys

    script = f"""
import json, os, signal, sys
sys.path.insert(0, {str(Path(__file__).resolve().parents[2])!r})
from lightning_loaders import ResumableLoader
loader = ResumableLoader(list(range(40)), batch_size=4, shuffle=True, seed=1, num_workers=2,
                         backend={backend!r}, collate_fn=list)
first = [b for b in loader]
read, write = os.pipe()
if os.fork() == 0:
    signal.alarm(30)
    os.write(write, json.dumps([b for b in loader]).encode())
    os._exit(0)
os.close(write)
parent = [b for b in loader]
child = json.loads(os.read(read, 1 << 16))
os.wait()
print(json.dumps([first, parent, child]))
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0 and not done.stderr.strip(), done.stderr
    first, parent, child = json.loads(done.stdout)
    expected = ResumableLoader(list(range(40)), batch_size=4, shuffle=True, seed=1,
                               collate_fn=list)
    epochs = [[b for b in expected] for _ in range(2)]
    assert first == epochs[0] and parent == child == epochs[1]
