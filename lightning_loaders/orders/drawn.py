"""Orders drawn from arbitrary user samplers and batch samplers, one epoch at a time.

A sampler that is not one of torch's built-in ones has no known semantics, so its epoch is drawn:
once per epoch on every rank (its first ``len()`` indices, as a trainer that stops at
``len()`` would read), after seeding everything it could draw randomness from (its
``generator`` attribute and that of a wrapped ``.sampler``, the ``random``/``numpy``/``torch``
global RNGs) from ``(seed, epoch)`` and calling its ``set_epoch(epoch)`` when it has one (its
``epoch`` attribute is then put back: the loader reads the user's ``set_epoch`` there). Its
``len()`` is read after that ``set_epoch``: a sampler whose length follows its epoch (a
curriculum) has epochs of their own lengths (``epoch_len``), as ``DataLoader`` reads them when
the sampler's epoch is set. Every rank then holds the same epoch and the global plan gives
each rank its slice of every global batch. The first draw is made twice to check that the
sampler is deterministic given that seeding; if not, exact resume and consistent ranks are
impossible and a warning says so.

A batch sampler's epoch is its batches laid end to end; when they are not of one size
(bucketing by length, token budgets) the order also gives their boundaries, and the plan deals
the batches themselves (``DrawnBatchOrder``).

The state is the loader's cursor plus, when the sampler has ``state_dict``/``load_state_dict``,
its state just before and just after the draw of the epochs in the cache.
"""

from __future__ import annotations

import copy
import operator
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from itertools import islice
from typing import Any, NamedTuple

import numpy as np
import torch

from lightning_loaders.context import seeded_global_rngs
from lightning_loaders.hashing import mix64

__all__ = ["DrawnBatchOrder", "DrawnOrder"]

_TAG = 0x5A3D
_CACHED_EPOCHS = 2  # rollover plans read two consecutive epochs
_GENERATOR_DEPTH = 4
_UNSET = object()  # a sampler without an ``epoch`` attribute
_RANK_ATTRIBUTES = (("num_replicas", "rank"), ("data_parallel_size", "data_parallel_rank"))
MAX_DRAWN = 1 << 24
"""The most items an epoch of a sampler without ``len()`` may yield (16.8M)."""


class _Drawn(NamedTuple):
    """An epoch as drawn: its indices and, for a batch sampler's epoch that is not cut into
    batches of one size, the boundaries of its batches (``DrawnBatchOrder.batch_bounds``)."""

    indices: np.ndarray
    bounds: np.ndarray | None = None

    def same_as(self, other: _Drawn) -> bool:
        if self.bounds is None or other.bounds is None:
            return self.bounds is other.bounds and np.array_equal(self.indices, other.indices)
        return (np.array_equal(self.indices, other.indices)
                and np.array_equal(self.bounds, other.bounds))


