"""``MapStyleLoader``: ``ResumableLoader`` over a map-style dataset, a drop-in ``DataLoader``
whose batch order is a function, and whose state is a cursor.

The order of an epoch is a pure function of ``(seed, epoch, world_size, rank)``; the cursor is
``(epoch, batches delivered)``, counted when a batch reaches the caller. Workers (processes or
threads, ``engines``) are fed with planned batch requests; without workers, and for in-memory
data that workers could only slow down, the same requests are fetched in the main process.

Because the cursor only moves on delivery, every fault is handled by restarting from it: a
worker that dies is replaced and the batch it owed is requested again; an error in user code
leaves the cursor on the failing batch; ``close()`` at any point loses nothing.
"""

from __future__ import annotations

import copy
import logging
import warnings
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from dataclasses import replace
from typing import Any

from torch.utils.data import (
    IterableDataset,
    RandomSampler,
    Sampler,
    SequentialSampler,
)

from lightning_loaders.collectives import gather_by_rank
from lightning_loaders.engines.faults import Failed, Skipped, SkippedSample
from lightning_loaders.engines.fetch import BatchFetcher, Numbered, Unbatched
from lightning_loaders.engines.pool import InProcess, WorkerLost, WorkerStalled
from lightning_loaders.errors import SampleFetchError, StateMismatchError
from lightning_loaders.loaders.delivery import SequentialEpochSampler, SizedEpochSampler
from lightning_loaders.loaders.options import unbatched_conversion
from lightning_loaders.loaders.out_of_order import (
    WINDOW,
    DeliveredWindow,
    not_delivered,
    rank_entry,
)
from lightning_loaders.loaders.prefetch import batches_after, fit_epoch
from lightning_loaders.loaders.resumable import LoaderOptions, ResumableLoader
from lightning_loaders.orders.base import SampleOrder, SequentialOrder, ShuffledOrder
from lightning_loaders.orders.from_torch import (
    SamplerEpochs,
    bulk_key,
    order_from_sampler,
    placement_from_sampler,
    sampler_contents,
    sampler_seed,
    sampler_signature,
    unbatched_sampler,
)
from lightning_loaders.schedule.audit import AUDIT
from lightning_loaders.schedule.map_plan import LastBatch
from lightning_loaders.schedule.map_schedule import MapSchedule, resolve_last_batch, resolve_seed
from lightning_loaders.schedule.requests import BatchRequest
from lightning_loaders.sources.identity import content_identity
from lightning_loaders.sources.mix import Mix
from lightning_loaders.state import PARTS, LoaderState, is_stateful

__all__ = ["MapStyleLoader"]

_log = logging.getLogger(__name__)
_SKIPPED = "skipped"  # the part: samples skipped under on_error="skip" so far
_DATASET = "dataset"  # the part: the dataset's own state_dict(), when it has one
_NOTHING = object()  # a batch whose samples were all skipped: nothing to deliver
_MIX_RNGS = ("a Mix source reads its samples under global-RNG states of their own (a "
             "ShardedSource that is neither rng_free nor seeks), which threads share")


