"""Workload 7: epoch start latency with persistent workers: the time from ``iter()`` to the
first batch of epoch 2 (epochs 0 and 1 fully read first), 2 workers."""

from __future__ import annotations

import time
from functools import partial
from typing import Any

from benchmarks.bench_transform import TransformDataset, sample_seconds
from benchmarks.common import (
    OURS,
    Plot,
    Report,
    Settings,
    close_loader,
    interleaved,
    loader_names,
    make_loaders,
    median,
    paired_ratio,
    standalone,
)

__all__ = ["run"]

BATCH_SIZE = 32
WORKERS = 2


def _epoch_two_latency(name: str, dataset: Any) -> float:
    """A fresh loader reads epochs 0 and 1, then the first batch of epoch 2 is timed."""
    loader = make_loaders(dataset, [name], batch_size=BATCH_SIZE, shuffle=True,
                          num_workers=WORKERS)[name]
    try:
        for epoch in range(2):
            _set_epoch(loader, epoch)
            for _ in loader:
                pass
        _set_epoch(loader, 2)
        start = time.perf_counter()
        next(iter(loader))
        return time.perf_counter() - start
    finally:
        close_loader(loader)


def _set_epoch(loader: Any, epoch: int) -> None:
    """What Lightning does before each epoch."""
    set_epoch = getattr(getattr(loader, "sampler", None), "set_epoch", None)
    if callable(set_epoch):
        set_epoch(epoch)


def run(settings: Settings) -> Report:
    n = settings.pick(512, 2048)
    dataset = TransformDataset(n, rounds=2)
    per_sample = sample_seconds(dataset)
    names = loader_names()
    times = interleaved({name: partial(_epoch_two_latency, name, dataset) for name in names},
                        settings.repeats, "epoch start", settings)
    ms = {name: median(values) * 1e3 for name, values in times.items()}
    row: dict[str, Any] = {"config": f"num_workers={WORKERS}, persistent"}
    row.update({f"{name} (ms)": value for name, value in ms.items()})
    row.update({f"{name} / ours": paired_ratio(times[OURS], values, higher_is_better=False)
                for name, values in times.items() if name != OURS})
    return Report(
        name="epoch_start",
        title=f"7. Epoch start latency: iter() to first batch of epoch 2, batch {BATCH_SIZE}, "
              f"{per_sample * 1e6:.0f} us per sample, persistent workers",
        columns=("config", *(f"{name} (ms)" for name in names),
                 *(f"{name} / ours" for name in names if name != OURS)),
        rows=[row],
        notes=(f"Each repetition builds fresh loaders over {n:,} samples and reads epochs 0 and "
               f"1 first; medians of {settings.repeats} interleaved repetitions; ratios: median "
               "of the per-repetition ratios.",),
        plot=Plot("config", tuple(f"{name} (ms)" for name in names), "ms"),
    )


if __name__ == "__main__":
    raise SystemExit(standalone(run, __doc__.splitlines()[0], {}))
