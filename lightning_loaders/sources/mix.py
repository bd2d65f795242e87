"""``Mix``: several datasets mixed by weight, with weights that may follow the global step.

A ``Mix`` is a map-style dataset over its sources laid end to end (source ``k``'s sample ``i``
is index ``offsets[k] + i``) that also decides its own order: ``ResumableLoader(mix, ...)``
plans every epoch over ``mix.order`` (``lightning_loaders.orders.mix.MixOrder``). Because the
mixing is an order over indices, everything the map-style loader does applies unchanged: worker
processes, ``in_order=False``, DDP with equal batch counts, exact resume from a cursor, and
elastic resume under another world size or worker count.

Sources: anything with ``__len__`` and ``__getitem__`` (a ``torch`` map-style dataset, a
``TableDataset`` over Parquet/Arrow/pandas, a Hugging Face ``datasets.Dataset``), and
``ShardedSource`` iterables with known shard lengths (``RecordFiles``, ``ParquetSource``, ...),
read by random access: sample ``i`` opens its shard at its offset, which costs a shard seek per
sample (for large Parquet shards, prefer a ``TableDataset``). Iterables whose length is unknown
are refused: which sample a position takes is its source's own cursor, which needs random access
to stay a function of the position (a stream would need one reader per rank and worker, and a
resume could not jump).
"""

from __future__ import annotations

import bisect
from collections.abc import Sequence
from typing import Any

import numpy as np
from torch.utils.data import Dataset, IterableDataset

from lightning_loaders.context import sample_context
from lightning_loaders.hashing import checked_seed
from lightning_loaders.orders.mix import MixMode, MixOrder, WeightSchedule
from lightning_loaders.sources.shards import ShardedSource

__all__ = ["Mix"]


class Mix(Dataset[Any]):
    """Several datasets mixed by weight; give it to ``ResumableLoader`` (no sampler, no shuffle:
    the mixture is its own order).

    Args:
        sources: the datasets to mix (see the module docstring for what is accepted). Their
            samples should collate together (the same structure).
        weights: one weight per source; or ``(step, weights)`` breakpoints from step 0; or a
            callable ``step -> weights`` (a pure function of the global step).
        mode: what an epoch is, and what happens when a source runs out:
            ``"cycle"`` (default): ``samples_per_epoch`` draws; an exhausted source restarts
            with a new permutation. ``"replacement"``: ``samples_per_epoch`` draws, each a
            uniformly random sample of its source. ``"stop"``: each source contributes a fixed
            count in proportion to the (constant) weights, and the epoch ends when the first
            source runs out; no sample is read twice.
        samples_per_epoch: positions per epoch for ``"cycle"`` and ``"replacement"`` (default:
            the sources' total length).
        batch_size: samples per global step (per-rank batch size x world size), needed when the
            weights change with the step (a schedule, or ``set_weights``). Keep it when resuming
            on another world size: the schedule stays on the same samples.
        seed: keys the mixture's draws (default: the loader's seed).

    ``len(mix)`` is the total of the sources' lengths (the index space); the number of samples
    an epoch draws is ``len(mix.order)``.
    """

    def __init__(self, sources: Sequence[Any], weights: Any, *, mode: MixMode = "cycle",
                 samples_per_epoch: int | None = None, batch_size: int | None = None,
                 seed: int | None = None) -> None:
        members = [_random_access(source, k) for k, source in enumerate(sources)]
        if not members:
            raise ValueError("Mix needs at least one source")
        self.sources = members
        lengths = [len(member) for member in members]
        self._starts = [int(s) for s in np.concatenate([[0], np.cumsum(lengths)[:-1]])]
        self._total = int(sum(lengths))
        self._order = MixOrder(
            lengths, WeightSchedule(weights, len(members)), mode, samples_per_epoch, batch_size,
            None if seed is None else checked_seed(seed), [_identity(m) for m in members])

    @property
    def order(self) -> MixOrder:
        """The mixture's order; a copy of the ``Mix`` (a pickled or deep-copied loader) keeps
        it, shared with the copied loader's plan."""
        return self._order

    def set_weights(self, weights: Any, step: int | None = None) -> None:
        """Use ``weights`` from global ``step`` on (see ``MixOrder.set_weights``); by default
        from the first step after every batch delivered (``next_step()``, the latest rank's
        under a process group), the next batch: in a Lightning callback,
        ``mix.set_weights(w)``."""
        self.order.set_weights(weights, step)

    def next_step(self) -> int | None:
        """The first global step after every batch this rank delivered (``None`` before the
        loader starts); with ``in_order=False``, after the batches delivered ahead of others
        too."""
        return self.order.next_step()

    def weights_at(self, step: int) -> np.ndarray:
        """The weights in force at global ``step``."""
        return self.order.weights_at(step)

    def source_of(self, index: int) -> tuple[int, int]:
        """``(source, sample of that source)`` of an index of the mixture."""
        if not 0 <= index < self._total:
            raise IndexError(f"index {index} outside [0, {self._total})")
        k = bisect.bisect_right(self._starts, index) - 1
        return k, index - self._starts[k]

    def describe_index(self, index: int) -> str:
        """What a mixture's index is in its source, for errors that name the index."""
        k, i = self.source_of(index)
        return f"sample {i} of source {k}"

    def __len__(self) -> int:
        return self._total

    def __getitem__(self, index: int) -> Any:
        k, i = self.source_of(int(index))
        return self.sources[k][i]

    def __getitems__(self, indices: Sequence[int]) -> list[Any]:
        """The samples at ``indices``, fetched a source at a time (through each source's own
        ``__getitems__`` when it has one)."""
        located = [self.source_of(int(index)) for index in indices]
        out: list[Any] = [None] * len(located)
        for k, member in enumerate(self.sources):
            slots = [slot for slot, (source, _) in enumerate(located) if source == k]
            if not slots:
                continue
            wanted = [located[slot][1] for slot in slots]
            getitems = getattr(member, "__getitems__", None)
            samples = getitems(wanted) if callable(getitems) else [member[i] for i in wanted]
            for slot, sample in zip(slots, samples, strict=True):
                out[slot] = sample
        return out

    @property
    def own_rngs(self) -> bool:
        """Whether a source's samples are read under global-RNG states of their own (a
        ``ShardedSource`` with ``own_rngs``), which worker threads would take turns at."""
        return any(isinstance(member, _ShardRows) and member.source.own_rngs
                   for member in self.sources)

    def __repr__(self) -> str:
        order = self.order
        kinds = ", ".join(type(m.source if isinstance(m, _ShardRows) else m).__name__
                          for m in self.sources)
        return f"Mix([{kinds}], mode={order.mode!r}, samples_per_epoch={len(order)})"


