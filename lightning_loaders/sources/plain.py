"""A plain ``IterableDataset`` (no shards) as a one-shard source, read as its only reader.

Many plain datasets split their own stream: torch's documented pattern calls
``torch.utils.data.get_worker_info()`` in ``__iter__``, Hugging Face ``IterableDataset`` and
WebDataset split by worker, WebDataset also by ``RANK``/``WORLD_SIZE``. The loader shards the
stream over ranks and workers itself (every slot keeps every ``k``-th sample), so a dataset
that also split it would lose ``(k - 1) / k`` of what each slot reads. ``sole_reader()`` is the
view the dataset's code runs in while it is read: ``get_worker_info()`` returns ``None`` and
the environment says rank 0 of 1, so the dataset yields its whole stream in every slot.
Datasets that split by rank from their own configuration (HF ``split_dataset_by_node``, a
WebDataset ``split_by_node`` stage) cannot be undone by a view and are refused with the fix.
Shuffles seeded per process would make every slot's stream another: the stream reads under
global RNGs of its own, seeded from the loader's seed and the epoch when it opens and carried
from read to read (``sources.rngs``), a WebDataset's own shuffles are seeded from them too, and
a Hugging Face ``shuffle()`` without a seed is refused.
"""

from __future__ import annotations

import hashlib
import itertools
import os
import threading
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any

import numpy as np
import torch
from torch.utils.data import IterableDataset
from torch.utils.data._utils import worker as torch_worker

from lightning_loaders.hashing import mix64
from lightning_loaders.sources.hf import refuse_unseeded_shuffle
from lightning_loaders.sources.rngs import ReadRngs, opened_under
from lightning_loaders.sources.shards import ShardedSource

__all__ = ["PlainStream", "refuse_rank_split", "sole_reader"]

# what the view sets while the dataset runs; WebDataset reads RANK/WORLD_SIZE before
# torch.distributed, and WORKER/NUM_WORKERS (only overridden where set) before get_worker_info
_RANK_ENV = {"RANK": "0", "WORLD_SIZE": "1"}
_WORKER_ENV = {"WORKER": "0", "NUM_WORKERS": "1"}
_SOURCES_HINT = ("or use a first-class source (lightning_loaders.sources: HFSource, "
                 "WebDatasetSource, ParquetSource), which knows its shards and can seek")
_PIPELINE_DEPTH = 4
_DIGEST_SAMPLES = 8
_END = object()  # what no stream yields: ``_taken``'s sentinel
_OPEN_TAG = 0x0BE5  # keys the RNGs a plain stream is opened with
_SHUFFLE_TAG = 0x5EED  # keys the seeds of a WebDataset's own shuffles


@contextmanager
def sole_reader() -> Iterator[None]:
    """While inside, dataset code sees itself as the only reader of its stream.

    ``torch.utils.data.get_worker_info()`` returns ``None`` (the module global torch's function
    reads is cleared, so a name bound at import sees it too), and ``RANK``/``WORLD_SIZE`` are
    ``0``/``1`` (``WORKER``/``NUM_WORKERS`` ``0``/``1`` where set). Everything is restored on
    exit, so a ``worker_init_fn`` and the rest of the worker see torch's real values. Enter it
    around reads of a chunk of samples, not per sample: it costs a few environment writes.

    The view is process-wide (the environment and torch's global are): worker threads reading
    at once share one view, set by the first to enter and restored by the last to leave, and
    the process's other threads see it meanwhile.
    """
    with _VIEW.lock:
        if _VIEW.depth == 0:
            _VIEW.saved_info = torch_worker._worker_info
            overrides = {**_RANK_ENV, **{k: v for k, v in _WORKER_ENV.items() if k in os.environ}}
            _VIEW.saved_env = {name: os.environ.get(name) for name in overrides}
            torch_worker._worker_info = None
            os.environ.update(overrides)
        _VIEW.depth += 1
    try:
        yield
    finally:
        with _VIEW.lock:
            _VIEW.depth -= 1
            if _VIEW.depth == 0:
                _VIEW.restore()


