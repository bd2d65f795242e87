"""``ResumableLoader``: a drop-in ``DataLoader`` whose batch order is a function, and whose
state is a cursor.

The order of an epoch is a pure function of ``(seed, epoch, world_size, rank)``; the cursor is
``(epoch, batches delivered)``, counted when a batch reaches the caller. Workers are torch's own
(``DataLoader`` machinery), fed with planned batch requests; without workers, and for in-memory
data that workers could only slow down, the same requests are fetched in the main process.

Because the cursor only moves on delivery, every fault is handled by restarting from it: a
worker that dies is replaced and the batch it owed is requested again; an error in user code
leaves the cursor on the failing batch; ``close()`` at any point loses nothing.
"""

from __future__ import annotations

import logging
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from lightning_loaders.engines.faults import Failed, OnError, Skipped, SkippedSample
from lightning_loaders.engines.fetch import BatchFetcher
from lightning_loaders.engines.workers import WorkerLost, WorkerStalled, shutdown
from lightning_loaders.errors import StateMismatchError
from lightning_loaders.loaders.base import SizedEpochSampler, WorkerLoader, check_current
from lightning_loaders.loaders.prefetch import batches_held
from lightning_loaders.orders.base import SampleOrder, SequentialOrder, ShuffledOrder
from lightning_loaders.orders.from_torch import order_from_sampler
from lightning_loaders.schedule.map_plan import LastBatch
from lightning_loaders.schedule.map_schedule import MapSchedule, resolve_last_batch
from lightning_loaders.schedule.requests import BatchRequest

__all__ = ["ResumableLoader"]

_log = logging.getLogger(__name__)
_SKIPPED = "skipped"  # state["extra"] key: samples skipped under on_error="skip" so far
_NOTHING = object()  # a batch whose samples were all skipped: nothing to deliver


