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

import numpy as np
import torch
from torch.utils.data import BatchSampler, DataLoader, IterableDataset, Sampler, get_worker_info

from lightning_loaders._fetch import BatchFetcher, BatchRequest
from lightning_loaders._hashing import mix64
from lightning_loaders.context import WorkerInfo, _set_worker
from lightning_loaders.distributed import resolve_rank_world
from lightning_loaders.order import SampleOrder, SequentialOrder, ShuffledOrder
from lightning_loaders.plan import LAST_BATCH_POLICIES, EpochPlan, LastBatch, rollover_span
from lightning_loaders.samplers import order_from_sampler
from lightning_loaders.state import LoaderState

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
        self.last_batch: LastBatch = _resolve_last_batch(last_batch, drop_last)
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
        self._dataset_len = len(dataset)
        if self._dataset_len < 1:
            raise ValueError("the dataset is empty")
        self.order = self._make_order(sampler, bool(shuffle))
        self._explicit_placement = (rank, world_size)
        self.sampler = _EpochSampler(self)
        # The cursor: the epoch being delivered and the batches delivered in it.
        self._placement: tuple[int, int] | None = None
        self._epoch: int | None = None
        self._batches = 0
        self._offset_batches = 0
        self._plan: EpochPlan | None = None
        self._pending: LoaderState | None = None
        self._requested_epoch: int | None = None
        self._iter_token = 0
        self._torch_loader: DataLoader[Any] | None = None

    # -- the DataLoader surface -------------------------------------------------------------

    def __iter__(self) -> Iterator[Any]:
        """A new iterator. Cheap: the epoch and the workers start at its first ``next()``."""
        self._iter_token += 1
        return _LoaderIterator(self, self._iter_token)

    def __len__(self) -> int:
        """Batches per epoch on this rank (equal on every rank)."""
        if self.last_batch == "rollover":
            raise TypeError("len() is undefined with last_batch='rollover': epochs differ in "
                            "length by one batch as leftovers roll over")
        _, world_size = self._current_placement()
        return self._plan_for(0, world_size).num_batches

    def __repr__(self) -> str:
        rank, world_size = self._current_placement()
        epoch = "not started" if self._epoch is None else self._epoch
        return (f"{type(self).__name__}(dataset={type(self.dataset).__name__}(len="
                f"{self._dataset_len}), batch_size={self.batch_size}, order="
                f"{self.order.fingerprint}, last_batch={self.last_batch!r}, num_workers="
                f"{self.num_workers}, rank={rank}/{world_size}, seed={self.seed}, epoch={epoch}, "
                f"batches={self._batches})")

    @property
    def epoch(self) -> int | None:
        """The epoch being delivered (``None`` before the first batch)."""
        return self._epoch

    def set_epoch(self, epoch: int) -> None:
        """Ask for ``epoch`` at the next epoch start.

        A restored cursor wins over an earlier or equal epoch (Lightning may call this with a
        stale epoch on restart); a later epoch abandons the cursor's unfinished epoch.
        """
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        if self._epoch == epoch and self._pending is None and self._requested_epoch is None:
            return
        self._requested_epoch = epoch

    # -- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The cursor as a small plain dict (O(1) in dataset length and worker count)."""
        if self._pending is not None:
            return self._pending.to_dict()
        _, world_size = self._current_placement()
        requested = self._requested_epoch
        if self._epoch is None or (requested is not None and requested > self._epoch):
            state = LoaderState(requested or 0, 0, world_size, fingerprint=self._fingerprint())
        else:
            assert self._placement is not None
            state = LoaderState(self._epoch, self._batches, self._placement[1],
                                self._offset_position(), self._offset_batches,
                                fingerprint=self._fingerprint())
        return state.to_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a cursor; the next ``iter()`` continues exactly after its last batch."""
        self._pending = LoaderState.from_dict(state_dict, self._fingerprint())

    def close(self) -> None:
        """Shut the worker processes down now (they also stop when the loader is collected)."""
        loader, self._torch_loader = self._torch_loader, None
        iterator = getattr(loader, "_iterator", None)
        if iterator is not None and hasattr(iterator, "_shutdown_workers"):
            iterator._shutdown_workers()

    # -- epochs -----------------------------------------------------------------------------

    def _begin_epoch(self) -> Iterator[Any]:
        """Decide which epoch and batch come next, then start delivering from there."""
        rank, world_size = self._placement = self._current_placement()
        pending, requested = self._pending, self._requested_epoch
        self._pending = self._requested_epoch = None
        if pending is not None and (requested is None or requested <= pending.epoch):
            self._resume(pending, world_size)
        else:
            if requested is not None:
                epoch = requested
            else:
                epoch = 0 if self._epoch is None else self._epoch + 1
            self._start(epoch, 0, 0, world_size)
        assert self._plan is not None
        if self._batches - self._offset_batches >= self._plan.num_batches:
            assert self._epoch is not None
            self._start(self._epoch + 1, 0, 0, world_size)
        return iter(self._workers())

    def _start(self, epoch: int, batches: int, offset_batches: int, world_size: int,
               offset_position: int = 0) -> None:
        self._epoch, self._batches, self._offset_batches = epoch, batches, offset_batches
        self._plan = self._plan_for(epoch, world_size, offset_position)

    def _resume(self, state: LoaderState, world_size: int) -> None:
        if state.world_size == world_size:
            self._start(state.epoch, state.batches, state.offset_batches, world_size,
                        state.offset_position)
            return
        if self.last_batch == "rollover":
            raise ValueError(f"cannot resume last_batch='rollover' with another world size: "
                             f"saved {state.world_size}, now {world_size}")
        saved = self._plan_for(state.epoch, state.world_size, state.offset_position)
        position = saved.consumed(state.batches - state.offset_batches)
        self._start(state.epoch, state.batches, state.batches, world_size, position)
        assert self._plan is not None
        full_epoch = self._plan_for(state.epoch, world_size).num_batches
        if state.batches + self._plan.num_batches > full_epoch:
            warnings.warn(
                f"elastic resume from world size {state.world_size} to {world_size} after "
                f"{state.batches} batches leaves {self._plan.num_batches} batches in this epoch, "
                f"past len()={full_epoch}: a trainer that stops at len() (Lightning does) would "
                "skip the last ones. Resume at an epoch end, or on fewer ranks.",
                stacklevel=3,
            )

    def _plan_for(self, epoch: int, world_size: int, offset_position: int = 0) -> EpochPlan:
        if self.last_batch == "rollover":
            start, stop = rollover_span(epoch, self._dataset_len, self.batch_size * world_size)
            return EpochPlan(start, stop, self.batch_size, world_size, "drop")
        plan = EpochPlan(offset_position, self._dataset_len, self.batch_size, world_size,
                         self.last_batch)
        if offset_position == 0 and plan.num_batches == 0:
            raise ValueError(
                f"last_batch='drop' leaves no batch: {self._dataset_len} samples are fewer than "
                f"one global batch of {world_size} ranks x batch_size {self.batch_size}; use a "
                "smaller batch_size or last_batch='keep'/'pad'"
            )
        return plan

    def _offset_position(self) -> int:
        assert self._plan is not None
        return 0 if self.last_batch == "rollover" else self._plan.start

    def _requests(self) -> Iterator[BatchRequest]:
        """This rank's remaining batch requests of the current epoch, from the cursor on."""
        assert self._plan is not None and self._epoch is not None
        return _batch_requests(self._plan, self._epoch, self._batches, self._offset_batches,
                               self._current_placement()[0], self.order,
                               self._dataset_len if self.last_batch == "rollover" else None)

    def _workers(self) -> DataLoader[Any]:
        """torch's DataLoader over our batch requests (created once, workers persistent)."""
        if self._torch_loader is None:
            rank, world_size = self._current_placement()
            extra: dict[str, Any] = {}
            if self.num_workers > 0:
                extra = {"prefetch_factor": self.prefetch_factor,
                         "persistent_workers": self.persistent_workers}
            if self.pin_memory_device:
                extra["pin_memory_device"] = self.pin_memory_device
            self._torch_loader = DataLoader(
                BatchFetcher(self.dataset, self.collate_fn, self.seed),
                batch_size=None,
                sampler=_RequestSampler(self),
                num_workers=self.num_workers,
                collate_fn=_passthrough,
                pin_memory=self.pin_memory,
                timeout=self.timeout,
                worker_init_fn=_WorkerStart(self.worker_init_fn, self.num_workers, rank,
                                            world_size, self._epoch or 0, self.seed),
                multiprocessing_context=self.multiprocessing_context,
                generator=torch.Generator().manual_seed(mix64(self.seed, rank) >> 1),
                **extra,
            )
        return self._torch_loader

    # -- configuration ----------------------------------------------------------------------

    def _current_placement(self) -> tuple[int, int]:
        if self._placement is not None:
            return self._placement
        return resolve_rank_world(*self._explicit_placement)

    def _make_order(self, sampler: Any, shuffle: bool) -> SampleOrder:
        if sampler is not None:
            return order_from_sampler(sampler, self._dataset_len, self.seed)
        if shuffle:
            return ShuffledOrder(self._dataset_len, self.seed)
        return SequentialOrder(self._dataset_len)

    def _fingerprint(self) -> dict[str, Any]:
        return {"dataset_len": self._dataset_len, "seed": self.seed,
                "batch_size": self.batch_size, "last_batch": self.last_batch,
                "order": self.order.fingerprint}


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
        loader._batches += 1
        return batch


