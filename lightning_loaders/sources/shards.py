"""Sharded sources: iterable datasets that say what their shards are and how to open one.

A ``ShardedSource`` is a ``torch.utils.data.IterableDataset`` that declares

- ``shards``: one descriptor per shard (a file path, a range, a sequence, ...);
- ``shard_lengths``: samples per shard, or ``None`` when unknown (known lengths give an exact
  ``len()``, exactly balanced ranks and an O(1) resume state);
- ``open_shard(index, start=0, state=None)``: an iterator over shard ``index`` from its sample
  ``start`` on.

The loader (``ResumableLoader`` over such a source) decides which (rank, worker) reads which
shard, or which part of one, in every epoch. A shard iterator that can describe its position
more cheaply than a sample count (a byte offset in a file) may expose ``state_dict()``: the
loader saves it with the position and hands it back as ``state`` together with the same
``start``, so ``open_shard`` can seek instead of skipping ``start`` samples.

A shard may draw from the global ``random``, numpy and torch RNGs as it opens (a shuffle of
its rows) or as it is read (an augmentation). Every batch's read runs under the RNGs seeded for
that batch, which makes a draw per sample the same for every worker count and resume; but a
shard split between two slots is opened in two batches, so a shuffle of its rows drawn there
would be two permutations. So a source that reaches ``start`` by reading and dropping the
samples before it (``GeneratorSource`` by default, Hugging Face streams) is opened with the RNGs
seeded from ``(seed, epoch, shard index)`` and read under states of its own, carried from read
to read: what it draws is a function of the shard and of how far it was read, so it is one
stream wherever it is read and after any resume. A source that ``seeks`` (a byte offset, an
index: the file sources, ``SequenceSource``, ``GeneratorSource(seekable=True)``) skips the draws
of the samples before ``start``, so carried states would not come back after a resume: it is
read under each batch's seeding (a worker thread holds the global RNGs for it, one thread at a
time, as ``context.rng_turn`` says; a sample read before its batch's fetch, for a shuffle window or
ahead of a batch to learn where a stream of unknown length ends, under a seeding keyed by its
place in the slot's stream: ``engines.shard_reader``), and the order of its rows must not come
from the global RNGs (derive it from the shard: a seekable ``fn`` must find ``start`` in it
anyway). Sources that never draw say so with ``rng_free`` and are read under each batch's
seeding too.

Ready sources: ``RecordFiles`` (length-prefixed binary records, see ``write_records``),
``LineFiles`` (text lines), ``SequenceSource`` (in-memory sequences) and ``GeneratorSource`` (a
generator function per shard). Everything here is picklable, so worker processes can open
shards themselves.
"""

from __future__ import annotations

import codecs
import itertools
import numbers
import os
import struct
from abc import abstractmethod
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager, nullcontext
from typing import IO, Any, Literal, TypeVar

import numpy as np
import torch
from torch.utils.data import IterableDataset

from lightning_loaders.hashing import digest
from lightning_loaders.sources.rngs import opened_under

__all__ = [
    "GeneratorSource",
    "LineFiles",
    "RecordFiles",
    "SequenceSource",
    "ShardedSource",
    "checked_lengths",
    "count_records",
    "write_records",
]

T = TypeVar("T")
Lengths = Sequence[int] | Literal["scan"] | None

_HEADER = struct.Struct("<I")  # a record's payload length, little-endian uint32
_SHARD_TAG = 0x5A4D  # keys the global RNGs a shard is opened and read under
_CONTAINERS = (list, tuple, range, str, bytes, np.ndarray, torch.Tensor)  # no code of users'


