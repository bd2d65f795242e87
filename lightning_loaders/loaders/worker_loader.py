"""``WorkerLoader``: the delivery core plus what the loaders with workers share:
``DataLoader``'s attributes and worker options, the pool of workers (``engines.workers``'
processes or ``engines.threads``' threads, by ``backend``; persistent, restarted from the
cursor after a crash), and the crash and stall errors.
"""

from __future__ import annotations

import dataclasses
import logging
import multiprocessing
import os
import threading
import warnings
from collections.abc import Callable, Iterator
from typing import Any

from torch.utils.data import Dataset, Sampler, default_collate, get_worker_info
from torch.utils.data._utils import worker as torch_worker

from lightning_loaders.context import WorkerInfo, set_worker
from lightning_loaders.engines.autotune import Autotuner, Setting, Tuning
from lightning_loaders.engines.faults import Failed, OnError
from lightning_loaders.engines.fetch import BatchFetcher
from lightning_loaders.engines.pool import InProcess, WorkerLost, WorkerStalled, pin_target
from lightning_loaders.engines.shard_reader import SlotFetcher
from lightning_loaders.engines.threads import AutoChoice, BackendSwitch, ThreadPool, thread_worker
from lightning_loaders.engines.workers import ProcessPool
from lightning_loaders.errors import (
    WorkerCrashedError,
    WorkerInitError,
    WorkerTimeoutError,
    describe_exit,
    user_error,
)
from lightning_loaders.hashing import mix64
from lightning_loaders.loaders.delivery import Delivery, DeliveryCore
from lightning_loaders.loaders.options import (
    LoaderOptions,
    check_loader_arguments,
    check_picklable,
    int_counts,
    start_method,
)
from lightning_loaders.loaders.tuned import TunedDelivery, autotuner_for
from lightning_loaders.schedule.map_schedule import resolve_seed

__all__ = ["WorkerLoader"]

_log = logging.getLogger(__name__)
_FIXED = frozenset(("batch_size", "batch_sampler", "sampler", "drop_last", "dataset",
                    "persistent_workers"))  # what DataLoader refuses to change once built


