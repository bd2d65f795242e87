"""``ResumableLoader``: the one public loader signature (``DataLoader``'s arguments plus ours),
and the choice of the loader for a dataset.

``ResumableLoader(dataset, ...)`` returns a ``MapStyleLoader`` for a map-style dataset and a
``ResumableIterableLoader`` for an iterable one; both are ``ResumableLoader``s, so
``isinstance``, ``make_resumable`` and the data module treat them alike. Each is a configuration
of a schedule and an engine, built from the same ``LoaderOptions``.
"""

from __future__ import annotations

import inspect
from collections.abc import Callable, Iterable
from types import GenericAlias
from typing import Any, Literal

import torch
from torch.utils.data import BatchSampler, IterableDataset, Sampler

from lightning_loaders.engines.autotune import AutotuneConfig
from lightning_loaders.engines.faults import OnError
from lightning_loaders.loaders.options import LoaderOptions
from lightning_loaders.loaders.out_of_order import DeliveredWindow
from lightning_loaders.loaders.worker_loader import WorkerLoader
from lightning_loaders.orders.base import SampleOrder
from lightning_loaders.schedule.map_plan import LastBatch

__all__ = ["ResumableLoader"]


class _InitSignature:
    """What ``inspect.signature`` (so ``help()`` and IDEs) shows for a loader class: its
    ``__init__``'s parameters, which ``__new__``'s ``(dataset=None, *args, **kwargs)`` would
    hide; a subclass's own ``__init__`` where it has one."""

    def __get__(self, instance: object, owner: type[Any]) -> inspect.Signature:
        init = inspect.signature(owner.__init__)
        return init.replace(parameters=list(init.parameters.values())[1:])  # less self


