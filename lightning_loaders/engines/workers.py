"""torch's worker processes, watched: a dead or stalled worker is reported where it can be
handled, by id and pid.

torch reports a dead worker from a ``SIGCHLD`` handler, which raises in whatever code the main
thread runs at that moment (often the training step, where nothing can recover). ``WorkerPool``
iterators take their workers off that handler and instead check them every ``POLL_S`` seconds
while waiting for a batch, raising ``WorkerLost`` from the loader's own ``next()``; a
``timeout`` raises ``WorkerStalled`` naming the worker whose batch is due. A forked worker that
does not reach torch's worker loop within ``START_S`` is killed and reported as lost too: before
3.11.8, CPython can fork a child while another thread (gloo's, under DDP) holds the interpreter's
thread-list lock, and that child waits for it forever (gh-112275). ``shutdown`` stops
an iterator's workers without leaving shared memory behind. Results that workers packed into
their shared-memory rings (``transport.RingPacker``) are unpacked as soon as they are received,
freeing their slots. This relies on private parts of
``torch.utils.data`` (checked by the tests on every torch upgrade).
"""

from __future__ import annotations

import multiprocessing
import queue
import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader
from torch.utils.data import _utils as torch_data_utils
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter

from lightning_loaders.engines.transport import Packed, RingReader

__all__ = ["POLL_S", "START_S", "WorkerLost", "WorkerPool", "WorkerStalled", "shutdown"]

POLL_S = 0.1
"""Seconds between liveness checks of the workers while the main process waits for a batch."""
START_S = 10.0
"""How long a forked worker may take to reach torch's worker loop before it counts as wedged."""
DEATH_GRACE_S = 2.0
"""How long a failed receive waits for a worker to be seen dead before it counts as an error."""
DRAIN_S = 2.0
"""Under the ``file_system`` sharing strategy, how long ``shutdown`` waits for batches in the
making (so that their shared-memory files are freed, not left until the process exits)."""


class WorkerLost(Exception):
    """Internal: worker processes died, or were killed because they never started.
    ``workers`` holds ``(worker id, pid, exit code)``; ``reason`` says why, when the exit code
    does not."""

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


class WorkerPool(DataLoader[Any]):
    """The loader's internal ``DataLoader``: its multi-process iterators are watched. Forked
    workers mark themselves started (a flag each, in memory shared with them) before the
    ``worker_init_fn`` they were given."""

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.started: Any = None
        context = self.multiprocessing_context or multiprocessing.get_context()
        if self.num_workers > 0 and context.get_start_method() == "fork":
            self.started = context.RawArray("b", self.num_workers)
            self.worker_init_fn = _MarkStarted(self.started, self.worker_init_fn)

    def _get_iterator(self) -> Any:
        if self.num_workers == 0:
            return super()._get_iterator()
        return _WatchedIterator(self)


