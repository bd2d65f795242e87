"""Out-of-order delivery that stays exactly resumable (``in_order=False``).

Workers answer planned batches as they finish them; each answer carries its batch number. The
cursor's ``batches`` stays the *frontier* (every batch before it delivered), and the batches
delivered past it are the *ahead* set. As in ``DataLoader(in_order=False)``, a fast worker runs
on while a slow one holds the frontier, however far: requests go out in plan order and at most
``num_workers * prefetch_factor`` are in flight, so every batch between the frontier and the
last one delivered was delivered except those still in flight. The state saves the ahead set
as runs of consecutive batches; the frontier and each gap between two runs is a batch in
flight (or one a trainer holds unused), so there are no more runs than those, whatever the
dataset's size or how far ahead the fast worker ran. A resume requests every planned batch from
the frontier that is not in the ahead set: nothing is repeated and nothing is lost.

The same bookkeeping serves map-style batches (``BatchRequest``) and iterable batches planned
over canonical partitions (``PartRequest``): both are numbered batches of a planned sequence,
and each request says by itself what to read, so any worker can answer any of them.

Under DDP every rank has its own frontier and ahead set; ``state_dict()`` gathers them from all
ranks (every rank calls it together, as Lightning does when it checkpoints), so the one state a
checkpoint keeps resumes every rank.
"""

from __future__ import annotations

import sys
from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, TypeVar

from lightning_loaders.errors import StateMismatchError

__all__ = ["WINDOW", "DeliveredWindow", "Frontier", "NumberedRequest", "not_delivered",
           "rank_entry"]

WINDOW = "window"  # the part: per rank, [frontier, [[start, stop) runs delivered past it]]
_RECENT = 64  # delivered batch numbers remembered (a prefetching trainer holds a few)


class NumberedRequest(Protocol):
    """A planned batch's request (``BatchRequest``, ``PartRequest``): its number in the plan."""

    @property
    def batch(self) -> int: ...


class Frontier(Protocol):
    """What the window reads of a schedule: its frontier, and counting a batch over it."""

    batches: int

    def delivered(self) -> None: ...


_R = TypeVar("_R", bound=NumberedRequest)


