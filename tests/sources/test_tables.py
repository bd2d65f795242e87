"""``TableDataset`` over pandas, polars and pyarrow tables: the same batches as ``DataLoader``
over the same rows, numeric tables gathered a batch at a time, exact resume from every step."""

from __future__ import annotations

import pickle

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

pa = pytest.importorskip("pyarrow", reason="TableDataset keeps its table in Arrow")

from lightning_loaders import ResumableLoader, StateMismatchError  # noqa: E402
from lightning_loaders.sources.tables import TableDataset, arrow_rows  # noqa: E402
from lightning_loaders.testing import (  # noqa: E402
    check_resume_at_every_step,
    run_epochs,
    to_plain,
)

N = 40
ORDER = np.random.default_rng(0).permutation(N).tolist()  # one fixed index order for both


def _columns() -> dict[str, list]:
    return {"id": list(range(N)), "x": [np.float32(i / 4) for i in range(N)],
            "name": [f"row{i}" for i in range(N)]}


def _frame(library: str):
    """The same 40 rows as a pyarrow Table, a pandas DataFrame or a polars DataFrame."""
    columns = _columns()
    if library == "pyarrow":
        return pa.table({"id": pa.array(columns["id"], pa.int64()),
                         "x": pa.array(columns["x"], pa.float32()), "name": columns["name"]})
    if library == "pandas":
        pd = pytest.importorskip("pandas", reason="a pandas DataFrame as the table")
        return pd.DataFrame({"id": np.array(columns["id"], dtype=np.int64),
                             "x": np.array(columns["x"], dtype=np.float32),
                             "name": columns["name"]})
    pl = pytest.importorskip("polars", reason="a polars DataFrame as the table")
    return pl.DataFrame({"id": columns["id"], "x": columns["x"], "name": columns["name"]},
                        schema={"id": pl.Int64, "x": pl.Float32, "name": pl.String})


def _reference_rows(columns: list[str]) -> list[dict]:
    """The rows built independently of any table: what ``TableDataset`` must give."""
    values = _columns()
    values["id"] = [np.int64(i) for i in values["id"]]
    return [{name: values[name][i] for name in columns} for i in range(N)]


def _same(got, expected) -> bool:
    """Batches equal, tensors with the same dtype."""
    if isinstance(expected, torch.Tensor):
        return (isinstance(got, torch.Tensor) and got.dtype == expected.dtype
                and torch.equal(got, expected))
    if isinstance(expected, dict):
        return got.keys() == expected.keys() and all(_same(got[k], expected[k]) for k in got)
    return got == expected


LIBRARIES = ["pyarrow", "pandas", "polars"]


@pytest.mark.parametrize("library", LIBRARIES)
@pytest.mark.parametrize("columns", [["id", "x"], ["name", "id", "x"]])
def test_batches_equal_dataloader_over_the_same_rows(library, columns) -> None:
    dataset = TableDataset(_frame(library), columns=columns)
    reference = _reference_rows(columns)
    assert len(dataset) == N and list(dataset[7]) == columns
    assert [dataset[i] for i in range(N)] == reference
    assert type(dataset[3]["id"]) is np.int64 and type(dataset[3]["x"]) is np.float32
    assert dataset.__getitems__([5, -1, 0]) == [reference[5], reference[-1], reference[0]]
    expected = list(DataLoader(reference, batch_size=6, sampler=ORDER))
    for workers in (0, 2):
        ours = ResumableLoader(dataset, batch_size=6, sampler=ORDER, num_workers=workers)
        got = list(ours)
        ours.close()
        assert len(got) == len(expected) == len(ours)
        assert all(_same(g, e) for g, e in zip(got, expected, strict=True))
    torch_loader = list(DataLoader(dataset, batch_size=6, sampler=ORDER))
    assert all(_same(g, e) for g, e in zip(torch_loader, expected, strict=True))


@pytest.mark.parametrize("library", LIBRARIES)
def test_numeric_tables_are_gathered_in_memory_and_others_are_not(library) -> None:
    numeric = TableDataset(_frame(library), columns=["x", "id"])
    assert set(numeric.numeric_arrays()) == {"x", "id"}
    for workers in (0, 2):
        assert ResumableLoader(numeric, batch_size=4, num_workers=workers).gathers_in_memory
    mixed = TableDataset(_frame(library))
    assert mixed.numeric_arrays() is None
    assert not ResumableLoader(mixed, batch_size=4).gathers_in_memory


