"""Tables as map-style datasets: ``TableDataset`` over a pandas or polars ``DataFrame`` or a
``pyarrow.Table``, and ``arrow_rows`` (an Arrow table as samples, converted column by column).

A sample is a dict of column -> value. Numeric columns (integers, floats, booleans, and
fixed-size lists of them) give numpy values: a scalar per row, or an array of the list's shape,
so ``default_collate`` makes tensors of the column's dtype; a null in a float column is NaN
(pandas turns NaN into nulls). Every other column, and an integer or boolean column with nulls,
gives Python values (``str``, ``bytes``, ``list``, ``datetime``, ``None`` for a null, ...).

A ``TableDataset`` whose columns are all numeric is gathered by the loader a whole batch at a
time, one vectorised take per column straight into tensors (no per-row Python); one with other
columns fetches a batch with one ``take`` through ``__getitems__``. pyarrow (and pandas or
polars) are imported only when a table is used, never by ``import lightning_loaders``.
"""

from __future__ import annotations

import operator
from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset

__all__ = ["TableDataset", "arrow_rows", "is_view"]


class TableDataset(Dataset[dict[str, Any]]):
    """A table as a map-style dataset: sample ``i`` is row ``i``, a dict of column -> value.

    Args:
        table: a ``pyarrow.Table`` or ``RecordBatch``, a pandas ``DataFrame`` or a polars
            ``DataFrame``. pandas and polars frames are converted to Arrow once, here (a copy
            for pandas; the frame's index is not a column). Columns split into several chunks
            are made contiguous once, so that numeric columns are numpy views of Arrow memory,
            and string and binary views (Arrow's ``string_view``, ``binary_view``, which its
            ``take`` cannot gather) are cast once to large strings and binaries.
        columns: the columns a sample holds, in this order (default: all of them).
    """

    def __init__(self, table: Any, columns: Sequence[str] | None = None) -> None:
        arrow = _as_arrow(table)
        self.columns: list[str] = check_columns(columns, list(arrow.column_names),
                                                f"the {type(table).__name__}")
        self.table = _takeable(arrow.select(self.columns).combine_chunks())
        self._arrays = _numeric_arrays(self.table)

    def __len__(self) -> int:
        return int(self.table.num_rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        i = _checked_index(operator.index(index), len(self))
        arrays = self._arrays
        return {name: arrays[name][i] if name in arrays else self.table.column(name)[i].as_py()
                for name in self.columns}

    def __getitems__(self, indices: Sequence[int]) -> list[dict[str, Any]]:
        """The rows at ``indices``: numeric columns by numpy indexing, the others by one Arrow
        ``take`` each, converted column by column."""
        import pyarrow as pa

        index = np.asarray(indices, dtype=np.int64).reshape(-1)
        n = len(self)
        index = np.where(index < 0, index + n, index)
        if index.size and (int(index.min()) < 0 or int(index.max()) >= n):
            raise IndexError(f"row index out of range for a table of {n} rows")
        arrays, taken = self._arrays, pa.array(index)
        values = [arrays[name][index] if name in arrays
                  else self.table.column(name).take(taken).to_pylist() for name in self.columns]
        return _rows(self.columns, values, len(index))

    def numeric_arrays(self) -> dict[str, np.ndarray] | None:
        """Every column as a numpy array of ``len(self)`` rows when all of them are numeric
        (what a vectorised gather needs); ``None`` otherwise."""
        arrays = self._arrays
        if any(name not in arrays for name in self.columns):
            return None
        return {name: arrays[name] for name in self.columns}

    def __getstate__(self) -> dict[str, Any]:
        return {"columns": self.columns, "table": self.table}  # arrays are views: rebuilt

    def __setstate__(self, state: dict[str, Any]) -> None:
        self.columns, self.table = state["columns"], state["table"]
        self._arrays = _numeric_arrays(self.table)

    def __repr__(self) -> str:
        return f"TableDataset({len(self)} rows, columns={self.columns})"


def arrow_rows(table: Any) -> list[dict[str, Any]]:
    """The rows of a ``pyarrow.Table`` or ``RecordBatch`` as samples, converted column by column
    (numeric columns to numpy, the others with ``to_pylist``), never cell by cell."""
    names = list(table.column_names)
    values = [_column_values(table.column(k)) for k in range(len(names))]
    return _rows(names, values, int(table.num_rows))


def _rows(names: list[str], values: list[Any], count: int) -> list[dict[str, Any]]:
    if not names:
        return [{} for _ in range(count)]
    return [dict(zip(names, row, strict=True)) for row in zip(*values, strict=True)]


def _column_values(column: Any) -> Any:
    """A column's values, row by row: a numpy array for a numeric column, else a list."""
    array = _numeric_array(column)
    return column.to_pylist() if array is None else array


def _numeric_array(column: Any) -> np.ndarray | None:
    """A numeric Arrow column as one numpy array of shape ``(rows, *list shape)``, a null in
    a float column as NaN; ``None`` for an integer or boolean column with nulls, or any other
    column. Arrays of more than one dimension are writable copies (``default_collate`` warns
    on read-only rows); 1-D ones may be views of Arrow memory."""
    import pyarrow as pa

    array = column.combine_chunks() if isinstance(column, pa.ChunkedArray) else column
    rows, shape = len(array), []
    while pa.types.is_fixed_size_list(array.type):
        if array.null_count:
            return None
        shape.append(array.type.list_size)
        array = array.flatten()
    kind = array.type
    exact = pa.types.is_integer(kind) or pa.types.is_boolean(kind)  # no NaN for a null
    if not (pa.types.is_floating(kind) or (exact and not array.null_count)):
        return None
    values = array.to_numpy(zero_copy_only=False)
    if shape:
        values = values.reshape(rows, *shape)
        if not values.flags.writeable:
            values = values.copy()
    return values


def _numeric_arrays(table: Any) -> dict[str, np.ndarray]:
    arrays = {}
    for name in table.column_names:
        array = _numeric_array(table.column(name))
        if array is not None:
            arrays[name] = array
    return arrays


def _as_arrow(table: Any) -> Any:
    """``table`` as a ``pyarrow.Table`` (pandas and polars frames converted once)."""
    import pyarrow as pa

    if isinstance(table, pa.Table):
        return table
    if isinstance(table, pa.RecordBatch):
        return pa.Table.from_batches([table])
    kind = type(table)
    library = kind.__module__.split(".")[0]
    if library == "pandas" and kind.__name__ == "DataFrame":
        return pa.Table.from_pandas(table, preserve_index=False)
    if library == "polars" and kind.__name__ == "DataFrame":
        return table.to_arrow()
    hint = " (call .collect() on a polars LazyFrame first)" if kind.__name__ == "LazyFrame" else ""
    raise TypeError(f"TableDataset takes a pyarrow Table or RecordBatch, a pandas DataFrame or a "
                    f"polars DataFrame, got {kind.__module__}.{kind.__name__}{hint}")


def _takeable(table: Any) -> Any:
    """``table`` with its string and binary views cast to large strings and binaries, also
    inside lists, structs, maps and dictionaries: Arrow's ``take`` has no kernel for them
    (pyarrow 26). List views are left as they are: ``take`` gathers them whole, and casting
    them to lists makes invalid arrays (pyarrow 26)."""
    import pyarrow as pa

    schema = pa.schema([field.with_type(_without_views(field.type)) for field in table.schema],
                       metadata=table.schema.metadata)
    return table if schema.equals(table.schema) else table.cast(schema)


def _without_views(kind: Any) -> Any:
    """``kind`` with ``string_view`` and ``binary_view`` made ``large_string`` and
    ``large_binary`` (see ``_takeable``)."""
    import pyarrow as pa

    types = pa.types
    if is_view(kind):
        return pa.large_string()
    if is_view(kind, "is_binary_view"):
        return pa.large_binary()
    if types.is_list(kind) or types.is_large_list(kind):
        make = pa.list_ if types.is_list(kind) else pa.large_list
        return make(kind.value_field.with_type(_without_views(kind.value_type)))
    if types.is_fixed_size_list(kind):
        return pa.list_(kind.value_field.with_type(_without_views(kind.value_type)),
                        kind.list_size)
    if types.is_map(kind):
        return pa.map_(kind.key_field.with_type(_without_views(kind.key_type)),
                       kind.item_field.with_type(_without_views(kind.item_type)),
                       kind.keys_sorted)
    if types.is_struct(kind):
        return pa.struct([field.with_type(_without_views(field.type)) for field in kind])
    if types.is_dictionary(kind):
        return pa.dictionary(kind.index_type, _without_views(kind.value_type), kind.ordered)
    return kind


def check_columns(columns: Sequence[str] | None, available: list[str], where: str) -> list[str]:
    """The columns a sample holds: ``columns`` (default: all ``available``), checked against
    ``where``'s (a ``ValueError`` naming the missing ones)."""
    if isinstance(columns, str):
        raise TypeError(f"columns must be a sequence of names, got the str {columns!r} (one "
                        f"column: [{columns!r}])")
    wanted = list(available) if columns is None else list(columns)
    if not wanted:
        raise ValueError(f"no columns selected from {where}; available: {available}")
    missing = [name for name in wanted if name not in available]
    if missing:
        raise ValueError(f"{where} has no column(s) {missing}; available: {available}")
    if len(set(wanted)) != len(wanted):
        raise ValueError(f"columns {wanted} name a column more than once")
    return wanted


def _checked_index(index: int, n: int) -> int:
    if index < 0:
        index += n
    if not 0 <= index < n:
        raise IndexError(f"row index {index} out of range for a table of {n} rows")
    return index


def is_view(kind: Any, predicate: str = "is_string_view") -> bool:
    """Whether the Arrow type ``kind`` is a string (or with ``"is_binary_view"``, binary)
    view, which ``take`` has no kernel for; ``False`` on a pyarrow without views (before 16)."""
    import pyarrow as pa

    return bool(getattr(pa.types, predicate, lambda _: False)(kind))