class DeliveredWindow:
    """The batches of the current epoch delivered past the cursor's frontier."""

    def __init__(self) -> None:
        self.ahead: set[int] = set()
        self._recent: deque[int] = deque(maxlen=_RECENT)  # delivery order, newest last
        self._restored: tuple[int, int, frozenset[int]] | None = None
        self.order: list[int] | None = None
        """The epoch's batches in delivery order, once ``record_order()`` asked for them."""
        self._counted: list[tuple[int, list[int], int | None]] = []  # since ``handing()``

    def record_order(self) -> list[int]:
        """Keep the epoch's batches in delivery order from now on (``order``, cleared at each
        epoch start), for a consumer that knows batches by their delivery count."""
        if self.order is None:
            self.order = []
        return self.order

    def reset(self) -> None:
        """Forget the window (a new epoch, or a state without one loaded)."""
        self._restored = None
        self.ahead.clear()
        self._recent.clear()
        self._counted.clear()
        if self.order is not None:
            self.order.clear()

    def due(self, frontier: int) -> int:
        """The first planned batch from ``frontier`` not delivered yet."""
        batch = frontier
        while batch in self.ahead:
            batch += 1
        return batch

    def count(self, schedule: Frontier, batch: int) -> None:
        """Count ``batch`` handed to the caller: the frontier moves over every batch
        delivered in a row, a batch past it joins the ahead set."""
        recent = self._recent
        dropped = recent[0] if len(recent) == recent.maxlen else None
        recent.append(batch)
        if self.order is not None:
            self.order.append(batch)
        folded: list[int] = []  # the ahead batches the frontier moved over
        self._counted.append((batch, folded, dropped))
        if batch != schedule.batches:
            self.ahead.add(batch)
            return
        schedule.delivered()
        while schedule.batches in self.ahead:
            self.ahead.remove(schedule.batches)
            folded.append(schedule.batches)
            schedule.delivered()

    def handing(self) -> None:
        """A batch is about to be handed over: the counts from now on are its own, which
        ``take_back`` undoes (as the schedule's ``handing``)."""
        self._counted.clear()

    def take_back(self) -> bool:
        """Undo the counts since ``handing()`` here (the schedule's ``take_back`` undoes its
        own): their batch was not handed over. Whether there were any: a batch that only
        joined the ahead set counted too, and the engine is past it."""
        counted = bool(self._counted)
        while self._counted:
            batch, folded, dropped = self._counted.pop()
            self.ahead.discard(batch)
            self.ahead.update(folded)
            self._recent.pop()
            if dropped is not None:
                self._recent.appendleft(dropped)
            if self.order:
                self.order.pop()
        return counted

    def saved(self, frontier: int, held: int) -> list[Any]:
        """``[frontier, runs]`` as a state, the last ``held`` delivered batches (which a
        prefetching trainer holds unused) counted as not delivered."""
        recent = list(self._recent)
        undone = set(recent[len(recent) - held:]) if held else set()
        start = min([frontier, *undone])
        delivered = set(range(start, frontier)) | self.ahead
        return [start, _runs(delivered - undone)]

    def restore(self, epoch: int, entry: list[Any]) -> None:
        """Keep a restored ``[frontier, ahead]`` (``rank_entry``'s) until the epoch it
        belongs to reopens."""
        self._restored = (epoch, int(entry[0]), frozenset(int(b) for b in entry[1]))

    def pending_ahead(self) -> int:
        """How many batches the restored state had delivered past its frontier: they are not
        delivered again (0 without a restored state)."""
        return 0 if self._restored is None else len(self._restored[2])

    def last_ahead(self) -> int | None:
        """The last batch delivered past the frontier (a restored state's until it applies;
        ``None`` when none was): a ``Mix``'s weights may change only after it."""
        restored = self._restored
        return max(self.ahead if restored is None else restored[2], default=None)

    def pending(self) -> list[Any] | None:
        """The restored ``[frontier, runs]`` not yet applied, if any."""
        if self._restored is None:
            return None
        return [self._restored[1], _runs(self._restored[2])]

    def resumed(self, epoch: int | None, frontier: int) -> None:
        """At an epoch start: the restored ahead set applies if the restored cursor
        continues, else the window starts empty."""
        restored, self._restored = self._restored, None
        self.reset()
        if restored is not None and restored[:2] == (epoch, frontier):
            self.ahead.update(restored[2])


def not_delivered(requests: Iterable[_R], ahead: frozenset[int]) -> Iterator[_R]:
    """``requests`` less the batches already delivered (a free function: it must not keep its
    loader alive)."""
    for request in requests:
        if request.batch not in ahead:
            yield request


def rank_entry(part: Any, rank: int, world_size: int, batches: int, end: int) -> list[Any]:
    """This rank's ``[frontier, ahead]`` from a saved window part, checked, its runs read
    into the batch numbers they hold; a ``StateMismatchError`` names what is wrong."""
    if not isinstance(part, Mapping) or not isinstance(part.get("ranks"), list):
        raise StateMismatchError(f"corrupted loader state: parts[{WINDOW!r}]={part!r} is not "
                                 "{'ranks': [...]}")
    ranks = part["ranks"]
    if len(ranks) != world_size and any(entry is None for entry in ranks):
        raise StateMismatchError(
            f"an out-of-order state saved on {len(ranks)} ranks without a process group "
            f"holds only some ranks' entries, so it cannot resume on {world_size}: save "
            "with every rank calling state_dict() together (as Lightning does), or resume "
            f"on {len(ranks)} ranks, each from its own state")
    if not any(isinstance(e, list | tuple) and e and _is_batch(e[0]) and e[0] == batches
               for e in ranks):
        raise StateMismatchError(
            f"corrupted loader state: the cursor says batches={batches}, but no rank's "
            f"entry in parts[{WINDOW!r}] has that frontier (the saving rank's must): {ranks!r}")
    if len(ranks) != world_size:  # no plan of this loader's bounds another world size's
        by_rank = [_ahead_of(entry, r, sys.maxsize) for r, entry in enumerate(ranks)]
        if any(by_rank) or any(entry[0] != batches for entry in ranks):
            raise StateMismatchError(_elastic_refusal(ranks, by_rank, world_size, batches))
        return [batches, []]
    entry = ranks[rank]
    if entry is None:
        raise StateMismatchError(
            f"the out-of-order state holds no entry for rank {rank}: it was saved without a "
            "process group, on another rank; save with every rank calling state_dict() "
            "together (as Lightning does), or load each rank's own state")
    ahead = _ahead_of(entry, rank, end)
    return [entry[0], ahead]


