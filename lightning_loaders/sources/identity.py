"""``content_identity``: what a map-style dataset's rows are, for the loader's fingerprint, from
the datasets that can tell cheaply and deterministically.

The fingerprint otherwise holds the dataset's length, so a state saved over one dataset would
resume mid-epoch over other data of the same length. The identity is a digest of the column
names and of a few rows spread over the dataset (the first, the last and evenly between), read
as Arrow and converted to Python values, and of the row count. It is chosen to stay the same
wherever the same rows are rebuilt, since refusing a valid resume is as bad as accepting a
wrong one:

- Hugging Face's ``Dataset._fingerprint`` is not used: it changes with every transform, and a
  ``map`` whose function cannot be hashed gets a random one, new in every process. Cache file
  names are not used either: in-memory datasets have none, and such a ``map`` writes new ones.
- Rows are read with ``with_format("arrow")``, so a ``set_transform`` or format (user code,
  maybe random augmentations) never runs; through the dataset's indices, so rows rearranged by
  ``select``/``shuffle``/``sort`` count as other content (a ``shuffle()`` without a seed, new
  in every process, is then refused: give it a seed).
- Values, not Arrow types or Hugging Face features: the same values stored with another
  integer width or string type are the same samples. An image or audio cell stored as a path
  (``imagefolder``) counts by its file name, not its directory: data copied elsewhere (a
  job's local disk) resumes; files of the same names elsewhere are not told apart.

A few rows cannot see a change between them (a dataset edited in one row), but they see other
files, another split, and another order. A plain torch dataset has no such identity (reading a
sample may decode an image or draw an augmentation): ``None``, and its fingerprint keeps the
length alone.
"""

from __future__ import annotations

import posixpath
import sys
from typing import Any

import numpy as np

from lightning_loaders.hashing import digest
from lightning_loaders.sources.mix import Mix
from lightning_loaders.sources.tables import TableDataset

__all__ = ["content_identity"]

_ROWS = 8  # rows read: the cost is theirs (well under a millisecond for rows of a few values)
_MEDIA = {"bytes", "path"}  # the Arrow storage of Hugging Face's Image, Audio and Video cells


def content_identity(dataset: Any) -> str | None:
    """A short, deterministic identity of ``dataset``'s rows: for a ``TableDataset``, a Hugging
    Face ``datasets.Dataset``, and a ``Mix`` with either among its sources; ``None`` for any
    other dataset (see the module docstring)."""
    if isinstance(dataset, TableDataset):
        return _rows_identity("TableDataset", dataset.table.take(_positions(len(dataset))),
                              len(dataset))
    hf = sys.modules.get("datasets")  # never imported here: an HF dataset has imported it
    if hf is not None and isinstance(dataset, hf.Dataset):
        rows = dataset.with_format("arrow")[_positions(len(dataset))]
        return _rows_identity("datasets.Dataset", rows, len(dataset))
    if isinstance(dataset, Mix):
        members = [content_identity(source) for source in dataset.sources]
        return None if all(m is None for m in members) else f"Mix {digest(members)}"
    return None


def _positions(length: int) -> list[int]:
    """``_ROWS`` row numbers spread evenly over ``length`` rows, the first and last included."""
    if length <= _ROWS:
        return list(range(length))
    return [(length - 1) * k // (_ROWS - 1) for k in range(_ROWS)]


def _rows_identity(kind: str, rows: Any, length: int) -> str:
    """The identity of a dataset of ``length`` rows from the Arrow table of its sampled rows."""
    values = _canonical(rows.to_pylist())
    return f"{kind} rows {digest([length, list(rows.column_names), values])}"


def _canonical(value: Any) -> Any:
    """``value`` as the identity reads it: each ``bytes`` replaced by its digest, which reads
    it at memory speed where ``repr`` would spell every byte out (an encoded image: 2 ms
    instead of 33 for eight of 200 KB); the ``path`` of a Hugging Face media cell
    (``{"bytes", "path"}``: ``Image``, ``Audio``, ``Video``) by its file name, since where the
    files lie is not what they are (a job that copies its data to local disk resumes)."""
    if isinstance(value, bytes):
        return ("bytes", digest(np.frombuffer(value, dtype=np.uint8)))
    if isinstance(value, dict):
        if value.keys() == _MEDIA and isinstance(value["path"], str):
            value = {**value, "path": posixpath.basename(value["path"].replace("\\", "/"))}
        return {key: _canonical(item) for key, item in value.items()}
    if isinstance(value, list):
        return [_canonical(item) for item in value]
    return value
