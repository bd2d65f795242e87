"""``FFCVLoader``: an FFCV ``.beton`` file as a distributed, exactly resumable Lightning loader.

FFCV decodes; the order is ours. ``MapSchedule`` plans every epoch from the seed (shuffle,
sharding by global rank, last-batch policy) and counts delivered batches; at each epoch start the
FFCV ``Loader`` is handed this rank's remaining planned indices as its traversal order. Compared
with a raw ``ffcv.loader.Loader`` under Lightning:

- no process group is needed: the FFCV loader is built at the first ``next()`` and sharding is
  done by our plan (equal batch counts on every rank), not by ``distributed=True``; in
  Lightning's DDP loops the ranks compare their plans at every epoch start (a seed, a
  ``.beton`` length or ``indices`` per rank is refused), as ``ResumableLoader``'s do;
- ``iter()`` is free: Lightning's extra ``iter()`` no longer burns epoch 0, and ``set_epoch`` is
  honoured as in the core loader;
- ``state_dict()``/``load_state_dict()`` resume mid-epoch exactly (the rest of the epoch is
  sliced from the plan, nothing is replayed), also on another world size;
- the last batch is kept by default (``drop_last=False``); batches own their memory unless
  ``copy=False``; ``ToDevice`` targets the trainer's ``strategy.root_device``.

``ffcv`` is an optional dependency, imported when a loader is created (not with this module).
"""

from __future__ import annotations

import hashlib
import queue
import time
from collections.abc import Iterator, Mapping, Sequence
from enum import Enum
from pathlib import Path
from types import ModuleType
from typing import Any, NamedTuple

import numpy as np
import torch

from lightning_loaders.loaders.delivery import DeliveryCore, SizedEpochSampler, counted
from lightning_loaders.orders.base import SampleOrder, SequentialOrder, ShuffledOrder
from lightning_loaders.placement import resolve_device
from lightning_loaders.schedule.map_plan import LastBatch
from lightning_loaders.schedule.map_schedule import MapSchedule, resolve_last_batch, resolve_seed
from lightning_loaders.schedule.requests import BatchRequest

__all__ = ["FFCV_INSTALL_HINT", "FFCVLoader", "require_ffcv"]

FFCV_INSTALL_HINT = (
    "the FFCV adapter needs the optional dependency ffcv: `pip install "
    "'lightning-loaders[ffcv]'`. ffcv compiles against system libraries; install them first, "
    "e.g. `apt-get install libturbojpeg0-dev libopencv-dev pkg-config` on Debian/Ubuntu "
    "(or `conda install -c conda-forge libjpeg-turbo opencv pkg-config`)"
)

_STOP_TIMEOUT_S = 30.0
_NUMPY_DTYPES = frozenset({torch.uint8, torch.int8, torch.int16, torch.int32, torch.int64,
                           torch.float16, torch.float32, torch.float64, torch.bool})


def require_ffcv() -> ModuleType:
    """Import ``ffcv`` (and the parts this package uses), or fail with the install hint."""
    try:
        import ffcv
        import ffcv.fields  # noqa: F401 (imported to check it loads)
        import ffcv.loader  # noqa: F401 (imported to check it loads)
        import ffcv.transforms  # noqa: F401 (imported to check it loads)
        import ffcv.types  # noqa: F401 (imported to check it loads)
    except (ImportError, OSError) as exc:
        raise ImportError(f"{FFCV_INSTALL_HINT}. (import failed: {exc})") from exc
    return ffcv


class _BetonHeader(NamedTuple):
    num_samples: int
    field_names: tuple[str, ...]


def _read_header(fname: str) -> _BetonHeader:
    """Sample count and field names of a ``.beton`` (reads only its first few hundred bytes)."""
    require_ffcv()
    from ffcv.types import CURRENT_VERSION, FieldDescType, HeaderType
    from ffcv.utils import decode_null_terminated_string

    path = Path(fname)
    if not path.is_file():
        raise FileNotFoundError(f"no .beton file at {fname}")
    if path.stat().st_size < HeaderType.itemsize:
        raise ValueError(f"{fname} is not a .beton file: {path.stat().st_size} bytes is shorter "
                         f"than its {HeaderType.itemsize}-byte header")
    header = np.fromfile(fname, dtype=HeaderType, count=1)[0]
    if header["version"] != CURRENT_VERSION:
        raise ValueError(f"{fname}: .beton format version {header['version']}, this ffcv reads "
                         f"version {CURRENT_VERSION}")
    fields = np.fromfile(fname, dtype=FieldDescType, count=int(header["num_fields"]),
                         offset=HeaderType.itemsize)
    names = tuple(decode_null_terminated_string(name) for name in fields["name"])
    return _BetonHeader(int(header["num_samples"]), names)


