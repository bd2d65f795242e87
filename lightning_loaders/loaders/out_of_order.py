"""Out-of-order delivery that stays exactly resumable (``in_order=False``).

Workers answer planned batches as they finish them; each answer carries its batch number. The
cursor's ``batches`` stays the *frontier* (every batch before it delivered), and the batches
delivered past it are the *ahead* set. It only holds batches of the in-flight window (at most
``num_workers * prefetch_factor`` requests are outstanding), so the state stays O(1) in the
dataset's size. A resume requests every planned batch from the frontier that is not in the
ahead set: nothing is repeated and nothing is lost.

The same window serves map-style batches (``BatchRequest``) and iterable batches planned over
canonical partitions (``PartRequest``): both are numbered batches of a planned sequence, and
each request says by itself what to read, so any worker can answer any of them.

Under DDP every rank has its own frontier and ahead set; ``state_dict()`` gathers them from all
ranks (every rank calls it together, as Lightning does when it checkpoints), so the one state a
checkpoint keeps resumes every rank.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Iterator, Mapping
from typing import Any, Protocol, TypeVar

from lightning_loaders.errors import StateMismatchError

__all__ = ["WINDOW", "DeliveredWindow", "Frontier", "NumberedRequest", "WindowedRequests",
           "not_delivered", "rank_entry"]

WINDOW = "window"  # the part: per rank, [frontier, [batches delivered past it]]
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
        self._recent.append(batch)
        if self.order is not None:
            self.order.append(batch)
        if batch != schedule.batches:
            self.ahead.add(batch)
            return
        schedule.delivered()
        while schedule.batches in self.ahead:
            self.ahead.remove(schedule.batches)
            schedule.delivered()

    def saved(self, frontier: int, held: int) -> list[Any]:
        """``[frontier, ahead]`` as a state, the last ``held`` delivered batches (which a
        prefetching trainer holds unused) counted as not delivered."""
        recent = list(self._recent)
        undone = set(recent[len(recent) - held:]) if held else set()
        start = min([frontier, *undone])
        delivered = set(range(start, frontier)) | self.ahead
        return [start, sorted(delivered - undone)]

    def restore(self, epoch: int, entry: list[Any]) -> None:
        """Keep a restored ``[frontier, ahead]`` until the epoch it belongs to reopens."""
        self._restored = (epoch, int(entry[0]), frozenset(int(b) for b in entry[1]))

    def pending_ahead(self) -> int:
        """How many batches the restored state had delivered past its frontier: they are not
        delivered again (0 without a restored state)."""
        return 0 if self._restored is None else len(self._restored[2])

    def pending(self) -> list[Any] | None:
        """The restored ``[frontier, ahead]`` not yet applied, if any."""
        if self._restored is None:
            return None
        return [self._restored[1], sorted(self._restored[2])]

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


class WindowedRequests(Iterator[_R]):
    """Requests that are ``ready()`` (the workers' iterator asks) only while the next one is
    less than ``limit`` batches past the first undelivered batch (``schedule.batches``): with
    out-of-order delivery, a fast worker cannot run away from a slow one, so the batches
    delivered past the frontier stay fewer than ``limit``."""

    def __init__(self, requests: Iterator[_R], schedule: Frontier, limit: int) -> None:
        self._requests = requests
        self._schedule = schedule
        self._limit = limit
        self._next: _R | None = None

    def __iter__(self) -> WindowedRequests[_R]:
        return self

    def __next__(self) -> _R:
        request, self._next = self._next, None
        return next(self._requests) if request is None else request

    def ready(self) -> bool:
        if self._next is None:
            self._next = next(self._requests, None)
            if self._next is None:
                return True
        return self._next.batch < self._schedule.batches + self._limit


def rank_entry(part: Any, rank: int, world_size: int, batches: int, end: int) -> list[Any]:
    """This rank's ``[frontier, ahead]`` from a saved window part, checked; a
    ``StateMismatchError`` names what is wrong."""
    if not isinstance(part, Mapping) or not isinstance(part.get("ranks"), list):
        raise StateMismatchError(f"corrupted loader state: parts[{WINDOW!r}]={part!r} is not "
                                 "{'ranks': [...]}")
    ranks = part["ranks"]
    if len(ranks) != world_size:
        if any(entry is None for entry in ranks):
            raise StateMismatchError(
                f"an out-of-order state saved on {len(ranks)} ranks without a process group "
                f"holds only some ranks' entries, so it cannot resume on {world_size}: save "
                "with every rank calling state_dict() together (as Lightning does), or resume "
                f"on {len(ranks)} ranks, each from its own state")
        if any(entry[1] or entry[0] != batches for entry in ranks):
            raise StateMismatchError(
                f"an out-of-order state saved on {len(ranks)} ranks cannot resume on "
                f"{world_size}: its ranks had delivered different batches; resume on "
                f"{len(ranks)} ranks, or at an epoch end")
        return [batches, []]
    entry = ranks[rank]
    if entry is None:
        raise StateMismatchError(
            f"the out-of-order state holds no entry for rank {rank}: it was saved without a "
            "process group, on another rank; save with every rank calling state_dict() "
            "together (as Lightning does), or load each rank's own state")
    ok = (isinstance(entry, list | tuple) and len(entry) == 2 and isinstance(entry[0], int)
          and isinstance(entry[1], list | tuple)
          and all(isinstance(b, int) and entry[0] < b < end for b in entry[1]))
    if not ok or not 0 <= entry[0] <= end:
        raise StateMismatchError(f"corrupted loader state: parts[{WINDOW!r}] entry {entry!r} "
                                 f"of rank {rank} is not [frontier, [batches past it, before "
                                 f"{end}]]")
    return [entry[0], list(entry[1])]
