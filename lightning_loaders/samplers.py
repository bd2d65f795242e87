"""Turning a ``torch.utils.data`` sampler into a ``SampleOrder`` the global plan can shard."""

from __future__ import annotations

from typing import Any

from torch.utils.data import RandomSampler, SequentialSampler

from lightning_loaders.order import SampleOrder, SequentialOrder, ShuffledOrder

__all__ = ["order_from_sampler"]


def order_from_sampler(sampler: Any, dataset_len: int, seed: int) -> SampleOrder:
    """The distributed, resumable equivalent of ``sampler`` over a dataset of ``dataset_len``."""
    if isinstance(sampler, SampleOrder):
        return sampler
    if isinstance(sampler, SequentialSampler):
        return SequentialOrder(dataset_len)
    if (isinstance(sampler, RandomSampler) and not sampler.replacement
            and sampler.num_samples == dataset_len):
        return ShuffledOrder(dataset_len, seed)
    raise TypeError(f"cannot convert a {type(sampler).__name__} into a resumable order; pass a "
                    "SampleOrder, a SequentialSampler or a RandomSampler without replacement")
