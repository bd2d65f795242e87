"""Where user code running inside the loader learns where it is: worker, rank, epoch, sample.

``sample_rng()`` gives ``__getitem__`` and transforms a generator seeded by
``(seed, epoch, global position)``: augmentations then do not change with ``num_workers``,
``world_size`` or a resume. Global RNGs (``random``, ``numpy``, ``torch``) are also re-seeded
before every batch from ``(seed, epoch, batch, rank)``, so code using them is reproducible for a
fixed world size whatever ``num_workers`` is.
"""

from __future__ import annotations

import random
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

from lightning_loaders._hashing import mix64, seed32

__all__ = ["SampleContext", "WorkerInfo", "sample_context", "sample_rng", "worker_info"]


@dataclass(frozen=True)
class SampleContext:
    """The sample being fetched right now.

    Attributes:
        seed: the loader's seed.
        epoch: the epoch whose permutation holds the sample.
        position: the sample's position in that epoch's order.
        index: the dataset index being fetched.
        rank: the rank fetching it.
    """

    seed: int
    epoch: int
    position: int
    index: int
    rank: int

    @property
    def sample_seed(self) -> int:
        """A 63-bit seed unique to ``(seed, epoch, position)``."""
        return mix64(self.seed, self.epoch, self.position) >> 1

    def rng(self) -> np.random.Generator:
        """A numpy generator seeded by ``(seed, epoch, position)``."""
        return np.random.default_rng(self.sample_seed)

    def torch_generator(self) -> torch.Generator:
        """A CPU torch generator seeded by ``(seed, epoch, position)``."""
        return torch.Generator().manual_seed(self.sample_seed)


class WorkerInfo(int):
    """The worker id (it *is* the int torch passes to ``worker_init_fn``) plus where it runs.

    A plain one-argument ``worker_init_fn(worker_id)`` keeps working; richer ones read the
    attributes ``id``, ``num_workers``, ``rank``, ``world_size``, ``epoch``, ``seed`` and
    ``dataset`` (the user's dataset, not our wrapper).
    """

    id: int
    num_workers: int
    rank: int
    world_size: int
    epoch: int
    seed: int
    dataset: Any

    def __new__(
        cls,
        worker_id: int,
        *,
        num_workers: int,
        rank: int,
        world_size: int,
        epoch: int,
        seed: int,
        dataset: Any,
    ) -> WorkerInfo:
        info = super().__new__(cls, worker_id)
        info.id = worker_id
        info.num_workers = num_workers
        info.rank = rank
        info.world_size = world_size
        info.epoch = epoch
        info.seed = seed
        info.dataset = dataset
        return info

    def __repr__(self) -> str:
        return (f"WorkerInfo(id={self.id}, num_workers={self.num_workers}, rank={self.rank}, "
                f"world_size={self.world_size}, epoch={self.epoch}, seed={self.seed})")


# Per process: a worker process serves exactly one loader, and in the main process these are set
# only for the duration of one fetch, so loaders never see each other's values.
_current_sample: SampleContext | None = None
_current_worker: WorkerInfo | None = None


def sample_context() -> SampleContext:
    """The sample being fetched; only valid inside ``__getitem__`` or a transform it calls."""
    if _current_sample is None:
        raise RuntimeError("sample_context() is only available while a ResumableLoader fetches "
                           "a sample (inside the dataset's __getitem__ or its transforms)")
    return _current_sample


def sample_rng() -> np.random.Generator:
    """``sample_context().rng()``: the per-sample generator to use for augmentations."""
    return sample_context().rng()


def worker_info() -> WorkerInfo | None:
    """This worker's ``WorkerInfo``, or ``None`` in the main process."""
    return _current_worker


def _set_sample(ctx: SampleContext | None) -> None:
    global _current_sample
    _current_sample = ctx


def _set_worker(info: WorkerInfo) -> None:
    global _current_worker
    _current_worker = info


def _seed_global_rngs(*key: int) -> None:
    """Re-seed ``random``, ``numpy`` and ``torch`` global RNGs from ``key`` (a few microseconds)."""
    random.seed(seed32(*key, 0))
    np.random.seed(seed32(*key, 1))
    torch.default_generator.manual_seed(mix64(*key, 2) >> 1)
