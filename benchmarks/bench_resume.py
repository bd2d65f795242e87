"""Workload 5: resume. Time from ``load_state_dict`` to the first batch at growing positions of
an epoch of a 10^9-sample shuffled dataset, and the size of the state.

Peers cannot shuffle 10^9 samples on this machine (``RandomSampler`` materialises
``randperm(n).tolist()``, about 36 GB for 10^9), so they run on a smaller dataset at the
positions it has: ``StatefulDataLoader`` (restores its sampler by regenerating the permutation
and stepping through it) and ``DataLoader`` replaying the epoch up to the position.
"""

from __future__ import annotations

import math
import pickle
import time
from typing import Any

import numpy as np
from torch.utils.data import DataLoader, Dataset

from benchmarks.common import (
    DATALOADER,
    OURS,
    STATEFUL,
    Plot,
    Report,
    Settings,
    interleaved,
    median,
    paired_ratio,
    standalone,
)

__all__ = ["IndexDataset", "run"]

BATCH_SIZE = 256
N_OURS = 10**9
REPLAY = f"{DATALOADER} (replay)"


class IndexDataset(Dataset[int]):
    """Sample ``i`` is ``i``: cheap, so the measurement is the resume itself."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


def _ours(n: int) -> Any:
    from lightning_loaders import ResumableLoader

    return ResumableLoader(IndexDataset(n), batch_size=BATCH_SIZE, shuffle=True, seed=0)


def _ours_state(batches: int) -> dict[str, Any]:
    """The state a checkpoint taken after ``batches`` batches of epoch 0 holds: a loader
    moved to the batch before by a cursor, then one batch read, so that the state is the one
    delivery writes (its resume audit included); at 0, a new loader's."""
    loader = _ours(N_OURS)
    cursor = loader.state_dict()
    if batches == 0:
        return cursor
    cursor["batches"] = batches - 1
    loader.load_state_dict(cursor)
    next(iter(loader))
    return loader.state_dict()


def _ours_latency(state: dict[str, Any]) -> float:
    from lightning_loaders.orders.base import ShuffledOrder

    loader = _ours(N_OURS)
    start = time.perf_counter()
    loader.load_state_dict(state)
    batch = next(iter(loader))
    elapsed = time.perf_counter() - start
    position = np.array([state["batches"] * BATCH_SIZE])
    expected = int(ShuffledOrder(N_OURS, 0).indices(0, position)[0])
    if int(batch[0]) != expected:
        raise AssertionError(f"resumed at the wrong sample: {int(batch[0])} != {expected}")
    return elapsed


def _stateful(n: int) -> Any:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(IndexDataset(n), batch_size=BATCH_SIZE, shuffle=True)


def _stateful_state(n: int, batches: int) -> dict[str, Any]:
    loader = _stateful(n)
    iterator = iter(loader)
    for _ in range(batches):
        next(iterator)
    return dict(loader.state_dict())


def _stateful_latency(n: int, state: dict[str, Any]) -> float:
    loader = _stateful(n)
    start = time.perf_counter()
    loader.load_state_dict(state)
    next(iter(loader))
    return time.perf_counter() - start


def _replay_latency(n: int, batches: int) -> float:
    start = time.perf_counter()
    iterator = iter(DataLoader(IndexDataset(n), batch_size=BATCH_SIZE, shuffle=True))
    for _ in range(batches + 1):
        next(iterator)
    return time.perf_counter() - start


def run(settings: Settings) -> Report:
    n_peer = settings.pick(10**6, 10**7)
    positions = [0, 1024, 999_936, N_OURS - BATCH_SIZE]
    rows = []
    for position in positions:
        batches = position // BATCH_SIZE
        state = _ours_state(batches)
        cases = {OURS: lambda state=state: _ours_latency(state)}
        stateful_state: dict[str, Any] | None = None
        if position < n_peer:
            stateful_state = _stateful_state(n_peer, batches)
            cases[STATEFUL] = lambda s=stateful_state: _stateful_latency(n_peer, s)
            cases[REPLAY] = lambda b=batches: _replay_latency(n_peer, b)
        times = interleaved(cases, settings.repeats, f"resume @{position:,}", settings)
        ms = {name: median(values) * 1e3 for name, values in times.items()}
        rows.append({
            "position": position,
            "ours (ms)": ms[OURS],
            f"{STATEFUL} (ms)": ms.get(STATEFUL, math.nan),
            f"{REPLAY} (ms)": ms.get(REPLAY, math.nan),
            "ours state (bytes)": len(pickle.dumps(state)),
            f"{STATEFUL} state (bytes)": (len(pickle.dumps(stateful_state))
                                          if stateful_state is not None else math.nan),
            f"{STATEFUL} / ours": (paired_ratio(times[OURS], times[STATEFUL],
                                                higher_is_better=False)
                                   if STATEFUL in times else math.nan),
        })
    return Report(
        name="resume",
        title=f"5. Resume: load_state_dict to first batch, batch {BATCH_SIZE}, shuffled "
              f"(ours: n = {N_OURS:,}; peers: n = {n_peer:,})",
        columns=("position", "ours (ms)", f"{STATEFUL} (ms)", f"{REPLAY} (ms)",
                 "ours state (bytes)", f"{STATEFUL} state (bytes)", f"{STATEFUL} / ours"),
        rows=rows,
        notes=("Position = samples of the epoch already delivered when the state was saved; "
               "ours checks that the first resumed sample is the one at that position.",
               "State size: len(pickle.dumps(state_dict())).",
               f"Peers have no entry past their dataset (n = {n_peer:,}): shuffling 10^9 "
               "samples with RandomSampler needs ~36 GB.",
               f"Medians of {settings.repeats} interleaved repetitions, num_workers=0."),
        plot=Plot("position", ("ours (ms)", f"{STATEFUL} (ms)", f"{REPLAY} (ms)"), "ms",
                  log=True),
    )


if __name__ == "__main__":
    raise SystemExit(standalone(run, __doc__.splitlines()[0], {}))