class DrawnOrder:
    """Any other sampler: its indices, drawn once per epoch with seeded randomness."""

    batched = False

    def __init__(self, sampler: Any, seed: int) -> None:
        if isinstance(sampler, Iterator):
            raise TypeError(
                f"the sampler is an iterator ({type(sampler).__qualname__}), which yields its "
                "indices once: a resumable loader reads its sampler again for every epoch (and "
                "twice to check that it is deterministic). Give an iterable that starts over at "
                "each iter(): a list, a range or a Sampler")
        self.sampler = sampler
        self.seed = seed
        self._name = type(sampler).__qualname__
        self._cache: OrderedDict[int, _Drawn] = OrderedDict()
        self._states: OrderedDict[int, dict[str, Any]] = OrderedDict()
        self._pending: dict[int, dict[str, Any]] | None = None
        self._checked = False
        _warn_if_rank_aware(sampler)
        self._length = _declared_length(sampler) if not self.batched else None
        self._declared = self._length is not None
        if self._length is None:
            self._length = len(self._drawn(0).indices)

    def __len__(self) -> int:
        assert self._length is not None
        return self._length

    def epoch_len(self, epoch: int) -> int:
        """Positions of ``epoch``: the sampler's ``len()`` once its ``set_epoch(epoch)`` is
        called (without a ``set_epoch``, or a ``len()``, every epoch has ``len(self)``)."""
        cached = self._cache.get(epoch)
        if cached is not None:
            return len(cached.indices)
        set_epoch = getattr(self.sampler, "set_epoch", None)
        if not self._declared or not callable(set_epoch):
            return len(self)
        with (_drawing(self._name, epoch), _seeded(self.sampler, self.seed, epoch),
              _epoch_kept(self.sampler)):
            set_epoch(epoch)  # as the draw calls it: what it draws leaves no trace
            length = _declared_length(self.sampler)
        return len(self) if length is None else length

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        return self._drawn(epoch).indices[np.asarray(positions, dtype=np.int64)]

    @property
    def fingerprint(self) -> str:
        return f"drawn({self._name}, len={self._length})"

    # -- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The sampler's own state around the draws of the cached epochs (empty without one)."""
        states = self._pending if self._pending is not None else self._states
        return {"draws": {str(epoch): dict(state) for epoch, state in states.items()}}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Make the next draw of epoch ``e`` start from the sampler state it had at ``e``."""
        draws = state.get("draws", {}) if isinstance(state, dict) else {}
        self._pending = {int(epoch): dict(s) for epoch, s in draws.items()}
        self._cache.clear()

    # -- drawing ----------------------------------------------------------------------------

    def _drawn(self, epoch: int) -> _Drawn:
        cached = self._cache.get(epoch)
        if cached is not None:
            return cached
        restored = self._restore_for(epoch)
        before = _sampler_state(self.sampler)
        try:
            drawn = self._draw(epoch)
        except _NothingDrawn:
            if not restored:
                raise
            # a sampler whose state is how far its iteration got (torchdata's
            # StatefulDistributedSampler) reads its state at an epoch's end as "all yielded";
            # uninterrupted, that state began a new iteration: so does the draw now
            drawn = self._draw(epoch)
        if not self._checked:
            self._checked = True
            if before is not None:
                self.sampler.load_state_dict(copy.deepcopy(before))
            again = self._draw(epoch)
            if not drawn.same_as(again):
                warnings.warn(
                    f"{self._name} is not deterministic given the seed: two draws of epoch "
                    f"{epoch} after the same seeding differed, so it draws from randomness the "
                    "loader does not seed (a generator of its own) and no resume can reproduce "
                    "an interrupted epoch (ranks draw the same orders only if that randomness "
                    "is seeded alike on every rank; in Lightning's DDP loops the ranks compare "
                    "their epochs' first indices). Draw randomness from the sampler's "
                    "`generator`, the global torch/numpy/random RNGs or `set_epoch` (all "
                    "seeded per epoch), or give the sampler state_dict()/load_state_dict().",
                    stacklevel=4,
                )
            drawn = again
        self._remember(epoch, drawn, before)
        return drawn

    def _draw(self, epoch: int) -> _Drawn:
        with _seeded(self.sampler, self.seed, epoch), _epoch_kept(self.sampler):
            with _drawing(self._name, epoch):
                set_epoch = getattr(self.sampler, "set_epoch", None)
                if callable(set_epoch):
                    set_epoch(epoch)
                length = None
                if self._declared:  # read after set_epoch, which may change it (epoch_len)
                    length = (_declared_length(self.sampler) if callable(set_epoch)
                              else len(self))
                items = iter(self.sampler)
            return self._collect(_named_draw(items, self._name, epoch), epoch, length)

    def _collect(self, items: Iterator[Any], epoch: int, length: int | None) -> _Drawn:
        """The epoch's indices: its first ``length`` (its ``len()`` after ``set_epoch``), or,
        without a ``len()`` (``None``), all of them."""
        if length is None:
            drawn = _as_indices(_listed(items, self._name, "indices", "Give it a __len__: each "
                                        "epoch then takes its first len() indices"), self._name)
            if self._length is not None and len(drawn) != self._length:
                raise ValueError(
                    f"{self._name} has no len() and yielded {len(drawn)} indices in epoch "
                    f"{epoch}, {self._length} in the first: without len(), every epoch must have "
                    "the first one's length (the plan and len() are fixed from it). Give the "
                    "sampler a __len__ that says each epoch's length: a changed len() is "
                    "followed between epochs")
            return _Drawn(drawn)
        drawn = _as_indices(list(islice(items, length)), self._name)
        if not len(drawn) and length:
            raise _NothingDrawn(f"{self._name} yielded no index in epoch {epoch}, but len() is "
                                f"{length}: every epoch must have len() indices")
        if len(drawn) != length:
            raise ValueError(f"{self._name} yielded only {len(drawn)} indices in epoch {epoch}, "
                             f"but len() is {length}: every epoch must have len() indices")
        if not self._checked and next(items, None) is not None:
            warnings.warn(
                f"{self._name} yields more indices than its len() ({length}): each epoch "
                f"takes its first {length}, as a trainer that stops at len() reads an "
                "endless sampler (DataLoader would deliver them all). Make len() the epoch's "
                "length if it is not.", stacklevel=6)
        return _Drawn(drawn)

    def _remember(self, epoch: int, drawn: _Drawn, before: Any) -> None:
        self._cache[epoch] = drawn
        after = _sampler_state(self.sampler)
        if after is not None:
            self._states[epoch] = {"before": before, "after": after}
        for cache in (self._cache, self._states):
            while len(cache) > _CACHED_EPOCHS:
                cache.popitem(last=False)

    def _restore_for(self, epoch: int) -> bool:
        """After ``load_state_dict``: put the sampler where it was when ``epoch`` was drawn;
        returns whether a state was loaded."""
        pending, self._pending = self._pending, None
        load = getattr(self.sampler, "load_state_dict", None)
        if not pending or load is None:
            return False
        if epoch in pending:
            load(copy.deepcopy(pending[epoch]["before"]))
            return True
        earlier = [e for e in pending if e < epoch]
        if earlier:
            load(copy.deepcopy(pending[max(earlier)]["after"]))
        return bool(earlier)


class DrawnBatchOrder(DrawnOrder):
    """Any other batch sampler: its batches laid end to end, so that global batch ``g`` holds
    its batches ``g * world_size ..`` and rank ``r`` reads batch ``g * world_size + r``.

    ``batch_size`` and ``len()`` are learnt from the first draw (epoch 0): its first batch's
    size and its number of indices. An epoch with as many indices whose batches all have that
    size (the last may be shorter) is planned as positions cut into batches of ``batch_size``
    (``EpochPlan``), as it always was. Any other epoch (bucketing by length, token budgets:
    sizes differ, and so may the number of batches and of indices) has ``batch_bounds``, and
    the plan deals its batches whole (``BoundaryPlan``).
    """

    batched = True

    def __init__(self, batch_sampler: Any, seed: int) -> None:
        self.batch_size = 0
        super().__init__(batch_sampler, seed)

    @property
    def fingerprint(self) -> str:
        return f"drawn-batches({self._name}, len={self._length}, batch_size={self.batch_size})"

    def batch_bounds(self, epoch: int) -> np.ndarray | None:
        """Where each batch of ``epoch`` begins among its positions, then the epoch's end
        (``None``: the epoch is cut into batches of ``batch_size``)."""
        return self._drawn(epoch).bounds

    def _collect(self, items: Iterator[Any], epoch: int, length: int | None) -> _Drawn:
        batches = [_as_indices(list(batch), self._name)
                   for batch in _listed(items, self._name, "batches", "Give each epoch an end")]
        if not batches:
            raise _NothingDrawn(f"{self._name} yielded no batch in epoch {epoch}")
        sizes = np.array([len(batch) for batch in batches], dtype=np.int64)
        empty = np.flatnonzero(sizes == 0)
        if empty.size:
            raise ValueError(f"{self._name} yielded an empty batch (batch {empty[0]} of epoch "
                             f"{epoch}): every batch needs at least one index")
        if self.batch_size == 0:
            self.batch_size = int(sizes[0])
        drawn = np.concatenate(batches)
        if ((sizes[:-1] == self.batch_size).all() and sizes[-1] <= self.batch_size
                and self._length in (None, len(drawn))):
            return _Drawn(drawn)
        bounds = np.zeros(len(sizes) + 1, dtype=np.int64)
        np.cumsum(sizes, out=bounds[1:])
        bounds.flags.writeable = False
        return _Drawn(drawn, bounds)


class _NothingDrawn(ValueError):
    """A sampler with ``len()`` yielded no index in an epoch."""


def _listed(items: Iterator[Any], name: str, what: str, fix: str) -> list[Any]:
    """An epoch's items; refused past ``MAX_DRAWN`` (an endless sampler would never end)."""
    listed = list(islice(items, MAX_DRAWN + 1))
    if len(listed) > MAX_DRAWN:
        raise ValueError(f"{name} has no len() and yielded more than {MAX_DRAWN:,} {what} in "
                         f"one epoch: an endless sampler cannot be planned into epochs. {fix}.")
    return listed