class ShardedSource(IterableDataset[T]):
    """An iterable dataset made of shards (subclass it, or use a ready source)."""

    rng_free: bool = False
    """Whether opening and reading shards never draws from the global ``random``, numpy and
    torch RNGs (no user code runs, or none that draws): the loader then reads them without
    putting RNG states of their own in place (``open_reading``), which saves about 100 us of
    CPU per batch (numpy's state is most of it). Leave it ``False`` for a source that draws
    (a shuffle of a shard's rows, an augmentation): every shard then draws the same wherever
    it is read."""

    seeks: bool = False
    """Whether ``open_shard(index, start, state)`` reaches ``start`` without reading the samples
    before it (a byte offset, an index), so their draws are not made again: its shards are read
    under each batch's seeding of the global RNGs, which per-sample draws need to be exact
    across resumes, and never under states of their own (module docstring)."""

    @property
    def own_rngs(self) -> bool:
        """Whether its shards are read under global-RNG states of their own (``open_reading``):
        neither ``rng_free`` nor ``seeks``."""
        return not (self.rng_free or self.seeks)

    @property
    @abstractmethod
    def shards(self) -> Sequence[Any]:
        """One descriptor per shard, in a fixed order (the plan shuffles indices into it)."""

    @property
    def shard_lengths(self) -> Sequence[int] | None:
        """Samples in each shard, or ``None`` when unknown."""
        return None

    @abstractmethod
    def open_shard(self, index: int, start: int = 0,
                   state: Mapping[str, Any] | None = None) -> Iterator[T]:
        """Samples of shard ``index`` from its sample ``start`` on.

        ``state``, when given, is what this source's shard iterator returned from
        ``state_dict()`` when it stood at sample ``start``.
        """

    def open_reading(self, index: int, start: int, state: Mapping[str, Any] | None,
                     seed: int, epoch: int) -> tuple[Iterator[T], AbstractContextManager[Any]]:
        """Shard ``index`` opened for the loader (``open_shard``), and the context its reads
        run inside: around a batch's read and, nested in it, each chunk of it, never per
        sample.

        Unless the source is ``rng_free`` or ``seeks``, the shard is opened with the global
        RNGs seeded from ``(seed, epoch, index)`` and read under states of its own carried
        from read to read (``ReadRngs``), so what it draws from them depends on the shard and
        how far it was read, never on the slot, the worker count, the backend or a resume.
        """
        if not self.own_rngs:
            return iter(self.open_shard(index, start, state)), nullcontext()
        return opened_under(lambda: iter(self.open_shard(index, start, state)),
                            _SHARD_TAG, seed, epoch, index)

    def sample_at(self, index: int, start: int, seed: int, epoch: int) -> T:
        """Sample ``start`` of shard ``index`` alone (random access, as a ``Mix`` reads a
        source): with ``own_rngs``, the shard is opened and read under the global RNGs seeded
        from ``(seed, epoch, index)`` as ``open_reading`` opens it (the caller's put back
        afterwards), so every sample of it in an epoch comes from one permutation, with the
        same draws, wherever and whenever it is read. ``StopIteration`` when the shard ends
        before ``start``."""
        def first() -> T:
            rows = iter(self.open_shard(index, start))
            try:
                return next(rows)
            finally:
                close = getattr(rows, "close", None)
                if callable(close):
                    close()

        return opened_under(first, _SHARD_TAG, seed, epoch, index)[0] if self.own_rngs else first()

    def describe_shard(self, index: int) -> str:
        """Shard ``index`` as errors name it: with its file, when its descriptor is a path."""
        shard = self.shards[index]
        return f"shard {index} ({shard})" if isinstance(shard, str) else f"shard {index}"

    @property
    def fingerprint(self) -> str:
        """Changes whenever the shards would read differently; checked on resume."""
        lengths = self.shard_lengths
        return (f"{type(self).__name__}:{len(self.shards)} shards:"
                f"{digest(list(lengths)) if lengths is not None else 'unknown lengths'}")

    def __iter__(self) -> Iterator[T]:
        """Every shard in order, unsharded (what a plain ``DataLoader`` would read)."""
        for index in range(len(self.shards)):
            yield from self.open_shard(index)

    def __len__(self) -> int:
        lengths = self.shard_lengths
        if lengths is None:
            raise TypeError(f"{type(self).__name__} does not know its shard lengths")
        return sum(lengths)


