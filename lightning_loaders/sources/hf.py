"""Hugging Face ``datasets``: ``HFSource``, a ``datasets.IterableDataset`` as a sharded source.

The shards are the dataset's own (``dataset.num_shards``: its files, the shards of
``Dataset.to_iterable_dataset(num_shards=k)``, Parquet row groups after ``reshard()``). Shard
``i`` is read through ``dataset.shard(num_shards, i)``, so everything the user applied to the
dataset (``map``, ``filter``, ``select_columns``, ``with_format``, ...) still applies. The loader
decides which (rank, worker) slot reads which shard and reshuffles the shard order per epoch
from its seed; Hugging Face's own splitting by worker and rank is never used, so the stream is
the loader's plan (with known lengths, over partitions kept for the run whatever
``num_workers`` becomes).

Lengths
    ``lengths="auto"`` declares ``shard_lengths`` when they are known without reading the
    data: the shards of ``Dataset.to_iterable_dataset`` (saved and reloaded or not), an Arrow
    file (``IterableDataset.from_file``) and local Parquet files without ``filters`` (row
    counts from the footers), through steps that keep every row (``map`` without
    ``batched=True``, column selection and renaming, formatting, ``shuffle``). Anything else
    (``filter``, a batched ``map``, ``skip``/``take``, generators, remote files) has unknown
    lengths. ``lengths="scan"`` counts the unknown ones by reading every shard once, here;
    a sequence declares them. A declared length is checked as the shard is read: a shard with
    more or fewer samples raises ``ValueError``, never silently drops data.

Epochs and ``shuffle()``
    The loader's epoch is passed to every shard (``set_epoch``), as Hugging Face expects. A
    ``shuffle(seed=..., buffer_size=...)`` dataset shuffles within each shard with a buffer
    reseeded per epoch from its own seed: each shard's order is a function of (shard, epoch),
    the same for any number of workers. Its data-source shuffling is replaced by the loader's
    shard order, and its buffer never mixes two shards (the loader's ``shuffle_buffer`` mixes
    within a slot).

Resume
    A shard iterator's ``state_dict()`` is the dataset's own ``state_dict()`` (torchdata's
    ``Stateful`` protocol), which the loader saves with the position and hands back: reopening
    loads it, so Hugging Face seeks (whole Arrow tables skipped, no ``map`` re-run on skipped
    rows) instead of replaying. A shuffle buffer's content is not in that state, so a shuffled
    dataset is reopened by re-reading the shard up to the position instead (exact, slower).
    Opening at ``start`` without a state uses ``dataset.skip(start)``. A state is refused by a
    source over other files (by name), or whose steps were built otherwise (a ``shuffle``
    seed or buffer, a ``map``'s batching, features, format).

Refused
    A dataset already split by rank with ``datasets.distributed.split_dataset_by_node``: pass
    the unsplit dataset, the loader shards it. A dataset of several shards with a step that
    gives other samples when it runs per shard (``take``, ``skip``, ``interleave_datasets``,
    ``batch``, ``map``/``filter`` with ``with_indices=True``): pass it to ``ResumableLoader``
    directly. A batched ``map`` runs on each shard's rows, as in ``datasets``' own loader
    workers: one that regroups rows (packing) groups them within a shard. A map-style
    ``datasets.Dataset`` is not a source: give it to ``ResumableLoader`` directly (it is read
    through its ``__getitems__``).

``HFSource`` reads a few internals of ``datasets`` (how an ``IterableDataset`` is iterated
without its worker split, and what its pipeline is made of; checked against datasets 5.2).
``datasets`` is imported only when an ``HFSource`` is built, never by ``import
lightning_loaders``.
"""

from __future__ import annotations

import os
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any, Literal

from lightning_loaders.hashing import digest
from lightning_loaders.sources.shards import ShardedSource

if TYPE_CHECKING:
    from datasets import IterableDataset as HFIterableDataset

__all__ = ["HFSource", "refuse_unseeded_shuffle"]

HFLengths = Sequence[int] | Literal["auto", "scan"] | None

_END = object()
_DRAWN_ENTROPY = 1 << 64  # numpy draws 128 bits from the OS for a Generator given no seed

# Pipeline steps that yield exactly one sample per input sample and keep the shard structure.
_KEEPS_LENGTH = frozenset({
    "BufferShuffledExamplesIterable",
    "FormattedExamplesIterable",
    "InterleavedShardsExamplesIterable",
    "SelectColumnsIterable",
})


