"""What a worker pool's iterator does whatever its workers are (threads or processes).

A pool stands where ``DataLoader(fetcher, sampler=requests, batch_size=None,
num_workers=N)`` stands: it iterates the requests, has its ``N`` workers run
``fetcher[request]`` and delivers the results in request order, or, with ``in_order=False``,
as they finish. ``PoolIterator`` is that pass: torch's round-robin (worker ``w`` gets requests
``w``, ``w + N``, ... in order; out of order, the next worker in the round with fewer than
``prefetch_factor`` in hand; in order over a ``balanced`` pool, whose requests any worker can
answer, the next worker in the round with the fewest in hand), at most
``num_workers * prefetch_factor`` requests in flight, and a worker's exception re-raised in
the caller (torch's ``ExceptionWrapper``). Subclasses move
the requests and results (``_put``, ``_take``).

``WorkerLost`` and ``WorkerStalled`` are how a pool reports dead and late workers to the
loader, which restarts them from the cursor or raises its timeout error. ``signals_held`` keeps
a Ctrl-C from landing between a worker's start and its registration with its pool.
"""

from __future__ import annotations

import contextlib
import itertools
import signal
import threading
import time
import warnings
from collections.abc import Iterable, Iterator
from typing import Any, NamedTuple, NoReturn, Protocol

import torch
from torch.utils.data import _utils as torch_data_utils

from lightning_loaders.engines.autotune import run_delay_s
from lightning_loaders.engines.faults import Raised

__all__ = ["POLL_S", "Arrival", "FetchTimer", "InProcess", "PoolIterator", "WorkerLost",
           "WorkerStalled", "pin_target", "refuse_live", "release_held_signals", "signals_held"]

POLL_S = 0.1
"""Seconds between liveness checks of the workers while the main process waits for a batch."""


def refuse_live(workers: int) -> NoReturn:
    """Refuse to pickle (or deep-copy) a pool holding ``workers`` live workers: a copy could
    not reach them, and would start its own under the same cursor."""
    raise TypeError(f"cannot pickle or copy a loader while it holds {workers} workers: "
                    "close() it first (an iterator used afterwards starts new ones and goes "
                    "on from the cursor)")


_HELD_SIGNALS = (signal.SIGINT, signal.SIGTERM)
_held: tuple[dict[int, Any], list[int]] | None = None
"""While ``signals_held()`` holds: the handlers it replaced, and the signals that arrived."""


@contextlib.contextmanager
def signals_held() -> Iterator[None]:
    """Hold SIGINT and SIGTERM back while a worker starts and joins its pool, then raise those
    that arrived meanwhile again. Their Python handlers (``KeyboardInterrupt``, a
    ``sys.exit``) run in the main thread between any two bytecodes: one that ran after a
    worker's fork (or a thread's start) and before the pool registered it would leave a
    worker ``close()`` never sees. Blocking the signals in the main thread would not do: another
    thread takes them, and the main thread still runs the handler. Elsewhere than in the main
    thread no handler runs, so nothing is held; a process forked meanwhile calls
    ``release_held_signals()`` as it starts."""
    global _held
    if _held is not None or threading.current_thread() is not threading.main_thread():
        yield
        return
    handlers: dict[int, Any] = {}
    arrived: list[int] = []
    _held = (handlers, arrived)
    try:
        for signum in _HELD_SIGNALS:
            handler = signal.getsignal(signum)
            if callable(handler):  # not SIG_DFL or SIG_IGN: no Python code runs for those
                handlers[signum] = handler
                signal.signal(signum, lambda signum, _: arrived.append(signum))
        yield
    finally:
        release_held_signals()


def release_held_signals() -> None:
    """End ``signals_held()``: the handlers as they were, then each signal that arrived meanwhile
    raised again (so its handler runs now). In a worker process forked while they were held,
    its first step, so that it stops on Ctrl-C as before; elsewhere nothing."""
    global _held
    if _held is None:
        return
    handlers, arrived = _held
    for signum, handler in handlers.items():
        signal.signal(signum, handler)
    _held = None
    for signum in dict.fromkeys(arrived):
        signal.raise_signal(signum)


