"""Worker processes: our own worker loop, watched.

``ProcessPool`` is the process counterpart of ``threads.ThreadPool`` (both iterate as
``pool.PoolIterator`` says). Each worker has two pipes of its own: requests come in on one,
results go out on the other, written by the worker itself. torch's worker machinery instead
passes every request and result through a ``multiprocessing.Queue``, whose feeder thread
pickles and writes in the background; on a core busy with the work, that thread and its wake-ups
cost the worker about a tenth of its time, and the main process's feeder as much again
(``benchmarks/bench_throughput.py``). Results that a worker packed into its shared-memory ring
(``transport.RingPacker``) are a few hundred bytes; others are pickled with torch's reductions
(tensors in shared memory), as torch's workers send them.

A worker does what torch's does before its first request: it seeds ``random``, ``torch`` and
numpy from the pool's base seed, uses one intra-op thread, publishes torch's ``WorkerInfo``
(``get_worker_info()``) and runs ``worker_init_fn``; an exception there comes back with every
request, as with torch. It exits when asked, on Ctrl-C, or when its parent is gone.

The main process waits on the result pipes and the workers' exit sentinels together: a worker
that dies is reported at once as ``WorkerLost`` (id, pid, exit code) from the loader's own
``next()``, never from a signal handler in the middle of the training step, and ``timeout``
raises ``WorkerStalled`` naming the worker whose batch is due. A forked worker that does not
reach its loop within ``START_S`` is killed and reported as lost: before 3.11.8, CPython can
fork a child while another thread (gloo's, under DDP) holds the interpreter's thread-list lock,
and that child waits for it forever (gh-112275). ``close()`` stops the workers and leaves no
shared memory behind.
"""

from __future__ import annotations

import atexit
import fcntl
import multiprocessing
import os
import random
import select
import time
import weakref
from collections.abc import Callable
from multiprocessing.connection import Connection, wait
from multiprocessing.reduction import ForkingPickler
from typing import Any, NoReturn

import numpy as np
import torch
from torch.utils.data import _utils as torch_data_utils
from torch.utils.data._utils import worker as torch_worker

from lightning_loaders.engines.faults import Raised, captured
from lightning_loaders.engines.pool import (
    Arrival,
    PoolIterator,
    WorkerLost,
    WorkerStalled,
    pin_target,
    refuse_live,
    release_held_signals,
    signals_held,
)
from lightning_loaders.engines.transport import Packed, RingPacker, RingReader
from lightning_loaders.schedule.requests import BatchRequest

__all__ = ["DEATH_GRACE_S", "HELD", "JOIN_S", "PIPE_BYTES", "START_S", "ProcessPool"]

START_S = 10.0
"""How long a forked worker may take to reach its loop before it counts as wedged."""
DEATH_GRACE_S = 2.0
"""How long a broken result pipe waits for its worker to be seen dead before it counts as an
error of its own."""
JOIN_S = 5.0
"""How long ``close()`` waits for a worker to finish the fetch it is in before killing it."""
WATCH_S = 1.0
"""How often an idle worker checks that its parent is alive."""
HELD = 2
"""Ring slots per worker beyond its in-flight results: delivered batches view their slots
while the user holds them (the training step's batch, and the one Lightning fetches ahead)."""
PIPE_BYTES = 1 << 20
"""Pipe buffer asked for (Linux): requests and results are written whole without waiting for
the reader, up to this size."""