class SequenceSource(ShardedSource[T]):
    """In-memory sequences (lists, arrays, tensors, map-style datasets), one per shard."""

    seeks = True  # indexed from ``start``

    def __init__(self, sequences: Sequence[Sequence[T]]) -> None:
        if len(sequences) == 0:
            raise ValueError("SequenceSource needs at least one sequence")
        self.sequences = list(sequences)
        # a map-style dataset's __getitem__ may draw; plain containers do not
        self.rng_free = all(isinstance(sequence, _CONTAINERS) for sequence in self.sequences)

    @property
    def shards(self) -> Sequence[Sequence[T]]:
        return self.sequences

    @property
    def shard_lengths(self) -> list[int]:
        return [len(sequence) for sequence in self.sequences]

    def open_shard(self, index: int, start: int = 0,
                   state: Mapping[str, Any] | None = None) -> Iterator[T]:
        sequence = self.sequences[index]
        return map(sequence.__getitem__, range(start, len(sequence)))


class GeneratorSource(ShardedSource[T]):
    """A generator function per shard: ``fn(shard)`` yields the samples of ``shard``.

    Args:
        fn: called in the process that reads the shard (a worker), so it must be picklable (a
            module-level function). With ``seekable=True`` it is called as ``fn(shard, start)``
            and must begin at sample ``start``; otherwise the first ``start`` samples are read
            and skipped on resume.
        shards: the shard descriptors passed to ``fn`` (paths, ranges, seeds, ...). A state
            saved over other shards is refused (the fingerprint): a ``str`` or
            ``os.PathLike`` is compared by its last path component (a moved directory still
            resumes, as with the file sources), a number (numpy's too), ``bytes``, ``None``
            or a ``range`` by its value, a tuple or list item by item; any other object by
            its type's name alone (its ``repr`` may differ between processes), so a state
            over other such objects of the same lengths loads.
        lengths: samples per shard, if known.
        seekable: whether ``fn`` accepts a start position. Its shards are then read under
            each batch's seeding of the global RNGs (``ShardedSource.seeks``), so its order
            must not come from them (shuffle with ``random.Random(shard)``); without it the
            first ``start`` samples are read, and drawn, again, and its shards read under
            global-RNG states of their own.
        rng_free: ``True`` when ``fn`` never draws from the global ``random``, numpy and
            torch RNGs: its shards are then read without RNG states of their own, about
            100 us less per batch (see ``ShardedSource.rng_free``).
    """

    def __init__(self, fn: Callable[..., Iterable[T]], shards: Sequence[Any],
                 lengths: Sequence[int] | None = None, seekable: bool = False,
                 rng_free: bool = False) -> None:
        if not callable(fn):
            raise TypeError(f"GeneratorSource needs a callable fn(shard), got "
                            f"{type(fn).__name__}")
        self.fn = fn
        self._shards = list(shards)
        self._lengths = checked_lengths(lengths, len(self._shards))
        self.seekable = self.seeks = seekable
        self.rng_free = rng_free
        if not self._shards:
            raise ValueError("GeneratorSource needs at least one shard")

    @property
    def shards(self) -> Sequence[Any]:
        return self._shards

    @property
    def shard_lengths(self) -> list[int] | None:
        return self._lengths

    def open_shard(self, index: int, start: int = 0,
                   state: Mapping[str, Any] | None = None) -> Iterator[T]:
        shard = self._shards[index]
        if self.seekable:
            return iter(self.fn(shard, start))
        return itertools.islice(iter(self.fn(shard)), start, None)

    @property
    def fingerprint(self) -> str:
        """``fn``'s name, the shard count and lengths, and the shards (``shards`` above)."""
        described = [_described(shard) for shard in self._shards]
        return (f"{getattr(self.fn, '__qualname__', type(self.fn).__name__)}:"
                f"{super().fingerprint}:shards {digest(described)}")


class _FileShards(ShardedSource[T]):
    """Files as shards; subclasses say how one file is cut into samples."""

    seeks = True  # to a saved byte offset, or past records skipped undecoded

    def __init__(self, paths: str | os.PathLike[str] | Sequence[str | os.PathLike[str]],
                 lengths: Lengths = None, decode: Callable[[Any], T] | None = None) -> None:
        listed = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
        self.paths = [os.fspath(path) for path in listed]
        if not self.paths:
            raise ValueError(f"{type(self).__name__} needs at least one file")
        missing = [path for path in self.paths if not os.path.isfile(path)]
        if missing:
            raise FileNotFoundError(f"{type(self).__name__}: no such file(s): {missing[:5]}")
        if decode is not None and not callable(decode):
            raise TypeError(f"decode must be callable, got {type(decode).__name__}")
        self.decode = decode
        self.rng_free = decode is None  # a decode may draw (an augmentation)
        if lengths == "scan":
            self._lengths: list[int] | None = [self._count(path) for path in self.paths]
        else:
            self._lengths = checked_lengths(lengths, len(self.paths))

    @property
    def shards(self) -> list[str]:
        return self.paths

    @property
    def shard_lengths(self) -> list[int] | None:
        return self._lengths

    @property
    def fingerprint(self) -> str:
        names = [os.path.basename(path) for path in self.paths]
        return f"{super().fingerprint}:files {digest(names)}"

    @abstractmethod
    def _count(self, path: str) -> int:
        """Samples in the file at ``path`` (for ``lengths="scan"``)."""


