"""Copy-on-access-safe storage for Python-object sample metadata (paths, labels, records).

Forked workers share the parent's memory copy-on-write, but CPython writes into every object it
touches (its reference count) and the cyclic garbage collector writes into every container it
tracks. A dataset holding a list of a million dicts or strings is therefore copied, page by
page, into every worker as an epoch reads it: worker memory grows by the size of the metadata
per worker (the "DataLoader memory leak" of forked workers). The containers here hold the same
data in a few flat numpy buffers, so there is nothing per sample to write to: workers read the
parent's pages without copying them.
"""

from __future__ import annotations

import os
import pickle
from collections.abc import Iterator, Mapping, Sequence
from pathlib import PurePath
from typing import Any, overload

import numpy as np

__all__ = ["PackedObjects", "PackedPaths", "PackedRecords", "PackedStrings", "pack"]

_INT64_MIN, _INT64_MAX = -(2**63), 2**63 - 1


class _Packed(Sequence[Any]):
    """Shared sequence behaviour: ``len``, int and slice indexing, iteration."""

    def __len__(self) -> int:
        raise NotImplementedError

    def _get(self, index: int) -> Any:
        raise NotImplementedError

    @overload
    def __getitem__(self, index: int) -> Any: ...

    @overload
    def __getitem__(self, index: slice) -> list[Any]: ...

    def __getitem__(self, index: int | slice) -> Any:
        size = len(self)
        if isinstance(index, slice):
            return [self._get(i) for i in range(*index.indices(size))]
        i = index.__index__()
        if i < 0:
            i += size
        if not 0 <= i < size:
            raise IndexError(f"index {index} out of range for {type(self).__name__} of length "
                             f"{size}")
        return self._get(i)

    def __iter__(self) -> Iterator[Any]:
        return (self._get(i) for i in range(len(self)))

    def __repr__(self) -> str:
        return f"{type(self).__name__}(len={len(self)}, nbytes={self.nbytes})"

    @property
    def nbytes(self) -> int:
        """Bytes held in buffers."""
        raise NotImplementedError


class _Blobs:
    """Variable-length byte strings: one ``bytes`` buffer and an int64 array of offsets."""

    __slots__ = ("data", "offsets", "size")

    def __init__(self, blobs: Sequence[bytes]) -> None:
        self.size = len(blobs)
        self.offsets = np.zeros(self.size + 1, dtype=np.int64)
        np.cumsum([len(b) for b in blobs], out=self.offsets[1:])
        self.data = b"".join(blobs)

    def get(self, i: int) -> bytes:
        return self.data[self.offsets.item(i):self.offsets.item(i + 1)]

    @property
    def nbytes(self) -> int:
        return len(self.data) + int(self.offsets.nbytes)


class PackedStrings(_Packed):
    """A sequence of ``str`` (paths accepted, returned as ``str``) in one UTF-8 buffer."""

    def __init__(self, strings: Sequence[str | os.PathLike[str]]) -> None:
        encoded = []
        for i, item in enumerate(strings):
            if not isinstance(item, str | os.PathLike):
                raise TypeError(f"PackedStrings holds str or os.PathLike items; item {i} is a "
                                f"{type(item).__name__}: {item!r}")
            encoded.append(os.fspath(item).encode("utf-8", "surrogatepass"))
        self._blobs = _Blobs(encoded)

    def __len__(self) -> int:
        return self._blobs.size

    def _get(self, index: int) -> str:
        return self._blobs.get(index).decode("utf-8", "surrogatepass")

    @property
    def nbytes(self) -> int:
        return self._blobs.nbytes


class PackedPaths(_Packed):
    """A sequence of paths of one ``PurePath`` type (``Path``, ``PurePosixPath``...) in one
    UTF-8 buffer, given back as that type (a path is rebuilt exactly from its string)."""

    def __init__(self, paths: Sequence[PurePath]) -> None:
        if not _same_paths(paths):
            raise TypeError(f"PackedPaths holds paths of one PurePath type; got "
                            f"{sorted({type(path).__name__ for path in paths})}")
        self._type = type(paths[0])
        self._strings = PackedStrings(paths)

    def __len__(self) -> int:
        return len(self._strings)

    def _get(self, index: int) -> PurePath:
        return self._type(self._strings._get(index))

    @property
    def nbytes(self) -> int:
        return self._strings.nbytes


