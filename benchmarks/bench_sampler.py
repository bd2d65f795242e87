"""Workload 6: the sampler alone for a shuffled dataset of up to 10^9 samples: peak memory, time
to the first batch of indices and time per further batch.

Ours is the plan the loader runs (``MapSchedule`` over ``ShuffledOrder``); the peer is what
``DataLoader(shuffle=True)`` runs (``BatchSampler`` over ``RandomSampler``), which cannot
shuffle 10^9 samples here (``randperm(n).tolist()`` needs ~36 GB). Each case runs in its own
process (``python -m benchmarks.bench_sampler KIND N BATCHES``): first timed, then again under
``tracemalloc`` for the peak of the memory it allocates (Python objects and numpy buffers;
torch tensor storage is not traced, which only favours ``RandomSampler``).
"""

from __future__ import annotations

import json
import math
import subprocess
import sys
import time
import tracemalloc
from collections.abc import Iterator
from pathlib import Path
from typing import Any

from benchmarks.common import (
    Plot,
    Report,
    Settings,
    interleaved,
    median,
    ratio,
    standalone,
)

__all__ = ["measure_case", "run"]

REPO = Path(__file__).resolve().parent.parent
BATCH_SIZE = 256
OURS_KIND = "ours"
TORCH_KIND = "RandomSampler"


def _ours(n: int) -> Iterator[Any]:
    """Batch requests of epoch after epoch, as the loader asks for them."""
    from lightning_loaders.orders.base import ShuffledOrder
    from lightning_loaders.schedule.map_schedule import MapSchedule

    schedule = MapSchedule(ShuffledOrder(n, 0), BATCH_SIZE, "keep", 0, rank=0, world_size=1)
    while True:
        schedule.begin_epoch()
        for request in schedule.requests():
            schedule.delivered()
            yield request


def _torch(n: int) -> Iterator[Any]:
    """Index batches of epoch after epoch, as ``DataLoader(shuffle=True)`` asks for them."""
    from torch.utils.data import BatchSampler, RandomSampler

    sampler = BatchSampler(RandomSampler(range(n)), BATCH_SIZE, drop_last=False)
    while True:
        yield from sampler


def measure_case(kind: str, n: int, batches: int) -> dict[str, float]:
    """Peak traced memory (MiB), first batch (ms) and further batches (us each) of a sampler."""
    make = _ours if kind == OURS_KIND else _torch
    next(make(1))  # imports, outside the measurements
    start = time.perf_counter()
    requests = make(n)
    next(requests)
    first = time.perf_counter() - start
    start = time.perf_counter()
    for _ in range(batches):
        next(requests)
    per_batch = (time.perf_counter() - start) / batches
    del requests
    tracemalloc.start()
    requests = make(n)
    for _ in range(min(batches, 100)):
        next(requests)
    peak = tracemalloc.get_traced_memory()[1]
    tracemalloc.stop()
    return {"peak_mib": peak / 2**20, "first_ms": first * 1e3, "batch_us": per_batch * 1e6}


def _run_case(kind: str, n: int, batches: int) -> dict[str, float]:
    out = subprocess.run([sys.executable, "-m", "benchmarks.bench_sampler", kind, str(n),
                          str(batches)], check=True, capture_output=True, text=True, cwd=REPO)
    return dict(json.loads(out.stdout.strip().splitlines()[-1]))


def run(settings: Settings) -> Report:
    batches = settings.pick(200, 2000)
    ours_sizes = [10**3, 10**6, 10**7, 10**9]
    torch_sizes = settings.pick([10**3, 10**6], [10**3, 10**6, 10**7])
    repeats = max(1, settings.repeats // 4)
    results: dict[tuple[str, int], list[dict[str, float]]] = {}

    def case(kind: str, n: int) -> Any:
        def measure() -> float:
            result = _run_case(kind, n, batches)
            results.setdefault((kind, n), []).append(result)
            return result["batch_us"]
        return measure

    cases = {f"{OURS_KIND} {n}": case(OURS_KIND, n) for n in ours_sizes}
    cases.update({f"{TORCH_KIND} {n}": case(TORCH_KIND, n) for n in torch_sizes})
    interleaved(cases, repeats, "sampler", settings)

    def stat(kind: str, n: int, key: str) -> float:
        runs = results.get((kind, n))
        return median([r[key] for r in runs]) if runs else math.nan

    rows = []
    for n in ours_sizes:
        row: dict[str, Any] = {"dataset size": f"10^{round(math.log10(n))}"}
        batches_per_epoch = -(-n // BATCH_SIZE)
        for kind in (OURS_KIND, TORCH_KIND):
            first_ms, batch_us = stat(kind, n, "first_ms"), stat(kind, n, "batch_us")
            row[f"{kind} peak (MiB)"] = stat(kind, n, "peak_mib")
            row[f"{kind} first batch (ms)"] = first_ms
            row[f"{kind} per batch (us)"] = batch_us
            row[f"{kind} epoch average (us/batch)"] = (
                (first_ms * 1e3 + batch_us * (batches_per_epoch - 1)) / batches_per_epoch)
        row["epoch average: RandomSampler / ours"] = ratio(
            row["ours epoch average (us/batch)"], row["RandomSampler epoch average (us/batch)"],
            higher_is_better=False)
        rows.append(row)
    columns = ("dataset size", *(f"{kind} {what}" for kind in (OURS_KIND, TORCH_KIND)
                                 for what in ("peak (MiB)", "first batch (ms)", "per batch (us)",
                                              "epoch average (us/batch)")),
               "epoch average: RandomSampler / ours")
    return Report(
        name="sampler",
        title=f"6. Shuffled sampler alone, batch {BATCH_SIZE}: memory and time per batch",
        columns=columns,
        rows=rows,
        notes=(f"Per batch: mean over {batches} batches after the first; epoch average: the first "
               "batch and the others averaged over a whole epoch. Peak: tracemalloc peak "
               "over building the sampler and 100 batches (RandomSampler's randperm tensor, "
               "8 bytes per sample, is not traced). Each case in a fresh process; medians of "
               f"{repeats} interleaved repetitions.",
               "RandomSampler has no entry at 10^9 (randperm(10^9).tolist() needs ~36 GB)."),
        plot=Plot("dataset size", ("ours peak (MiB)", "RandomSampler peak (MiB)"), "MiB",
                  log=True),
    )


if __name__ == "__main__":
    if len(sys.argv) > 1 and not sys.argv[1].startswith("-"):  # one case, for run()
        print(json.dumps(measure_case(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]))))
    else:
        raise SystemExit(standalone(run, __doc__.splitlines()[0], {}))
