"""Turning a ``torch.utils.data`` sampler into a ``SampleOrder`` the global plan can shard.

torch's own samplers map to exact semantic equivalents computed from ``(seed, epoch, position)``
(O(1) state, no materialisation). Their subclasses and every other sampler may behave
differently, so they are drawn once per epoch instead (``drawn_orders``). The epoch a user sets
on their own sampler (``set_epoch``, ``DistributedSampler``'s idiom) is read by ``SamplerEpochs``.
"""

from __future__ import annotations

from numbers import Integral
from typing import Any, Literal

import numpy as np
import torch
from torch.utils.data import (
    BatchSampler,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from lightning_loaders.hashing import checked_seed, digest
from lightning_loaders.orders.base import SampleOrder, SequentialOrder, ShuffledOrder
from lightning_loaders.orders.drawn import DrawnBatchOrder, DrawnOrder
from lightning_loaders.orders.dynamic_weighted import DynamicWeightedSampler
from lightning_loaders.orders.random import (
    RepeatedShuffleOrder,
    ReplacementOrder,
    SubsetOrder,
    WeightedOrder,
)

__all__ = [
    "SamplerEpochs",
    "bulk_key",
    "order_from_sampler",
    "placement_from_sampler",
    "sampler_contents",
    "sampler_seed",
    "sampler_signature",
    "unbatched_sampler",
]

_INDEX_SAMPLERS = (SequentialSampler, RandomSampler, SubsetRandomSampler, WeightedRandomSampler,
                   DistributedSampler)


def order_from_sampler(sampler: Any, dataset_len: int, seed: int) -> SampleOrder:
    """The distributed, resumable equivalent of ``sampler`` over a dataset of ``dataset_len``.

    ``SequentialSampler``, ``RandomSampler`` (with or without replacement, any ``num_samples``),
    ``SubsetRandomSampler``, ``WeightedRandomSampler`` and ``DistributedSampler`` (whose sharding
    the plan replaces) become counter-based orders keyed by ``seed``; a ``SampleOrder`` is used
    as is; anything else iterable is drawn once per epoch (see ``DrawnOrder``).
    """
    if isinstance(sampler, DynamicWeightedSampler):
        return sampler.bind(seed)
    if isinstance(sampler, SampleOrder):
        return sampler
    kind = type(sampler)
    if kind is SequentialSampler:
        return SequentialOrder(len(sampler))
    if kind is RandomSampler:
        n = len(sampler.data_source)
        if sampler.replacement:
            return ReplacementOrder(n, sampler.num_samples, seed)
        if sampler.num_samples == n:
            return ShuffledOrder(n, seed)
        return RepeatedShuffleOrder(n, sampler.num_samples, seed)
    if kind is SubsetRandomSampler:
        return SubsetOrder(sampler.indices, seed)
    if kind is WeightedRandomSampler:
        return WeightedOrder(sampler.weights, sampler.num_samples, sampler.replacement, seed)
    if kind is DistributedSampler:  # its drop_last: the order's tail past equal shares
        n = len(sampler.dataset)
        kept = n - n % sampler.num_replicas if sampler.drop_last else n
        if not sampler.shuffle:
            return SequentialOrder(kept)
        return ShuffledOrder(n, seed) if kept == n else RepeatedShuffleOrder(n, kept, seed)
    if not hasattr(sampler, "__iter__"):
        raise TypeError(f"cannot use a {kind.__name__} as a sampler: it is not iterable")
    return DrawnOrder(sampler, seed)


def sampler_signature(sampler: Any) -> tuple[Any, ...]:
    """What the order made of ``sampler`` was read from, cheap to compare between epochs, so
    that a sampler changed in place is followed as ``DataLoader`` follows it (it iterates the
    sampler at every epoch): new ``indices`` or ``weights`` (a tensor edited in place too), a
    new ``num_samples``, a new ``len()`` of a sampler that is drawn. Orders of our own, which
    follow their changes themselves, and samplers without ``len()`` give ``()``. Contents
    edited in place under the same length (a list, a numpy array) are ``sampler_contents``."""
    kind = type(sampler)
    if kind is SequentialSampler:
        return (len(sampler),)
    if kind is RandomSampler:
        return (len(sampler.data_source), sampler.num_samples, sampler.replacement)
    if kind is SubsetRandomSampler:
        return (_identity(sampler.indices),)
    if kind is WeightedRandomSampler:
        return (_identity(sampler.weights), sampler.num_samples, sampler.replacement)
    if kind is DistributedSampler or isinstance(sampler, SampleOrder | DynamicWeightedSampler):
        return ()
    try:
        return (len(sampler),)
    except TypeError:
        return ()


def sampler_contents(sampler: Any) -> str | None:
    """A digest of the data the order made of ``sampler`` copies (``SubsetRandomSampler``'s
    indices, ``WeightedRandomSampler``'s weights), ``None`` for other samplers: an edit in
    place that keeps the length (a list, a numpy array, the array a weights tensor shares)
    changes it and nothing ``sampler_signature`` sees. O(n), so read once per epoch start
    (10^7 indices: 90 ms in an array or a tensor, 260 ms in a list; ``torch.randperm`` of
    them, which ``SubsetRandomSampler`` draws every epoch, 350 ms). A ``range`` or a
    ``tuple``, which cannot be edited, is not read (a ``range`` of 10^7: 1.5 s)."""
    kind = type(sampler)
    if kind is SubsetRandomSampler:
        values, dtype = sampler.indices, "int64"
    elif kind is WeightedRandomSampler:
        values, dtype = sampler.weights, "float64"
    else:
        return None
    return None if isinstance(values, range | tuple) else digest(_as_array(values, dtype))


def _as_array(values: Any, dtype: str) -> np.ndarray:
    """``values`` (a sequence, an array, a tensor on any device) as a numpy array."""
    if isinstance(values, torch.Tensor):
        values = values.detach().cpu().numpy()
    return np.asarray(values, dtype=dtype)


def _identity(values: Any) -> tuple[int, int, int | None]:
    """Which sequence ``values`` is: a new one, or a tensor edited in place, differs."""
    return id(values), len(values), getattr(values, "_version", None)


def sampler_seed(sampler: Any) -> int | None:
    """The seed that orders ``sampler`` (or the sampler a batch sampler wraps) in torch: its
    ``generator``'s initial seed, a ``DistributedSampler``'s ``seed``; ``None`` for a sampler
    that draws from torch's global RNG or draws nothing."""
    for candidate in (sampler, getattr(sampler, "sampler", None)):
        generator = getattr(candidate, "generator", None)
        if isinstance(generator, torch.Generator):
            return int(generator.initial_seed())
        if isinstance(candidate, DistributedSampler):
            return checked_seed(candidate.seed, "DistributedSampler's seed")
    return None


class SamplerEpochs:
    """The epochs a user gives the samplers they passed, through the samplers' own
    ``set_epoch``: the ``DistributedSampler`` idiom calls it on the user's object, which the
    loader reads instead of iterating. Followed: every sampler with a ``set_epoch`` (the one a
    torch ``BatchSampler`` or a drawn batch sampler wraps too) that keeps the epoch as
    ``DistributedSampler`` does, in an int ``epoch``."""

    def __init__(self, *samplers: Any) -> None:
        wrapped = [s.sampler for s in samplers if isinstance(s, BatchSampler | DrawnOrder)]
        given = (*samplers, *wrapped)
        self._samplers = [s for s in given if callable(getattr(s, "set_epoch", None))]
        self._read = [0] * len(self._samplers)  # the default: one set before counts too

    def changed(self) -> int | None:
        """The epoch a sampler was set to since the last call, if one was: a sampler left alone
        (Lightning sets ``loader.sampler``'s epoch instead) or set to the epoch it had says
        nothing, so it never overrides the trainer's epoch or a restored cursor."""
        changed = None
        for i, sampler in enumerate(self._samplers):
            epoch = _epoch_of(sampler)
            if epoch is not None and epoch != self._read[i]:
                self._read[i] = changed = epoch
        return changed


def _epoch_of(sampler: Any) -> int | None:
    """``sampler.epoch`` when it is an epoch: an int (numpy's too) from 0."""
    epoch = getattr(sampler, "epoch", None)
    if isinstance(epoch, Integral) and not isinstance(epoch, bool) and int(epoch) >= 0:
        return int(epoch)
    return None


def unbatched_sampler(batch_sampler: Any, seed: int) -> tuple[Any, int, bool]:
    """``(sampler, batch_size, drop_last)`` equivalent to ``batch_sampler``.

    A torch ``BatchSampler`` is its sampler cut into batches: that sampler is given back, to
    be ordered as any sampler is (``order_from_sampler``, which follows it when it changes in
    place, and places the loader by a ``DistributedSampler``); any other batch sampler is drawn
    once per epoch and its batches laid end to end (a ``DrawnBatchOrder``; batches of
    different sizes are planned whole), ``batch_size`` being its first batch's size.
    """
    if type(batch_sampler) is BatchSampler:
        return batch_sampler.sampler, batch_sampler.batch_size, batch_sampler.drop_last
    drawn = DrawnBatchOrder(batch_sampler, seed)
    return drawn, drawn.batch_size, False


def placement_from_sampler(sampler: Any) -> tuple[int, int] | None:
    """``(rank, world_size)`` of a ``DistributedSampler`` (what it was built with, or read from
    the process group), else ``None``: a sampler built for rank ``r`` of ``n`` places the loader
    there, as ``DataLoader`` would read only that rank's share."""
    if isinstance(sampler, DistributedSampler):
        return int(sampler.rank), int(sampler.num_replicas)
    return None


def bulk_key(sampler: Any) -> Literal["", "bulk", "tuple"]:
    """What each item of ``sampler`` is with ``batch_size=None``: ``""`` an index (torch's
    index samplers and orders); ``"bulk"`` a list of indices read in one ``dataset[list]``
    (bulk loading: torch's ``BatchSampler``, items that are lists, 1-D arrays or tensors);
    ``"tuple"`` one key made of indices, which ``DataLoader`` passes as it is
    (``dataset[(i, j)]``: a 2-D array's element, a dict keyed by tuples). Any other sampler
    is asked for its first item."""
    if isinstance(sampler, BatchSampler):
        return "bulk"
    if isinstance(sampler, SampleOrder) or type(sampler) in _INDEX_SAMPLERS:
        return ""
    first = next(iter(sampler), None)
    if isinstance(first, tuple):
        return "tuple"
    if isinstance(first, list) or (isinstance(first, np.ndarray | torch.Tensor)
                                   and first.ndim == 1):
        return "bulk"
    return ""