class ProcessPool:
    """Worker processes over ``fetcher`` indexed by ``sampler``'s requests (module docstring).

    Workers start at the first ``iter()`` and persist across iterators (epochs) unless
    ``persistent_workers=False``; ``close()`` stops them. ``ring`` sends results through
    shared-memory rings of ``prefetch_factor + HELD`` slots per worker. ``seed`` is the workers'
    base seed: worker ``w`` seeds its RNGs from ``seed + w``, as torch's workers do.
    ``balanced``: any worker can answer any request (``pool.PoolIterator._next_worker``).
    """

    def __init__(self, fetcher: Any, sampler: Any, *, num_workers: int, seed: int,
                 prefetch_factor: int | None = None,
                 worker_init_fn: Callable[[int], None] | None = None, pin_memory: bool = False,
                 pin_memory_device: str = "", timeout: float = 0, in_order: bool = True,
                 balanced: bool = False, persistent_workers: bool = True,
                 multiprocessing_context: Any = None, ring: bool = True) -> None:
        if num_workers < 1:
            raise ValueError(f"a ProcessPool needs num_workers >= 1, got {num_workers}")
        self.fetcher = fetcher
        self.sampler = sampler
        self.num_workers = num_workers
        self.seed = seed
        self.prefetch_factor = prefetch_factor or 2
        self.worker_init_fn = worker_init_fn
        self.pin = pin_target(pin_memory, pin_memory_device)
        self.timeout = timeout
        self.in_order = in_order
        self.balanced = balanced
        self.persistent_workers = persistent_workers
        context = multiprocessing_context
        if context is None or isinstance(context, str):
            context = multiprocessing.get_context(context)
        self.context = context
        self.ring = ring
        self.workers: list[_Worker] = []
        self._reader = RingReader()
        self._generation = 0
        self._started: Any = None
        self._stop: Any = None
        self._start_deadline: float | None = None
        self._stalled: set[int] = set()  # workers reported stalled (killed at close)
        self._owner = os.getpid()  # only this process may stop the workers

    def __iter__(self) -> _ProcessIterator:
        if self._owner != os.getpid():
            self._forked()
        if self.workers and not self.persistent_workers:
            self.close()
        if not self.workers:
            self._start()
            _LIVE.add(self)
        self._generation += 1
        return _ProcessIterator(self, self._generation)

    def close(self, wait: bool = True) -> None:
        """Stop the workers: each is asked to exit after the fetch it is in, and killed if it
        has not within ``JOIN_S`` (one reported stalled is killed at once, so a timeout's
        error comes on time; all are, without ``wait``); then the slots of their rings are
        unlinked. In a process forked from the owner (a worker of another loader, the user's
        ``os.fork()``), the copy is only dropped: the workers and rings are the owner's."""
        workers, self.workers = self.workers, []
        stalled, self._stalled = self._stalled, set()
        if not workers or self._owner != os.getpid():
            return
        _LIVE.discard(self)
        self._stop.value = 1  # requests sent and not started are dropped
        for w, worker in enumerate(workers):
            if w in stalled or not wait:
                worker.process.kill()
                continue
            try:
                worker.requests.send(None)
            except OSError:  # gone already
                pass
        _drain_until_exited(workers, time.monotonic() + JOIN_S)
        for worker in workers:
            if worker.process.exitcode is None:
                worker.process.kill()
            worker.process.join()
            worker.requests.close()
            worker.results.close()
        self._reader.close([worker.process.pid for worker in workers])

    def __del__(self) -> None:
        if getattr(self, "workers", None):
            self.close()

    def __getstate__(self) -> dict[str, Any]:
        """A pool without workers (before its first ``iter()``, stopped at an epoch's end)
        pickles as its settings; one holding workers cannot (``refuse_live``)."""
        if self.workers and self._owner == os.getpid():
            refuse_live(self.num_workers)
        return {**self.__dict__, "workers": [], "_reader": None, "_started": None,
                "_stop": None, "_stalled": set()}

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.__dict__.update(state)
        self._reader = RingReader()
        self._owner = os.getpid()

    def _forked(self) -> None:
        """In a process forked from the owner (``ddp_fork``, the user's ``os.fork()``) that
        iterates its copy: the workers and rings are the owner's, left to it; this copy
        starts its own."""
        self.close()
        self._reader = RingReader()
        self._owner = os.getpid()

    def _start(self) -> None:
        """Start the workers, each registered in ``workers`` as it is forked (Ctrl-C held
        back meanwhile: ``signals_held``); if starting one fails or is interrupted, those
        started are stopped, so that none outlives the error unseen."""
        started = None
        if self.context.get_start_method() == "fork":
            started = self.context.RawArray("b", self.num_workers)
            self._start_deadline = time.monotonic() + START_S
        stop = self._stop = self.context.RawValue("b", 0)
        packer = RingPacker(slots=self.prefetch_factor + HELD) if self.ring else None
        # a fork server, not this process, is the parent of the workers it starts
        parent = None if self.context.get_start_method() == "forkserver" else os.getpid()
        try:
            for w in range(self.num_workers):
                requests_in, requests_out = self.context.Pipe(duplex=False)
                results_in, results_out = self.context.Pipe(duplex=False)
                for end in (requests_out, results_out):
                    _widen(end)
                process = self.context.Process(
                    target=_serve, name=f"lightning_loaders worker {w}", daemon=True,
                    args=(_Setup(w, self.num_workers, self.seed, parent, started, stop),
                          self.fetcher, packer, self.worker_init_fn, requests_in, results_out))
                with signals_held():
                    process.start()
                    self.workers.append(_Worker(process, requests_out, results_in))
                    requests_in.close()
                    results_out.close()
        except BaseException:
            self.close(wait=False)
            raise
        self._started = started

    def _check_started(self) -> None:
        """Past ``START_S`` after the fork, kill the live workers that have not started, and
        report them lost (the loader restarts its workers from the cursor)."""
        if self._start_deadline is None:
            return
        if all(self._started):
            self._start_deadline = None
        elif time.monotonic() > self._start_deadline:
            wedged: list[tuple[int, int | None, int | None]] = [
                (w, worker.process.pid, None) for w, worker in enumerate(self.workers)
                if not self._started[w] and worker.process.exitcode is None]
            if wedged:
                for w, _, _ in wedged:
                    self.workers[w].process.kill()
                raise WorkerLost(wedged, f"did not start within {START_S:g} s of its fork and "
                                         "was killed")

    def _raise_lost(self, error: Exception) -> NoReturn:
        """Raise what a failed pipe operation means: ``WorkerLost`` when a worker is seen
        dead within ``DEATH_GRACE_S``, else ``error`` itself."""
        dead = self._dead(grace_s=DEATH_GRACE_S)
        if dead:
            raise WorkerLost(dead) from error
        raise error

    def _dead(self, grace_s: float = 0.0) -> list[tuple[int, int | None, int | None]]:
        """``(worker id, pid, exit code)`` of the workers that have exited, waiting up to
        ``grace_s`` for one to be seen exiting."""
        deadline = time.monotonic() + grace_s
        while True:
            dead: list[tuple[int, int | None, int | None]] = [
                (w, worker.process.pid, worker.process.exitcode)
                for w, worker in enumerate(self.workers) if worker.process.exitcode is not None]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.01)


