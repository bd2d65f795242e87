"""Worker threads: what the worker processes do for the loader, with threads.

``ThreadPool(fetcher, requests, num_workers=N, ...)`` is ``workers.ProcessPool`` with threads:
it iterates the requests as ``pool.PoolIterator`` says (order, round-robin, in-flight
window). Thread ``w`` runs ``worker_init_fn(w)`` once, then serves its requests on its own
``thread_copy()`` of the fetcher when it has one (per-worker state such as a slot's open
shards; the dataset itself is shared, as threads share memory). Threads persist across
iterators (epochs) unless ``persistent_workers=False``; ``close()`` stops and joins them, and
a pool that is dropped stops its threads too.

Nothing is pickled and nothing crosses a process boundary, so no time goes to inter-process
transport; threads run in parallel where the work releases the GIL (image decoding, numpy and
torch operations, file reads). An exception in a thread reaches the caller as from a worker
process (torch's ``ExceptionWrapper``); ``timeout`` raises ``WorkerStalled`` naming the worker
whose request is due. A thread cannot be killed, so there is no crash to recover from; a
stalled thread is left to finish its fetch on its own (it is a daemon thread, and stops then).

``AutoChoice`` with a pool measures whether threads pay (``backend="auto"``): whether they
deliver faster than processes could, which ``choose_backend`` estimates from the fetch times
alone and with every thread busy, the cores the process used meanwhile, and what a batch would
take to cross from a process. Where that crossing is a small share of processes' time per
batch (``crossing_share``), processes are taken after two fetches alone.
"""

from __future__ import annotations

import atexit
import logging
import math
import os
import queue
import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any, NamedTuple

import torch
from torch.utils.data import _utils as torch_data_utils

from lightning_loaders.context import set_samples, set_worker
from lightning_loaders.engines.autotune import available_cpus, run_delay_s, threads_run_delay_s
from lightning_loaders.engines.faults import Failed, Skipped, captured
from lightning_loaders.engines.fetch import Numbered
from lightning_loaders.engines.pool import (
    Arrival,
    PoolIterator,
    WorkerLost,
    WorkerStalled,
    pin_target,
    refuse_live,
    signals_held,
)
from lightning_loaders.engines.transport import transit_s
from lightning_loaders.schedule.requests import SlotEnd

__all__ = [
    "COMPUTED",
    "CROSSING_SHARE",
    "EARLY_LEAD",
    "MIN_SPAN_S",
    "WAITING",
    "AutoChoice",
    "BackendSwitch",
    "ThreadPool",
    "ThreadWorker",
    "choose_backend",
    "crossing_share",
    "speedups",
    "thread_worker",
]

_log = logging.getLogger(__name__)

WAITING = 0.5
"""Threads whose process used fewer cores than this fraction of their speed-up mostly waited
(on I/O, sleeps) rather than computed: processes would wait just the same."""
EARLY_LEAD = 1.25
"""How far processes' speed-up must lead the threads' after one round of concurrent fetches for
``backend="auto"`` to take them without measuring more."""
MIN_SPAN_S = 0.05
"""The shortest concurrent phase whose CPU use ``backend="auto"`` reads (the process's CPU time
advances in ticks of a few milliseconds: a shorter span would say little)."""
COMPUTED = 0.25
"""The least share of a fetch's wall time on a CPU (its thread's CPU time) for which it
computed rather than waited; the time its thread waited for a core (run delay) is left out of
the wall time. A computing thread also waits for the GIL, and for a core where the delay is not
known, so the bar is well below 1, and far above a fetch that waits on I/O or sleeps (a few
percent)."""
CROSSING_SHARE = 0.1
"""The largest share of processes' time per batch spent on its crossing for which
``backend="auto"`` takes processes without trying threads (``crossing_share``)."""
JOIN_S = 60.0
"""How long ``close()`` waits for a thread to finish the fetch it is in before leaving it."""
NOTICE_S = 2.0
"""How long ``close()`` waits for a thread before saying that it waits (Ctrl-C seems stuck)."""
SETTLE_S = 1.0
"""The longest ``ThreadPool.settle()`` waits for the threads started while the pool ran to end."""
SETTLE_QUIET_S = 0.05
"""How long ``settle()`` waits for one more of those threads to end before taking the rest for
threads that live on (the main thread's own OpenMP team, started meanwhile)."""