class _LoaderView:
    """Holds its loader weakly: no reference cycle, so a dropped loader (and its workers) goes
    at once, not at a later garbage collection that a forked worker could run on its copy."""

    def __init__(self, loader: ResumableLoader) -> None:
        self._loader_ref = weakref.ref(loader)

    @property
    def _loader(self) -> ResumableLoader:
        loader = self._loader_ref()
        if loader is None:
            raise RuntimeError("the ResumableLoader behind this object was garbage-collected")
        return loader


class _EpochSampler(_LoaderView):
    """What Lightning sees as ``loader.sampler``: forwards ``set_epoch`` to the loader."""

    def set_epoch(self, epoch: int) -> None:
        self._loader.set_epoch(epoch)

    def __len__(self) -> int:
        """Samples this rank reads per epoch."""
        loader = self._loader
        rank, world_size = loader._current_placement()
        plan = loader._plan_for(0, world_size)
        return sum(len(plan.positions(b, rank)) for b in range(plan.num_batches))


class _RequestSampler(_LoaderView, Sampler[BatchRequest]):
    """The internal DataLoader's sampler: re-reads the cursor at every ``iter()``."""

    def __iter__(self) -> Iterator[BatchRequest]:
        return self._loader._requests()

    def __len__(self) -> int:
        loader = self._loader
        assert loader._plan is not None
        return loader._plan.num_batches - (loader._batches - loader._offset_batches)


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