def _declared_length(sampler: Any) -> int | None:
    try:
        return int(len(sampler))
    except TypeError:
        return None


def _as_indices(items: list[Any], name: str) -> np.ndarray:
    """The drawn items as an int64 array, refusing anything that is not a dataset index."""
    try:
        array = np.asarray(items)
    except (TypeError, ValueError):
        array = np.asarray(items, dtype=object)
    if array.size == 0:
        return np.zeros(0, dtype=np.int64)
    if array.ndim == 1 and array.dtype.kind in "iu":
        return array.astype(np.int64, copy=False)
    try:
        return np.array([operator.index(item) for item in items], dtype=np.int64)
    except TypeError:
        raise TypeError(f"{name} yielded {items[0]!r} ({type(items[0]).__name__}): a resumable "
                        "order needs integer dataset indices") from None


def _sampler_state(sampler: Any) -> Any:
    if callable(getattr(sampler, "state_dict", None)) and callable(
            getattr(sampler, "load_state_dict", None)):
        return copy.deepcopy(sampler.state_dict())
    return None


def _generator_holders(sampler: Any) -> list[Any]:
    """The sampler and wrapped samplers (``.sampler``) that draw from a torch ``generator``."""
    holders, current = [], sampler
    for _ in range(_GENERATOR_DEPTH):
        if current is None:
            break
        generator = getattr(current, "generator", False)
        if generator is None or isinstance(generator, torch.Generator):
            holders.append(current)
        current = getattr(current, "sampler", None)
    return holders


