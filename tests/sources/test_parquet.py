"""``ParquetSource`` (row groups as shards) and ``ArrowSource`` (record batches as shards)
over files these tests write: exactly once per epoch, resume from every step, every
last-batch policy, row-group seeks, and a real 2-rank DDP Trainer run."""

from __future__ import annotations

import pickle
import re
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

pa = pytest.importorskip("pyarrow", reason="ParquetSource and ArrowSource read with pyarrow")
pq = pytest.importorskip("pyarrow.parquet", reason="ParquetSource reads with pyarrow.parquet")
pafs = pytest.importorskip("pyarrow.fs", reason="the filesystem argument is a pyarrow.fs one")

from lightning_loaders import ResumableLoader  # noqa: E402
from lightning_loaders.sources.parquet import ArrowSource, ParquetSource  # noqa: E402
from lightning_loaders.testing import check_resume_at_every_step, run_epochs  # noqa: E402
from tests.real_data_harness import check_real_data_ddp  # noqa: E402

ROW_GROUPS = [[6, 1, 9], [12], [3, 5, 4]]  # per file: uneven row groups, 40 rows in all
TOTAL = sum(map(sum, ROW_GROUPS))
LENGTHS = [n for groups in ROW_GROUPS for n in groups]


def _table(ids: range) -> pa.Table:
    return pa.table({"id": pa.array(ids, pa.int64()),
                     "x": pa.array([i / 4 for i in ids], pa.float32()),
                     "name": pa.array([f"row{i}" for i in ids], pa.string())})


def write_parquet(root: Path, row_groups: list[list[int]] = ROW_GROUPS) -> list[Path]:
    """Files ``part<k>.parquet`` whose row groups have the given sizes; ids count up from 0."""
    root.mkdir(parents=True, exist_ok=True)
    paths, first = [], 0
    for k, groups in enumerate(row_groups):
        paths.append(root / f"part{k}.parquet")
        with pq.ParquetWriter(paths[-1], _table(range(0)).schema) as writer:
            for size in groups:
                writer.write_table(_table(range(first, first + size)), row_group_size=size)
                first += size
    return paths


def write_arrow(root: Path) -> list[Path]:
    """Arrow IPC files with record batches of the sizes in ``ROW_GROUPS``."""
    root.mkdir(parents=True, exist_ok=True)
    paths, first = [], 0
    for k, groups in enumerate(ROW_GROUPS):
        paths.append(root / f"part{k}.arrow")
        with pa.OSFile(str(paths[-1]), "wb") as sink, \
                pa.ipc.new_file(sink, _table(range(0)).schema) as writer:
            for size in groups:
                writer.write_batch(_table(range(first, first + size)).to_batches()[0])
                first += size
    return paths


def ddp_dataset(data_dir: str) -> ParquetSource:
    """For ``tests/scripts/real_data_fit.py``: the Parquet files of a directory."""
    return ParquetSource(data_dir)


@pytest.fixture(scope="module")
def files(tmp_path_factory) -> list[Path]:
    return write_parquet(tmp_path_factory.mktemp("parquet"))


def ids(batch) -> list[int]:
    return batch["id"].tolist()


def _epoch_ids(epoch: list[list[int]]) -> list[int]:
    return [i for batch in epoch for i in batch]


# -- the source --------------------------------------------------------------------------------


def test_importing_the_package_imports_no_table_library() -> None:
    code = ("import sys, lightning_loaders, lightning_loaders.sources.parquet, "
            "lightning_loaders.sources.tables; "
            "print(sorted({'pyarrow', 'pandas', 'polars'} & set(sys.modules)))")
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                          check=True)
    assert done.stdout.strip() == "[]"


def test_shards_are_row_groups_with_lengths_from_the_footers(files) -> None:
    source = ParquetSource(files)
    assert source.shard_lengths == LENGTHS and len(source) == TOTAL
    assert source.shards[:4] == [(str(files[0]), 0), (str(files[0]), 1), (str(files[0]), 2),
                                 (str(files[1]), 0)]
    rows = list(source)
    assert [row["id"] for row in rows] == list(range(TOTAL))
    sample = rows[7]
    assert sample == {"id": 7, "x": 1.75, "name": "row7"}
    assert type(sample["id"]) is np.int64 and type(sample["x"]) is np.float32
    assert type(sample["name"]) is str


