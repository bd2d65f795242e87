"""One rank of plain datasets that split their stream by rank themselves, read another stream
or declare another ``len()`` on each rank, under real DDP (launched by
``tests/loaders/test_self_sharding.py`` through ``tests/ddp_harness.run_ddp``).

For each case it reads one epoch through ``ResumableLoader``, as Lightning's loops read it
(through its data fetcher, where the ranks compare their streams), and reports either the ids
this rank received or the error it raised; then rank 0 alone reads an epoch in a loop of its
own, and each rank reads one in a thread beside an ``all_reduce`` of the main thread (both
compared with nothing, so they neither wait for the other rank nor pair with its
``all_reduce``). Loaders with ``compare_ranks=True`` are read in a loop of the ranks' own (every
rank alike, where they compare), and one with ``compare_ranks=False`` through Lightning's loops
(where it compares nothing)::

    {"<case>": {"ids": [...]} | {"error": "<type>: <message>"}, ...}

    python tests/scripts/self_sharding_ddp.py DATA_DIR
"""

from __future__ import annotations

import os
import random
import sys
import threading
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist
import webdataset as wds
from torch.utils.data import IterableDataset

from lightning_loaders import ResumableLoader
from tests.ddp_harness import through_lightning, write_result
from tests.loaders.test_self_sharding import DistRankSplit, ShuffleBuffer, _wds_sample, read_ids


class UnsizedDistRankSplit(DistRankSplit):
    def __len__(self) -> int:
        raise TypeError("unsized")


class ShareDistRankSplit(DistRankSplit):
    """Splits by ``torch.distributed`` and says so: its ``len()`` is this rank's share."""

    def __len__(self) -> int:
        return len(self.ids[dist.get_rank()::dist.get_world_size()])


