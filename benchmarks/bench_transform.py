"""Workload 2: a CPU-bound per-sample transform (a few hundred microseconds of numpy work per
sample), shuffled, batch 32, with 0, 1 and 2 workers."""

from __future__ import annotations

import time

import numpy as np
import torch
from torch.utils.data import Dataset

from benchmarks.common import (
    Plot,
    Report,
    Settings,
    compare_throughput,
    median,
    standalone,
    throughput_columns,
    throughput_note,
    throughput_series,
)

__all__ = ["TransformDataset", "run"]

BATCH_SIZE = 32


class TransformDataset(Dataset[torch.Tensor]):
    """Sample ``i``: ``rounds`` passes of elementwise numpy math over a 4096-float row."""

    def __init__(self, n: int, rounds: int = 12) -> None:
        self.n = n
        self.rounds = rounds
        self.base = np.random.default_rng(0).standard_normal((256, 4096)).astype(np.float32)

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        x = self.base[index % len(self.base)]
        for _ in range(self.rounds):
            x = np.tanh(x * np.float32(1.5) + np.float32(0.1))
        return torch.from_numpy(x)


def sample_seconds(dataset: Dataset[torch.Tensor], samples: int = 200) -> float:
    """Median seconds of one ``dataset[i]`` call (the work per sample)."""
    times = []
    for i in range(samples):
        start = time.perf_counter()
        dataset[i]
        times.append(time.perf_counter() - start)
    return median(times)


def run(settings: Settings) -> Report:
    n = settings.pick(2_048, 20_000)
    batches = settings.pick(10, 20)
    dataset = TransformDataset(n)
    per_sample = sample_seconds(dataset)
    configs = {f"num_workers={w}": {"batch_size": BATCH_SIZE, "shuffle": True, "num_workers": w}
               for w in (0, 1, 2)}
    rows = compare_throughput(dataset, configs, batches, settings, "transform")
    return Report(
        name="transform",
        title=f"2. CPU-bound per-sample transform ({per_sample * 1e6:.0f} us of numpy per sample),"
              f" batch {BATCH_SIZE}, shuffled: samples/s",
        columns=throughput_columns(),
        rows=rows,
        notes=(throughput_note(batches, settings),),
        plot=Plot("config", throughput_series(), "samples/s"),
    )


if __name__ == "__main__":
    raise SystemExit(standalone(run, __doc__.splitlines()[0], {}))
