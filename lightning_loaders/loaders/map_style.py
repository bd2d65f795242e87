"""``MapStyleLoader``: ``ResumableLoader`` over a map-style dataset, a drop-in ``DataLoader``
whose batch order is a function, and whose state is a cursor.

The order of an epoch is a pure function of ``(seed, epoch, world_size, rank)``; the cursor is
``(epoch, batches delivered)``, counted when a batch reaches the caller. Workers are torch's own
(``DataLoader`` machinery), fed with planned batch requests; without workers, and for in-memory
data that workers could only slow down, the same requests are fetched in the main process.

Because the cursor only moves on delivery, every fault is handled by restarting from it: a
worker that dies is replaced and the batch it owed is requested again; an error in user code
leaves the cursor on the failing batch; ``close()`` at any point loses nothing.
"""

from __future__ import annotations

import copy
import logging
from collections import deque
from collections.abc import Iterator, Mapping
from dataclasses import replace
from typing import Any

from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler

from lightning_loaders.engines.faults import Failed, Skipped, SkippedSample
from lightning_loaders.engines.fetch import BatchFetcher
from lightning_loaders.engines.workers import WorkerLost, WorkerStalled, shutdown
from lightning_loaders.errors import StateMismatchError
from lightning_loaders.loaders.delivery import SizedEpochSampler
from lightning_loaders.loaders.resumable import LoaderOptions, ResumableLoader
from lightning_loaders.orders.base import SampleOrder, SequentialOrder, ShuffledOrder
from lightning_loaders.orders.from_torch import order_from_sampler
from lightning_loaders.schedule.map_plan import LastBatch
from lightning_loaders.schedule.map_schedule import MapSchedule, resolve_last_batch
from lightning_loaders.schedule.requests import BatchRequest
from lightning_loaders.state import Stateful

__all__ = ["MapStyleLoader"]

_log = logging.getLogger(__name__)
_SKIPPED = "skipped"  # the part: samples skipped under on_error="skip" so far
_DATASET = "dataset"  # the part: the dataset's own state_dict(), when it has one
_NOTHING = object()  # a batch whose samples were all skipped: nothing to deliver