@contextmanager
def _seeded(sampler: Any, seed: int, epoch: int) -> Iterator[None]:
    """Seed every RNG the sampler could use from ``(seed, epoch)``; restore them afterwards."""
    replaced = []
    with seeded_global_rngs(seed, epoch, _TAG):
        try:
            for depth, holder in enumerate(_generator_holders(sampler)):
                generator = torch.Generator().manual_seed(mix64(seed, epoch, _TAG, depth) >> 1)
                try:
                    previous = holder.generator
                    holder.generator = generator
                except AttributeError:
                    continue
                replaced.append((holder, previous))
            yield
        finally:
            for holder, previous in replaced:
                holder.generator = previous


@contextmanager
def _drawing(name: str, epoch: int) -> Iterator[None]:
    """Name the draw on an exception the sampler's own code raises in it (``set_epoch``,
    ``len()``, ``__iter__``), keeping the exception's type and traceback: the loader calls
    the sampler far from the user's own code."""
    try:
        yield
    except Exception as exc:
        exc.add_note(f"(raised while the loader drew the indices of epoch {epoch} from the "
                     f"sampler {name}, seeded by (seed, epoch))")
        raise


def _named_draw(items: Iterator[Any], name: str, epoch: int) -> Iterator[Any]:
    """``items``, the sampler's iterator, with ``_drawing`` around each step of it."""
    with _drawing(name, epoch):
        yield from items


@contextmanager
def _epoch_kept(sampler: Any) -> Iterator[None]:
    """Put the ``epoch`` attribute of a sampler with ``set_epoch`` back as the user left it:
    the loader follows the user's ``sampler.set_epoch`` by reading it (``SamplerEpochs``), and
    the draw's own ``set_epoch`` is not the user's. A sampler without ``set_epoch`` keeps what
    its draw did (one that advances its own ``epoch`` as it is iterated)."""
    has_set_epoch = callable(getattr(sampler, "set_epoch", None))
    epoch = getattr(sampler, "epoch", _UNSET) if has_set_epoch else _UNSET
    try:
        yield
    finally:
        if epoch is not _UNSET:
            with suppress(AttributeError):
                sampler.epoch = epoch


def _warn_if_rank_aware(sampler: Any) -> None:
    """Warn of a sampler with the attributes of one that splits the data by rank itself (torch's
    ``rank``/``num_replicas``, Megatron's ``data_parallel_rank``/``data_parallel_size``)."""
    names = next((pair for pair in _RANK_ATTRIBUTES
                  if all(hasattr(sampler, name) for name in pair)), None)
    if names is not None:
        warnings.warn(
            f"{type(sampler).__qualname__} looks rank-aware (it has {names[0]} and {names[1]}): "
            "the loader already gives each rank its share of the sampler's order, so a sampler "
            "that shards by rank itself is sharded twice (under DDP the loader refuses an "
            "order that differs between ranks). Give it a sampler over the whole dataset.",
            stacklevel=4,
        )
