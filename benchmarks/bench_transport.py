"""Workload 13: what a batch costs to cross from a worker process to the main process.

Samples cost nothing (every sample is the same prepared tensor, collated by
``default_collate``), so what is measured is the transport: our loader with torch's per-batch
shared-memory segments (``shared_ring=False``, the path before the rings), with the reusable
shared-memory rings (``engines.transport``, the default), and ``DataLoader``; 2 persistent
workers, ``prefetch_factor=2``. Per batch: wall time, the main process's CPU time (what
competes with training for the cores) and the CPU time of all processes.
"""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import torch
from torch.utils.data import DataLoader, Dataset

from benchmarks.common import (
    DATALOADER,
    Plot,
    Report,
    Settings,
    close_loader,
    cpu_seconds,
    interleaved,
    median,
    standalone,
)

__all__ = ["CASES", "TemplateDataset", "run"]

WORKERS = 2
TORCH_PATH = "ours, torch's path"
RING = "ours, ring"
LOADERS = (TORCH_PATH, RING, DATALOADER)


def _small_dict() -> dict[str, torch.Tensor]:
    return {f"feature{k}": torch.zeros(16, dtype=torch.float32) for k in range(8)} | {
        "label": torch.tensor(0), "mask": torch.zeros(16, dtype=torch.bool)}


def _stack(samples: list[torch.Tensor]) -> torch.Tensor:
    """A user's ``collate_fn``: its batch is made outside the ring, which copies it in."""
    return torch.stack(samples)


# case -> (batch size, a sample, collate_fn)
CASES: dict[str, tuple[int, Callable[[], Any], Callable[[list[Any]], Any] | None]] = {
    "64 x (3x32x32 uint8, label)": (64, lambda: (torch.zeros(3, 32, 32, dtype=torch.uint8), 0),
                                    None),
    "32 x (3x128x128 uint8, label)": (32, lambda: (torch.zeros(3, 128, 128,
                                                               dtype=torch.uint8), 0), None),
    "256 x (3x128x128 uint8, label)": (256, lambda: (torch.zeros(3, 128, 128,
                                                                 dtype=torch.uint8), 0), None),
    "64 x dict of 10 small tensors": (64, _small_dict, None),
    "16 x 64 KB float32 (1 MB)": (16, lambda: torch.zeros(16384, dtype=torch.float32), None),
    "16 x 1 MB float32 (16 MB)": (16, lambda: torch.zeros(262144, dtype=torch.float32), None),
    "16 x 1 MB float32 (16 MB), own collate_fn": (
        16, lambda: torch.zeros(262144, dtype=torch.float32), _stack),
}


class TemplateDataset(Dataset[Any]):
    """``n`` samples, all the same prepared ``sample``: reading one costs nothing."""

    def __init__(self, n: int, sample: Any) -> None:
        self.n, self.sample = n, sample

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> Any:
        return self.sample


def _loader(name: str, dataset: Dataset[Any], batch_size: int,
            collate_fn: Callable[[list[Any]], Any] | None) -> Any:
    from lightning_loaders import ResumableLoader

    kwargs: dict[str, Any] = {"batch_size": batch_size, "num_workers": WORKERS,
                              "persistent_workers": True, "prefetch_factor": 2,
                              "collate_fn": collate_fn}
    if name == DATALOADER:
        return DataLoader(dataset, **kwargs)
    loader = ResumableLoader(dataset, **kwargs)
    loader.shared_ring = name == RING
    return loader


def _nbytes(batch: Any) -> int:
    if isinstance(batch, torch.Tensor):
        return batch.nbytes
    if isinstance(batch, dict):
        return sum(_nbytes(value) for value in batch.values())
    return sum(_nbytes(value) for value in batch)


def _case(loader: Any, batches: int, warmup: int, main_cpu: list[float],
          all_cpu: list[float]) -> Callable[[], float]:
    """One epoch: ``warmup`` batches, then ``batches`` timed; seconds per batch (CPU times
    per batch go to ``main_cpu`` and ``all_cpu``)."""
    def run() -> float:
        iterator = iter(loader)
        for _ in range(warmup):
            next(iterator)
        wall, main, total = time.perf_counter(), cpu_seconds(), cpu_seconds(children=True)
        for _ in range(batches):
            next(iterator)
        wall = time.perf_counter() - wall
        main_cpu.append((cpu_seconds() - main) / batches)
        all_cpu.append((cpu_seconds(children=True) - total) / batches)
        for _ in iterator:  # finish the epoch: the next one starts clean
            pass
        return wall / batches

    return run


def run(settings: Settings) -> Report:
    batches = settings.pick(20, 200)
    warmup = 4
    rows = []
    for case, (batch_size, make, collate_fn) in CASES.items():
        dataset = TemplateDataset(batch_size * (warmup + batches), make())
        loaders = {name: _loader(name, dataset, batch_size, collate_fn) for name in LOADERS}
        size = _nbytes(next(iter(loaders[DATALOADER])))
        main_cpu: dict[str, list[float]] = {name: [] for name in LOADERS}
        all_cpu: dict[str, list[float]] = {name: [] for name in LOADERS}
        try:
            walls = interleaved({name: _case(loader, batches, warmup, main_cpu[name],
                                             all_cpu[name])
                                 for name, loader in loaders.items()},
                                settings.repeats, f"transport {case}", settings)
        finally:
            for loader in loaders.values():
                close_loader(loader)
        row: dict[str, Any] = {"batch": case, "MB": size / 1e6}
        for name in LOADERS:
            wall = median(walls[name])
            row[f"{name} (us/batch)"] = wall * 1e6
            row[f"{name} main CPU (us/batch)"] = median(main_cpu[name]) * 1e6
            row[f"{name} all CPU (us/batch)"] = median(all_cpu[name]) * 1e6
            row[f"{name} MB/s"] = size / 1e6 / wall
        rows.append(row)
    columns = ("batch", "MB",
               *(f"{name} (us/batch)" for name in LOADERS),
               *(f"{name} main CPU (us/batch)" for name in LOADERS),
               *(f"{name} all CPU (us/batch)" for name in LOADERS),
               *(f"{name} MB/s" for name in LOADERS))
    return Report(
        name="transport",
        title=f"13. Worker to main process transport ({WORKERS} workers, trivial samples, "
              "default_collate unless said): us per batch",
        columns=columns,
        rows=rows,
        notes=(f"Per repetition and loader (in a shuffled order), one epoch of a new iter() on "
               f"persistent workers: {warmup} warm-up batches, {batches} timed; medians of "
               f"{settings.repeats} repetitions. 'main CPU': the main process (all its "
               "threads); 'all CPU': main process and workers. MB/s: batch bytes / wall time.",
               f"'{TORCH_PATH}': shared_ring=False (torch's fresh segment per tensor: fd "
               f"passing, mmap, page faults); '{RING}': the default (engines.transport: "
               "default_collate stacks into a slot, the batch arrives as a view of it; an own "
               "collate_fn's batch is copied into the slot).",),
        plot=Plot("batch", tuple(f"{name} main CPU (us/batch)" for name in LOADERS),
                  "main-process CPU us/batch", log=True),
    )


if __name__ == "__main__":
    raise SystemExit(standalone(run, __doc__.splitlines()[0], {}))