class _SubsetOrder:
    """An order over positions of ``subset``, mapped to the file's sample indices."""

    def __init__(self, base: SampleOrder, subset: np.ndarray) -> None:
        self.base = base
        self.subset = subset
        digest = hashlib.sha1(subset.tobytes()).hexdigest()[:16]
        self._fingerprint = f"{base.fingerprint}|subset:{len(subset)}:{digest}"

    def __len__(self) -> int:
        return len(self.subset)

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        return self.subset[self.base.indices(epoch, positions)]

    @property
    def fingerprint(self) -> str:
        return self._fingerprint


class _PlannedTraversal:
    """Stands in for FFCV's ``TraversalOrder``: every epoch, the order we planned for it.

    FFCV 1.0.2's constructor rejects ``TraversalOrder`` subclasses (``isinstance`` on a class),
    so this is set as ``loader.traversal_order`` after construction. It ignores FFCV's epoch
    counter: the epoch is ours.
    """

    def __init__(self) -> None:
        self.order = np.empty(0, dtype=np.uint64)

    def sample_order(self, epoch: int) -> np.ndarray:
        return self.order


class _Cut(NamedTuple):
    """One planned batch in FFCV's stream: its size, and whether FFCV read it padded."""

    size: int
    padded: bool


def _ffcv_epoch(requests: Sequence[BatchRequest], batch_size: int
                ) -> tuple[np.ndarray, list[_Cut]]:
    """FFCV traversal order giving exactly the planned batches, and how to cut its output.

    FFCV cuts its order into chunks of ``batch_size``. Planned batches are full except the last
    one and, when a short last global batch is rebalanced over ranks, the one before it; a
    short batch that is not the last is padded with repeats of its first index so the next
    batch starts on a chunk boundary, and the padding rows are sliced off on delivery.
    """
    parts: list[np.ndarray] = []
    cuts: list[_Cut] = []
    last = len(requests) - 1
    for k, request in enumerate(requests):
        size = len(request.indices)
        if not 0 < size <= batch_size:
            raise AssertionError(f"planned batch of {size} samples, batch_size {batch_size}")
        parts.append(request.indices)
        pad = batch_size - size if k < last else 0
        if pad:
            parts.append(np.full(pad, request.indices[0], dtype=request.indices.dtype))
        cuts.append(_Cut(size, pad > 0))
    order = np.concatenate(parts).astype(np.uint64) if parts else np.empty(0, np.uint64)
    return order, cuts


def _own(value: Any) -> Any:
    """A copy of an output that FFCV will overwrite (it reuses its buffers in a ring).

    CPU tensors are copied through numpy, single-threaded, keeping their memory layout:
    torch's multi-threaded ``clone()`` contends with FFCV's decoding threads running at the
    same time and can take milliseconds for a small batch.
    """
    if isinstance(value, torch.Tensor):
        if value.device.type == "cpu" and value.dtype in _NUMPY_DTYPES:
            return torch.from_numpy(value.numpy().copy(order="K"))
        return value.clone()
    if isinstance(value, np.ndarray):
        return value.copy()
    return value


def _deliver(epoch_iter: Iterator[tuple[Any, ...]], cuts: list[_Cut], copy: bool
             ) -> Iterator[tuple[Any, ...]]:
    """FFCV's batches, cut to the plan (a free function: it must not keep the loader alive)."""
    for cut in cuts:
        outputs = next(epoch_iter)
        if cut.padded:
            outputs = tuple(value[:cut.size] for value in outputs)
        yield tuple(_own(value) for value in outputs) if copy else outputs