def test_the_gather_reads_no_row_one_at_a_time(monkeypatch) -> None:
    """Over a numeric table the loader reads two rows at each epoch's start (its check that
    the gather, set up anew for data that may have been replaced, equals ``default_collate``),
    and never ``__getitem__`` nor ``__getitems__`` for a batch."""
    rows_read = []
    row = TableDataset.__getitem__

    def counted(self, index):
        rows_read.append(index)
        return row(self, index)

    def forbidden(self, indices):
        raise AssertionError("a batch was read row by row")

    monkeypatch.setattr(TableDataset, "__getitem__", counted)
    monkeypatch.setattr(TableDataset, "__getitems__", forbidden)
    loader = ResumableLoader(TableDataset(_frame("pyarrow"), columns=["id", "x"]),
                             batch_size=8, shuffle=True, seed=1, num_workers=2)
    epochs = run_epochs(loader, range(2))
    assert rows_read == [0, N - 1] * 2
    assert all(sorted(i for batch in epoch for i in batch["id"]) == list(range(N))
               for epoch in epochs)


@pytest.mark.parametrize(("library", "columns", "workers"), [
    ("pyarrow", ["id", "x"], 0), ("pandas", ["id", "x"], 0), ("polars", None, 0),
    ("pyarrow", None, 2)])
def test_resume_at_every_step_is_exact(library, columns, workers) -> None:
    def make():
        return ResumableLoader(TableDataset(_frame(library), columns=columns),
                               batch_size=4 if workers == 0 else 9, shuffle=True, seed=3,
                               num_workers=workers)

    full = check_resume_at_every_step(make, epochs=2)
    for epoch in full:
        assert sorted(i for batch in epoch for i in batch["id"]) == list(range(N))
    assert full[0] != full[1]


def test_more_column_types() -> None:
    """Booleans, fixed-size lists (a row is an array), float nulls (NaN) are numeric and
    gathered; integer nulls, variable lists and timestamps are Python values."""
    table = pa.table({
        "id": pa.array(range(6), pa.int64()),
        "flag": pa.array([i % 2 == 0 for i in range(6)]),
        "vec": pa.array([[i, -i, 2 * i] for i in range(6)], pa.list_(pa.float32(), 3)),
        "maybe": pa.array([None if i == 2 else i / 2 for i in range(6)], pa.float64()),
    }).to_batches(max_chunksize=4)  # two chunks: made contiguous once
    dataset = TableDataset(pa.Table.from_batches(table))
    assert dataset[1]["vec"].tolist() == [1.0, -1.0, 2.0] and np.isnan(dataset[2]["maybe"])
    loader = ResumableLoader(dataset, batch_size=4)
    assert loader.gathers_in_memory
    batch = next(iter(loader))
    reference = next(iter(DataLoader([dataset[i] for i in range(6)], batch_size=4)))
    assert batch["vec"].shape == (4, 3) and batch["flag"].dtype == torch.bool
    assert all(torch.equal(batch[k], reference[k]) for k in ("id", "flag", "vec"))
    assert torch.allclose(batch["maybe"], reference["maybe"], equal_nan=True)
    other = pa.table({"n": pa.array([1, None], pa.int64()), "l": pa.array([[1], [2, 3]]),
                      "t": pa.array([0, 86_400], pa.timestamp("s"))})
    rows = arrow_rows(other)
    assert rows[1]["n"] is None and rows[1]["l"] == [2, 3] and rows[1]["t"].day == 2
    assert TableDataset(other).numeric_arrays() is None


def _views_or_not(views: bool):
    """The same rows with string and binary columns stored as Arrow views (flat and inside a
    list, a struct, a map, a dictionary, a fixed-size list and a list view) or as strings."""
    text, data = (pa.string_view(), pa.binary_view()) if views else (pa.string(), pa.binary())
    names = [f"row{i}" for i in range(N)]
    return pa.table({
        "id": pa.array(range(N), pa.int64()),
        "name": pa.array(names, text),
        "raw": pa.array([name.encode() for name in names], data),
        "tags": pa.array([[name, "t"] for name in names], pa.list_(text)),
        "pair": pa.array([[name, "p"] for name in names], pa.list_(text, 2)),
        "meta": pa.array([{"name": name} for name in names], pa.struct([("name", text)])),
        "attrs": pa.array([[("k", name)] for name in names], pa.map_(text, text)),
        "kind": pa.array([f"k{i % 3}" for i in range(N)], text).dictionary_encode(),
        "spans": pa.array([[name] for name in names],
                          pa.list_view(text) if views else pa.list_(text)),
    })


def test_string_and_binary_views_read_as_strings_and_resume_exactly() -> None:
    """Arrow's ``take`` cannot gather string or binary views (pyarrow 26: no kernel), which a
    table may hold (built by hand, or from a query engine's Arrow export): such a table gave
    no loader at all. Its views are cast once, so it reads as the same rows stored as strings,
    has the same content identity, and resumes exactly at every step."""
    plain, viewed = TableDataset(_views_or_not(False)), TableDataset(_views_or_not(True))
    assert [viewed[i] for i in range(N)] == [plain[i] for i in range(N)]

    def make(table):
        return lambda: ResumableLoader(TableDataset(table), batch_size=6, shuffle=True, seed=3)

    full = check_resume_at_every_step(make(_views_or_not(True)), epochs=2)
    assert full == run_epochs(make(_views_or_not(False))(), range(2))
    assert sorted(i for batch in full[0] for i in batch["id"]) == list(range(N))
    saved = make(_views_or_not(False))()
    next(iter(saved))
    resumed = make(_views_or_not(True))()
    resumed.load_state_dict(saved.state_dict())
    assert [to_plain(batch) for batch in resumed] == full[0][1:]