class OwnShuffle(IterableDataset[dict[str, int]]):
    """Shuffles with a generator of its own, seeded in each process (``random.Random()``)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __iter__(self) -> Iterator[dict[str, int]]:
        order = list(self.ids)
        random.Random().shuffle(order)
        return ({"id": i} for i in order)

    def __len__(self) -> int:
        return len(self.ids)


class Declared(IterableDataset[dict[str, int]]):
    """The whole stream, with a ``len()`` of ``less`` samples fewer on rank 1 than on rank 0
    (0: the same, and right, on both)."""

    def __init__(self, ids: list[int], less: int = 0) -> None:
        self.ids, self.less = ids, less

    def __iter__(self) -> Iterator[dict[str, int]]:
        return ({"id": i} for i in self.ids)

    def __len__(self) -> int:
        return len(self.ids) - self.less * dist.get_rank()


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


def read_before_ddp(ids: list[int]) -> dict[str, Any]:
    """Epoch 0 read before the process group and the environment place the rank (each rank
    alone, at rank 0 of 1), then epoch 1 under DDP, of a stream that differs by rank."""
    placing = {name: os.environ.pop(name) for name in ("RANK", "LOCAL_RANK", "WORLD_SIZE")}
    loader = ResumableLoader(OwnShuffle(ids), batch_size=4)
    alone = sorted(i for batch in loader for i in batch["id"].tolist())
    os.environ.update(placing)
    dist.init_process_group("gloo")
    return {"alone": alone, **read_epoch(loader)}


def read_epoch(loader: ResumableLoader,
               read: Callable[[Any], Iterable[Any]] = through_lightning) -> dict[str, Any]:
    """The ids of an epoch of ``loader`` read by ``read`` (as Lightning's loops read it, else
    ``iter`` for a loop of the user's), or its error."""
    try:
        return {"ids": [i for batch in read(loader) for i in batch["id"].tolist()]}
    except Exception as exc:  # reported to the launching test
        return {"error": f"{type(exc).__name__}: {exc}"}
    finally:
        loader.close()


def read_in_thread(ids: list[int]) -> dict[str, Any]:
    """An epoch read in a thread (a user's prefetching thread) while the main thread runs an
    ``all_reduce`` (DDP's gradients'): rank 0 reduces before its thread starts, rank 1 after
    its thread ends, so a collective of the thread's would pair with the other rank's."""
    loader = ResumableLoader(Declared(ids), batch_size=4)
    read: dict[str, Any] = {}

    def epoch() -> None:
        try:
            read["ids"] = [i for batch in loader for i in batch["id"].tolist()]
        except Exception as exc:  # reported to the launching test
            read["error"] = f"{type(exc).__name__}: {exc}"

    thread = threading.Thread(target=epoch)
    grads = torch.full((5,), float(dist.get_rank() + 1))
    if dist.get_rank() == 0:
        dist.all_reduce(grads)
        thread.start()
    else:
        thread.start()
        thread.join()
        dist.all_reduce(grads)
    thread.join()
    loader.close()
    return {**read, "grads": grads.tolist()}


def main() -> None:
    warnings.filterwarnings("ignore")
    data_dir = sys.argv[1]
    ids = read_ids(data_dir)
    before_ddp = read_before_ddp(ids)  # starts the process group
    # (dataset, num_workers, drop_last): under drop_last, 6 samples leave both ranks without a
    # batch (refused at the len() Lightning reads first)
    cases: dict[str, tuple[Callable[[], Any], int, bool]] = {
        "dist-unsized-w0": (lambda: UnsizedDistRankSplit(ids), 0, False),
        "dist-unsized-w2": (lambda: UnsizedDistRankSplit(ids), 2, False),
        "dist-sized-w0": (lambda: DistRankSplit(ids), 0, False),
        "dist-share-w0": (lambda: ShareDistRankSplit(ids), 0, False),
        "seed-per-rank-w2": (lambda: RankSeededShuffle(ids), 2, False),
        "own-shuffle-sized-w0": (lambda: OwnShuffle(ids), 0, False),
        "own-shuffle-sized-w2": (lambda: OwnShuffle(ids), 2, False),
        "len-per-rank-w0": (lambda: Declared(ids, less=1), 0, False),
        "no-batch-on-both-w0": (lambda: Declared(ids[:6]), 0, True),
        "shuffle-buffer-w0": (lambda: ShuffleBuffer(ids), 0, False),
        "wds-seed-per-rank-w2": (lambda: webdataset_seeded_per_rank(data_dir), 2, False),
    }
    results: dict[str, Any] = {"read-before-ddp": before_ddp}
    for name, (build, workers, drop) in cases.items():
        results[name] = read_epoch(ResumableLoader(build(), batch_size=4, num_workers=workers,
                                                   drop_last=drop))
        dist.barrier()
    shrunk = Declared(ids)
    loader = ResumableLoader(shrunk, batch_size=4)
    shrunk.less = 1  # rank 1's data lose a sample after len() was planned: it refuses to begin
    results["len-changed-on-one-w0"] = read_epoch(loader)
    dist.barrier()
    compared: dict[str, Callable[[], Any]] = {
        "dist-unsized-own-loop-compared": lambda: UnsizedDistRankSplit(ids),
        "own-shuffle-sized-own-loop-compared": lambda: OwnShuffle(ids),
        "declared-own-loop-compared": lambda: Declared(ids),
    }
    for name, build in compared.items():
        results[name] = read_epoch(ResumableLoader(build(), batch_size=4, compare_ranks=True),
                                   read=iter)
        dist.barrier()
    results["dist-unsized-never-compared"] = read_epoch(ResumableLoader(
        UnsizedDistRankSplit(ids), batch_size=4, compare_ranks=False))
    dist.barrier()
    if dist.get_rank() == 0:
        alone = ResumableLoader(Declared(ids), batch_size=4)
        results["rank-0-alone"] = {"ids": [i for batch in alone for i in batch["id"].tolist()]}
        alone.close()
    dist.barrier()
    results["thread-beside-all-reduce"] = read_in_thread(ids)
    write_result(results)


if __name__ == "__main__":
    main()