class _View:
    """What ``sole_reader`` changed, restored by the last of the threads inside it to leave."""

    def __init__(self) -> None:
        self.lock = threading.Lock()
        self.depth = 0
        self.saved_info: Any = None
        self.saved_env: dict[str, str | None] = {}

    def restore(self) -> None:
        torch_worker._worker_info = self.saved_info
        for name, value in self.saved_env.items():
            if value is None:
                os.environ.pop(name, None)
            else:
                os.environ[name] = value
        self.saved_info, self.saved_env = None, {}

    def after_fork(self) -> None:
        """In a forked child: only the forking thread exists, so no reader is inside; a lock
        another thread held is released and a view it had set is undone."""
        self.lock = threading.Lock()
        if self.depth:
            self.depth = 0
            self.restore()


_VIEW = _View()
os.register_at_fork(after_in_child=_VIEW.after_fork)


def refuse_rank_split(dataset: Any) -> None:
    """Raise ``ValueError`` naming the fix if ``dataset`` splits itself by rank from its own
    configuration (which the sole-reader view cannot undo)."""
    name = type(dataset).__name__
    distributed = getattr(dataset, "_distributed", None)
    if type(dataset).__module__.startswith("datasets.") and distributed is not None:
        raise ValueError(
            f"this Hugging Face {name} was split by node with "
            "datasets.distributed.split_dataset_by_node (rank "
            f"{getattr(distributed, 'rank', '?')} of {getattr(distributed, 'world_size', '?')}); "
            "ResumableLoader shards over ranks itself, so each rank would read only its share "
            "of that share. Pass the unsplit dataset, " + _SOURCES_HINT)
    if any(map(_is_node_splitter, _stages(dataset, _PIPELINE_DEPTH))):
        raise ValueError(
            f"this WebDataset {name} splits its shards by node (a split_by_node stage, e.g. "
            "nodesplitter=webdataset.split_by_node); ResumableLoader shards over ranks itself, "
            "so each rank would read only its share of that share. Drop the node splitter (the "
            "default nodesplitter is fine), " + _SOURCES_HINT)


def _one_reader() -> int:
    """The worker seed of a resampled WebDataset read as its only reader."""
    return 0


def _stages(pipeline: Any, depth: int) -> Iterator[Any]:
    """Every stage of a WebDataset pipeline and of the pipelines nested in it, in order."""
    stages = getattr(pipeline, "pipeline", None)
    if depth == 0 or not isinstance(stages, list):
        return
    for stage in stages:
        yield stage
        yield from _stages(stage, depth - 1)


def _webdataset_function(stage: Any, name: str) -> bool:
    """Whether ``stage`` calls WebDataset's function ``name`` (a ``functools.partial`` of it,
    or a ``FilterFunction`` of it)."""
    function = getattr(stage, "func", None) or getattr(stage, "f", None) or stage
    return (getattr(function, "__name__", None) == name
            and getattr(function, "__module__", "").startswith("webdataset"))


def _is_node_splitter(stage: Any) -> bool:
    return _webdataset_function(stage, "split_by_node")


def _seed_webdataset_shuffles(pipeline: Any, seed: int, epoch: int) -> None:
    """Seed a WebDataset pipeline's own shuffles (``shardshuffle=``'s stage, ``.shuffle(n)``,
    ``resampled=True``'s shard draws) from the loader's seed and the epoch, before it is
    opened.

    WebDataset draws their seed in each process when none is given, so every rank and every
    restarted run would read another stream (a resume losing and repeating samples), and a
    given seed repeats one order every epoch. Seeded here, the stream is a function of the
    loader's seed and the epoch, like the rest of the order.
    """
    for position, stage in enumerate(_stages(pipeline, _PIPELINE_DEPTH)):
        value = mix64(_SHUFFLE_TAG, seed, epoch, position) & 0x7FFFFFFF
        kind = type(stage).__name__ if type(stage).__module__.startswith("webdataset") else ""
        if kind == "detshuffle":
            stage.seed, stage.epoch = value, -1  # its run() counts the epoch up to 0
        elif kind == "ResampledShards":  # resampled=True: drawn from pid, clock and urandom
            stage.seed, stage.epoch, stage.deterministic = value, -1, True
            stage.worker_seed = _one_reader  # not the rank's and worker's: one stream
        elif _webdataset_function(stage, "_shuffle"):
            kept = {name: v for name, v in stage.kw.items() if name not in ("rng", "seed")}
            stage.args, stage.kw = stage.args[:2], {**kept, "seed": value}  # (bufsize, initial)