class WorkerLost(Exception):
    """Internal: workers died, or were killed because they never started. ``workers`` holds
    ``(worker id, pid, exit code)``; ``reason`` says why, when the exit code does not."""

    def __init__(self, workers: list[tuple[int, int | None, int | None]],
                 reason: str | None = None) -> None:
        super().__init__(f"DataLoader workers lost: {workers}" + (f" ({reason})" if reason
                                                                   else ""))
        self.workers, self.reason = workers, reason


class WorkerStalled(Exception):
    """Internal: no batch within ``timeout``; ``worker``/``pid`` owe the batch due next."""

    def __init__(self, worker: int | None, pid: int | None, timeout: float) -> None:
        super().__init__(f"DataLoader worker {worker} (pid {pid}) stalled for {timeout} s")
        self.worker, self.pid, self.timeout = worker, pid, timeout


class Arrival(NamedTuple):
    """A result as it reaches the main process: the number of its request and the data."""

    number: int
    data: Any


def pin_target(pin_memory: bool, device: str = "") -> str | None:
    """The device type whose pinned memory batches go to (``None``: no pinning), warning as
    ``DataLoader`` does when ``pin_memory`` is asked for without an accelerator."""
    if not pin_memory:
        return None
    if not torch.accelerator.is_available():
        warnings.warn("'pin_memory' argument is set as true but no accelerator is found, "
                      "then device pinned memory won't be used.", stacklevel=3)
        return None
    accelerator = torch.accelerator.current_accelerator()
    if device:
        return device
    return None if accelerator is None or accelerator.type == "mps" else accelerator.type


class Pool(Protocol):
    """What a ``PoolIterator`` reads of its pool."""

    sampler: Iterable[Any]
    num_workers: int
    prefetch_factor: int
    in_order: bool
    balanced: bool
    persistent_workers: bool
    timeout: float
    _generation: int

    def close(self) -> None: ...


