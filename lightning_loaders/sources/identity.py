"""``content_identity``: what a map-style dataset's rows are, for the loader's fingerprint, from
the datasets that can tell cheaply and deterministically.

The fingerprint otherwise holds the dataset's length, so a state saved over one dataset would
resume mid-epoch over other data of the same length. The identity is a digest of the column
names and of a few rows spread over the dataset (the first, the last and evenly between), read
as Arrow column by column, and of the row count. It is chosen to stay the same wherever the
same rows are rebuilt, since refusing a valid resume is as bad as accepting a wrong one:

- Hugging Face's ``Dataset._fingerprint`` is not used: it changes with every transform, and a
  ``map`` whose function cannot be hashed gets a random one, new in every process. Cache file
  names are not used either: in-memory datasets have none, and such a ``map`` writes new ones.
- Rows are read with ``with_format("arrow")``, so a ``set_transform`` or format (user code,
  maybe random augmentations) never runs; through the dataset's indices, so rows rearranged by
  ``select``/``shuffle``/``sort`` count as other content (a ``shuffle()`` without a seed, new
  in every process, is then refused: give it a seed).
- Values, not Arrow types or Hugging Face features: the same values stored with another
  integer or float width, string or list type are the same samples. An image or audio cell
  stored as a path (``imagefolder``) counts by its file name, not its directory: data copied
  elsewhere (a job's local disk) resumes; files of the same names elsewhere are not told apart.

A few rows cannot see a change between them (a dataset edited in one row), but they see other
files, another split, and another order. Wide rows are read at a bounded cost, never as Python
values: numbers, strings and lists of them straight from Arrow's buffers, and of each array (a
column, the values its lists hold, the bytes of its strings) at most ``_VALUES`` entries
spread over it, so 30 s of speech per row costs a few milliseconds, as a few values do (an
edit inside a wide cell, like one between the rows, may go unseen). A plain torch dataset has
no such identity (reading a sample may decode an image or draw an augmentation): ``None``, and
its fingerprint keeps the length alone.
"""

from __future__ import annotations

import sys
from typing import Any

import numpy as np

from lightning_loaders.hashing import digest
from lightning_loaders.sources.mix import Mix
from lightning_loaders.sources.tables import TableDataset, is_view

__all__ = ["content_identity"]

_ROWS = 8  # rows read
_VALUES = 1 << 16  # values (or bytes) read of each array of them: the cost of the widest rows
_LIST_TYPES = ("is_list", "is_large_list", "is_fixed_size_list", "is_list_view",
               "is_large_list_view")  # pyarrow.types predicates, where this pyarrow has them
_MEDIA = {"bytes", "path"}  # the Arrow storage of Hugging Face's Image, Audio and Video cells


def content_identity(dataset: Any) -> str | None:
    """A short, deterministic identity of ``dataset``'s rows: for a ``TableDataset``, a Hugging
    Face ``datasets.Dataset``, and a ``Mix`` with either among its sources; ``None`` for any
    other dataset (see the module docstring)."""
    if isinstance(dataset, TableDataset):
        rows = dataset.table.take(_positions(len(dataset), _ROWS))
        return _rows_identity("TableDataset", rows, len(dataset))
    hf = sys.modules.get("datasets")  # never imported here: an HF dataset has imported it
    if hf is not None and isinstance(dataset, hf.Dataset):
        rows = dataset.with_format("arrow")[_positions(len(dataset), _ROWS).tolist()]
        return _rows_identity("datasets.Dataset", rows, len(dataset))
    if isinstance(dataset, Mix):
        members = [content_identity(source) for source in dataset.sources]
        return None if all(m is None for m in members) else f"Mix {digest(members)}"
    return None


def _positions(length: int, count: int) -> np.ndarray:
    """``count`` positions spread evenly over ``length``, the first and last included (all of
    them when there are no more)."""
    if length <= count:
        return np.arange(length)
    return (length - 1) * np.arange(count) // (count - 1)


def _rows_identity(kind: str, rows: Any, length: int) -> str:
    """The identity of a dataset of ``length`` rows from the Arrow table of its sampled rows."""
    values = [_column(column.combine_chunks()) for column in rows.columns]
    return f"{kind} rows {digest([length, list(rows.column_names), values])}"