class PlainStream(ShardedSource[Any]):
    """A plain ``IterableDataset`` seen as one shard: the strided fallback's source.

    Every slot iterates the whole dataset (read inside ``sole_reader()``, so a dataset that
    splits itself by worker or by the ``RANK`` environment still yields all of it, and inside
    ``open_reading()``, under the global-RNG states of its own stream) and keeps its share;
    ``start`` is reached by skipping. ``set_epoch`` is forwarded, so a dataset that
    reshuffles per epoch (HF reorders its shards) stays the same stream in every process of
    that epoch. The dataset's
    own ``state_dict()``, if any, is not used: the loader keeps the stream's position.
    """

    def __init__(self, dataset: IterableDataset[Any], seed: int = 0) -> None:
        refuse_rank_split(dataset)
        refuse_unseeded_shuffle(dataset)
        self.dataset = dataset
        self.seed = seed
        self._epoch = 0
        self.opened_head: int | None = None
        """The digest of the first sample of the stream this process opened last: every slot
        must see one stream (``SlotFetcher`` sends it with a slot's first batch to compare)."""

    @property
    def shards(self) -> list[IterableDataset[Any]]:
        return [self.dataset]

    @property
    def shard_lengths(self) -> list[int] | None:
        try:
            return [len(self.dataset)]  # type: ignore[arg-type]
        except TypeError:
            return None

    def open_shard(self, index: int, start: int = 0,
                   state: Mapping[str, Any] | None = None) -> Iterator[Any]:
        """The stream from sample ``start`` on, read under the global RNGs as they are (the
        loader reads it through ``open_reading``); read it inside ``sole_reader()``."""
        return itertools.islice(self._opened(self.seed, self._epoch)[0], start, None)

    def open_reading(self, index: int, start: int, state: Mapping[str, Any] | None,
                     seed: int, epoch: int) -> tuple[Iterator[Any], ReadRngs]:
        """The stream from sample ``start`` on (``islice``'s ``next()``, at C speed) and the
        global-RNG states it reads under; read it inside ``sole_reader()``."""
        stream, rngs = self._opened(seed, epoch)
        return itertools.islice(stream, start, None), rngs

    def _opened(self, seed: int, epoch: int) -> tuple[Iterator[Any], ReadRngs]:
        """``iter(dataset)``, opened (up to its first sample, where a generator's body starts)
        with the global RNGs seeded from the seed and the epoch alone, and the RNG states the
        rest of it reads under: a dataset that draws from them (``random.shuffle`` of its
        files as it opens, a shuffle buffer as it goes) is then the same stream in every slot,
        rank and resume of the epoch, where the RNGs of each batch's fetch (seeded per slot
        and batch) would make every slot's stream another."""
        def open_stream() -> tuple[Iterator[Any], list[Any]]:
            _seed_webdataset_shuffles(self.dataset, seed, epoch)
            stream = iter(self.dataset)
            return stream, list(itertools.islice(_taken(stream), 1))

        (stream, head), rngs = opened_under(open_stream, _OPEN_TAG, seed, epoch)
        self.opened_head = _digest(head)
        return _chained(head, stream), rngs

    def set_epoch(self, epoch: int) -> None:
        """Forward ``epoch`` unless the dataset's ``epoch`` already says it.

        Hugging Face keeps the epoch in memory shared by the main process and its workers and
        updates it by adding a difference, so workers setting it at once would add twice; the
        loader sets it in the main process first, and the workers then leave it alone.
        """
        self._epoch = epoch
        set_epoch = getattr(self.dataset, "set_epoch", None)
        if callable(set_epoch) and getattr(self.dataset, "epoch", None) != epoch:
            set_epoch(epoch)

    def shorter_than_declared(self, ended_before: int, declared: int) -> str:
        """The error message for a stream that ended before its ``len()``."""
        return (
            f"the {type(self.dataset).__name__} stream ended before sample {ended_before}, but "
            f"its len() is {declared}. It probably splits its stream itself by rank (reading "
            "torch.distributed or a node splitter), or its __len__ is wrong. Pass the unsplit "
            "dataset (the loader shards it over ranks and workers itself), " + _SOURCES_HINT)

    def digest(self) -> int:
        """A 62-bit digest of the stream's first samples, read in this process (inside the
        view), to compare between ranks. Only plain data (numbers, strings, bytes, arrays,
        tensors, and lists and dicts of them) counts; other objects count by type name, so
        the digest never differs by memory addresses or hash seeds."""
        with sole_reader():
            iterator, rngs = self._opened(self.seed, self._epoch)
            try:
                with rngs:
                    return _digest(itertools.islice(iterator, _DIGEST_SAMPLES))
            finally:
                close = getattr(iterator, "close", None)
                if callable(close):
                    close()

    @property
    def fingerprint(self) -> str:
        lengths = self.shard_lengths
        size = lengths[0] if lengths is not None else "unknown length"
        return f"{type(self.dataset).__name__}:{size}"


