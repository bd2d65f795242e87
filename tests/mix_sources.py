"""A three-source ``Mix`` for tests: a map-style dataset, Parquet files read through
``ParquetSource`` (a ``ShardedSource``) and a Hugging Face ``datasets.Dataset``.

Every sample is ``{"index": id, "source": k}``; source ``k``'s ids start at ``1000 * k``, so a
batch says where each sample came from.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import torch

from lightning_loaders import ResumableLoader
from lightning_loaders.sources.mix import Mix

SIZES = (12, 30, 20)
SCHEDULE = [(0, [0.6, 0.3, 0.1]), (3, [0.1, 0.3, 0.6])]


class Ids(torch.utils.data.Dataset[dict[str, Any]]):
    """Map-style: sample ``i`` is ``{"index": i, "source": 0}``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"index": index, "source": 0}


def write_sources(root: Path, sizes: tuple[int, ...] = SIZES) -> list[Any]:
    """The three sources, their files written under ``root`` (once)."""
    import datasets
    import pyarrow as pa
    import pyarrow.parquet as pq

    from lightning_loaders.sources.parquet import ParquetSource

    root.mkdir(parents=True, exist_ok=True)
    path = root / "source1.parquet"
    if not path.exists():
        ids = list(range(1000, 1000 + sizes[1]))
        pq.write_table(pa.table({"index": ids, "source": [1] * len(ids)}), path,
                       row_group_size=8)
    hf = datasets.Dataset.from_dict({"index": list(range(2000, 2000 + sizes[2])),
                                     "source": [2] * sizes[2]})
    return [Ids(sizes[0]), ParquetSource([path]), hf]


def three_source_mix(root: Path, weights: Any = SCHEDULE, batch_size: int | None = 4,
                     **kwargs: Any) -> Mix:
    return Mix(write_sources(root), weights, batch_size=batch_size, **kwargs)


def gated_mix_loader(gate: Path, gated: frozenset[int] = frozenset(), *, step_size: int = 3,
                     **kwargs: Any) -> ResumableLoader:
    """12 steps of ``step_size`` samples drawn from three lists of 100 ids (``0..``,
    ``1000..``, ``2000..``; weights 0.6, 0.2, 0.2: source 0 draws no id twice), read in batches
    of 3 (``kwargs``: the loader's); source 0's ids in ``gated`` wait for the file ``gate``
    (``Gated``), so that with ``in_order=False`` later batches are delivered before theirs."""
    from tests.loaders.test_out_of_order import Gated

    sources = [Gated(100, str(gate), gated), list(range(1000, 1100)), list(range(2000, 2100))]
    mix = Mix(sources, [0.6, 0.2, 0.2], samples_per_epoch=12 * step_size, batch_size=step_size)
    return ResumableLoader(mix, batch_size=3, seed=4, **kwargs)


def key(batch: dict[str, Any]) -> list[int]:
    """The ids of a batch."""
    return batch["index"].tolist()