class _ShardRows:
    """A ``ShardedSource`` with known shard lengths, read by random access: sample ``i`` is
    read by opening its shard at its offset (``ShardedSource.sample_at``)."""

    def __init__(self, source: ShardedSource[Any], lengths: Sequence[int]) -> None:
        self.source = source
        self._starts = [int(s) for s in np.concatenate([[0], np.cumsum(lengths)[:-1]])]
        self._total = int(sum(lengths))

    def __len__(self) -> int:
        return self._total

    def __getitem__(self, index: int) -> Any:
        shard = bisect.bisect_right(self._starts, index) - 1
        offset = index - self._starts[shard]
        try:
            context = sample_context()
            seed, epoch = context.seed, context.epoch
        except RuntimeError:  # indexed outside a loader's fetch
            seed, epoch = 0, 0
        try:
            return self.source.sample_at(shard, offset, seed, epoch)
        except StopIteration:
            raise ValueError(f"shard {shard} of the {type(self.source).__name__} ended before "
                             f"sample {offset}, which its declared length promises: fix the "
                             "source's shard_lengths") from None


def _random_access(source: Any, k: int) -> Any:
    """``source`` as something indexable, or a ``TypeError`` naming what it lacks."""
    if isinstance(source, Mix):
        raise TypeError(f"Mix source {k} is itself a Mix: read as a member, its samples would be "
                        "drawn uniformly, and its weights, schedule and mode ignored. Flatten it: "
                        "give its sources to this Mix, each with the product of its weight and "
                        "the inner Mix's")
    if isinstance(source, ShardedSource):
        lengths = source.shard_lengths
        if lengths is None:
            raise TypeError(f"Mix source {k} ({type(source).__name__}) does not know its shard "
                            "lengths: a Mix reads every source by random access (which sample a "
                            "position takes must be a function of the position); give the "
                            "source its lengths (lengths=... or 'scan')")
        return _ShardRows(source, list(lengths))
    if isinstance(source, IterableDataset) or not (hasattr(source, "__len__")
                                                   and hasattr(source, "__getitem__")):
        raise TypeError(f"Mix source {k} ({type(source).__name__}) is not indexable: a Mix reads "
                        "every source by random access (which sample a position takes must be a "
                        "function of the position); give a map-style dataset (__len__ and "
                        "__getitem__) or a ShardedSource with known shard lengths")
    if len(source) < 1:
        raise ValueError(f"Mix source {k} ({type(source).__name__}) is empty")
    return source


def _identity(member: Any) -> str:
    """What a member is, for the mixture's fingerprint: a source's own fingerprint (its files,
    columns, pipeline), else its type."""
    source = member.source if isinstance(member, _ShardRows) else member
    fingerprint = getattr(source, "fingerprint", None)
    return fingerprint if isinstance(fingerprint, str) else type(source).__name__