def _taken(stream: Iterator[Any]) -> Iterator[Any]:
    """The rest of ``stream`` by ``next()`` alone (at C speed): ``iter()`` on a dataset that
    is its own iterator rewinds it, and ``yield from`` and ``islice`` call it."""
    return iter(stream.__next__, _END)


def _chained(head: list[Any], stream: Iterator[Any]) -> Iterator[Any]:
    """``head``, then ``stream``; closing it closes ``stream``."""
    yield from head
    try:
        yield from _taken(stream)
    except GeneratorExit:
        close = getattr(stream, "close", None)
        if callable(close):
            close()
        raise


def _digest(samples: Iterable[Any]) -> int:
    """A 62-bit digest of ``samples`` that is the same in every process (``_feed``)."""
    hasher = hashlib.blake2b(digest_size=8)
    for sample in samples:
        _feed(hasher, sample)
    return int.from_bytes(hasher.digest(), "little") >> 2


def _feed(hasher: Any, value: Any) -> None:
    """Feed a process-independent form of ``value`` to ``hasher``."""
    if isinstance(value, torch.Tensor):
        hasher.update(f"t{value.dtype}{tuple(value.shape)}".encode())
        try:
            raw = value.detach().cpu().flatten().contiguous().view(torch.uint8).numpy()
        except (RuntimeError, TypeError):  # sparse, quantized, ...: the header only
            return
        hasher.update(raw.tobytes())
    elif isinstance(value, np.ndarray):
        hasher.update(f"a{value.dtype.str}{value.shape}".encode())
        if value.dtype != object:
            hasher.update(np.ascontiguousarray(value).tobytes())
    elif isinstance(value, str | int | float | bool | bytes | type(None) | np.generic):
        hasher.update(f"{type(value).__name__}:".encode())
        hasher.update(value if isinstance(value, bytes) else repr(value).encode())
    elif isinstance(value, Mapping):
        hasher.update(b"{")
        for key in sorted(value, key=repr):
            _feed(hasher, key)
            _feed(hasher, value[key])
    elif isinstance(value, list | tuple):
        hasher.update(f"[{len(value)}".encode())
        for item in value:
            _feed(hasher, item)
    else:
        hasher.update(f"<{type(value).__qualname__}>".encode())
