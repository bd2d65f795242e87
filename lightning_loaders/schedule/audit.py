"""The resume audit: a map-style cursor carries a digest of the batch it stands after, and a
restore checks it against the batch the plan puts there.

The order is a pure function of (seed, epoch, world size, rank), so a resume can be proved
right rather than hoped: the loader that saves a cursor ``(epoch, batches)`` also saves, in
``parts["audit"]``, a 64-bit digest of the sample indices of the last batch it delivered there
(of the epoch's first batch when none was yet), with the epoch, that batch's number, the rank
and the world size; the loader that restores it
computes the same digest from its own plan and refuses a mismatch with a
``StateMismatchError`` showing both values. That catches what the fingerprint cannot see: an
order that draws differently under the same description (a custom sampler with another seed,
a changed permutation after an upgrade), or a cursor edited without its digest.

Why the last batch and not the whole epoch's prefix: a digest chained over every batch would
also catch a divergence earlier in the epoch, but the restoring loader could only predict it by
replaying the prefix, O(epoch) (minutes at 10^9 samples, where a resume is otherwise a ~2 ms
jump), or by trusting a saved chain it cannot check. The last batch is predicted in O(batch),
is identical for any ``num_workers`` (it is the plan's, not the workers'), keeps the state O(1),
and since every index of a shuffled order depends on the seed and the epoch, one batch already
tells another order apart with near certainty. Under DDP every rank restores rank 0's state, so
the digest names the rank and world size it was taken on and is predicted for those.

A state saved before the loader delivered anything has no audit part and is not audited. An
out-of-order state (``in_order=False``) replaces the cursor by each rank's frontier; its audit
part then also names the cursor it describes (``batches``: the saving rank's frontier).
"""

from __future__ import annotations

import hashlib
from collections.abc import Callable, Mapping
from typing import Any

import numpy as np

from lightning_loaders.errors import StateMismatchError

__all__ = ["AUDIT", "audit_part", "batch_digest", "check_audit", "reaudited", "saved_digest"]

AUDIT = "audit"  # the state's part
_RANK = "rank"
_DIGEST = "digest"
_BATCHES = "batches"


def batch_digest(epoch: int, batch: int, rank: int, world_size: int,
                 sample_epochs: np.ndarray, indices: np.ndarray) -> str:
    """16 hex digits naming batch ``batch`` of ``epoch`` on ``rank`` of ``world_size`` and the
    sample indices in it (``sample_epochs``: each sample's epoch, which differs under
    ``last_batch="rollover"``); ``batch=-1``: none delivered, ``indices`` empty."""
    hasher = hashlib.blake2b(digest_size=8)
    hasher.update(np.array([epoch, batch, rank, world_size], dtype=np.int64).tobytes())
    hasher.update(np.ascontiguousarray(sample_epochs, dtype=np.int64).tobytes())
    hasher.update(np.ascontiguousarray(indices, dtype=np.int64).tobytes())
    return hasher.hexdigest()


def audit_part(rank: int, digest: str, batches: int | None = None) -> dict[str, Any]:
    """The part saved with a cursor: the rank it was taken on and the batch digest; ``batches``
    where the digest describes another cursor than the state's own (an out-of-order state,
    whose ``batches`` is each rank's own frontier, audits the saving rank's)."""
    part: dict[str, Any] = {_RANK: rank, _DIGEST: digest}
    if batches is not None:
        part[_BATCHES] = batches
    return part


def reaudited(part: Mapping[str, Any], batches: int, predict: Callable[[int, int], str]
              ) -> dict[str, Any]:
    """``part`` (a valid audit part of a cursor at ``batches``) with its digest predicted anew,
    as ``check_audit`` will predict it: the same cursor, under an order whose state changed
    since it was saved."""
    rank, own = part[_RANK], part.get(_BATCHES)
    return audit_part(rank, predict(rank, batches if own is None else own), own)


def saved_digest(state: Mapping[str, Any]) -> str | None:
    """The audit digest of a saved state dict (``None``: not audited), for logs."""
    parts = state.get("parts") if isinstance(state, Mapping) else None
    part = parts.get(AUDIT) if isinstance(parts, Mapping) else None
    digest = part.get(_DIGEST) if isinstance(part, Mapping) else None
    return digest if isinstance(digest, str) else None


def check_audit(part: Any, epoch: int, batches: int, world_size: int,
                predict: Callable[[int, int], str]) -> None:
    """Compare a saved audit ``part`` with ``predict(rank, batches)``, this loader's digest for
    the saved cursor (the part's own, else ``batches``) on the rank it was saved on; refuse a
    mismatch, naming both digests."""
    if not isinstance(part, Mapping) or not isinstance(part.get(_DIGEST), str):
        raise StateMismatchError(f"corrupted loader state: parts[{AUDIT!r}]={part!r} is not "
                                 f"{{{_RANK!r}: int, {_DIGEST!r}: str}}")
    rank = part.get(_RANK)
    if not isinstance(rank, int) or isinstance(rank, bool) or not 0 <= rank < world_size:
        raise StateMismatchError(f"corrupted loader state: parts[{AUDIT!r}][{_RANK!r}]={rank!r} "
                                 f"is not a rank of world size {world_size}")
    batches = part.get(_BATCHES, batches)
    if not isinstance(batches, int) or isinstance(batches, bool) or batches < 0:
        raise StateMismatchError(f"corrupted loader state: parts[{AUDIT!r}][{_BATCHES!r}]="
                                 f"{batches!r} is not a batch count")
    saved, predicted = part[_DIGEST], predict(rank, batches)
    if saved != predicted:
        raise StateMismatchError(
            f"resume audit failed at epoch {epoch}, after batch {batches} (rank {rank} of "
            f"{world_size}): the state's last batch has digest {saved}, this loader's plan puts "
            f"a batch with digest {predicted} there. The state comes from another order (a "
            "sampler or seed the fingerprint does not describe, another version of the order) "
            "or its cursor was edited; resume with the loader that saved it, or start afresh")