class WorkerLoader(DeliveryCore):
    """Base of the loaders that run worker pools (see the module docstring).

    A subclass calls ``_take_options`` in its constructor, sets ``schedule`` and implements
    the delivery core's hooks and ``_position`` (the batch due next, named in errors).
    """

    schedule: Any
    _initialized = False
    _waits = True  # close() waits for the workers (not as an error leaves the loop)
    _autotuner: Autotuner | None = None
    _collating: Any = None  # the collate_fn the fetcher was made with
    shared_ring = True
    """Worker processes send batches through reusable shared-memory rings
    (``engines.transport``); ``False`` (set before iterating) uses torch's per-batch segments."""

    def __setattr__(self, name: str, value: Any) -> None:
        """Refuse, as ``DataLoader`` does, to change how batches are made once built; a start
        method's name set as ``multiprocessing_context`` is kept as its context, as
        ``DataLoader`` keeps it."""
        if self._initialized and name in _FIXED:
            raise ValueError(f"{name} attribute should not be set after "
                             f"{type(self).__name__} is initialized: build a new loader")
        if name == "multiprocessing_context" and isinstance(value, str):
            value = multiprocessing.get_context(value)
        super().__setattr__(name, value)

    def _take_options(self, dataset: Any, options: LoaderOptions, *, drop_last: bool,
                      process_wide: str | None = None, turns: bool = False) -> None:
        """Check and keep ``DataLoader``'s arguments (as its attributes) and the worker
        options; the dataset, collate_fn and worker_init_fn must pickle for workers.
        ``drop_last`` is what the resolved last-batch policy says; ``process_wide`` names what
        the workers set up in state shared by the whole process (``backend="auto"`` then
        starts on processes, where each worker has its own); ``turns``: threads would take
        turns at it, holding the global RNGs (a warning says so when threads are used)."""
        o = options
        check_loader_arguments(
            batch_size=o.batch_size, num_workers=o.num_workers, timeout=o.timeout,
            prefetch_factor=o.prefetch_factor, persistent_workers=o.persistent_workers,
            collate_fn=o.collate_fn, worker_init_fn=o.worker_init_fn,
            multiprocessing_context=o.multiprocessing_context, on_error=o.on_error,
            max_worker_restarts=o.max_worker_restarts,
            snapshot_every_n_steps=o.snapshot_every_n_steps, backend=o.backend,
            compare_ranks=o.compare_ranks)
        o = int_counts(o)
        assert o.batch_size is not None
        self._autotuner = autotuner_for(o.num_workers, o.prefetch_factor)
        tuned = self._autotuner.tuning.setting if self._autotuner else None
        num_workers = o.num_workers if tuned is None else tuned.workers
        assert isinstance(num_workers, int)
        self.backend = o.backend
        self._auto: AutoChoice | None = None  # backend="auto": made with the first workers
        if (num_workers > 0 or tuned is not None) and o.backend != "thread":  # threads share
            try:
                check_picklable(start_method(o.multiprocessing_context), dataset=dataset,
                                collate_fn=o.collate_fn, worker_init_fn=o.worker_init_fn)
            except ValueError:
                if o.backend != "auto":
                    raise
                # auto cannot move what does not pickle
                self._auto = AutoChoice(max(1, num_workers), backend="thread")
            if self._auto is None and o.backend == "auto":
                shared = _shared_under_threads(o.worker_init_fn, process_wide)
                if shared is not None:
                    _log.info("backend='auto' chose process workers: %s", shared)
                    self._auto = AutoChoice(max(1, num_workers), backend="process")
        threads = o.backend == "thread" or (self._auto is not None
                                            and self._auto.backend == "thread")
        if turns and threads and (num_workers > 0 or tuned is not None):
            warnings.warn(
                f"worker threads: {process_wide}: they read one at a time, and what the "
                "training loop draws from random/numpy/torch while a thread reads comes from "
                "the reader's states and is lost; use backend='process'", stacklevel=4)
        self.dataset = dataset
        self.batch_size: int = o.batch_size
        self.batch_sampler: Any = None  # DataLoader's attribute (Lightning reads it)
        self.num_workers = num_workers
        self.collate_fn = default_collate if o.collate_fn is None else o.collate_fn  # as torch's
        self.pin_memory = o.pin_memory
        self.drop_last = drop_last
        self.timeout = o.timeout
        self.worker_init_fn = o.worker_init_fn
        self.multiprocessing_context = o.multiprocessing_context
        self.generator = o.generator
        self.prefetch_factor = (o.prefetch_factor or 2) if num_workers else None  # as torch's
        self.persistent_workers = ((num_workers > 0 or tuned is not None)
                                   and o.persistent_workers is not False)
        self.pin_memory_device = o.pin_memory_device
        self.in_order = o.in_order
        self.snapshot_every_n_steps = o.snapshot_every_n_steps
        self.compare_ranks = o.compare_ranks
        self.seed = resolve_seed(o.seed, o.generator)
        self.on_error: OnError = o.on_error
        self.max_worker_restarts = o.max_worker_restarts
        self._pool: ProcessPool | ThreadPool | InProcess | None = None
        self._epoch_restarts = 0
        self.worker_restarts = 0
        """Worker restarts after crashes in this process (all epochs)."""

    def __iter__(self) -> Iterator[Any]:
        """A new iterator (cheap); with ``num_workers="auto"``, timed for the autotuner."""
        iterator = super().__iter__()
        if self._autotuner is None:
            return iterator
        assert isinstance(iterator, Delivery)
        return TunedDelivery(iterator, self._autotuner, self._run_setting, self._batches_left,
                             self._untunable, settled=self._settled, serial=self._serial,
                             take_back=iterator.take_back)

    @property
    def autotune(self) -> Tuning | None:
        """With ``num_workers="auto"``: where tuning stands (the setting decided, the best
        trial, every trial measured, the reason for the last decision; also logged at INFO);
        ``None`` for a fixed count. ``num_workers`` and ``prefetch_factor`` are the setting
        running now (a change decided near an epoch's end runs from the next epoch)."""
        return None if self._autotuner is None else self._autotuner.tuning

    @property
    def backend_in_use(self) -> str | None:
        """What the workers are: ``"process"`` or ``"thread"``; ``"main"`` without workers
        (``num_workers=0``); ``None`` while ``backend="auto"`` is still measuring (on
        threads, during the first batches)."""
        if self.num_workers == 0:
            return "main"
        if self.backend != "auto":
            return self.backend
        return self._auto.backend if self._auto is not None else None

    def close(self) -> None:
        """Shut the workers down now (they also stop when the loader is collected); worker
        threads are joined. From another thread, once the ``next()`` in flight has returned.

        Nothing is lost: an iterator used after ``close()`` starts new workers and continues
        from the cursor.
        """
        pool, self._pool = self._pool, None
        super().close()
        if isinstance(pool, ThreadPool | ProcessPool):
            pool.close(wait=self._waits)

    def _own_worker_thread(self) -> str | None:
        pool, thread = self._pool, threading.current_thread()
        if isinstance(pool, ThreadPool) and thread in pool.threads:
            return thread.name
        return None

    def _close_after_error(self) -> None:
        """``close()`` as an error leaves the loop: worker processes are killed at once (what
        they fetch would be dropped anyway) and threads left to end their fetch on their own,
        so that the error reaches the caller without waiting for a slow sample."""
        self._waits = False
        try:
            self.close()
        finally:
            self._waits = True

    # -- for subclasses ---------------------------------------------------------------------

    def _position(self) -> int:
        """The batch of the current epoch due next on this rank (named in errors)."""
        raise NotImplementedError

    def _collate_fn_changed(self) -> bool:
        """Whether ``collate_fn`` was reassigned since the fetcher was made (``DataLoader``'s
        next iterator collates with the new one); the workers, which hold the old one, are
        then stopped, and new ones start from the cursor."""
        if self.collate_fn is self._collating:
            return False
        self.close()
        self._collating = self.collate_fn
        return True

    # -- workers ----------------------------------------------------------------------------

    def _run_setting(self, setting: Setting) -> None:
        """Run the autotuner's ``setting``: the pool restarts from the cursor with it."""
        self.num_workers = setting.workers
        self.prefetch_factor = setting.prefetch if setting.workers else None
        self.close()

    def _untunable(self) -> str | None:
        """Why no worker count could change this loader's speed (``None``: it can)."""
        return None

    def _settled(self) -> bool:
        """Whether the workers are what they will stay: ``backend="auto"`` has chosen, and
        the threads it leaves have delivered what they had in hand."""
        backend = self.backend_in_use
        return backend is not None and not (backend == "process"
                                            and isinstance(self._pool, ThreadPool))

    def _batches_left(self) -> int | None:
        """Batches left in the current epoch on this rank (``None``: unknown)."""
        try:
            return self.schedule.num_batches() - self.schedule.batches
        except TypeError:
            return None

    def _backend_fields(self) -> list[str]:
        """``repr`` fields naming the backend, when it is not the default."""
        if self.backend == "process":
            return []
        if self.backend == "thread" or self.num_workers == 0:
            return [f"backend={self.backend!r}"]
        return [f"backend='auto' ({self.backend_in_use or 'measuring'})"]

    def _auto_choice(self) -> AutoChoice | None:
        """``backend="auto"``'s measurement and choice, made when first needed: with the first
        workers, or without workers under ``num_workers="auto"`` (the main process's fetches
        are then its fetches alone); it measures for the workers that run."""
        if self.backend == "auto" and self._auto is None:
            if self.num_workers > 0:
                self._auto = AutoChoice(self.num_workers)
            elif self._autotuner is not None:
                self._auto = AutoChoice(self._autotuner.config.max_workers or 1)
        if self._auto is not None and self._auto.backend is None and self.num_workers > 0:
            self._auto.num_workers = self.num_workers
        return self._auto

    def _worker_pool(self, fetcher: Dataset[Any], sampler: Sampler[Any],
                     prefetch_factor: int | None, *, balanced: bool = False
                     ) -> ProcessPool | ThreadPool | InProcess:
        """The pool that answers ``sampler``'s requests with ``fetcher``: worker processes,
        threads, or the calling thread without workers (kept, with persistent workers, until
        ``close()``). ``balanced``: any worker can answer any request, so the workers with the
        fewest in hand get the next ones (a slot's requests go to its own worker, which keeps
        its reader)."""
        auto = self._auto_choice()
        threads = self.num_workers > 0 and self.backend_in_use != "process"
        if self._pool is None and threads:
            rank, world_size = self.schedule.placement
            self._pool = ThreadPool(
                fetcher, sampler, num_workers=self.num_workers, prefetch_factor=prefetch_factor,
                worker_init_fn=_WorkerStart(self.worker_init_fn, self.num_workers, rank,
                                            world_size, self.schedule.epoch or 0, self.seed),
                pin_memory=self.pin_memory, timeout=self.timeout, in_order=self.in_order,
                balanced=balanced, persistent_workers=self.persistent_workers,
                auto=auto if self.backend_in_use is None else None)
        if self._pool is None and self.num_workers == 0:
            self._pool = InProcess(fetcher, sampler,
                                   pin_target(self.pin_memory, self.pin_memory_device), auto)
        if self._pool is None:
            rank, world_size = self.schedule.placement
            self._pool = ProcessPool(
                fetcher, sampler, num_workers=self.num_workers, seed=mix64(self.seed, rank) >> 1,
                prefetch_factor=prefetch_factor,
                worker_init_fn=_WorkerStart(self.worker_init_fn, self.num_workers, rank,
                                            world_size, self.schedule.epoch or 0, self.seed),
                pin_memory=self.pin_memory, pin_memory_device=self.pin_memory_device,
                timeout=self.timeout, in_order=self.in_order, balanced=balanced,
                persistent_workers=self.persistent_workers,
                multiprocessing_context=self.multiprocessing_context, ring=self.shared_ring)
        return self._pool

    def _recover(self, lost: WorkerLost) -> None:
        """Stop every worker (new ones start from the cursor) and count a restart, or raise
        ``WorkerCrashedError`` past ``max_worker_restarts`` in this epoch (the restart is
        logged before the workers are stopped). After ``backend="auto"``
        chose processes, only stop the threads, and let what they started end before the
        processes are forked (``ThreadPool.settle``): processes go on from the cursor."""
        if isinstance(lost, BackendSwitch):
            threads = self._pool
            self.close()
            if isinstance(threads, ThreadPool):
                threads.settle()
            return
        worker, pid, exitcode = lost.workers[0]
        rank, epoch, batch = self.schedule.placement[0], self.schedule.epoch, self._position()
        what = (f"DataLoader worker {worker} (pid {pid}) {lost.reason or describe_exit(exitcode)}"
                f" with batch {batch} of epoch {epoch} due next on rank {rank}")
        if len(lost.workers) > 1:
            what += f" (also lost: {[(w, p) for w, p, _ in lost.workers[1:]]} as (worker, pid))"
        if self._epoch_restarts >= self.max_worker_restarts:
            if self.max_worker_restarts == 0:
                fix = ("worker recovery is off (max_worker_restarts=0): set max_worker_restarts "
                       ">= 1 to restart the workers from the cursor and continue")
            else:
                fix = (f"gave up after {self._epoch_restarts} restarts in this epoch "
                       f"(max_worker_restarts={self.max_worker_restarts}): "
                       f"{self._why_workers_end(exitcode)}")
            self._close_after_error()
            raise WorkerCrashedError(f"{what}; {fix}", worker=worker, pid=pid,
                                     exitcode=exitcode, epoch=epoch, batch=batch, rank=rank,
                                     restarts=self._epoch_restarts) from None
        self._epoch_restarts += 1
        self.worker_restarts += 1
        _log.warning("%s; restarting %d workers from the cursor (restart %d of at most %d in "
                     "this epoch)", what, self.num_workers, self._epoch_restarts,
                     self.max_worker_restarts)
        self._close_after_error()

    def _why_workers_end(self, exitcode: int | None) -> str:
        """Where to look for why workers keep ending with ``exitcode``: a worker killed by a
        signal (or lost otherwise) points at memory or a sample; one that exited with a code
        of its own said why on stderr, and a spawned one may not import the main module."""
        if exitcode is None or exitcode <= 0:
            return "look at the workers' memory use, or at the samples of that batch"
        why = "a worker that exits with a code of its own says why on stderr, above"
        if start_method(self.multiprocessing_context) != "fork":
            why += ("; a worker started by 'spawn' or 'forkserver' first imports the main "
                    "module, so a script needs `if __name__ == \"__main__\":` and code given "
                    "on stdin or in a notebook cell cannot define the dataset")
        return why

    def _stall_error(self, stalled: WorkerStalled) -> WorkerTimeoutError:
        """The error for a batch later than ``timeout`` (workers are stopped first)."""
        if isinstance(self._pool, ThreadPool):
            who = (f"DataLoader worker thread {stalled.worker} (named 'lightning_loaders "
                   f"worker {stalled.worker}', in pid {stalled.pid})")
        else:
            who = f"DataLoader worker {stalled.worker} (pid {stalled.pid})"
        self._close_after_error()
        rank, epoch, batch = self.schedule.placement[0], self.schedule.epoch, self._position()
        return WorkerTimeoutError(
            f"{who} stalled: batch {batch} of epoch {epoch} on rank {rank} did not arrive "
            f"within timeout={stalled.timeout} s. See what it is doing (e.g. py-spy dump "
            f"--pid {stalled.pid}), or raise timeout",
            worker=stalled.worker, pid=stalled.pid, timeout=stalled.timeout, epoch=epoch,
            batch=batch, rank=rank)