class ThreadWorker(NamedTuple):
    """What ``thread_worker()`` says inside a pool thread (torch's ``WorkerInfo`` fields that a
    thread has): its id, the number of threads, and its copy of the fetcher."""

    id: int
    num_workers: int
    dataset: Any


_local = threading.local()


def thread_worker() -> ThreadWorker | None:
    """The ``ThreadWorker`` of the pool thread calling it, ``None`` in any other thread."""
    return getattr(_local, "worker", None)


class BackendSwitch(WorkerLost):
    """Internal: ``backend="auto"`` measured that worker processes pay more than threads; the
    loader stops the threads and goes on from the cursor with processes."""

    def __init__(self, backend: str) -> None:
        Exception.__init__(self, f"switching to the {backend} backend")
        self.workers, self.reason = [], None
        self.backend = backend


def choose_backend(serial_s: list[float], concurrent_s: list[float], num_workers: int,
                   cores: int, parallelism: float | None = None, transit_s: float = 0.0) -> str:
    """``"thread"`` or ``"process"``: whichever delivers batches faster, from fetch times
    measured on threads (``speedups``); a tie goes to processes: no probe sees the GIL's
    friction on delivery, or the threads' share of ``parallelism`` that is spinning."""
    threads, processes = speedups(serial_s, concurrent_s, num_workers, cores, parallelism,
                                  transit_s)
    return "thread" if threads > processes else "process"


def crossing_share(fetch_s: float, transit_s: float, num_workers: int, cores: int) -> float:
    """The share of a batch's time, as processes deliver it, that goes to its crossing: of
    ``fetch_s / min(num_workers, cores) + transit_s`` (see ``speedups``; ``fetch_s`` a fetch
    alone), the ``transit_s``. No backend delivers faster than the fetches run in parallel, so
    this is the most any could gain over processes."""
    if math.isinf(transit_s):  # what does not pickle cannot cross at all
        return 1.0
    parallel = fetch_s / min(num_workers, cores)
    return transit_s / (parallel + transit_s) if transit_s > 0 else 0.0


def speedups(serial_s: list[float], concurrent_s: list[float], num_workers: int, cores: int,
             parallelism: float | None = None, transit_s: float = 0.0) -> tuple[float, float]:
    """How many times faster than one fetch alone threads and processes deliver batches.

    ``serial_s`` are the wall times of fetches that ran alone, ``concurrent_s`` of fetches
    that ran with all threads busy; ``parallelism`` is this process's CPU seconds per wall
    second meanwhile (``None``: unknown), ``transit_s`` what a batch would take to cross from
    a worker process (``transport.transit_s``).

    - Threads speed fetching up ``num_workers * median(serial) / median(concurrent)`` times:
      work that holds the GIL takes about ``num_workers`` times longer when the threads run
      at once, work that releases it (or waits) about as long.
    - Threads that used fewer cores than ``WAITING`` of that speed-up mostly waited, and
      processes would wait the same: threads count as infinitely fast. Otherwise they
      computed, and ran no faster than the cores they kept busy: their speed-up is at most
      ``parallelism``.
    - Processes deliver a batch every ``serial / min(num_workers, cores) + transit_s`` at
      best.
    """
    serial, concurrent = statistics.median(serial_s), statistics.median(concurrent_s)
    if concurrent <= 0 or serial <= 0:  # nothing to fetch: nothing for processes to gain
        return math.inf, 0.0
    processes = serial / (serial / min(num_workers, cores) + transit_s)
    threads = num_workers * serial / concurrent
    if parallelism is None:
        return threads, processes
    if parallelism < WAITING * threads:
        return math.inf, processes
    return min(threads, parallelism), processes


