"""Workload 12: a long tail, one sample in fifty slow: throughput of ``in_order=False``
against ``in_order=True`` and against ``DataLoader(in_order=False)``.

Every sample costs a little CPU; every fiftieth sleeps (a slow disk read, a large image). In
order, the batch holding a slow sample stalls every batch after it; out of order, the other
workers' batches go on. Ours stays exactly resumable out of order (the state records the batches
delivered past the first undelivered one); ``DataLoader`` has no state. All three loaders use
the same workers, batch size and prefetch factor; each value is one whole epoch.
"""

from __future__ import annotations

import functools
import time
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from benchmarks.common import (
    Plot,
    Report,
    Settings,
    close_loader,
    interleaved,
    median,
    ratio,
    standalone,
)

__all__ = ["LongTail", "run"]

SLOW_EVERY = 50
BATCH_SIZE = 4
WORKERS = 2
IN_ORDER = "ours in_order=True"
OUT_OF_ORDER = "ours in_order=False"
TORCH = "DataLoader(in_order=False)"


class LongTail(Dataset[torch.Tensor]):
    """Sample ``i``: a small tensor; every ``SLOW_EVERY``-th sample sleeps ``slow_s`` first."""

    def __init__(self, n: int, slow_s: float) -> None:
        self.n, self.slow_s = n, slow_s

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        if index % SLOW_EVERY == SLOW_EVERY // 2:
            time.sleep(self.slow_s)
        return torch.full((16,), float(index)).sin()


def _loader(kind: str, data: LongTail) -> Any:
    from lightning_loaders import ResumableLoader

    common: dict[str, Any] = {"batch_size": BATCH_SIZE, "num_workers": WORKERS,
                              "shuffle": True, "prefetch_factor": 4,
                              "persistent_workers": True}
    if kind == TORCH:
        return DataLoader(data, in_order=False, generator=torch.Generator().manual_seed(0),
                          **common)
    return ResumableLoader(data, in_order=kind == IN_ORDER, seed=0, **common)


def _epoch_rate(loader: Any, samples: int) -> float:
    """Samples per second over one whole epoch (workers already started)."""
    start = time.perf_counter()
    count = sum(len(batch) for batch in loader)
    assert count == samples, (count, samples)
    return samples / (time.perf_counter() - start)


def run(settings: Settings, n: int | None = None, slow_ms: int | None = None) -> Report:
    n = n or settings.pick(400, 4000)
    slow_s = (slow_ms or settings.pick(20, 50)) / 1e3
    data = LongTail(n, slow_s)
    loaders = {kind: _loader(kind, data) for kind in (IN_ORDER, OUT_OF_ORDER, TORCH)}
    try:
        for loader in loaders.values():  # start the workers outside the measurements
            _epoch_rate(loader, n)
        rates = interleaved({kind: functools.partial(_epoch_rate, loader, n)
                             for kind, loader in loaders.items()},
                            settings.repeats, "long tail", settings)
    finally:
        for loader in loaders.values():
            close_loader(loader)
    row: dict[str, Any] = {"samples": n, "slow sample (ms)": round(slow_s * 1e3)}
    for kind in loaders:
        row[f"{kind} (samples/s)"] = median(rates[kind])
    ours = row[f"{OUT_OF_ORDER} (samples/s)"]
    row["out of order / in order"] = ratio(ours, row[f"{IN_ORDER} (samples/s)"], True)
    row["ours / DataLoader(in_order=False)"] = ratio(ours, row[f"{TORCH} (samples/s)"], True)
    return Report(
        name="long_tail",
        title=f"12. Long tail (1 sample in {SLOW_EVERY} slow): out-of-order delivery",
        columns=tuple(row),
        rows=[row],
        notes=(f"batch_size={BATCH_SIZE}, num_workers={WORKERS}, prefetch_factor=4, shuffled; "
               f"medians of {settings.repeats} interleaved whole epochs per loader, workers "
               "started before timing.",
               "ours in_order=False resumes exactly (each batch once); DataLoader(in_order="
               "False) has no state to resume from."),
        plot=Plot("samples", tuple(f"{kind} (samples/s)" for kind in loaders), "samples/s"),
    )


if __name__ == "__main__":
    raise SystemExit(standalone(run, __doc__.splitlines()[0], {
        "n": "samples per epoch", "slow_ms": "milliseconds a slow sample sleeps"}))
