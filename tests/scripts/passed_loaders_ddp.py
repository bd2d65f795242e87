"""One rank of a 2-process DDP ``Trainer.fit`` with ``ExactResume`` and plain ``DataLoader``s
passed straight to ``fit`` whose sampling is the user's (run by ``tests/ddp_harness``).

``user-shards``: a Megatron-style sampler that splits the data by rank itself (attributes
``data_parallel_rank``/``data_parallel_size``), with ``use_distributed_sampler=False``.
``generator-per-rank``: ``shuffle=True`` with a generator seeded by the rank, with Lightning's
default ``use_distributed_sampler=True``. Reports what every training step saw, the training
loader's type, the warnings given, or the error ``fit`` raised.

    python tests/scripts/passed_loaders_ddp.py CASE ROOT
"""

import sys
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch
from torch.utils.data import DataLoader, Sampler

from lightning_loaders import ExactResume
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


def main() -> None:
    case, root = sys.argv[1], Path(sys.argv[2])
    user_shards = case == "user-shards"
    model = RecordingModule()
    trainer = make_trainer(root, 2, [ExactResume()], strategy="ddp", devices=2,
                           use_distributed_sampler=not user_shards)
    rank = trainer.global_rank
    if user_shards:
        train = DataLoader(IndexDataset(N), batch_size=2, sampler=RankShare(N, rank, 2))
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