class RecordFiles(_FileShards[T]):
    """Files of length-prefixed binary records (written by ``write_records``), one per shard.

    Each record is a 4-byte little-endian payload length and the payload; a sample is
    ``decode(payload)`` (the raw ``bytes`` without ``decode``). Skipping to a position hops over
    record headers without reading payloads, and a resume seeks straight to the saved byte
    offset. ``lengths="scan"`` counts the records of every file at construction (a header hop
    per record).
    """

    def open_shard(self, index: int, start: int = 0,
                   state: Mapping[str, Any] | None = None) -> Iterator[T]:
        return _RecordReader(self.paths[index], start, state, self.decode)

    def _count(self, path: str) -> int:
        return count_records(path)


class LineFiles(_FileShards[T]):
    """Text files read line by line, one file per shard.

    A sample is ``decode(line)`` (the line as ``str`` without its line ending when ``decode``
    is not given). A resume seeks to the saved byte offset; opening at another position reads
    and skips the lines before it. ``lengths="scan"`` counts the lines of every file.
    Lines are split at the byte 0x0A before they are decoded, so ``encoding`` must write a
    line feed as that one byte and never use it inside another character (UTF-8, Latin-1 and
    other ASCII supersets do; UTF-16 and UTF-32 are refused).
    """

    def __init__(self, paths: Sequence[str | os.PathLike[str]], lengths: Lengths = None,
                 decode: Callable[[str], T] | None = None, encoding: str = "utf-8") -> None:
        codecs.lookup(encoding)  # LookupError for an unknown encoding, now
        # a line feed, then a character that UTF-16 and UTF-32 write with 0x0A bytes
        if "\n\u0a0a".encode(encoding, errors="replace").count(b"\n") != 1:
            raise ValueError(f"LineFiles splits lines at the byte \\n before decoding them, and "
                             f"{encoding!r} is not an ASCII superset (it writes \\n otherwise, or "
                             "uses that byte inside other characters): convert the files to "
                             "UTF-8, or read them with a source of your own")
        self.encoding = encoding
        super().__init__(paths, lengths, decode)

    def open_shard(self, index: int, start: int = 0,
                   state: Mapping[str, Any] | None = None) -> Iterator[T]:
        return _LineReader(self.paths[index], start, state, self.decode, self.encoding)

    def _count(self, path: str) -> int:
        with open(path, "rb") as file:
            return sum(1 for _ in file)


class _FileReader(Iterator[T]):
    """An open shard file positioned at a sample; ``state_dict()`` is the byte offset."""

    def __init__(self, path: str, start: int, state: Mapping[str, Any] | None) -> None:
        self.path = path
        self.position = 0
        self._file: IO[bytes] | None = open(path, "rb")  # noqa: SIM115 (closed by close())
        if state is not None and state.get("position") == start:
            self._file.seek(int(state["offset"]))
            self.position = start
        while self.position < start and self._skip():
            self.position += 1

    def state_dict(self) -> dict[str, int]:
        assert self._file is not None
        return {"position": self.position, "offset": self._file.tell()}

    def __next__(self) -> T:
        if self._file is None:
            raise StopIteration
        sample = self._read()
        if sample is None:
            self.close()
            raise StopIteration
        self.position += 1
        return sample

    def close(self) -> None:
        file, self._file = self._file, None
        if file is not None:
            file.close()

    def __del__(self) -> None:
        self.close()

    @abstractmethod
    def _skip(self) -> bool:
        """Pass over one sample; ``False`` at the end of the file."""

    @abstractmethod
    def _read(self) -> T | None:
        """The next sample, ``None`` at the end of the file."""


