"""Where a worker's epoch goes: its time in the dataset's code, the gaps between batches, and
the wait at each end of the epoch, per worker, for ``bench_throughput``'s numpy workload.

The limit assumes that every core runs the dataset's code all epoch. This shows what keeps a
worker from it: the gaps (collating, packing and sending a batch, taking the next request, the
main process on the same core) and the epoch's start and tail. A wrapper's ``__getitems__``
writes each batch's start and end (and the thread CPU time between them) to shared memory;
batches are not shuffled, so the first index names the batch.

    python -m benchmarks.worker_timeline [--epochs 6] [--workers 2] [--backend process]
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import sys
import threading
import time
from typing import Any

import numpy as np
from torch.utils.data import Dataset, default_collate

from benchmarks.bench_throughput import NUMPY_ROUNDS
from benchmarks.bench_transform import TransformDataset

__all__ = ["Timed", "main"]

_FIELDS = 4  # per batch: start, end, thread CPU seconds, the thread's native id


class Timed(Dataset[Any]):
    """``dataset`` whose ``__getitems__`` records each batch's span in a shared array."""

    def __init__(self, dataset: Any, batch_size: int) -> None:
        self.dataset, self.batch_size = dataset, batch_size
        batches = -(-len(dataset) // batch_size)
        self.spans = multiprocessing.get_context("fork").RawArray("d", _FIELDS * batches)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> Any:
        return self.dataset[index]

    def __getitems__(self, indices: list[int]) -> list[Any]:
        start, cpu = time.perf_counter(), time.thread_time()
        samples = [self.dataset[i] for i in indices]
        k = _FIELDS * (indices[0] // self.batch_size)
        self.spans[k:k + _FIELDS] = [start, time.perf_counter(), time.thread_time() - cpu,
                                     float(threading.get_native_id())]
        return samples

    def table(self) -> np.ndarray:
        return np.frombuffer(self.spans, dtype=np.float64).reshape(-1, _FIELDS).copy()


def _serial_s(dataset: Any, batch_size: int) -> float:
    """One core's epoch with no loader: the limit's numerator."""
    start = time.perf_counter()
    for first in range(0, len(dataset), batch_size):
        default_collate([dataset[i] for i in range(first, min(first + batch_size, len(dataset)))])
    return time.perf_counter() - start


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--epochs", type=int, default=6)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--backend", default="process", choices=["process", "thread", "auto"])
    parser.add_argument("--samples", type=int, default=4096)
    args = parser.parse_args(argv)

    from lightning_loaders import ResumableLoader

    batch_size, cores = 32, len(os.sched_getaffinity(0))
    dataset = Timed(TransformDataset(args.samples, rounds=NUMPY_ROUNDS), batch_size)
    limit = _serial_s(dataset.dataset, batch_size) / cores
    print(f"limit (one core's serial epoch / {cores} cores): {limit:.3f} s")
    loader = ResumableLoader(dataset, batch_size=batch_size, shuffle=False,
                             num_workers=args.workers, backend=args.backend)
    with loader:
        for epoch in range(args.epochs):
            start, cpu = time.perf_counter(), time.process_time()
            for _ in loader:
                pass
            end, cpu = time.perf_counter(), time.process_time() - cpu
            spans = dataset.table()
            print(f"epoch {epoch}: {end - start:.3f} s, {limit / (end - start):.3f} of the "
                  f"limit; main process CPU {1000 * cpu:.0f} ms; samples' CPU "
                  f"{spans[:, 2].sum():.3f} s")
            for tid in sorted(set(spans[:, 3])):
                mine = spans[spans[:, 3] == tid]
                mine = mine[np.argsort(mine[:, 0])]
                gaps = mine[1:, 0] - mine[:-1, 1]
                print(f"  worker (thread id {int(tid)}): {len(mine)} batches, samples "
                      f"{mine[:, 1].sum() - mine[:, 0].sum():.3f} s, gaps "
                      f"{1000 * gaps.sum():.1f} ms, start +{1000 * (mine[0, 0] - start):.1f} ms, "
                      f"tail {1000 * (end - mine[-1, 1]):.1f} ms")
    return 0


if __name__ == "__main__":
    sys.exit(main())