def _ahead_of(entry: Any, rank: int, end: int) -> list[int]:
    """The batches a saved ``[frontier, runs]`` entry of ``rank`` holds past its frontier
    (each before ``end``), its shape checked before anything reads it; a
    ``StateMismatchError`` names a malformed one as corrupted."""
    if (isinstance(entry, list | tuple) and len(entry) == 2 and _is_batch(entry[0])
            and 0 <= entry[0] <= end and isinstance(entry[1], list | tuple)):
        ahead = _batches_of(entry[1], entry[0], end)
        if ahead is not None:
            return ahead
    before = "" if end == sys.maxsize else f", before {end}"
    raise StateMismatchError(f"corrupted loader state: parts[{WINDOW!r}] entry {entry!r} of "
                             f"rank {rank} is not [frontier, [[start, stop) runs of batches "
                             f"past it{before}]]")


def _elastic_refusal(ranks: list[Any], ahead: list[list[int]], world_size: int,
                     batches: int) -> str:
    """Why a state saved on ``len(ranks)`` ranks, some with batches (``ahead``, by rank)
    delivered past the cursor's frontier ``batches``, cannot resume on ``world_size``: another
    world size deals the rest of the epoch anew from the frontier, and would deliver those
    batches again."""
    shown = [f"batch{'es' * (len(numbers) > 1)} " + ", ".join(
        str(start) if stop == start + 1 else f"{start}-{stop - 1}"
        for start, stop in _runs(numbers)) if numbers else "none" for numbers in ahead]
    saved = f"{len(ranks)} rank{'s' * (len(ranks) > 1)}"
    if all(entry == ranks[0] for entry in ranks):  # the saving rank's frontier is the cursor
        where = "" if len(ranks) == 1 else "on every rank, "
        why = (f"{where}{shown[0]} had been delivered ahead of the frontier, batch {batches} "
               "(out of order)")
    else:
        held = "; ".join(f"rank {r}: frontier {entry[0]}, ahead {listed}"
                         for r, (entry, listed) in enumerate(zip(ranks, shown, strict=True)))
        why = f"its ranks had delivered different batches ({held})"
    return (f"an out-of-order state saved on {saved} cannot resume on {world_size}: {why}; "
            "another world size deals the rest of the epoch anew from the frontier, and would "
            f"deliver again what was delivered past it. Resume on {saved}, or from a state with "
            "no batch delivered ahead of its frontier (as at an epoch end)")


def _runs(batches: Iterable[int]) -> list[list[int]]:
    """Batch numbers as sorted ``[start, stop)`` runs of consecutive ones."""
    runs: list[list[int]] = []
    for batch in sorted(batches):
        if runs and runs[-1][1] == batch:
            runs[-1][1] += 1
        else:
            runs.append([batch, batch + 1])
    return runs


def _batches_of(runs: Iterable[Any], frontier: int, end: int) -> list[int] | None:
    """The batch numbers of saved runs, each past ``frontier`` and before ``end``, in
    order and apart (``None`` if they are not); a plain batch number (the format before
    runs) is a run of one."""
    batches: list[int] = []
    for run in runs:
        if _is_batch(run):
            run = [run, run + 1]
        if not (isinstance(run, list | tuple) and len(run) == 2
                and all(_is_batch(b) for b in run)):
            return None
        start, stop = run
        if not (batches[-1] if batches else frontier) < start < stop <= end:
            return None
        batches.extend(range(start, stop))
    return batches


def _is_batch(value: Any) -> bool:
    """Whether a saved value is a batch number: an ``int``, not a ``bool``."""
    return isinstance(value, int) and not isinstance(value, bool)
