"""``ResumableIterableLoader``: iterable datasets, sharded over ranks and workers, with equal
batch counts on every rank and an exact resume. ``ResumableLoader(iterable_dataset, ...)``
returns one.

Slots and shards
    Every (rank, worker) pair is a *slot*; a rank has ``max(1, num_workers)`` slots. In every
    epoch each slot reads a fixed list of *pieces* (a shard, or a part of one) and cuts its own
    batches from them. The main process interleaves the slots' batches round-robin (slot 0's
    first batch, slot 1's first, ..., slot 0's second, ...; a finished slot drops out), so the
    stream of a rank is a pure function of ``(seed, epoch, world_size, num_workers)`` and the
    shards. Shards come from a ``ShardedSource`` (see ``lightning_loaders.sources.shards``).

The plan of an epoch
    The shard order is reshuffled per epoch (``shuffle=True``), keyed by ``(seed, epoch)``.

    *Known lengths* (the source declares ``shard_lengths``): the epoch's samples are the shards laid
    end to end in that order, cut into ``partitions`` contiguous *canonical partitions* (chosen
    once, saved in the state; see ``lightning_loaders.schedule.partition_plan``), each cut into
    batches; rank ``r`` delivers batches ``r, r + world_size, ...`` of the partitions taken
    round-robin, so shards may be split (opened mid-shard with ``open_shard(index, start)``) and the
    order does not depend on the layout: a mid-epoch resume under another world size or
    ``num_workers`` deals the rest of the epoch to the new layout exactly (``"rollover"`` keeps one
    contiguous part per rank and slot, as below). Batch counts are fixed before the epoch starts and
    equal on every rank: ``"keep"`` reads every sample once (the last batches of a rank may be
    smaller, never empty), ``"drop"`` reads only full batches (the tail of the epoch's order is
    dropped), ``"pad"`` fills every batch by wrapping around to the start of the epoch's order,
    ``"rollover"`` carries the tail over to open the next epoch. ``len()`` is exact and the saved
    state is O(1).

    *Unknown lengths*: whole shards are dealt out, rank first, in the epoch's order. Each slot
    reads its shards to the end (``"keep"`` delivers its short last batch, ``"drop"`` does
    not). In one process every sample is read. Under DDP, ranks cannot know in advance who
    runs out first, so every ``sync_interval`` batches they agree (one ``all_reduce`` of an
    int, on the main thread, inside ``next()``) on how many batches all of them still have:
    the epoch ends on every rank when the first rank runs out, and the other ranks' remaining
    samples are not read that epoch (a warning says so once). No rank ever waits for a batch
    another rank does not have, so there is no hang (this needs an initialised process group,
    as under Lightning's DDP; without one, several ranks of unknown length are refused).
    ``len()`` raises ``TypeError``; Lightning then prefetches one batch, which the saved state
    does not count. ``"pad"`` and ``"rollover"`` need known lengths.

    *Plain* ``IterableDataset`` *(no shards)*: the strided fallback. Every slot iterates the
    whole dataset and keeps every ``k``-th sample (``k`` = world size x slots per rank), so it
    reads ``k`` times the data, and a resume re-reads the skipped part of the stream: slower,
    but sharded and resumable. A dataset
    with ``__len__`` counts as known length (equal batch counts as above, per slot), else
    unknown. The dataset is read as its only reader (``lightning_loaders.sources.plain``):
    ``get_worker_info()`` returns ``None`` and ``RANK``/``WORLD_SIZE`` say 0/1 while it yields,
    so datasets that split their stream by worker (torch's documented pattern, Hugging Face,
    WebDataset) are read whole and every sample arrives once. Datasets split by node from
    their own configuration (HF ``split_dataset_by_node``, a WebDataset ``split_by_node``
    stage) are refused with the fix. The stream must be the same in every process: it reads
    under global RNGs of its own (seeded from the seed and the epoch when it opens, carried
    from batch to batch), and on several ranks the ranks compare its ``len()`` and first
    samples at every epoch start of Lightning's loops (not, by default, in a loop of the
    user's, which may run on one rank alone or in a thread; ``compare_ranks=True`` compares in
    any loop, for one every rank runs alike); its ``set_epoch(epoch)``, if any, is called
    before each epoch.

    ``shuffle_buffer=n`` additionally mixes samples within a canonical partition (or, without
    partitions, a slot): its stream is cut into windows of ``n`` samples, each emitted in a
    permutation keyed by ``(seed, epoch, partition, window)`` (``(seed, epoch, rank, slot,
    window)``).

    Exact resume The cursor is the number of batches delivered to the caller (never counting
    prefetched ones, nor the batch Lightning's fetcher holds ahead of the training step). With known
    lengths every slot's position follows from it. With unknown lengths every slot reports its
    position (piece, offset in the shard, and the shard iterator's own ``state_dict()`` if it has
    one) with every batch; ``state_dict()`` gathers all ranks' positions with ``all_gather_object``
    (every rank calls it when Lightning checkpoints), so the state rank 0 saves restores every rank.
    An iterable dataset's own ``state_dict()`` (a Hugging Face ``IterableDataset`` has one) is
    neither saved nor loaded: the loader keeps the position, and restoring both would skip twice.
    With canonical partitions, resuming mid-epoch with another ``num_workers`` or world size
    continues exactly; otherwise (unknown lengths, ``"rollover"``, plain datasets) it is refused
    with an error saying why (the slots' streams would differ); at an epoch boundary any
    configuration resumes (under ``"rollover"`` on another world size, the leftovers the saved
    run carried over open the next epoch, and the stream is cut into the new global batches
    from there on; the state saves where). A worker process that dies is replaced the same
    way: all workers restart from the position of the last batch received, so the stream goes
    on as if nothing happened (at most ``max_worker_restarts`` times per epoch).

Out-of-order delivery (``in_order=False``)
    With canonical partitions every batch of a rank is a numbered request that says by itself
    which samples to read (partition segments; a worker opens a shard mid-shard with
    ``open_shard(index, start)`` when it does not already stand there), so any worker can
    answer any batch: each is delivered as soon as it arrives, and a worker's own batches stay
    in their order. The state is the cursor's frontier plus the batches delivered past it
    (``lightning_loaders.loaders.out_of_order``: the window map-style loaders use, bounded by
    ``num_workers * prefetch_factor``), and a resume requests exactly the others. A state
    saved in order resumes out of order and vice versa. Without canonical partitions (unknown
    lengths, ``"rollover"``, plain datasets) a slot's batch continues that slot's stream, which
    only its own worker can do without re-reading it, so ``in_order=False`` warns and is
    ignored. """

