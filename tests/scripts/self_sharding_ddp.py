"""One rank of plain datasets that split their stream by rank themselves, under real DDP
(launched by ``tests/loaders/test_self_sharding.py`` through ``tests/ddp_harness.run_ddp``).

For each case it reads one epoch through ``ResumableLoader`` and reports either the ids this
rank received or the error it raised::

    {"<case>": {"ids": [...]} | {"error": "<type>: <message>"}, ...}

    python tests/scripts/self_sharding_ddp.py DATA_DIR
"""

from __future__ import annotations

import random
import sys
import warnings
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist
import webdataset as wds
from torch.utils.data import IterableDataset

from lightning_loaders import ResumableLoader
from tests.ddp_harness import write_result
from tests.loaders.test_self_sharding import DistRankSplit, ShuffleBuffer, _wds_sample, read_ids


class UnsizedDistRankSplit(DistRankSplit):
    def __len__(self) -> int:
        raise TypeError("unsized")


class RankSeededShuffle(IterableDataset[dict[str, int]]):
    """Shuffles its ids with a generator seeded by the rank (its own, not the global RNGs)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __iter__(self) -> Iterator[dict[str, int]]:
        order = list(self.ids)
        random.Random(dist.get_rank()).shuffle(order)
        return ({"id": i} for i in order)


def webdataset_seeded_per_rank(data_dir: str) -> Any:
    """A WebDataset whose shard shuffle seed differs by rank (as ``seed=None`` draws one per
    process): the loader seeds its shuffles, so the ranks read one stream."""
    urls = sorted(str(path) for path in Path(data_dir).glob("*.tar"))
    return wds.WebDataset(urls, shardshuffle=4, seed=dist.get_rank()).decode().map(_wds_sample)


def main() -> None:
    warnings.filterwarnings("ignore")
    data_dir = sys.argv[1]
    dist.init_process_group("gloo")
    ids = read_ids(data_dir)
    cases: dict[str, tuple[Callable[[], Any], int]] = {
        "dist-unsized-w0": (lambda: UnsizedDistRankSplit(ids), 0),
        "dist-unsized-w2": (lambda: UnsizedDistRankSplit(ids), 2),
        "dist-sized-w0": (lambda: DistRankSplit(ids), 0),
        "seed-per-rank-w2": (lambda: RankSeededShuffle(ids), 2),
        "shuffle-buffer-w0": (lambda: ShuffleBuffer(ids), 0),
        "wds-seed-per-rank-w2": (lambda: webdataset_seeded_per_rank(data_dir), 2),
    }
    results: dict[str, Any] = {}
    for name, (build, workers) in cases.items():
        loader = ResumableLoader(build(), batch_size=4, num_workers=workers)
        try:
            results[name] = {"ids": [i for batch in loader for i in batch["id"].tolist()]}
        except Exception as exc:  # reported to the launching test
            results[name] = {"error": f"{type(exc).__name__}: {exc}"}
        loader.close()
        dist.barrier()
    write_result(results)


if __name__ == "__main__":
    main()