class _WorkerStart:
    """``worker_init_fn`` wrapper: publishes ``WorkerInfo`` and calls the user's function."""

    def __init__(self, user_fn: Callable[[int], None] | None, num_workers: int, rank: int,
                 world_size: int, epoch: int, seed: int) -> None:
        self.user_fn = user_fn
        self.num_workers, self.rank, self.world_size = num_workers, rank, world_size
        self.epoch, self.seed = epoch, seed

    def __call__(self, worker_id: int) -> None:
        torch_info = get_worker_info()
        thread = thread_worker() if torch_info is None else None
        found = torch_info or thread
        fetcher = found.dataset if found else None
        dataset = getattr(fetcher, "dataset", None)
        info = WorkerInfo(worker_id, num_workers=self.num_workers, rank=self.rank,
                          world_size=self.world_size, epoch=self.epoch, seed=self.seed,
                          dataset=dataset, backend="process" if thread is None else "thread")
        set_worker(info)
        if torch_info is not None and _shows_user_dataset(fetcher):
            _publish_user_dataset(torch_info, dataset)
        if self.user_fn is None:
            return
        try:
            self.user_fn(info)
        except Exception as exc:
            pid = os.getpid()
            error = user_error(
                WorkerInitError, exc, f"{type(exc).__name__} in worker_init_fn of worker "
                f"{worker_id} (pid {pid}) on rank {self.rank}, starting epoch {self.epoch}: "
                f"{exc}", {"worker": worker_id, "pid": pid, "rank": self.rank,
                           "epoch": self.epoch, "cause_type": type(exc).__name__})
            if not isinstance(fetcher, BatchFetcher):
                raise error from exc
            error.__cause__ = exc
            fetcher.init_failure = Failed(error)  # every batch of this worker reports it