from __future__ import annotations

import itertools
import warnings
from collections.abc import Callable, Iterator, Mapping
from dataclasses import replace
from typing import Any

from torch.utils.data import Sampler

from lightning_loaders.collectives import agree_min, gather_by_rank
from lightning_loaders.engines.pool import WorkerLost, WorkerStalled
from lightning_loaders.engines.shard_reader import SlotFetcher
from lightning_loaders.engines.transport import worker_collate
from lightning_loaders.loaders.delivery import EpochSampler
from lightning_loaders.loaders.options import LoaderOptions, unbatched_conversion
from lightning_loaders.loaders.out_of_order import (
    WINDOW,
    DeliveredWindow,
    not_delivered,
    rank_entry,
)
from lightning_loaders.loaders.prefetch import batches_after
from lightning_loaders.loaders.resumable import ResumableLoader
from lightning_loaders.schedule.map_plan import LastBatch
from lightning_loaders.schedule.map_schedule import resolve_last_batch
from lightning_loaders.schedule.partition_plan import uses_partitions
from lightning_loaders.schedule.requests import Delivered, PartRequest, SlotEnd, SlotRequest
from lightning_loaders.schedule.shard_plan import PlanConfig
from lightning_loaders.schedule.shard_schedule import IterableSchedule
from lightning_loaders.sources.plain import PlainStream
from lightning_loaders.sources.shards import ShardedSource
from lightning_loaders.state import PARTS

__all__ = ["ResumableIterableLoader"]


