"""The thread pool's own behaviour (threads named and initialised once, persistence, shutdown,
a stalled thread left behind; the contract both pools keep is in ``test_pool``); and the rule
``backend="auto"`` decides by."""

from __future__ import annotations

import gc
import logging
import math
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path
from types import FrameType
from typing import Any

import pytest
import torch

from lightning_loaders import ResumableLoader
from lightning_loaders.engines import threads as threads_module
from lightning_loaders.engines.faults import Failed, Skipped
from lightning_loaders.engines.fetch import Numbered
from lightning_loaders.engines.pool import InProcess, WorkerStalled
from lightning_loaders.engines.threads import (
    COMPUTED,
    CROSSING_SHARE,
    EARLY_LEAD,
    MIN_SPAN_S,
    WAITING,
    AutoChoice,
    BackendSwitch,
    ThreadPool,
    choose_backend,
    crossing_share,
    speedups,
    thread_worker,
)
from lightning_loaders.engines.transport import TRANSIT_BATCH_S
from lightning_loaders.engines.workers import ProcessPool
from lightning_loaders.errors import SampleFetchError
from lightning_loaders.schedule.requests import SlotEnd


class Recorder:
    """``fetcher[r]`` is ``(r, the thread's worker id)``; counts fetches running at once."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay
        self.lock = threading.Lock()
        self.running = 0
        self.most_at_once = 0

    def __getitem__(self, request: int) -> tuple[int, int]:
        with self.lock:
            self.running += 1
            self.most_at_once = max(self.most_at_once, self.running)
        try:
            time.sleep(self.delay)
            info = thread_worker()
            assert info is not None
            return request, info.id
        finally:
            with self.lock:
                self.running -= 1


def pool_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if t.name.startswith("lightning_loaders worker")]


def test_worker_init_fn_runs_once_in_each_thread() -> None:
    calls: list[tuple[int, int | None, str]] = []

    def init(worker_id: int) -> None:
        info = thread_worker()
        calls.append((worker_id, info.id if info else None, threading.current_thread().name))

    pool = ThreadPool(Recorder(), range(9), num_workers=3, worker_init_fn=init)
    for _ in range(2):  # persistent threads: initialised once
        assert len(list(pool)) == 9
    pool.close()
    assert sorted(calls) == [(w, w, f"lightning_loaders worker {w}") for w in range(3)]


class Hangs:
    def __init__(self) -> None:
        self.release = threading.Event()

    def __getitem__(self, request: int) -> int:
        if request == 3:
            self.release.wait(10)
        return request


def test_close_leaves_a_stalled_thread_to_finish_on_its_own() -> None:
    fetcher = Hangs()
    pool = ThreadPool(fetcher, range(6), num_workers=2, timeout=0.3)
    it = iter(pool)
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(WorkerStalled) as caught:
        next(it)
    assert caught.value.worker == 1 and caught.value.timeout == 0.3
    pool.close()  # does not wait for the stalled thread
    fetcher.release.set()
    _wait_for_no_threads()


def test_close_says_that_it_waits_for_a_long_fetch(monkeypatch: pytest.MonkeyPatch,
                                                     caplog: pytest.LogCaptureFixture) -> None:
    """A Ctrl-C that seems stuck: ``close()`` says whom it waits for, then waits."""
    monkeypatch.setattr(threads_module, "NOTICE_S", 0.1)
    pool = ThreadPool(Recorder(delay=0.6), range(4), num_workers=2)
    it = iter(pool)
    next(it)
    with caplog.at_level(logging.WARNING, logger=threads_module.__name__):
        pool.close()
    assert "waiting up to" in caplog.text and "lightning_loaders worker" in caplog.text
    assert pool_threads() == []


def test_threads_persist_across_iterators_and_close_joins_them() -> None:
    pool = ThreadPool(Recorder(), range(5), num_workers=3)
    assert pool.threads == []
    list(pool)
    first = pool.threads
    list(pool)
    assert pool.threads == first and all(t.is_alive() for t in first)
    pool.close()
    assert pool.threads == [] and not any(t.is_alive() for t in first)
    assert pool_threads() == []
    assert list(pool) == [(r, r % 3) for r in range(5)]  # new threads after close()
    pool.close()
    assert pool_threads() == []


def test_a_ctrl_c_as_the_threads_start_leaves_none_registered_and_never_started(
        ctrl_c: None, monkeypatch: pytest.MonkeyPatch,
        caplog: pytest.LogCaptureFixture) -> None:
    """Ctrl-C (a real SIGINT) as the pool starts its second thread: that thread was registered
    and never started, so ``close()`` (and the interpreter's exit) waited ``JOIN_S`` for it to
    end. The ``KeyboardInterrupt`` comes once both run, ``close()`` joins them at once, and
    the pool then serves every request."""
    monkeypatch.setattr(threads_module, "NOTICE_S", 0.2)
    monkeypatch.setattr(threads_module, "JOIN_S", 0.5)
    pool = ThreadPool(Recorder(), range(6), num_workers=2)
    starts = []

    def ctrl_c_at_the_second_start(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and frame.f_code is threading.Thread.start.__code__:
            starts.append(frame)
            if len(starts) == 2:
                os.kill(os.getpid(), signal.SIGINT)

    previous = sys.gettrace()
    sys.settrace(ctrl_c_at_the_second_start)
    try:
        with pytest.raises(KeyboardInterrupt):
            iter(pool)
    finally:
        sys.settrace(previous)
    assert len(starts) == 2
    with caplog.at_level(logging.WARNING, logger=threads_module.__name__):
        pool.close()
    assert caplog.text == "" and pool_threads() == []
    assert list(pool) == [(r, r % 2) for r in range(6)]
    pool.close()


def test_non_persistent_threads_stop_at_the_end_of_each_pass() -> None:
    pool = ThreadPool(Recorder(), range(5), num_workers=2, persistent_workers=False)
    list(pool)
    assert pool.threads == [] and pool_threads() == []


def test_an_abandoned_pass_does_not_leak_into_the_next() -> None:
    pool = ThreadPool(Recorder(0.01), range(12), num_workers=2)
    it = iter(pool)
    next(it)
    assert [r for r, _ in pool] == list(range(12))
    with pytest.raises(RuntimeError, match="replaced"):
        next(it)
    pool.close()


def test_a_dropped_pool_stops_its_threads() -> None:
    pool = ThreadPool(Recorder(), range(5), num_workers=2)
    list(pool)
    del pool
    gc.collect()
    _wait_for_no_threads()


def _wait_for_no_threads() -> None:
    for _ in range(200):
        if not pool_threads():
            return
        time.sleep(0.05)
    raise AssertionError(f"threads still alive: {pool_threads()}")


# -- backend="auto" ---------------------------------------------------------------------------


_EXIT_WITH_THREADS_AT_WORK = textwrap.dedent("""
    import os, signal, sys, threading
    from lightning_loaders import ResumableLoader, WorkerTimeoutError
    from tests.engines.test_threads import MatMuls

    backend, how = sys.argv[1:]

    def loader(seconds=0.0, timeout=0):
        return ResumableLoader(MatMuls(seconds), batch_size=1, num_workers=2, backend=backend,
                               timeout=timeout)

    if how == "left open":  # persistent threads, and an iterator mid-epoch
        kept = loader()
        for _ in kept:
            pass
        next(iter(kept))
    elif how == "dropped":  # the pool collected mid-epoch, without close()
        next(iter(loader(0.5)))
    elif how == "close interrupted":  # Ctrl-C while close() waits for the fetches
        kept = loader(1.5)
        next(iter(kept))
        threading.Timer(0.3, os.kill, (os.getpid(), signal.SIGINT)).start()
        try:
            kept.close()
        except KeyboardInterrupt:
            pass
    elif how == "stalled":  # a fetch past timeout: that thread is left to finish
        try:
            next(iter(loader(3.0, timeout=1)))
        except WorkerTimeoutError:
            pass
""")


class MatMuls:
    """Samples that spend ``seconds`` (at least one round) in torch ops, which release the GIL,
    so that the threads are inside one when the interpreter exits; no loader gathers it in
    bulk."""

    def __init__(self, seconds: float = 0.0) -> None:
        self.seconds = seconds

    def __len__(self) -> int:
        return 16

    def __getitem__(self, index: int) -> torch.Tensor:
        a = torch.full((400, 400), float(index))
        deadline = time.monotonic() + self.seconds
        for _ in range(20):
            a = torch.tanh(a @ a)
        while time.monotonic() < deadline:
            a = torch.tanh(a @ a)
        return a.sum()


@pytest.mark.parametrize(("backend", "how"), [
    ("thread", "left open"), ("auto", "left open"), ("thread", "dropped"),
    ("thread", "close interrupted"), ("thread", "stalled")])
def test_an_interpreter_that_exits_with_threads_at_work_joins_them_first(backend: str,
                                                                          how: str) -> None:
    """Threads still in torch ops when the interpreter exits, whatever became of their pool:
    they are stopped and joined before its teardown, which would abort the process
    ("terminate called without an active exception") as a thread came back from one, and no
    ``__del__`` complains of modules torn down. An interrupted ``join()`` leaves
    ``Thread.is_alive()`` false of a running thread: its end is known otherwise."""
    done = subprocess.run([sys.executable, "-c", _EXIT_WITH_THREADS_AT_WORK, backend, how],
                          cwd=Path(__file__).parents[2], capture_output=True, text=True,
                          timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Exception ignored" not in done.stderr and "Traceback" not in done.stderr


def test_the_rule_keeps_threads_only_where_they_deliver_faster_than_processes() -> None:
    # GIL held: fetches take num_workers times longer when the threads run at once
    assert choose_backend([1.0, 1.0], [3.9, 4.1], num_workers=4, cores=8) == "process"
    # half the time under the GIL: threads reach 1.33x of the 2x processes could
    assert choose_backend([1.0], [1.5], num_workers=2, cores=2) == "process"
    # more workers than cores: processes could only reach the cores' speed-up too
    assert choose_backend([1.0], [1.9], num_workers=4, cores=2) == "thread"
    assert choose_backend([1.0], [2.1], num_workers=4, cores=2) == "process"
    # threads as fast as processes could be: a tie, which goes to processes
    assert choose_backend([1.0], [1.0], num_workers=2, cores=2) == "process"


def test_a_dear_crossing_keeps_threads_that_processes_would_otherwise_beat() -> None:
    """Batches that take longer to cross from a process than to fetch (small batches of
    many tensors, Python objects to pickle) go faster on threads, even under the GIL."""
    assert choose_backend([1e-3], [2e-3], num_workers=2, cores=2) == "process"
    # processes: a batch every 0.5 ms + 0.6 ms, threads (GIL held): every 1 ms
    assert choose_backend([1e-3], [2e-3], num_workers=2, cores=2, transit_s=6e-4) == "thread"
    assert choose_backend([1e-3], [2e-3], num_workers=2, cores=2, transit_s=4e-4) == "process"
    assert choose_backend([1e-3], [2e-3], num_workers=2, cores=2,
                          transit_s=math.inf) == "thread"


def test_threads_that_mostly_waited_are_kept_and_computing_ones_count_their_cores() -> None:
    """Threads whose process used few cores meanwhile waited (I/O, sleeps), as processes
    would; threads that computed ran no faster than the cores the process kept busy."""
    assert WAITING * 2 > 0.2
    assert choose_backend([1.0], [1.0], num_workers=2, cores=2, parallelism=0.2) == "thread"
    assert choose_backend([1.0], [1.0], num_workers=2, cores=2, parallelism=1.9) == "process"
    # four threads computing on two cores: twice as fast as one, as processes would be
    assert choose_backend([1.0], [2.0], num_workers=4, cores=2, parallelism=1.9) == "process"
    # four fetches overlapping fully: more than two cores' worth, so they waited
    assert choose_backend([1.0], [1.0], num_workers=4, cores=2) == "thread"


@pytest.mark.parametrize("min_span_s", [MIN_SPAN_S, 3600.0])
def test_auto_reads_the_processs_cpu_use_over_a_long_enough_concurrent_phase(min_span_s) -> None:
    """Over the concurrent phase (4 fetches on 2 threads: two rounds of ``MIN_SPAN_S`` each)
    the process's CPU seconds per second are read when it lasted ``min_span_s`` or more;
    over a shorter one, the fetch threads' own CPU time stands in, as they mostly waited.
    Threads that sleep use next to no CPU either way."""
    auto = AutoChoice(2, min_span_s=min_span_s)
    pool = ThreadPool(Recorder(MIN_SPAN_S), range(4), num_workers=2, auto=auto)
    list(pool)
    list(pool)
    assert auto.backend == "thread"
    assert auto.parallelism is not None and 0 <= auto.parallelism < WAITING
    assert len(auto.concurrent_cpu) == 4 and max(auto.concurrent_cpu) < MIN_SPAN_S / 2
    pool.close()


@pytest.mark.parametrize(("cpu_share", "chosen"), [(0.02, "thread"), (0.6, None)])
def test_a_short_phase_of_fetches_that_waited_keeps_threads(
        monkeypatch: pytest.MonkeyPatch, cpu_share: float, chosen: str | None) -> None:
    """Four 9 ms fetches on two threads last under ``MIN_SPAN_S``: the process's CPU time
    says little there. Fetches that mostly waited (their threads' CPU time) keep threads, as
    processes would wait the same; computing ones leave it unknown, as before."""
    monkeypatch.setattr(threads_module, "available_cpus", lambda: 2)
    monkeypatch.setattr(threads_module, "CROSSING_SHARE", 0.0)
    auto = AutoChoice(2)
    while auto.serial_phase:
        auto.record(True, 0.009, None, cpu_share * 0.009)
    auto.sending()
    time.sleep(0.02)
    for _ in range(4):
        auto.record(False, 0.0095, None, cpu_share * 0.0095)
    assert auto.backend == (chosen or "process")
    assert (auto.parallelism is None) is (chosen is None)


def test_auto_measures_fetches_alone_then_all_threads_busy() -> None:
    fetcher = Recorder(0.05)  # long enough that a busy machine's wake-up delays cannot flip it
    auto = AutoChoice(2)
    pool = ThreadPool(fetcher, range(4), num_workers=2, auto=auto)
    list(pool)  # the serial phase: one fetch at a time
    assert fetcher.most_at_once == 1 and len(auto.serial) == 4 and auto.backend is None
    list(pool)
    assert len(auto.concurrent) == 4 and auto.backend == "thread"  # sleeping releases the GIL
    # what each result would take to cross from a process, timed on every fetch measured
    assert len(auto.transit) == 8 and min(auto.transit) >= TRANSIT_BATCH_S
    pool.close()


def test_fetches_in_the_main_process_are_the_serial_phase() -> None:
    """``num_workers="auto"`` starts without workers: the main process's fetches are timed
    as fetches alone until the serial phase is full, and the threads then start busy."""
    auto = AutoChoice(2)
    main = InProcess(Sleeps(0.05), range(6), None, timer=auto)
    assert list(main) == list(range(6))
    assert len(auto.serial) == len(auto.serial_cpu) == len(auto.transit) == 4  # then not timed
    assert min(auto.serial) >= 0.05 > max(auto.serial_cpu)  # sleeping: waited, not computed
    assert auto.backend is None and not auto.serial_phase
    fetcher = Recorder(0.05)
    pool = ThreadPool(fetcher, range(4), num_workers=2, auto=auto)
    list(pool)
    assert fetcher.most_at_once == 2 and len(auto.serial) == 4 and len(auto.concurrent) == 4
    assert auto.backend == "thread" and auto.parallelism is not None  # sleeps: threads wait
    pool.close()


class Sleeps:
    """``fetcher[r]`` is ``r`` after ``seconds`` of sleep, in any thread."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __getitem__(self, request: int) -> int:
        time.sleep(self.seconds)
        return request


class HoldsTheGil:
    """``fetcher[r]`` is ``r`` after ``rounds`` rounds of a loop in C that never gives up the
    GIL: a fixed amount of work, so a fetch beside another takes twice its time alone however
    busy the machine is (a deadline in wall time would let a thread that waited, for the GIL
    or for a core, finish with less work done)."""

    def __init__(self, rounds: int) -> None:
        self.rounds = rounds

    def __getitem__(self, request: int) -> int:
        for _ in range(self.rounds):
            sum(range(100_000))
        return request


def test_a_fetch_that_holds_the_gil_is_timed_from_its_request(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """With every thread busy, a thread waits for the GIL before its fetch can start: that
    wait counts, so pure-Python work does not look as fast on two threads as alone (the
    crossing shortcut, which would skip the threads' measurement, is off)."""
    monkeypatch.setattr(threads_module, "available_cpus", lambda: 2)
    monkeypatch.setattr(threads_module, "CROSSING_SHARE", 0.0)
    auto = AutoChoice(2)
    pool = ThreadPool(HoldsTheGil(5), range(8), num_workers=2, auto=auto)
    with pytest.raises(BackendSwitch):
        list(pool)
    assert auto.backend == "process"
    assert max(auto.concurrent) > 1.5 * min(auto.serial), (auto.serial, auto.concurrent)
    pool.close()


def test_a_fetch_that_waited_for_a_core_computed(monkeypatch: pytest.MonkeyPatch) -> None:
    """On an oversubscribed machine a computing fetch spends most of its wall time waiting for
    a core (its run delay): 7 ms of CPU in 40 ms, 30 ms of them runnable. Without the delay it
    looks like I/O; with it left out of the wall time it computed, and takes processes."""
    monkeypatch.setattr(threads_module, "available_cpus", lambda: 2)
    assert 0.007 / 0.04 < COMPUTED < 0.007 / (0.04 - 0.03)
    starved = AutoChoice(2)
    for _ in range(2):
        starved.record(True, 0.04, None, 0.007, 0.03)
    assert starved.backend == "process" and starved.serial_delay == [0.03, 0.03]
    unknown = AutoChoice(2)  # no run delay known (no /proc): it looks as if it waited
    for _ in range(2):
        unknown.record(True, 0.04, None, 0.007)
    assert unknown.backend is None and unknown.serial_phase


@pytest.mark.skipif(not Path("/proc/thread-self/schedstat").is_file(),
                    reason="the run delay is read from /proc")
def test_a_fetch_that_holds_the_gil_switches_to_processes_with_the_cores_oversubscribed(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Three busy loops a core beside the pool: its threads wait for a core most of each
    fetch, and their CPU time alone is well under ``COMPUTED`` of the wall time. Their run
    delay tells that wait from I/O, so pure-Python work still hands over to processes (the
    crossing shortcut is off: the probe with every thread busy decides)."""
    monkeypatch.setattr(threads_module, "available_cpus", lambda: 2)
    monkeypatch.setattr(threads_module, "CROSSING_SHARE", 0.0)
    loops = [subprocess.Popen([sys.executable, "-c", "while True: pass"])
             for _ in range(3 * (os.cpu_count() or 1))]
    try:
        time.sleep(0.2)  # the loops are running
        auto = AutoChoice(2)
        pool = ThreadPool(HoldsTheGil(5), range(8), num_workers=2, auto=auto)
        with pytest.raises(BackendSwitch):
            list(pool)
        pool.close()
    finally:
        for loop in loops:
            loop.kill()
            loop.wait()
    assert auto.backend == "process", (auto.serial, auto.serial_cpu, auto.serial_delay,
                                       auto.concurrent, auto.concurrent_cpu,
                                       auto.concurrent_delay, auto.parallelism)


def _probe(auto: AutoChoice, serial_s: float, concurrent_s: list[float]) -> list[str | None]:
    """What ``auto`` has chosen after each of ``concurrent_s``, fed after its serial phase's
    fetches alone of ``serial_s`` each. The fetches alone are fed as waiting (no CPU time),
    which keeps the crossing shortcut out; the busy ones as computing."""
    while auto.serial_phase:
        auto.record(True, serial_s, None, 0.0)
    chosen = []
    for wall_s in concurrent_s:
        auto.record(False, wall_s, None, wall_s)
        chosen.append(auto.backend)
    return chosen


def test_auto_takes_processes_after_one_busy_round_when_they_lead_clearly(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """After the first round with every thread busy, processes are taken when their
    speed-up leads the threads' by ``EARLY_LEAD``; threads only ever after the whole probe."""
    monkeypatch.setattr(threads_module, "available_cpus", lambda: 2)
    assert 1.0 < EARLY_LEAD < 1.5
    # GIL held: both fetches took twice as long at once; threads 1x, processes almost 2x
    assert _probe(AutoChoice(2), 1.0, [2.0, 2.0]) == [None, "process"]
    threads, processes = speedups([1.0], [2.0, 2.0], 2, 2)
    assert threads == 1.0 and processes == 2.0
    # threads at 1.67x: processes (2x) lead by less than EARLY_LEAD, so the probe goes on
    assert _probe(AutoChoice(2), 1.0, [1.2, 1.2, 1.2, 1.2]) == [None, None, None, "process"]
    # threads as fast at once as alone (they wait, or release the GIL): never chosen early
    chosen = _probe(AutoChoice(2, min_span_s=math.inf), 1.0, [1.0, 1.0, 1.0, 1.0])
    assert chosen == [None, None, None, "thread"]
    # the same slow round, but the fetches waited (no CPU time): nothing is chosen early
    waited = AutoChoice(2)
    while waited.serial_phase:
        waited.record(True, 1.0, None, 0.0)
    for wall_s in (2.0, 2.0):
        waited.record(False, wall_s, None, 0.0)
    assert waited.backend is None


def test_crossing_share_is_the_most_any_backend_could_gain_over_processes() -> None:
    """Processes deliver a batch every ``fetch alone / min(workers, cores) + crossing``; no
    backend beats the fetches in parallel, so the crossing's share is all there is to gain."""
    assert crossing_share(0.01, 0.0004, 2, 2) == pytest.approx(0.0004 / 0.0054)
    assert crossing_share(0.01, 0.0004, 4, 2) == crossing_share(0.01, 0.0004, 2, 2)
    assert crossing_share(0.01, math.inf, 2, 2) == 1.0  # a result that does not pickle
    assert crossing_share(0.0, 0.0, 2, 2) == 0.0


def test_fetches_that_compute_and_cross_cheaply_take_processes_without_trying_threads(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """From the second fetch alone: processes at once when the fastest fetch computed (its
    thread's CPU time at least ``COMPUTED`` of its wall time: a first one is often cold) and a
    batch's crossing is at most ``CROSSING_SHARE`` of processes' time per batch; fetches that
    waited, or whose crossing would cost more, go on to the threads' probe."""
    monkeypatch.setattr(threads_module, "available_cpus", lambda: 2)
    assert TRANSIT_BATCH_S / (0.008 / 2 + TRANSIT_BATCH_S) < CROSSING_SHARE
    assert 0.0001 / 0.008 < COMPUTED < 0.0075 / 0.008
    computed = AutoChoice(2)
    computed.record(True, 0.009, None, 0.0085)
    assert computed.backend is None  # one fetch says little
    computed.record(True, 0.008, None, 0.0075)
    assert computed.backend == "process" and computed.concurrent == []
    waited = AutoChoice(2)
    for _ in range(2):
        waited.record(True, 0.008, None, 0.0001)  # I/O: threads wait as well as processes
    assert waited.backend is None and waited.serial_phase
    cold = AutoChoice(2)  # a slow first fetch, then 0.2 ms ones: crossing is most of a batch
    for wall_s in (0.05, 0.0002, 0.0002):
        cold.record(True, wall_s, None, wall_s)
    assert cold.backend is None and TRANSIT_BATCH_S / (0.0001 + TRANSIT_BATCH_S) > 0.5
    set_up = AutoChoice(2)  # 30 ms of one-off set-up in the first fetch, then 13 ms of I/O
    set_up.record(True, 0.046, None, 0.030)
    set_up.record(True, 0.013, None, 0.0005)
    assert set_up.backend is None and set_up.serial_phase


def test_only_fetched_batches_are_timed() -> None:
    """An error, a batch whose samples were all skipped, or a slot's end takes far less (or
    more) than fetching a batch: timing one as a fetch alone would skew the choice."""
    auto = AutoChoice(2)
    error = SampleFetchError("boom")
    for result in (torch.utils.data._utils.worker.ExceptionWrapper(where="in a test"),
                   Failed(error), Skipped(None, (), empty=True), SlotEnd(0),
                   Numbered(3, Skipped(None, (), empty=True))):
        auto.record(True, 0.0001, result, 0.0001)
    assert auto.serial == auto.serial_cpu == auto.transit == [] and auto.serial_phase
    auto.record(True, 0.01, Numbered(4, torch.ones(2)), 0.0)
    assert auto.serial == [0.01] and len(auto.transit) == 1


def test_pure_python_work_switches_to_processes_after_two_fetches_alone(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Real threads: the fetches alone compute and their results cross cheaply, so the
    threads hand over to processes before any of them runs busy."""
    monkeypatch.setattr(threads_module, "available_cpus", lambda: 2)
    auto = AutoChoice(2)
    pool = ThreadPool(HoldsTheGil(15), range(8), num_workers=2, auto=auto)
    with pytest.raises(BackendSwitch):
        list(pool)
    assert auto.backend == "process" and len(auto.serial) == 2 and auto.concurrent == []
    pool.close()


def _task_ids() -> set[str]:
    return set(os.listdir("/proc/self/task"))


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="threads are counted in /proc")
def test_the_threads_torch_ops_started_have_ended_once_the_pool_settles() -> None:
    """Torch ops on a pool thread start an OpenMP team that ends after the thread: a process
    forked meanwhile copies Intel MKL's allocator locked and hangs in its first matmul.
    ``settle()`` waits for those threads."""
    before = _task_ids()
    pool = ThreadPool(MatMuls(), range(8), num_workers=2)
    assert len(list(pool)) == 8
    pool.close()
    pool.settle()
    assert _task_ids() <= before


@pytest.mark.skipif(not Path("/proc/self/task").is_dir(), reason="threads are counted in /proc")
def test_auto_forks_its_processes_once_the_threads_and_what_they_started_have_ended(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """``backend="auto"`` measured torch ops on threads, then chose processes: it forks them
    with no thread of the probe's left (under load a fork among them hung 1 of 6 runs)."""
    monkeypatch.setattr(threads_module, "CROSSING_SHARE", 0.0)
    monkeypatch.setattr(threads_module, "choose_backend", lambda *args, **kwargs: "process")
    at_fork: list[set[str]] = []
    start = ProcessPool._start

    def forks(pool: ProcessPool) -> None:
        at_fork.append(_task_ids())
        start(pool)

    monkeypatch.setattr(ProcessPool, "_start", forks)
    before = _task_ids()
    with ResumableLoader(MatMuls(), batch_size=1, num_workers=2, backend="auto") as loader:
        assert len(list(loader)) == len(MatMuls())
        assert loader.backend_in_use == "process"
    assert len(at_fork) == 1 and at_fork[0] <= before


def test_while_auto_measures_the_threads_hold_one_request_each() -> None:
    """Alone, one request is out at a time; with every thread busy, one per thread, not
    ``prefetch_factor`` each (few are left to drain should processes win); once threads are
    chosen, the whole window."""
    auto = AutoChoice(2)
    pool = ThreadPool(Recorder(0.01), range(24), num_workers=2, prefetch_factor=3, auto=auto)
    it = iter(pool)
    out: dict[str, int] = {"alone": 0, "busy": 0, "chosen": 0}
    for _ in it:
        phase = ("alone" if auto.serial_phase else "busy") if auto.backend is None else "chosen"
        out[phase] = max(out[phase], len(it._pending) + len(it._done))
    assert auto.backend == "thread"  # sleeping releases the GIL
    assert out == {"alone": 1, "busy": 2, "chosen": 2 * 3}
    pool.close()


def test_after_choosing_processes_the_threads_deliver_what_they_have_then_switch() -> None:
    """Nothing the threads fetched is thrown away: no new request goes to them, the ones in
    hand are delivered in order, then ``BackendSwitch`` (processes go on from the cursor)."""
    fetcher = Recorder()
    auto = AutoChoice(2, probe=1)
    pool = ThreadPool(fetcher, range(10), num_workers=2, prefetch_factor=2, auto=auto)
    it = iter(pool)
    delivered = [next(it)[0] for _ in range(2)]  # the probe's two phases, one batch each
    auto.backend = "process"
    in_hand = set(it._pending) | set(it._done)
    assert in_hand, "the concurrent window was open when processes were chosen"
    with pytest.raises(BackendSwitch):
        while True:
            delivered.append(next(it)[0])
    assert delivered == list(range(2 + len(in_hand))) and it._sent == len(delivered)
    pool.close()


class _Leaves(torch.utils.data.Dataset[int]):
    """Leaves the loop from sample 5 by raising ``error`` (no ``Exception``)."""

    def __init__(self, error: BaseException) -> None:
        self.error = error

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> int:
        if index == 5:
            raise self.error
        return index


@pytest.mark.parametrize("error", [SystemExit(3), KeyboardInterrupt()])
@pytest.mark.parametrize("backend", ["thread", "process"])
def test_system_exit_and_keyboard_interrupt_from_a_thread_leave_as_without_workers(
        error: BaseException, backend: str) -> None:
    """As from ``__getitem__`` in the main process: the same exception, ``SystemExit``'s code
    kept (torch's wrapper rebuilt it from a message, which became its code)."""
    from lightning_loaders import ResumableLoader

    workers = 2 if backend == "thread" else 0
    with ResumableLoader(_Leaves(error), batch_size=2, num_workers=workers,
                         backend=backend) as loader, pytest.raises(type(error)) as info:
        list(loader)
    assert info.value is error or info.value.args == error.args
    if isinstance(error, SystemExit):
        assert info.value.code == 3