def test_opening_a_shard_at_a_row_equals_the_rest_of_it(files) -> None:
    source = ParquetSource(files, columns=["name", "id"])
    rows = list(source)
    first = 0
    for shard, length in enumerate(LENGTHS):
        for start in range(length + 1):
            assert list(source.open_shard(shard, start)) == rows[first + start:first + length]
        first += length
    assert list(rows[0]) == ["name", "id"], "columns in the order asked for"


def test_reading_a_row_group_from_a_row_parses_no_other_row_group(files, tmp_path) -> None:
    """Every column chunk of every other row group is overwritten with garbage: reading the
    target row group from any row still works, so nothing else was read; and a column left
    out is never read either."""
    for target in range(3):
        path = tmp_path / f"target{target}.parquet"
        shutil.copy(files[0], path)
        _corrupt(path, groups=[g for g in range(3) if g != target], columns=None)
        source = ParquetSource([path])
        expected = list(ParquetSource([files[0]]).open_shard(target))
        for start in range(len(expected)):
            assert list(source.open_shard(target, start)) == expected[start:]
        with pytest.raises(OSError):
            list(source.open_shard((target + 1) % 3))
    path = tmp_path / "no-names.parquet"
    shutil.copy(files[0], path)
    _corrupt(path, groups=range(3), columns=["name"])
    assert [row["id"] for row in ParquetSource([path], columns=["id", "x"])] == list(range(16))
    with pytest.raises(OSError):
        list(ParquetSource([path]))


def _corrupt(path: Path, groups, columns) -> None:
    """Overwrite the bytes of the given row groups' column chunks (all columns by default)."""
    metadata = pq.read_metadata(path)
    data = bytearray(path.read_bytes())
    for group in groups:
        row_group = metadata.row_group(group)
        for j in range(row_group.num_columns):
            chunk = row_group.column(j)
            if columns is not None and chunk.path_in_schema not in columns:
                continue
            offset = chunk.data_page_offset
            if chunk.has_dictionary_page and chunk.dictionary_page_offset:
                offset = min(offset, chunk.dictionary_page_offset)
            data[offset:offset + chunk.total_compressed_size] = b"\xff" * \
                chunk.total_compressed_size
    path.write_bytes(bytes(data))


def test_directories_globs_and_filesystems_name_the_same_files(files, tmp_path) -> None:
    root = tmp_path / "root"
    for path in files:
        (root / "nested").mkdir(parents=True, exist_ok=True)
        shutil.copy(path, root / "nested" / path.name)
    (root / "_SUCCESS").write_text("")
    for hidden in (root / "_temporary" / "part9.parquet", root / "nested" / ".part9.parquet"):
        hidden.parent.mkdir(exist_ok=True)
        shutil.copy(files[0], hidden)
    expected = ParquetSource(files)
    rows = list(expected)
    for source in (ParquetSource(root), ParquetSource(str(root / "nested" / "*.parquet")),
                   pickle.loads(pickle.dumps(expected))):
        assert source.shard_lengths == LENGTHS and list(source) == rows
    assert [row["id"] for row in ParquetSource(str(files[1]))] == list(range(16, 28))
    local = pafs.SubTreeFileSystem(str(root), pafs.LocalFileSystem())
    on_fs = ParquetSource("/", filesystem=local)
    assert on_fs.paths == [f"nested/part{k}.parquet" for k in range(3)]
    assert list(pickle.loads(pickle.dumps(on_fs))) == rows
    assert list(ParquetSource("nested/part2.parquet", filesystem=local)) == rows[28:]


def test_the_fingerprint_names_files_row_groups_and_columns(files, tmp_path) -> None:
    fingerprint = ParquetSource(files).fingerprint
    assert ParquetSource(files).fingerprint == fingerprint
    assert ParquetSource(files, columns=["id"]).fingerprint != fingerprint
    regrouped = write_parquet(tmp_path / "regrouped", [[7, 9], [12], [3, 5, 4]])
    assert ParquetSource(regrouped).fingerprint != fingerprint
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for k, path in enumerate(files):
        shutil.copy(path, renamed / f"other{k}.parquet")
    assert ParquetSource(renamed).fingerprint != fingerprint