@dataclass
class AutoChoice:
    """``backend="auto"``'s measurement and decision, kept by the loader across pools.

    The first ``probe`` fetches run one at a time (``serial``: on one thread, or in the main
    process while ``num_workers="auto"`` starts without workers), the next ``probe`` on
    threads with every one busy on one request (``concurrent``); what each result would take
    to cross from a process is timed meanwhile (``transit``). Then ``choose_backend`` decides,
    once for the loader's life, also from the process's CPU seconds per wall second over the
    concurrent phase (``parallelism``, when that phase lasted at least ``min_span_s``).
    ``backend`` is ``None`` until then. ``probe`` defaults to twice the number of workers,
    which the loader sets (``num_workers``) before the threads start.

    Two shortcuts spare the probe's slow batches; both take processes, never threads (a wrong
    choice of threads costs the GIL's slowdown for the whole run, a wrong choice of processes
    at most the crossing):

    - From the second fetch alone on, processes are taken without trying threads when the
      fastest fetch alone computed (its thread's CPU time, ``serial_cpu``, is at least
      ``COMPUTED`` of its wall time) and a batch's crossing is at most ``CROSSING_SHARE`` of
      what processes take per batch with it (``crossing_share``). The fastest, because a
      first fetch pays for cold caches and one-off set-up that later ones do not (CPU time
      too), and a slower fetch would understate the crossing's share. Threads, at best as
      fast as the fetches run in parallel with nothing to cross, could gain no more than
      that. Fetches that mostly wait (I/O) are left to the probe, which keeps threads for
      them.
    - After the first ``num_workers`` concurrent fetches, processes are taken when their
      speed-up leads the threads' by ``EARLY_LEAD`` (``speedups``, ``parallelism`` left out:
      over so short a span it is unknown) and those fetches did not mostly wait: work that
      holds the GIL is slowest on threads exactly while they are measured.

    Only results that are batches are timed (``_fetched_a_batch``): errors, batches with
    samples skipped and the ends of slots are not.

    On a machine with more runnable threads than cores, a thread that computes spends much of
    its time waiting for a core, and would look as if it waited on I/O. So each fetch's run
    delay (``serial_delay``, ``concurrent_delay``: its thread's time runnable but not running,
    ``autotune.run_delay_s``) is left out of its wall time where ``COMPUTED`` is applied, and
    ``parallelism`` counts the cores the process used or wanted: its CPU seconds plus its
    threads' run delay, per wall second. Without ``/proc`` the delay is 0 (as before).
    """

    num_workers: int
    probe: int = 0
    backend: str | None = None
    serial: list[float] = field(default_factory=list)
    serial_cpu: list[float] = field(default_factory=list)
    concurrent: list[float] = field(default_factory=list)
    concurrent_cpu: list[float] = field(default_factory=list)
    transit: list[float] = field(default_factory=list)
    serial_delay: list[float] = field(default_factory=list)
    concurrent_delay: list[float] = field(default_factory=list)
    parallelism: float | None = None
    min_span_s: float = MIN_SPAN_S
    _phase_start: tuple[float, float, dict[str, float]] | None = field(
        default=None, init=False, repr=False)

    @property
    def serial_phase(self) -> bool:
        return self.backend is None and len(self.serial) < self._probe_size

    @property
    def _probe_size(self) -> int:
        return self.probe or 2 * self.num_workers

    def sending(self) -> None:
        """A request goes to a thread: the concurrent phase starts with the first one sent
        after the serial phase (its CPU use is read from there)."""
        if self.backend is None and self._phase_start is None and not self.serial_phase:
            self._phase_start = (time.perf_counter(), time.process_time(),
                                 threads_run_delay_s())

    def record(self, serial: bool, wall_s: float, result: Any, cpu_s: float,
               delay_s: float = 0.0) -> None:
        """Note one fetch's wall time, its thread's CPU time and run delay, and what its
        ``result`` would take to cross from a process; decide once both phases are measured,
        or early (class docstring)."""
        if self.backend is not None or not _fetched_a_batch(result):
            return
        (self.serial if serial else self.concurrent).append(wall_s)
        (self.serial_cpu if serial else self.concurrent_cpu).append(cpu_s)
        (self.serial_delay if serial else self.concurrent_delay).append(delay_s)
        self.transit.append(transit_s(result))
        cores = available_cpus()
        if serial:
            share = self._computed_crossing_share(cores)
            if share is not None and share <= CROSSING_SHARE:
                self.backend = "process"
                _log.info("backend='auto' chose process workers without trying threads: a "
                          "batch's crossing from a process (%.4f s) is %.1f%% of what %d "
                          "processes take per batch (fetch times alone %s s), at most "
                          "CROSSING_SHARE=%.0f%%", self._transit(), 100 * share,
                          self.num_workers, _rounded(self.serial), 100 * CROSSING_SHARE)
        elif len(self.concurrent) >= self._probe_size:
            self._decide(self._parallelism())
        elif len(self.concurrent) == self.num_workers:
            threads, processes = speedups(self.serial, self.concurrent, self.num_workers, cores,
                                          transit_s=self._transit())
            if processes >= EARLY_LEAD * threads and not _waited(
                    self.concurrent, self.concurrent_cpu, self.concurrent_delay):
                self._decide(None, early=True)

    def _computed_crossing_share(self, cores: int) -> float | None:
        """``crossing_share`` with the fastest fetch alone, from the second one on, when that
        fetch computed (``None`` otherwise: too early, or it mostly waited)."""
        if len(self.serial) < 2:
            return None
        fastest = min(range(len(self.serial)), key=self.serial.__getitem__)
        if _waited([self.serial[fastest]], [self.serial_cpu[fastest]],
                   [self.serial_delay[fastest]]):
            return None
        return crossing_share(self.serial[fastest], self._transit(), self.num_workers, cores)

    def _parallelism(self) -> float | None:
        """The process's CPU seconds plus its threads' run delay per wall second over the
        concurrent phase: the cores it used or wanted. Over a phase shorter than
        ``min_span_s`` that says little; then, when the fetches mostly waited, their threads'
        own CPU time and run delay (precise) stand in. A computing phase that short stays
        unknown: next to tiny fetches, the threads' CPU understates what they deliver."""
        if self._phase_start is not None:
            start, cpu, delays = self._phase_start
            wall = time.perf_counter() - start
            if wall >= self.min_span_s:
                delay = sum(max(0.0, now - delays.get(tid, 0.0))
                            for tid, now in threads_run_delay_s().items())
                self.parallelism = (time.process_time() - cpu + delay) / wall
            elif wall > 0 and _waited(self.concurrent, self.concurrent_cpu,
                                      self.concurrent_delay):
                self.parallelism = (sum(self.concurrent_cpu) + sum(self.concurrent_delay)) / wall
        return self.parallelism

    def _transit(self) -> float:
        return statistics.median(self.transit) if self.transit else 0.0

    def _decide(self, parallelism: float | None, early: bool = False) -> None:
        self.backend = choose_backend(self.serial, self.concurrent, self.num_workers,
                                      available_cpus(), parallelism, self._transit())
        used = "unknown" if parallelism is None else f"{parallelism:.2f}"
        _log.info("backend='auto' chose %s workers%s (fetch times alone %s s, all threads busy "
                  "%s s, CPU seconds per second meanwhile: %s, a batch's crossing from a "
                  "process: %.4f s)", self.backend, " early" * early,
                  _rounded(self.serial), _rounded(self.concurrent), used, self._transit())


