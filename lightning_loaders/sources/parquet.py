"""Parquet and Arrow IPC files as sharded sources: ``ParquetSource`` (a shard per row group)
and ``ArrowSource`` (a shard per record batch of Arrow IPC files, Feather v2).

Shard lengths come from the files' metadata, read once at construction, so ``len()`` is exact,
every ``last_batch`` policy works and the loader's state is O(1). Opening shard ``i`` at row
``start`` reads only that row group (or record batch) and only the wanted columns, then converts
its rows from ``start`` on, column by column, a block of rows at a time: a resume seeks by row
group and never converts the rows it skips. A sample is a dict of column -> value, as
``arrow_rows`` gives it (numeric columns as numpy values, the others as Python values).

Files found below a directory (or a glob's fixed part) get its Hive partition keys, the
``key=value`` directories between it and them, as columns, as ``pyarrow.dataset`` reads them with
``partitioning="hive"``: after the file's columns, URI-decoded, int32 where every value of the key
parses as one, else strings, ``__HIVE_DEFAULT_PARTITION__`` and a key a file's path lacks as null.

Sources hold paths, never open files, so they pickle to worker processes, which open the files
themselves. pyarrow is imported only when a source is made.
"""

from __future__ import annotations

import glob
import os
import sys
from abc import abstractmethod
from collections.abc import Iterator, Mapping, Sequence
from typing import Any
from urllib.parse import unquote

from lightning_loaders.hashing import digest
from lightning_loaders.sources.shards import ShardedSource
from lightning_loaders.sources.tables import arrow_rows, check_columns

__all__ = ["ArrowSource", "ParquetSource"]

Paths = str | os.PathLike[str] | Sequence[str | os.PathLike[str]]

_CONVERT_ROWS = 1024  # rows converted to Python at a time: bounds the work a slot may waste


class _ColumnarFiles(ShardedSource[dict[str, Any]]):
    """Columnar files cut into pieces (row groups, record batches): one shard per piece."""

    suffixes: tuple[str, ...] = ()
    rng_free = True  # no code of the user's runs
    piece_name = "piece"  # what a shard of a file is (a Parquet row group, an Arrow batch)

    def __init__(self, paths: Paths, columns: Sequence[str] | None = None, *,
                 filesystem: Any = None) -> None:
        self.filesystem = filesystem
        found = _expand(paths, self.suffixes, filesystem, type(self).__name__)
        self.paths = [path for path, _ in found]
        keys, self._key_types = _partition_keys([below for _, below in found])
        partitioned = list(self._key_types)
        wanted: Sequence[str] | None = columns
        self._shards: list[tuple[str, int]] = []
        self._lengths: list[int] = []
        self._shard_keys: list[dict[str, Any]] = []  # the partition keys of each shard's file
        types: dict[str, Any] = {}  # the first file's type of each wanted column
        for (path, below), values in zip(found, keys, strict=True):
            in_file = None if wanted is None else [n for n in wanted if n not in partitioned]
            schema, lengths = self._describe(path, in_file)
            chosen = [key for key in partitioned if wanted is None or key in wanted]
            _check_no_clash(list(schema.names), chosen, path, found)
            wanted = _checked_columns(wanted, list(schema.names) + partitioned, path, below)
            for name in (n for n in wanted if n not in partitioned):
                kind = types.setdefault(name, schema.field(name).type)
                if schema.field(name).type != kind:
                    raise ValueError(
                        f"column {name!r} is {schema.field(name).type} in {path} but {kind} in "
                        f"{self.paths[0]}: a sample's type would depend on its file. Cast the "
                        "files to one schema, or leave the column out (columns=...)")
            self._shards += [(path, piece) for piece in range(len(lengths))]
            self._lengths += lengths
            self._shard_keys += [values] * len(lengths)
        assert wanted is not None
        self.columns: list[str] = list(wanted)
        self._file_columns = [name for name in self.columns if name not in self._key_types]
        self._keys = keys

    @property
    def shards(self) -> list[tuple[str, int]]:
        """``(path, piece)`` per shard: the file and its row group or record batch."""
        return self._shards

    @property
    def shard_lengths(self) -> list[int]:
        return self._lengths

    def open_shard(self, index: int, start: int = 0,
                   state: Mapping[str, Any] | None = None) -> Iterator[dict[str, Any]]:
        path, piece = self._shards[index]
        return self._rows(path, piece, start, self._shard_keys[index])

    def describe_shard(self, index: int) -> str:
        path, piece = self._shards[index]
        return f"shard {index} ({path}, {self.piece_name} {piece})"

    @property
    def fingerprint(self) -> str:
        names = [os.path.basename(path) for path in self.paths]
        fingerprint = f"{super().fingerprint}:files {digest(names)}:columns {digest(self.columns)}"
        wanted = [name for name in self.columns if name in self._key_types]
        if not wanted:
            return fingerprint
        values = [[keys[name] for name in wanted] for keys in self._keys]
        return f"{fingerprint}:partitions {digest(values)}"

    def __repr__(self) -> str:
        return (f"{type(self).__name__}({len(self.paths)} files, {len(self._shards)} shards, "
                f"{sum(self._lengths)} rows, columns={self.columns})")

    def _rows(self, path: str, piece: int, start: int,
              keys: dict[str, Any]) -> Iterator[dict[str, Any]]:
        import pyarrow as pa

        table = self._read(path, piece)
        if len(self._file_columns) < len(self.columns):  # partition keys wanted
            for name in (n for n in self.columns if n in self._key_types):
                value = pa.scalar(keys[name], self._key_types[name])
                table = table.append_column(name, pa.repeat(value, table.num_rows))
            table = table.select(self.columns)
        for offset in range(start, table.num_rows, _CONVERT_ROWS):
            yield from arrow_rows(table.slice(offset, _CONVERT_ROWS))

    @abstractmethod
    def _describe(self, path: str, columns: list[str] | None) -> tuple[Any, list[int]]:
        """The file's ``pyarrow.Schema`` and the rows of each piece, from its metadata
        (``columns``: the wanted ones, when known)."""

    @abstractmethod
    def _read(self, path: str, piece: int) -> Any:
        """Piece ``piece`` of the file, its wanted columns only (``_file_columns``), as a
        ``pyarrow.Table``."""


