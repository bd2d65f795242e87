"""Workload 0: the loader's own cost per batch. Samples cost nothing (sample ``i`` is ``i``),
so what is measured is each loader's machinery: sampling, fetching, collating, bookkeeping.
Measured in CPU time of the (single) process, which a busy shared machine disturbs far less
than wall time; ``num_workers=0``."""

from __future__ import annotations

import time
from typing import Any

from benchmarks.bench_resume import IndexDataset
from benchmarks.common import (
    OURS,
    Plot,
    Report,
    Settings,
    close_loader,
    loader_names,
    make_loaders,
    median,
    paired_ratio,
    round_robin,
    standalone,
)

__all__ = ["run"]


def run(settings: Settings) -> Report:
    n = 10**6
    batches = settings.pick(200, 1000)
    names = loader_names()
    rows = []
    for batch_size in (32, 256):
        loaders = make_loaders(IndexDataset(n), batch_size=batch_size, shuffle=True)
        try:
            times = round_robin(loaders, batches, settings.repeats, f"overhead {batch_size}",
                                settings, clock=time.process_time)
        finally:
            for loader in loaders.values():
                close_loader(loader)
        row: dict[str, Any] = {"batch size": batch_size}
        row.update({f"{name} (us/batch)": median(values) * 1e6 for name, values in times.items()})
        row["ours - DataLoader (us/batch)"] = (row[f"{OURS} (us/batch)"]
                                               - row["DataLoader (us/batch)"])
        row.update({f"{name} / ours": paired_ratio(times[OURS], values, higher_is_better=False)
                    for name, values in times.items() if name != OURS})
        rows.append(row)
    return Report(
        name="overhead",
        title="0. Per-batch cost of the loader itself (trivial samples, shuffled, "
              "num_workers=0): CPU us per batch",
        columns=("batch size", *(f"{name} (us/batch)" for name in names),
                 "ours - DataLoader (us/batch)",
                 *(f"{name} / ours" for name in names if name != OURS)),
        rows=rows,
        notes=(f"{batches} batches per repetition and loader, in 5 interleaved turns; CPU time "
               f"(time.process_time); medians of {settings.repeats} repetitions; ratios: median "
               "of the per-repetition ratios (above 1: ours costs less).",),
        plot=Plot("batch size", tuple(f"{name} (us/batch)" for name in names), "CPU us/batch"),
    )


if __name__ == "__main__":
    raise SystemExit(standalone(run, __doc__.splitlines()[0], {}))