_LIVE: weakref.WeakSet[ProcessPool] = weakref.WeakSet()


def _forget_live_pools() -> None:
    """In a child forked from the owner (``os.fork()`` in user code): it owns none of the
    pools. Their workers also leave multiprocessing's list of this process's children, where
    a plain fork keeps them and whence its exit would terminate them, the owner's daemons
    (torch's ``DataLoader`` workers die that way)."""
    children = getattr(multiprocessing.process, "_children", None)
    for pool in list(_LIVE):
        for worker in pool.workers:
            if isinstance(children, set):
                children.discard(worker.process)
    _LIVE.clear()


os.register_at_fork(after_in_child=_forget_live_pools)


@atexit.register
def _close_live_pools() -> None:
    """Stop the pools still running when the interpreter exits, while the modules that
    ``close()`` needs are still there (``__del__`` may run after they are torn down)."""
    for pool in list(_LIVE):
        pool.close()


class _Worker:
    """A worker process and the main process's ends of its pipes."""

    def __init__(self, process: Any, requests: Connection, results: Connection) -> None:
        self.process, self.requests, self.results = process, requests, results


class _ProcessIterator(PoolIterator):
    """One pass over the pool's requests; a newer ``iter()`` on the pool replaces it."""

    def __init__(self, pool: ProcessPool, generation: int) -> None:
        super().__init__(pool, generation)
        self._pool: ProcessPool = pool
        # the result pipes, and the exit sentinels (None), by file descriptor, polled together
        self._watched: dict[int, Connection | None] = {}
        self._poll = select.poll()
        for worker in pool.workers:
            for fd, pipe in ((worker.results.fileno(), worker.results),
                             (worker.process.sentinel, None)):
                self._watched[fd] = pipe
                self._poll.register(fd, select.POLLIN)
        self._send()

    def _put(self, worker: int, number: int, request: Any) -> None:
        try:
            self._pool.workers[worker].requests.send((self._generation, number, request))
        except OSError as exc:  # a dead worker's pipe is closed
            self._pool._raise_lost(exc)

    def _take(self) -> Arrival:
        """The next result of this iterator's requests, waiting at most ``timeout``."""
        pool = self._pool
        deadline = self._deadline()
        watched = self._watched
        while True:
            pool._check_started()
            ready = [watched[fd] for fd, _ in self._poll.poll(self._wait_s(deadline) * 1000)]
            if None in ready:  # a worker exited
                raise WorkerLost(pool._dead(grace_s=DEATH_GRACE_S))
            for pipe in ready:
                assert pipe is not None
                message = self._receive(pipe)
                if message is not None:
                    return message
            if deadline is not None and time.monotonic() >= deadline:
                worker = self._due_worker()
                pool._stalled.add(worker)
                raise WorkerStalled(worker, pool.workers[worker].process.pid, pool.timeout)

    def _receive(self, pipe: Connection) -> Arrival | None:
        """Read one result from ``pipe`` (``None``: an abandoned iterator's), its ring slot
        freed and its tensors pinned when asked."""
        pool = self._pool
        try:
            generation, number, data = pipe.recv()
        except Exception as exc:  # a worker killed while it wrote
            pool._raise_lost(exc)
        if isinstance(data, Packed):
            data = pool._reader.unpack(data, pool.pin is not None)
        elif pool.pin is not None and not isinstance(data, torch_data_utils.ExceptionWrapper):
            data = torch_data_utils.pin_memory.pin_memory(data, pool.pin)
        return Arrival(number, data) if generation == self._generation else None


