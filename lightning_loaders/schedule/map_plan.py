"""The global batch plan: which epoch positions each rank reads in each batch.

An epoch's positions are cut into *global batches* of ``world_size * batch_size``; rank ``r``
reads a contiguous share of every global batch. Every rank therefore has the same number of
batches, and after ``g`` global batches the consumed positions are exactly a prefix of the
epoch, whatever the world size was: that prefix is what elastic resume continues from.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal, get_args

import numpy as np

__all__ = ["LAST_BATCH_POLICIES", "EpochPlan", "LastBatch", "keep_fix", "keep_refusal",
           "rollover_span"]

LastBatch = Literal["keep", "drop", "pad", "rollover"]
LAST_BATCH_POLICIES: tuple[str, ...] = get_args(LastBatch)


def keep_fix(size: int) -> str:
    """The batch size to suggest when ``last_batch='keep'`` leaves fewer samples than ranks
    (ending with a comma and a space)."""
    return ("a batch_size >= 2, " if size == 1 else
            "a batch_size that leaves at least one sample per rank after the full batches, ")


def keep_refusal(world_size: int, batch_size: int, left: int, total: int, rounds: int,
                 tail: int, *, merged: bool, resumed: bool) -> str:
    """Why ``last_batch="keep"`` cannot deal ``left`` samples of an epoch of ``total``
    (``resumed``: the rest of one, at an elastic resume) to ``world_size`` ranks: ``rounds``
    full rounds (a batch per rank) leave ``tail`` samples, fewer than the ranks, with none to
    borrow (batches of 1, or no full round). It names only fixes that deal them: the world
    sizes that deal both these samples and a whole epoch (at a resume, the next one)."""
    what = (f"the {_count(left, 'sample')} left" if resumed else
            f"the epoch's {_count(total, 'sample')}")
    if rounds:
        what += (f" ({_count(rounds, 'full round')} of {world_size} batches "
                 f"leave{'s' * (rounds == 1)} {tail})")
    what += f" with batch_size={batch_size}"
    if batch_size == 1 and not merged:  # one sample per batch: a world size must divide both
        common = math.gcd(left, total)
        sizes = sorted({d for n in range(1, math.isqrt(common) + 1) if not common % n
                        for d in (n, common // n)})
        listed = " or ".join(filter(None, [", ".join(map(str, sizes[:-1])), str(sizes[-1])]))
        both = f"both the {_count(left, 'sample')} left and " if resumed else ""
        ranks = (f"a world size dividing {both}the epoch's {total} ({listed} "
                 f"rank{'s' * (len(sizes) > 1)})")
    else:  # batches of 2 borrow from a full round, evaluation merges: any number up to ``left``
        ranks = f"at most {_count(left, 'rank')}"
    if resumed:
        fix = f"resume on {ranks}, or from a checkpoint at an epoch's end"
    elif merged:  # evaluation reads every sample once, where 'pad' would read some twice
        fix = f"evaluate on {ranks}"
    elif rounds:  # batches of 1 after full rounds
        fix = (f"use last_batch='pad' or 'drop', {keep_fix(batch_size)}evaluation=True, or "
               f"{ranks}")
    else:  # fewer samples than ranks: no batch size, merge or 'drop' helps
        fix = f"use last_batch='pad', or {ranks}"
    return (f"last_batch='keep' cannot give each of {world_size} ranks a non-empty last batch "
            f"from {what}; {fix}")


def _count(n: int, noun: str) -> str:
    """``n`` and ``noun``, plural unless ``n`` is 1."""
    return f"{n} {noun}{'s' * (n != 1)}"


@dataclass(frozen=True)
class EpochPlan:
    """Batches over positions ``[start, stop)`` for ``world_size`` ranks.

    Attributes:
        start: first position still to read (0, or where an elastic resume continues).
        stop: end of the epoch's positions.
        batch_size: samples per rank per full batch.
        world_size: number of ranks sharing each global batch.
        last_batch: ``"keep"`` splits a short last global batch as evenly as possible (never an
            empty batch), ``"drop"`` drops it, ``"pad"`` fills it by wrapping to position 0.
            (``"rollover"`` is planned as ``"drop"`` over stream positions: see ``rollover_span``.)
        merge_short_tail: with ``"keep"``, a short tail that only empty batches could spread
            (``batch_size=1``) joins the last full global batch instead, so its first ranks read
            one extra sample: what evaluation needs (every sample once, equal batch counts).
    """

    start: int
    stop: int
    batch_size: int
    world_size: int
    last_batch: Literal["keep", "drop", "pad"] = "keep"
    merge_short_tail: bool = False

    def __post_init__(self) -> None:
        if self.batch_size < 1 or self.world_size < 1:
            raise ValueError(f"batch_size and world_size must be >= 1, got {self.batch_size}, "
                             f"{self.world_size}")
        if not 0 <= self.start <= self.stop:
            raise ValueError(f"need 0 <= start <= stop, got start={self.start}, stop={self.stop}")
        if (self.last_batch == "keep" and self._short_tail() and not self._can_rebalance()
                and not self._merges_tail()):
            samples = self.stop - self.start
            raise ValueError(keep_refusal(
                self.world_size, self.batch_size, samples, self.stop,
                *divmod(samples, self.global_batch_size), merged=self.merge_short_tail,
                resumed=self.start > 0))

    @property
    def global_batch_size(self) -> int:
        return self.batch_size * self.world_size

    @property
    def num_batches(self) -> int:
        """Batches per rank (equal on every rank)."""
        full, rest = divmod(self.stop - self.start, self.global_batch_size)
        if rest == 0 or self.last_batch == "drop" or self._merges_tail():
            return full
        return full + 1

    def consumed(self, batches: int) -> int:
        """The position up to which the epoch is read after ``batches`` global batches."""
        if batches >= self.num_batches:
            return self.stop
        return self._span(batches)[0]

    @property
    def even_batches(self) -> int:
        """How many leading batches are whole global batches split evenly (all but the last one
        or two): in each, a rank reads ``batch_size`` consecutive positions."""
        full = (self.stop - self.start) // self.global_batch_size
        return full - 1 if self.last_batch == "keep" and self._short_tail() else full

    def even_positions(self, first: int, stop: int, rank: int) -> np.ndarray:
        """``positions(batch, rank)`` for the even batches ``first..stop - 1`` at once, one row
        per batch (a whole block of the plan in two numpy calls)."""
        if not 0 <= first <= stop <= self.even_batches:
            raise IndexError(f"batches [{first}, {stop}) outside the even batches [0, "
                             f"{self.even_batches})")
        begins = np.arange(first, stop, dtype=np.int64) * self.global_batch_size
        begins += self.start + rank * self.batch_size
        return begins[:, None] + np.arange(self.batch_size, dtype=np.int64)

    def positions(self, batch: int, rank: int) -> np.ndarray:
        """Epoch positions (int64) that ``rank`` reads in ``batch``."""
        if not 0 <= batch < self.num_batches:
            raise IndexError(f"batch {batch} outside [0, {self.num_batches})")
        if not 0 <= rank < self.world_size:
            raise IndexError(f"rank {rank} outside [0, {self.world_size})")
        begin, size = self._span(batch)
        share, extra = divmod(size, self.world_size)
        first = begin + rank * share + min(rank, extra)
        pos = np.arange(first, first + share + (rank < extra), dtype=np.int64)
        if self.last_batch == "pad":
            beyond = pos >= self.stop
            pos[beyond] = (pos[beyond] - self.stop) % self.stop
        return pos

    def _span(self, batch: int) -> tuple[int, int]:
        """First position and size of global ``batch``."""
        g = self.global_batch_size
        full, rest = divmod(self.stop - self.start, g)
        begin = self.start + batch * g
        if self._merges_tail():
            return begin, g + rest if batch == full - 1 else g
        if self.last_batch != "keep" or rest == 0 or batch < full - 1:
            return begin, g if (batch < full or self.last_batch == "pad") else rest
        if not self._short_tail():
            return begin, g if batch < full else rest
        # Fewer leftovers than ranks: the second-to-last global batch gives up one sample per
        # rank so the last one holds exactly one sample per rank.
        shrunk = g - self.world_size + rest
        if batch == full - 1:
            return begin, shrunk
        return self.start + (full - 1) * g + shrunk, self.world_size

    def _short_tail(self) -> bool:
        rest = (self.stop - self.start) % self.global_batch_size
        return 0 < rest < self.world_size

    def _can_rebalance(self) -> bool:
        return self.batch_size >= 2 and self.stop - self.start >= self.global_batch_size

    def _merges_tail(self) -> bool:
        return (self.merge_short_tail and self.last_batch == "keep" and self._short_tail()
                and not self._can_rebalance()
                and self.stop - self.start >= self.global_batch_size)


def rollover_span(epoch: int, length: int, global_batch_size: int,
                  origin: tuple[int, int] = (0, 0)) -> tuple[int, int]:
    """Stream positions ``[start, stop)`` of ``epoch`` under ``last_batch="rollover"``.

    Epochs are laid end to end as one stream; global batches are cut from the stream, and a
    batch belongs to the epoch in which it completes, so an epoch's leftover samples open the
    next one (as MXNet Gluon's ``rollover``). ``origin``: the ``(epoch, stream position)`` the
    cutting starts at, where epoch ``epoch`` (or an earlier one) begins: a resume under another
    global batch size cuts the stream anew from where the saved run's epoch ended, so the
    leftovers it carried over open the next epoch whole.
    """
    g = global_batch_size
    first_epoch, position = origin
    start = position if epoch == first_epoch else position + (epoch * length - position) // g * g
    return start, position + ((epoch + 1) * length - position) // g * g