class ResumableLoader(WorkerLoader):
    """A deterministic, distributed, exactly resumable ``torch.utils.data.DataLoader``.

    Takes ``DataLoader``'s keyword arguments, plus:

    Args:
        seed: keys every shuffle; defaults to the seed that orders the ``sampler`` in torch
            (its generator's initial seed, a ``DistributedSampler``'s ``seed``), else
            ``generator.initial_seed()`` when a generator is given, else ``$PL_GLOBAL_SEED``
            (set by ``seed_everything``), else 0.
        last_batch: ``"keep"`` (default), ``"drop"`` (what ``drop_last=True`` means), ``"pad"``
            (wrap around to fill the last global batch) or ``"rollover"`` (leftovers open the
            next epoch). With a batch sampler's batches of different sizes, it says what
            becomes of the last batches, fewer than the ranks: their samples split evenly,
            dropped, or the ranks without one given a batch from the epoch's start
            (``"rollover"`` needs batches of one size).
        rank, world_size: explicit placement; by default resolved at the first ``next()`` from
            the process group or the ``RANK``/``WORLD_SIZE`` environment.
        on_error: ``"raise"`` (default): an exception in ``__getitem__``, a transform or
            ``collate_fn`` is re-raised in the main process as ``SampleFetchError`` naming the
            sample (dataset index and epoch position), batch, epoch, worker and rank, chained to
            the original exception (with the worker's traceback). ``"skip"``: a sample whose
            fetch raises is left out of its batch (which is then shorter; a batch with no sample
            left is not delivered, or raises on more than one rank, which would otherwise wait
            for it) and recorded in ``skipped``. Skipping is deterministic when
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
        shuffle_buffer, sync_interval, partitions: for iterable datasets
            (``ResumableIterableLoader``, which an iterable dataset gets); a map-style dataset
            refuses them.
        num_workers: as in ``DataLoader``, or ``"auto"`` (or an ``AutotuneConfig``): start in
            the main process and, while the caller waits for data, try more workers (up to
            the usable CPUs) and deeper prefetch, keeping what makes delivery faster
            (``lightning_loaders.engines.autotune`` has the rule). The order never depends on
            them, so tuning changes speed, never data or ``state_dict()``. ``num_workers``
            and ``prefetch_factor`` then read the current setting and ``autotune`` reports
            the trials. Iterable datasets need known shard lengths (canonical partitions).
        compare_ranks: whether the ranks of a process group compare their plans at every
            epoch start (a map-style order's seed, length, batches and first indices; a plain
            ``IterableDataset``'s ``len()`` and first samples), one small ``all_reduce`` that
            refuses plans that differ, which would repeat and lose samples silently. ``None``
            (default): in Lightning's loops only (an iterator its data fetcher made, on the
            main thread), since a loop of your own may run on one rank alone (rank-zero
            evaluation, ``prepare_data``: the collective would wait forever) or in a thread
            beside DDP's collectives (it would pair with theirs). ``True``: at every epoch
            start of any loop, for one that every rank runs alike on its main thread (a Fabric
            or torchrun training loop). ``False``: never.
        snapshot_every_n_steps: accepted for ``torchdata``'s ``StatefulDataLoader`` code and
            ignored: the state is exact at every step, and costs nothing to take.
        backend: what the ``num_workers`` workers are. ``"process"`` (default): worker
            processes, sending batches through shared-memory rings. ``"thread"``: threads of
            this process, with nothing pickled or sent between processes; they run in parallel
            where fetching releases the GIL (PIL, numpy, torch ops, file reads). ``"auto"``:
            threads first; the first ``2 * num_workers`` fetches run one at a time (each
            batch's crossing from a process estimated meanwhile), the next ``2 * num_workers``
            with every thread busy (no fetches alone under ``num_workers="auto"``, which
            timed them in the main process; processes are taken after the first busy round
            where they lead by ``engines.threads.EARLY_LEAD``); threads are kept where they
            mostly waited (I/O) or beat what processes could reach, a batch every ``fetch /
            min(num_workers, cores) + crossing`` (``engines.threads.choose_backend``), else
            the loader switches to processes at the next batch, from the cursor (a dataset
            that cannot be pickled stays on threads; with a ``worker_init_fn`` or a plain
            ``IterableDataset`` or a source that is not ``rng_free``, whose per-worker state
            threads would share, it takes processes at once); ``backend_in_use`` says which
            runs. The stream, ``sample_rng()`` and the state are the same for every backend
            (a state saved under one resumes under another). Under threads,
            ``worker_info()`` is the thread's and ``torch.utils.data.get_worker_info()`` is
            ``None`` (as in the main process); the global ``random``/numpy/torch RNGs are
            shared and left unseeded (draw per-sample randomness from ``sample_rng()``);
            errors, ``timeout`` and ``on_error`` behave as with processes; a thread cannot be
            killed, so crash recovery does not arise, and a stalled thread is left to finish
            its fetch.

    ``batch_size=None`` loads unbatched, as in ``DataLoader``: each sampled index gives one
    sample (``collate_fn`` defaults to ``default_convert``); a sampler that yields lists of
    indices gives ``dataset[list]`` (bulk loading), one that yields tuples ``dataset[tuple]``
    (each tuple one key); an iterable dataset's items come as they are (ready-made batches).
    ``batch_sampler`` may be any iterable of index lists, of any sizes (bucketing by length,
    token budgets): each batch is read whole by one rank, and ``len()`` is that of the epoch
    being read or about to start, whose number of batches may change from epoch to epoch
    (under Lightning, pass ``reload_dataloaders_every_n_epochs=1`` so that it reads ``len()``
    at every epoch). ``in_order=False`` delivers batches as
    workers finish them (one slow sample no longer stalls the others) and stays exactly
    resumable: the state records which batches past the first undelivered one were already
    delivered, and a resume delivers exactly the others (for an iterable dataset, when it is
    planned over canonical partitions; others warn and stay in order).

    ``timeout`` raises ``WorkerTimeoutError`` naming the worker whose batch is late. Workers
    stop on ``close()`` (also used as ``with loader:``), when the loader is collected, and when
    a Lightning ``Trainer`` tears its loop down (end of ``fit``, an exception, Ctrl-C,
    SIGTERM).

    Unlike ``DataLoader``, workers are persistent between epochs unless
    ``persistent_workers=False``. In-memory
    data (tensors, numeric arrays, ``TensorDataset`` and the like, with the default collate) is
    gathered a whole batch at a time in the main process whatever ``num_workers`` is, unless a
    ``worker_init_fn`` or ``pin_memory`` asks for workers: no user code runs per sample, and a
    batch sent from a worker process would cost more than gathering it.
    """

    __signature__ = _InitSignature()

    def __new__(cls, dataset: Any = None, *args: Any, **kwargs: Any) -> Any:
        """Pick the loader for ``dataset``: ``ResumableIterableLoader`` for an iterable
        dataset, ``MapStyleLoader`` otherwise. A subclass of one of them is kept; a subclass
        of ``ResumableLoader`` itself (``class MyLoader(ResumableLoader)``, as code subclasses
        ``DataLoader``) is combined with the one the dataset needs (``_with_loader``)."""
        from lightning_loaders.loaders.iterable import ResumableIterableLoader
        from lightning_loaders.loaders.map_style import MapStyleLoader

        if not issubclass(cls, MapStyleLoader | ResumableIterableLoader):
            iterable = isinstance(dataset, IterableDataset)
            loader = ResumableIterableLoader if iterable else MapStyleLoader
            cls = loader if cls is ResumableLoader else _with_loader(cls, loader)
        return super().__new__(cls)

    def __init__(
        self,
        dataset: Any,
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler[Any] | SampleOrder | None = None,
        batch_sampler: BatchSampler | Iterable[list[int]] | None = None,
        num_workers: int | Literal["auto"] | AutotuneConfig = 0,
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
        partitions: int | None = None,
        snapshot_every_n_steps: int | None = None,
        backend: str = "process",
        compare_ranks: bool | None = None,
    ) -> None:
        self._configure(dataset, LoaderOptions(
            batch_size=batch_size, shuffle=shuffle, sampler=sampler, batch_sampler=batch_sampler,
            num_workers=num_workers, collate_fn=collate_fn, pin_memory=pin_memory,
            drop_last=drop_last, timeout=timeout, worker_init_fn=worker_init_fn,
            multiprocessing_context=multiprocessing_context, generator=generator,
            prefetch_factor=prefetch_factor, persistent_workers=persistent_workers,
            pin_memory_device=pin_memory_device, in_order=in_order, seed=seed,
            last_batch=last_batch, rank=rank, world_size=world_size, on_error=on_error,
            max_worker_restarts=max_worker_restarts, evaluation=evaluation,
            shuffle_buffer=shuffle_buffer, sync_interval=sync_interval, partitions=partitions,
            snapshot_every_n_steps=snapshot_every_n_steps, backend=backend,
            compare_ranks=compare_ranks))
        self._initialized = True

    def __class_getitem__(cls, item: Any) -> GenericAlias:
        """``ResumableLoader[T]`` in annotations, as ``DataLoader[T]``."""
        return GenericAlias(cls, item)

    def _configure(self, dataset: Any, options: LoaderOptions) -> None:
        """Check ``options`` for this kind of dataset and build the schedule and engine (and
        ``_window``)."""
        raise NotImplementedError

    _window: DeliveredWindow
    """The batches of the epoch delivered past the frontier (``in_order=False``)."""

    def resume_batch(self) -> int | None:
        """``DeliveryCore.resume_batch``, past the batches an out-of-order state had
        delivered beyond its frontier: they are not delivered again."""
        batch = super().resume_batch()
        return None if batch is None else batch + self._window.pending_ahead()

    def _begin_handing(self) -> None:
        super()._begin_handing()
        self._window.handing()

    def _take_back(self) -> bool:
        """Also the window's count: a batch delivered past the frontier (``in_order=False``)
        counted there alone, and one at it moved the frontier over the ahead batches that
        followed it."""
        window = self._window.take_back()
        return super()._take_back() or window


