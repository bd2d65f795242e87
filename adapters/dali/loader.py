"""``DALILoader``: a DALI pipeline as a distributed, exactly resumable Lightning loader.

The user writes the pipeline (a ``@pipeline_def`` function or a factory); the loader builds it
lazily with the right ``device_id``, shard and seed, owns the epoch like the core loader does
(``MapSchedule``), counts batches on delivery and saves a cursor that resumes exactly. Two modes,
chosen by what is given:

* **reader mode** (``reader_name=``): a DALI reader shards and reads the data itself. The loader
  requires ``pad_last_batch=True`` (equal batch counts on every rank), maps ``last_batch`` onto
  DALI's ``LastBatchPolicy`` and resumes mid-epoch through DALI checkpoints, gathered from every
  rank into the state rank 0 saves. Resuming on another world size is refused.
* **external-source mode** (``dataset=``): the global plan of the core decides which sample
  every rank reads in every batch (any ``shuffle``/``sampler``, elastic resume); DALI pulls the
  samples through a per-sample ``fn.external_source`` callback. Resume rebuilds the pipeline at
  ``(epoch, batch)``; with the same world size the saved DALI checkpoint also restores the state
  of random operators, so even augmentations continue exactly.

``nvidia-dali`` is an optional extra: it is imported when a loader is created.
"""

from __future__ import annotations

import math
import weakref
from collections.abc import Callable, Iterator, Mapping, Sequence
from itertools import repeat
from typing import Any, Literal

import torch

from lightning_loaders.adapters.dali.engine import (
    INSTALL_HINT,
    Engine,
    EngineBox,
    Entry,
    Placement,
    Restore,
    call_pipeline,
    check_pipeline,
    frozen_heap,
    import_dali,
    shutdown_pipeline,
)
from lightning_loaders.adapters.dali.source import FileSamples, PlannedSource, batch_sizes
from lightning_loaders.collectives import gather_by_rank
from lightning_loaders.hashing import seed32
from lightning_loaders.loaders.delivery import DeliveryCore, EpochSampler
from lightning_loaders.orders.base import SampleOrder, SequentialOrder, ShuffledOrder
from lightning_loaders.orders.from_torch import SamplerEpochs, order_from_sampler
from lightning_loaders.placement import resolve_device, resolve_rank_world
from lightning_loaders.schedule.map_plan import LastBatch
from lightning_loaders.schedule.map_schedule import MapSchedule, resolve_seed
from lightning_loaders.state import PARTS

__all__ = ["INSTALL_HINT", "DALILoader", "FileSamples"]

_STATE_KEY = "dali"
_POLICIES = ("keep", "drop", "pad")
_DALI_POLICY = {"keep": "PARTIAL", "drop": "DROP", "pad": "FILL"}