# -- worker side -----------------------------------------------------------------------------


class _Setup:
    """What a worker needs to know of itself (pickled to spawned workers); ``parent``: the pid
    its parent must keep (``None``: the one it has as it starts, a fork server's)."""

    def __init__(self, worker_id: int, num_workers: int, seed: int, parent: int | None,
                 started: Any, stop: Any) -> None:
        self.worker_id, self.num_workers, self.seed = worker_id, num_workers, seed
        self.parent, self.started, self.stop = parent, started, stop


def _serve(setup: _Setup, fetcher: Any, packer: RingPacker | None,
           init: Callable[[int], None] | None, requests: Connection,
           results: Connection) -> None:
    """A worker process: set up as torch's workers are, then answer each request of
    ``requests`` on ``results`` until ``None`` or the pool's stop flag (or EOF, Ctrl-C, the
    parent's death)."""
    w = setup.worker_id
    parent = os.getppid() if setup.parent is None else setup.parent
    if setup.started is not None:
        setup.started[w] = 1
    try:
        release_held_signals()  # forked while the pool held them back
        failure = _set_up(setup, fetcher, init)
        if packer is not None:
            packer.install()
        where = f"in DataLoader worker process {w}"
        watch = select.poll()  # kept: Connection.poll() builds a selector per call
        watch.register(requests.fileno(), select.POLLIN)
        while True:
            while not watch.poll(WATCH_S * 1000):
                if os.getppid() != parent:
                    return
            message = requests.recv()
            if message is None or setup.stop.value:
                return
            generation, number, request = message
            data: Any = failure
            if data is None:
                try:
                    data = fetcher[request]
                except Exception:
                    data = captured(where)
            if packer is not None:  # also an error's: it ends the slot collated into
                data = packer(data)
            try:
                payload = ForkingPickler.dumps((generation, number, data))
            except Exception:
                error = torch_data_utils.ExceptionWrapper(
                    where=f"{where}, pickling its result{_for_batch(request)}")
                payload = ForkingPickler.dumps((generation, number, error))
            del data, request, message
            results.send_bytes(payload)
    except (KeyboardInterrupt, EOFError, BrokenPipeError):
        return  # Ctrl-C reaches every process of the group; the main process stops the pool


def _for_batch(request: Any) -> str:
    """The batch and epoch a planned request asks for, to name in an error."""
    if not isinstance(request, BatchRequest):
        return ""
    return f" for batch {request.batch} of epoch {request.epoch} on rank {request.rank}"


def _set_up(setup: _Setup, fetcher: Any, init: Callable[[int], None] | None
            ) -> Raised | torch_data_utils.ExceptionWrapper | None:
    """Seed, publish torch's ``WorkerInfo`` and run ``init`` as torch's workers do; the error
    ``init`` raised, to answer every request with."""
    torch.multiprocessing._set_thread_name("pt_data_worker")  # as top and ps show torch's
    torch_data_utils.signal_handling._set_worker_signal_handlers()
    torch.set_num_threads(1)
    w = setup.worker_id
    seed = setup.seed + w
    random.seed(seed)
    torch.manual_seed(seed)
    np.random.seed(torch_worker._generate_state(setup.seed, w))
    torch_worker._worker_info = torch_worker.WorkerInfo(
        id=w, num_workers=setup.num_workers, seed=seed, dataset=fetcher)
    if init is None:
        return None
    try:
        init(w)
    except Exception:
        return captured(f"in DataLoader worker process {w}")
    return None


def _widen(pipe: Connection) -> None:
    """Ask for a ``PIPE_BYTES`` pipe buffer (where the platform allows it)."""
    try:
        fcntl.fcntl(pipe.fileno(), fcntl.F_SETPIPE_SZ, PIPE_BYTES)
    except (AttributeError, OSError):
        pass


def _drain_until_exited(workers: list[_Worker], deadline: float) -> None:
    """Wait for ``workers`` to exit until ``deadline``, reading and dropping what they send
    meanwhile (a worker must not stay blocked writing a result nobody reads; results pickled
    into named shared-memory files are rebuilt, so that their files are freed)."""
    rebuild = torch.multiprocessing.get_sharing_strategy() == "file_system"
    live: set[Any] = {worker.process.sentinel for worker in workers}
    pipes: set[Any] = {worker.results for worker in workers}
    while live and (left := deadline - time.monotonic()) > 0:
        ready: Any
        for ready in wait([*live, *pipes], timeout=left):
            if ready in live:
                live.discard(ready)
                continue
            try:
                if rebuild:
                    ready.recv()
                else:
                    ready.recv_bytes()
            except Exception:  # its writer is gone or was cut off
                pipes.discard(ready)