class MapStyleLoader(ResumableLoader):
    """A ``ResumableLoader`` over a map-style dataset: the global batch plan over the dataset's
    indices (``MapSchedule``), fetched by ``BatchFetcher`` in this process or in torch's
    workers. ``ResumableLoader(map_style_dataset, ...)`` returns one."""

    schedule: MapSchedule

    def _configure(self, dataset: Any, options: LoaderOptions) -> None:
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise TypeError(f"{type(self).__name__} needs a map-style dataset (with __len__ and "
                            "__getitem__); ResumableLoader picks the loader for an iterable one")
        if options.shuffle_buffer != 0 or options.sync_interval != 8 or options.partitions:
            raise ValueError("shuffle_buffer, sync_interval and partitions are for iterable "
                             "datasets; a map-style dataset is shuffled over the whole epoch "
                             "with shuffle=True, its ranks always have equal batch counts, and "
                             "it resumes under any layout")
        batch_sampler = options.batch_sampler
        if batch_sampler is not None:
            o = options
            if o.batch_size != 1 or o.shuffle or o.sampler is not None or o.drop_last:
                raise ValueError("batch_sampler is mutually exclusive with batch_size, shuffle, "
                                 "sampler and drop_last (as in DataLoader)")
            if not isinstance(batch_sampler, BatchSampler):
                raise TypeError(f"cannot convert a {type(batch_sampler).__name__} batch sampler; "
                                "pass a torch BatchSampler or a sampler and batch_size")
            options = replace(options, sampler=batch_sampler.sampler, batch_sampler=None,
                              batch_size=batch_sampler.batch_size,
                              drop_last=batch_sampler.drop_last)
        self.last_batch: LastBatch = resolve_last_batch(options.last_batch, options.drop_last)
        self._take_options(dataset, options, drop_last=self.last_batch == "drop")
        sampler = options.sampler
        if sampler is not None and options.shuffle:
            raise ValueError("shuffle=True cannot be combined with a sampler: the sampler "
                             "decides the order (drop shuffle, or drop the sampler)")
        if len(dataset) < 1:
            raise ValueError(f"the dataset ({type(dataset).__name__}) is empty: len() is 0; a "
                             "loader needs at least one sample (check its path or filter)")
        order = self._make_order(sampler, bool(options.shuffle), len(dataset))
        self.schedule = MapSchedule(order, self.batch_size, self.last_batch, self.seed,
                                    options.rank, options.world_size,
                                    merge_short_tail=options.evaluation)
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

    def _describe(self) -> list[str]:
        schedule = self.schedule
        return [f"dataset={type(self.dataset).__name__}(len={schedule.dataset_len})",
                f"batch_size={self.batch_size}", f"order={schedule.order.fingerprint}",
                f"last_batch={self.last_batch!r}", f"num_workers={self.num_workers}"]

    @property
    def skipped_indices(self) -> list[int]:
        """Dataset indices of ``skipped`` (this process's history, not saved in the state)."""
        return [sample.index for sample in self.skipped]

    @property
    def num_skipped(self) -> int:
        """Samples skipped so far in the run, including before a resume (saved in the state)."""
        return self._num_skipped

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a cursor; the next ``iter()`` continues exactly after its last batch.

        A state from another dataset length, seed, batch size, last-batch policy or order, of
        an unknown version, or corrupted, is refused with a ``StateMismatchError`` naming each
        field and both values. ``num_workers``, ``prefetch_factor`` and ``pin_memory`` may
        differ, and so may the world size (except under ``last_batch="rollover"``).

        A dataset with ``state_dict()``/``load_state_dict()`` (torchdata's ``Stateful``) gets
        the state its main-process object had when the state was saved (rank 0's, under DDP);
        running workers are shut down so that the next ones start from it. What a dataset
        changes inside worker processes is never seen by the main process, so never saved.
        """
        super().load_state_dict(state_dict)

    def _parts(self, held: int) -> dict[str, Any]:
        """The skip count (when skipping) and the dataset's own state (when it has one)."""
        parts: dict[str, Any] = {}
        if self.on_error == "skip" or self._num_skipped:
            recent = list(self._recent_skips)
            in_held = sum(recent[max(0, len(recent) - held):]) if held else 0
            parts[_SKIPPED] = self._num_skipped - in_held
        if isinstance(self.dataset, Stateful):
            parts[_DATASET] = copy.deepcopy(self.dataset.state_dict())
        return parts

    def _check_parts(self, parts: Mapping[str, Any]) -> None:
        _saved_skip_count(parts)

    def _load_parts(self, parts: Mapping[str, Any]) -> None:
        self._num_skipped = _saved_skip_count(parts)
        self._recent_skips.clear()
        if _DATASET in parts and isinstance(self.dataset, Stateful):
            self.dataset.load_state_dict(copy.deepcopy(parts[_DATASET]))
            self.close()

    def close(self) -> None:
        """Shut the worker processes down now (they also stop when the loader is collected).

        Nothing is lost: an iterator used after ``close()`` starts new workers and continues
        from the cursor.
        """
        active, self._active = self._active, None
        shutdown(active)
        super().close()

    def _position(self) -> int:
        return self.schedule.batches

    def _open_epoch(self) -> Iterator[Any]:
        self.schedule.begin_epoch()
        self._epoch_restarts = 0
        return self._deliver()

    def _reopen(self) -> Iterator[Any]:
        return self._deliver()

    def _deliver(self) -> Iterator[Any]:
        """The rest of the current epoch from the cursor, each batch counted as it is handed
        over. The engine is reopened at the cursor after a worker crash, and when the order
        changed mid-epoch (a re-weighted sampler), which re-plans the prefetched batches."""
        schedule = self.schedule
        while schedule.remaining > 0:
            version = schedule.order_version
            try:
                for item in self._open():
                    batch = self._receive(item)
                    schedule.delivered()
                    if batch is not _NOTHING:
                        yield batch
                    if schedule.order_version != version:
                        break
                else:
                    return
            except WorkerLost as lost:
                self._recover(lost)
            except WorkerStalled as stalled:
                raise self._stall_error(stalled) from None

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


def _saved_skip_count(parts: Mapping[str, Any]) -> int:
    """The skip count saved in a state's parts (0 when absent); a corrupted one is refused."""
    count = parts.get(_SKIPPED, 0)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise StateMismatchError(
            f"corrupted loader state: parts[{_SKIPPED!r}]={count!r} is not an int >= 0")
    return count