def _column(array: Any) -> Any:
    """``array``'s values as the identity reads them, column by column and level by level,
    never converting a number, string or list of them to Python: numbers by ``_numbers``,
    strings and bytes as their lengths and bytes, lists as their lengths and the values they
    hold, so other widths of the same values read the same. Each array is read at ``_spread``
    (a wide row costs as much as a narrow one). The ``path`` of a Hugging Face media cell (a
    ``{"bytes", "path"}`` struct: ``Image``, ``Audio``, ``Video``) counts by its file name,
    since where the files lie is not what they are (a job that copies its data to local disk
    resumes). Other types (dates, decimals, maps) as Python values."""
    import pyarrow as pa
    import pyarrow.compute as pc

    kind = array.type
    if isinstance(array, pa.ExtensionArray):
        return _column(array.storage)
    if pa.types.is_dictionary(kind):
        return _column(array.dictionary_decode())
    nulls = digest(_spread(array.is_null()).to_numpy(zero_copy_only=False)) \
        if array.null_count else None
    if pa.types.is_integer(kind) or pa.types.is_floating(kind) or pa.types.is_boolean(kind):
        return "numbers", nulls, digest(_numbers(_spread(array)))
    if _is_text(kind):
        return "str", nulls, *_lengths_and_bytes(array)
    if _is_bytes(kind):
        return "bytes", nulls, *_lengths_and_bytes(array)
    if any(getattr(pa.types, name, lambda _: False)(kind) for name in _LIST_TYPES):
        lengths = pc.list_value_length(array).fill_null(0)
        return ("list", nulls, digest(_spread(lengths).to_numpy().astype(np.int64)),
                _column(array.flatten()))
    if pa.types.is_struct(kind):
        fields = dict(zip([field.name for field in kind], array.flatten(), strict=True))
        if fields.keys() == _MEDIA and _is_text(fields["path"].type):
            fields["path"] = pc.replace_substring_regex(fields["path"], r"^.*[/\\]", "")
        return "struct", nulls, {name: _column(field) for name, field in fields.items()}
    return _spread(array).to_pylist()


def _spread(values: Any) -> Any:
    """At most ``_VALUES`` of ``values`` (an Arrow or numpy array), evenly spread, the first and
    last included: what the identity reads of an array, however wide its rows."""
    return values if len(values) <= _VALUES else values.take(_positions(len(values), _VALUES))


def _numbers(array: Any) -> np.ndarray:
    """A numeric Arrow array's values as int64, float64 (NaNs made one) or bool, whatever width
    stores them; a null as a zero (``_column`` digests where they are)."""
    import pyarrow as pa

    if array.null_count:
        array = array.fill_null(False if pa.types.is_boolean(array.type) else 0)
    values = array.to_numpy(zero_copy_only=False)
    if values.dtype.kind == "f":
        values = values.astype(np.float64)
        values[np.isnan(values)] = np.nan
    if values.dtype.kind == "u" and len(values) and values.max() > np.iinfo(np.int64).max:
        return values  # as uint64: as int64 they would read as other, negative, values
    return values.astype(np.int64) if values.dtype.kind in "iu" else values


def _is_text(kind: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_string(kind) or pa.types.is_large_string(kind) or is_view(kind))


def _is_bytes(kind: Any) -> bool:
    import pyarrow as pa

    return bool(pa.types.is_binary(kind) or pa.types.is_large_binary(kind)
                or is_view(kind, "is_binary_view"))


def _lengths_and_bytes(array: Any) -> tuple[str, str]:
    """The digests of the lengths of a string or binary array's values, and of their bytes
    (``_spread``), read from its Arrow buffers (a view cast whole first: ``take`` has no
    kernel for views)."""
    import pyarrow as pa

    if is_view(array.type) or is_view(array.type, "is_binary_view"):
        array = array.cast(pa.large_binary())
    sample = _spread(array).cast(pa.large_binary())
    _, offsets, data = sample.buffers()
    ends = np.frombuffer(offsets, dtype=np.int64)[sample.offset:sample.offset + len(sample) + 1]
    content = np.frombuffer(data, dtype=np.uint8)[ends[0]:ends[-1]]
    return digest(np.diff(ends)), digest(_spread(content))
