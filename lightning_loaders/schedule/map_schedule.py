"""``MapSchedule``: the plan of every epoch plus the cursor, for loaders over indexable data.

It answers "which dataset indices does this rank read in each remaining batch of the current
epoch", owns the epoch against the trainer's ``set_epoch`` calls, counts delivered batches and
saves/restores itself as a ``LoaderState``. ``ResumableLoader`` and the DALI/FFCV adapters
differ only in the engine that turns its requests into batches.

An epoch is planned as positions cut into batches of ``batch_size`` (``EpochPlan``), or, for a
batch sampler's epoch whose batches differ in size, as those batches dealt whole
(``BoundaryPlan``); either way the cursor and the state are the same few integers.
"""

from __future__ import annotations

import logging
import os
from collections.abc import Callable, Iterator, Mapping
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

import numpy as np
import torch

from lightning_loaders.collectives import agree_range, all_gather, group_size
from lightning_loaders.errors import StateMismatchError
from lightning_loaders.hashing import checked_seed, digest, mix64
from lightning_loaders.orders.base import BatchedOrder, EpochSizedOrder, SampleOrder
from lightning_loaders.placement import resolve_rank_world
from lightning_loaders.schedule.audit import (
    AUDIT,
    audit_part,
    batch_digest,
    check_audit,
    reaudited,
)
from lightning_loaders.schedule.boundary_plan import BoundaryPlan
from lightning_loaders.schedule.epochs import (
    EpochOwner,
    following_epoch,
    trainer_moved_on,
    warn_past_len,
)
from lightning_loaders.schedule.map_plan import (
    LAST_BATCH_POLICIES,
    EpochPlan,
    LastBatch,
    rollover_span,
)
from lightning_loaders.schedule.requests import BatchRequest
from lightning_loaders.state import CONTENT, LoaderState, is_stateful

__all__ = [
    "MapSchedule",
    "Plan",
    "resolve_last_batch",
    "resolve_seed",
]

Plan = EpochPlan | BoundaryPlan
"""An epoch's plan: positions cut into equal batches, or a batch sampler's batches dealt whole."""

KIND = "map"
ORDER_STATE = "order"  # the part holding the order's own state (a drawn sampler's, weights)
_BLOCK_SAMPLES = 8192  # positions planned per order.indices call (~64 KiB of int64 per array)
_COMPARED_POSITIONS = 256  # the epoch's first positions whose indices the ranks compare
_SHOWN = 4  # of which an error shows each rank's first ones
_SPLIT_BY_RANK = (
    "A sampler that splits the dataset by rank itself does this (one with rank and "
    "num_replicas, data_parallel_rank and data_parallel_size, a SubsetRandomSampler over this "
    "rank's indices), and so does a dataset whose len() is this rank's share. Pass the sampler "
    "over the whole dataset, alike on every rank: the loader gives each rank its share. A "
    "sampler that must split by rank itself belongs in a plain DataLoader, which resumes from "
    "its epoch's start. Under Lightning, Trainer(use_distributed_sampler=False) leaves one "
    "passed to fit() or returned by a LightningModule's or LightningDataModule's hook as it is "
    "(ExactResume too); a ResumableDataModule converts its hooks' DataLoaders whatever that "
    "setting says: override its convert(loader, stage) to return that one as it is, or return "
    "it from a LightningDataModule")

_log = logging.getLogger(__name__)