class PoolIterator(Iterator[Any]):
    """One pass over a pool's requests (see the module docstring); a newer ``iter()`` on the
    pool (its ``_generation``) replaces it."""

    def __init__(self, pool: Pool, generation: int) -> None:
        self._pool = pool
        self._generation = generation
        self._requests = iter(pool.sampler)
        num_workers, self._prefetch = pool.num_workers, pool.prefetch_factor
        self._num_workers, self._in_order = num_workers, pool.in_order
        self._balanced = pool.balanced
        self._limit = num_workers * self._prefetch
        self._cycle = itertools.cycle(range(num_workers))
        self._per_worker = [0] * num_workers
        self._sent = 0
        self._received = 0  # the next result to deliver (in_order=True)
        self._pending: dict[int, int] = {}  # sent, not received: the worker
        self._done: dict[int, Arrival] = {}  # received ahead of their turn (in_order=True)
        self._exhausted = False

    def __next__(self) -> Any:
        self._check()
        while True:
            self._send()
            arrival = self._done.pop(self._received, None)
            if arrival is None:
                if not self._pending:  # every request sent was delivered
                    self._finished()
                    raise StopIteration
                arrival = self._take()
                worker = self._pending.pop(arrival.number)
                self._per_worker[worker] -= 1
                if self._in_order and arrival.number != self._received:
                    self._done[arrival.number] = arrival
                    continue
            if self._in_order:
                self._received += 1
            self._send()  # keep the workers busy while the caller uses this result
            data = arrival.data
            if isinstance(data, torch_data_utils.ExceptionWrapper | Raised):
                data.reraise()
            return data

    # -- for subclasses ---------------------------------------------------------------------

    def _check(self) -> None:
        """Raise if this iterator may not go on (called at every ``next()``)."""
        if self._pool._generation != self._generation:
            raise RuntimeError("this iterator was replaced by a newer iter() on its pool")

    def _window(self) -> int:
        """How many requests may be sent and not delivered now."""
        return self._limit

    def _put(self, worker: int, number: int, request: Any) -> None:
        """Hand request ``number`` to ``worker``."""
        raise NotImplementedError

    def _take(self) -> Arrival:
        """The next result of this iterator's requests to reach the main process."""
        raise NotImplementedError

    def _finished(self) -> None:
        """Every request was delivered: workers that do not persist stop."""
        if not self._pool.persistent_workers:
            self._pool.close()

    def _deadline(self) -> float | None:
        """When a result asked for now is late (``None``: never)."""
        timeout = self._pool.timeout
        return time.monotonic() + timeout if timeout > 0 else None

    @staticmethod
    def _wait_s(deadline: float | None) -> float:
        """How long to wait for a result before looking at the workers again."""
        return POLL_S if deadline is None else max(0.0, min(POLL_S, deadline - time.monotonic()))

    def _due_worker(self) -> int:
        """The worker whose result is awaited longest (named when it is late)."""
        return self._pending[min(self._pending)]

    # -- sending ----------------------------------------------------------------------------

    def _send(self) -> None:
        """Send requests while fewer than ``_window()`` are sent and not delivered."""
        while not self._exhausted:
            if len(self._pending) + len(self._done) >= self._window():
                return
            try:
                request = next(self._requests)
            except StopIteration:
                self._exhausted = True
                return
            worker = self._next_worker()
            self._put(worker, self._sent, request)
            self._pending[self._sent] = worker
            self._per_worker[worker] += 1
            self._sent += 1

    def _next_worker(self) -> int:
        """torch's choice: round-robin; with ``in_order=False``, the next worker in the round
        with fewer than ``prefetch_factor`` requests in hand.

        In order over a ``balanced`` pool, the next worker in the round with the fewest in
        hand: a worker that runs ahead (its core less taken by the main process) takes more
        requests, where round-robin would leave it waiting for the slower one's result to free
        the in-flight window (2-4% of a 2-core epoch, ``benchmarks/README.md``)."""
        if self._in_order and not self._balanced:
            return next(self._cycle)
        counts = self._per_worker
        most = min(counts) if self._in_order else self._prefetch - 1  # in hand, to be chosen
        for _ in range(self._num_workers):
            w = next(self._cycle)
            if counts[w] <= most:
                return w
        return w


class FetchTimer(Protocol):
    """What ``InProcess`` reports its fetches to (``backend="auto"``'s ``AutoChoice``): while
    ``serial_phase`` holds, each fetch's wall and CPU seconds, its result and the seconds it
    waited for a core, as fetches that ran alone."""

    @property
    def serial_phase(self) -> bool: ...

    def record(self, serial: bool, wall_s: float, result: Any, cpu_s: float,
               delay_s: float = 0.0) -> None: ...


class InProcess:
    """What a pool does without workers: each request is fetched in the calling thread when
    its result is asked for (pinned when ``pin`` names a device), and timed for ``timer``
    while it measures fetches alone."""

    def __init__(self, fetcher: Any, sampler: Iterable[Any], pin: str | None,
                 timer: FetchTimer | None = None) -> None:
        self.fetcher, self.sampler, self.pin, self.timer = fetcher, sampler, pin, timer

    def __iter__(self) -> Iterator[Any]:
        fetcher, pin, timer = self.fetcher, self.pin, self.timer
        for request in self.sampler:
            if timer is not None and timer.serial_phase:
                start, cpu, delay = time.perf_counter(), time.thread_time(), run_delay_s()
                data = fetcher[request]
                delay = run_delay_s() - delay  # first: a later wait would not be in the wall
                timer.record(True, time.perf_counter() - start, data, time.thread_time() - cpu,
                             delay)
            else:
                data = fetcher[request]
            yield data if pin is None else torch_data_utils.pin_memory.pin_memory(data, pin)
