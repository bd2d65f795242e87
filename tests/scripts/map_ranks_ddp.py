"""One rank of map-style loaders whose sampler, seed or batches differ between ranks, under real
DDP (launched by ``tests/loaders/test_map_style.py`` through ``tests/ddp_harness.run_ddp``).

For each case it reads two epochs through a ``ResumableLoader`` (``make_resumable`` of a
``DataLoader``), as Lightning's loops read it (through its data fetcher, where the ranks
compare their plans), and reports either the indices this rank received in each epoch or the
error it raised; then rank 0 alone reads an epoch in a loop of its own (compared with nothing,
so it cannot wait for the other rank). Loaders with ``compare_ranks=True`` are read in a loop
of the ranks' own (every rank alike, where they compare), and one with ``compare_ranks=False``
through Lightning's loops (where it compares nothing)::

    {"<case>": {"epochs": [[...], [...]]} | {"error": "<type>: <message>"}, ...}

    python tests/scripts/map_ranks_ddp.py
"""

from __future__ import annotations

import warnings
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import DataLoader, Sampler, SubsetRandomSampler

from lightning_loaders import ResumableLoader, make_resumable
from tests.conftest import EpochSampler, IndexDataset
from tests.ddp_harness import write_result
from tests.lightning_harness import fetched_cases

N = 12


class WholeShuffle(Sampler[int]):
    """The whole dataset, shuffled from the global torch RNG (which the loader seeds)."""

    def __len__(self) -> int:
        return N

    def __iter__(self) -> Iterator[int]:
        return iter(torch.randperm(N).tolist())


class OwnRng(Sampler[int]):
    """A generator of its own, seeded alike on every rank: one order on every rank."""

    def __init__(self, seed: int = 0) -> None:
        self.rng = np.random.default_rng(seed)

    def __len__(self) -> int:
        return N

    def __iter__(self) -> Iterator[int]:
        return iter(self.rng.permutation(N).tolist())


class RankShare(Sampler[int]):
    """Megatron-style: splits by data-parallel rank itself (padded to equal shares, unless
    ``padded`` is false: then rank 0's share is longer with an odd ``n``)."""

    def __init__(self, n: int, padded: bool = True) -> None:
        self.n, self.padded = n, padded
        self.data_parallel_rank, self.data_parallel_size = dist.get_rank(), dist.get_world_size()

    def _share(self) -> list[int]:
        size = self.data_parallel_size
        indices = list(range(self.n))
        if self.padded:
            indices += indices[:-self.n % size]
        return indices[self.data_parallel_rank::size]

    def __len__(self) -> int:
        return len(self._share())

    def __iter__(self) -> Iterator[int]:
        return iter(self._share())


class ShortOnRankOne(Sampler[int]):
    """Says ``len()`` is ``N`` on every rank, but yields one index fewer on rank 1."""

    def __len__(self) -> int:
        return N

    def __iter__(self) -> Iterator[int]:
        return iter(range(N - dist.get_rank()))


class RankOrderFromEpochOne(EpochSampler):
    """One order on every rank in epoch 0, then rotated by the rank."""

    def __iter__(self) -> Iterator[int]:
        shift = dist.get_rank() if self.epoch else 0
        return iter([(i + shift) % N for i in range(N)])


def _plain(sampler: Sampler[int] | None = None, **kwargs: Any) -> Any:
    return make_resumable(DataLoader(IndexDataset(N), sampler=sampler, **{"batch_size": 2,
                                                                          **kwargs}))


def main() -> None:
    warnings.filterwarnings("ignore")
    dist.init_process_group("gloo")
    rank = dist.get_rank()
    cases: dict[str, Callable[[], Any]] = {
        "whole-sampler": lambda: _plain(WholeShuffle()),
        "own-rng-alike": lambda: _plain(OwnRng(0)),
        "shuffle": lambda: _plain(shuffle=True),
        "rank-share": lambda: _plain(RankShare(N)),
        "rank-share-uneven": lambda: _plain(RankShare(N - 1, padded=False)),
        "subset-per-rank": lambda: _plain(SubsetRandomSampler(range(rank, N, 2))),
        "generator-per-rank": lambda: _plain(
            shuffle=True, generator=torch.Generator().manual_seed(rank)),
        "short-on-rank-1": lambda: _plain(ShortOnRankOne()),
        "rank-order-from-epoch-1": lambda: _plain(RankOrderFromEpochOne(N)),
        "batch-size-per-rank": lambda: _plain(shuffle=True, batch_size=2 + rank),
        "rank-share-placed-by-hand": lambda: ResumableLoader(
            IndexDataset(N), sampler=RankShare(N), batch_size=2, rank=0, world_size=1),
    }
    results = fetched_cases(cases)
    results.update(fetched_cases({
        "rank-share-own-loop-compared": lambda: make_resumable(
            DataLoader(IndexDataset(N), sampler=RankShare(N), batch_size=2), compare_ranks=True),
        "shuffle-own-loop-compared": lambda: ResumableLoader(
            IndexDataset(N), batch_size=2, shuffle=True, compare_ranks=True),
    }, read=iter))
    results.update(fetched_cases({"rank-share-never-compared": lambda: make_resumable(
        DataLoader(IndexDataset(N), sampler=RankShare(N), batch_size=2), compare_ranks=False)}))
    if rank == 0:
        alone = _plain(shuffle=True)
        results["rank-0-alone"] = {"epochs": [[i for batch in alone
                                               for i in batch["index"].tolist()]]}
        alone.close()
    dist.barrier()
    write_result(results)


if __name__ == "__main__":
    main()
