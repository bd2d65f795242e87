"""``ResumableLoader``: a drop-in ``DataLoader`` whose batch order is a function, and whose
state is a cursor.

The order of an epoch is a pure function of ``(seed, epoch, world_size, rank)``; the cursor is
``(epoch, batches delivered)``, counted when a batch reaches the caller. Workers are torch's own
(``DataLoader`` machinery), fed with planned batch requests.
"""

from __future__ import annotations

import os
import warnings
import weakref
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler, get_worker_info

from lightning_loaders._fetch import BatchFetcher, BatchRequest
from lightning_loaders._hashing import mix64
from lightning_loaders._lightning import batches_held, find_prefetcher
from lightning_loaders.context import WorkerInfo, _set_worker
from lightning_loaders.order import SampleOrder, SequentialOrder, ShuffledOrder
from lightning_loaders.plan import LastBatch
from lightning_loaders.samplers import order_from_sampler
from lightning_loaders.schedule import MapSchedule, resolve_last_batch

__all__ = ["ResumableLoader"]


class ResumableLoader:
    """A deterministic, distributed, exactly resumable ``torch.utils.data.DataLoader``.

    Takes ``DataLoader``'s keyword arguments, plus:

    Args:
        seed: keys every shuffle; defaults to ``generator.initial_seed()`` when a generator is
            given, else ``$PL_GLOBAL_SEED`` (set by ``seed_everything``), else 0.
        last_batch: ``"keep"`` (default), ``"drop"`` (what ``drop_last=True`` means), ``"pad"``
            (wrap around to fill the last global batch) or ``"rollover"`` (leftovers open the
            next epoch).
        rank, world_size: explicit placement; by default resolved at the first ``next()`` from
            the process group or the ``RANK``/``WORLD_SIZE`` environment.

    Unlike ``DataLoader``, workers are persistent between epochs unless
    ``persistent_workers=False``, and ``in_order`` is always honoured as ``True``.
    """

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | SampleOrder | None = None,
        batch_sampler: BatchSampler | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool | None = None,
        pin_memory_device: str = "",
        in_order: bool = True,
        seed: int | None = None,
        last_batch: LastBatch | None = None,
        rank: int | None = None,
        world_size: int | None = None,
    ) -> None:
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise TypeError("ResumableLoader needs a map-style dataset (with __len__ and "
                            "__getitem__)")
        if batch_sampler is not None:
            if batch_size != 1 or shuffle or sampler is not None or drop_last:
                raise ValueError("batch_sampler is mutually exclusive with batch_size, shuffle, "
                                 "sampler and drop_last (as in DataLoader)")
            if not isinstance(batch_sampler, BatchSampler):
                raise TypeError(f"cannot convert a {type(batch_sampler).__name__} batch sampler; "
                                "pass a torch BatchSampler or a sampler and batch_size")
            sampler = batch_sampler.sampler  # type: ignore[assignment]
            batch_size = batch_sampler.batch_size
            drop_last = batch_sampler.drop_last
        if batch_size is None or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r} (unbatched "
                             "loading is not supported: use batch_size=1)")
        if sampler is not None and shuffle:
            raise ValueError("shuffle=True cannot be combined with a sampler: the sampler "
                             "decides the order (drop shuffle, or drop the sampler)")
        if num_workers < 0:
            raise ValueError(f"num_workers must be >= 0, got {num_workers}")
        if timeout < 0:
            raise ValueError(f"timeout must be >= 0, got {timeout}")
        if prefetch_factor is not None and num_workers == 0:
            raise ValueError("prefetch_factor needs num_workers > 0 (as in DataLoader)")
        self.last_batch: LastBatch = resolve_last_batch(last_batch, drop_last)
        if not in_order:
            warnings.warn("in_order=False is ignored: exact resume needs batches in plan order",
                          stacklevel=2)
        self.dataset = dataset
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.collate_fn = collate_fn
        self.pin_memory = pin_memory
        self.drop_last = self.last_batch == "drop"
        self.timeout = timeout
        self.worker_init_fn = worker_init_fn
        self.multiprocessing_context = multiprocessing_context
        self.generator = generator
        self.prefetch_factor = prefetch_factor
        self.persistent_workers = num_workers > 0 and persistent_workers is not False
        self.pin_memory_device = pin_memory_device
        self.seed = _resolve_seed(seed, generator)
        if len(dataset) < 1:
            raise ValueError("the dataset is empty")
        order = self._make_order(sampler, bool(shuffle), len(dataset))
        self.schedule = MapSchedule(order, batch_size, self.last_batch, self.seed, rank,
                                    world_size)
        self.sampler = _EpochSampler(self.schedule)
        self._iter_token = 0
        self._prefetcher: weakref.ref[Any] | None = None
        self._torch_loader: DataLoader[Any] | None = None

    # -- the DataLoader surface -------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        """A new iterator. Cheap: the epoch and the workers start at its first ``next()``."""
        self._iter_token += 1
        self._prefetcher = find_prefetcher()
        return _LoaderIterator(self, self._iter_token)

    def __len__(self) -> int:
        """Batches per epoch on this rank (equal on every rank)."""
        return len(self.schedule)

    def __repr__(self) -> str:
        schedule = self.schedule
        rank, world_size = schedule.placement
        epoch = "not started" if schedule.epoch is None else schedule.epoch
        return (f"{type(self).__name__}(dataset={type(self.dataset).__name__}(len="
                f"{schedule.dataset_len}), batch_size={self.batch_size}, order="
                f"{schedule.order.fingerprint}, last_batch={self.last_batch!r}, num_workers="
                f"{self.num_workers}, rank={rank}/{world_size}, seed={self.seed}, epoch={epoch}, "
                f"batches={schedule.batches})")

    @property
    def epoch(self) -> int | None:
        """The epoch being delivered (``None`` before the first batch)."""
        return self.schedule.epoch

    def set_epoch(self, epoch: int) -> None:
        """Ask for ``epoch`` at the next epoch start; a restored cursor wins over an earlier
        or equal epoch, a later one abandons the cursor's unfinished epoch."""
        self.schedule.set_epoch(epoch)

    def state_dict(self) -> dict[str, Any]:
        """The cursor as a small plain dict (O(1) in dataset length and worker count)."""
        return self.schedule.state_dict(held=batches_held(self._prefetcher))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a cursor; the next ``iter()`` continues exactly after its last batch."""
        self.schedule.load_state_dict(state_dict)

    def close(self) -> None:
        """Shut the worker processes down now (they also stop when the loader is collected)."""
        loader, self._torch_loader = self._torch_loader, None
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()

    def _begin_epoch(self) -> Iterator[Any]:
        """Decide which epoch and batch come next, then start delivering from there."""
        self.schedule.begin_epoch()
        return iter(self._workers())

    def _workers(self) -> DataLoader[Any]:
        """torch's DataLoader over our batch requests (created once, workers persistent)."""
        if self._torch_loader is None:
            rank, world_size = self.schedule.placement
            extra: dict[str, Any] = {}
            if self.num_workers > 0:
                extra = {"prefetch_factor": self.prefetch_factor,
                         "persistent_workers": self.persistent_workers}
            if self.pin_memory_device:
                extra["pin_memory_device"] = self.pin_memory_device
            self._torch_loader = DataLoader(
                BatchFetcher(self.dataset, self.collate_fn, self.seed),
                batch_size=None,
                sampler=_RequestSampler(self.schedule),
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

    # -- configuration ----------------------------------------------------------------------

    def _make_order(self, sampler: Any, shuffle: bool, dataset_len: int) -> SampleOrder:
        if sampler is not None:
            return order_from_sampler(sampler, dataset_len, self.seed)
        if shuffle:
            return ShuffledOrder(dataset_len, self.seed)
        return SequentialOrder(dataset_len)


class _LoaderIterator:
    """Counts a batch when it is handed to the caller, never when it is prefetched."""

    def __init__(self, loader: ResumableLoader, token: int) -> None:
        self._loader = loader
        self._token = token
        self._batches: Iterator[Any] | None = None

    def __iter__(self) -> _LoaderIterator:
        return self

    def __next__(self) -> Any:
        loader = self._loader
        if loader._iter_token != self._token:
            raise RuntimeError("this iterator was replaced by a newer iter() on its loader")
        if self._batches is None:
            self._batches = loader._begin_epoch()
        batch = next(self._batches)
        loader.schedule.delivered()
        return batch


class _EpochSampler:
    """What Lightning sees as ``loader.sampler``: forwards ``set_epoch`` to the schedule.

    Like ``_RequestSampler`` it holds the schedule, never the loader, so there is no reference
    cycle: a dropped loader (and its workers) goes at once, not at a later garbage collection
    that a forked worker could run on its copy.
    """

    def __init__(self, schedule: MapSchedule) -> None:
        self._schedule = schedule

    def set_epoch(self, epoch: int) -> None:
        self._schedule.set_epoch(epoch)

    def __len__(self) -> int:
        """Samples this rank reads per epoch."""
        return self._schedule.samples_per_epoch()


class _RequestSampler(Sampler[BatchRequest]):
    """The internal DataLoader's sampler: re-reads the cursor at every ``iter()``."""

    def __init__(self, schedule: MapSchedule) -> None:
        self._schedule = schedule

    def __iter__(self) -> Iterator[BatchRequest]:
        return self._schedule.requests()

    def __len__(self) -> int:
        return self._schedule.remaining


class _WorkerStart:
    """``worker_init_fn`` wrapper: publishes ``WorkerInfo`` and calls the user's function."""

    def __init__(self, user_fn: Callable[[int], None] | None, num_workers: int, rank: int,
                 world_size: int, epoch: int, seed: int) -> None:
        self.user_fn = user_fn
        self.num_workers, self.rank, self.world_size = num_workers, rank, world_size
        self.epoch, self.seed = epoch, seed

    def __call__(self, worker_id: int) -> None:
        torch_info = get_worker_info()
        dataset = getattr(torch_info.dataset, "dataset", None) if torch_info else None
        info = WorkerInfo(worker_id, num_workers=self.num_workers, rank=self.rank,
                          world_size=self.world_size, epoch=self.epoch, seed=self.seed,
                          dataset=dataset)
        _set_worker(info)
        if self.user_fn is not None:
            self.user_fn(info)


def _passthrough(batch: Any) -> Any:
    return batch


def _resolve_seed(seed: int | None, generator: torch.Generator | None) -> int:
    if seed is not None:
        return int(seed)
    if generator is not None:
        return int(generator.initial_seed())
    return int(os.environ.get("PL_GLOBAL_SEED", 0))
