"""The delivery core every loader of this package shares, adapters included.

A loader is a schedule (the plan and the cursor) and an engine (what turns the plan into
batches). What users and Lightning see is the same for all of them and lives here once:

- ``iter()`` is cheap and replaces older iterators; the epoch and the engine start at the
  first ``next()`` (Lightning calls ``iter()`` once extra during setup); threads take turns:
  an ``iter()`` waits for a ``next()`` in flight in another thread (the engine, the slots and
  the schedule are driven by one iterator at a time), which then raises at its next ``next()``;
  ``close()``, ``state_dict()`` and ``load_state_dict()`` from another thread (a checkpoint or
  watchdog thread, a teardown path) wait for it too, so a state is always taken between two
  batches; called from one of the loader's own worker threads (inside the dataset), where
  the iterating thread may be waiting for that very fetch, they raise ``RuntimeError``;
- a batch is counted when it is handed to the caller, never when it is prefetched, and batches
  a prefetching trainer holds are left out of ``state_dict()``;
- ``sampler.set_epoch`` (what Lightning calls), ``epoch``, ``len()``; the ``set_epoch`` of a
  sampler the user passed, when they call it on their own object (the ``DistributedSampler``
  idiom: ``SamplerEpochs``);
- ``close()``, ``with``, and Lightning's loop teardown; an iterator used after ``close()`` or
  after an error goes on from the cursor;
- ``repr()`` says where the loader is.

A loader implements ``_open_epoch`` (decide the epoch and open the engine at the cursor; over a
``MapSchedule``, ``_begin_map_epoch`` begins it, compared across the ranks where
``_compares_ranks`` says), ``_reopen`` (the rest of the current epoch from the cursor, after an
error or ``close()``), ``_describe`` (its own ``repr`` fields) and extends ``close``; the
iterators they return count each batch with the schedule as they hand it over (``counted`` does
it for an engine that yields plain batches).
"""

from __future__ import annotations

import functools
import os
import threading
import weakref
from collections.abc import Callable, Iterable, Iterator, Mapping
from contextlib import AbstractContextManager
from typing import Any, Protocol, Self, TypeVar, cast

from torch.utils.data import SequentialSampler

from lightning_loaders.loaders.prefetch import (
    HeldNote,
    batches_after,
    batches_held,
    find_prefetcher,
    fit_epoch,
    lightning_fetches,
    note_held,
)
from lightning_loaders.orders.from_torch import SamplerEpochs
from lightning_loaders.schedule.map_schedule import MapSchedule
from lightning_loaders.state import PARTS

__all__ = [
    "Delivery",
    "DeliveryCore",
    "EpochSampler",
    "Schedule",
    "SizedEpochSampler",
    "counted",
]


class Schedule(Protocol):
    """What the delivery core needs of a schedule (``MapSchedule``, ``IterableSchedule``)."""

    epoch: int | None
    batches: int

    @property
    def placement(self) -> tuple[int, int]: ...

    def set_epoch(self, epoch: int) -> None: ...

    def begin_epoch(self) -> None: ...

    def num_batches(self) -> int: ...

    def resume_batch(self) -> int | None: ...

    def state_dict(self, held: int = 0) -> dict[str, Any]: ...

    def load_state_dict(self, state_dict: dict[str, Any]) -> None: ...

    def handing(self) -> None: ...

    def take_back(self) -> bool: ...

    def loading(self) -> AbstractContextManager[None]: ...

    @property
    def restoring(self) -> bool: ...


_Method = TypeVar("_Method", bound=Callable[..., Any])
_SERIALIZED = ("close", "state_dict", "load_state_dict")
"""The loader methods whose whole call holds ``_serial`` (``DeliveryCore.__init_subclass__``)."""