class _RecordReader(_FileReader[T]):
    def __init__(self, path: str, start: int, state: Mapping[str, Any] | None,
                 decode: Callable[[bytes], T] | None) -> None:
        self.decode = decode
        super().__init__(path, start, state)

    def _header(self) -> int | None:
        assert self._file is not None
        header = self._file.read(_HEADER.size)
        if not header:
            return None
        if len(header) < _HEADER.size:
            raise ValueError(f"{self.path}: truncated record header after record "
                             f"{self.position} (is this a file written by write_records?)")
        return int(_HEADER.unpack(header)[0])

    def _skip(self) -> bool:
        assert self._file is not None
        size = self._header()
        if size is None:
            return False
        self._file.seek(size, os.SEEK_CUR)
        return True

    def _read(self) -> T | None:
        assert self._file is not None
        size = self._header()
        if size is None:
            return None
        payload = self._file.read(size)
        if len(payload) < size:
            raise ValueError(f"{self.path}: record {self.position} claims {size} bytes but only "
                             f"{len(payload)} remain (is this a file written by write_records?)")
        return self.decode(payload) if self.decode is not None else payload  # type: ignore[return-value]


class _LineReader(_FileReader[T]):
    def __init__(self, path: str, start: int, state: Mapping[str, Any] | None,
                 decode: Callable[[str], T] | None, encoding: str) -> None:
        self.decode, self.encoding = decode, encoding
        super().__init__(path, start, state)

    def _skip(self) -> bool:
        assert self._file is not None
        return bool(self._file.readline())

    def _read(self) -> T | None:
        assert self._file is not None
        line = self._file.readline()
        if not line:
            return None
        text = line.decode(self.encoding).rstrip("\r\n")
        return self.decode(text) if self.decode is not None else text  # type: ignore[return-value]


def write_records(path: str | os.PathLike[str], records: Iterable[bytes]) -> int:
    """Write ``records`` as a ``RecordFiles`` shard; returns how many were written."""
    count = 0
    with open(path, "wb") as file:
        for record in records:
            payload = bytes(record)
            if len(payload) >= 1 << 32:
                raise ValueError(f"record {count} of {path} has {len(payload)} bytes; the limit "
                                 "is 4 GiB - 1")
            file.write(_HEADER.pack(len(payload)))
            file.write(payload)
            count += 1
    return count


def count_records(path: str | os.PathLike[str]) -> int:
    """Records in a ``RecordFiles`` shard (hops over headers, never reads payloads)."""
    reader: _RecordReader[bytes] = _RecordReader(os.fspath(path), 0, None, None)
    count = 0
    while reader._skip():
        count += 1
    reader.close()
    return count


def _described(shard: Any) -> Any:
    """A ``GeneratorSource`` shard as its fingerprint compares it (see its ``shards``)."""
    if isinstance(shard, str | os.PathLike):
        return os.path.basename(os.path.normpath(os.fspath(shard)))
    if isinstance(shard, numbers.Integral):  # numpy's too
        return int(shard)
    if isinstance(shard, numbers.Real):
        return float(shard)
    if shard is None or isinstance(shard, bytes | range):
        return shard
    if isinstance(shard, tuple | list):
        return tuple(_described(item) for item in shard)
    return f"<{type(shard).__qualname__}>"


def checked_lengths(lengths: Any, count: int) -> list[int] | None:
    """``lengths`` as a list of ``count`` ints >= 0 (``None`` stays ``None``), or a
    ``ValueError`` naming what is wrong."""
    if lengths is None:
        return None
    if isinstance(lengths, str):
        raise ValueError(f"lengths must be a sequence of ints or None, got {lengths!r} (file "
                         "sources also take 'scan', to count their samples)")
    values = list(lengths)
    if len(values) != count:
        raise ValueError(f"lengths has {len(values)} entries for {count} shards")
    bad = [v for v in values if not isinstance(v, int) or isinstance(v, bool) or v < 0]
    if bad:
        raise ValueError(f"shard lengths must be ints >= 0, got {bad[:5]}")
    return values