class _WatchedIterator(_MultiProcessingDataLoaderIter):
    """Watched workers; and a sampler iterator with ``ready()`` (out-of-order delivery)
    holds requests back until it is ready, so batches never run further ahead of the
    first undelivered one than the in-flight window."""

    def __init__(self, loader: WorkerPool) -> None:
        self._ring_reader = RingReader()
        self._started = loader.started
        if self._started is not None:
            self._started[:] = [0] * len(self._started)
        super().__init__(loader)
        self._start_deadline = time.monotonic() + START_S if self._started is not None else None
        if self._worker_pids_set:
            torch_data_utils.signal_handling._remove_worker_pids(id(self))
            self._worker_pids_set = False

    def _try_put_index(self) -> None:
        ready = getattr(self._sampler_iter, "ready", None)
        if ready is None:
            super()._try_put_index()
        elif self._tasks_outstanding < self._prefetch_factor * self._num_workers and ready():
            super()._try_put_index()

    def _next_data(self) -> Any:
        """Send what was held back and is ready now, then torch's ``_next_data``."""
        ready = getattr(self._sampler_iter, "ready", None)
        limit = self._prefetch_factor * self._num_workers
        while ready is not None and self._tasks_outstanding < limit and ready():
            sent = self._send_idx
            super()._try_put_index()
            if self._send_idx == sent:
                break
        return super()._next_data()

    def _try_get_data(self, timeout: float = torch_data_utils.MP_STATUS_CHECK_INTERVAL
                      ) -> tuple[bool, Any]:
        deadline = time.monotonic() + timeout
        while True:
            if self._start_deadline is not None:
                self._check_started()
            wait = min(POLL_S, max(0.0, deadline - time.monotonic()))
            try:
                found, data = super()._try_get_data(timeout=wait)
            except Exception as exc:
                # torch names dead workers it has seen; a worker killed while its batch was
                # being received shows as a broken connection first, and as dead just after.
                dead = self._dead_workers(grace_s=DEATH_GRACE_S)
                if not dead:
                    raise
                raise WorkerLost(dead) from exc
            if found and isinstance(data, tuple) and isinstance(data[1], Packed):
                # a dead worker's batches stay readable in its ring (torch's cannot be rebuilt
                # once their sender is gone): report the death now, as torch's path would
                dead = self._dead_workers(grace_s=0)
                if dead:
                    raise WorkerLost(dead)
                return found, (data[0], self._ring_reader.unpack(data[1], self._pin_memory))
            if found or time.monotonic() >= deadline:
                return found, data

    def _check_started(self) -> None:
        """Past ``START_S`` after the fork, kill the live workers that have not started, and
        report them lost (the loader restarts its workers from the cursor)."""
        assert self._start_deadline is not None
        if all(self._started):
            self._start_deadline = None
        elif time.monotonic() > self._start_deadline:
            wedged: list[tuple[int, int | None, int | None]] = [
                (i, w.pid, None) for i, w in enumerate(self._workers)
                if not self._started[i] and w.exitcode is None]
            if wedged:
                for i, _, _ in wedged:
                    self._workers[i].kill()
                raise WorkerLost(wedged, f"did not start within {START_S:g} s of its fork and "
                                         "was killed")

    def _dead_workers(self, grace_s: float) -> list[tuple[int, int | None, int | None]]:
        """``(worker id, pid, exit code)`` of the workers that have exited, waiting up to
        ``grace_s`` for one to be seen exiting."""
        deadline = time.monotonic() + grace_s
        while True:
            dead: list[tuple[int, int | None, int | None]] = [
                (i, w.pid, w.exitcode) for i, w in enumerate(self._workers)
                if w.exitcode is not None]
            if dead or time.monotonic() >= deadline:
                return dead
            time.sleep(0.01)

    def _shutdown_workers(self) -> None:
        """torch's shutdown (also run by ``__del__``), without leaving shared memory behind:
        under the ``file_system`` sharing strategy every batch a worker made holds a
        ``/dev/shm`` file until it is received, so batches in the making are awaited (for at
        most ``DRAIN_S``) and batches sent but not received are read and dropped."""
        exiting = torch_data_utils.python_exit_status is not False
        if self._shutdown or exiting:
            super()._shutdown_workers()
        else:
            named = torch.multiprocessing.get_sharing_strategy() == "file_system"
            if named:
                _receive_outstanding(self, DRAIN_S)
            super()._shutdown_workers()
            if named:
                _drop_unreceived(self)
        reader = getattr(self, "_ring_reader", None)
        if reader is not None:  # the workers have stopped: no slot of theirs is needed
            reader.close([w.pid for w in getattr(self, "_workers", [])])

    def _get_data(self) -> Any:
        if self._timeout <= 0:
            try:
                return super()._get_data()
            except RuntimeError as exc:  # the pin-memory thread dies on a batch a killed worker
                dead = self._dead_workers(grace_s=DEATH_GRACE_S)  # could not finish sending
                if not dead:
                    raise
                raise WorkerLost(dead) from exc
        found, data = self._try_get_data(self._timeout)
        if found:
            return data
        info = self._task_info.get(self._rcvd_idx)
        worker = info[0] if info else None
        pid = self._workers[worker].pid if worker is not None else None
        raise WorkerStalled(worker, pid, self._timeout)


class _MarkStarted:
    """``worker_init_fn`` wrapper: sets this worker's flag, then calls ``init_fn``."""

    def __init__(self, started: Any, init_fn: Callable[[int], None] | None) -> None:
        self.started, self.init_fn = started, init_fn

    def __call__(self, worker_id: int) -> None:
        self.started[worker_id] = 1
        if self.init_fn is not None:
            self.init_fn(worker_id)


def shutdown(iterator: Any) -> None:
    """Stop a torch iterator's worker processes (and pin-memory thread) now, if it has any."""
    if isinstance(iterator, _MultiProcessingDataLoaderIter):
        iterator._shutdown_workers()


def _receive_outstanding(iterator: _WatchedIterator, limit_s: float) -> None:
    """Receive (and drop) the batches already asked of live workers, for at most ``limit_s``."""
    deadline = time.monotonic() + limit_s
    while iterator._tasks_outstanding > 0 and all(w.is_alive() for w in iterator._workers):
        left = deadline - time.monotonic()
        if left <= 0:
            return
        try:
            found, _ = iterator._try_get_data(timeout=min(left, POLL_S))
        except Exception:  # a worker died meanwhile: nothing more will come
            return
        if found:
            iterator._tasks_outstanding -= 1


def _drop_unreceived(iterator: _WatchedIterator) -> None:
    """Read and drop what stopped workers sent but nobody received (only after workers that all
    exited cleanly: one killed mid-send can leave a cut message that must not be read)."""
    if iterator._pin_memory or any(w.exitcode != 0 for w in iterator._workers):
        return
    while True:
        try:
            iterator._worker_result_queue.get(timeout=0)
        except queue.Empty:
            return
        except Exception:  # a batch whose sender is gone cannot be rebuilt: nothing to free
            continue