def _shared_under_threads(worker_init_fn: Callable[[int], None] | None,
                          process_wide: str | None) -> str | None:
    """Why threads would not keep what each worker process has of its own (``None``: they
    would): state a ``worker_init_fn`` sets on the dataset (one object for every thread), or
    ``process_wide``, what the workers set up in state the whole process shares."""
    if worker_init_fn is not None:
        return ("worker_init_fn may set per-worker state on the dataset, which threads share "
                "(one object for all)")
    return process_wide


def _shows_user_dataset(fetcher: Any) -> bool:
    """Whether ``get_worker_info().dataset`` shows the worker's copy of the user's dataset (a
    map-style one, a source, a plain ``IterableDataset``). A plain one is read whole in every
    worker and strided, so a ``worker_init_fn`` that splits it per worker there (torch's
    second example) is refused by the slots' first batches (``_check_head``)."""
    return isinstance(fetcher, SlotFetcher | BatchFetcher)


def _publish_user_dataset(torch_info: Any, dataset: Any) -> None:
    """Make ``torch.utils.data.get_worker_info().dataset`` the worker's copy of the user's
    dataset (torch's own ``WorkerInfo``, only the dataset changed), not the fetcher that wraps
    it: ``worker_init_fn`` and ``__getitem__`` then configure and read the object that serves
    the samples, as with ``DataLoader``. Relies on torch's worker module global."""
    published: Any
    if dataclasses.is_dataclass(torch_info) and not isinstance(torch_info, type):
        published = dataclasses.replace(torch_info, dataset=dataset)
    else:
        published = type(torch_info)(id=torch_info.id, num_workers=torch_info.num_workers,
                                     seed=torch_info.seed, dataset=dataset)
    torch_worker._worker_info = published
