"""Where our loader spends its time per batch: ``cProfile`` over a loop of ``next()``.

The benchmarks say how fast; this says where the time goes, for the workloads whose cost is
the loader's own (``bench_overhead``'s trivial samples, ``bench_tensor``'s in-memory gather).
Prints the functions with the most time of their own, in the main process (``num_workers=0``).

    python -m benchmarks.profile_loader [--workload tensor] [--batches 3000] [--top 15]
"""

from __future__ import annotations

import argparse
import cProfile
import itertools
import pstats
import sys
import time
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import TensorDataset

from benchmarks.bench_resume import IndexDataset

__all__ = ["main"]

WORKLOADS = {
    "trivial": lambda: (IndexDataset(10**6), 32),
    "tensor": lambda: (TensorDataset(torch.randn(10**6, 64), torch.arange(10**6)), 256),
}


def _forever(loader: Any) -> Iterator[Any]:
    """Batches across epoch ends."""
    while True:
        yield from loader


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workload", choices=sorted(WORKLOADS), default="trivial")
    parser.add_argument("--batches", type=int, default=3000)
    parser.add_argument("--top", type=int, default=15)
    args = parser.parse_args(argv)
    from lightning_loaders import ResumableLoader

    dataset, batch_size = WORKLOADS[args.workload]()
    batches = _forever(ResumableLoader(dataset, batch_size=batch_size, shuffle=True))
    next(batches)  # the first epoch's plan and the fetch path are set up outside the profile
    start = time.perf_counter()
    for _ in itertools.islice(batches, args.batches):
        pass
    print(f"{args.workload}: {(time.perf_counter() - start) / args.batches * 1e6:.1f} us per "
          f"batch of {batch_size} without the profiler\n")
    profile = cProfile.Profile()
    profile.runcall(lambda: [None for _ in itertools.islice(batches, args.batches)])
    pstats.Stats(profile).sort_stats("tottime").print_stats(args.top)
    return 0


if __name__ == "__main__":
    sys.exit(main())