def test_bad_input_is_refused_with_the_fix(files, tmp_path) -> None:
    with pytest.raises(ValueError, match=r"has no column\(s\) \['y'\]; available: \['id', 'x'"):
        ParquetSource(files, columns=["id", "y"])
    with pytest.raises(FileNotFoundError, match="no such file"):
        ParquetSource(tmp_path / "missing.parquet")
    with pytest.raises(FileNotFoundError, match="no file matches"):
        ParquetSource(str(tmp_path / "*.parquet"))
    (tmp_path / "empty").mkdir()
    with pytest.raises(FileNotFoundError, match=r"no \.parquet/\.parq/\.pq file under"):
        ParquetSource(tmp_path / "empty")
    text = tmp_path / "text.parquet"
    text.write_text("not parquet")
    with pytest.raises(ValueError, match="not a readable Parquet file"):
        ParquetSource(text)
    with pytest.raises(ValueError, match="not an Arrow IPC file.*ipc.new_file"):
        ArrowSource(files[0])


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize(("kind", "piece"), [("parquet", "row group"), ("arrow", "record batch")])
def test_a_file_corrupt_past_its_footer_is_named_in_the_error(kind, piece, workers,
                                                              tmp_path) -> None:
    """The footer reads (construction succeeds), the data does not: the error names the file
    and its row group or record batch, not only the shard's index."""
    paths = (write_parquet if kind == "parquet" else write_arrow)(tmp_path)
    source = (ParquetSource if kind == "parquet" else ArrowSource)(tmp_path)
    data = bytearray(paths[0].read_bytes())
    middle = slice(len(data) // 4, len(data) // 2)  # piece data, before the footer
    data[middle] = bytes(byte ^ 0x5A for byte in data[middle])
    paths[0].write_bytes(bytes(data))
    with pytest.raises(Exception, match=rf"\({re.escape(str(paths[0]))}, {piece} \d\)"):
        list(ResumableLoader(source, batch_size=4, num_workers=workers))


@pytest.mark.parametrize("kind", ["parquet", "arrow"])
def test_files_whose_column_types_differ_are_refused(kind, tmp_path) -> None:
    """Else a sample's type would depend on its file (int64 batches, then str ones)."""
    tables = [pa.table({"id": [0, 1], "x": [0.5, 1.5]}),
              pa.table({"id": ["2", "3"], "x": [2.5, 3.5]})]
    paths = [tmp_path / f"{name}.{kind}" for name in "ab"]
    for table, path in zip(tables, paths, strict=True):
        if kind == "parquet":
            pq.write_table(table, path)
        else:
            with pa.ipc.new_file(path, table.schema) as sink:
                sink.write_table(table)
    source = ParquetSource if kind == "parquet" else ArrowSource
    with pytest.raises(ValueError, match=r"column 'id' is string in .*b\..* but int64 in "
                                         r".*a\..*Cast the files to one schema"):
        source(paths)
    assert [row["x"] for row in source(paths, columns=["x"])] == [0.5, 1.5, 2.5, 3.5]


# -- under the loader ---------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2, 3])
def test_every_row_once_per_epoch_and_shard_order_reshuffled(files, workers) -> None:
    loader = ResumableLoader(ParquetSource(files), batch_size=4, shuffle=True, seed=3,
                             num_workers=workers)
    epochs = run_epochs(loader, range(2), key=ids)
    loader.close()
    for epoch in epochs:
        assert sorted(_epoch_ids(epoch)) == list(range(TOTAL))
        assert len(epoch) == len(loader) == 10
    assert _epoch_ids(epochs[0]) != _epoch_ids(epochs[1])
    firsts = [[batch[0] for batch in epoch] for epoch in epochs]
    assert firsts[0] != firsts[1]


@pytest.mark.parametrize("workers", [0, 2])
def test_resume_at_every_step_is_exact(files, workers) -> None:
    def make():
        return ResumableLoader(ParquetSource(files), batch_size=4 if workers == 0 else 7,
                               shuffle=True, seed=5, num_workers=workers)

    full = check_resume_at_every_step(make, epochs=2)
    for epoch in full:
        assert sorted(i for batch in epoch for i in batch["id"]) == list(range(TOTAL))
        assert all(name == f"row{i}" for batch in epoch
                   for i, name in zip(batch["id"], batch["name"], strict=True))


def test_the_state_is_a_cursor_whatever_the_row_groups(files) -> None:
    loader = ResumableLoader(ParquetSource(files), batch_size=4, shuffle=True, num_workers=2)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    state = loader.state_dict()
    loader.close()
    assert "positions" not in state["parts"]["slots"] and len(pickle.dumps(state)) < 1024


@pytest.mark.parametrize("policy", ["keep", "drop", "pad"])
def test_every_last_batch_policy_with_an_exact_len_on_two_ranks(files, policy) -> None:
    ranks = []
    for rank in range(2):
        loader = ResumableLoader(ParquetSource(files), batch_size=6, shuffle=True, seed=2,
                                 last_batch=policy, rank=rank, world_size=2)
        ranks.append(run_epochs(loader, range(2), key=ids))
        assert len(loader) == len(ranks[-1][0]) == len(ranks[-1][1])
    assert len(ranks[0][0]) == len(ranks[1][0])
    for epoch in range(2):
        read = [i for rank in ranks for batch in rank[epoch] for i in batch]
        sizes = [len(batch) for rank in ranks for batch in rank[epoch]]
        if policy == "keep":
            assert sorted(read) == list(range(TOTAL))
        if policy == "drop":
            assert len(set(read)) == len(read) == 36 and set(sizes) == {6}
        if policy == "pad":
            assert set(read) == set(range(TOTAL)) and len(read) == 48 and set(sizes) == {6}


def test_rollover_carries_leftovers_into_the_next_epoch_and_has_no_len(files) -> None:
    loader = ResumableLoader(ParquetSource(files), batch_size=6, shuffle=True, seed=2,
                             last_batch="rollover")
    with pytest.raises(TypeError, match="rollover.*differ in length"):
        len(loader)
    epochs = run_epochs(loader, range(3), key=ids)
    assert [len(epoch) for epoch in epochs] == [6, 7, 7]  # 40, 4 + 40, 2 + 40 rows
    read = [i for epoch in epochs for i in _epoch_ids(epoch)]
    assert all(len(batch) == 6 for epoch in epochs for batch in epoch)
    assert sorted(read[:TOTAL]) == list(range(TOTAL))
    assert sorted(read[TOTAL:2 * TOTAL]) == list(range(TOTAL))


def test_resume_with_another_num_workers(files) -> None:
    """Mid-epoch and at an epoch boundary, the saved canonical partitions go on: the stream
    is the uninterrupted one of the saving layout."""
    def make(workers: int):
        return ResumableLoader(ParquetSource(files), batch_size=4, shuffle=True, seed=9,
                               num_workers=workers)

    expected = run_epochs(make(0), range(2), key=ids)
    loader = make(0)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    other = make(2)
    other.load_state_dict(loader.state_dict())
    assert [ids(batch) for batch in other] == expected[0][3:]
    other.close()
    done = make(0)
    run_epochs(done, [0])
    resumed = make(2)
    resumed.load_state_dict(done.state_dict())
    assert [ids(batch) for batch in resumed] == expected[1]
    resumed.close()


# -- Hive-partitioned directories ----------------------------------------------------------------

HIVE = [("year=2020/tag=a%20b", [3, 2]), ("year=2020/tag=__HIVE_DEFAULT_PARTITION__", [4]),
        ("year=2021/tag=7", [2, 5]), ("year=2022", [3])]  # the last has no tag: null
HIVE_TOTAL = sum(sum(groups) for _, groups in HIVE)


def write_hive(root: Path, layout=HIVE) -> list[Path]:
    """``part0.parquet`` in each ``key=value`` directory (one name in all, as pyarrow's
    ``write_to_dataset`` writes), with the given row groups; ids count up from 0."""
    paths, first = [], 0
    for folder, groups in layout:
        (root / folder).mkdir(parents=True)
        paths.append(root / folder / "part0.parquet")
        with pq.ParquetWriter(paths[-1], _table(range(0)).schema) as writer:
            for size in groups:
                writer.write_table(_table(range(first, first + size)), row_group_size=size)
                first += size
    return paths


def _plain(row: dict) -> dict:
    return {name: value.item() if isinstance(value, np.generic) else value
            for name, value in row.items()}


def test_hive_partition_keys_are_columns_as_pyarrow_dataset_reads_them(tmp_path) -> None:
    """Every file gets the keys of its directories below the one given, typed as pyarrow
    infers them (year: int32; tag: '7' alongside 'a b' makes it a string), a missing or
    default partition as null; a directory, a glob and a filesystem read alike."""
    pads = pytest.importorskip("pyarrow.dataset", reason="the reference reader")
    paths = write_hive(tmp_path / "hive")
    source = ParquetSource(tmp_path / "hive")
    expected = pads.dataset(tmp_path / "hive", partitioning="hive").to_table()
    assert source.columns == expected.column_names == ["id", "x", "name", "year", "tag"]
    rows = sorted((_plain(row) for row in source), key=lambda row: row["id"])
    assert rows == sorted(expected.to_pylist(), key=lambda row: row["id"])
    assert [(row["year"], row["tag"]) for row in rows[4:6]] == [(2020, "a b"), (2020, None)]
    assert rows[-1]["tag"] is None and rows[9]["tag"] == "7"
    assert type(list(source)[0]["year"]) is np.int32
    local = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    for same in (ParquetSource(str(tmp_path / "hive" / "**" / "*.parquet")),
                 ParquetSource(str(tmp_path / "hive" / "year=*" / "**" / "*.parquet")),
                 ParquetSource("hive", filesystem=local), pickle.loads(pickle.dumps(source))):
        assert same.columns == source.columns and list(same) == list(source)
    chosen = ParquetSource(tmp_path / "hive", columns=["tag", "id"])
    assert [_plain(row) for row in chosen.open_shard(2, 1)] == [{"tag": "a b", "id": 4}]
    assert _plain(next(chosen.open_shard(0, 1))) == {"tag": None, "id": 6}  # files sorted
    only = ParquetSource(tmp_path / "hive", columns=["year"])
    assert [row["year"] for row in only] == [row["year"] for row in source]
    assert list(ParquetSource(paths[0]))[0] == list(ParquetSource(paths))[0]  # files: no keys
    assert ParquetSource(paths).columns == ["id", "x", "name"]
    arrow = tmp_path / "arrow" / "shard=3" / "part0.arrow"
    arrow.parent.mkdir(parents=True)
    with pa.ipc.new_file(arrow, _table(range(2)).schema) as sink:
        sink.write_table(_table(range(2)))
    assert [row["shard"] for row in ArrowSource(tmp_path / "arrow")] == [3, 3]


@pytest.mark.parametrize("workers", [0, 2])
def test_hive_partitions_resume_at_every_step(workers, tmp_path) -> None:
    write_hive(tmp_path)

    def make():
        return ResumableLoader(ParquetSource(tmp_path, columns=["year", "id", "name"]),
                               batch_size=3, shuffle=True, seed=2, num_workers=workers)

    full = check_resume_at_every_step(make, epochs=2)
    years = {i: 2020 if i < 9 else 2021 if i < 16 else 2022 for i in range(HIVE_TOTAL)}
    for epoch in full:
        assert sorted(i for batch in epoch for i in batch["id"]) == list(range(HIVE_TOTAL))
        assert all(year == years[i] for batch in epoch
                   for i, year in zip(batch["id"], batch["year"], strict=True))
    assert next(iter(make()))["year"].dtype == torch.int32


def test_the_fingerprint_names_the_partition_values_read(tmp_path) -> None:
    """Renamed partition directories read other values from files of the same names and
    row groups: another fingerprint, unless the keys are left out."""
    write_hive(tmp_path / "a")
    write_hive(tmp_path / "b", [(folder.replace("2022", "2029"), groups)
                                for folder, groups in HIVE])
    assert ParquetSource(tmp_path / "a").fingerprint != ParquetSource(tmp_path / "b").fingerprint
    assert (ParquetSource(tmp_path / "a", columns=["id", "tag"]).fingerprint
            == ParquetSource(tmp_path / "b", columns=["id", "tag"]).fingerprint)
    plain = ParquetSource(tmp_path / "a", columns=["id"]).fingerprint
    assert "partitions" not in plain


def test_hive_misuse_is_refused_with_the_fix(tmp_path) -> None:
    pads = pytest.importorskip("pyarrow.dataset", reason="a Dataset is refused")
    paths = write_hive(tmp_path / "hive")
    with pytest.raises(TypeError, match=r"takes paths, not a pyarrow\.dataset\.FileSystemDataset"
                                        r".*the directory it was made from.*ds\.files.*"
                                        r"TableDataset\(ds\.to_table\(\)\)"):
        ParquetSource(pads.dataset(tmp_path / "hive", partitioning="hive"))
    with pytest.raises(ValueError, match=r"has no column\(s\) \['year'\].*\['year'\] are Hive "
                                         r"partition keys of its path.*directory above them"):
        ParquetSource(paths[0], columns=["id", "year"])
    clash = tmp_path / "clash" / "id=5" / "part0.parquet"
    clash.parent.mkdir(parents=True)
    pq.write_table(_table(range(2)), clash)
    with pytest.raises(ValueError, match=r"has column\(s\) \['id'\] that are also Hive "
                                         r"partition keys \(id=5/part0\.parquet\)"):
        ParquetSource(tmp_path / "clash")
    with pytest.raises(ValueError, match=r"has column\(s\) \['id'\] that are also Hive"):
        ParquetSource(tmp_path / "clash", columns=["id"])
    assert [row["id"] for row in ParquetSource(clash)] == [0, 1]
    left_out = ParquetSource(tmp_path / "clash", columns=["x"])  # the key not chosen: no clash
    assert left_out.columns == ["x"] and len(list(left_out)) == 2


# -- Arrow IPC files ----------------------------------------------------------------------------


def test_arrow_files_are_record_batch_shards(tmp_path) -> None:
    paths = write_arrow(tmp_path / "arrow")
    source = ArrowSource(tmp_path / "arrow", columns=["id", "name"])
    assert source.paths == [str(p) for p in paths]
    assert source.shard_lengths == LENGTHS and len(source) == TOTAL
    rows = list(source)
    assert rows[7] == {"id": 7, "name": "row7"} and type(rows[7]["id"]) is np.int64
    assert list(source.open_shard(2, 4)) == rows[11:16]
    local = pafs.SubTreeFileSystem(str(tmp_path), pafs.LocalFileSystem())
    on_fs = ArrowSource("arrow", columns=["id", "name"], filesystem=local)
    assert on_fs.shard_lengths == LENGTHS and list(on_fs) == rows
    feather = pytest.importorskip("pyarrow.feather", reason="Feather v2 is written by it")
    compressed = tmp_path / "compressed.feather"
    feather.write_feather(_table(range(30)), compressed, chunksize=8, compression="zstd")
    zipped = ArrowSource(compressed, columns=["x", "id"])
    assert zipped.shard_lengths == [8, 8, 8, 6]
    assert [row["id"] for row in zipped.open_shard(3, 2)] == [26, 27, 28, 29]
    assert list(zipped.open_shard(3, 2))[0]["x"] == np.float32(6.5)

    def make():
        return ResumableLoader(pickle.loads(pickle.dumps(source)), batch_size=6, shuffle=True,
                               seed=1)

    full = check_resume_at_every_step(make, epochs=2)
    assert sorted(i for batch in full[1] for i in batch["id"]) == list(range(TOTAL))
    assert isinstance(full[0][0]["id"], list) and isinstance(full[0][0]["name"], list)
    batch = next(iter(make()))
    assert batch["id"].dtype == torch.int64


# -- a real 2-rank DDP Trainer ------------------------------------------------------------------


@pytest.mark.skipif(sys.platform != "linux", reason="gloo DDP on CPU")
def test_ddp_two_ranks_read_every_row_once_and_resume(tmp_path) -> None:
    data = tmp_path / "data"
    write_parquet(data)
    runs = check_real_data_ddp("tests.sources.test_parquet:ddp_dataset", data, total=TOTAL,
                               result_dir=tmp_path / "ddp", workers=2, shuffle=True)
    assert runs[0]["len"] == runs[1]["len"] == 5
