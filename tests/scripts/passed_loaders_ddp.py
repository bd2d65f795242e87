"""One rank of a 2-process DDP ``Trainer.fit`` with ``ExactResume`` and plain ``DataLoader``s
passed straight to ``fit`` whose sampling is the user's (run by ``tests/ddp_harness``).

``user-shards``: a Megatron-style sampler that splits the data by rank itself (attributes
``data_parallel_rank``/``data_parallel_size``), with ``use_distributed_sampler=False``.
``generator-per-rank``: ``shuffle=True`` with a generator seeded by the rank, with Lightning's
default ``use_distributed_sampler=True``. ``datamodule-user-shards``: the Megatron-style
sampler's loader returned by a ``ResumableDataModule``'s hook with
``use_distributed_sampler=False`` (the data module converts it all the same);
``datamodule-user-shards-kept``: the same with ``convert`` returning it as it is. Reports what
every training step saw, the training loader's type, the warnings given, or the error ``fit``
raised.

    python tests/scripts/passed_loaders_ddp.py CASE ROOT
"""

import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from lightning_loaders import ExactResume, ResumableDataModule
from tests.conftest import IndexDataset
from tests.ddp_harness import write_result
from tests.lightning_harness import RecordingModule, make_trainer

N = 11


class RankShare(Sampler[int]):
    """Megatron-style: this data-parallel rank's share, padded to equal shares."""

    def __init__(self, n: int, data_parallel_rank: int, data_parallel_size: int) -> None:
        self.n = n
        self.data_parallel_rank, self.data_parallel_size = data_parallel_rank, data_parallel_size

    def __iter__(self) -> Iterator[int]:
        padded = list(range(self.n)) + list(range(len(self) * self.data_parallel_size - self.n))
        return iter(padded[self.data_parallel_rank::self.data_parallel_size])

    def __len__(self) -> int:
        return -(-self.n // self.data_parallel_size)


class RankShares(ResumableDataModule):
    """Returns the Megatron-style sampler's loader from its hook."""

    def train_dataloader(self) -> Any:
        rank = self.trainer.global_rank
        return DataLoader(IndexDataset(N), batch_size=2, sampler=RankShare(N, rank, 2))


class KeptRankShares(RankShares):
    """Leaves that loader as it is."""

    def convert(self, loader: Any, stage: str) -> Any:
        return loader if stage == "train" else super().convert(loader, stage)


def main() -> None:
    case, root = sys.argv[1], Path(sys.argv[2])
    user_shards = case != "generator-per-rank"
    model = RecordingModule()
    trainer = make_trainer(root, 2, [ExactResume()], strategy="ddp", devices=2,
                           use_distributed_sampler=not user_shards)
    rank = trainer.global_rank
    train: Any
    if case == "user-shards":
        train = DataLoader(IndexDataset(N), batch_size=2, sampler=RankShare(N, rank, 2))
    elif case == "datamodule-user-shards":
        train = RankShares()
    elif case == "datamodule-user-shards-kept":
        train = KeptRankShares()
    else:
        train = DataLoader(IndexDataset(N), batch_size=2, shuffle=True,
                           generator=torch.Generator().manual_seed(rank))
    result: dict[str, Any] = {}
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        try:
            trainer.fit(model, train)
        except Exception as exc:  # reported to the launching test
            result["error"] = f"{type(exc).__name__}: {exc}"
    result.update(seen=model.seen, kind=type(trainer.train_dataloader).__name__,
                  warnings=[str(w.message) for w in caught if "state_dict()" in str(w.message)])
    write_result(result)


if __name__ == "__main__":
    main()