_COMBINED: dict[tuple[type[Any], type[Any]], type[Any]] = {}


def _with_loader(subclass: type[ResumableLoader], loader: type[ResumableLoader]) -> type[Any]:
    """``subclass`` (of ``ResumableLoader``) on top of the concrete ``loader`` (made once per
    pair): its methods first, then the loader's. Named as ``subclass``; pickled and copied
    through ``_rebuilt``, since its name finds ``subclass`` alone."""
    combined = _COMBINED.get((subclass, loader))
    if combined is None:
        combined = _COMBINED[(subclass, loader)] = type(subclass.__name__, (subclass, loader), {
            "__module__": subclass.__module__, "__qualname__": subclass.__qualname__,
            "__reduce_ex__": _reduce_combined})
    return combined


def _reduce_combined(self: ResumableLoader, protocol: Any) -> tuple[Any, ...]:
    """Pickle a combined loader by its two bases: the combined class is made at run time, so
    no importable name leads to it."""
    subclass, loader = type(self).__bases__
    return _rebuilt, (subclass, loader), self.__getstate__()


def _rebuilt(subclass: type[ResumableLoader], loader: type[ResumableLoader]) -> Any:
    """An empty instance of ``_with_loader(subclass, loader)`` (its state is set next)."""
    return object.__new__(_with_loader(subclass, loader))