def _serialized(method: _Method) -> _Method:
    """``method`` of a loader, run holding the loader's ``_serial`` lock: from another thread
    it waits for a ``next()`` or ``iter()`` in flight, so that it never sees (or changes) an
    epoch half begun or a batch half counted. Refused in one of the loader's own worker
    threads, which the lock's holder may be waiting for."""

    @functools.wraps(method)
    def serialized(self: DeliveryCore, *args: Any, **kwargs: Any) -> Any:
        thread = self._own_worker_thread()
        if thread is not None:
            raise RuntimeError(
                f"{type(self).__name__}.{method.__name__}() was called from the loader's own "
                f"worker thread {thread!r} (in the dataset or collate_fn, backend='thread'), "
                "where the thread iterating the loader may be waiting for this very fetch: "
                "call it from the thread that iterates (the training loop, a callback), or "
                "raise an exception in the dataset to end the epoch (the loader then stops its "
                "workers)")
        with self._serial():
            return method(self, *args, **kwargs)

    return cast(_Method, serialized)


class DeliveryCore:
    """The loader surface shared by every loader (see the module docstring).

    A subclass sets ``schedule``, ``seed`` and ``sampler`` (and ``_user_samplers``, when the
    user passed samplers) and implements ``_open_epoch``, ``_reopen`` and ``_describe``. Its
    own ``close``, ``state_dict`` and ``load_state_dict`` are wrapped as this class's are
    (``_serialized``): each whole call holds ``_serial``.
    """

    schedule: Schedule
    seed: int
    sampler: Any
    _user_samplers: SamplerEpochs | None = None  # whose own set_epoch asks for an epoch
    _iter_token = 0
    _generation = 0  # bumped by close(): iterators then go on from the cursor
    _prefetcher: weakref.ref[Any] | None = None
    _held: HeldNote | None = None  # what a prefetching fetcher holds (``note_held``)
    _lightning_iterates = False  # the last iter() came from Lightning's loop (every rank's)
    _handing: object | None = None  # the latest next() (``Delivery``), until another call
    compare_ranks: bool | None = None
    """Whether the ranks compare their epochs' plans: ``None`` in Lightning's loops only,
    ``True`` in any loop, ``False`` never (``_compares_ranks``)."""

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name in _SERIALIZED:
            if name in cls.__dict__:
                setattr(cls, name, _serialized(cls.__dict__[name]))

    def __iter__(self) -> Iterator[Any]:
        """A new iterator. Cheap: the epoch and the engine start at its first ``next()``.

        Under Lightning's prefetching fetcher: the fit loop's first fetch comes before it
        gives the epoch, which is then taken from it (``fit_epoch``), also for a restored
        state: one at its epoch's end stays exhausted in the epoch it resumes (``max_size``),
        one mid-epoch after the epoch's last step begins the next (``min_size``); and batches
        a fetcher still held at a new ``iter()`` were never trained on (it iterates again under
        ``reload_dataloaders_every_n_epochs``, or a restart sets the data up twice and drops
        it), so the new iterator goes on from before them (the cursor the state saves), not
        with the next epoch.

        Called while another thread is inside ``next()`` on this loader, it waits for that
        batch to be handed over (``_serial``)."""
        with self._serial():
            if batches_held(self._held):
                self.load_state_dict(self.state_dict())
            self._held = None
            prefetcher = find_prefetcher()
            self._iter_token += 1
            self._prefetcher = prefetcher
            self._lightning_iterates = lightning_fetches()
            if prefetcher is not None and (epoch := fit_epoch()) is not None:
                self.schedule.set_epoch(epoch)  # Lightning fetches a batch before it says so
            return Delivery(self, self._iter_token)

    def _serial(self) -> threading.RLock:
        """The lock under which one thread at a time replaces (``iter()``) or advances
        (``next()``) this loader's iterator: two iterators driving the engine at once would
        mix their requests and results. Made at first use; a copy makes its own, and so does
        a forked child (``ddp_fork``, ``os.fork()``), where a thread of the parent that held
        it does not exist."""
        pid = os.getpid()
        owned = self.__dict__.get("_lock")
        if owned is None:
            owned = self.__dict__.setdefault("_lock", (pid, threading.RLock()))
        if owned[0] != pid:  # forked: the child's only thread
            owned = self.__dict__["_lock"] = (pid, threading.RLock())
        return owned[1]

    def _begin_handing(self) -> None:
        """A batch is about to be handed over: the counts from now on are its own, which
        ``_take_back`` undoes (the schedule's ``handing``)."""
        self.schedule.handing()

    def _take_back(self) -> bool:
        """Undo what counting the batch of a ``next()`` that raised changed (the schedule's
        ``take_back``); whether it counted one."""
        return self.schedule.take_back()

    def _own_worker_thread(self) -> str | None:
        """The name of the calling thread when it is one of this loader's worker threads
        (``None`` otherwise): the thread iterating the loader may hold ``_serial`` while it
        waits for that thread's fetch."""
        return None

    def __getstate__(self) -> dict[str, Any]:
        """Pickled (and copied) without the lock of ``_serial``."""
        return {name: value for name, value in self.__dict__.items() if name != "_lock"}

    def __len__(self) -> int:
        """Batches per epoch on this rank (equal on every rank)."""
        return self.schedule.num_batches()

    def __repr__(self) -> str:
        schedule = self.schedule
        rank, world_size = schedule.placement
        epoch = "not started" if schedule.epoch is None else schedule.epoch
        fields = ", ".join(self._describe())
        return (f"{type(self).__name__}({fields}, rank={rank}/{world_size}, seed={self.seed}, "
                f"epoch={epoch}, batches={schedule.batches})")

    @property
    def epoch(self) -> int | None:
        """The epoch being delivered (``None`` before the first batch)."""
        return self.schedule.epoch

    def resume_batch(self) -> int | None:
        """The batch of its epoch at which a restored state (``load_state_dict``, not yet
        iterated) resumes on this rank and world size, counted as ``len()`` counts: ``len()``
        minus the batches it has left. ``None`` without a restored state pending, or when it
        cannot be known (unknown lengths, ``last_batch='rollover'``). Starts nothing.

        On another world size than the state's (an elastic resume) the rest of the epoch is
        dealt anew; a trainer's per-epoch batch count belongs here (``ExactResume`` sets
        Lightning's), so that it asks for exactly the batches left."""
        return self.schedule.resume_batch()

    def set_epoch(self, epoch: int) -> None:
        """Ask for ``epoch`` at the next epoch start; a restored cursor wins over an earlier
        or equal epoch, a later one abandons the cursor's unfinished epoch."""
        self.schedule.set_epoch(epoch)

    @_serialized
    def state_dict(self, unused: int = 0) -> dict[str, Any]:
        """The cursor as a small plain dict (``lightning_loaders.state``), with this loader's
        own parts; batches a prefetching trainer holds are not counted, so a resume delivers
        them again. Nor are, with ``unused``, that many batches the trainer took from its
        fetcher and has not used (the batch of a training step that a checkpoint written
        inside it interrupts: ``ExactResume``) and every batch delivered after them."""
        held = batches_after(self._held, unused)
        state = self.schedule.state_dict(held=held)
        state[PARTS] = {**state[PARTS], **self._parts(held)}
        return state

    @_serialized
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a cursor; the next ``iter()`` continues exactly after its last batch. A
        state that cannot be restored changes nothing."""
        parts = state_dict.get(PARTS) if isinstance(state_dict, Mapping) else None
        if isinstance(parts, Mapping):
            self._check_parts(parts)
        with self.schedule.loading():
            self.schedule.load_state_dict(state_dict)
            self._load_parts(state_dict[PARTS])
        self._held = None
        self._handing = None  # a next() that raises after this takes nothing back

    @_serialized
    def close(self) -> None:
        """Stop the engine now; an iterator used afterwards goes on from the cursor."""
        self._generation += 1

    def _close_after_error(self) -> None:
        """``close()`` as an error leaves the loop (a loader with workers does not wait for
        them, so that the error comes at once)."""
        self.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    @property
    def _iterator(self) -> None:
        """Lightning's loop teardown (end of ``fit``, exceptions, Ctrl-C, SIGTERM) stops a
        loader's workers by setting ``loader._iterator = None``: that closes this loader."""
        return None

    @_iterator.setter
    def _iterator(self, value: object) -> None:
        if value is None:
            self.close()

    def _begin(self) -> Iterator[Any]:
        """``_open_epoch``, after asking (as ``set_epoch``) for the epoch the user set on a
        sampler they passed, if they changed it: the ``DistributedSampler`` loop calls
        ``sampler.set_epoch(epoch)`` on its own sampler, not on ``loader.sampler``."""
        epoch = None if self._user_samplers is None else self._user_samplers.changed()
        if epoch is not None:
            self.set_epoch(epoch)
        return self._open_epoch()

    def _open_epoch(self) -> Iterator[Any]:
        """Decide which epoch and batch come next (``schedule.begin_epoch()``) and return the
        rest of that epoch, each batch counted as it is handed over."""
        raise NotImplementedError

    def _compares_ranks(self) -> bool:
        """Whether the epoch beginning now is compared across the ranks (one small collective,
        which every rank must run, on the thread of its loop). By default (``compare_ranks``
        ``None``) only in Lightning's loops, which run on every rank alike: a loop of the
        user's may run on one rank alone (rank-zero evaluation, ``prepare_data``), where the
        collective would wait forever, or in a thread beside DDP's own collectives, where it
        would pair with theirs. ``True``: the user says every rank iterates alike on its main
        thread (a Fabric or torchrun loop), so any loop compares; ``False``: none does."""
        return self._lightning_iterates if self.compare_ranks is None else self.compare_ranks

    def _begin_map_epoch(self, schedule: MapSchedule) -> None:
        """Begin ``schedule``'s next epoch, compared across the ranks where ``_compares_ranks``
        says (``begin_agreed_epoch``): each rank shards its own plan, so ranks whose plans
        differ would repeat and lose samples, or hang on different batch counts."""
        if self._compares_ranks():
            schedule.begin_agreed_epoch()
        else:
            schedule.begin_epoch()

    def _reopen(self) -> Iterator[Any]:
        """The rest of the current epoch from the delivered cursor (after an error or
        ``close()``), each batch counted as it is handed over."""
        raise NotImplementedError

    def _describe(self) -> list[str]:
        """This loader's own ``repr`` fields (dataset, batch size, ...)."""
        raise NotImplementedError

    def _parts(self, held: int) -> dict[str, Any]:
        """This loader's own components' states, by name, beside the schedule's (``held``:
        batches delivered but not yet used)."""
        return {}

    def _check_parts(self, parts: Mapping[str, Any]) -> None:
        """Refuse, before anything changes, parts that ``_load_parts`` could not restore."""

    def _load_parts(self, parts: Mapping[str, Any]) -> None:
        """Restore what ``_parts`` saved (the state has been checked already)."""


