"""``check_resume_at_every_step``: the generic resume check every loader in this package goes
through, public so that a user's own order, source or loader can be proved resumable with it.

Run once uninterrupted while snapshotting ``state_dict()`` after every batch; then, for every
snapshot, build a fresh loader, load the snapshot (after a ``torch.save`` round trip, as a
checkpoint would) and check that what it delivers equals the uninterrupted run's remainder.
Epochs are driven as Lightning drives them: ``sampler.set_epoch(e)`` then a fresh ``iter()``.
"""

from __future__ import annotations

import io
from collections.abc import Callable, Iterable
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["Snapshot", "check_resume_at_every_step", "checkpoint_roundtrip", "run_epochs",
           "set_epoch", "to_plain"]

Key = Any


def to_plain(batch: Any) -> Any:
    """Tensors and arrays to nested lists, so batches compare with ``==``."""
    if isinstance(batch, torch.Tensor | np.ndarray):
        return batch.tolist()
    if isinstance(batch, dict):
        return {k: to_plain(v) for k, v in batch.items()}
    if isinstance(batch, list | tuple):
        return [to_plain(v) for v in batch]
    return batch


def set_epoch(loader: Any, epoch: int) -> None:
    """What Lightning does before each epoch."""
    sampler = getattr(loader, "sampler", None)
    if sampler is not None and hasattr(sampler, "set_epoch"):
        sampler.set_epoch(epoch)


def checkpoint_roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    """``state`` after a ``torch.save``/``torch.load(weights_only=True)`` round trip, as a
    Lightning checkpoint stores it."""
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


@dataclass(frozen=True)
class Snapshot:
    """A loader's ``state_dict()`` taken after ``batch`` batches of ``epoch``."""

    epoch: int
    batch: int  # batches of ``epoch`` delivered when the state was taken
    last_of_epoch: bool
    state: dict[str, Any]


def run_epochs(loader: Any, epochs: Iterable[int], key: Callable[[Any], Key] = to_plain,
               snapshots: list[Snapshot] | None = None) -> list[list[Key]]:
    """Deliver ``epochs``; returns the batches of each, optionally snapshotting every step."""
    out = []
    for epoch in epochs:
        set_epoch(loader, epoch)
        batches = []
        for batch in loader:
            batches.append(key(batch))
            if snapshots is not None:
                snapshots.append(Snapshot(epoch, len(batches), False, loader.state_dict()))
        if snapshots and snapshots[-1].epoch == epoch:
            last = snapshots[-1]
            snapshots[-1] = Snapshot(last.epoch, last.batch, True, last.state)
        out.append(batches)
    return out


def check_resume_at_every_step(make_loader: Callable[[], Any], epochs: int,
                               key: Callable[[Any], Key] = to_plain) -> list[list[Key]]:
    """Check that resuming from every step's state reproduces the uninterrupted stream.

    ``make_loader`` builds a fresh loader (anything with ``state_dict``/``load_state_dict`` and
    an optional ``sampler.set_epoch``); ``key`` turns a batch into something comparable with
    ``==``. Raises ``AssertionError`` naming the first snapshot whose resume diverged; returns
    the uninterrupted run's batches per epoch for further checks.
    """
    snapshots: list[Snapshot] = []
    full = run_epochs(make_loader(), range(epochs), key, snapshots)
    if not snapshots or sum(map(len, full)) != len(snapshots):
        raise AssertionError(f"the loader delivered {sum(map(len, full))} batches in {epochs} "
                             f"epochs and {len(snapshots)} states: nothing to check")
    for snap in snapshots:
        resumed = make_loader()
        resumed.load_state_dict(checkpoint_roundtrip(snap.state))
        next_epoch = snap.epoch + 1 if snap.last_of_epoch else snap.epoch
        got = [b for e in run_epochs(resumed, range(next_epoch, epochs), key) for b in e]
        expected = full[snap.epoch][snap.batch:] + [b for e in full[snap.epoch + 1:] for b in e]
        if got != expected:
            raise AssertionError(
                f"resume after batch {snap.batch} of epoch {snap.epoch} diverged:\n"
                f"  got      {got[:4]}...\n  expected {expected[:4]}...")
    return full