class HFSource(ShardedSource[Any]):
    """A Hugging Face ``datasets.IterableDataset`` read shard by shard (see the module doc).

    Args:
        dataset: the ``datasets.IterableDataset``, with its ``map``/``filter``/format steps,
            not split by rank.
        lengths: ``"auto"`` (declare the shard lengths when they are known without reading),
            ``"scan"`` (as ``"auto"``, counting the others by reading every shard once, now),
            samples per shard, or ``None`` (unknown).
    """

    def __init__(self, dataset: HFIterableDataset, lengths: HFLengths = "auto") -> None:
        _check_dataset(dataset)
        self.dataset = dataset
        self.num_shards = int(dataset.num_shards)
        if self.num_shards < 1:
            raise ValueError("the dataset has no shards")
        steps = _steps(dataset._ex_iterable)
        self.pipeline = [_describe(step) for step in steps]
        self._settings = [_settings(step) for step in steps]
        self.seekable = not any(type(step).__name__ == "BufferShuffledExamplesIterable"
                                for step in steps)
        self.rng_free = not any(map(_runs_user_code, steps))
        self._epoch = 0
        self._lengths = self._resolve_lengths(lengths)

    @property
    def shards(self) -> list[int]:
        return list(range(self.num_shards))

    @property
    def shard_lengths(self) -> list[int] | None:
        return self._lengths

    def set_epoch(self, epoch: int) -> None:
        """The epoch every shard opened from now on is read in (the loader calls it)."""
        self._epoch = int(epoch)

    def open_shard(self, index: int, start: int = 0,
                   state: Mapping[str, Any] | None = None) -> Iterator[Any]:
        if not 0 <= index < self.num_shards:
            raise IndexError(f"shard {index} out of range for {self.num_shards} shards")
        length = None if self._lengths is None else self._lengths[index]
        saved = state.get("hf") if state is not None and state.get("position") == start else None
        if (state is not None and saved is not None and self.seekable
                and saved.get("epoch") == self._epoch):
            skipped = int(state["skipped"])
            shard = self._open(index, skipped)
            shard.load_state_dict(dict(saved))
        else:
            skipped = start
            shard = self._open(index, start)
        return _ShardReader(shard, index, start, skipped, length, self.seekable)

    @property
    def fingerprint(self) -> str:
        features = self.dataset.features
        formatting = self.dataset._formatting
        described = [self.pipeline, self._settings, None if features is None else list(features),
                     None if formatting is None else formatting.format_type]
        return f"{super().fingerprint}:{digest(described)}"

    def __repr__(self) -> str:
        samples = "unknown" if self._lengths is None else sum(self._lengths)
        return f"HFSource(num_shards={self.num_shards}, samples={samples})"

    def _open(self, index: int, skip: int) -> HFIterableDataset:
        """Shard ``index`` as a one-shard dataset, past its first ``skip`` samples."""
        shard = self.dataset.shard(num_shards=self.num_shards, index=index)
        if skip:
            shard = shard.skip(skip)
        shard.set_epoch(self._epoch)
        return shard

    def _resolve_lengths(self, lengths: HFLengths) -> list[int] | None:
        if lengths is None:
            return None
        if isinstance(lengths, str):
            if lengths not in ("auto", "scan"):
                raise ValueError(f"lengths must be 'auto', 'scan', a sequence of ints or None, "
                                 f"got {lengths!r}")
            known = _known_lengths(self.dataset, self.num_shards)
            if known is not None or lengths == "auto":
                return known
            return [sum(1 for _ in _examples(self._open(i, 0))) for i in range(self.num_shards)]
        values = list(lengths)
        if len(values) != self.num_shards:
            raise ValueError(f"lengths has {len(values)} entries for {self.num_shards} shards")
        bad = [v for v in values if not isinstance(v, int) or isinstance(v, bool) or v < 0]
        if bad:
            raise ValueError(f"shard lengths must be ints >= 0, got {bad[:5]}")
        return values


class _ShardReader(Iterator[Any]):
    """The samples of one shard from ``position`` on.

    ``state_dict()`` is the position, the samples skipped with ``skip()`` when the shard was
    opened, and (unless the dataset has a shuffle buffer) the dataset's own state there.
    """

    def __init__(self, shard: HFIterableDataset, index: int, position: int, skipped: int,
                 length: int | None, seekable: bool) -> None:
        self._shard = shard
        self._samples: Iterator[Any] | None = _examples(shard)
        self.index, self.position, self.skipped = index, position, skipped
        self.length, self.seekable = length, seekable

    def __next__(self) -> Any:
        if self._samples is None:
            raise StopIteration
        sample = next(self._samples)
        self.position += 1
        if self.position == self.length and next(self._samples, _END) is not _END:
            raise ValueError(f"shard {self.index} has more samples than its declared length "
                             f"{self.length}: fix HFSource(lengths=...) or leave it 'auto'")
        return sample

    def state_dict(self) -> dict[str, Any]:
        return {"position": self.position, "skipped": self.skipped,
                "hf": self._shard.state_dict() if self.seekable else None}

    def close(self) -> None:
        samples, self._samples = self._samples, None
        close = getattr(samples, "close", None)
        if callable(close):
            close()