def test_pickles_without_its_views_and_refuses_bad_input() -> None:
    dataset = TableDataset(_frame("pyarrow"))
    copy = pickle.loads(pickle.dumps(dataset))
    assert [copy[i] for i in range(N)] == [dataset[i] for i in range(N)]
    assert copy.numeric_arrays() is None and TableDataset(copy.table, ["id"]).numeric_arrays()
    assert dataset[-1] == dataset[N - 1]
    with pytest.raises(IndexError, match="out of range"):
        dataset[N]
    with pytest.raises(IndexError, match="out of range"):
        dataset.__getitems__([0, N])
    with pytest.raises(ValueError, match=r"no column\(s\) \['y'\]; available: \['id'"):
        TableDataset(_frame("pyarrow"), columns=["id", "y"])
    with pytest.raises(TypeError, match=r"got the str 'id' \(one column: \['id'\]\)"):
        TableDataset(_frame("pyarrow"), columns="id")
    with pytest.raises(TypeError, match="pandas DataFrame or a polars DataFrame"):
        TableDataset([{"id": 1}])
    pl = pytest.importorskip("polars", reason="a polars LazyFrame")
    with pytest.raises(TypeError, match=r"\.collect\(\)"):
        TableDataset(pl.DataFrame({"a": [1]}).lazy())


def test_epochs_reshuffle_and_a_table_reads_the_same_on_every_run() -> None:
    def make():
        return ResumableLoader(TableDataset(_frame("pandas"), columns=["id"]), batch_size=8,
                               shuffle=True, seed=5)

    first, second = run_epochs(make(), range(2)), run_epochs(make(), range(2))
    assert first == second and first[0] != first[1]


def _parquet(path, first: int) -> str:
    """A Parquet file of ``N`` rows (ids from ``first`` on) in row groups of 16."""
    import pyarrow.parquet as pq

    ids = list(range(first, first + N))
    pq.write_table(pa.table({"id": ids, "name": [f"row{i}" for i in ids]}), str(path),
                   row_group_size=16)
    return str(path)


def _table_loader(table) -> ResumableLoader:
    return ResumableLoader(TableDataset(table), batch_size=8, shuffle=True, seed=5)


def test_a_state_over_another_table_of_the_same_length_is_refused(tmp_path) -> None:
    """The fingerprint holds a digest of a few rows: a state saved over one Parquet file is
    refused over another of as many rows, both identities shown. Read again from its file
    (as Arrow, through pandas, or with another integer width: the same values), the saving
    table resumes exactly."""
    import pyarrow.parquet as pq

    pd = pytest.importorskip("pandas", reason="the file read again through pandas")
    a, b = _parquet(tmp_path / "a.parquet", 0), _parquet(tmp_path / "b.parquet", 100)
    saving = _table_loader(pq.read_table(a))
    next(iter(saving))
    state = saving.state_dict()
    with pytest.raises(StateMismatchError, match=r"content: saved 'TableDataset rows \w+', "
                                                 r"this loader 'TableDataset rows \w+'"):
        _table_loader(pq.read_table(b)).load_state_dict(state)
    whole = run_epochs(_table_loader(pq.read_table(a)), [0])[0]
    narrow = pq.read_table(a).cast(pa.schema([("id", pa.int32()), ("name", pa.string())]))
    for same in (pq.read_table(a), pd.read_parquet(a), narrow):
        resumed = _table_loader(same)
        resumed.load_state_dict(state)
        assert [to_plain(batch) for batch in resumed] == whole[1:]


def test_a_state_saved_without_a_content_identity_still_loads(tmp_path) -> None:
    """A state of the release before the identity (a fingerprint without ``content``) is
    checked as it was then, and resumes."""
    import pyarrow.parquet as pq

    path = _parquet(tmp_path / "a.parquet", 0)
    whole = run_epochs(_table_loader(pq.read_table(path)), [0])[0]
    saving = _table_loader(pq.read_table(path))
    iterator = iter(saving)
    next(iterator), next(iterator)
    state = saving.state_dict()
    del state["fingerprint"]["content"]
    resumed = _table_loader(pq.read_table(path))
    resumed.load_state_dict(state)
    assert [to_plain(batch) for batch in resumed] == whole[2:]
