"""What the loaders built on torch's worker machinery share.

``ResumableLoader`` (map-style) and ``ResumableIterableLoader`` differ in their plan and in how
they deliver; they share ``DataLoader``'s attributes and worker options, the iterator rule (a
newer ``iter()`` replaces older iterators), the epoch surface Lightning calls, shutdown on
``close()``, ``with`` and Lightning's loop teardown, and the pool of torch workers with its
crash and stall errors. ``DeliveringIterator`` is the iterator of the DALI and FFCV adapters.
"""

from __future__ import annotations

import logging
import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any, Self

import torch
from torch.utils.data import DataLoader, Dataset, Sampler, get_worker_info

from lightning_loaders.context import WorkerInfo, set_worker
from lightning_loaders.engines.faults import Failed, OnError
from lightning_loaders.engines.fetch import BatchFetcher
from lightning_loaders.engines.workers import WorkerLost, WorkerPool, WorkerStalled, shutdown
from lightning_loaders.errors import (
    WorkerCrashedError,
    WorkerInitError,
    WorkerTimeoutError,
    describe_exit,
)
from lightning_loaders.hashing import mix64
from lightning_loaders.loaders.options import check_loader_arguments, check_picklable, start_method
from lightning_loaders.loaders.prefetch import find_prefetcher
from lightning_loaders.schedule.map_schedule import resolve_seed

__all__ = [
    "DeliveringIterator",
    "EpochSampler",
    "SizedEpochSampler",
    "WorkerLoader",
    "check_current",
]

_log = logging.getLogger(__name__)