class ResumableIterableLoader(ResumableLoader):
    """A deterministic, sharded, exactly resumable loader over an iterable dataset.

    ``ResumableLoader(dataset, ...)`` returns one when ``dataset`` is a
    ``torch.utils.data.IterableDataset`` (a ``ShardedSource`` or a plain one). It takes
    ``ResumableLoader``'s arguments (``sampler`` and ``batch_sampler`` must stay unset: the plan
    decides the order), plus:

    Args:
        shuffle: reshuffle the shard order every epoch, keyed by ``(seed, epoch)``.
        evaluation: with known shard lengths, ``last_batch="keep"`` and ``batch_size=1``,
            leftover samples (fewer than ranks) join the last batch of the first ranks instead
            of failing (as for ``ResumableLoader``).
        shuffle_buffer: mix samples within each (rank, worker) slot in windows of this many
            samples (0: off). Costs that many samples of memory per worker.
        sync_interval: with unknown lengths under DDP, batches between two agreements of the
            ranks on how many batches they all still have (each rank holds up to this many
            batches ahead to answer, and its workers prefetch at least as many).
        partitions: with known shard lengths (not ``"rollover"``), the number of canonical
            partitions the epoch order is planned over; ``None``: the saved number on resume,
            else world size x slots per rank (with ``num_workers="auto"``: x the most workers
            the tuning may use, so the order never depends on it). Fixed for the run (saved
            in the state). The epoch order is the same for every layout given the same
            number; a multiple of every layout's ranks x workers lets each worker read its
            own partitions.

    ``in_order=False`` delivers batches as workers finish them when the epochs are planned over
    canonical partitions (known shard lengths, not ``"rollover"``); otherwise it warns and is
    ignored. See the module docstring for the plan, the equal-count strategies and resume.
    """

    schedule: IterableSchedule

    def _configure(self, dataset: Any, options: LoaderOptions) -> None:
        if options.sampler is not None or options.batch_sampler is not None:
            raise ValueError("an iterable dataset takes no sampler or batch_sampler (as in "
                             "DataLoader): the plan decides the order; shuffle shards with "
                             "shuffle=True and mix samples with shuffle_buffer")
        unbatched: _Unbatched | None = None
        if options.batch_size is None:  # each item delivered as it is, converted, as DataLoader
            unbatched = _Unbatched(unbatched_conversion(options))
            options = replace(options, batch_size=1, collate_fn=unbatched)
        self.last_batch: LastBatch = resolve_last_batch(options.last_batch, options.drop_last)
        self._take_options(dataset, options, drop_last=self.last_batch == "drop",
                           process_wide=_process_wide(dataset),
                           turns=not isinstance(dataset, ShardedSource) or not dataset.rng_free)
        shuffle, shuffle_buffer = options.shuffle, options.shuffle_buffer
        if options.on_error != "raise":
            raise ValueError(f"on_error={options.on_error!r} is not supported for iterable "
                             "datasets: a shard iterator that raised cannot go on past the "
                             "failing sample; skip bad records inside open_shard instead")
        partitions = options.partitions
        if partitions is not None and (not isinstance(partitions, int)
                                       or isinstance(partitions, bool) or partitions < 1):
            raise ValueError(f"partitions must be None or an int >= 1, got {partitions!r}")
        for name, value, low in (("shuffle_buffer", shuffle_buffer, 0),
                                 ("sync_interval", options.sync_interval, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        source = (dataset if isinstance(dataset, ShardedSource)
                  else PlainStream(dataset, self.seed))
        strided = isinstance(source, PlainStream)
        lengths = source.shard_lengths
        if not source.shards:
            raise ValueError(f"{type(dataset).__name__} declares no shards")
        if lengths is not None and sum(lengths) == 0:
            raise ValueError(f"the dataset ({type(dataset).__name__}) is empty: its shard "
                             "lengths add up to 0")
        if partitions is not None and lengths is not None and partitions > sum(lengths):
            raise ValueError(f"partitions={partitions} is more than the {sum(lengths)} samples "
                             "to cut into partitions; use at most that many")
        if self.last_batch == "rollover" and (lengths is None or strided):
            raise ValueError("last_batch='rollover' needs a ShardedSource with known shard "
                             "lengths; use 'keep' or 'drop'")
        if self.last_batch == "pad" and lengths is None:
            raise ValueError("last_batch='pad' needs known lengths (shard_lengths, or __len__ "
                             "on a plain dataset) to know what to pad; use 'keep' or 'drop'")
        if shuffle and strided and shuffle_buffer == 0:
            raise ValueError(f"shuffle=True on a plain {type(dataset).__name__} (no shards to "
                             "reorder) needs shuffle_buffer > 0 to mix samples")
        if shuffle and len(source.shards) == 1 and shuffle_buffer == 0:
            raise ValueError(f"shuffle=True reorders the shards, and this "
                             f"{type(dataset).__name__} has one: every epoch would come in the "
                             "same order. Pass shuffle_buffer > 0 to mix samples, or split the "
                             "data into more shards (files, Parquet row groups)")
        self.shuffle = bool(shuffle)
        self.shuffle_buffer = shuffle_buffer
        self.sync_interval = options.sync_interval
        config = PlanConfig(None if lengths is None else tuple(lengths), len(source.shards),
                            strided, self.batch_size, self.last_batch, self.shuffle, self.seed,
                            merge_short_tail=options.evaluation and not strided)
        if not self.in_order and not uses_partitions(config):
            warnings.warn(_ordered_only(config), stacklevel=3)
            self.in_order = True
        tuner = self._autotuner
        if tuner is not None and not uses_partitions(config):
            raise ValueError(
                "num_workers='auto' needs an order that does not depend on the number of "
                "workers: a ShardedSource with known shard_lengths, without "
                "last_batch='rollover' (planned over canonical partitions). Here each (rank, "
                "worker) slot reads its own part of the shards, so changing the worker count "
                "would change the data; set num_workers to a number")
        # Under autotuning, the slots (and so the default partition count) are the most workers
        # it may use, fixed for the run: the order and the state never depend on the tuning.
        slots = max(1, self.num_workers if tuner is None else tuner.config.max_workers or 1)
        self.schedule = IterableSchedule(config, slots, max(1, shuffle_buffer),
                                         source.fingerprint, options.rank,
                                         options.world_size, partitions)
        self.sampler = EpochSampler(self.schedule)
        self._fetcher = SlotFetcher(source, config, slots, max(1, shuffle_buffer),
                                   options.collate_fn, ring=self.shared_ring)
        if unbatched is not None:  # DataLoader's surface
            self.batch_size = None  # type: ignore[assignment]
            self.collate_fn = unbatched.fn
        self._collating = self.collate_fn
        self._warned_surplus = False
        self._window = DeliveredWindow()  # canonical partitions: batches past the frontier
        self._restored = False  # a loaded window waits for its epoch to open
        self._window_epoch: int | None = None  # the epoch of a loaded out-of-order window

    # -- the DataLoader surface -------------------------------------------------------------

    def _describe(self) -> list[str]:
        config = self.schedule.config
        lengths = "unknown" if config.lengths is None else sum(config.lengths)
        kind = "strided" if config.strided else f"{config.num_shards} shards"
        return [f"dataset={type(self.dataset).__name__}({kind}, samples={lengths})",
                f"batch_size={self.batch_size}", f"shuffle={self.shuffle}",
                f"shuffle_buffer={self.shuffle_buffer}", f"last_batch={self.last_batch!r}",
                *([] if self.in_order else ["in_order=False"]),
                f"num_workers={self.num_workers}", *self._backend_fields()]

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a cursor; the next ``iter()`` continues exactly after its last batch.

        An ``in_order=False`` state (canonical partitions) resumes each rank at its own
        frontier, skipping the batches it had delivered past it; so does an ``in_order=True``
        loader, and an ``in_order=True`` state resumes under ``in_order=False`` (no batch
        past its cursor was delivered)."""
        parts = state_dict.get(PARTS) if isinstance(state_dict, Mapping) else None
        if not isinstance(parts, Mapping) or WINDOW not in parts or not self.schedule.canonical:
            super().load_state_dict(state_dict)
            self._window.reset()
            self._restored, self._window_epoch = True, None
            return
        rank, world_size = self.schedule.placement
        # a mismatch first: the window is checked against this loader's plan
        state = self.schedule.saved_state(state_dict)
        # the epoch's end bounds the saved batch numbers; another world size keeps no window
        end = self.schedule.saved_batches(state, rank) if state.world_size == world_size else 0
        entry = rank_entry(parts[WINDOW], rank, world_size, state.batches, end)
        super().load_state_dict({**state_dict, "batches": entry[0]})
        self._window.restore(state.epoch, entry)
        self._restored, self._window_epoch = True, state.epoch

    def state_dict(self, unused: int = 0) -> dict[str, Any]:
        """The cursor (see ``DeliveryCore.state_dict``); with ``in_order=False``, also every
        rank's batches delivered past its frontier (the ``window`` part, gathered from all
        ranks: every rank must call it, as Lightning does)."""
        state = super().state_dict(unused)
        if self.in_order and self._window_epoch != state["epoch"]:
            return state
        held, schedule = batches_after(self._held, unused), self.schedule
        if self._restored or schedule.epoch is None:  # not started, or a state pending
            entry = self._window.pending() or [state["batches"], []]
        else:
            entry = self._window.saved(schedule.batches, held)
        state["batches"] = entry[0]
        rank, world_size = schedule.placement
        ranks = gather_by_rank(entry, rank, world_size)
        state[PARTS] = {**state[PARTS], WINDOW: {"ranks": ranks}}
        return state

    def close(self) -> None:
        """Shut the worker processes (and, without workers, the open shards) down now; they
        also stop when the loader is collected. Iterating again continues from the cursor."""
        super().close()
        self._fetcher.close()

    def _open_epoch(self) -> Iterator[Any]:
        schedule, source = self.schedule, self._fetcher.source
        if isinstance(source, PlainStream) and self._compares_ranks():
            # the ranks compare streams before any refusal
            schedule.check_same_stream(self._begin_epoch, self._plain_digest)
        else:
            self._begin_epoch()
        self._restored = False
        self._window.resumed(schedule.epoch, schedule.batches)
        self._epoch_restarts = 0
        return self._deliver()

    def _begin_epoch(self) -> None:
        schedule = self.schedule
        _check_lengths(self._fetcher.source, schedule.config.lengths)
        if self._collate_fn_changed():
            unbatched = self.batch_size is None  # each item converted by collate_fn
            collate_fn = _Unbatched(self.collate_fn) if unbatched else self.collate_fn
            self._fetcher.collate_fn = worker_collate(collate_fn, self.shared_ring)
        schedule.begin_epoch()

    def _plain_digest(self) -> int:
        """The digest of the epoch's plain stream's first samples, read in this process."""
        source, epoch = self._fetcher.source, self.schedule.epoch
        assert isinstance(source, PlainStream) and epoch is not None
        self._fetcher.set_epoch(epoch)  # in this process, before any worker reads
        return source.digest()

    def _reopen(self) -> Iterator[Any]:
        self.schedule.restart()
        return self._deliver()

    def _position(self) -> int:
        schedule = self.schedule  # out of order, the first batch not delivered is the one due
        return schedule.received_batches if self.in_order else schedule.batches

    # -- delivery ---------------------------------------------------------------------------

    def _deliver(self) -> Iterator[Any]:
        """The rest of the current epoch, counted as each batch is handed over."""
        schedule = self.schedule
        received = self._received()
        items = (self._agreed(received) if schedule.synced
                 else ((item, False) for item in received))
        window = self._window if schedule.canonical else None
        for item, last in items:
            if window is not None:  # numbered batches, maybe out of order
                window.count(schedule, item.batch)
            else:
                schedule.delivered(item, last)
            yield item.data
        schedule.finish()
        if schedule.open_tail():  # a restored epoch had nothing left: the next one follows
            yield from self._open_epoch()

    def _received(self) -> Iterator[Delivered]:
        """Batches in plan order as the workers answer, skipping the slots' end markers;
        dead workers are replaced and continue after the last batch received."""
        schedule = self.schedule
        if schedule.ended:
            return
        assert schedule.epoch is not None
        self._fetcher.set_epoch(schedule.epoch)  # in this process, before any worker reads
        while True:
            try:
                for item in self._workers():
                    schedule.received(item)
                    if isinstance(item, Delivered):
                        yield item
                return
            except WorkerLost as lost:
                self._recover(lost)
                if schedule.canonical:  # every batch received was delivered (maybe ahead)
                    schedule.restart()
                else:
                    schedule.restart_after_received()
            except WorkerStalled as stalled:
                raise self._stall_error(stalled) from None

    def _agreed(self, items: Iterator[Delivered]) -> Iterator[tuple[Delivered, bool]]:
        """Unknown lengths under DDP: deliver only batches every rank has.

        Every ``sync_interval`` batches each rank reads that many ahead and the ranks take the
        minimum of ``2 * count + (0 if the rank has nothing after them else 1)``: everyone then
        delivers ``count`` more batches, and the epoch ends after them when the rank with the
        fewest has nothing left.
        """
        schedule = self.schedule
        while True:
            ahead = list(itertools.islice(items, self.sync_interval))
            done_here = len(ahead) < self.sync_interval or len(schedule.exhausted) == schedule.slots
            agreed = agree_min(2 * len(ahead) + (0 if done_here else 1))
            count, ends = agreed // 2, agreed % 2 == 0
            for i, item in enumerate(ahead[:count]):
                yield item, ends and i == count - 1
            if ends:
                if (len(ahead) > count or not done_here) and not self._warned_surplus:
                    self._warned_surplus = True
                    rank, world_size = schedule.placement
                    warnings.warn(
                        f"rank {rank} of {world_size} ended epoch {schedule.epoch} after "
                        f"{schedule.batches} batches because another rank ran out of data: with "
                        "unknown shard lengths every rank stops when the first one does, so the "
                        "rest of this rank's shards is not read this epoch. Declare the shard "
                        "lengths to balance the ranks exactly (warned once)", stacklevel=2)
                return

    def _workers(self) -> Iterator[Delivered | SlotEnd]:
        """torch's DataLoader over the current generation's requests (workers persistent)."""
        prefetch = self.prefetch_factor
        if self.num_workers > 0 and self.schedule.synced:  # ranks agree on batches in hand
            prefetch = max(prefetch or 2, -(-self.sync_interval // self.num_workers))
        sampler = _RequestSampler(self.schedule, self.num_workers > 0, self._window)
        return iter(self._worker_pool(self._fetcher, sampler, prefetch))


class _RequestSampler(Sampler[SlotRequest | PartRequest]):
    """The internal DataLoader's sampler: the current generation's requests at every iter()
    (with canonical partitions, less the batches delivered out of order)."""

    def __init__(self, schedule: IterableSchedule, with_skips: bool, window: DeliveredWindow
                 ) -> None:
        self._schedule = schedule
        self._with_skips = with_skips
        self._window = window

    def __iter__(self) -> Iterator[SlotRequest | PartRequest]:
        requests = self._schedule.requests(self._with_skips)
        if not self._schedule.canonical:
            return requests
        return not_delivered(requests, frozenset(self._window.ahead))


def _ordered_only(config: PlanConfig) -> str:
    """Why ``in_order=False`` is ignored for this iterable dataset (see the warning)."""
    if config.strided:
        kind = "a plain IterableDataset (the strided fallback)"
    elif config.lengths is None:
        kind = "a ShardedSource without shard_lengths"
    else:
        kind = "last_batch='rollover'"
    return (f"in_order=False is ignored for {kind}: batches are delivered in plan order. Out-of-"
            "order delivery needs batches that each say what to read, so that any worker can "
            "answer any of them and a resume can skip those delivered: an iterable has them only "
            "when planned over canonical partitions (a ShardedSource with known shard_lengths, "
            "last_batch 'keep', 'drop' or 'pad'). Here each (rank, worker) slot cuts its batches "
            "from its own stream, which only its own worker can continue without re-reading it")


class _Unbatched:
    """``batch_size=None`` over an iterable dataset: each planned batch holds one item, which
    ``fn`` converts (``default_convert`` unless a ``collate_fn`` is given) instead of a
    collation into a batch of one."""

    def __init__(self, fn: Callable[[Any], Any]) -> None:
        self.fn = fn

    def __call__(self, items: list[Any]) -> Any:
        return self.fn(items[0])


def _check_lengths(source: ShardedSource[Any], planned: tuple[int, ...] | None) -> None:
    """Refuse to start an epoch of a source whose lengths changed since the loader planned
    them (a dataset whose ``len()`` grows between epochs): the plan, ``len()`` and the state
    are fixed from them, so the epoch would be cut at the old length or run short."""
    lengths = source.shard_lengths
    if planned is not None and lengths is not None and tuple(lengths) != planned:
        what = (f"len() changed from {planned[0]} to {lengths[0]}" if len(planned) == 1
                else "shard lengths changed")
        name = type(getattr(source, "dataset", source)).__name__  # a plain stream: the user's
        raise ValueError(
            f"the {name}'s {what} since the loader was built: an iterable "
            "dataset's epochs are planned from its lengths once. Build a new loader for the "
            "new data (map-style datasets follow a changed len() between epochs)")


def _process_wide(dataset: Any) -> str | None:
    """What reading ``dataset`` needs of state the whole process shares, which threads could
    not give each worker (``None``: nothing): the global RNGs and environment a plain stream
    is opened under, the global-RNG states of their own a source's shards are read under
    (``ShardedSource.own_rngs``), or each batch's seeding of the global RNGs, which a worker
    thread holds for a source that may draw from them as it seeks and reads (``rng_turn``)."""
    if not isinstance(dataset, ShardedSource):
        return ("a plain IterableDataset's stream is opened under the global RNGs and the "
                "environment (RANK, WORLD_SIZE), which threads share with the training loop")
    name = type(dataset).__name__
    if dataset.own_rngs:
        return (f"{name} reads each shard under global-RNG states of its own (it is neither "
                "rng_free, which a source that never draws from them may set, nor seeks), "
                "which threads share")
    if not dataset.rng_free:
        return (f"{name} may draw from the global RNGs as it reads (it is not rng_free): "
                "it reads under each batch's seeding of them, which makes its draws the same "
                "for every num_workers, backend and resume, and which threads share")
    return None

