"""``content_identity``: a digest of a few rows for the datasets that can read them cheaply
(``TableDataset``, Hugging Face ``datasets.Dataset``, a ``Mix`` of them), ``None`` for a plain
torch dataset, never running user code."""

from __future__ import annotations

import tracemalloc
from typing import Any

import numpy as np
import pytest

pa = pytest.importorskip("pyarrow", reason="the identity reads rows as Arrow")
datasets = pytest.importorskip("datasets", reason="a map-style datasets.Dataset")

from lightning_loaders import Mix, ResumableLoader, StateMismatchError  # noqa: E402
from lightning_loaders.sources.identity import content_identity  # noqa: E402
from lightning_loaders.sources.tables import TableDataset  # noqa: E402
from tests.conftest import IndexDataset  # noqa: E402

N = 1000


def _hf(first: int = 0) -> Any:
    return datasets.Dataset.from_dict({"id": list(range(first, first + N))})


def _boom(batch: dict[str, Any]) -> dict[str, Any]:
    raise AssertionError("the identity ran the dataset's transform")


def test_a_plain_torch_dataset_has_none_and_keeps_the_length_alone() -> None:
    assert content_identity(IndexDataset(N)) is None
    loader = ResumableLoader(IndexDataset(N), batch_size=4)
    assert "content" not in loader.state_dict()["fingerprint"]


def test_the_identity_reads_arrow_through_the_indices_and_never_the_transform() -> None:
    plain = content_identity(_hf())
    transformed = _hf()
    transformed.set_transform(_boom)
    assert content_identity(transformed) == plain
    assert content_identity(_hf().with_format("torch")) == plain
    others = {content_identity(_hf(1)), content_identity(_hf().shuffle(seed=0)),
              content_identity(_hf().select([*range(1, N), 0])),
              content_identity(_hf().rename_column("id", "other"))}
    assert plain not in others and len(others) == 4


def test_a_change_at_the_first_or_last_row_is_seen() -> None:
    ids = list(range(N))
    base = content_identity(TableDataset(pa.table({"id": ids})))
    assert content_identity(TableDataset(pa.table({"id": [-1, *ids[1:]]}))) != base
    assert content_identity(TableDataset(pa.table({"id": [*ids[:-1], -1]}))) != base
    chunked = pa.Table.from_batches(pa.table({"id": ids}).to_batches(max_chunksize=7))
    assert content_identity(TableDataset(chunked)) == base


def test_a_mix_is_identified_by_its_sources_and_refuses_a_state_of_others() -> None:
    def mixed(first: int) -> Mix:
        return Mix([_hf(first), _hf(5000)], weights=[1, 1])

    assert content_identity(Mix([IndexDataset(5), IndexDataset(10)], weights=[1, 1])) is None
    assert content_identity(mixed(0)) == content_identity(mixed(0)) != content_identity(mixed(1))
    saving = ResumableLoader(mixed(0), batch_size=4, seed=1)
    next(iter(saving))
    with pytest.raises(StateMismatchError, match=r"content: saved 'Mix \w+', this loader 'Mix"):
        ResumableLoader(mixed(1), batch_size=4, seed=1).load_state_dict(saving.state_dict())


def test_an_image_stored_as_a_path_counts_by_its_file_name(tmp_path) -> None:
    """``imagefolder`` stores each image as its absolute path: the same files copied to
    another directory (a job's local disk) keep the identity; other file names change it."""
    pytest.importorskip("PIL", reason="datasets' Image feature")

    def images(folder: str, names: list[str]) -> Any:
        (tmp_path / folder).mkdir(exist_ok=True)
        for name in names:
            (tmp_path / folder / name).write_bytes(b"not decoded")
        paths = [str(tmp_path / folder / name) for name in names]
        return datasets.Dataset.from_dict({"image": paths}).cast_column("image",
                                                                        datasets.Image())

    names = [f"img{i}.png" for i in range(10)]
    copied = images("copy", names)
    assert copied.with_format("arrow")[:1].to_pylist()[0]["image"]["path"].endswith(
        "copy/img0.png")
    assert content_identity(images("data", names)) == content_identity(copied)
    assert content_identity(images("data", [f"pic{i}.png" for i in range(10)])) != \
        content_identity(copied)


def test_wide_rows_are_read_from_arrow_buffers_and_match_across_widths() -> None:
    """Rows of 250,000 float32 each (speech after a feature extractor): the identity reads a
    spread of their values from Arrow's buffers, never a Python float per value (the peak of
    Python and numpy allocations stays below half the rows' own 8 MB, where 2 million Python
    floats and their ``repr`` took over 100 MB); the same values as float64 in a ``large_list``
    read the same, and another last value reads otherwise."""
    values = np.random.default_rng(0).random((8, 250_000), dtype=np.float32)

    def speech(rows: np.ndarray, kind: Any) -> Any:
        offsets = np.arange(0, rows.size + 1, rows.shape[1])
        column = kind.from_arrays(offsets, rows.ravel())
        return datasets.Dataset(pa.table({"input_values": column, "label": np.arange(8)}))

    dataset = speech(values, pa.ListArray)
    tracemalloc.start()
    try:
        wide = content_identity(dataset)
        peak = tracemalloc.get_traced_memory()[1]
    finally:
        tracemalloc.stop()
    held = values.nbytes
    assert peak < held / 2, f"{peak} bytes allocated for rows of {held}"
    assert content_identity(speech(values.astype(np.float64), pa.LargeListArray)) == wide
    changed = values.copy()
    changed[-1, -1] += 1
    assert content_identity(speech(changed, pa.ListArray)) != wide


def _table_identity(**columns: Any) -> str | None:
    return content_identity(TableDataset(pa.table(columns)))


def test_other_arrow_types_of_the_same_values_read_alike_and_other_values_do_not() -> None:
    """A list view holds what a list holds, and a string or binary view what a string or
    binary holds (also past the values one array is read at); a media path stored as
    ``large_string`` still counts by its file name; a ``uint64`` past int64's range is not the
    negative number its bits would make."""
    lists = [[1.0, 2.0], [3.0]]
    assert (_table_identity(x=pa.array(lists, pa.list_(pa.float32())))
            == _table_identity(x=pa.array(lists, pa.list_view(pa.float64()))))
    media = [("bytes", pa.binary()), ("path", pa.string())]
    wide = [("bytes", pa.binary()), ("path", pa.large_string())]
    assert (_table_identity(img=pa.array([{"bytes": None, "path": "/a/x.png"}], pa.struct(media)))
            == _table_identity(img=pa.array([{"bytes": None, "path": "/b/x.png"}],
                                            pa.struct(wide))))
    assert (_table_identity(x=pa.array([2**64 - 1, 1], pa.uint64()))
            != _table_identity(x=pa.array([-1, 1], pa.int64())))
    assert (_table_identity(x=pa.array([5, 1], pa.uint64()))
            == _table_identity(x=pa.array([5, 1], pa.int32())))
    wide = [[f"v{i}" for i in range(70_000)], ["w"]]  # more values than one array is read at
    assert (_table_identity(x=pa.array(wide, pa.list_view(pa.string_view())))
            == _table_identity(x=pa.array(wide, pa.list_(pa.string()))))
    assert (_table_identity(x=pa.array([[b"a"]], pa.list_view(pa.binary_view())))
            == _table_identity(x=pa.array([[b"a"]], pa.list_(pa.binary())))
            != _table_identity(x=pa.array([["a"]], pa.list_(pa.string()))))