class ParquetSource(_ColumnarFiles):
    """Parquet files, one shard per row group.

    Args:
        paths: Parquet files, directories (searched recursively for ``.parquet``, ``.parq``
            and ``.pq`` files, in sorted order; names starting with ``.`` or ``_`` are left
            out) or glob patterns (``data/**/*.parquet``); files in the order given.
        columns: the columns a sample holds, in this order (default: the first file's, then
            the partition keys). Only these are read. Every file must have them, of the same
            types.
        filesystem: a ``pyarrow.fs.FileSystem`` the paths are on (default: local paths);
            glob patterns need local paths.

    The footers are read at construction (no data); a shard read loads one row group. The
    Hive partition keys of files below a directory or glob given (``year=2020/...``) are
    columns, as ``pyarrow.dataset.dataset(path, partitioning="hive")`` reads them (see the
    module's docstring); a file named itself has none. A ``pyarrow.dataset.Dataset`` is
    refused: give the directory it was made from.
    """

    suffixes = (".parquet", ".parq", ".pq")
    piece_name = "row group"

    def _describe(self, path: str, columns: list[str] | None) -> tuple[Any, list[int]]:
        import pyarrow.parquet as pq

        try:
            metadata = pq.read_metadata(path, filesystem=self.filesystem)
        except Exception as exc:
            raise ValueError(f"{path} is not a readable Parquet file: {exc}") from exc
        lengths = [metadata.row_group(i).num_rows for i in range(metadata.num_row_groups)]
        return metadata.schema.to_arrow_schema(), lengths

    def _read(self, path: str, piece: int) -> Any:
        import pyarrow.parquet as pq

        with pq.ParquetFile(path, filesystem=self.filesystem) as file:
            return file.read_row_group(piece, columns=self._file_columns)


