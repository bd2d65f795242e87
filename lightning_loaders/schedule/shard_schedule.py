"""Main-process side of an iterable loader: the epochs, the cursor and its state, the requests
sent to the slots, and (unknown lengths under DDP) the ranks' agreement on batch counts.
"""

from __future__ import annotations

import operator
from collections import deque
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import torch.distributed as dist

from lightning_loaders.collectives import agree_range, gather_by_rank, group_size
from lightning_loaders.errors import StateMismatchError
from lightning_loaders.placement import resolve_rank_world
from lightning_loaders.schedule.epochs import EpochOwner, still_draining, warn_past_len
from lightning_loaders.schedule.map_plan import rollover_span
from lightning_loaders.schedule.partition_plan import advanced, deal, uses_partitions
from lightning_loaders.schedule.requests import (
    SKIP,
    Cursor,
    Delivered,
    PartRequest,
    SlotEnd,
    SlotRequest,
)
from lightning_loaders.schedule.shard_plan import (
    Layout,
    PlanConfig,
    delivered_counts,
    locate,
    plan_epoch,
)
from lightning_loaders.state import LoaderState

__all__ = ["IterableSchedule"]

KIND = "iterable"
SLOTS = "slots"  # the part: {"per_rank": slots per rank, "ended": ..., "positions": [rank][slot]}
_PER_RANK, _ENDED, _POSITIONS = "per_rank", "ended", "positions"
_ORIGIN = "origin"  # "rollover": rollover_span's [epoch, stream position] (absent while 0, 0)
# canonical partitions: their number, and [first item, first batch] of the epoch's last deal
_PARTITIONS, _BASE = "partitions", "base"
_SECOND = operator.itemgetter(1)


