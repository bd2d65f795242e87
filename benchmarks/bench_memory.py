"""Workload 4: a Python-object dataset (a list of small dicts) read by 2 forked workers over a
whole epoch: how much the workers' private memory grows (copy-on-access after ``fork``).

Each case runs in its own process (``python -m benchmarks.bench_memory CASE N``), so a worker
only inherits the data of its own case. Growth is the workers' unique set size (USS: pages no
other process shares, so pages copied since the fork) at the end of the epoch minus at their
start (``worker_init_fn``, before any sample is read), summed over workers. A baseline case
reads no metadata at all: its growth is the workers' own allocations (the noise floor).
"""

from __future__ import annotations

import gc
import json
import multiprocessing
import os
import subprocess
import sys
from collections.abc import Sequence
from functools import partial
from pathlib import Path
from typing import Any

from torch.utils.data import Dataset

from benchmarks.common import (
    DATALOADER,
    OURS,
    Plot,
    Report,
    Settings,
    close_loader,
    interleaved,
    make_loaders,
    median,
    ratio,
    standalone,
)

__all__ = ["CASES", "RecordDataset", "make_records", "measure_case", "run"]

REPO = Path(__file__).resolve().parent.parent
BATCH_SIZE = 256
WORKERS = 2
# case name -> (loader, storage)
CASES = {
    "DataLoader, list of dicts": (DATALOADER, "list"),
    "ours, list of dicts": (OURS, "list"),
    "DataLoader, pack()": (DATALOADER, "packed"),
    "ours, pack()": (OURS, "packed"),
    "baseline: ours, no metadata": (OURS, "none"),
}


def make_records(n: int) -> list[dict[str, Any]]:
    """Typical sample metadata: a path, a class label and a weight per sample."""
    return [{"path": f"/data/train/{i // 1000:05d}/{i:09d}.jpg", "label": i % 1000,
             "weight": 1.0 + (i % 7) / 10} for i in range(n)]


class RecordDataset(Dataset[dict[str, Any]]):
    """Reads sample ``i``'s record (from a list or a packed sequence alike)."""

    def __init__(self, records: Sequence[dict[str, Any]]) -> None:
        self.records = records

    def __len__(self) -> int:
        return len(self.records)

    def __getitem__(self, index: int) -> dict[str, Any]:
        record = self.records[index]
        return {"label": record["label"], "weight": record["weight"],
                "path_length": len(record["path"])}


class _NoMetadata(Dataset[dict[str, Any]]):
    """The same samples computed from the index alone: nothing inherited is read."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"label": index % 1000, "weight": 1.0 + (index % 7) / 10, "path_length": 30}


def _note_start(shared: Any, worker_id: int) -> None:
    import psutil

    shared[2 * int(worker_id)] = os.getpid()
    shared[2 * int(worker_id) + 1] = psutil.Process().memory_full_info().uss


def measure_case(case: str, n: int) -> dict[str, float]:
    """Run one epoch of ``case`` over ``n`` records; the workers' USS (MiB, summed) at their
    start and at the end of the epoch."""
    import psutil

    from lightning_loaders import pack

    loader_name, storage = CASES[case]
    dataset: Dataset[dict[str, Any]] = _NoMetadata(n)
    if storage != "none":
        records: Sequence[dict[str, Any]] = make_records(n)
        if storage == "packed":
            records = pack(records)
            gc.collect()
        dataset = RecordDataset(records)
    shared = multiprocessing.get_context("fork").RawArray("d", 2 * WORKERS)
    loader = make_loaders(dataset, [loader_name], batch_size=BATCH_SIZE, shuffle=True,
                          num_workers=WORKERS, multiprocessing_context="fork",
                          worker_init_fn=partial(_note_start, shared))[loader_name]
    for _ in loader:
        pass
    pids = [int(pid) for pid in shared[0::2]]
    end = sum(psutil.Process(pid).memory_full_info().uss for pid in pids)
    close_loader(loader)
    return {"start_mib": sum(shared[1::2]) / 2**20, "end_mib": end / 2**20}


def _run_case(case: str, n: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_memory", case, str(n)],
                         check=True, capture_output=True, text=True, cwd=REPO)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def run(settings: Settings) -> Report:
    n = settings.pick(100_000, 1_000_000)
    results: dict[str, list[dict[str, float]]] = {case: [] for case in CASES}

    def case_runner(case: str) -> Any:
        def measure() -> float:
            result = _run_case(case, n)
            results[case].append(result)
            return result["end_mib"] - result["start_mib"]
        return measure

    growth = interleaved({case: case_runner(case) for case in CASES},
                         max(1, settings.repeats // 4), "memory", settings)
    reference = median(growth["DataLoader, list of dicts"])
    floor = median(growth["baseline: ours, no metadata"])
    rows = []
    for case, values in growth.items():
        rows.append({
            "case": case,
            "workers' USS at start (MiB)": median([r["start_mib"] for r in results[case]]),
            "workers' USS at epoch end (MiB)": median([r["end_mib"] for r in results[case]]),
            "growth over the epoch (MiB)": median(values),
            "growth above baseline (MiB)": median(values) - floor,
            "DataLoader list growth / this growth": ratio(max(median(values), 0.01), reference,
                                                         higher_is_better=False),
        })
    return Report(
        name="memory",
        title=f"4. Worker memory over one epoch of {n:,} dicts, {WORKERS} forked workers, "
              f"batch {BATCH_SIZE}, shuffled",
        columns=("case", "workers' USS at start (MiB)", "workers' USS at epoch end (MiB)",
                 "growth over the epoch (MiB)", "growth above baseline (MiB)",
                 "DataLoader list growth / this growth"),
        rows=rows,
        notes=("USS: memory private to the worker processes (pages copied since the fork), "
               "summed over both workers, from worker_init_fn to the end of the epoch; each case "
               "runs in a fresh process. The baseline reads no inherited data: its growth is "
               "the workers' own allocations.",
               "pack() is lightning_loaders.pack: the same records in flat buffers.",
               f"Medians of {max(1, settings.repeats // 4)} interleaved repetitions (growth "
               "below 0.01 MiB counts as 0.01 in the ratio)."),
        plot=Plot("case", ("growth over the epoch (MiB)",), "MiB", log=True),
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):  # one case, for run()
        print(json.dumps(measure_case(sys.argv[1], int(sys.argv[2]))))
    else:
        raise SystemExit(standalone(run, __doc__.splitlines()[0], {}))