class PackedObjects(_Packed):
    """A sequence of any picklable objects, each pickled into one shared buffer (unpickled on
    access, so every access returns a fresh copy)."""

    def __init__(self, items: Sequence[Any]) -> None:
        self._blobs = _Blobs([pickle.dumps(item, protocol=pickle.HIGHEST_PROTOCOL)
                              for item in items])

    def __len__(self) -> int:
        return self._blobs.size

    def _get(self, index: int) -> Any:
        return pickle.loads(self._blobs.get(index))

    @property
    def nbytes(self) -> int:
        return self._blobs.nbytes


class PackedRecords(_Packed):
    """A sequence of dicts with the same keys, stored column by column.

    Columns of only ``int`` (within int64), only ``float`` or only ``bool`` values become numpy
    arrays, columns of only ``str`` a ``PackedStrings``, of paths of one type a ``PackedPaths``,
    anything else a ``PackedObjects``; ``records[i]`` rebuilds the dict with the original value
    types. ``column(key)`` gives a whole column (a numpy array for numbers: handy for vectorised
    work such as class weights).
    """

    def __init__(self, records: Sequence[Mapping[str, Any]]) -> None:
        if not len(records):
            self._keys: tuple[str, ...] = ()
            self._columns: tuple[np.ndarray | _Packed, ...] = ()
            self._length = 0
            return
        first = records[0]
        if not isinstance(first, Mapping):
            raise TypeError(f"PackedRecords holds dicts; record 0 is a {type(first).__name__}")
        keys = tuple(first)
        values: dict[str, list[Any]] = {key: [] for key in keys}
        for i, record in enumerate(records):
            if not isinstance(record, Mapping) or record.keys() != first.keys():
                got = sorted(record) if isinstance(record, Mapping) else type(record).__name__
                raise ValueError(f"PackedRecords needs dicts with the same keys: record 0 has "
                                 f"{sorted(keys)}, record {i} has {got}")
            for key in keys:
                values[key].append(record[key])
        self._keys = keys
        self._columns = tuple(_column(values.pop(key)) for key in keys)
        self._length = len(records)

    def __len__(self) -> int:
        return self._length

    def _get(self, index: int) -> dict[str, Any]:
        return {key: column.item(index) if isinstance(column, np.ndarray) else column._get(index)
                for key, column in zip(self._keys, self._columns, strict=True)}

    def keys(self) -> tuple[str, ...]:
        """The records' keys, in the first record's order."""
        return self._keys

    def column(self, key: str) -> np.ndarray | Sequence[Any]:
        """All values of ``key``: a numpy array for number columns, else a packed sequence."""
        try:
            return self._columns[self._keys.index(key)]
        except ValueError:
            raise KeyError(f"no column {key!r}; the records have {list(self._keys)}") from None

    @property
    def nbytes(self) -> int:
        return sum(int(c.nbytes) for c in self._columns)


def _column(values: list[Any]) -> np.ndarray | _Packed:
    kinds = {type(v) for v in values}
    if kinds == {bool}:
        return np.array(values, dtype=np.bool_)
    if kinds == {float}:
        return np.array(values, dtype=np.float64)
    if kinds == {int} and _INT64_MIN <= min(values) and max(values) <= _INT64_MAX:
        return np.array(values, dtype=np.int64)
    if kinds == {str}:
        return PackedStrings(values)
    if _same_paths(values):
        return PackedPaths(values)
    return PackedObjects(values)


def _same_paths(items: Sequence[Any]) -> bool:
    """Whether ``items`` are paths of one ``PurePath`` type, which ``PackedPaths`` rebuilds."""
    return (bool(len(items)) and isinstance(items[0], PurePath)
            and all(type(item) is type(items[0]) for item in items))


def pack(items: Sequence[Any]) -> PackedStrings | PackedPaths | PackedRecords | PackedObjects:
    """Pack a list of sample metadata into the most compact copy-on-access-safe container.

    Strings give ``PackedStrings``; paths of one type (``Path``, ``PurePosixPath``...)
    ``PackedPaths``, which gives them back as that type; dicts that share their keys
    ``PackedRecords``; anything else (strings and paths mixed too) ``PackedObjects``. The
    result is a read-only sequence: use it where the dataset kept the list
    (``self.samples = pack(samples)``).
    """
    if len(items) and all(isinstance(item, str) for item in items):
        return PackedStrings(items)
    if _same_paths(items):
        return PackedPaths(items)
    if len(items) and isinstance(items[0], Mapping):
        keys = items[0].keys()
        if all(isinstance(item, Mapping) and item.keys() == keys for item in items):
            return PackedRecords(items)
    return PackedObjects(items)