class ArrowSource(_ColumnarFiles):
    """Arrow IPC files (the file format, also written as Feather v2), one shard per record
    batch.

    Arguments as for ``ParquetSource``; directories are searched for ``.arrow``, ``.feather``
    and ``.ipc`` files. Local files are memory-mapped and read without a copy when
    uncompressed. The row count of each record batch is read at construction: free for an
    uncompressed file; a compressed one (Feather's default is LZ4) decompresses the first
    wanted column once for it. The Arrow IPC *stream* format has no random access: convert it
    with ``pyarrow.ipc.new_file``.
    """

    suffixes = (".arrow", ".feather", ".ipc")
    piece_name = "record batch"

    def _describe(self, path: str, columns: list[str] | None) -> tuple[Any, list[int]]:
        import pyarrow as pa

        try:
            with self._open(path) as source:
                schema = pa.ipc.open_file(source).schema
                names = list(schema.names)
        except pa.ArrowInvalid as exc:
            raise ValueError(f"{path} is not an Arrow IPC file ({exc}); write one with "
                             "pyarrow.ipc.new_file or pyarrow.feather.write_feather") from exc
        first = (columns or names or [None])[0]
        fields = [names.index(first)] if first in names else None
        with self._open(path) as source:
            reader = self._reader(source, fields)
            return schema, [reader.get_batch(i).num_rows
                            for i in range(reader.num_record_batches)]

    def _read(self, path: str, piece: int) -> Any:
        import pyarrow as pa

        with self._open(path) as source:
            reader = self._reader(source, None)
            fields = [reader.schema.get_field_index(name) for name in self._file_columns]
            reader = self._reader(source, sorted(fields))
            batch = reader.get_batch(piece).select(self._file_columns)
            return pa.Table.from_batches([batch])

    def _open(self, path: str) -> Any:
        import pyarrow as pa

        if self.filesystem is None:
            return pa.memory_map(path)
        return self.filesystem.open_input_file(path)

    @staticmethod
    def _reader(source: Any, fields: list[int] | None) -> Any:
        import pyarrow as pa

        options = None if fields is None else pa.ipc.IpcReadOptions(included_fields=fields)
        return pa.ipc.open_file(source, options=options)


def _expand(paths: Paths, suffixes: tuple[str, ...], filesystem: Any,
            owner: str) -> list[tuple[str, str | None]]:
    """Files, directories and glob patterns to the files they name, each with its path below
    the directory searched (or the glob's part before its first wildcard); ``None`` for a file
    named itself."""
    dataset = sys.modules.get("pyarrow.dataset")
    if dataset is not None and isinstance(paths, dataset.Dataset):
        raise TypeError(
            f"{owner} takes paths, not a pyarrow.dataset.{type(paths).__name__} (its filter, "
            f"schema and format would be ignored): pass the directory it was made from (its "
            f"Hive partition keys become columns alike), its files ({owner}(ds.files, "
            f"filesystem=ds.filesystem), without partition columns), or the table in memory "
            f"(TableDataset(ds.to_table())).")
    items = [paths] if isinstance(paths, str | os.PathLike) else list(paths)
    found: list[tuple[str, str | None]] = []
    for item in items:
        path = os.fspath(item)
        if filesystem is not None:
            found += _expand_on(filesystem, path, suffixes, owner)
        elif any(char in path for char in "*?["):
            matches = sorted(p for p in glob.glob(path, recursive=True) if os.path.isfile(p))
            if not matches:
                raise FileNotFoundError(f"{owner}: no file matches {path!r}")
            fixed = path.replace(os.sep, "/").split("/")
            root = "/".join(fixed[:next(k for k, part in enumerate(fixed)
                                        if any(char in part for char in "*?["))] + [""])
            found += [(match, os.path.relpath(match, root or os.curdir)) for match in matches]
        elif os.path.isdir(path):
            found += _in_directory(path, suffixes, owner)
        elif os.path.isfile(path):
            found.append((path, None))
        else:
            raise FileNotFoundError(f"{owner}: no such file or directory: {path!r}")
    if not found:
        raise ValueError(f"{owner} needs at least one file")
    return found