def _batch_requests(plan: EpochPlan, epoch: int, batches: int, offset_batches: int, rank: int,
                    order: SampleOrder, stream_epoch_len: int | None) -> Iterator[BatchRequest]:
    """Requests for batches ``batches..`` of ``plan`` (a free function: the generator must not
    keep the loader alive). ``stream_epoch_len`` is set when positions are rollover stream
    positions, which span the permutations of two epochs."""
    for batch in range(batches - offset_batches, plan.num_batches):
        positions = plan.positions(batch, rank)
        if stream_epoch_len is None:
            sample_epochs = np.full_like(positions, epoch)
            indices = order.indices(epoch, positions)
        else:
            sample_epochs, positions = np.divmod(positions, stream_epoch_len)
            indices = np.empty_like(positions)
            for sample_epoch in np.unique(sample_epochs):
                mask = sample_epochs == sample_epoch
                indices[mask] = order.indices(int(sample_epoch), positions[mask])
        yield BatchRequest(epoch, offset_batches + batch, rank, sample_epochs, positions, indices)


def _passthrough(batch: Any) -> Any:
    return batch


def _resolve_last_batch(last_batch: str | None, drop_last: bool) -> LastBatch:
    if last_batch is None:
        return "drop" if drop_last else "keep"
    if last_batch not in LAST_BATCH_POLICIES:
        raise ValueError(f"last_batch must be one of {LAST_BATCH_POLICIES}, got {last_batch!r}")
    if drop_last and last_batch != "drop":
        raise ValueError(f"drop_last=True contradicts last_batch={last_batch!r}; give one of them")
    return last_batch  # type: ignore[return-value]


def _resolve_seed(seed: int | None, generator: torch.Generator | None) -> int:
    if seed is not None:
        return int(seed)
    if generator is not None:
        return int(generator.initial_seed())
    return int(os.environ.get("PL_GLOBAL_SEED", 0))