def _waited(wall_s: list[float], cpu_s: list[float], delay_s: list[float]) -> bool:
    """Whether fetches mostly waited (I/O, sleeps): their thread's CPU time is under
    ``COMPUTED`` of their wall time less the time it waited for a core (medians)."""
    unqueued = [wall - delay for wall, delay in zip(wall_s, delay_s, strict=True)]
    return statistics.median(cpu_s) < COMPUTED * statistics.median(unqueued)


def _fetched_a_batch(result: Any) -> bool:
    """Whether ``result`` times the fetch of a batch: an error, a batch with samples skipped
    or the end of a slot cost more or less than one, and would skew the choice."""
    if isinstance(result, Numbered):
        result = result.item
    return not isinstance(result, torch_data_utils.ExceptionWrapper | Failed | Skipped | SlotEnd)


def _rounded(values: list[float]) -> list[float]:
    return [round(v, 4) for v in values]


class _Task(NamedTuple):
    generation: int
    number: int
    request: Any
    sent: float  # perf_counter() when the request was put in the thread's inbox
    measured: bool  # ``backend="auto"`` measures: the thread reads its run delay too


class _Result(NamedTuple):
    generation: int
    number: int
    data: Any
    wall_s: float  # from the request's sending to its result: waits for the GIL count too
    cpu_s: float  # the thread's CPU time in the fetch
    delay_s: float  # the thread's time waiting for a core in the fetch (0 if not measured)


