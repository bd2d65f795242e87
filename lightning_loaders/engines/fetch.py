"""Worker side: turn one planned batch request into a collated batch.

The loader feeds its worker pool (``engines.workers``, ``engines.threads``) with
``BatchRequest`` objects instead of indices; ``BatchFetcher`` is the dataset those workers
index (or the loader calls itself, when batches are fetched in the main process). It seeds the
global RNGs per batch, exposes the per-sample context, takes the fastest fetch path the dataset
allows, and names the failing sample when user code raises.

When user code raises, a worker returns a ``Failed`` (the error, re-raised by the loader in the
main process) rather than raising through torch, which would keep only the error's text. With
``on_error="skip"`` a failing sample is left out of its batch and reported in a ``Skipped``;
a batch whose ``__getitems__`` fails is retried sample by sample to find the failing ones.

Fetch paths, fastest first (each gives exactly what ``default_collate`` of the samples gives):

1. *gather*: in-memory data (a tensor, a numeric numpy array, ``TensorDataset``, a
   ``TableDataset`` of numeric columns, and ``StackDataset``/``Subset`` over those) is
   gathered a whole batch at a time with numpy's ``take`` (in the main process, several
   batches at a time: ``gathered``); no user code runs, so no RNG is seeded and no sample
   context is set.
2. *getitems*: a dataset's own ``__getitems__`` gets the batch's indices in one call.
3. *per sample*: ``dataset[i]`` for every index, with ``sample_context()`` set (in a batch,
   a ``Subset``'s or ``StackDataset``'s samples are read from the datasets they wrap, as
   their ``__getitems__`` reads them for ``DataLoader``).
"""

from __future__ import annotations

import copy
import warnings
from collections.abc import Callable, Iterator
from functools import partial
from itertools import accumulate, islice
from typing import Any, Literal, NamedTuple

import numpy as np
import torch
from torch.utils.data import (
    Dataset,
    StackDataset,
    Subset,
    TensorDataset,
    default_collate,
    get_worker_info,
)

from lightning_loaders.context import seeded_fetch, set_samples, worker_info
from lightning_loaders.engines.faults import Failed, OnError, Skipped, SkippedSample
from lightning_loaders.engines.transport import worker_collate
from lightning_loaders.errors import SampleFetchError, exception_text, fetch_error
from lightning_loaders.schedule.requests import BatchRequest
from lightning_loaders.sources.mix import Mix
from lightning_loaders.sources.tables import TableDataset

__all__ = ["BatchFetcher", "Numbered", "Unbatched"]

Unbatched = Literal["", "sample", "bulk", "tuple"]
"""How a fetch with ``batch_size=None`` reads: ``""`` batched (collate a list of samples),
``"sample"`` one sample per request, ``"bulk"`` the whole request in one ``dataset[list]``,
``"tuple"`` the whole request as one key, ``dataset[tuple]``."""


class Numbered(NamedTuple):
    """A fetch's result with the number of its planned batch (for out-of-order delivery)."""

    batch: int
    item: Any


_Gather = Callable[[torch.Tensor], Any]
_GATHER_BLOCK_BYTES = 1 << 20  # in-memory batches gathered together, in bytes of output