class DALILoader(DeliveryCore):
    """Runs a user's DALI pipeline as a deterministic, distributed, resumable loader.

    Args:
        pipeline: a ``@pipeline_def`` function, or a factory taking the ``Pipeline`` constructor's
            keywords it declares (``batch_size``, ``num_threads``, ``device_id``, ``seed``,
            ``enable_checkpointing``, ``checkpoint``, ``py_num_workers``, ``py_start_method``,
            ...) and returning a ``Pipeline``. Besides, it receives whichever of these it
            declares: ``shard_id`` and ``num_shards`` (this rank and the world size: give them
            to the reader), ``device`` (``"gpu"`` when the pipeline runs on a GPU, else
            ``"cpu"``: pick ``"mixed"``/``"gpu"`` operators from it) and, in external-source
            mode, ``source``: the per-sample callback to use as
            ``fn.external_source(source=source, batch=False, parallel=True, ...)``.
        output_map: names of the pipeline's outputs, in order.
        batch_size: samples per batch on each rank (the pipeline's ``batch_size``).
        reader_name: reader mode: the ``name`` of the pipeline's reader, which must shard with
            ``shard_id``/``num_shards`` and pad with ``pad_last_batch=True``.
        dataset: external-source mode: a map-style dataset whose items are what the source
            callback returns to DALI (numpy arrays, or a tuple of them; see ``FileSamples``).
        shuffle, sampler: external-source mode only: the sample order (as ``ResumableLoader``).
        last_batch: ``"keep"`` (default: a short last batch, no duplicates), ``"drop"`` or
            ``"pad"``. In reader mode these are DALI's ``PARTIAL``, ``DROP`` and ``FILL``
            (DALI pads by repeating a shard's last sample; ``DROP`` needs shards of one size).
        seed: keys the order and the pipeline seeds; defaults to ``$PL_GLOBAL_SEED``, else 0.
        trainer: the Lightning trainer (``self.trainer`` in ``train_dataloader``): the device is
            its ``strategy.root_device``.
        device: an explicit device instead; by default the trainer's, else ``cuda:LOCAL_RANK``
            when CUDA is available, else the CPU.
        rank, world_size: explicit placement; by default the process group's.
        num_threads: DALI CPU threads; ``py_num_workers``: processes running the source
            callback; ``py_start_method``: ``"fork"`` on CPU, ``"spawn"`` on GPU by default (a
            forked process cannot use CUDA once the parent has).
        batch_format: ``"dict"`` (``{name: tensor}``) or ``"tuple"`` (in ``output_map`` order).
        pipeline_kwargs: further ``Pipeline`` keywords (``prefetch_queue_depth``, ...).

    ``iter()`` is cheap; the pipeline is built at the first ``next()`` (in reader mode also by
    ``len()`` or ``state_dict()``, which need the reader's size). Under DDP, ``state_dict()``
    gathers every rank's DALI checkpoint, so every rank must call it together, as Lightning
    does; in Lightning's loops the ranks compare their plans at every epoch start, as
    ``ResumableLoader``'s do (in reader mode the order's length is the reader's epoch size), and
    refuse a difference. In external-source mode with ``py_start_method="spawn"`` the dataset
    must pickle.
    """

    def __init__(
        self,
        pipeline: Callable[..., Any],
        output_map: Sequence[str],
        *,
        batch_size: int,
        reader_name: str | None = None,
        dataset: Any = None,
        shuffle: bool | None = None,
        sampler: Any = None,
        last_batch: LastBatch = "keep",
        seed: int | None = None,
        trainer: Any = None,
        device: torch.device | str | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        num_threads: int = 2,
        py_num_workers: int = 1,
        py_start_method: Literal["fork", "spawn"] | None = None,
        batch_format: Literal["dict", "tuple"] = "dict",
        pipeline_kwargs: Mapping[str, Any] | None = None,
    ) -> None:
        import_dali()
        if (reader_name is None) == (dataset is None):
            raise ValueError("give exactly one of reader_name= (reader mode) and dataset= "
                             f"(external-source mode); got reader_name={reader_name!r} and "
                             f"dataset={type(dataset).__name__}")
        if reader_name is not None and (shuffle is not None or sampler is not None):
            raise ValueError("shuffle and sampler apply to external-source mode; in reader mode "
                             "the reader shuffles (its random_shuffle argument)")
        if sampler is not None and shuffle:
            raise ValueError("shuffle=True cannot be combined with a sampler")
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if last_batch not in _POLICIES:
            raise ValueError(f"last_batch must be one of {_POLICIES}, got {last_batch!r}")
        if batch_format not in ("dict", "tuple"):
            raise ValueError(f"batch_format must be 'dict' or 'tuple', got {batch_format!r}")
        if not output_map or len(set(output_map)) != len(output_map):
            raise ValueError(f"output_map needs distinct output names, got {list(output_map)}")
        if num_threads < 1 or py_num_workers < 0:
            raise ValueError(f"need num_threads >= 1 and py_num_workers >= 0, got {num_threads} "
                             f"and {py_num_workers}")
        self.pipeline = pipeline
        self.output_map = list(output_map)
        self.batch_size = batch_size
        self.reader_name = reader_name
        self.dataset = dataset
        self.last_batch: LastBatch = last_batch
        self.drop_last = last_batch == "drop"
        self.seed = resolve_seed(seed, None)
        self.trainer = trainer
        self.device = device
        self.num_threads = num_threads
        self.num_workers = py_num_workers
        self.py_start_method = py_start_method
        self.batch_format = batch_format
        self.pipeline_kwargs = dict(pipeline_kwargs or {})
        self._explicit_placement = (rank, world_size)
        self._schedule: MapSchedule | None = None
        if dataset is not None:
            if not hasattr(dataset, "__len__") or len(dataset) < 1:
                raise ValueError("dataset must be a non-empty map-style dataset (with __len__ "
                                 "and __getitem__)")
            self._schedule = self._make_schedule(self._order(sampler, bool(shuffle),
                                                             len(dataset)))
        self._pending_epoch: int | None = None  # reader mode: set_epoch before the schedule
        self._user_samplers = SamplerEpochs(sampler)
        self._restore: Restore | None = None
        self._closed: tuple[Placement, dict[str, Any]] | None = None  # the pipeline close() shut
        self._unread: tuple[Placement, dict[str, Any]] | None = None  # before the last batch
        self._engine = EngineBox()
        self._finalizer = weakref.finalize(self, self._engine.close)
        self.sampler = EpochSampler(weakref.proxy(self))
        self.batch_sampler: Any = None  # DataLoader's surface: Lightning's evaluation reads it

    # -- the DataLoader surface -------------------------------------------------------------

    def __repr__(self) -> str:
        """Says where the loader is without building the pipeline (which sizing would)."""
        mode = f"reader {self.reader_name!r}" if self.reader_name else "external source"
        rank, world_size = resolve_rank_world(*self._explicit_placement)
        epoch = self._schedule.epoch if self._schedule is not None else None
        return (f"{type(self).__name__}({mode}, batch_size={self.batch_size}, last_batch="
                f"{self.last_batch!r}, rank={rank}/{world_size}, seed={self.seed}, epoch="
                f"{'not started' if epoch is None else epoch})")

    @property
    def schedule(self) -> MapSchedule:  # type: ignore[override]  # built lazily: a property
        """The plan and cursor (in reader mode, sizing it builds the pipeline)."""
        if self._schedule is None:
            engine = self._build(self._placement(), None, None)
            schedule = self._make_schedule(SequentialOrder(engine.reader_meta["epoch_size"]))
            try:
                self._check_reader(engine, schedule)
            except Exception:
                engine.close()
                raise
            if self._pending_epoch is not None:
                schedule.set_epoch(self._pending_epoch)
            self._schedule, self._engine.engine = schedule, engine
            self._pending_epoch = None
        return self._schedule

    @property
    def epoch(self) -> int | None:
        """The epoch being delivered (``None`` before the first batch)."""
        return None if self._schedule is None else self._schedule.epoch

    def set_epoch(self, epoch: int) -> None:
        """Record the trainer's epoch; it takes effect at the next epoch start (a restored
        cursor wins over a stale epoch, a later one abandons the unfinished epoch: see
        ``MapSchedule``). Abandoning an epoch reads its tail past in reader mode (DALI cannot
        seek) and rebuilds the pipeline in external-source mode."""
        if self._schedule is None:
            if epoch < 0:
                raise ValueError(f"epoch must be >= 0, got {epoch}")
            self._pending_epoch = epoch
        else:
            self._schedule.set_epoch(epoch)

    def state_dict(self, unused: int = 0) -> dict[str, Any]:
        """The cursor plus, per rank, the DALI checkpoint of the pipeline (gathered under DDP).
        ``unused`` must be 0: a DALI checkpoint is where the pipeline's readers stand, and
        cannot leave out batches already taken from it."""
        if unused:
            raise ValueError(f"DALILoader.state_dict(unused={unused}): a DALI checkpoint is "
                             "where the pipeline's readers stand and cannot leave out batches "
                             "already taken from it")
        state = self.schedule.state_dict()
        if self._restore is None:
            rank, world_size = self.schedule.placement
            engine = self._engine.engine
            closed = self._closed[1] if self._closed is not None else None
            entries = gather_by_rank(engine.entry() if engine else closed, rank, world_size)
            state[PARTS] = {**state[PARTS], _STATE_KEY: entries}
        elif _STATE_KEY not in state[PARTS]:  # restored at an epoch's end, not read since
            state[PARTS] = {**state[PARTS], _STATE_KEY: self._restore.entries}
        return state

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a cursor; the next ``iter()`` continues exactly after its last batch. A
        state of another dataset or configuration is refused now, with both values shown, and
        changes nothing (in reader mode, checking it builds the pipeline, as ``len()`` does)."""
        entries = dict(state_dict.get(PARTS) or {}).get(_STATE_KEY)
        self.schedule.load_state_dict(state_dict)
        self._restore = Restore(int(state_dict["world_size"]), entries)
        self._closed = None

    def close(self) -> None:
        """Shut the pipeline (and its source worker processes) down now; it is rebuilt on
        demand, at the cursor, from its DALI checkpoint (so random operators go on as if it
        had never stopped), which the state saves meanwhile. Dropping the loader shuts it down
        too."""
        engine = self._engine.engine
        if engine is not None and engine.iterator is not None:
            self._closed = (engine.placement, engine.entry())
        self._engine.close()
        super().close()

    # -- epochs -----------------------------------------------------------------------------

    def _take_back(self) -> bool:
        """Also the pipeline, past the batch taken back: it is shut as it stood before it
        read that batch (``close()`` keeps that DALI checkpoint), so that it reads the same
        batch again, random operators included."""
        if not super()._take_back():
            return False
        self._engine.close()
        self._closed = self._unread
        return True

    def _open_epoch(self) -> Iterator[Any]:
        """Decide which epoch and batch come next, bring the pipeline there, deliver."""
        schedule = self.schedule
        restore = self._restore
        world_size = schedule.placement[1]
        if self.reader_name and restore is not None and restore.world_size != world_size:
            raise ValueError(
                f"reader mode cannot resume on another world size: saved {restore.world_size}, "
                f"now {world_size}. DALI checkpoints are per shard; use external-source mode "
                "(dataset=...) for elastic resume"
            )
        self._restore = None
        self._begin_map_epoch(schedule)
        if schedule.remaining == 0:
            # A restored cursor at its epoch's end that stays exhausted (the trainer is still
            # in that epoch, a CombinedLoader(mode="max_size") draining longer members): nothing
            # to read; the saved pipeline is restored when the next epoch starts.
            self._restore = restore
            return iter(())
        return self._deliver(self._seek(schedule, restore), schedule)

    def _reopen(self) -> Iterator[Any]:
        schedule = self.schedule
        return self._deliver(self._seek(schedule, None), schedule)

    def _seek(self, schedule: MapSchedule, restore: Restore | None) -> Engine:
        """A pipeline whose next batch is the schedule's next one."""
        assert schedule.epoch is not None
        target = (schedule.epoch, schedule.batches)
        placement = self._placement(fixed=schedule.placement)
        entry = restore.entry(placement) if restore is not None else self._closed_entry(placement)
        self._closed = None
        engine = self._engine.engine
        if engine is not None and engine.placement != placement:
            self._engine.close()
            engine = None
        if self.reader_name is None:
            # every epoch starts on a pipeline built for it, seeded from (seed, rank, epoch):
            # carried over from the last epoch, its random operators would depend on whether
            # this loader (or a fresh one, after a reload or a restart) read that epoch
            epoch_start = target[1] == 0
            if engine is None or engine.at != target or (epoch_start
                                                         and engine.built_at != target):
                self._engine.close()
                usable = (entry if entry is not None and entry.at == target and not epoch_start
                          else None)
                engine = self._build(placement, schedule, usable)
        else:
            if entry is not None and entry.at > target:
                entry = None
            if engine is None or engine.at > target or (entry is not None
                                                        and entry.at > engine.at):
                self._engine.close()
                engine = self._build(placement, schedule, entry)
            self._drain(engine, target, schedule.num_batches())
        self._engine.engine = engine
        return engine

    def _closed_entry(self, placement: Placement) -> Entry | None:
        """The checkpoint of the pipeline ``close()`` shut, if it was built for ``placement``."""
        if self._closed is None or self._closed[0] != placement:
            return None
        return Entry(self._closed[1])

    def _drain(self, engine: Engine, target: tuple[int, int], epoch_len: int) -> None:
        """Reader mode: read and discard batches up to ``target`` (DALI cannot seek)."""
        while engine.at < target:
            engine.next()
            engine.advance(last=engine.at[1] + 1 == epoch_len)

    def _deliver(self, engine: Engine, schedule: MapSchedule) -> Iterator[Any]:
        sizes: Iterator[int | None]
        if self.reader_name is None:
            sizes = batch_sizes(schedule)
        else:
            sizes = repeat(None, schedule.remaining)
        as_tuple = self.batch_format == "tuple"
        names = self.output_map
        for size in sizes:
            if engine.order_version != schedule.order_version:
                engine = self._rebuild_at_cursor(schedule)
            self._unread = (engine.placement, engine.entry())  # ~0.02 ms, for a take-back
            batch = engine.next()
            engine.advance(last=schedule.remaining == 1)
            if size is not None and size < self.batch_size:
                batch = {name: batch[name][:size] for name in names}
            schedule.delivered()
            yield tuple(batch[name] for name in names) if as_tuple else batch

    def _rebuild_at_cursor(self, schedule: MapSchedule) -> Engine:
        """External-source mode: the order changed mid-epoch (a re-weighted sampler), so the
        batches DALI prefetched are stale; start again at the cursor with the new order."""
        self._engine.close()
        engine = self._build(self._placement(fixed=schedule.placement), schedule, None)
        self._engine.engine = engine
        return engine

    # -- building ---------------------------------------------------------------------------

    def _placement(self, fixed: tuple[int, int] | None = None) -> Placement:
        rank, world_size = fixed or resolve_rank_world(*self._explicit_placement)
        device = resolve_device(self.trainer, self.device)
        if device.type == "cuda":
            index = device.index if device.index is not None else torch.cuda.current_device()
            return Placement(rank, world_size, index)
        if device.type != "cpu":
            raise ValueError(f"DALI runs on CPU or CUDA devices, got device {device}")
        return Placement(rank, world_size, None)

    def _build(self, placement: Placement, schedule: MapSchedule | None,
               entry: Entry | None) -> Engine:
        """Build the user's pipeline for ``placement``, fresh or from a checkpoint ``entry``."""
        _, dali_torch = import_dali()
        context: dict[str, Any] = {"shard_id": placement.rank,
                                   "num_shards": placement.world_size,
                                   "device": "cpu" if placement.device_id is None else "gpu"}
        if self.reader_name is None:
            assert schedule is not None and schedule.epoch is not None
            at = (schedule.epoch, schedule.batches)
            seed = entry.seed if entry else seed32(self.seed, placement.rank, *at) >> 1
            context["source"] = PlannedSource(self.dataset, schedule,
                                              entry.iteration if entry else 0)
        else:
            at = (0, 0)
            seed = seed32(self.seed, placement.rank) >> 1
        start = self.py_start_method or ("fork" if placement.device_id is None else "spawn")
        kwargs = {"batch_size": self.batch_size, "num_threads": self.num_threads,
                  "device_id": placement.device_id, "seed": seed, "enable_checkpointing": True,
                  "py_num_workers": self.num_workers, "py_start_method": start,
                  **self.pipeline_kwargs}
        if entry is not None:
            kwargs["checkpoint"] = entry.checkpoint
            at = entry.at
        pipe = call_pipeline(self.pipeline, kwargs, context)
        check_pipeline(pipe, self.batch_size)
        policy: dict[str, Any] = {}
        meta: dict[str, Any] = {}
        try:
            with frozen_heap():  # building forks the source's worker processes
                pipe.build()
            if self.reader_name is not None:
                meta = self._reader_meta(pipe, placement)
                policy = {"reader_name": self.reader_name,
                          "last_batch_policy": getattr(dali_torch.LastBatchPolicy,
                                                       _DALI_POLICY[self.last_batch])}
            iterator = dali_torch.DALIGenericIterator(pipe, self.output_map, auto_reset=False,
                                                      prepare_first_batch=False, **policy)
        except Exception:
            shutdown_pipeline(pipe)
            raise
        engine = Engine(pipe, iterator, placement, at, entry.iteration if entry else 0, seed,
                        reader=self.reader_name is not None)
        engine.reader_meta = meta
        if schedule is not None:
            engine.order_version = schedule.order_version
        if self.reader_name is not None and self._schedule is not None:
            try:
                self._check_reader(engine, self._schedule)
            except Exception:
                engine.close()
                raise
        return engine

    def _reader_meta(self, pipe: Any, placement: Placement) -> dict[str, Any]:
        try:
            meta = dict(pipe.reader_meta(self.reader_name))
        except Exception as exc:
            raise ValueError(f"the pipeline has no reader named {self.reader_name!r}: give the "
                             f"reader name={self.reader_name!r}") from exc
        if not meta.get("pad_last_batch"):
            raise ValueError(f"reader {self.reader_name!r} needs pad_last_batch=True: without it "
                             "ranks get different batch counts and epochs bleed into each other")
        shard = (meta["shard_id"], meta["number_of_shards"])
        if shard != (placement.rank, placement.world_size):
            raise ValueError(f"reader {self.reader_name!r} has shard_id={shard[0]}, num_shards="
                             f"{shard[1]} but this is rank {placement.rank} of "
                             f"{placement.world_size}: pass the shard_id and num_shards the "
                             "loader gives the pipeline function to the reader")
        return meta

    def _check_reader(self, engine: Engine, schedule: MapSchedule) -> None:
        """Reader mode: DALI's batch count must be the plan's, and no rank's batch empty."""
        n, shards = engine.reader_meta["epoch_size"], engine.reader_meta["number_of_shards"]
        planned = schedule.num_batches()
        if len(engine.iterator) != planned:
            raise RuntimeError(f"DALI's iterator has {len(engine.iterator)} batches per epoch, "
                               f"the plan {planned} ({n} samples, {shards} shards, batch_size "
                               f"{self.batch_size}, last_batch={self.last_batch!r})")
        if self.last_batch == "drop" and n % shards:
            raise ValueError(
                f"last_batch='drop' in reader mode needs shards of one size ({n} samples over "
                f"{shards} shards are not): DALI pads the shorter shards, never reads the padded "
                "tail it drops, and begins the next epoch inside it, so samples repeat and others "
                "are never read. Use last_batch='pad', or external-source mode (which plans the "
                "epoch itself)")
        if self.last_batch == "keep":
            sizes = [(i + 1) * n // shards - i * n // shards for i in range(shards)]
            short = [s for s in sizes if math.ceil(s / self.batch_size) < planned]
            if short:
                raise ValueError(
                    f"last_batch='keep' in reader mode would give a shard of {short[0]} samples "
                    f"an empty batch {planned} ({n} samples over {shards} shards, batch_size "
                    f"{self.batch_size}): use last_batch='pad' or 'drop', another batch_size, "
                    "or external-source mode (which balances the last batch over ranks)"
                )

    def _make_schedule(self, order: SampleOrder) -> MapSchedule:
        mode = f"reader:{self.reader_name}" if self.reader_name else "external_source"
        return _DaliSchedule(order, self.batch_size, self.last_batch, self.seed,
                             *self._explicit_placement, mode=mode)

    def _order(self, sampler: Any, shuffle: bool, n: int) -> SampleOrder:
        if sampler is not None:
            return order_from_sampler(sampler, n, self.seed)
        return ShuffledOrder(n, self.seed) if shuffle else SequentialOrder(n)


class _DaliSchedule(MapSchedule):
    """``MapSchedule`` whose fingerprint also names the DALI mode (and reader)."""

    def __init__(self, *args: Any, mode: str, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        self.mode = mode

    def fingerprint(self) -> dict[str, Any]:
        return {**super().fingerprint(), "dali": self.mode}