class _Worker(NamedTuple):
    """A pool thread, its requests, and whether it has returned: ``Thread.is_alive()`` says
    ``False`` of a running thread once a ``join()`` of it was interrupted (Ctrl-C in
    ``close()``)."""

    thread: threading.Thread
    inbox: queue.SimpleQueue[_Task | None]
    ended: threading.Event

    def running(self) -> bool:
        return not self.ended.is_set()


class ThreadPool:
    """The thread counterpart of torch's ``DataLoader`` over a fetcher (module docstring);
    ``balanced``: any worker can answer any request (``pool.PoolIterator._next_worker``)."""

    def __init__(self, fetcher: Any, sampler: Any, *, num_workers: int,
                 prefetch_factor: int | None = None,
                 worker_init_fn: Callable[[int], None] | None = None, pin_memory: bool = False,
                 timeout: float = 0, in_order: bool = True, balanced: bool = False,
                 persistent_workers: bool = True, auto: AutoChoice | None = None) -> None:
        if num_workers < 1:
            raise ValueError(f"a ThreadPool needs num_workers >= 1, got {num_workers}")
        self.fetcher = fetcher
        self.sampler = sampler
        self.num_workers = num_workers
        self.prefetch_factor = prefetch_factor or 2
        self.worker_init_fn = worker_init_fn
        self.timeout = timeout
        self.in_order = in_order
        self.balanced = balanced
        self.persistent_workers = persistent_workers
        self.auto = auto
        device = pin_target(pin_memory)
        self._pin = (device, torch.accelerator.current_device_index()) if device else None
        self._workers: list[_Worker] | None = None
        self._outbox: queue.SimpleQueue[_Result] = queue.SimpleQueue()
        self._generation = 0
        self._stalled: set[int] = set()
        self._owner = os.getpid()  # a forked child has none of the threads
        self._thread_ids_before = frozenset[str]()

    @property
    def threads(self) -> list[threading.Thread]:
        """The running threads (empty before the first ``iter()`` and after ``close()``)."""
        return [worker.thread for worker in self._workers or ()]

    def __iter__(self) -> _ThreadIterator:
        if self._owner != os.getpid():  # forked from the owner: none of its threads run here
            self._workers, self._outbox, self._stalled = None, queue.SimpleQueue(), set()
            self._owner = os.getpid()
        if self._workers is not None and not self.persistent_workers:
            self.close()
        if self._workers is None:
            self._start()
        else:
            _drain_inboxes(self._workers)
        self._generation += 1
        return _ThreadIterator(self, self._generation)

    def close(self, wait: bool = True) -> None:
        """Stop the threads and wait for them (a thread finishes the fetch it is in first; one
        reported stalled, or every one without ``wait``, is left to finish on its own, and
        joined at exit)."""
        workers, self._workers = self._workers, None
        if workers is None or self._owner != os.getpid():
            return
        _stop(workers)
        if wait:
            _join([worker for w, worker in enumerate(workers) if w not in self._stalled
                   and worker.thread is not threading.current_thread()])
        self._stalled.clear()
        self._outbox = queue.SimpleQueue()  # results of the stopped threads are dropped

    def settle(self) -> None:
        """After ``close()``, wait for the threads that started while the pool ran to end
        (``SETTLE_S`` at most), before processes are forked. A pool thread that ran torch ops
        leaves an OpenMP team that ends just after it, releasing Intel MKL's buffers: a
        process forked meanwhile copies MKL's allocator locked and spins forever in its
        first matrix product (2 of 20 forks right after two threads' ``matmul``, none of 20
        once these threads had ended)."""
        deadline = time.monotonic() + SETTLE_S
        quiet_until = time.monotonic() + SETTLE_QUIET_S
        left = _thread_ids() - self._thread_ids_before
        while left and time.monotonic() < min(deadline, quiet_until):
            time.sleep(0.001)
            still = left & _thread_ids()
            if len(still) < len(left):
                quiet_until = time.monotonic() + SETTLE_QUIET_S
            left = still

    def __getstate__(self) -> dict[str, Any]:
        """A pool without threads (before its first ``iter()``, stopped at an epoch's end)
        pickles as its settings; one holding threads cannot (``refuse_live``)."""
        if self._workers is not None and self._owner == os.getpid():
            refuse_live(self.num_workers)
        return {**self.__dict__, "_workers": None, "_outbox": None, "_stalled": set()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._outbox = queue.SimpleQueue()
        self._owner = os.getpid()

    def __del__(self, _getpid: Callable[[], int] = os.getpid) -> None:
        workers = getattr(self, "_workers", None)
        if getattr(self, "_owner", None) != _getpid():  # os may be gone at interpreter exit
            return  # a forked copy: the threads are the owner's
        if workers is not None and any(worker.running() for worker in workers):
            _stop(workers)  # they end after their fetch; one still running at exit is joined

    def _start(self) -> None:
        """Start the threads, registered first, with Ctrl-C held back from registration until
        all run (``signals_held``): one registered and never started would be waited for by
        ``close()`` and at exit, ``JOIN_S`` long."""
        outbox, workers = self._outbox, []
        self._thread_ids_before = _thread_ids()
        for w in range(self.num_workers):
            inbox: queue.SimpleQueue[_Task | None] = queue.SimpleQueue()
            ended = threading.Event()
            copy = getattr(self.fetcher, "thread_copy", None)
            fetcher = copy() if callable(copy) else self.fetcher
            thread = threading.Thread(
                target=_serve, name=f"lightning_loaders worker {w}", daemon=True,
                args=(ThreadWorker(w, self.num_workers, fetcher), inbox, outbox,
                      self.worker_init_fn, self._pin, ended))
            workers.append(_Worker(thread, inbox, ended))
        with signals_held():
            self._workers = workers
            _RUNNING.difference_update([w for w in _RUNNING if not w.running()])
            _RUNNING.update(workers)
            for worker in workers:
                worker.thread.start()


_RUNNING: set[_Worker] = set()
"""The threads started, whatever became of their pools (pruned as pools start)."""
os.register_at_fork(after_in_child=_RUNNING.clear)  # a forked child runs none of them


@atexit.register
def _join_running_threads() -> None:
    """Stop and join the threads still running when the interpreter exits, those of pools
    dropped or closed mid-fetch (a stalled one, an interrupted ``close()``) too. Left running,
    a daemon thread inside a torch op that releases the GIL is ended by the interpreter's
    teardown as it returns, and that aborts the process ("terminate called without an active
    exception")."""
    running = [worker for worker in _RUNNING if worker.running()]
    _stop(running)
    _join(running)


def _thread_ids() -> frozenset[str]:
    """This process's threads, by kernel id (none where there is no ``/proc``)."""
    try:
        return frozenset(os.listdir("/proc/self/task"))
    except OSError:
        return frozenset()


def _stop(workers: list[_Worker]) -> None:
    _drain_inboxes(workers)
    for worker in workers:
        worker.inbox.put(None)


def _join(workers: list[_Worker]) -> None:
    """Wait for ``workers`` to end, ``JOIN_S`` at most in all; saying so when one takes longer
    than ``NOTICE_S`` (a fetch in progress), and naming those that outlive the wait."""
    deadline = time.monotonic() + JOIN_S
    for worker in workers:
        if not worker.ended.wait(NOTICE_S):
            _log.warning("waiting up to %.0f s for worker thread %s to finish the fetch it is "
                         "in", max(0.0, deadline - time.monotonic()), worker.thread.name)
        if worker.ended.wait(max(0.0, deadline - time.monotonic())):
            worker.thread.join()  # it has returned: only the thread's own teardown is left
        else:
            _log.warning("worker thread %s is still in a fetch after %.0f s; it stops when "
                         "that fetch returns", worker.thread.name, JOIN_S)


def _drain_inboxes(workers: list[_Worker]) -> None:
    """Drop the requests no thread has started (those of an abandoned iterator)."""
    for worker in workers:
        while True:
            try:
                worker.inbox.get_nowait()
            except queue.Empty:
                break


def _serve(me: ThreadWorker, inbox: queue.SimpleQueue[_Task | None],
           outbox: queue.SimpleQueue[_Result], init: Callable[[int], None] | None,
           pin: tuple[str, int] | None, ended: threading.Event) -> None:
    """A pool thread: ``init`` once, then fetch each task of ``inbox`` until ``None``;
    ``ended`` is set as it returns."""
    _local.worker = me
    try:
        where = f"in DataLoader worker thread {me.id}"
        failure = None
        if pin is not None:
            torch.accelerator.set_device_index(pin[1])
        if init is not None:
            try:
                init(me.id)
            except BaseException:
                failure = captured(where)
        fetcher = me.dataset
        while (task := inbox.get()) is not None:
            data: Any = failure
            cpu = time.thread_time()
            delay = run_delay_s() if task.measured else 0.0
            if data is None:
                try:
                    data = fetcher[task.request]
                    if pin is not None:
                        data = torch_data_utils.pin_memory.pin_memory(data, pin[0])
                except BaseException:
                    data = captured(where)
            # the delay first: a wait for a core after the wall time is read would count in it
            delay = run_delay_s() - delay if task.measured else 0.0
            outbox.put(_Result(task.generation, task.number, data,
                               time.perf_counter() - task.sent, time.thread_time() - cpu, delay))
            del data, task
    finally:
        set_samples(None)
        set_worker(None)
        _local.worker = None
        ended.set()


class _ThreadIterator(PoolIterator):
    """One pass over the pool's requests (see ``ThreadPool``); a newer ``iter()`` on the pool
    replaces it."""

    def __init__(self, pool: ThreadPool, generation: int) -> None:
        super().__init__(pool, generation)
        self._pool: ThreadPool = pool
        self._serial: set[int] = set()  # requests sent while ``auto`` measures fetches alone
        self._send()

    def _check(self) -> None:
        """After ``backend="auto"`` chose processes, once the requests the threads had in hand
        are delivered (none is fetched twice), raise ``BackendSwitch``."""
        super()._check()
        if self._switching() and not self._pending and not self._done:
            raise BackendSwitch("process")

    def _window(self) -> int:
        """While ``backend="auto"`` measures: one request at a time, then one per thread (each
        busy, and no more left to drain should processes win); after it chose processes, none."""
        auto = self._pool.auto
        if auto is not None and auto.backend is None:
            return 1 if auto.serial_phase else self._num_workers
        return 0 if self._switching() else self._limit

    def _switching(self) -> bool:
        auto = self._pool.auto
        return auto is not None and auto.backend == "process"

    def _put(self, worker: int, number: int, request: Any) -> None:
        workers = self._pool._workers
        assert workers is not None
        auto = self._pool.auto
        if auto is not None and auto.serial_phase:
            self._serial.add(number)
        elif auto is not None:
            auto.sending()
        measured = auto is not None and auto.backend is None
        workers[worker].inbox.put(_Task(self._generation, number, request, time.perf_counter(),
                                        measured))

    def _take(self) -> Arrival:
        """The next result of this iterator's requests, waiting at most ``timeout``."""
        pool = self._pool
        deadline = self._deadline()
        while True:
            try:
                result = pool._outbox.get(timeout=self._wait_s(deadline))
            except queue.Empty:
                self._check_alive()
                if deadline is not None and time.monotonic() >= deadline:
                    worker = self._due_worker()
                    pool._stalled.add(worker)
                    raise WorkerStalled(worker, os.getpid(), pool.timeout) from None
                continue
            if result.generation != self._generation:
                continue  # an abandoned iterator's
            serial = result.number in self._serial
            self._serial.discard(result.number)
            if pool.auto is not None:
                pool.auto.record(serial, result.wall_s, result.data, result.cpu_s,
                                 result.delay_s)
            return Arrival(result.number, result.data)

    def _check_alive(self) -> None:
        """A pool thread ends only when stopped; one that ended otherwise is reported as a
        lost worker (and restarted by the loader, as a dead worker process would be)."""
        workers = self._pool._workers or []
        dead: list[tuple[int, int | None, int | None]] = [
            (w, os.getpid(), None) for w, worker in enumerate(workers)
            if not worker.running()]
        if dead:
            raise WorkerLost(dead)
