"""``DynamicWeightedSampler``: weighted sampling whose weights may change during an epoch.

Draws are with replacement: position ``p`` of epoch ``e`` is the inverse CDF, under the weights
current when it is planned, of a uniform hashed from ``(seed, e, p)``. A change made after a
loader has delivered ``k`` batches of an epoch (for example in ``on_train_batch_end``, from the
per-sample losses) applies from batch ``k`` on: the loader sees the sampler's ``version`` change
and re-plans the batches it had prefetched (with ``in_order=False``, every batch not delivered
yet: one in flight behind batches delivered ahead of it too, as a resume from the state saved
then re-plans it). Every rank must hold the same weights, so ``set_weights`` checks them
across ranks and ``update_weights`` gathers every rank's updates (both are collective when a
process group is initialised: call them on every rank at the same step).

State: the current weights (float64, 8 bytes per sample) once they differ from the initial
ones; a resume needs nothing else, because positions before the cursor are never re-planned.
"""

from __future__ import annotations

import numbers
from collections.abc import Iterator
from typing import Any

import numpy as np
import torch
from torch.utils.data import Sampler

from lightning_loaders.collectives import all_gather
from lightning_loaders.errors import StateMismatchError
from lightning_loaders.hashing import checked_seed, digest, mix64
from lightning_loaders.orders.random import check_weights, weighted_draws

__all__ = ["DynamicWeightedSampler", "check_same_on_every_rank"]

_TAG = 0xD1A


class DynamicWeightedSampler(Sampler[int]):
    """Weighted sampling with replacement, re-weightable mid-epoch, exactly resumable.

    Args:
        weights: one non-negative weight per dataset sample (not necessarily normalised).
        num_samples: draws per epoch; defaults to ``len(weights)``.
        seed: keys the draws; defaults to the seed of the loader it is given to.

    Use it as a ``DataLoader``'s sampler and convert the loader with ``make_resumable`` (or pass
    it to ``ResumableLoader(sampler=...)``); keep a reference to call ``set_weights`` or
    ``update_weights``. Iterated directly (as a plain torch sampler) it draws lazily with the
    current weights, but only a resumable loader gives changes an exact batch boundary.
    """

    def __init__(self, weights: Any, num_samples: int | None = None, *,
                 seed: int | None = None) -> None:
        super().__init__()
        self._initial = check_weights(weights)
        self._initial_digest = digest(self._initial)
        if num_samples is not None and (isinstance(num_samples, bool) or not isinstance(
                num_samples, numbers.Integral) or num_samples < 1):
            raise ValueError(f"num_samples must be an int >= 1, got {num_samples!r}")
        self.num_samples = self._initial.size if num_samples is None else int(num_samples)
        self.seed = None if seed is None else checked_seed(seed)
        self.version = 0
        self._epoch = 0
        self._use(self._initial)

    # -- SampleOrder ------------------------------------------------------------------------

    def __len__(self) -> int:
        return self.num_samples

    def indices(self, epoch: int, positions: np.ndarray) -> np.ndarray:
        pos = np.asarray(positions, dtype=np.int64)
        if pos.size and (pos.min() < 0 or pos.max() >= self.num_samples):
            raise IndexError(f"positions must lie in [0, {self.num_samples})")
        key = mix64(self.seed or 0, epoch, _TAG)
        return weighted_draws(self._cumulative, self._last_positive, key, pos)

    @property
    def fingerprint(self) -> str:
        return (f"dynamic-weighted(n={self._initial.size}, num_samples={self.num_samples}, "
                f"initial={self._initial_digest})")

    def bind(self, seed: int) -> DynamicWeightedSampler:
        """Take the loader's seed unless one was given (called by the conversion)."""
        if self.seed is None:
            self.seed = seed
        return self

    # -- weights ----------------------------------------------------------------------------

    @property
    def weights(self) -> np.ndarray:
        """The current weights (a read-only view)."""
        view = self._weights.view()
        view.flags.writeable = False
        return view

    def set_weights(self, weights: Any) -> None:
        """Replace all weights; they must be identical on every rank (checked)."""
        new = check_weights(weights, self._initial.size)
        check_same_on_every_rank(new)
        self._use(new)

    def update_weights(self, indices: Any, values: Any) -> None:
        """Set ``weights[indices] = values``, gathering the updates of every rank (applied in
        rank order), so each rank can pass what it learnt about its own samples."""
        index = np.asarray(indices.detach().cpu() if hasattr(indices, "detach") else indices,
                           dtype=np.int64).reshape(-1)
        value = np.asarray(values.detach().cpu() if hasattr(values, "detach") else values,
                           dtype=np.float64).reshape(-1)
        if index.shape != value.shape:
            raise ValueError(f"indices and values must have the same length, got {index.size} "
                             f"and {value.size}")
        n = self._initial.size
        if index.size and (index.min() < -n or index.max() >= n):
            raise IndexError(f"indices must lie in [0, {n}), got {index.min()}..{index.max()}")
        new = self._weights.copy()
        for rank_index, rank_value in all_gather((index, value)):
            new[rank_index] = rank_value
        self._use(check_weights(new))

    def _use(self, weights: np.ndarray) -> None:
        self._weights = weights
        self._cumulative = np.cumsum(weights)
        self._last_positive = int(np.flatnonzero(weights)[-1])
        self.version += 1

    # -- state ------------------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """The current weights when they differ from the initial ones (else ``None``)."""
        changed = self._weights is not self._initial
        return {"weights": torch.from_numpy(self._weights.copy()) if changed else None}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Restore the weights saved by ``state_dict``; a ``StateMismatchError`` unless they
        are ``None`` or one finite weight >= 0 per sample."""
        weights = state.get("weights")
        try:
            checked = None if weights is None else check_weights(weights, self._initial.size)
        except (TypeError, ValueError) as exc:
            raise StateMismatchError(
                f"corrupted DynamicWeightedSampler state: its saved 'weights' (a "
                f"{type(weights).__name__}) are refused: {exc}") from exc
        self._use(self._initial if checked is None else checked)

    # -- plain torch sampler ----------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        self._epoch = epoch

    def __iter__(self) -> Iterator[int]:
        epoch = self._epoch
        for position in range(self.num_samples):
            yield int(self.indices(epoch, np.array([position]))[0])


def check_same_on_every_rank(weights: np.ndarray, also: Any = None) -> list[Any]:
    """Refuse weights that differ between ranks (collective under a process group); returns
    every rank's ``also`` (a caller's own values to compare), gathered in the same collective."""
    gathered = all_gather((digest(weights), also))
    digests = [weights_digest for weights_digest, _ in gathered]
    if len(set(digests)) > 1:
        raise ValueError(
            f"set_weights got different weights on different ranks (digests by rank: {digests}); "
            "every rank must draw from the same weights: all-reduce them first, or use "
            "update_weights(indices, values), which gathers every rank's updates"
        )
    return [value for _, value in gathered]