class IterableSchedule(EpochOwner):
    """The epoch being delivered on this rank, its cursor, and its saved form; epochs are
    owned as every schedule owns them (``EpochOwner``)."""

    def __init__(self, config: PlanConfig, slots: int, window: int, fingerprint: str,
                 rank: int | None, world_size: int | None,
                 partitions: int | None = None) -> None:
        self.config, self.slots, self.window = config, slots, window
        self.requested_partitions = partitions
        self.partitions: int | None = None  # fixed at the first epoch, or by a loaded state
        self.base = (0, 0, 0)  # (first item, first batch, skip) of the current epoch's deal
        self.origin = (0, 0)  # "rollover": the (epoch, stream position) batches are cut from
        self.first_request = 0  # the batch the current generation begins with
        self._fingerprint = fingerprint
        super().__init__(rank, world_size)
        self.ended = False
        self.layout: Layout | None = None
        self.generation = 0
        self.starts: tuple[Cursor, ...] = ()  # where the current generation began
        self.cursors: list[Cursor] = []  # delivered (unknown lengths)
        self.exhausted: set[int] = set()  # slots known to have no batch left (as received)
        self.received_batches = 0  # batches received from the workers in this epoch
        self._received_cursors: list[Cursor] = []  # (unknown lengths)
        self._start_batches = 0
        self._undo: deque[tuple[int, Cursor]] = deque(maxlen=8)
        self._head: tuple[int, int, int] | None = None  # epoch, slot, its plain stream's head
        # a plain stream of unknown length: (slot, stream position) of the furthest slot
        # cursor, and of the earliest where a slot's copy ended (see _check_tail)
        self._furthest: tuple[int, int] = (0, 0)
        self._shortest: tuple[int, int] | None = None
        self._open_tail = False  # a restored epoch that may have no batch left (see open_tail)

    @property
    def known(self) -> bool:
        return self.config.lengths is not None

    @property
    def canonical(self) -> bool:
        """Whether epochs are planned over canonical partitions (``partition_plan``)."""
        return uses_partitions(self.config)

    @property
    def synced(self) -> bool:
        """Whether ranks must agree on the epoch's end at run time (unknown lengths, DDP)."""
        return not self.known and self.placement[1] > 1

    def num_batches(self) -> int:
        """Batches per epoch on this rank (equal on every rank), when known in advance."""
        if not self.known:
            raise TypeError("len() is unknown: the dataset does not declare its shard lengths "
                            "(a ShardedSource's shard_lengths, or a plain dataset's __len__)")
        if self.config.last_batch == "rollover":
            raise TypeError("len() is undefined with last_batch='rollover': epochs differ in "
                            "length by one batch as leftovers roll over")
        if self.canonical:
            rank, world_size = self.sizing_placement
            return len(deal(self.config, 0, self._partition_count(), world_size)[rank])
        layout = plan_epoch(self.config, 0, self.sizing_placement[1], self.slots)
        assert layout.num_batches is not None
        return layout.num_batches

    def _partition_count(self) -> int:
        """The run's number of canonical partitions: saved, asked for, or (default) the
        number of slots of the first layout, world size x slots per rank."""
        if self.partitions is not None:
            return self.partitions
        return self.requested_partitions or self.placement[1] * self.slots

    # -- epochs -----------------------------------------------------------------------------

    def begin_epoch(self) -> None:
        """``EpochOwner.begin_epoch``; also notes a restored mid-epoch state of unknown length
        that continues its epoch (see ``open_tail``)."""
        pending = self._pending
        declared = pending is not None and self._declared_for is pending
        trainer = self._trainer_epoch
        if pending is not None and pending.abandoned:  # EpochOwner skips _resume for it
            world_size = resolve_rank_world(*self._explicit_placement)[1]
            self.origin = self._restored_origin(pending, world_size)
        super().begin_epoch()
        self._open_tail = (pending is not None and not self.known and not pending.abandoned
                           and pending.batches > 0 and (self.epoch, self.batches)
                           == (pending.epoch, pending.batches) and not self.ended
                           and not still_draining(trainer if declared else None, self._owner))

    def open_tail(self) -> bool:
        """Whether the epoch just finished was a restored state's rest that held no batch: a
        state saved after the epoch's last batch that could not know it was the last (with
        unknown lengths, ``"drop"`` leaves a short batch unread, so the slots had not hit their
        end). The uninterrupted run's next ``iter()`` would begin the next epoch: so does the
        caller, at once. Read once (it resets)."""
        tail, self._open_tail = self._open_tail, False
        return tail

    def _has_rest(self) -> bool:
        return not self.ended

    def _not_begun(self, state: LoaderState) -> bool:
        """At batch 0 and not ended: an epoch begun and known to have no batch is saved
        ended, so this one is not begun (or has its batches still to read)."""
        return not state.batches and not state.parts[SLOTS].get(_ENDED, False)

    def _start_epoch(self, epoch: int, rank: int, world_size: int) -> None:
        if self.canonical:
            self.partitions = self._partition_count()
            self.base = (0, 0, 0)
        layout = self._layout(epoch)
        self._begin(epoch, 0, _first_cursors(layout, rank), layout)

    def restart(self) -> None:
        """Begin a new generation at the delivered cursor (after an error)."""
        assert self.epoch is not None and self.layout is not None
        self._begin(self.epoch, self.batches, self._delivered_cursors(), self.layout)

    def restart_after_received(self) -> None:
        """Begin a new generation just after the last batch received (new workers after a
        crash: batches received but not yet delivered stay valid)."""
        assert self.layout is not None
        if self.canonical:
            starts = []
        elif self.known:
            starts = self._derived_cursors(self.layout, self.placement[0], self.received_batches)
        else:
            starts = list(self._received_cursors)
        self.generation += 1
        self.starts = tuple(starts)
        self.first_request = self.received_batches

    def requests(self, with_skips: bool) -> Iterator[SlotRequest | PartRequest]:
        """The current generation's batch requests, slot by slot round-robin."""
        assert self.epoch is not None and self.layout is not None
        rank, world_size = self.placement
        if self.canonical:
            assert self.partitions is not None
            batches = self._dealt()
            return (PartRequest(self.generation, self.epoch, rank, world_size, 0, t,
                                self.partitions, batches[t - self.base[1]])
                    for t in range(self.first_request, self.base[1] + len(batches)))
        sizes = self.layout.sizes[rank] if self.layout.sizes is not None else None
        return _requests(self.generation, self.epoch, rank, world_size, self.starts, sizes,
                         self.config.batch_size, self.exhausted, with_skips, self.origin)

    def received(self, item: Delivered | SlotEnd) -> None:
        """Note what a slot answered (before delivery, so that later requests and a restart
        of the workers know it)."""
        if isinstance(item, SlotEnd):
            if item.slot >= 0:
                self.exhausted.add(item.slot)
                if item.end is not None:
                    self._check_tail(item.slot, item.end, True)
            return
        self.received_batches += 1
        if item.head is not None:
            self._check_head(item.slot, item.head)
        if item.cursor is not None:
            self._received_cursors[item.slot] = item.cursor
            if item.cursor.exhausted:
                self.exhausted.add(item.slot)
            if self.config.strided:
                self._check_tail(item.slot, item.cursor.offset, item.cursor.exhausted)

    def delivered(self, item: Delivered | None = None, last: bool = False) -> None:
        """Count one batch handed to the caller (``last``: the ranks agreed it ends the epoch;
        ``item`` is needed with unknown lengths only, to move its slot's cursor)."""
        self._counting()
        self.batches += 1
        if self.known:
            assert self.layout is not None and self.layout.num_batches is not None
            self.ended = self.batches >= self.layout.num_batches
            return
        assert item is not None and item.cursor is not None
        self._open_tail = False
        self._undo.append((item.slot, self.cursors[item.slot]))
        self.cursors[item.slot] = item.cursor
        self.ended = last or all(cursor.exhausted for cursor in self.cursors)

    def _count_now(self) -> tuple[Any, ...]:
        return self.batches, self.ended, self._open_tail, tuple(self._undo)

    def _count_back(self, before: tuple[Any, ...]) -> None:
        if not self.known:  # one batch counted: its slot's cursor goes back
            slot, cursor = self._undo[-1]
            self.cursors[slot] = cursor
        self.batches, self.ended, self._open_tail, undo = before
        self._undo.clear()
        self._undo.extend(undo)

    def finish(self) -> None:
        """The epoch has no batch left on this rank."""
        self.ended = True

    def check_same_stream(self, begin: Callable[[], None], digest: Callable[[], int]) -> None:
        """Begin an epoch of a plain stream (``begin()``); on several ranks, then refuse a
        stream whose ``len()`` differs between ranks or that does not begin with the same
        samples on every rank (``digest()``: of its first samples).

        The loader calls it at every epoch start of Lightning's loops (the first ``next()`` of
        an iterator its data fetcher made, on the main thread), which every rank runs alike;
        whatever ``begin()`` raises on one rank (a plan it refuses, as a ``len()`` of its own
        can make it) waits until the ranks have compared, so the one small collective cannot
        hang. A loop of the user's is not compared (unless the loader's ``compare_ranks=True``
        says every rank runs it alike): it may run on one rank alone, or in a thread beside
        DDP's own collectives. The placement is the one ``begin()`` plans the
        epoch with, resolved afresh (the last epoch's may be from before DDP started); without
        a process group of its ranks (one process placed by hand) there is nothing to compare
        with."""
        world_size = resolve_rank_world(*self._explicit_placement)[1]
        if world_size == 1 or group_size() != world_size:
            begin()
            return
        length = sum(self.config.lengths) if self.config.lengths is not None else -1
        failure: Exception | None = None
        try:
            begin()
            mine = digest()
        except Exception as exc:
            failure, mine = exc, 0
        failed, lengths, digests = agree_range(int(failure is not None), length, mine)
        if lengths[0] != lengths[1]:
            raise ValueError(
                f"the plain dataset's len() differs between ranks (from {lengths[0]} to "
                f"{lengths[1]}; {length} here): the loader shards one stream over the ranks, "
                "planned from its len(), so data would be lost or repeated. A __len__ that "
                "returns this rank's share goes with an __iter__ that splits the stream by "
                "rank (reading torch.distributed): return the full length and yield the "
                "whole stream, or use a first-class source (lightning_loaders.sources: "
                "HFSource, WebDatasetSource, ParquetSource)") from failure
        if failure is not None:
            raise failure
        if failed[1]:
            raise RuntimeError(f"another rank failed to begin epoch {self.epoch} of the plain "
                               "dataset (before the ranks compared its stream): see its error")
        if digests[0] != digests[1]:
            raise ValueError(
                f"the plain dataset's stream differs between ranks in epoch {self.epoch} (its "
                "first samples do not match): the loader shards one stream over the ranks, so "
                "data would be lost or repeated. The dataset probably splits itself by rank "
                "(reading torch.distributed; its __len__, if any, then often returns the "
                "rank's share), or shuffles with a seed drawn in each process (e.g. "
                "random.Random() in __iter__). Pass the unsplit dataset with a fixed seed, or "
                "a first-class source (lightning_loaders.sources: HFSource, WebDatasetSource, "
                "ParquetSource)")

    def _check_head(self, slot: int, head: int) -> None:
        """Refuse a plain stream that begins otherwise in another slot: every slot reads the
        one stream and keeps its share, so slots reading different streams lose and repeat
        samples (a ``worker_init_fn`` that split the dataset per worker, torch's second
        example, or a stream drawn from per-process randomness)."""
        assert self.epoch is not None
        if self._head is None or self._head[0] != self.epoch:
            self._head = (self.epoch, slot, head)
            return
        first = self._head[1]
        if self._head[2] != head:
            raise ValueError(
                f"the plain dataset's stream begins with another sample in worker slot {slot} "
                f"than in slot {first} (epoch {self.epoch}): every worker reads the whole "
                "stream and keeps its share, so each must see the same one, or samples would "
                "be lost and repeated. A worker_init_fn that splits the dataset per worker "
                "(torch's second get_worker_info() example) does this, and so does a stream "
                "shuffled or augmented with a seed drawn in each process. Split the stream in "
                "__iter__ with get_worker_info() instead (the loader reads it whole and shares "
                "it out), leave per-worker set-up to what does not change the samples (an open "
                "file, a connection), draw augmentations from lightning_loaders.sample_rng(), "
                "or use a ShardedSource")

    def _check_tail(self, slot: int, position: int, ended: bool) -> None:
        """Refuse a plain stream of unknown length that ends earlier in one slot than another
        slot reads: slot ``s`` of ``k`` (ranks x slots) reads positions ``s, s + k, ...``, so
        a cursor at ``position`` has read ``position - k``, and one whose copy ended there
        had nothing at ``position``; reading one stream, every slot ends within ``k`` of the
        others. A slot's copy that ends early (a ``worker_init_fn`` that caps or filters it)
        would lose the other slots' samples past its end in silence. Two comparisons per
        batch received (the slots of this rank only: no collective)."""
        if position > self._furthest[1]:
            self._furthest = (slot, position)
        if ended and (self._shortest is None or position < self._shortest[1]):
            self._shortest = (slot, position)
        stride = self.placement[1] * self.slots
        if self._shortest is None or self._furthest[1] - stride < self._shortest[1]:
            return
        (short, end), (long, read) = self._shortest, (self._furthest[0],
                                                      self._furthest[1] - stride)
        rank = f" of rank {self.placement[0]}" if self.placement[1] > 1 else ""
        raise ValueError(
            f"the plain dataset's stream ends earlier in worker slot {short} than in slot "
            f"{long}{rank} (epoch {self.epoch}): slot {short}'s copy had no sample at stream "
            f"position {end}, while slot {long} read position {read}. Every worker reads the "
            "whole stream and keeps its share, so each must see the same one, or the other "
            f"slots' samples from position {end} on would be lost. A "
            "worker_init_fn that changes the stream per worker (caps, filters or splits it) "
            "does this, and so does a stream that depends on the process (its randomness, "
            "environment or files). Split the stream in __iter__ with get_worker_info() "
            "instead (the loader reads it whole and shares it out), leave per-worker set-up "
            "to what does not change the samples (an open file, a connection), or use a "
            "ShardedSource")

    def _dealt(self) -> tuple[tuple[tuple[int, int, int], ...], ...]:
        """This rank's batches of the current epoch's deal (canonical partitions)."""
        assert self.epoch is not None and self.partitions is not None
        rank, world_size = self.placement
        first, _, skip = self.base
        return deal(self.config, self.epoch, self.partitions, world_size, first, skip)[rank]

    def _layout(self, epoch: int) -> Layout:
        if self.canonical:
            self.epoch = epoch
            return Layout(((),) * self.placement[1], None, self.base[1] + len(self._dealt()))
        layout = plan_epoch(self.config, epoch, self.placement[1], self.slots, self.origin)
        if self.synced and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"a dataset of unknown length on {self.placement[1]} ranks needs an initialised "
                "torch.distributed process group: the ranks agree at run time on when the epoch "
                "ends. Initialise it (Lightning's DDP does), or declare the shard lengths")
        return layout

    def _begin(self, epoch: int, batches: int, cursors: list[Cursor], layout: Layout) -> None:
        self.epoch, self.batches, self.layout = epoch, batches, layout
        self.cursors, self.starts = list(cursors), tuple(cursors)
        self.first_request = batches
        self.exhausted = {w for w, cursor in enumerate(cursors) if cursor.exhausted}
        self.generation += 1
        self.received_batches = self._start_batches = batches
        self._received_cursors = list(cursors)
        self._furthest = max(enumerate(c.offset for c in cursors), key=_SECOND, default=(0, 0))
        self._shortest = min(((w, c.offset) for w, c in enumerate(cursors) if c.exhausted),
                             key=_SECOND, default=None)
        self._undo.clear()
        self.ended = (layout.num_batches is not None and batches >= layout.num_batches) or (
            layout.num_batches is None and all(cursor.exhausted for cursor in cursors))

    def _resume(self, state: LoaderState, rank: int, world_size: int) -> None:
        slots = state.parts[SLOTS]
        workers, ended = slots[_PER_RANK], bool(slots.get(_ENDED, False))
        self._owner = state.trainer_epoch
        origin = self._restored_origin(state, world_size)
        if self.canonical:
            self._resume_partitions(slots, state.epoch, state.world_size, state.batches)
        if ended:
            self.epoch, self.batches, self.ended = state.epoch, state.batches, True
            self.origin = origin
            return
        if (state.batches and not self.canonical
                and (state.world_size, workers) != (world_size, self.slots)):
            raise StateMismatchError(
                f"cannot resume mid-epoch (epoch {state.epoch}, after batch {state.batches}) "
                f"with another world size or number of worker slots: saved world_size="
                f"{state.world_size}, slots per rank={workers}; now world_size={world_size}, "
                f"slots per rank={self.slots} (num_workers, or 1 for num_workers=0). Each "
                "(rank, worker) reads its own part of the shards, so the rest of the epoch would "
                "repeat or skip data. Resume with the saved configuration, or from a checkpoint "
                "taken at an epoch end. " + (
                    "A plain IterableDataset is read whole by every slot (the strided fallback), "
                    "with or without len(): wrap its data in a ShardedSource with known "
                    "shard_lengths to plan over canonical partitions, which resume under any "
                    "layout" if self.config.strided else
                    "Only known shard lengths without last_batch='rollover' plan over canonical "
                    "partitions, which resume under any layout"))
        self.origin = origin
        layout = self._layout(state.epoch)
        if not state.batches or self.canonical:
            cursors = _first_cursors(layout, rank)
        elif self.known:
            cursors = self._derived_cursors(layout, rank, state.batches)
        else:
            cursors = _saved_cursors(slots, rank)
        self._begin(state.epoch, state.batches, cursors, layout)
        if (self.canonical and state.world_size != world_size and self._recounted is not state
                and layout.num_batches is not None and self.config.last_batch != "rollover"):
            warn_past_len(state.world_size, world_size, state.batches,
                          layout.num_batches - state.batches, self.num_batches())

    def _resume_partitions(self, slots: Mapping[str, Any], epoch: int, saved_world: int,
                           batches: int) -> None:
        """Take the saved partition count and rebase the deal at the cursor's item, so the
        rest of the epoch is dealt to the current layout."""
        self.partitions, self.base = self._rebased(slots, epoch, saved_world, batches)

    def _rebased(self, slots: Mapping[str, Any], epoch: int, saved_world: int, batches: int
                 ) -> tuple[int, tuple[int, int, int]]:
        """The saved partition count and the deal's ``(first item, first batch, skip)`` that
        continue a canonical state after ``batches`` on ``saved_world`` ranks: past the
        samples the saved deal's rounds since its base delivered (whole items, but for the
        rounds ``"keep"`` cuts anew at an epoch's end)."""
        saved = slots.get(_PARTITIONS)
        if saved is None:
            if batches:
                raise StateMismatchError(
                    "this mid-epoch state was saved by a version that planned per (rank, "
                    "worker) slot, not over canonical partitions; resume it with that version, "
                    "or from a checkpoint taken at an epoch end")
            saved = self._partition_count()
        if not isinstance(saved, int) or saved < 1:
            raise StateMismatchError(f"corrupted loader state: parts[{SLOTS!r}][{_PARTITIONS!r}]"
                                     f" must be an int >= 1, got {saved!r}")
        if self.requested_partitions not in (None, saved):
            raise StateMismatchError(
                f"partitions={self.requested_partitions} differs from the {saved} canonical "
                "partitions the state was saved with: the epoch order depends on them. Pass "
                f"partitions={saved} (or leave it unset to take the saved number)")
        if not batches:
            return saved, (0, 0, 0)
        first, batch, skip = _base(slots)
        try:
            dealt = deal(self.config, epoch, saved, saved_world, first, skip)
        except ValueError as exc:  # a state this data could not have written
            raise StateMismatchError(
                f"corrupted loader state: batches={batches} on world_size={saved_world} cannot "
                f"have been saved from this data ({exc})") from exc
        samples = sum(segment[2] for batches_of_rank in dealt
                      for segment_batch in batches_of_rank[:batches - batch]
                      for segment in segment_batch)
        first, skip = advanced(self.config, epoch, saved, first, skip, samples)
        return saved, (first, batches, skip)

    def _rest_of(self, state: LoaderState, rank: int, world_size: int) -> int | None:
        slots = state.parts[SLOTS]
        if slots.get(_ENDED, False):
            return 0
        if self.canonical:
            partitions, (first, _, skip) = self._rebased(slots, state.epoch, state.world_size,
                                                         state.batches)
            return len(deal(self.config, state.epoch, partitions, world_size, first, skip)[rank])
        if not self.known or (state.batches and state.world_size != world_size):
            return None
        layout = plan_epoch(self.config, state.epoch, world_size, self.slots,
                            self._restored_origin(state, world_size))
        assert layout.num_batches is not None
        return layout.num_batches - state.batches

    def _restored_origin(self, state: LoaderState, world_size: int) -> tuple[int, int]:
        """``rollover_span``'s origin for a restored state on ``world_size``: the saved one on
        the saved world size; on another, the saved run's stream position at the state's
        epoch start (a state at batch 0) or end, so that the leftovers that run carried over
        open the next epoch whole, cut into this world size's global batches (the cuts
        depend on the world size; mid-epoch, ``_resume`` refuses the state)."""
        first, position = state.parts[SLOTS].get(_ORIGIN, (0, 0))
        if self.config.last_batch != "rollover" or state.world_size == world_size:
            return first, position
        assert self.config.lengths is not None
        ended = state.abandoned or bool(state.parts[SLOTS].get(_ENDED, False))
        if ended and first > state.epoch:  # the saved origin is where the epoch ended
            return first, position
        start, stop = rollover_span(state.epoch, sum(self.config.lengths),
                                    state.world_size * self.config.batch_size, (first, position))
        return (state.epoch + 1, stop) if ended else (state.epoch, start)

    def saved_batches(self, state: LoaderState, rank: int) -> int:
        """Canonical partitions: batches of ``rank`` in the epoch a saved state is in (the
        saved layout's; ``StateMismatchError`` if the state cannot say)."""
        slots = state.parts.get(SLOTS)
        if not isinstance(slots, Mapping):
            raise StateMismatchError(f"corrupted loader state: parts[{SLOTS!r}] is {slots!r}")
        partitions, _ = self._rebased(slots, state.epoch, state.world_size, state.batches)
        try:
            first, batch, skip = _base(slots)
            dealt = deal(self.config, state.epoch, partitions, state.world_size, first, skip)
            return batch + len(dealt[rank])
        except (KeyError, TypeError, ValueError, IndexError) as exc:
            raise StateMismatchError(f"corrupted loader state: {exc!r}") from exc

    def _derived_cursors(self, layout: Layout, rank: int, batches: int) -> list[Cursor]:
        """Known lengths: every slot's position after ``batches`` delivered batches."""
        assert layout.sizes is not None and layout.num_batches is not None
        sizes = layout.sizes[rank]
        counts = delivered_counts([len(s) for s in sizes], batches)
        cursors = []
        for w, (count, pieces) in enumerate(zip(counts, layout.pieces[rank], strict=True)):
            emitted = sum(sizes[w][:count])
            window_emitted = emitted - emitted % self.window
            piece, offset = locate(pieces, window_emitted)
            cursors.append(Cursor(count, emitted, window_emitted, piece, offset, None,
                                  count >= len(sizes[w])))
        return cursors

    def _delivered_cursors(self) -> list[Cursor]:
        if self.canonical:
            return []
        if self.known:
            assert self.layout is not None
            return self._derived_cursors(self.layout, self.placement[0], self.batches)
        return list(self.cursors)

    # -- state ------------------------------------------------------------------------------

    def fingerprint(self) -> dict[str, Any]:
        config = self.config
        return {"source": self._fingerprint, "strided": config.strided, "seed": config.seed,
                "batch_size": config.batch_size, "last_batch": config.last_batch,
                "shuffle": config.shuffle,
                "shuffle_buffer": self.window if self.window > 1 else 0}

    def state_dict(self, held: int = 0) -> dict[str, Any]:
        """The cursor; ``held``: batches delivered but not yet used by the consumer.

        With unknown lengths it holds every rank's slot positions, gathered from all ranks
        (a collective: every rank must call it, as Lightning does when it checkpoints).
        """
        if self._pending is not None:
            return self._pending.to_dict()
        rank, world_size = self.placement
        slots: dict[str, Any] = {_PER_RANK: self.slots, _ENDED: False}
        if self.origin != (0, 0):
            slots[_ORIGIN] = list(self.origin)
        if self.canonical and self.partitions is not None:
            slots[_PARTITIONS] = self.partitions
            if self.base != (0, 0, 0):
                slots[_BASE] = list(self.base if self.base[2] else self.base[:2])
        if self.epoch is None:
            return LoaderState(KIND, self._trainer_epoch or 0, 0, world_size,
                               trainer_epoch=self._trainer_epoch,
                               fingerprint=self.fingerprint(), parts={SLOTS: slots}).to_dict()
        held = min(held, self.batches - self._start_batches if self.known else len(self._undo))
        slots[_ENDED] = self.ended and held == 0
        if not self.known:
            cursors = list(self.cursors)
            for slot, previous in list(self._undo)[len(self._undo) - held:][::-1]:
                cursors[slot] = previous
            slots[_POSITIONS] = gather_by_rank([list(c) for c in cursors], rank, world_size)
        return LoaderState(KIND, self.epoch, self.batches - held, world_size,
                           trainer_epoch=self._owner, fingerprint=self.fingerprint(),
                           parts={SLOTS: slots}).to_dict()

    def saved_state(self, state_dict: Mapping[str, Any]) -> LoaderState:
        """``state_dict`` parsed; a ``StateMismatchError`` unless it is this loader's kind,
        dataset and configuration (checked before anything else reads it, so that a mismatch
        is named as one)."""
        return LoaderState.from_dict(state_dict, KIND, self.fingerprint())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a cursor; the next ``begin_epoch`` continues exactly after its last batch."""
        state = self.saved_state(state_dict)
        slots = state.parts.get(SLOTS)
        if not isinstance(slots, Mapping):
            raise StateMismatchError(f"corrupted loader state: parts[{SLOTS!r}] is missing or "
                                     f"not a dict: {slots!r}")
        per_rank = slots.get(_PER_RANK)
        if not isinstance(per_rank, int) or per_rank < 1:
            raise StateMismatchError(f"corrupted loader state: parts[{SLOTS!r}] must hold "
                                     f"{_PER_RANK!r}, an int >= 1; got {slots!r}")
        ended = slots.get(_ENDED, False)
        if not isinstance(ended, bool):
            raise StateMismatchError(f"corrupted loader state: parts[{SLOTS!r}][{_ENDED!r}]="
                                     f"{ended!r} is not a bool")
        if not self.known and state.batches:
            if _POSITIONS not in slots:
                raise StateMismatchError(
                    "corrupted loader state: a mid-epoch state of a dataset of unknown length "
                    f"needs parts[{SLOTS!r}][{_POSITIONS!r}] (the slots' positions)")
            _check_positions(slots[_POSITIONS], state.world_size, per_rank)
        origin = slots.get(_ORIGIN, (0, 0))
        total = sum(self.config.lengths or ())
        if not (isinstance(origin, list | tuple) and len(origin) == 2
                and all(type(value) is int for value in origin)
                and 0 <= origin[0] <= state.epoch + 1 and 0 <= origin[1] <= origin[0] * total):
            raise StateMismatchError(
                f"corrupted loader state: parts[{SLOTS!r}][{_ORIGIN!r}] must be [epoch, stream "
                f"position] with epoch <= {state.epoch + 1} (the state's epoch + 1) and "
                f"position <= epoch x {total} samples; got {origin!r}")
        if self.canonical and _base(slots)[1] > state.batches:
            raise StateMismatchError(
                f"corrupted loader state: parts[{SLOTS!r}][{_BASE!r}]={slots[_BASE]!r} begins "
                f"its deal at batch {slots[_BASE][1]}, after the cursor's batches="
                f"{state.batches}")
        self._check_cursor(state, per_rank)
        self._pending = state

    def _check_cursor(self, state: LoaderState, per_rank: int) -> None:
        """Known lengths: refuse a cursor past the end of its epoch on the layout it was saved
        under (a corrupted or edited state), as map-style loaders do; it would begin the next
        epoch instead."""
        if not self.known or not state.batches:
            return
        if self.canonical:
            batches = self.saved_batches(state, 0)  # equal on every rank
        else:
            origin = state.parts[SLOTS].get(_ORIGIN, (0, 0))
            try:
                layout = plan_epoch(self.config, state.epoch, state.world_size, per_rank,
                                    (origin[0], origin[1]))
            except ValueError as exc:
                raise StateMismatchError(
                    f"corrupted loader state: epoch {state.epoch} on world size "
                    f"{state.world_size} has no plan ({exc})") from exc
            assert layout.num_batches is not None
            batches = layout.num_batches
        if state.batches > batches:
            raise StateMismatchError(
                f"corrupted loader state: batches={state.batches} is past the end of epoch "
                f"{state.epoch}, which has {batches} batches on world size {state.world_size}")


def _base(slots: Mapping[str, Any]) -> tuple[int, int, int]:
    """A saved deal's ``(first item, first batch, skip)`` (``skip`` is absent where 0); a
    ``StateMismatchError`` unless it is 2 or 3 ints >= 0."""
    base = slots.get(_BASE, (0, 0))
    if not (isinstance(base, list | tuple) and len(base) in (2, 3)
            and all(type(value) is int and value >= 0 for value in base)):
        raise StateMismatchError(
            f"corrupted loader state: parts[{SLOTS!r}][{_BASE!r}] must be [first item, first "
            f"batch] or [first item, first batch, skip], ints >= 0; got {base!r}")
    first, batch, *rest = base
    return first, batch, rest[0] if rest else 0


def _first_cursors(layout: Layout, rank: int) -> list[Cursor]:
    """Every slot of ``rank`` at the start of its stream (exhausted when it has no batch)."""
    return [Cursor(0, 0, 0, 0, pieces[0].start if pieces else 0, None,
                   not pieces or (layout.sizes is not None and not layout.sizes[rank][slot]))
            for slot, pieces in enumerate(layout.pieces[rank])]


def _requests(generation: int, epoch: int, rank: int, world_size: int,
              starts: tuple[Cursor, ...], sizes: tuple[tuple[int, ...], ...] | None,
              batch_size: int, exhausted: set[int], with_skips: bool,
              origin: tuple[int, int]) -> Iterator[SlotRequest]:
    """Requests round-robin over slots: slot ``w``'s ``k``-th batch comes in round ``k``.

    With workers, every round asks every slot (finished ones with a skip request), so request
    ``i`` of a generation goes to worker ``i % num_workers``, which keeps that slot's reader
    (torch deals requests to its workers in turn). ``exhausted`` is read live: slots that end
    stop being asked once the main process has heard so.
    """
    slots = len(starts)
    next_batch = [cursor.batches for cursor in starts]

    def done(w: int) -> bool:
        return next_batch[w] >= len(sizes[w]) if sizes is not None else w in exhausted

    while True:
        live = [w for w in range(slots) if not done(w)]
        if not live:
            return
        round_ = min(next_batch[w] for w in live)
        for w in range(slots):
            if next_batch[w] == round_ and not done(w):
                size = sizes[w][round_] if sizes is not None else batch_size
                yield SlotRequest(generation, epoch, rank, world_size, w, round_, size,
                                  starts[w], origin)
                next_batch[w] += 1
            elif with_skips:
                yield SKIP


def _check_positions(rows: Any, world_size: int, slots: int) -> None:
    """Refuse saved slot positions (checked at load) that are not one row per rank, each
    ``None`` (a rank not gathered) or a ``Cursor`` per slot: counts ``>= 0``, the shard
    iterator's state (a dict) or ``None``, and whether the slot is exhausted."""
    if not isinstance(rows, list) or len(rows) != world_size:
        raise StateMismatchError(
            f"corrupted loader state: parts[{SLOTS!r}][{_POSITIONS!r}] must hold a row per "
            f"rank ({world_size}); got {rows!r}")
    for rank, row in enumerate(rows):
        if row is not None and not (isinstance(row, list) and len(row) == slots
                                    and all(map(_is_cursor, row))):
            raise StateMismatchError(
                f"corrupted loader state: rank {rank}'s slot positions {row!r} are not "
                f"{slots} (its slots per rank) [batches, samples, window start, piece, offset, "
                "reader state or None, exhausted], counts >= 0")


def _is_cursor(entry: Any) -> bool:
    """Whether ``entry`` is a saved ``Cursor``."""
    return (isinstance(entry, list | tuple) and len(entry) == len(Cursor._fields)
            and all(type(value) is int and value >= 0 for value in entry[:5])
            and (entry[5] is None or isinstance(entry[5], Mapping))
            and isinstance(entry[6], bool))


def _saved_cursors(saved: Mapping[str, Any], rank: int) -> list[Cursor]:
    """Rank ``rank``'s saved slot positions (checked at load: ``_check_positions``)."""
    row = saved[_POSITIONS][rank]
    if row is None:
        raise StateMismatchError(
            f"the loader state has no positions for rank {rank}: it was saved without an "
            "initialised process group, so it holds only the saving rank's. Save it with "
            "torch.distributed initialised (every rank calling state_dict()), or restore each "
            "rank from its own state")
    return [Cursor(*entry) for entry in row]