class WorkerLoader:
    """Base of the loaders that run torch's worker processes (see the module docstring).

    A subclass calls ``_take_options`` in its constructor, sets ``schedule`` (anything with
    ``epoch``, ``set_epoch`` and ``placement``), and implements ``_new_iterator`` and
    ``_position`` (the batch due next, named in errors).
    """

    schedule: Any

    def _take_options(
        self,
        dataset: Any,
        *,
        batch_size: int | None,
        num_workers: int,
        collate_fn: Callable[[list[Any]], Any] | None,
        pin_memory: bool,
        drop_last: bool,
        timeout: float,
        worker_init_fn: Callable[[int], None] | None,
        multiprocessing_context: Any,
        generator: torch.Generator | None,
        prefetch_factor: int | None,
        persistent_workers: bool | None,
        pin_memory_device: str,
        in_order: bool,
        seed: int | None,
        on_error: OnError,
        max_worker_restarts: int,
    ) -> None:
        """Check and keep ``DataLoader``'s arguments (as its attributes) and the worker
        options; the dataset, collate_fn and worker_init_fn must pickle for workers."""
        check_loader_arguments(
            batch_size=batch_size, num_workers=num_workers, timeout=timeout,
            prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
            collate_fn=collate_fn, worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context, on_error=on_error,
            max_worker_restarts=max_worker_restarts)
        assert batch_size is not None
        if not in_order:
            warnings.warn("in_order=False is ignored: exact resume needs batches in plan order",
                          stacklevel=3)
        if num_workers > 0:
            check_picklable(start_method(multiprocessing_context), dataset=dataset,
                            collate_fn=collate_fn, worker_init_fn=worker_init_fn)
        self.dataset = dataset
        self.batch_size: int = batch_size
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.pin_memory = pin_memory
        self.drop_last = drop_last
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.generator = generator
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = num_workers > 0 and persistent_workers is not False
        self.pin_memory_device = pin_memory_device
        self.seed = resolve_seed(seed, generator)
        self.on_error: OnError = on_error
        self.max_worker_restarts = max_worker_restarts
        self._iter_token = 0
        self._prefetcher: weakref.ref[Any] | None = None
        self._torch_loader: DataLoader[Any] | None = None
        self._generation = 0  # bumped by close(): iterators then go on from the cursor
        self._epoch_restarts = 0
        self.worker_restarts = 0
        """Worker restarts after crashes in this process (all epochs)."""

    # -- the DataLoader surface -------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        """A new iterator. Cheap: the epoch and the workers start at its first ``next()``."""
        self._iter_token += 1
        self._prefetcher = find_prefetcher()
        return self._new_iterator(self._iter_token)

    @property
    def epoch(self) -> int | None:
        """The epoch being delivered (``None`` before the first batch)."""
        return self.schedule.epoch

    def set_epoch(self, epoch: int) -> None:
        """Ask for ``epoch`` at the next epoch start; a restored cursor wins over an earlier
        or equal epoch, a later one abandons the cursor's unfinished epoch."""
        self.schedule.set_epoch(epoch)

    def close(self) -> None:
        """Shut the worker processes down now (they also stop when the loader is collected).

        Nothing is lost: an iterator used after ``close()`` starts new workers and continues
        from the cursor.
        """
        loader, self._torch_loader = self._torch_loader, None
        self._generation += 1
        shutdown(getattr(loader, "_iterator", None))

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def _iterator(self) -> None:
        """Lightning's loop teardown (end of ``fit``, exceptions, Ctrl-C, SIGTERM) stops a
        loader's workers by setting ``loader._iterator = None``: that closes this loader."""
        return None

    @_iterator.setter
    def _iterator(self, value: object) -> None:
        if value is None:
            self.close()

    # -- for subclasses ---------------------------------------------------------------------

    def _new_iterator(self, token: int) -> Iterator[Any]:
        raise NotImplementedError

    def _position(self) -> int:
        """The batch of the current epoch due next on this rank (named in errors)."""
        raise NotImplementedError

    # -- workers ----------------------------------------------------------------------------

    def _worker_pool(self, fetcher: Dataset[Any], sampler: Sampler[Any],
                     prefetch_factor: int | None) -> DataLoader[Any]:
        """torch's DataLoader over ``fetcher`` indexed by ``sampler``'s requests (kept, with
        persistent workers, until ``close()``)."""
        if self._torch_loader is None:
            rank, world_size = self.schedule.placement
            extra: dict[str, Any] = {}
            if self.num_workers > 0:
                extra = {"prefetch_factor": prefetch_factor,
                         "persistent_workers": self.persistent_workers}
            if self.pin_memory_device:
                extra["pin_memory_device"] = self.pin_memory_device
            self._torch_loader = WorkerPool(
                fetcher,
                batch_size=None,
                sampler=sampler,
                num_workers=self.num_workers,
                collate_fn=_passthrough,
                pin_memory=self.pin_memory,
                timeout=self.timeout,
                worker_init_fn=_WorkerStart(self.worker_init_fn, self.num_workers, rank,
                                            world_size, self.schedule.epoch or 0, self.seed),
                multiprocessing_context=self.multiprocessing_context,
                generator=torch.Generator().manual_seed(mix64(self.seed, rank) >> 1),
                **extra,
            )
        return self._torch_loader

    def _recover(self, lost: WorkerLost) -> None:
        """Stop every worker (new ones start from the cursor) and count a restart, or raise
        ``WorkerCrashedError`` past ``max_worker_restarts`` in this epoch."""
        self.close()
        worker, pid, exitcode = lost.workers[0]
        rank, epoch, batch = self.schedule.placement[0], self.schedule.epoch, self._position()
        what = (f"DataLoader worker {worker} (pid {pid}) {describe_exit(exitcode)} with batch "
                f"{batch} of epoch {epoch} due next on rank {rank}")
        if len(lost.workers) > 1:
            what += f" (also dead: {[(w, p) for w, p, _ in lost.workers[1:]]} as (worker, pid))"
        if self._epoch_restarts >= self.max_worker_restarts:
            if self.max_worker_restarts == 0:
                fix = ("worker recovery is off (max_worker_restarts=0): set max_worker_restarts "
                       ">= 1 to restart the workers from the cursor and continue")
            else:
                fix = (f"gave up after {self._epoch_restarts} restarts in this epoch "
                       f"(max_worker_restarts={self.max_worker_restarts}): look at the "
                       "workers' memory use, or at the samples of that batch")
            raise WorkerCrashedError(f"{what}; {fix}", worker=worker, pid=pid,
                                     exitcode=exitcode, epoch=epoch, batch=batch, rank=rank,
                                     restarts=self._epoch_restarts) from None
        self._epoch_restarts += 1
        self.worker_restarts += 1
        _log.warning("%s; restarting %d workers from the cursor (restart %d of at most %d in "
                     "this epoch)", what, self.num_workers, self._epoch_restarts,
                     self.max_worker_restarts)

    def _stall_error(self, stalled: WorkerStalled) -> WorkerTimeoutError:
        """The error for a batch later than ``timeout`` (workers are stopped first)."""
        self.close()
        rank, epoch, batch = self.schedule.placement[0], self.schedule.epoch, self._position()
        return WorkerTimeoutError(
            f"DataLoader worker {stalled.worker} (pid {stalled.pid}) stalled: batch {batch} of "
            f"epoch {epoch} on rank {rank} did not arrive within timeout={stalled.timeout} s. "
            "See what that process is doing (e.g. py-spy dump --pid PID), or raise timeout",
            worker=stalled.worker, pid=stalled.pid, timeout=stalled.timeout, epoch=epoch,
            batch=batch, rank=rank)