class Delivery:
    """A loader's iterator: opens the epoch at the first ``next()``, goes on from the cursor
    after an error or ``close()``, and refuses to run once a newer ``iter()`` replaced it.
    Each ``next()`` holds the loader's ``_serial`` lock.

    ``ends`` counts the ``next()`` calls that found the epoch over: a ``CombinedLoader`` in
    ``"max_size"`` mode asks an ended member again for every batch, so it says how many
    batches ago the member handed over its last."""

    def __init__(self, loader: DeliveryCore, token: int) -> None:
        self._loader = loader
        self._token = token
        self._batches: Iterator[Any] | None = None
        self._generation = -1
        self._started = False
        self._call: object | None = None  # the last next(), while the loader's latest
        self.ends = 0

    def __iter__(self) -> Delivery:
        return self

    def __del__(self) -> None:
        """Dropped before its epoch's end (a ``break``), the loader's current iterator takes
        workers that are not persistent with it, as ``DataLoader``'s iterator does; persistent
        ones wait for the next ``iter()``. Not while another thread holds the loader's lock:
        a collection may run in any thread, and that thread's ``iter()`` or ``next()`` now
        owns the workers."""
        loader = self._loader
        lock = loader._serial()
        if (not self._started or getattr(loader, "persistent_workers", True) is not False
                or not lock.acquire(blocking=False)):
            return
        try:
            if loader._iter_token == self._token:
                loader.close()
        finally:
            lock.release()

    def __next__(self) -> Any:
        """The next batch, counted. A ``next()`` that raises instead of returning it (a Ctrl-C
        lands between any two bytecodes, also after the count) takes the count back
        (``_taken_back``), so that the batch comes again."""
        loader = self._loader
        try:
            with loader._serial():
                loader._handing = self._call = object()  # this call, while the latest
                loader._begin_handing()
                return self._next_batch()
        except BaseException:
            self.take_back()
            raise

    def take_back(self) -> None:
        """The batch the last ``next()`` returned (or counted and raised) was not handed over:
        a wrapper's ``next()`` raised before returning it. Take its count back, unless
        another ``next()`` or a ``load_state_dict()`` came since."""
        loader = self._loader
        with loader._serial():
            if loader._handing is self._call:
                self._taken_back()

    def _next_batch(self) -> Any:
        loader = self._loader
        if loader._iter_token != self._token:
            raise RuntimeError("this iterator was replaced by a newer iter() on its loader")
        if self._batches is None or self._generation != loader._generation:
            self._batches = loader._reopen() if self._started else loader._begin()
            self._started = True
            self._generation = loader._generation
        try:
            batch = next(self._batches)
        except StopIteration:
            loader._begin_handing()  # batches counted with nothing to hand over stay so
            loader._held = note_held(loader._prefetcher, handed=False)
            self.ends += 1
            raise
        except BaseException:
            self._batches = None
            loader._close_after_error()
            raise
        # An engine restarted inside next() (after a worker crash) is current; a close()
        # between two calls is not, and reopens at the cursor.
        self._generation = loader._generation
        if loader._prefetcher is not None:
            loader._held = note_held(loader._prefetcher, handed=True)
        return batch

    def _taken_back(self) -> None:
        """After this ``next()`` raised: take back the count of the batch it did not hand
        over, if it counted one; the engine, already past that batch, is closed and reopens
        at the cursor."""
        loader = self._loader
        loader._handing = None
        if not loader._take_back():
            return
        if self._batches is not None:
            self._batches = None
            loader._close_after_error()
        if loader._prefetcher is not None:
            loader._held = note_held(loader._prefetcher, handed=False)