class ResumableLoader(WorkerLoader):
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
        on_error: ``"raise"`` (default): an exception in ``__getitem__``, a transform or
            ``collate_fn`` is re-raised in the main process as ``SampleFetchError`` naming the
            sample (dataset index and epoch position), batch, epoch, worker and rank, chained to
            the original exception (with the worker's traceback). ``"skip"``: a sample whose
            fetch raises is left out of its batch (which is then shorter; a batch with no sample
            left is not delivered) and recorded in ``skipped``. Skipping is deterministic when
            the same samples always fail, and a resume skips them again; ``collate_fn`` errors
            are always raised.
        max_worker_restarts: a worker process that dies (killed by a signal, e.g. the
            out-of-memory killer) is replaced, with all workers restarted from the cursor, so
            the stream goes on exactly as without the crash; at most this many times per epoch
            (default 3), then ``WorkerCrashedError``. ``0`` raises at the first crash.
        evaluation: for validation/test/predict: with ``last_batch="keep"`` and
            ``batch_size=1``, leftover samples (fewer than ranks) join the last batch of the
            first ranks instead of failing, so every sample is read once and every rank has the
            same number of batches.
        shuffle_buffer, sync_interval: for iterable datasets (``ResumableIterableLoader``,
            which an iterable dataset gets); a map-style dataset refuses them.

    ``timeout`` raises ``WorkerTimeoutError`` naming the worker whose batch is late. Workers
    stop on ``close()`` (also used as ``with loader:``), when the loader is collected, and when
    a Lightning ``Trainer`` tears its loop down (end of ``fit``, an exception, Ctrl-C,
    SIGTERM).

    Unlike ``DataLoader``, workers are persistent between epochs unless
    ``persistent_workers=False``, and ``in_order`` is always honoured as ``True``. In-memory
    data (tensors, numeric arrays, ``TensorDataset`` and the like, with the default collate) is
    gathered a whole batch at a time in the main process whatever ``num_workers`` is, unless a
    ``worker_init_fn`` or ``pin_memory`` asks for workers: no user code runs per sample, and a
    batch sent from a worker process would cost more than gathering it.
    """

    def __new__(cls, dataset: Any = None, *args: Any, **kwargs: Any) -> Any:
        """An iterable dataset gets a ``ResumableIterableLoader`` (same arguments, plus
        ``shuffle_buffer`` and ``sync_interval``): sharded, equal-length, exactly resumable."""
        if cls is ResumableLoader and isinstance(dataset, IterableDataset):
            from lightning_loaders.loaders.iterable import ResumableIterableLoader

            return ResumableIterableLoader(dataset, *args, **kwargs)
        return super().__new__(cls)

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
        on_error: OnError = "raise",
        max_worker_restarts: int = 3,
        evaluation: bool = False,
        shuffle_buffer: int = 0,
        sync_interval: int = 8,
    ) -> None:
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise TypeError("ResumableLoader needs a map-style dataset (with __len__ and "
                            "__getitem__)")
        if shuffle_buffer != 0 or sync_interval != 8:
            raise ValueError("shuffle_buffer and sync_interval are for iterable datasets; a "
                             "map-style dataset is shuffled over the whole epoch with "
                             "shuffle=True, and its ranks always have equal batch counts")
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
        self.last_batch: LastBatch = resolve_last_batch(last_batch, drop_last)
        self._take_options(
            dataset, batch_size=batch_size, num_workers=num_workers, collate_fn=collate_fn,
            pin_memory=pin_memory, drop_last=self.last_batch == "drop", timeout=timeout,
            worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
            generator=generator, prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers, pin_memory_device=pin_memory_device,
            in_order=in_order, seed=seed, on_error=on_error,
            max_worker_restarts=max_worker_restarts)
        if sampler is not None and shuffle:
            raise ValueError("shuffle=True cannot be combined with a sampler: the sampler "
                             "decides the order (drop shuffle, or drop the sampler)")
        if len(dataset) < 1:
            raise ValueError(f"the dataset ({type(dataset).__name__}) is empty: len() is 0; a "
                             "loader needs at least one sample (check its path or filter)")
        order = self._make_order(sampler, bool(shuffle), len(dataset))
        self.schedule = MapSchedule(order, self.batch_size, self.last_batch, self.seed, rank,
                                    world_size, merge_short_tail=evaluation)
        _check_plan(self.schedule)
        self.sampler = SizedEpochSampler(self.schedule)
        self.batch_sampler: Any = None  # DataLoader's surface: Lightning's evaluation reads it
        self._batch_fetcher: BatchFetcher | None = None
        self._active: Iterator[Any] | None = None  # the iterator delivering now
        self.skipped: list[SkippedSample] = []
        """Samples skipped under ``on_error="skip"`` in this process, in delivery order."""
        self._num_skipped = 0
        self._recent_skips: deque[int] = deque(maxlen=8)  # per delivered batch, newest last

    # -- the DataLoader surface -------------------------------------------------------------

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
    def skipped_indices(self) -> list[int]:
        """Dataset indices of ``skipped`` (this process's history, not saved in the state)."""
        return [sample.index for sample in self.skipped]

    @property
    def num_skipped(self) -> int:
        """Samples skipped so far in the run, including before a resume (saved in the state)."""
        return self._num_skipped

    def state_dict(self) -> dict[str, Any]:
        """The cursor as a small plain dict (O(1) in dataset length and worker count)."""
        held = batches_held(self._prefetcher)
        state = self.schedule.state_dict(held=held)
        if self.on_error == "skip" or self._num_skipped:
            recent = list(self._recent_skips)
            in_held = sum(recent[max(0, len(recent) - held):]) if held else 0
            state["extra"] = {**state.get("extra", {}), _SKIPPED: self._num_skipped - in_held}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a cursor; the next ``iter()`` continues exactly after its last batch.

        A state from another dataset length, seed, batch size, last-batch policy or order, of
        an unknown version, or corrupted, is refused with a ``ValueError`` naming each field
        and both values. ``num_workers``, ``prefetch_factor`` and ``pin_memory`` may differ,
        and so may the world size (except under ``last_batch="rollover"``).
        """
        skipped = _saved_skip_count(state_dict)
        self.schedule.load_state_dict(state_dict)
        self._num_skipped = skipped
        self._recent_skips.clear()

    def close(self) -> None:
        """Shut the worker processes down now (they also stop when the loader is collected).

        Nothing is lost: an iterator used after ``close()`` starts new workers and continues
        from the cursor.
        """
        active, self._active = self._active, None
        shutdown(active)
        super().close()

    def _new_iterator(self, token: int) -> _LoaderIterator:
        return _LoaderIterator(self, token)

    def _position(self) -> int:
        return self.schedule.batches

    def _begin_epoch(self) -> None:
        """Decide which epoch and batch come next."""
        self.schedule.begin_epoch()
        self._epoch_restarts = 0

    def _open(self) -> Iterator[Any]:
        """An iterator over the rest of the epoch from the cursor: fetched in this process when
        worker processes could only add cost, else by torch's workers (started on first use)."""
        fetcher = self._fetcher()
        if self._fetches_in_process(fetcher):
            requests = self.schedule.requests()
            self._active = (fetcher.gathered(requests) if fetcher.in_memory
                            else map(fetcher.__getitem__, requests))
        else:
            self._active = iter(self._workers())
        return self._active

    @property
    def gathers_in_memory(self) -> bool:
        """Whether batches are gathered from in-memory data (tensors, numeric arrays, ...) by
        vectorised indexing in this process, whatever ``num_workers`` is."""
        fetcher = self._fetcher()
        return fetcher.in_memory and self._fetches_in_process(fetcher)

    def _fetches_in_process(self, fetcher: BatchFetcher) -> bool:
        """Without workers, or for in-memory data with no ``worker_init_fn``: a batch is then
        one vectorised gather, far cheaper than sending it from a worker process. Pinned
        batches go through torch's machinery, which pins them in a thread."""
        if self.pin_memory:
            return False
        return self.num_workers == 0 or (fetcher.in_memory and self.worker_init_fn is None)

    def _fetcher(self) -> BatchFetcher:
        """The batch fetcher (made once: it probes the dataset for the fastest fetch path)."""
        if self._batch_fetcher is None:
            self._batch_fetcher = BatchFetcher(self.dataset, self.collate_fn, self.seed,
                                               self.on_error)
        return self._batch_fetcher

    def _receive(self, item: Any) -> Any:
        """Unwrap what a fetch returned: raise a worker's error, record skipped samples."""
        kind = type(item)
        if kind is Failed:
            self.close()  # the cursor stays on the failed batch: a retry requests it again
            item.reraise()
        if kind is not Skipped:
            self._recent_skips.append(0)
            return item
        rank = self.schedule.placement[0]
        for sample in item.skipped:
            _log.warning("skipped sample index %d (epoch %d position %d, batch %d) on rank %d: "
                         "%s", sample.index, sample.epoch, sample.position, sample.batch, rank,
                         sample.error)
        self.skipped.extend(item.skipped)
        self._num_skipped += len(item.skipped)
        if item.empty:
            return _NOTHING
        self._recent_skips.append(len(item.skipped))
        return item.batch

    def _workers(self) -> DataLoader[Any]:
        """torch's DataLoader over our batch requests (created once, workers persistent)."""
        return self._worker_pool(self._fetcher(), _RequestSampler(self.schedule),
                                 self.prefetch_factor)

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
        self._started = False
        self._batches: Iterator[Any] | None = None
        self._generation = -1
        self._order_version = 0  # a re-weighted order re-plans the prefetched batches

    def __iter__(self) -> _LoaderIterator:
        return self

    def __next__(self) -> Any:
        loader = self._loader
        check_current(loader, self._token)
        if not self._started:
            loader._begin_epoch()
            self._started = True
        while True:
            batch = loader._receive(self._next_item())
            loader.schedule.delivered()
            if batch is not _NOTHING:
                return batch

    def _next_item(self) -> Any:
        """The next fetched item, from workers (re)opened at the cursor whenever needed."""
        loader = self._loader
        while True:
            try:
                if (self._batches is None or self._generation != loader._generation
                        or self._order_version != loader.schedule.order_version):
                    if loader.schedule.remaining == 0:
                        raise StopIteration
                    self._generation = loader._generation
                    self._order_version = loader.schedule.order_version
                    self._batches = loader._open()
                return next(self._batches)
            except StopIteration:
                raise
            except WorkerLost as lost:
                self._batches = None
                loader._recover(lost)
            except WorkerStalled as stalled:
                self._batches = None
                raise loader._stall_error(stalled) from None
            except BaseException:
                self._batches = None
                loader.close()
                raise


class _RequestSampler(Sampler[BatchRequest]):
    """The internal DataLoader's sampler: re-reads the cursor at every ``iter()``."""

    def __init__(self, schedule: MapSchedule) -> None:
        self._schedule = schedule

    def __iter__(self) -> Iterator[BatchRequest]:
        return self._schedule.requests()

    def __len__(self) -> int:
        return self._schedule.remaining


def _check_plan(schedule: MapSchedule) -> None:
    """Refuse, at construction, a plan that cannot give every rank a batch in every epoch
    (for the placement known now; one resolved later is checked at the first batch)."""
    _, world_size = schedule.placement
    if schedule.last_batch != "rollover":
        schedule.plan_for(0, world_size)
        return
    global_batch = schedule.batch_size * world_size
    if schedule.dataset_len < global_batch:
        raise ValueError(
            f"last_batch='rollover' needs at least one global batch per epoch: "
            f"{schedule.dataset_len} samples are fewer than {world_size} ranks x batch_size "
            f"{schedule.batch_size}; use batch_size <= {schedule.dataset_len // world_size} or "
            "another last_batch policy")


def _saved_skip_count(state_dict: Any) -> int:
    """The skip count saved in a state (0 when absent); a corrupted one is refused."""
    extra = state_dict.get("extra") if isinstance(state_dict, Mapping) else None
    if not isinstance(extra, Mapping):
        return 0
    count = extra.get(_SKIPPED, 0)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise StateMismatchError(
            f"corrupted loader state: extra.{_SKIPPED}={count!r} is not an int >= 0")
    return count

