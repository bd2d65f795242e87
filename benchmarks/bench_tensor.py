"""Workload 1: an in-memory tensor dataset (``TensorDataset`` of N x 64 float32 features and
int64 labels), shuffled, batch 256, with 0 and 2 workers."""

from __future__ import annotations

import torch
from torch.utils.data import TensorDataset

from benchmarks.common import (
    Plot,
    Report,
    Settings,
    compare_throughput,
    standalone,
    throughput_columns,
    throughput_note,
    throughput_series,
)

__all__ = ["run"]

BATCH_SIZE = 256
FEATURES = 64


def run(settings: Settings) -> Report:
    n = settings.pick(100_000, 1_000_000)
    batches = settings.pick(100, 300)
    generator = torch.Generator().manual_seed(0)
    dataset = TensorDataset(torch.randn(n, FEATURES, generator=generator), torch.arange(n))
    configs = {f"num_workers={w}": {"batch_size": BATCH_SIZE, "shuffle": True, "num_workers": w}
               for w in (0, 2)}
    rows = compare_throughput(dataset, configs, batches, settings, "tensor")
    return Report(
        name="tensor",
        title=f"1. In-memory TensorDataset ({n:,} x {FEATURES} float32), batch {BATCH_SIZE}, "
              "shuffled: samples/s",
        columns=throughput_columns(),
        rows=rows,
        notes=(throughput_note(batches, settings),),
        plot=Plot("config", throughput_series(), "samples/s",
                  log=True),
    )


if __name__ == "__main__":
    raise SystemExit(standalone(run, __doc__.splitlines()[0], {}))