def _check_dataset(dataset: Any) -> None:
    try:
        import datasets
    except ImportError as exc:
        raise ImportError("HFSource needs the datasets package: install it, or the package's "
                          "'data' extra") from exc

    if isinstance(dataset, datasets.Dataset):
        raise TypeError("HFSource takes a datasets.IterableDataset; give a map-style "
                        "datasets.Dataset to ResumableLoader directly (an exact global shuffle "
                        "and resume), or stream it with dataset.to_iterable_dataset(num_shards=k)")
    if not isinstance(dataset, datasets.IterableDataset):
        raise TypeError(f"HFSource takes a datasets.IterableDataset, got "
                        f"{type(dataset).__name__}")
    distributed = dataset._distributed
    if distributed is not None:
        raise ValueError(
            f"this dataset was split by rank with datasets.distributed.split_dataset_by_node "
            f"(rank {distributed.rank} of {distributed.world_size}); the loader shards the "
            "dataset over ranks and workers itself, so pass the unsplit dataset to HFSource")
    refuse_unseeded_shuffle(dataset)
    if dataset.num_shards > 1:
        for step in _steps(dataset._ex_iterable):
            whole = _whole_stream_only(step)
            if whole:
                raise ValueError(
                    f"HFSource reads the dataset shard by shard (dataset.shard(n, i)), and "
                    f"its {whole} applies to each shard then, not to the whole stream: other "
                    "samples than the dataset yields would be read. Pass the dataset to "
                    "ResumableLoader directly (read whole, strided over ranks and workers), or "
                    "apply it per shard yourself")


def refuse_unseeded_shuffle(dataset: Any) -> None:
    """Raise ``ValueError`` naming the fix if a Hugging Face ``IterableDataset`` shuffles with
    a seed drawn in this process (``shuffle()`` without ``seed=``): another rank, or the
    restarted run a resume is, would read another order, losing and repeating samples."""
    if not type(dataset).__module__.startswith("datasets."):
        return
    for step in _steps(getattr(dataset, "_ex_iterable", None)):
        seed_seq = getattr(getattr(getattr(step, "generator", None), "bit_generator", None),
                           "seed_seq", None)
        entropy = getattr(seed_seq, "entropy", None)
        if isinstance(entropy, int) and entropy >= _DRAWN_ENTROPY:
            raise ValueError(
                f"this Hugging Face {type(dataset).__name__} shuffles with a seed drawn in "
                "this process (shuffle() without seed=): every rank, and a resumed run, would "
                "read another order, so samples would be lost and repeated. Give it one: "
                "dataset.shuffle(seed=..., buffer_size=...)")


def _whole_stream_only(step: Any) -> str:
    """The pipeline step, described, whose result differs when it runs per shard: ``take``
    and ``skip`` (their count is spread over the shards), ``interleave_datasets`` (per shard,
    a source is exhausted, and the short ones cycled, elsewhere), ``batch`` (its batches would
    end at every shard's end) and ``map`` or ``filter`` with ``with_indices=True``,
    ``add_column`` among them (the index restarts in every shard); ``""`` for any other."""
    kind = type(step).__name__
    if kind in ("TakeExamplesIterable", "SkipExamplesIterable"):
        return f"{kind[:4].lower()}(n)"
    if "CyclingMultiSources" in kind:
        strategy = getattr(step, "stopping_strategy", "?")
        return f"interleave_datasets(..., stopping_strategy={strategy!r})"
    if getattr(step, "function", None) in _regrouping():
        return "batch(n) (give the loader batch_size=n instead)"
    if getattr(step, "with_indices", False):
        if "Filtered" in kind:
            return "filter(..., with_indices=True)"
        return "map(..., with_indices=True) (add_column is one)"
    return ""


def _regrouping() -> tuple[Any, ...]:
    """The functions ``IterableDataset.batch()`` maps with (batched), where ``datasets`` has
    them."""
    from datasets import iterable_dataset

    return tuple(function for name in ("_batch_fn", "_batch_arrow_table")
                 if (function := getattr(iterable_dataset, name, None)) is not None)


def _examples(dataset: HFIterableDataset) -> Iterator[Any]:
    """What ``iter(dataset)`` yields in the main process, from anywhere.

    In a torch worker, ``datasets.IterableDataset.__iter__`` keeps only that worker's share of
    the shards (nothing, for a one-shard dataset in worker 1) and reseeds its shuffle buffer
    from the worker id. The dataset is prepared now, so its ``state_dict()`` is valid (and a
    loaded state applied) before the first sample.
    """
    ex_iterable = dataset._prepare_ex_iterable_for_iteration()
    formatting = dataset._formatting
    if formatting is not None and (ex_iterable.iter_arrow or formatting.is_table):
        from datasets.formatting import get_formatter

        formatter = get_formatter(formatting.format_type, features=dataset.features)
        return (formatter.format_row(table) for _, table in ex_iterable.iter_arrow())
    return (example for _, example in ex_iterable)