def counted(batches: Iterable[Any], schedule: Any) -> Iterator[Any]:
    """``batches``, each counted with ``schedule.delivered()`` as it is handed over."""
    for batch in batches:
        schedule.delivered()
        yield batch


class EpochSampler:
    """What Lightning sees as ``loader.sampler``: forwards ``set_epoch`` to ``target`` (a
    schedule, or a weak proxy of a loader whose schedule is built later).

    It never holds a loader strongly, so there is no reference cycle: a dropped loader (and its
    workers) goes at once, not at a later garbage collection that a forked worker could run on
    its copy.
    """

    def __init__(self, target: Any) -> None:
        self._target = target

    def set_epoch(self, epoch: int) -> None:
        self._target.set_epoch(epoch)


class SizedEpochSampler(EpochSampler):
    """An ``EpochSampler`` whose ``len()`` is the samples this rank reads per epoch."""

    def __len__(self) -> int:
        return int(self._target.samples_per_epoch())


class SequentialEpochSampler(SizedEpochSampler, SequentialSampler):
    """A ``SizedEpochSampler`` of an unshuffled order, which Lightning's ``overfit_batches``
    then takes as it is: it rebuilds a loader whose sampler is no ``SequentialSampler`` as a
    ``DataLoader`` with one, which it cannot do for ours (its ``__iter__`` is not used)."""