def _expand_on(filesystem: Any, path: str, suffixes: tuple[str, ...],
               owner: str) -> list[tuple[str, str | None]]:
    from pyarrow import fs

    info = filesystem.get_file_info(path)
    if info.type == fs.FileType.File:
        return [(path, None)]
    if info.type != fs.FileType.Directory:
        raise FileNotFoundError(f"{owner}: no such file or directory on {filesystem}: {path!r}")
    listed = filesystem.get_file_info(fs.FileSelector(path, recursive=True))
    prefix = path.rstrip("/") + "/"
    below = {entry.path: entry.path[len(prefix):] if entry.path.startswith(prefix)
             else entry.path for entry in listed if entry.type == fs.FileType.File}
    files = sorted(name for name, relative in below.items() if _wanted(relative, suffixes))
    if not files:
        raise FileNotFoundError(f"{owner}: no {'/'.join(suffixes)} file under {path!r}")
    return [(name, below[name]) for name in files]


def _in_directory(root: str, suffixes: tuple[str, ...],
                  owner: str) -> list[tuple[str, str | None]]:
    files = sorted(os.path.join(folder, name) for folder, _, names in os.walk(root)
                   for name in names)
    found: list[tuple[str, str | None]] = [
        (path, below) for path in files if _wanted(below := os.path.relpath(path, root), suffixes)]
    if not found:
        raise FileNotFoundError(f"{owner}: no {'/'.join(suffixes)} file under {root!r}")
    return found


def _wanted(relative: str, suffixes: tuple[str, ...]) -> bool:
    """A data file, by its path below the directory searched: the right suffix, and no hidden
    part (``.x``, ``_x``)."""
    parts = relative.replace(os.sep, "/").split("/")
    return relative.endswith(suffixes) and not any(p.startswith((".", "_")) for p in parts)


def _hive_keys(below: str | None) -> dict[str, str | None]:
    """The ``key=value`` directories of a path below the directory searched, URI-decoded;
    Hive's ``__HIVE_DEFAULT_PARTITION__`` is a null (as ``pyarrow.dataset.HivePartitioning``)."""
    keys: dict[str, str | None] = {}
    for part in (below or "").replace(os.sep, "/").split("/")[:-1]:
        key, equals, value = part.partition("=")
        if equals:
            keys[unquote(key)] = None if value == "__HIVE_DEFAULT_PARTITION__" else unquote(value)
    return keys


def _partition_keys(below: list[str | None]) -> tuple[list[dict[str, Any]], dict[str, Any]]:
    """Each file's value of every Hive partition key (null where its path has none) and each
    key's type: int32 where every value of the key parses as one (pyarrow's own cast decides,
    as its partitioning discovery does), else string."""
    import pyarrow as pa
    import pyarrow.compute as pc

    found = [_hive_keys(path) for path in below]
    types: dict[str, Any] = {}
    typed: list[dict[str, Any]] = [{} for _ in found]
    for name in dict.fromkeys(name for keys in found for name in keys):
        reprs = pa.array([keys.get(name) for keys in found], pa.string())
        try:
            values, types[name] = pc.cast(reprs, pa.int32()).to_pylist(), pa.int32()
        except pa.ArrowInvalid:
            values, types[name] = reprs.to_pylist(), pa.string()
        for into, value in zip(typed, values, strict=True):
            into[name] = value
    return typed, types


def _check_no_clash(names: list[str], keys: list[str], path: str,
                    found: list[tuple[str, str | None]]) -> None:
    """Refuses a file column that is also a partition key a sample holds (``keys``: those
    chosen): it would hold two values for it (pyarrow fails to merge two types, and of one
    type replaces the file's values). A key left out of ``columns=`` clashes with nothing."""
    clash = [name for name in names if name in keys]
    if clash:
        where = next(below for _, below in found if clash[0] in _hive_keys(below))
        raise ValueError(
            f"{path} has column(s) {clash} that are also Hive partition keys ({where}): a sample "
            "would hold two values for each. Rename the column or the directory, or name the "
            "files themselves (partition keys come from directories and globs)")


def _checked_columns(wanted: Sequence[str] | None, available: list[str], path: str,
                     below: str | None) -> list[str]:
    """``check_columns``, pointing a missing column that is a ``key=value`` directory of a file
    named itself to its directory."""
    try:
        return check_columns(wanted, available, path)
    except ValueError as exc:
        keys = _hive_keys(path) if below is None else {}
        missing = [name for name in wanted or () if name in keys and name not in available]
        if not missing:
            raise
        raise ValueError(f"{exc}. {missing} are Hive partition keys of its path: they become "
                         "columns when the directory above them (or a glob) is given, not a "
                         "file itself") from exc
