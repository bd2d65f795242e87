"""Workload 8: a numeric table (int64 id, float32 features) from Parquet, Arrow and pandas.

Shuffled, batch 256, in one process: ours gathers a ``TableDataset`` a batch at a time (and
streams the Parquet file's row groups with ``ParquetSource``); ``DataLoader`` reads the same
table a row at a time, as a plain map-style dataset over it would."""

from __future__ import annotations

import sys
import tempfile
import time
from collections.abc import Callable
from functools import partial
from pathlib import Path
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Dataset

from benchmarks.common import (
    DATALOADER,
    OURS,
    Plot,
    Report,
    Settings,
    close_loader,
    interleaved,
    median,
    paired_ratio,
    seconds_per_batch,
    standalone,
)

__all__ = ["ArrowRows", "PandasRows", "main", "run"]

BATCH_SIZE = 256
FEATURES = 8
ROW_GROUP = 65_536  # rows per Parquet row group and per Arrow record batch
SERIES = (f"{OURS} samples/s", f"{DATALOADER} samples/s")


class ArrowRows(Dataset[dict[str, Any]]):
    """Row ``i`` of a ``pyarrow.Table`` as a dict, read on its own (the peer's dataset)."""

    def __init__(self, table: Any) -> None:
        self.table = table

    def __len__(self) -> int:
        return int(self.table.num_rows)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.table.slice(index, 1).to_pylist()[0]


class PandasRows(Dataset[dict[str, Any]]):
    """Row ``i`` of a pandas ``DataFrame`` as a dict, through ``iloc`` (the peer's dataset)."""

    def __init__(self, frame: Any) -> None:
        self.frame = frame

    def __len__(self) -> int:
        return len(self.frame)

    def __getitem__(self, index: int) -> dict[str, Any]:
        return self.frame.iloc[index].to_dict()


def _table(n: int) -> Any:
    import pyarrow as pa

    features = np.random.default_rng(0).standard_normal((n, FEATURES), dtype=np.float32)
    columns: dict[str, np.ndarray] = {"id": np.arange(n, dtype=np.int64)}
    columns.update({f"x{k}": features[:, k] for k in range(FEATURES)})
    return pa.table(columns)


def _workloads(table: Any, folder: Path) -> dict[str, tuple[Any, Any]]:
    """Per workload: (our dataset, the peer's dataset), both over the same rows."""
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lightning_loaders.sources.parquet import ParquetSource
    from lightning_loaders.sources.tables import TableDataset

    parquet, arrow = folder / "table.parquet", folder / "table.arrow"
    pq.write_table(table, parquet, row_group_size=ROW_GROUP)
    with pa.OSFile(str(arrow), "wb") as sink, pa.ipc.new_file(sink, table.schema) as writer:
        writer.write_table(table, max_chunksize=ROW_GROUP)
    from_parquet = pq.read_table(parquet)
    from_arrow = pa.ipc.open_file(pa.memory_map(str(arrow))).read_all()
    frame = table.to_pandas()
    return {
        "Parquet file": (TableDataset(from_parquet), ArrowRows(from_parquet)),
        "Arrow IPC file (memory-mapped)": (TableDataset(from_arrow), ArrowRows(from_arrow)),
        "pandas DataFrame": (TableDataset(frame), PandasRows(frame)),
        "ParquetSource (row groups streamed)": (ParquetSource(parquet), ArrowRows(from_parquet)),
    }


def run(settings: Settings, rows: int | None = None) -> Report:
    from lightning_loaders import ResumableLoader

    n = rows or settings.pick(100_000, 1_000_000)
    batches = settings.pick(20, 100)
    out = []
    with tempfile.TemporaryDirectory() as folder:
        for label, (ours, peer) in _workloads(_table(n), Path(folder)).items():
            loader = ResumableLoader(ours, batch_size=BATCH_SIZE, shuffle=True)
            plain = DataLoader(peer, batch_size=BATCH_SIZE, shuffle=True)
            try:
                peer_time: Callable[[], float] = partial(seconds_per_batch, plain, batches, 2)
                times = interleaved({OURS: _whole_epoch(loader), DATALOADER: peer_time},
                                    settings.repeats, f"tables {label}", settings)
            finally:
                close_loader(loader)
            gathered = getattr(loader, "gathers_in_memory", False)
            out.append({"config": label, "gathered": "yes" if gathered else "no",
                        SERIES[0]: BATCH_SIZE / median(times[OURS]),
                        SERIES[1]: BATCH_SIZE / median(times[DATALOADER]),
                        f"ours / {DATALOADER}": paired_ratio(times[OURS], times[DATALOADER],
                                                             higher_is_better=False)})
    return Report(
        name="tables",
        title=f"8. Numeric table ({n:,} rows: int64 id + {FEATURES} float32), batch "
              f"{BATCH_SIZE}, shuffled, one process: samples/s",
        columns=("config", "gathered", *SERIES, f"ours / {DATALOADER}"),
        rows=out,
        notes=(
            f"Per repetition: ours delivers one whole epoch ({-(-n // BATCH_SIZE):,} batches, "
            "its epoch start included, since it gathers several batches at a time); DataLoader "
            f"delivers {batches} batches of a new iter() after 2 warm-up batches. Seconds per "
            f"batch, median of {settings.repeats} repetitions (the two loaders take turns); "
            "ratio: median of the per-repetition ratios.",
            "ours: ResumableLoader(TableDataset(table)), each batch one vectorised take per "
            "column into tensors ('gathered'). DataLoader: a map-style dataset whose "
            "__getitem__ is table.slice(i, 1).to_pylist()[0] (pandas: frame.iloc[i].to_dict()),"
            " then default_collate; its rows are Python values, so its features collate to "
            "float64 where ours stay float32.",
            "ParquetSource streams the file's row groups in a shuffled order (no shuffle "
            "buffer), converting them column by column into per-row dicts, then "
            "default_collate: no table in memory, but per-row Python.",
            "The Parquet file is read whole with pyarrow.parquet.read_table; the Arrow IPC file "
            f"is memory-mapped; both have {ROW_GROUP:,}-row row groups / record batches, made "
            "contiguous once by TableDataset.",
        ),
        plot=Plot("config", SERIES, "samples/s", log=True),
    )


def _whole_epoch(loader: Any) -> Callable[[], float]:
    """A case for ``interleaved``: the next whole epoch's seconds per batch."""
    def case() -> float:
        start, count = time.perf_counter(), 0
        for _ in loader:
            count += 1
        return (time.perf_counter() - start) / count

    return case


def main(argv: list[str] | None = None) -> int:
    return standalone(run, __doc__.splitlines()[0],
                      {"rows": "table rows (default 100000, 1000000 with --full)"}, argv)


if __name__ == "__main__":
    sys.exit(main())
