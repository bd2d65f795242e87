"""Samplers for tests whose epochs differ in length: a bucketing batch sampler (batches of many
sizes, and epochs that differ in their number of batches, as bucketing by length and token
budgets make them) and a curriculum whose ``len()`` follows its ``set_epoch``."""

from __future__ import annotations

import torch
from torch.utils.data import DataLoader, Sampler

from tests.conftest import IndexDataset


def length(index: int) -> int:
    """The "sequence length" of sample ``index``."""
    return 1 + (index * 7) % 11


class LengthBuckets(Sampler[list[int]]):
    """Bucketing by length: a permutation (new at every ``set_epoch``) sorted by length in pools
    of 16, cut into batches of at most ``budget`` padded tokens, in a shuffled order. Batch
    sizes differ, and so does their number from epoch to epoch."""

    def __init__(self, n: int, budget: int = 24) -> None:
        self.n, self.budget, self.epoch = n, budget, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.epoch)
        perm = torch.randperm(self.n, generator=generator).tolist()
        batches: list[list[int]] = []
        for start in range(0, self.n, 16):
            batch: list[int] = []
            for i in sorted(perm[start:start + 16], key=length):
                if batch and (len(batch) + 1) * length(i) > self.budget:
                    batches.append(batch)
                    batch = []
                batch.append(i)
            batches.append(batch)
        order = torch.randperm(len(batches), generator=generator).tolist()
        return iter([batches[j] for j in order])


class GrowingCurriculum(Sampler[int]):
    """A curriculum: epoch ``e`` reads a shuffle of the first ``10 + 4e`` samples, and
    ``len()`` says so once ``set_epoch(e)`` is called."""

    def __init__(self) -> None:
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return 10 + 4 * self.epoch

    def __iter__(self):
        return iter(torch.randperm(len(self)).tolist())


def curriculum_epochs(epochs: int) -> list[list[int]]:
    """The samples ``GrowingCurriculum`` reads in each epoch, sorted."""
    return [list(range(10 + 4 * epoch)) for epoch in range(epochs)]


def sampler_epochs(n: int, epochs: int) -> list[list[list[int]]]:
    """``LengthBuckets(n)``'s own batches per epoch, as a ``DataLoader`` over
    ``IndexDataset(n)`` reads them."""
    sampler = LengthBuckets(n)
    loader = DataLoader(IndexDataset(n), batch_sampler=sampler)
    out = []
    for epoch in range(epochs):
        sampler.set_epoch(epoch)
        out.append([batch["index"].tolist() for batch in loader])
    return out


def flat(batches: list[list[int]]) -> list[int]:
    return [i for batch in batches for i in batch]


def dealt(batches: list[list[int]], world: int, last_batch: str = "keep"
          ) -> list[list[list[int]]]:
    """Per rank, the batches the documented rule deals from ``batches``: global batch ``g``
    is batches ``g * world ..``, whole; then the tail of fewer than ``world`` batches is
    dropped, padded with batches from the start, or its samples split evenly (joining the
    last global batch, one each on the first ranks, when they are fewer than the ranks)."""
    full, rest = divmod(len(batches), world)
    ranks = [[batches[g * world + r] for g in range(full)] for r in range(world)]
    tail = flat(batches[full * world:])
    if not rest or last_batch == "drop":
        return ranks
    if last_batch == "pad":
        for r in range(world):
            ranks[r].append(batches[full * world + r] if r < rest
                            else batches[(r - rest) % len(batches)])
        return ranks
    if len(tail) < world:
        for r, index in enumerate(tail):
            ranks[r][-1] = ranks[r][-1] + [index]
        return ranks
    share, extra = divmod(len(tail), world)
    for r in range(world):
        begin = r * share + min(r, extra)
        ranks[r].append(tail[begin:begin + share + (r < extra)])
    return ranks