def _stop(epoch_iter: Any) -> None:
    """Stop an FFCV epoch thread and wait for it (drain its queue: it may block on a put)."""
    epoch_iter.close()
    deadline = time.monotonic() + _STOP_TIMEOUT_S
    while epoch_iter.is_alive() and time.monotonic() < deadline:
        try:
            while True:
                epoch_iter.output_queue.get_nowait()
        except queue.Empty:
            pass
        epoch_iter.join(0.05)


def _device_pipelines(pipelines: Mapping[str, Any], field_names: Sequence[str],
                      device: torch.device) -> dict[str, Any]:
    """``pipelines`` with every ``ToDevice`` pointed at ``device``, appended where missing.

    A field without a pipeline keeps FFCV's default (decoder + ``ToTensor``) and gets a
    ``ToDevice`` when ``device`` is not the CPU; a pipeline that ends in numpy (no ``ToTensor``)
    stays on the host. Lists are copied: FFCV pops the decoder out of the list it is given.
    """
    from ffcv.pipeline import PipelineSpec
    from ffcv.transforms import ToDevice, ToTensor

    on_host = device.type == "cpu"

    def placed(ops: Sequence[Any]) -> list[Any]:
        out = [ToDevice(device, op.non_blocking) if isinstance(op, ToDevice) else op
               for op in ops]
        moved = any(isinstance(op, ToDevice) for op in ops)
        if not on_host and not moved and any(isinstance(op, ToTensor) for op in ops):
            out.append(ToDevice(device))
        return out

    result: dict[str, Any] = {}
    for name in [*field_names, *(k for k in pipelines if k not in field_names)]:
        if name not in pipelines:
            if not on_host:
                result[name] = [ToTensor(), ToDevice(device)]
            continue
        spec = pipelines[name]
        if spec is None:
            result[name] = None
        elif isinstance(spec, PipelineSpec):
            result[name] = PipelineSpec(spec.source, spec.decoder, placed(spec.transforms))
        else:
            result[name] = placed(spec)
    return result


def _most_threads() -> int:
    """The most threads FFCV's compiled pipeline may run on (numba's ``NUMBA_NUM_THREADS``):
    FFCV's own ``Loader`` fails at construction past it, this one would fail at its first
    batch."""
    from numba import config

    return int(config.NUMBA_NUM_THREADS)  # type: ignore[attr-defined]