def _steps(ex_iterable: Any) -> list[Any]:
    """Every step of a dataset's pipeline, outermost first."""
    out, stack = [], [ex_iterable]
    while stack:
        step = stack.pop()
        out.append(step)
        stack += reversed(getattr(step, "ex_iterables", None) or [])
        inner = getattr(step, "ex_iterable", None)
        if inner is not None:
            stack.append(inner)
    return out


def _runs_user_code(step: Any) -> bool:
    """Whether a pipeline step calls a function of the user's (``map``, ``filter``,
    ``from_generator``'s generator), which may draw from the global RNGs."""
    generate = getattr(step, "generate_examples_fn", None)
    builder = type(getattr(generate, "__self__", None))
    return (getattr(step, "function", None) is not None
            or builder.__module__.startswith("datasets.packaged_modules.generator"))


def _describe(step: Any) -> str:
    """A pipeline step's kind, and the name of the function it applies (``map``, ``filter``)."""
    function = getattr(step, "function", None)
    name = type(step).__name__
    return name if function is None else f"{name}({getattr(function, '__qualname__', '?')})"


def _settings(step: Any) -> list[Any]:
    """What a pipeline step was built with that changes what it yields, as plain values for
    the fingerprint: its public numbers, strings and flags (``buffer_size``, ``batch_size``,
    ``with_indices``, ...), its generator's seed (a ``shuffle(seed=...)``), and the files a
    source reads (their names, as the file sources fingerprint them)."""
    plain = (bool, int, float, str, type(None))
    settings: list[Any] = [(name, value) for name, value in sorted(vars(step).items())
                           if not name.startswith("_") and isinstance(value, plain)]
    seed_seq = getattr(getattr(getattr(step, "generator", None), "bit_generator", None),
                       "seed_seq", None)
    entropy = getattr(seed_seq, "entropy", None)
    if isinstance(entropy, int):
        settings.append(("seed", entropy))
    for name, value in sorted(getattr(step, "kwargs", {}).items()):
        values = value if isinstance(value, list | tuple) else [value]
        names = [os.path.basename(item) for item in values if isinstance(item, str)]
        if names:
            settings.append((name, names))
    return settings


def _known_lengths(dataset: HFIterableDataset, num_shards: int) -> list[int] | None:
    """Samples per shard when the pipeline keeps every row of sources of known size."""
    step = dataset._ex_iterable
    while type(step).__name__ != "ArrowExamplesIterable":
        if not _keeps_length(step):
            return None
        step = step.ex_iterable
    lengths = _source_lengths(step)
    return lengths if lengths is not None and len(lengths) == num_shards else None


def _keeps_length(step: Any) -> bool:
    name = type(step).__name__
    if name == "MappedExamplesIterable":
        return not step.batched
    if name == "RebatchedArrowExamplesIterable":
        return not step.drop_last_batch
    return name in _KEEPS_LENGTH


def _source_lengths(step: Any) -> list[int] | None:
    """Rows per shard of an Arrow source, from metadata: in-memory shards, an Arrow file, or
    local Parquet files read without filters."""
    from datasets import Dataset

    generate, kwargs = step.generate_tables_fn, step.kwargs
    if generate is Dataset._generate_tables_from_shards:
        return [len(shard) for shard in kwargs["shards"]]
    if generate is Dataset._generate_tables_from_cache_file:
        return [_arrow_rows(kwargs["filename"])]
    builder = getattr(generate, "__self__", None)
    config: Any = getattr(builder, "config", None)
    if (type(builder).__name__ == "Parquet" and generate.__name__ == "_generate_tables"
            and config.filters is None and config.on_bad_files == "error"):
        files = list(kwargs["files"])
        groups = kwargs.get("row_groups_list") or [None] * len(files)
        if all(isinstance(file, str) and os.path.isfile(file) for file in files):
            return [_parquet_rows(file, rows) for file, rows in zip(files, groups, strict=True)]
    return None


def _arrow_rows(path: str) -> int:
    import pyarrow as pa

    with pa.memory_map(path) as source:
        return sum(batch.num_rows for batch in pa.ipc.open_stream(source))


def _parquet_rows(path: str, row_groups: Sequence[int] | None) -> int:
    import pyarrow.parquet as pq

    metadata = pq.ParquetFile(path).metadata
    if row_groups is None:
        return int(metadata.num_rows)
    return sum(int(metadata.row_group(group).num_rows) for group in row_groups)