class BatchFetcher(Dataset[Any]):
    """Fetches and collates whole planned batches (what the internal DataLoader's workers index).

    ``in_memory`` is true when batches are gathered by vectorised indexing with no user code
    involved: worker processes can then only add inter-process cost. With ``ring`` (worker
    processes send through shared-memory rings), the default collate is ``ring_collate``.
    """

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any] | None, seed: int,
                 on_error: OnError = "raise", unbatched: Unbatched = "", ring: bool = False):
        self.dataset = dataset
        self.on_error = on_error
        self.init_failure: Failed | None = None  # set in a worker whose worker_init_fn raised
        default = collate_fn is None or collate_fn is default_collate
        self.collate_fn = worker_collate(collate_fn, ring)
        self.seed = seed
        self.unbatched: Unbatched = unbatched
        self.numbered = False
        batched = not unbatched
        self._gather = _checked_gather(dataset) if default and batched else None
        self._getitems = (dataset.__getitems__ if batched and _has_own_getitems(dataset)
                          else None)
        self._read = _sample_read(dataset) if batched else dataset.__getitem__

    def numbering(self) -> BatchFetcher:
        """A copy whose results are ``Numbered`` with their batch (for workers that may
        answer out of order)."""
        numbered = copy.copy(self)
        numbered.numbered = True
        return numbered

    def thread_copy(self) -> BatchFetcher:
        """A copy for one worker thread: the dataset is shared, a failed ``worker_init_fn`` is
        that thread's own (as it is a worker process's)."""
        mine = copy.copy(self)
        mine.init_failure = None
        return mine

    @property
    def in_memory(self) -> bool:
        return self._gather is not None

    def gathered(self, requests: Iterator[BatchRequest]) -> Iterator[Any]:
        """The batches of ``requests`` for in-memory data, several per gather.

        Consecutive batches are gathered together, up to about ``_GATHER_BLOCK_BYTES``: one
        large gather pays Python's per-call cost once. Each batch lies in its block's memory
        (``_split``), so holding one batch keeps at most that block alive.
        """
        gather = self._gather
        assert gather is not None, "gathered() needs in-memory data"
        first = next(requests, None)
        if first is None:
            return
        row_bytes = _nbytes(gather(torch.zeros(1, dtype=torch.int64)))
        per_block = max(1, _GATHER_BLOCK_BYTES // max(1, row_bytes * len(first.indices)))
        block = [first, *islice(requests, per_block - 1)]
        while block:
            sizes = [len(request.indices) for request in block]
            try:
                whole = gather(torch.from_numpy(np.concatenate([r.indices for r in block])))
            except IndexError:  # an index outside [0, len): each batch as its fetch says
                yield from map(self.__getitem__, block)
            else:
                yield from _split(whole, sizes)
            block = list(islice(requests, per_block))

    def __getitem__(self, request: BatchRequest) -> Any:
        if self.numbered:
            return Numbered(request.batch, self._result(request))
        return self._result(request)

    def _result(self, request: BatchRequest) -> Any:
        if self.init_failure is not None:
            return self.init_failure
        try:
            return self._fetch(request)
        except SampleFetchError as error:
            if worker_info() is None:  # in the main process: raise it here
                raise
            return Failed(error)

    def _fetch(self, request: BatchRequest) -> Any:
        gather = self._gather
        if gather is not None:
            try:
                return gather(torch.from_numpy(request.indices))
            except IndexError:  # an index outside [0, len) (a sampler's): fetched sample by
                pass  # sample, where a negative one counts from the end, as in DataLoader
        with seeded_fetch(self.seed, request.epoch, request.batch, request.rank):
            skipped: list[SkippedSample] = []
            getitems = self._getitems
            if self.unbatched in ("bulk", "tuple"):
                return self._collate(request, self._fetch_bulk(request))
            if getitems is not None:
                samples = self._fetch_batch(request, getitems, skipped)
            else:
                samples = self._fetch_samples(request, skipped)
            if self.unbatched:  # one sample: converted, not collated into a batch
                samples = samples[0] if samples else samples
            if not skipped:
                return self._collate(request, samples)
            if not samples:
                return Skipped(None, tuple(skipped), empty=True)
            return Skipped(self._collate(request, samples), tuple(skipped))

    def _fetch_bulk(self, request: BatchRequest) -> Any:
        """``dataset[indices]``: the dataset reads the whole planned batch itself (bulk
        loading with ``batch_size=None`` and a sampler that yields lists of indices), or
        ``dataset[tuple(indices)]``, one key, for a sampler that yields tuples."""
        indices = request.indices.tolist()
        try:
            return self.dataset[tuple(indices) if self.unbatched == "tuple" else indices]
        except Exception as exc:
            raise _fetch_error(request, None, exc, "__getitem__") from exc

    def _fetch_batch(self, request: BatchRequest, getitems: Callable[[list[int]], list[Any]],
                     skipped: list[SkippedSample]) -> list[Any]:
        """The dataset's ``__getitems__``; when skipping, a failing batch is fetched again sample
        by sample (``__getitems__([i])``: the dataset may have no ``__getitem__``) so that
        only the failing samples are left out."""
        try:
            return getitems(request.indices.tolist())
        except Exception as exc:
            if self.on_error != "skip":
                raise _fetch_error(request, None, exc, "__getitems__") from exc
        return self._fetch_samples(request, skipped, lambda index: getitems([index])[0])

    def _fetch_samples(self, request: BatchRequest, skipped: list[SkippedSample],
                       read: Callable[[int], Any] | None = None) -> list[Any]:
        """``dataset[i]`` (or ``read(i)``) for every index of the batch, with the sample
        context published once (``sample_context()`` counts the samples fetched so far, so the
        loop does nothing else per sample). With ``on_error="skip"`` a failing sample is
        recorded and the loop goes on after it."""
        get = read or self._read
        indices = request.indices.tolist()
        samples: list[Any] = []
        append = samples.append
        current = set_samples((self.seed, request.rank, request.sample_epochs,
                               request.positions, indices), samples)
        try:
            while (start := current.skipped + len(samples)) < len(indices):
                try:
                    for index in indices[start:]:
                        append(get(index))
                except Exception as exc:
                    k = current.skipped + len(samples)
                    if self.on_error != "skip":
                        raise _fetch_error(request, k, exc, within=self.dataset) from exc
                    skipped.append(SkippedSample(request.epoch, request.batch,
                                                 int(request.positions[k]), indices[k],
                                                 f"{type(exc).__name__}: "
                                                 f"{exception_text(exc)}"))
                    current.skipped += 1
        finally:
            set_samples(None)
        return samples

    def _collate(self, request: BatchRequest, samples: list[Any]) -> Any:
        try:
            return self.collate_fn(samples)
        except Exception as exc:
            raise _fetch_error(request, None, exc, "collate_fn") from exc


def _fetch_error(request: BatchRequest, k: int | None, exc: BaseException,
                 call: str = "", within: Any = None) -> SampleFetchError:
    """The error naming sample ``k`` of ``request`` (or, with ``k=None``, the batch that
    ``call`` failed on), and what that index is in the dataset ``within`` when it can say
    (``describe_index``: a ``Mix`` names the source and the source's own index)."""
    if k is None:
        shown = ", ".join(map(str, request.indices[:8].tolist()))
        more = ", ..." if len(request.indices) > 8 else ""
        return fetch_error(exc, f"{call} of batch {request.batch} (dataset indices "
                                f"[{shown}{more}])", epoch=request.epoch, batch=request.batch,
                           rank=request.rank)
    index, position = int(request.indices[k]), int(request.positions[k])
    describe = getattr(within, "describe_index", None)
    what = f"{describe(index)}; " if callable(describe) else ""
    return fetch_error(exc, f"sample index {index} ({what}epoch position {position}, batch "
                            f"{request.batch})", epoch=request.epoch, batch=request.batch,
                       rank=request.rank, index=index, position=position)


# -- the gather path -----------------------------------------------------------------------


def _checked_gather(dataset: Any) -> _Gather | None:
    """A vectorised gather for ``dataset`` that provably collates like ``default_collate``.

    The gather is built from the dataset's structure, then checked once against
    ``default_collate`` of its first and last samples (type, dtype, shape and values); any
    difference, or an error, keeps the general path.
    """
    try:
        gather = _gather_for(dataset)
        if gather is None:
            return None
        probe = [0, len(dataset) - 1]
        expected = default_collate([dataset[i] for i in probe])
        got = gather(torch.tensor(probe, dtype=torch.int64))
    except Exception:
        return None
    return gather if _same_batch(got, expected) else None


def _gather_for(data: Any) -> _Gather | None:
    """A gather over ``data``'s structure, or ``None`` when a part of it is not in memory.

    Types are matched exactly: a subclass may override ``__getitem__`` (a transform)."""
    kind = type(data)
    if kind is np.ndarray or kind is np.memmap:
        return _gather_array(data)
    if kind is torch.Tensor:
        return _gather_tensor(data)
    if kind is TensorDataset:
        return _gather_list([_gather_tensor(t) for t in data.tensors])
    if kind is StackDataset:
        if isinstance(data.datasets, dict):
            keys = list(data.datasets)
            parts = _gather_list([_gather_for(data.datasets[k]) for k in keys])
            return None if parts is None else _DictGather(keys, parts)
        return _gather_list([_gather_for(d) for d in data.datasets])
    if kind is TableDataset:
        return _gather_table(data)
    if kind is Subset:
        inner = _gather_for(data.dataset)
        if inner is None:
            return None
        return _SubsetGather(inner, torch.as_tensor(np.asarray(data.indices, dtype=np.int64)))
    return None


def _gather_list(parts: list[_Gather | None]) -> _ListGather | None:
    if any(part is None for part in parts):
        return None
    return _ListGather(parts)  # type: ignore[arg-type]


def _gather_table(table: TableDataset) -> _Gather | None:
    """A table whose columns are all numeric: one take per column into a dict of tensors."""
    arrays = table.numeric_arrays()
    if arrays is None:
        return None
    parts = _gather_list([_gather_array(array) for array in arrays.values()])
    return None if parts is None else _DictGather(list(arrays), parts)


def _gather_array(array: np.ndarray) -> _Gather | None:
    if array.ndim == 0 or array.dtype.kind not in "biufc":
        return None
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # read-only arrays: the tensor is only ever read
        tensor = torch.from_numpy(array)  # raises on dtypes and strides torch cannot view
    return _gather_tensor(tensor)


def _gather_tensor(tensor: torch.Tensor) -> _Gather | None:
    if (type(tensor) is not torch.Tensor or tensor.dim() == 0 or tensor.layout != torch.strided
            or tensor.is_nested or tensor.device.type != "cpu" or tensor.requires_grad):
        return None
    return _TensorGather(tensor)


# Gathers are small classes, not closures, so a fetcher pickles for spawned workers.


class _TensorGather:
    """Rows of a CPU tensor (``default_collate`` stacks the samples' rows)."""

    def __init__(self, tensor: torch.Tensor) -> None:
        self.tensor = tensor

    def __call__(self, index: torch.Tensor) -> torch.Tensor:
        tensor = self.tensor
        if get_worker_info() is None:
            return _rows(tensor, index)
        # In a worker, gather straight into shared memory (as default_collate does) so sending
        # the batch to the main process costs no extra copy.
        shape = (len(index), *tensor.shape[1:])
        storage = tensor._typed_storage()._new_shared(int(np.prod(shape)), device=tensor.device)
        out = tensor.new(storage).resize_(shape)
        return torch.index_select(tensor, 0, index, out=out)


def _rows(tensor: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """``tensor.index_select(0, index)``, by numpy's ``take`` where numpy can view the tensor:
    on this thread alone. ``index_select`` splits a large gather over torch's intra-op
    threads, which stall while other processes busy the cores: an epoch of 50,000 3x32x32
    samples in 1 MiB blocks took 0.15-0.33 s beside one busy process, against 0.07 s on idle
    cores; ``take`` takes 0.12 and 0.10 s."""
    try:
        array = tensor.numpy()
    except (TypeError, RuntimeError):  # a dtype numpy lacks (bfloat16), a conjugate view...
        return tensor.index_select(0, index)
    return torch.from_numpy(np.take(array, index.numpy(), axis=0))


class _ListGather:
    """Tuple-like samples: ``default_collate`` turns a batch of tuples into a list."""

    def __init__(self, parts: list[_Gather]) -> None:
        self.parts = parts

    def __call__(self, index: torch.Tensor) -> list[Any]:
        return [part(index) for part in self.parts]


class _DictGather:
    """Dict samples: ``default_collate`` collates each key."""

    def __init__(self, keys: list[Any], parts: _ListGather) -> None:
        self.keys = keys
        self.parts = parts

    def __call__(self, index: torch.Tensor) -> dict[Any, Any]:
        return dict(zip(self.keys, self.parts(index), strict=True))


class _SubsetGather:
    """``Subset``: map the indices, then gather from the underlying data."""

    def __init__(self, inner: _Gather, mapping: torch.Tensor) -> None:
        self.inner = inner
        self.mapping = mapping

    def __call__(self, index: torch.Tensor) -> Any:
        return self.inner(self.mapping.index_select(0, index))


def _split(batch: Any, sizes: list[int]) -> list[Any]:
    """A gathered block cut back into batches of ``sizes`` rows, each a tensor of its own over
    its own part of the block's memory (a storage slice: no copy). Not views: views of one
    block share its autograd version counter, so an in-place op on a batch (``x.sub_(mean)``)
    would fail the backward of an earlier batch still in a graph (gradient accumulation), and
    ``split``'s views refuse an in-place op with an operand that requires grad. Not the whole
    block's storage either: a batch grown by ``resize_`` would take over the next one's rows
    (a slice cannot be resized, as the shared memory of a worker's batch cannot)."""
    if isinstance(batch, torch.Tensor):
        storage, stride, item = batch.untyped_storage(), batch.stride(), batch.element_size()
        parts = []
        for offset, size in zip(accumulate(sizes[:-1], initial=0), sizes, strict=True):
            shape = (size, *batch.shape[1:])
            extent = 1 + sum((n - 1) * step for n, step in zip(shape, stride, strict=True))
            start = (batch.storage_offset() + offset * stride[0]) * item
            part = storage[start:start + (extent if all(shape) else 0) * item]
            parts.append(torch.empty(0, dtype=batch.dtype, device=batch.device).set_(
                part, 0, shape, stride))
        return parts
    if isinstance(batch, dict):
        keys = list(batch)
        return [dict(zip(keys, parts, strict=True))
                for parts in zip(*(_split(batch[k], sizes) for k in keys), strict=True)]
    return [list(parts) for parts in zip(*(_split(part, sizes) for part in batch), strict=True)]


def _nbytes(batch: Any) -> int:
    """Bytes of the tensors in a gathered batch."""
    if isinstance(batch, torch.Tensor):
        return batch.nbytes
    parts = batch.values() if isinstance(batch, dict) else batch
    return sum(_nbytes(part) for part in parts)


def _same_batch(got: Any, expected: Any) -> bool:
    """Same container types, keys, tensor dtypes, shapes and values (NaN equal to NaN)."""
    if type(got) is not type(expected):
        return False
    if isinstance(got, torch.Tensor):
        return (got.dtype == expected.dtype and got.shape == expected.shape
                and bool(torch.equal(got, expected) or (got.is_floating_point() and torch.allclose(
                    got, expected, rtol=0, atol=0, equal_nan=True))))
    if isinstance(got, dict):
        return got.keys() == expected.keys() and all(_same_batch(got[k], expected[k])
                                                     for k in got)
    if isinstance(got, list):
        return len(got) == len(expected) and all(_same_batch(g, e)
                                                 for g, e in zip(got, expected, strict=True))
    return False


# -- the getitems path ---------------------------------------------------------------------


def _has_own_getitems(dataset: Any) -> bool:
    """Whether ``dataset`` batches its own fetches: torch's ``Subset`` and ``StackDataset``
    and our ``Mix`` only forward ``__getitems__``, so over per-sample datasets they would hide
    the per-sample context (``sample_rng()``), and the per-sample path is used instead. A
    subclass that overrides ``__getitems__`` batches its own (``DataLoader`` calls it)."""
    if _forwards(dataset, Subset):
        return _has_own_getitems(dataset.dataset)
    if _forwards(dataset, StackDataset) or _forwards(dataset, Mix):
        parts = dataset.datasets if isinstance(dataset, StackDataset) else dataset.sources
        return all(_has_own_getitems(d) for d in _members(parts))
    return callable(getattr(dataset, "__getitems__", None))


def _forwards(dataset: Any, kind: type) -> bool:
    """Whether ``dataset`` is a ``kind`` whose ``__getitems__`` is ``kind``'s own."""
    return isinstance(dataset, kind) and (getattr(type(dataset), "__getitems__", None)
                                          is getattr(kind, "__getitems__", None))


def _members(parts: Any) -> list[Any]:
    """The datasets a ``StackDataset`` (tuple or dict) or a ``Mix`` holds."""
    return list(parts.values() if isinstance(parts, dict) else parts)


def _sample_read(dataset: Any) -> Callable[[int], Any]:
    """How a batched fetch reads one sample of ``dataset`` on the per-sample path."""
    if _forwards(dataset, Subset) or _forwards(dataset, StackDataset):
        return partial(_read_through, dataset)  # a partial, not a closure: it pickles
    return dataset.__getitem__


def _read_through(dataset: Any, index: int) -> Any:
    """Sample ``index`` as ``DataLoader``'s batched fetch reads it: through torch's forwarding
    ``__getitems__`` of a ``Subset`` or ``StackDataset`` down to the datasets they wrap, so a
    subclass's own ``__getitem__`` is not called (it is with ``batch_size=None``)."""
    if _forwards(dataset, Subset):
        return _read_through(dataset.dataset, dataset.indices[index])
    if not _forwards(dataset, StackDataset):
        return dataset[index]
    parts = dataset.datasets
    if isinstance(parts, dict):
        return {key: _read_through(part, index) for key, part in parts.items()}
    return tuple(_read_through(part, index) for part in parts)