class MapSchedule(EpochOwner):
    """Plan and cursor of a loader over ``order`` in batches of ``batch_size`` per rank.

    The cursor is ``(epoch, batches delivered in it)``; ``begin_epoch`` (at the first
    ``next()`` of a new iterator) decides what comes next, as every schedule does
    (``EpochOwner``).
    """

    def __init__(self, order: SampleOrder, batch_size: int, last_batch: LastBatch, seed: int,
                 rank: int | None = None, world_size: int | None = None,
                 merge_short_tail: bool = False, content: str | None = None) -> None:
        self.order = order
        self.content = content  # the data's identity, when it has one (``content_identity``)
        self.merge_short_tail = merge_short_tail
        self.dataset_len = len(order)
        self.batch_size = batch_size
        self.last_batch = last_batch
        self.seed = seed
        super().__init__(rank, world_size)
        self._offset_batches = 0
        self.plan: Plan | None = None
        self._audited: tuple[tuple[int, ...], str] | None = None  # the last digest, cached

    # -- size -------------------------------------------------------------------------------

    def num_batches(self, upcoming: int | None = None) -> int:
        """Batches per epoch on this rank (equal on every rank), in the epoch in view
        (``epoch_in_view``: epochs of a batch sampler may differ in length; others do not)."""
        if self.last_batch == "rollover":
            raise TypeError("len() is undefined with last_batch='rollover': epochs differ in "
                            "length by one batch as leftovers roll over")
        return self.plan_for(self.epoch_in_view(upcoming), self.sizing_placement[1]).num_batches

    def samples_per_epoch(self) -> int:
        """Samples this rank reads in the epoch in view."""
        rank, world_size = self.sizing_placement
        plan = self.plan_for(self.epoch_in_view(), world_size)
        return sum(len(plan.positions(b, rank)) for b in range(plan.num_batches))

    def epoch_in_view(self, upcoming: int | None = None) -> int:
        """The epoch ``len()`` describes: the one a restored state is read in; the epoch being
        read while it has batches left and the trainer has not moved past it; else the one
        the next epoch start begins. ``upcoming``: the epoch a trainer is about to declare,
        when it reads ``len()`` before calling ``set_epoch`` (Lightning's fit loop does)."""
        trainer = self._trainer_epoch if upcoming is None else upcoming
        restored = self.restored_epoch(trainer, upcoming is not None
                                       or self._declared_for is self._pending)
        if restored is not None:
            return restored
        if (self.plan is not None and self.epoch is not None and self.remaining > 0
                and not trainer_moved_on(trainer, self._owner, self.epoch)):
            return self.epoch
        return following_epoch(self.epoch, trainer, self._owner)

    def plan_for(self, epoch: int, world_size: int, offset_position: int = 0) -> Plan:
        bounds = self._batch_bounds(epoch)
        if self.last_batch == "rollover":
            if bounds is not None:
                raise ValueError(
                    f"last_batch='rollover' needs batches of one size, but the batch "
                    f"sampler's batches differ in size in epoch {epoch}: use last_batch="
                    "'keep', 'drop' or 'pad'")
            start, stop = rollover_span(epoch, self.dataset_len, self.batch_size * world_size)
            self._check_rollover_lengths(start, stop)
            return EpochPlan(start, stop, self.batch_size, world_size, "drop")
        if bounds is not None:
            return self._boundary_plan(epoch, bounds, world_size, offset_position)
        length = self.epoch_len(epoch)
        plan = EpochPlan(offset_position, length, self.batch_size, world_size,
                         self.last_batch, merge_short_tail=self.merge_short_tail)
        if offset_position == 0 and length == 0:
            raise ValueError("the order has no sample in epoch "
                             f"{epoch}: its sampler yields no index (len() is 0); a loader "
                             "needs at least one sample")
        if offset_position == 0 and plan.num_batches == 0:
            raise ValueError(
                f"last_batch='drop' leaves no batch: {length} samples are fewer than "
                f"one global batch of {world_size} ranks x batch_size {self.batch_size}; use a "
                "smaller batch_size, fewer ranks, or last_batch='pad' (or 'keep' with at least "
                "one sample per rank)"
            )
        return plan

    def epoch_len(self, epoch: int) -> int:
        """Positions of ``epoch``: ``dataset_len``, unless the order's epochs differ in length
        (``EpochSizedOrder``: a sampler whose ``len()`` follows its ``set_epoch``)."""
        order = self.order
        return order.epoch_len(epoch) if isinstance(order, EpochSizedOrder) else self.dataset_len

    def begin_agreed_epoch(self) -> None:
        """``begin_epoch``; on several ranks, then refuse a plan that differs between them:
        another seed, order length (the sampler's ``len()``, else the dataset's), number of
        batches, or order (the indices of the epoch's first positions). Each rank shards its
        own plan, so ranks with different plans repeat and lose samples silently, and ranks
        with different batch counts hang.

        The loader calls it at every epoch start of Lightning's loops (the first ``next()`` of
        an iterator its data fetcher made, on the main thread), which every rank runs alike;
        whatever ``begin_epoch`` raises on one rank waits until the ranks have compared, so the
        one small collective cannot hang. A loop of the user's is not compared (unless the
        loader's ``compare_ranks=True`` says every rank runs it alike): it may run on one rank
        alone, or in a thread beside DDP's own collectives. Without a process group
        of the loader's ranks (one process placed by hand) there is nothing to compare with."""
        world_size = resolve_rank_world(*self._explicit_placement)[1]
        if world_size == 1 or group_size() != world_size:
            self.begin_epoch()
            return
        failure: Exception | None = None
        try:
            self.begin_epoch()
            planned = self._planned()
        except Exception as exc:
            failure, planned = exc, (0, 0)
        failed, seeds, lengths, batches, orders = agree_range(
            int(failure is not None), mix64(self.seed) >> 2, self.dataset_len, *planned)
        if seeds[0] != seeds[1] or lengths[0] != lengths[1]:
            raise _differing(seeds[0] != seeds[1], all_gather((self.seed, self.dataset_len))
                             ) from failure
        if failure is not None:
            raise failure
        if failed[1]:
            raise RuntimeError(f"another rank failed to begin epoch {self.epoch} (before the "
                               "ranks compared their plans): see its error")
        epoch, plan = self.epoch, self.plan
        assert epoch is not None and plan is not None
        if batches[0] != batches[1]:
            raise ValueError(
                f"the number of batches of epoch {epoch} differs between ranks "
                f"({_by_rank(all_gather(plan.num_batches))}): a rank would wait for the others "
                "forever. Give every rank the same batch_size and last-batch policy, and a "
                "sampler whose len() is the same on every rank")
        if orders[0] != orders[1]:
            shown = np.arange(min(_SHOWN, self.epoch_len(epoch)))
            heads = all_gather(self.order.indices(epoch, shown).tolist())
            raise ValueError(
                f"the order differs between ranks in epoch {epoch} (its first indices: "
                f"{_by_rank(heads)}): the loader plans one order over all ranks and gives each "
                "rank its share of it, so the sampler must give the same order on every rank. "
                + _SPLIT_BY_RANK + ". A sampler drawing from randomness seeded by the rank, or "
                "not seeded (a generator of its own), does it too: seed it alike on every "
                "rank, or draw from its `generator` or the global RNGs, which the loader seeds")

    def _planned(self) -> tuple[int, int]:
        """``(batches, digest)`` of the epoch begun: its batches per rank, and a 62-bit digest
        of the dataset indices at its first positions."""
        assert self.plan is not None and self.epoch is not None
        positions = np.arange(min(_COMPARED_POSITIONS, self.epoch_len(self.epoch)))
        indices = np.asarray(self.order.indices(self.epoch, positions), dtype=np.int64)
        return self.plan.num_batches, int(digest(indices), 16) >> 2

    def _check_rollover_lengths(self, start: int, stop: int) -> None:
        """Refuse rollover stream positions ``[start, stop)`` over an epoch whose length is not
        ``dataset_len``: the stream lays epochs of that one length end to end."""
        n = self.dataset_len
        for epoch in range(start // n, max(stop - 1, start) // n + 1):
            length = self.epoch_len(epoch)
            if length != n:
                raise ValueError(
                    f"last_batch='rollover' needs epochs of one length, but the sampler's len() "
                    f"is {length} in epoch {epoch} and was {n} when the loader was built: use "
                    "last_batch='keep', 'drop' or 'pad'")

    def _batch_bounds(self, epoch: int) -> np.ndarray | None:
        """The boundaries of ``epoch``'s batches when the order is a batch sampler's whose
        batches differ in size in that epoch (``None``: positions cut into equal batches)."""
        order = self.order
        if not isinstance(order, BatchedOrder):
            return None
        bounds = order.batch_bounds(epoch)
        if bounds is not None and order.batch_size != self.batch_size:
            raise ValueError(
                f"batch_size={self.batch_size} would cut anew the batch sampler's batches, "
                f"which differ in size in epoch {epoch}: leave batch_size out (its batches "
                "are read as it makes them)")
        return bounds

    def _boundary_plan(self, epoch: int, bounds: np.ndarray, world_size: int,
                       offset_position: int) -> BoundaryPlan:
        """The plan of a batch sampler's batches of different sizes, checked as ``EpochPlan``s
        are: a whole epoch must give every rank a batch."""
        assert self.last_batch != "rollover"
        plan = BoundaryPlan.from_position(bounds, offset_position, world_size, self.last_batch)
        if offset_position == 0 and plan.num_batches == 0:
            raise ValueError(
                f"last_batch='drop' leaves no batch: epoch {epoch} of the batch sampler has "
                f"{len(bounds) - 1} batches, fewer than {world_size} ranks; use last_batch="
                "'pad' or 'keep', or fewer ranks")
        return plan

    # -- epochs -----------------------------------------------------------------------------

    @property
    def order_version(self) -> int:
        """Changes when the order's indices change mid-epoch (a re-weighted sampler)."""
        return int(getattr(self.order, "version", 0))

    @property
    def remaining(self) -> int:
        """Batches of the current epoch not yet delivered."""
        assert self.plan is not None
        return self.plan.num_batches - (self.batches - self._offset_batches)

    def delivered(self) -> None:
        """Count one batch handed to the caller."""
        self._counting()
        self.batches += 1

    def _count_now(self) -> int:
        return self.batches

    def _count_back(self, before: int) -> None:
        self.batches = before

    def frontier(self, last_ahead: int | None = None) -> tuple[int, int] | None:
        """``(epoch, position)``: the first position of the epoch not delivered yet, a restored
        state's until it applies (``None`` before any epoch); with ``last_ahead``, the last
        batch delivered past the cursor out of order, the first position after it. Under
        ``"rollover"`` plans count stream positions, so the epoch is the sample epoch that
        position falls in."""
        state = self._pending
        if state is not None:
            plan = self.plan_for(state.epoch, state.world_size, state.offset_position)
            epoch, batches, offset = state.epoch, state.batches, state.offset_batches
        elif self.plan is None or self.epoch is None:
            return None
        else:
            plan, epoch, batches, offset = self.plan, self.epoch, self.batches, self._offset_batches
        if last_ahead is not None:
            batches = max(batches, last_ahead + 1)
        position = plan.consumed(batches - offset)
        if self.last_batch == "rollover":
            sample_epoch, position = divmod(position, self.dataset_len)
            return sample_epoch, position
        return epoch, position

    def requests(self) -> Iterator[BatchRequest]:
        """This rank's remaining batch requests of the current epoch, from the cursor on."""
        assert self.plan is not None and self.epoch is not None
        return _batch_requests(self.plan, self.epoch, self.batches, self._offset_batches,
                               self.placement[0], self.order,
                               self.dataset_len if self.last_batch == "rollover" else None)

    def _has_rest(self) -> bool:
        return self.remaining > 0

    def _start_epoch(self, epoch: int, rank: int, world_size: int) -> None:
        self._start(epoch, 0, 0, world_size, owner=self._owner)

    def _start(self, epoch: int, batches: int, offset_batches: int, world_size: int,
               offset_position: int = 0, owner: int | None = None) -> None:
        self.epoch, self.batches, self._offset_batches = epoch, batches, offset_batches
        self._owner = owner
        self.plan = self.plan_for(epoch, world_size, offset_position)

    def _resume(self, state: LoaderState, rank: int, world_size: int) -> None:
        offset_batches, position = self._continuation(state, world_size)
        self._start(state.epoch, state.batches, offset_batches, world_size, position,
                    state.trainer_epoch)
        if state.world_size == world_size or self._recounted is state:
            return
        full_epoch = self.plan_for(state.epoch, world_size).num_batches
        warn_past_len(state.world_size, world_size, state.batches, self.remaining, full_epoch)

    def _continuation(self, state: LoaderState, world_size: int) -> tuple[int, int]:
        """``(offset_batches, offset_position)`` of the plan a restored state goes on under
        on ``world_size``: its own on the same world size, else the rest of its epoch from the
        position the saved plan had read up to, dealt anew."""
        if state.world_size == world_size:
            return state.offset_batches, state.offset_position
        if self.last_batch == "rollover":
            raise StateMismatchError(f"cannot resume last_batch='rollover' with another world "
                                     f"size: saved {state.world_size}, now {world_size}")
        saved = self.plan_for(state.epoch, state.world_size, state.offset_position)
        return state.batches, saved.consumed(state.batches - state.offset_batches)

    def _rest_of(self, state: LoaderState, rank: int, world_size: int) -> int | None:
        offset_batches, position = self._continuation(state, world_size)
        plan = self.plan_for(state.epoch, world_size, position)
        return plan.num_batches - (state.batches - offset_batches)

    # -- state ------------------------------------------------------------------------------

    def fingerprint(self) -> dict[str, Any]:
        """What a state is only valid for: the data (its length, and its ``content`` when
        known) and the configuration that plans its epochs."""
        content = {} if self.content is None else {CONTENT: self.content}
        return {"dataset_len": self.dataset_len, "seed": self.seed,
                "batch_size": self.batch_size, "last_batch": self.last_batch,
                "order": self.order.fingerprint, **content}

    def state_dict(self, held: int = 0) -> dict[str, Any]:
        """The cursor as a small plain dict (O(1) in dataset length and worker count).

        ``held``: batches delivered but not yet used by the consumer (a prefetching trainer);
        they are not counted, so a resume delivers them again.
        """
        if self._pending is not None:
            return self._restored_state().to_dict()
        trainer = self._trainer_epoch
        if self.epoch is None:
            state = LoaderState(KIND, trainer or 0, 0, self.placement[1], trainer_epoch=trainer,
                                fingerprint=self.fingerprint(), parts=self._order_state())
        else:
            assert self.plan is not None
            offset = 0 if self.last_batch == "rollover" else self.plan.start
            batches = max(self.batches - held, self._offset_batches)
            state = LoaderState(KIND, self.epoch, batches, self.placement[1], offset,
                                self._offset_batches, self._owner, fingerprint=self.fingerprint(),
                                parts={**self._order_state(), **self._audit(batches)})
        return state.to_dict()

    def _restored_state(self) -> LoaderState:
        """The restored state not yet begun, with the order's live state (loaded with it, and
        maybe changed since: new weights before the first batch) and its audit under it."""
        pending = self._pending
        assert pending is not None
        order = self._order_state()
        if not order:
            return pending
        parts = {**pending.parts, **order}
        if AUDIT in parts:
            parts[AUDIT] = reaudited(parts[AUDIT], pending.batches, self._predictor(pending))
        return replace(pending, parts=parts)

    def _predictor(self, state: LoaderState) -> Callable[[int, int], str]:
        """The audit digest this loader's plan gives the cursor of ``state`` on a rank."""
        return lambda rank, batches: self._digest(state.epoch, batches, state.offset_batches,
                                                  state.offset_position, state.world_size, rank)

    def audit_at(self, batches: int) -> dict[str, Any]:
        """The audit part of the cursor at ``batches`` of the epoch being delivered, on this
        rank, naming that cursor (an out-of-order state's frontier, not its ``batches``)."""
        return audit_part(self.placement[0], self._cursor_digest(batches), batches)

    def _audit(self, batches: int) -> dict[str, Any]:
        """The audit part of the cursor at ``batches``, or none where the epoch's order cannot
        be drawn (a sampler that raised, its error already the loop's): the state is saved
        unaudited, and a resume from it draws, and raises, again."""
        try:
            return {AUDIT: audit_part(self.placement[0], self._cursor_digest(batches))}
        except Exception as exc:
            _log.warning("loader state of epoch %s saved without its audit digest: drawing "
                         "the epoch's order raised %r", self.epoch, exc)
            return {}

    def _cursor_digest(self, batches: int) -> str:
        """The audit digest of the cursor at ``batches`` of the epoch being delivered here."""
        assert self.plan is not None and self.epoch is not None
        offset = 0 if self.last_batch == "rollover" else self.plan.start
        rank, world_size = self.placement
        return self._digest(self.epoch, batches, self._offset_batches, offset, world_size, rank)

    def saved_state(self, state_dict: Mapping[str, Any]) -> LoaderState:
        """``state_dict`` parsed; a ``StateMismatchError`` unless it is this loader's kind,
        dataset and configuration (checked before anything else reads it, so that a mismatch
        is named as one)."""
        return LoaderState.from_dict(state_dict, KIND, self.fingerprint())

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a cursor; the next ``begin_epoch`` continues exactly after its last batch."""
        state = self.saved_state(state_dict)
        self._check_cursor(state)
        with self.loading():
            if is_stateful(self.order) and ORDER_STATE in state.parts:
                part = state.parts[ORDER_STATE]
                if not isinstance(part, dict):
                    raise StateMismatchError(f"corrupted loader state: parts[{ORDER_STATE!r}]="
                                             f"{part!r} is not a dict (the order's state)")
                self.order.load_state_dict(part)
            if AUDIT in state.parts:
                self._audited = None  # the order's restored state may draw otherwise
                check_audit(state.parts[AUDIT], state.epoch, state.batches, state.world_size,
                            self._predictor(state))
            self._pending = state

    @contextmanager
    def loading(self) -> Iterator[None]:
        """As the base's, and the order's own state (a stateful sampler's) is put back too."""
        previous = self.order.state_dict() if is_stateful(self.order) else None
        try:
            with super().loading():
                yield
        except BaseException:
            if previous is not None:
                assert is_stateful(self.order)
                self.order.load_state_dict(previous)
            raise

    def _check_cursor(self, state: LoaderState) -> None:
        """Refuse a cursor outside the plan it was counted in (a corrupted or edited state)."""
        try:
            plan = self.plan_for(state.epoch, state.world_size, state.offset_position)
        except ValueError as exc:
            raise StateMismatchError(
                f"corrupted loader state: epoch {state.epoch} from position "
                f"{state.offset_position} on world size {state.world_size} has no plan ({exc})"
            ) from exc
        if state.batches - state.offset_batches > plan.num_batches:
            raise StateMismatchError(
                f"corrupted loader state: batches={state.batches} is past the end "
                f"of epoch {state.epoch}, which has "
                f"{state.offset_batches + plan.num_batches} batches on world size "
                f"{state.world_size}")

    def _digest(self, epoch: int, batches: int, offset_batches: int, offset_position: int,
                world_size: int, rank: int) -> str:
        """The audit digest (``lightning_loaders.schedule.audit``) of the cursor ``(epoch,
        batches)`` on ``rank``: of the last batch delivered under the plan the cursor counts in,
        or, when none was, of the plan's first; O(batch), never O(epoch)."""
        key = (epoch, batches, offset_batches, offset_position, world_size, rank,
               self.order_version)
        if self._audited is not None and self._audited[0] == key:
            return self._audited[1]
        plan = self.plan_for(epoch, world_size, offset_position)
        batch = min(max(batches - offset_batches - 1, 0), plan.num_batches - 1)
        if batch < 0:
            digest = batch_digest(epoch, -1, rank, world_size, np.empty(0), np.empty(0))
        else:
            positions = plan.positions(batch, rank)[None, :]
            sample_epochs, _, indices = _locate(
                self.order, epoch, positions,
                self.dataset_len if self.last_batch == "rollover" else None)
            digest = batch_digest(epoch, offset_batches + batch, rank, world_size,
                                  sample_epochs, indices)
        self._audited = (key, digest)
        return digest

    def _order_state(self) -> dict[str, Any]:
        """The order's own state (a drawn sampler's, re-weighted weights), if it has one."""
        return {ORDER_STATE: self.order.state_dict()} if is_stateful(self.order) else {}


def _batch_requests(plan: Plan, epoch: int, batches: int, offset_batches: int, rank: int,
                    order: SampleOrder, stream_epoch_len: int | None) -> Iterator[BatchRequest]:
    """Requests for batches ``batches..`` of ``plan`` (a free function: the generator must not
    keep its schedule alive). ``stream_epoch_len`` is set when positions are rollover stream
    positions, which span the permutations of two epochs.

    Even batches are planned a block at a time (one ``order.indices`` call per block), the last
    one or two batches of an epoch, and batches of different sizes, one by one.
    """
    block = max(1, _BLOCK_SAMPLES // plan.batch_size) if isinstance(plan, EpochPlan) else 1
    batch = batches - offset_batches
    while batch < plan.num_batches:
        stop = min(batch + block, plan.even_batches)
        if stop > batch:
            positions = plan.even_positions(batch, stop, rank)
        else:
            stop = batch + 1
            positions = plan.positions(batch, rank)[None, :]
        sample_epochs, positions, indices = _locate(order, epoch, positions, stream_epoch_len)
        for row in range(stop - batch):
            yield BatchRequest(epoch, offset_batches + batch + row, rank, sample_epochs[row],
                               positions[row], indices[row])
        batch = stop


def _locate(order: SampleOrder, epoch: int, positions: np.ndarray,
            stream_epoch_len: int | None) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(sample_epochs, positions, indices)`` of a block of positions: rollover stream
    positions are split into (epoch, position in it) first."""
    if stream_epoch_len is None:
        indices = order.indices(epoch, positions.ravel()).reshape(positions.shape)
        return np.full_like(positions, epoch), positions, indices
    sample_epochs, positions = np.divmod(positions, stream_epoch_len)
    indices = np.empty_like(positions)
    for sample_epoch in np.unique(sample_epochs):
        mask = sample_epochs == sample_epoch
        indices[mask] = order.indices(int(sample_epoch), positions[mask])
    return sample_epochs, positions, indices


def _differing(seeds: bool, ranks: list[tuple[int, int]]) -> ValueError:
    """The error for ranks whose seeds (``seeds``), else order lengths, differ (``ranks``:
    each rank's ``(seed, length)``)."""
    if seeds:
        return ValueError(
            f"the loader's seed differs between ranks ({_by_rank([s for s, _ in ranks])}): "
            "each rank would shuffle another order and read its share of it, repeating and "
            "losing samples in every epoch (and a resume would be refused). The seed is seed=, "
            "else the sampler's own (its generator's initial_seed(), a DistributedSampler's "
            "seed), else the DataLoader's generator's, else $PL_GLOBAL_SEED (seed_everything): "
            "a generator, sampler seed or seed_everything seeded by the rank does this. "
            "Give the same seed on every rank; randomness that should differ between samples "
            "(augmentation) comes from lightning_loaders.sample_rng(), seeded by the seed and "
            "the sample's position")
    return ValueError(
        f"the order's length (the sampler's len(), else the dataset's) differs between ranks "
        f"({_by_rank([n for _, n in ranks])}): the loader plans one order over all ranks and "
        "gives each rank its share of it, so the sampler (or dataset) must cover the whole "
        "dataset on every rank. " + _SPLIT_BY_RANK)


def _by_rank(values: list[Any]) -> str:
    """Each distinct value of ``values`` (one per rank) with the first ranks that have it."""
    ranks: dict[str, list[int]] = {}
    for rank, value in enumerate(values):
        ranks.setdefault(str(value), []).append(rank)
    return ", ".join(f"{value} on rank{'s' if len(held) > 1 else ''} "
                     f"{', '.join(map(str, held[:4]))}{', ...' if len(held) > 4 else ''}"
                     for value, held in ranks.items())


def resolve_last_batch(last_batch: str | None, drop_last: bool) -> LastBatch:
    """``last_batch``, or what ``drop_last`` means when it is not given."""
    if last_batch is None:
        return "drop" if drop_last else "keep"
    if last_batch not in LAST_BATCH_POLICIES:
        raise ValueError(f"last_batch must be one of {LAST_BATCH_POLICIES}, got {last_batch!r}")
    if drop_last and last_batch != "drop":
        raise ValueError(f"drop_last=True contradicts last_batch={last_batch!r}; give one of them")
    return last_batch  # type: ignore[return-value]


def resolve_seed(seed: int | None, generator: torch.Generator | None = None) -> int:
    """``seed``, else the ``generator``'s initial seed, else ``$PL_GLOBAL_SEED`` (which
    Lightning's ``seed_everything`` sets, also in DDP's launched processes), else 0."""
    if seed is not None:
        return checked_seed(seed)
    if generator is not None:
        if not isinstance(generator, torch.Generator):
            raise TypeError(f"generator must be a torch.Generator (its initial seed keys the "
                            f"order), got {type(generator).__name__}")
        return int(generator.initial_seed())
    return int(os.environ.get("PL_GLOBAL_SEED", 0))