class MapStyleLoader(ResumableLoader):
    """A ``ResumableLoader`` over a map-style dataset: the global batch plan over the dataset's
    indices (``MapSchedule``), fetched by ``BatchFetcher`` in this process or in torch's
    workers. ``ResumableLoader(map_style_dataset, ...)`` returns one."""

    schedule: MapSchedule

    def _configure(self, dataset: Any, options: LoaderOptions) -> None:
        if isinstance(dataset, IterableDataset) or not hasattr(dataset, "__len__"):
            raise TypeError(f"{type(self).__name__} needs a map-style dataset (with __len__ and "
                            "__getitem__); ResumableLoader picks the loader for an iterable one")
        if (options.shuffle_buffer != 0 or options.sync_interval != 8
                or options.partitions is not None):
            raise ValueError("shuffle_buffer, sync_interval and partitions are for iterable "
                             "datasets; a map-style dataset is shuffled over the whole epoch "
                             "with shuffle=True, its ranks always have equal batch counts, and "
                             "it resumes under any layout")
        batch_sampler = options.batch_sampler
        if options.seed is None:  # the sampler's own seed orders it in torch, as in make_resumable
            options = replace(options, seed=sampler_seed(
                options.sampler if batch_sampler is None else batch_sampler))
        seed = resolve_seed(options.seed, options.generator)
        self._user_samplers = SamplerEpochs(options.sampler, batch_sampler)
        if batch_sampler is not None:
            o = options
            if o.batch_size != 1 or o.shuffle or o.sampler is not None or o.drop_last:
                raise ValueError("batch_sampler is mutually exclusive with batch_size, shuffle, "
                                 "sampler and drop_last (as in DataLoader)")
            if not hasattr(batch_sampler, "__iter__"):
                raise TypeError(f"batch_sampler must be an iterable of lists of indices, got a "
                                f"{type(batch_sampler).__name__}")
            sampler, size, drop_last = unbatched_sampler(batch_sampler, seed)
            options = replace(options, sampler=sampler, batch_sampler=None, batch_size=size,
                              drop_last=drop_last)
        unbatched: Unbatched = ""
        if options.batch_size is None:
            unbatched, options = _unbatched(options, len(dataset), seed)
        self.last_batch: LastBatch = resolve_last_batch(options.last_batch, options.drop_last)
        options = _placed(options)
        own_rngs = isinstance(dataset, Mix) and dataset.own_rngs
        self._take_options(dataset, options, drop_last=self.last_batch == "drop",
                           process_wide=_MIX_RNGS if own_rngs else None, turns=own_rngs)
        plan_batch_size = self.batch_size
        if unbatched:
            self.batch_size = None  # type: ignore[assignment]  # DataLoader's surface
        sampler = options.sampler
        if isinstance(dataset, Mix):
            sampler = _mix_order(dataset, options, seed)
        if sampler is not None and options.shuffle:
            raise ValueError("shuffle=True cannot be combined with a sampler: the sampler "
                             "decides the order (drop shuffle, or drop the sampler)")
        if len(dataset) < 1:
            raise ValueError(f"the dataset ({type(dataset).__name__}) is empty: len() is 0 "
                             "(DataLoader would yield no batch; a resumable loader needs at "
                             "least one sample to plan its epochs: check the path or filter)")
        self._order_source = (sampler, bool(options.shuffle))
        order = self._make_order(sampler, bool(options.shuffle), len(dataset))
        self._order_read = self._order_key()
        self.schedule = MapSchedule(order, plan_batch_size, self.last_batch, self.seed,
                                    options.rank, options.world_size,
                                    merge_short_tail=options.evaluation,
                                    content=content_identity(dataset))
        _check_plan(self.schedule)
        self._follow_mix()
        self.sampler = (SequentialEpochSampler if isinstance(order, SequentialOrder)
                        else SizedEpochSampler)(self.schedule)
        self._unbatched: Unbatched = unbatched
        self._batch_fetcher: BatchFetcher | None = None
        self._window = DeliveredWindow()
        self._window_epoch: int | None = None  # the epoch of a loaded out-of-order window
        self._restored = False
        self._trainer_len: int | None = None  # the len() Lightning's fit loop read last
        self._active: Iterator[Any] | None = None  # the iterator delivering now
        self.skipped: list[SkippedSample] = []
        """Samples skipped under ``on_error="skip"`` in this process, in delivery order."""
        self._num_skipped = 0
        self._recent_skips: deque[int] = deque(maxlen=8)  # per delivered batch, newest last
        self._skips_handed: tuple[int, int, tuple[int, ...]] = (0, 0, ())  # at ``handing``

    # -- the DataLoader surface -------------------------------------------------------------

    def _describe(self) -> list[str]:
        schedule = self.schedule
        return [f"dataset={type(self.dataset).__name__}(len={schedule.dataset_len})",
                f"batch_size={self.batch_size}",
                *([] if self.in_order else ["in_order=False"]),
                f"order={schedule.order.fingerprint}",
                f"last_batch={self.last_batch!r}", f"num_workers={self.num_workers}",
                *self._backend_fields()]

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

        A state from another dataset length or content (the rows of a ``TableDataset`` or a
        Hugging Face ``Dataset``: ``content_identity``), seed, batch size, last-batch policy or
        order, of an unknown version, or corrupted, is refused with a ``StateMismatchError``
        naming each field and both values. ``num_workers``, ``prefetch_factor`` and
        ``pin_memory`` may differ, and so may the world size (except under
        ``last_batch="rollover"``).

        A dataset with ``state_dict()``/``load_state_dict()`` (torchdata's ``Stateful``) gets
        the state its main-process object had when the state was saved (rank 0's, under DDP);
        running workers are shut down so that the next ones start from it. What a dataset
        changes inside worker processes is never seen by the main process, so never saved.

        An ``in_order=False`` state resumes each rank at its own frontier, skipping the
        batches it had delivered past it; so does an ``in_order=True`` loader, which saves
        that window until the epoch ends.
        """
        parts = state_dict.get(PARTS) if isinstance(state_dict, Mapping) else None
        if not isinstance(parts, Mapping) or WINDOW not in parts:
            super().load_state_dict(state_dict)
            self._window.reset()
            self._window_epoch = None
            return
        # a mismatch first: the window is checked against this loader's plan
        state = self.schedule.saved_state(state_dict)
        entry = self._window_entry(state, parts[WINDOW])
        super().load_state_dict({**state_dict, "batches": entry[0]})
        self._window.restore(state.epoch, entry)
        self._window_epoch = state.epoch

    def _window_entry(self, state: LoaderState, part: Any) -> list[Any]:
        """This rank's ``[frontier, ahead]`` of a saved out-of-order window, checked."""
        rank, world_size = self.schedule.placement
        try:
            plan = self.schedule.plan_for(state.epoch, state.world_size, state.offset_position)
        except ValueError as exc:
            raise StateMismatchError(f"corrupted loader state: {exc}") from exc
        end = state.offset_batches + plan.num_batches
        return rank_entry(part, rank, world_size, state.batches, end)

    def delivery_order(self) -> list[int] | None:
        """With ``in_order=False``: the plan numbers of the epoch's batches in the order they
        were delivered, recorded from this call on (a live list, cleared at each epoch start).
        ``None`` in order, where the ``i``-th batch delivered is planned batch ``i``."""
        return None if self.in_order else self._window.record_order()

    def state_dict(self, unused: int = 0) -> dict[str, Any]:
        """The cursor (see ``DeliveryCore.state_dict``); with ``in_order=False`` (or in the
        epoch of a loaded out-of-order state), also every rank's batches delivered past its
        frontier (``out_of_order``)."""
        if self.in_order:
            state = super().state_dict(unused)
            if self._window_epoch != state["epoch"]:
                return state
        held = batches_after(self._held, unused)
        schedule = self.schedule
        state = schedule.state_dict()
        rank, world_size = schedule.placement
        parts = dict(state[PARTS])
        if self._restored or schedule.epoch is None:  # not started, or a state pending
            entry = self._window.pending() or [state["batches"], []]
        else:
            entry = self._window.saved(schedule.batches, held)
            entry[0] = max(entry[0], state["offset_batches"])
            # each rank's frontier replaces the cursor: the audit names the one it describes
            parts[AUDIT] = schedule.audit_at(entry[0])
        state["batches"] = entry[0]
        ranks = gather_by_rank(entry, rank, world_size)
        state[PARTS] = {**parts, **self._parts(held), WINDOW: {"ranks": ranks}}
        return state

    def _parts(self, held: int) -> dict[str, Any]:
        """The skip count (when skipping) and the dataset's own state (when it has one)."""
        parts: dict[str, Any] = {}
        if self.on_error == "skip" or self._num_skipped:
            recent = list(self._recent_skips)
            in_held = sum(recent[max(0, len(recent) - held):]) if held else 0
            parts[_SKIPPED] = self._num_skipped - in_held
        if is_stateful(self.dataset):
            parts[_DATASET] = copy.deepcopy(self.dataset.state_dict())
        return parts

    def _begin_handing(self) -> None:
        super()._begin_handing()
        self._skips_handed = (len(self.skipped), self._num_skipped, tuple(self._recent_skips))

    def _take_back(self) -> bool:
        """Also the skipped samples recorded since the handing began, counted or not yet:
        the engine reopens at the cursor, and they are recorded again as it fetches them."""
        skipped, self._num_skipped, recent = self._skips_handed
        del self.skipped[skipped:]
        self._recent_skips.clear()
        self._recent_skips.extend(recent)
        return super()._take_back()

    def _check_parts(self, parts: Mapping[str, Any]) -> None:
        _saved_skip_count(parts)

    def _load_parts(self, parts: Mapping[str, Any]) -> None:
        if _DATASET in parts and is_stateful(self.dataset):
            self.dataset.load_state_dict(copy.deepcopy(parts[_DATASET]))  # may refuse: first
            self.close()
        self._num_skipped = _saved_skip_count(parts)
        self._recent_skips.clear()
        self._restored = True

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (and deep-copied) as after ``close()``: without the engine's iterator (a
        spent one holds a generator); a pool holding workers refuses (``refuse_live``)."""
        return {**super().__getstate__(), "_active": None}

    def close(self) -> None:
        """Shut the worker processes down now (they also stop when the loader is collected).

        Nothing is lost: an iterator used after ``close()`` starts new workers and continues
        from the cursor.
        """
        self._active = None
        super().close()

    def _position(self) -> int:
        return self.schedule.batches

    def __len__(self) -> int:
        """Batches per epoch on this rank; ``len(dataset)`` and the sampler are read again
        between epochs. A batch sampler's epochs may differ in length: this is the length of
        the epoch being read, else of the one about to start (``MapSchedule.epoch_in_view``;
        under Lightning's fit loop, the epoch it is about to declare)."""
        self._refresh_order(contents=False)
        upcoming = fit_epoch()
        length = self.schedule.num_batches(upcoming=upcoming)
        if upcoming is not None:
            self._trainer_len = length
        return length

    def _open_epoch(self) -> Iterator[Any]:
        self._refresh_order()
        if self._batch_fetcher is not None and (self._collate_fn_changed()
                                                or self.gathers_in_memory):
            self._batch_fetcher = None  # made anew: the data's structure (new tensors,
            # indices) read again, or the new collate_fn
        schedule = self.schedule
        self._follow_mix()
        self._begin_map_epoch(schedule)
        self._restored = False
        self._window.resumed(schedule.epoch, schedule.batches)
        self._epoch_restarts = 0
        self._warn_if_the_trainer_stops_early()
        return self._deliver()

    def _warn_if_the_trainer_stops_early(self) -> None:
        """Lightning's fit loop stops every epoch after the ``len()`` it read when it set the
        data up: say so at the start of an epoch with more batches (a batch sampler's epochs
        may differ in length, so may a sampler's whose ``len()`` follows its ``set_epoch``, a
        dataset may grow), whose last ones it would skip."""
        told, schedule = self._trainer_len, self.schedule
        if told is None or schedule.batches or schedule.last_batch == "rollover":
            return
        planned = schedule.num_batches()
        if planned > told:
            warnings.warn(
                f"epoch {schedule.epoch} has {planned} batches on this rank, but Lightning read "
                f"len()={told} when it set the data up and stops every epoch there: the last "
                f"{planned - told} would be skipped. Pass Trainer("
                "reload_dataloaders_every_n_epochs=1) so that it reads len() at every epoch",
                stacklevel=4)

    def _follow_mix(self) -> None:
        """A ``Mix``'s order learns where delivery stands (``set_weights`` refuses past steps),
        again in a copied loader."""
        if isinstance(self.dataset, Mix):
            self.dataset.order.follow(self._delivered_to)

    def _delivered_to(self) -> tuple[int, int] | None:
        """``(epoch, position)`` after the last batch delivered, past the frontier too
        (``in_order=False``): a weight change before a batch delivered would not be what it was
        trained on, nor what a resume reads (``MapSchedule.frontier``)."""
        return self.schedule.frontier(self._window.last_ahead())

    def _refresh_order(self, contents: bool = True) -> None:
        """Between epochs, follow a dataset whose ``len()`` changed, and a sampler changed in
        place (``sampler_signature``, and with ``contents`` its indices or weights edited in
        place, ``sampler_contents``: O(n), read at each epoch start, which ``len()`` leaves
        out), as ``DataLoader`` does, which reads both at every epoch: the order is rebuilt,
        and when the dataset's length changed the workers, whose copies of the dataset are
        stale, restart. A state restored at its epoch's end is followed by the next epoch of
        the changed data too (one restored mid-epoch keeps its order)."""
        schedule = self.schedule
        between = schedule.epoch is None or schedule.remaining <= len(self._window.ahead)
        if not between:
            return
        key, read = self._order_key(contents), self._order_read
        if key == (read if contents else read[:-1] + (None,)) or len(self.dataset) < 1:
            return
        if self._restored and not schedule.abandon_finished_restore():
            return
        resized = key[0] != read[0]
        self._order_read = key if contents else self._order_key()
        sampler, shuffle = self._order_source
        order = self._make_order(sampler, shuffle, len(self.dataset))
        schedule.order, schedule.dataset_len = order, len(order)
        if resized:
            schedule.content = content_identity(self.dataset)
            self.close()
            self._batch_fetcher = None

    def _order_key(self, contents: bool = True) -> tuple[Any, ...]:
        """What the order is read from: the dataset's length (when the order follows it), the
        sampler's signature and, with ``contents``, the digest of its indices or weights."""
        sampler, _ = self._order_source
        follows = sampler is None or type(sampler) in (SequentialSampler, RandomSampler)
        return (len(self.dataset) if follows else None, sampler_signature(sampler),
                sampler_contents(sampler) if contents else None)

    def _reopen(self) -> Iterator[Any]:
        return self._deliver()

    def _deliver(self) -> Iterator[Any]:
        """The rest of the current epoch from the cursor, each batch counted as it is handed
        over. The engine is reopened at the cursor after a worker crash, and when the order
        changed mid-epoch (a re-weighted sampler), which re-plans the prefetched batches."""
        schedule, window = self.schedule, self._window
        while schedule.remaining > len(window.ahead):
            version = schedule.order_version
            try:
                for item in self._open():
                    if type(item) is Numbered:
                        number, item = item
                    else:  # in plan order
                        number = window.due(schedule.batches)
                    batch = self._receive(item)
                    window.count(schedule, number)
                    if batch is not _NOTHING:
                        yield batch
                    else:  # all skipped: its count stays, whatever this next() does next
                        self._begin_handing()
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
        worker processes could only add cost, else by the workers (started on first use)."""
        fetcher = self._fetcher()
        if self._fetches_in_process(fetcher):
            requests = not_delivered(self.schedule.requests(), frozenset(self._window.ahead))
            self._active = (fetcher.gathered(requests) if fetcher.in_memory
                            else iter(InProcess(fetcher, requests, None, self._auto_choice())))
        else:
            self._active = iter(self._workers())
        return self._active

    @property
    def gathers_in_memory(self) -> bool:
        """Whether batches are gathered from in-memory data (tensors, numeric arrays, ...) by
        vectorised indexing in this process, whatever ``num_workers`` is."""
        fetcher = self._fetcher()
        return fetcher.in_memory and self._fetches_in_process(fetcher)

    def _untunable(self) -> str | None:
        if self._gathers_with_any_workers(self._fetcher()):
            return ("the data is in memory and gathered in this process whatever num_workers "
                    "is: no worker is started")
        return None

    def _fetches_in_process(self, fetcher: BatchFetcher) -> bool:
        """Without workers, or for in-memory data that asks for no worker
        (``_gathers_with_any_workers``)."""
        if self.pin_memory:
            return False
        return self.num_workers == 0 or self._gathers_with_any_workers(fetcher)

    def _gathers_with_any_workers(self, fetcher: BatchFetcher) -> bool:
        """In-memory data with no ``worker_init_fn`` and no ``pin_memory``: a batch is one
        vectorised gather, far cheaper than sending it from a worker process. Pinned batches go
        through the worker pool, which pins them as they arrive."""
        return fetcher.in_memory and self.worker_init_fn is None and not self.pin_memory

    def _fetcher(self) -> BatchFetcher:
        """The batch fetcher (made once: it probes the dataset for the fastest fetch path)."""
        if self._batch_fetcher is None:
            self._collating = self.collate_fn
            self._batch_fetcher = BatchFetcher(self.dataset, self.collate_fn, self.seed,
                                               self.on_error, self._unbatched,
                                               ring=self.shared_ring)
        return self._batch_fetcher

    def _receive(self, item: Any) -> Any:
        """Unwrap what a fetch returned: raise a worker's error, record skipped samples."""
        kind = type(item)
        if kind is Failed:
            self._close_after_error()  # the cursor stays on the failed batch: a retry asks again
            item.reraise()
        if kind is not Skipped:
            self._recent_skips.append(0)
            return item
        rank, world_size = self.schedule.placement
        if item.empty and world_size > 1:
            self._close_after_error()  # the cursor stays on the batch, as after an error
            raise _emptied(item.skipped, rank)
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

    def _workers(self) -> Iterable[Any]:
        """The worker pool (processes or threads) over our batch requests (created once,
        workers persistent)."""
        fetcher = self._fetcher() if self.in_order else self._fetcher().numbering()
        return self._worker_pool(fetcher, _RequestSampler(self.schedule, self._window),
                                 self.prefetch_factor, balanced=True)

    # -- configuration ----------------------------------------------------------------------

    def _make_order(self, sampler: Any, shuffle: bool, dataset_len: int) -> SampleOrder:
        if sampler is not None:
            return order_from_sampler(sampler, dataset_len, self.seed)
        if shuffle:
            return ShuffledOrder(dataset_len, self.seed)
        return SequentialOrder(dataset_len)


def _mix_order(mix: Mix, options: LoaderOptions, seed: int) -> SampleOrder:
    """A ``Mix`` is its own order: a sampler or ``shuffle=True`` would contradict it (a
    ``DataLoader``'s default ``SequentialSampler``, as ``make_resumable`` passes it, is fine)."""
    sampler = options.sampler
    default = type(sampler) is SequentialSampler and len(sampler) == len(mix)
    if options.shuffle or (sampler is not None and not default):
        raise ValueError("a Mix decides its own order (its weighted draws are already random): "
                         "drop shuffle=True and the sampler; change the mixture with its "
                         "weights, mode and samples_per_epoch")
    return mix.order.bind(seed)


class _RequestSampler(Sampler[BatchRequest]):
    """The internal DataLoader's sampler: re-reads the cursor at every ``iter()`` (and skips
    the batches already delivered out of order)."""

    def __init__(self, schedule: MapSchedule, window: DeliveredWindow) -> None:
        self._schedule = schedule
        self._window = window

    def __iter__(self) -> Iterator[BatchRequest]:
        return not_delivered(self._schedule.requests(), frozenset(self._window.ahead))

    def __len__(self) -> int:
        return self._schedule.remaining - len(self._window.ahead)


def _unbatched(options: LoaderOptions, dataset_len: int, seed: int
               ) -> tuple[Unbatched, LoaderOptions]:
    """``batch_size=None`` (``DataLoader``'s unbatched loading): one sample per index of the
    sampler, ``dataset[list]`` per list of a sampler that yields lists (bulk loading), or
    ``dataset[tuple]`` per tuple (one key), converted by ``collate_fn`` (``default_convert``
    by default), never collated."""
    collate_fn = unbatched_conversion(options)
    sampler = options.sampler
    key = "" if sampler is None else bulk_key(sampler)
    if key:
        inner, size, drop_last = unbatched_sampler(sampler, seed)
        return key, replace(options, sampler=inner, batch_size=size, drop_last=drop_last,
                            collate_fn=collate_fn)
    return "sample", replace(options, batch_size=1, collate_fn=collate_fn)


def _placed(options: LoaderOptions) -> LoaderOptions:
    """An explicit ``DistributedSampler``'s ``rank``/``num_replicas`` as the placement."""
    placement = placement_from_sampler(options.sampler)
    if placement is None:
        return options
    rank, world_size = placement
    if (options.rank not in (None, rank)) or (options.world_size not in (None, world_size)):
        raise ValueError(f"the DistributedSampler says rank={rank}, num_replicas={world_size} "
                         f"but the loader was given rank={options.rank}, "
                         f"world_size={options.world_size}: give one of them")
    return replace(options, rank=rank, world_size=world_size)


def _check_plan(schedule: MapSchedule) -> None:
    """Refuse, at construction, a plan that cannot give every rank a batch in every epoch
    (for the placement known now; one resolved later is checked at the first batch)."""
    _, world_size = schedule.placement
    global_batch = schedule.batch_size * world_size
    if schedule.last_batch == "rollover" and schedule.dataset_len < global_batch:
        raise ValueError(
            f"last_batch='rollover' needs at least one global batch per epoch: "
            f"{schedule.dataset_len} samples are fewer than {world_size} ranks x batch_size "
            f"{schedule.batch_size}; use batch_size <= {schedule.dataset_len // world_size} or "
            "another last_batch policy")
    schedule.plan_for(0, world_size)


def _saved_skip_count(parts: Mapping[str, Any]) -> int:
    """The skip count saved in a state's parts (0 when absent); a corrupted one is refused."""
    count = parts.get(_SKIPPED, 0)
    if not isinstance(count, int) or isinstance(count, bool) or count < 0:
        raise StateMismatchError(
            f"corrupted loader state: parts[{_SKIPPED!r}]={count!r} is not an int >= 0")
    return count


def _emptied(skipped: tuple[SkippedSample, ...], rank: int) -> SampleFetchError:
    """The error for a batch whose every sample failed under ``on_error="skip"`` on one of
    several ranks: left out, it would leave this rank a batch short of the others, whose next
    collective (a DDP step) would wait for it forever."""
    first = skipped[0]
    errors = "; ".join(f"index {sample.index}: {sample.error}" for sample in skipped)
    return SampleFetchError(
        f"every sample of batch {first.batch} (epoch {first.epoch}) failed on rank {rank} "
        f"under on_error='skip' ({errors}): left out, it would give this rank one batch fewer "
        "than the other ranks, and a distributed step would wait for it forever. Fix or drop "
        "those samples (in the dataset), or use a larger batch_size", epoch=first.epoch,
        batch=first.batch, rank=rank, cause_type=first.error.partition(":")[0])