class DeliveringIterator:
    """An adapter's iterator: the loader's ``_begin_epoch()`` at the first ``next()`` gives
    the batches, each counted by ``schedule.delivered()`` as it is handed to the caller (never
    when the engine prefetches it); a newer ``iter()`` on the loader replaces it."""

    def __init__(self, loader: Any, token: int) -> None:
        self._loader = loader
        self._token = token
        self._batches: Iterator[Any] | None = None

    def __iter__(self) -> DeliveringIterator:
        return self

    def __next__(self) -> Any:
        loader = self._loader
        check_current(loader, self._token)
        if self._batches is None:
            self._batches = loader._begin_epoch()
        batch = next(self._batches)
        loader.schedule.delivered()
        return batch


def check_current(loader: Any, token: int) -> None:
    """Refuse an iterator that a newer ``iter()`` on its loader replaced (``token`` is the
    iterator's, ``loader._iter_token`` the newest)."""
    if loader._iter_token != token:
        raise RuntimeError("this iterator was replaced by a newer iter() on its loader")


class EpochSampler:
    """What Lightning sees as ``loader.sampler``: forwards ``set_epoch`` to ``target`` (a
    schedule, or a weak proxy of a loader whose schedule is built later).

    It never holds a loader strongly, so there is no reference cycle: a dropped loader (and its
    workers) goes at once, not at a later garbage collection that a forked worker could run on
    its copy.
    """

    def __init__(self, target: Any) -> None:
        self._target = target

    def set_epoch(self, epoch: int) -> None:
        self._target.set_epoch(epoch)


class SizedEpochSampler(EpochSampler):
    """An ``EpochSampler`` whose ``len()`` is the samples this rank reads per epoch."""

    def __len__(self) -> int:
        return int(self._target.samples_per_epoch())


class _WorkerStart:
    """``worker_init_fn`` wrapper: publishes ``WorkerInfo`` and calls the user's function."""

    def __init__(self, user_fn: Callable[[int], None] | None, num_workers: int, rank: int,
                 world_size: int, epoch: int, seed: int) -> None:
        self.user_fn = user_fn
        self.num_workers, self.rank, self.world_size = num_workers, rank, world_size
        self.epoch, self.seed = epoch, seed

    def __call__(self, worker_id: int) -> None:
        torch_info = get_worker_info()
        fetcher = torch_info.dataset if torch_info else None
        info = WorkerInfo(worker_id, num_workers=self.num_workers, rank=self.rank,
                          world_size=self.world_size, epoch=self.epoch, seed=self.seed,
                          dataset=getattr(fetcher, "dataset", None))
        set_worker(info)
        if self.user_fn is None:
            return
        try:
            self.user_fn(info)
        except Exception as exc:
            pid = os.getpid()
            error = WorkerInitError(
                f"{type(exc).__name__} in worker_init_fn of worker {worker_id} (pid {pid}) on "
                f"rank {self.rank}: {exc}", worker=worker_id, pid=pid, rank=self.rank,
                cause_type=type(exc).__name__)
            if not isinstance(fetcher, BatchFetcher):
                raise error from exc
            error.__cause__ = exc
            fetcher.init_failure = Failed(error)  # every batch of this worker reports it


def _passthrough(batch: Any) -> Any:
    return batch