class FFCVLoader(DeliveryCore):
    """An FFCV ``Loader`` whose order is our plan and whose state is a cursor.

    Takes ``ffcv.loader.Loader``'s arguments, with these differences:

    Args:
        fname: the ``.beton`` file.
        batch_size: samples per rank per batch.
        num_workers: FFCV's decoding threads (``-1``: one per CPU, FFCV's default).
        os_cache: FFCV's page-cache mode; ``None`` keeps FFCV's default.
        order: ``"sequential"``/``OrderOption.SEQUENTIAL``, ``"random"``/``OrderOption.RANDOM``
            (a new permutation per epoch from ``seed``), or a ``SampleOrder``. ``QUASI_RANDOM``
            and custom ``TraversalOrder`` classes are refused: they are not plannable.
        distributed: ``True`` (default) shards by global rank, resolved at the first
            ``next()`` without needing a process group; ``False`` reads everything on every
            process.
        seed: keys every shuffle; defaults to ``$PL_GLOBAL_SEED`` (``seed_everything``), else 0.
        indices: read only these sample indices of the file (the plan runs over them).
        pipelines, custom_fields, batches_ahead, recompile: passed to FFCV (``ToDevice``
            rewritten, see ``device``).
        drop_last: ``False`` by default (FFCV's default is ``True``); see ``last_batch``.
        last_batch: ``"keep"`` (default), ``"drop"``, ``"pad"`` or ``"rollover"``, as in
            ``ResumableLoader``.
        rank, world_size: explicit placement instead of the process group or environment.
        trainer: a Lightning ``Trainer``; outputs go to its ``strategy.root_device`` (pass
            ``self.trainer`` from ``train_dataloader()``).
        device: the output device, overriding ``trainer``. Without both: ``cuda:LOCAL_RANK``
            when CUDA is available, else the CPU. Every ``ToDevice`` in ``pipelines`` is
            pointed at it, and one is appended to tensor pipelines when it is a GPU.
        copy: ``True`` (default) returns batches that own their memory. ``False`` returns
            FFCV's own buffers (zero-copy): FFCV refills them in a ring of ``batches_ahead +
            2`` slots, so such a batch is only valid until the next batch is requested.

    Batches are tuples with one entry per pipeline output, as FFCV gives them.
    """

    schedule: MapSchedule

    def __init__(
        self,
        fname: str | Path,
        batch_size: int,
        num_workers: int = -1,
        os_cache: bool | None = None,
        order: Any = "sequential",
        distributed: bool = True,
        seed: int | None = None,
        indices: Sequence[int] | np.ndarray | None = None,
        pipelines: Mapping[str, Any] | None = None,
        custom_fields: Mapping[str, Any] | None = None,
        drop_last: bool = False,
        batches_ahead: int = 3,
        recompile: bool = False,
        *,
        last_batch: LastBatch | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        trainer: Any = None,
        device: torch.device | str | None = None,
        copy: bool = True,
    ) -> None:
        self.fname = str(fname)
        header = _read_header(self.fname)
        if not isinstance(batch_size, int) or batch_size < 1:
            raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r}")
        if num_workers == 0 or num_workers < -1:
            raise ValueError(f"num_workers must be >= 1 (FFCV threads) or -1 (one per CPU), "
                             f"got {num_workers}")
        most = _most_threads()
        if num_workers > most:
            raise ValueError(f"num_workers={num_workers} is more than the {most} "
                             "threads FFCV's numba may start here (NUMBA_NUM_THREADS, the CPU "
                             "count); use fewer, or -1 (one per CPU)")
        if batches_ahead < 1:
            raise ValueError(f"batches_ahead must be >= 1, got {batches_ahead}")
        if not distributed:
            if rank is not None or world_size is not None:
                raise ValueError(f"distributed=False reads the whole dataset on every process; "
                                 f"it contradicts rank={rank}, world_size={world_size}")
            rank, world_size = 0, 1
        self.field_names = header.field_names
        self.pipelines = dict(pipelines or {})
        self._check_pipelines()
        self.batch_size = batch_size
        self.num_workers = num_workers
        self.os_cache = os_cache
        self.distributed = distributed
        self.custom_fields = dict(custom_fields or {})
        self.batches_ahead = batches_ahead
        self.recompile = recompile
        self.copy = copy
        self.last_batch: LastBatch = resolve_last_batch(last_batch, drop_last)
        self.drop_last = self.last_batch == "drop"
        self.seed = resolve_seed(seed, None)
        self._trainer = trainer
        self._device = None if device is None else torch.device(device)
        sample_order = self._make_order(order, header.num_samples, indices)
        self.schedule = MapSchedule(sample_order, batch_size, self.last_batch, self.seed, rank,
                                    world_size)
        self.sampler = SizedEpochSampler(self.schedule)
        self.batch_sampler: Any = None  # DataLoader's surface: Lightning's evaluation reads it
        self._ffcv_loader: Any = None
        self._traversal: _PlannedTraversal | None = None
        self._epoch_iter: Any = None
        self._output_device: torch.device | None = None

    # -- the loader surface -----------------------------------------------------------------

    def _describe(self) -> list[str]:
        schedule = self.schedule
        return [repr(self.fname), f"samples={schedule.dataset_len}",
                f"batch_size={self.batch_size}", f"order={schedule.order.fingerprint}",
                f"last_batch={self.last_batch!r}", f"num_workers={self.num_workers}",
                f"device={self.device}"]

    @property
    def device(self) -> torch.device:
        """Where outputs are placed (fixed when the FFCV loader is built)."""
        if self._output_device is not None:
            return self._output_device
        return resolve_device(self._trainer, self._device)

    def close(self) -> None:
        """Stop FFCV's epoch thread now (it also stops when the loader is collected); an
        iterator used afterwards goes on from the cursor."""
        self._stop_epoch()
        super().close()

    def _stop_epoch(self) -> None:
        epoch_iter, self._epoch_iter = self._epoch_iter, None
        if epoch_iter is not None:
            _stop(epoch_iter)

    def __del__(self) -> None:
        if getattr(self, "_epoch_iter", None) is not None:
            self._stop_epoch()

    # -- epochs -----------------------------------------------------------------------------

    def _open_epoch(self) -> Iterator[tuple[Any, ...]]:
        """Decide where the epoch starts, then deliver from there."""
        self._begin_map_epoch(self.schedule)
        return self._reopen()

    def _reopen(self) -> Iterator[tuple[Any, ...]]:
        """Hand FFCV the rest of the epoch's plan from the cursor; deliver from there."""
        self._stop_epoch()
        order, cuts = _ffcv_epoch(list(self.schedule.requests()), self.batch_size)
        ffcv_loader, traversal = self._ffcv()
        traversal.order = order
        ffcv_loader.first_traversal_order = order  # FFCV's len() truncates the order by it
        self._epoch_iter = iter(ffcv_loader)
        return counted(_deliver(self._epoch_iter, cuts, self.copy), self.schedule)

    def _ffcv(self) -> tuple[Any, _PlannedTraversal]:
        """The FFCV loader (built once, at the first ``next()``)."""
        if self._ffcv_loader is None or self._traversal is None:
            from ffcv.loader import Loader, OrderOption

            device = resolve_device(self._trainer, self._device)
            options: dict[str, Any] = {}
            if self.os_cache is not None:
                options["os_cache"] = self.os_cache
            loader = Loader(
                self.fname,
                batch_size=self.batch_size,
                num_workers=self.num_workers,
                order=OrderOption.SEQUENTIAL,
                distributed=False,
                seed=self.seed & 0x7FFFFFFF,  # unused for SEQUENTIAL; avoids FFCV drawing one
                pipelines=_device_pipelines(self.pipelines, self.field_names, device),
                custom_fields=self.custom_fields,
                drop_last=False,
                batches_ahead=self.batches_ahead,
                recompile=self.recompile,
                **options,
            )
            self._traversal = _PlannedTraversal()
            loader.traversal_order = self._traversal
            self._ffcv_loader, self._output_device = loader, device
        return self._ffcv_loader, self._traversal

    # -- configuration ----------------------------------------------------------------------

    def _check_pipelines(self) -> None:
        from ffcv.pipeline import PipelineSpec

        for name, spec in self.pipelines.items():
            if name not in self.field_names and not isinstance(spec, PipelineSpec):
                raise ValueError(f"pipelines has {name!r}, which is not a field of {self.fname} "
                                 f"(fields: {list(self.field_names)}); new outputs need a "
                                 "PipelineSpec naming their source field")

    def _make_order(self, order: Any, num_samples: int,
                    indices: Sequence[int] | np.ndarray | None) -> SampleOrder:
        subset = None
        if indices is not None:
            subset = np.asarray(indices, dtype=np.int64).reshape(-1)
            bad = subset[(subset < 0) | (subset >= num_samples)]
            if len(bad):
                raise ValueError(f"indices hold {int(bad[0])}, outside the file's {num_samples} "
                                 "samples")
        n = num_samples if subset is None else len(subset)
        if n < 1:
            raise ValueError(f"nothing to read: {self.fname} has {num_samples} samples and "
                             f"indices selects {n}")
        base = _planned_order(order, n, self.seed)
        return base if subset is None else _SubsetOrder(base, subset)


def _planned_order(order: Any, n: int, seed: int) -> SampleOrder:
    """``order`` (an ``OrderOption``, its name, or a ``SampleOrder``) over ``n`` positions."""
    if isinstance(order, SampleOrder):
        if len(order) != n:
            raise ValueError(f"the order has {len(order)} positions, the data {n} samples")
        return order
    name = order.name if isinstance(order, Enum) else order
    if isinstance(name, str):
        key = name.lower()
        if key == "sequential":
            return SequentialOrder(n)
        if key == "random":
            return ShuffledOrder(n, seed)
        if key == "quasi_random":
            raise ValueError("order QUASI_RANDOM is not supported: its order follows FFCV's page "
                             "cache, not a plan, so it cannot be sharded or resumed exactly; "
                             "use RANDOM")
    raise TypeError(f"order must be 'sequential', 'random', an ffcv OrderOption or a "
                    f"lightning_loaders SampleOrder, got {order!r} (custom TraversalOrder classes "
                    "cannot be planned: wrap the order in a SampleOrder)")
