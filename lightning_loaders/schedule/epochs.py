"""``EpochOwner``: what every schedule shares. Placement is resolved lazily, the trainer's epoch
is recorded by ``set_epoch``, and at each epoch start the schedule decides whether a restored
cursor continues or the next epoch begins.

The rule (Lightning may create an iterator before calling ``set_epoch`` on a restart, and may
pass a stale epoch, #21938):

- a restored cursor continues, unless the trainer has moved to a later epoch than the one the
  cursor's epoch began under (its *owner*), or the state says its reader left that epoch for
  good (``abandoned``: a validation pass that stopped early, after which the live loader's
  next ``iter()`` begins the next epoch); one saved before its loader began the epoch reads
  that epoch, even one with no batch (``last_batch='rollover'`` can leave an epoch none);
- a restored cursor at its epoch's end stays exhausted (delivers nothing) when the trainer,
  after the restore, declares the very epoch the cursor's epoch began under: it is resuming that
  epoch, and may still be draining longer loaders beside this one
  (``CombinedLoader(mode="max_size")`` keeps a finished member finished until the longest one
  ends: Lightning's ``_MaxSize`` iterator never calls ``iter()`` on it again). Lightning's
  fit loop restores training loaders, then calls ``set_epoch``; ``max_size_cycle``
  re-iterates the exhausted member, which starts its next epoch, as it would have
  uninterrupted;
- otherwise the next epoch starts: one past the current epoch, or the trainer's epoch if that
  is later (so an unfinished epoch's tail is abandoned, as after ``limit_train_batches``). So
  a restored cursor at its epoch's end starts the next epoch without ``set_epoch`` after the
  restore, or when the epoch was declared before it (``ExactResume`` restores a validation
  loader between passes after the evaluation loop's ``set_epoch``: its next pass begins).

The trainer epoch an epoch began under (its *owner*) is saved with the cursor, so a restored
schedule makes exactly the decision the uninterrupted one would have made.
"""

from __future__ import annotations

import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from typing import Any

from lightning_loaders.placement import placement_settled, resolve_rank_world
from lightning_loaders.state import LoaderState

__all__ = ["EpochOwner", "following_epoch", "still_draining", "trainer_moved_on",
           "warn_past_len"]


class EpochOwner:
    """Base of the schedules: placement, the trainer's epoch, and the epoch-start decision.

    A subclass implements ``num_batches``, ``_resume`` (apply a restored state), ``_rest_of``
    (the batches a restored state has left, without applying it), ``_has_rest`` (whether the
    current epoch has batches left) and ``_start_epoch`` (begin an epoch at its first batch),
    plus ``state_dict``/``load_state_dict``.
    """

    def __init__(self, rank: int | None, world_size: int | None) -> None:
        if rank is not None or world_size is not None:
            resolve_rank_world(rank, world_size)  # explicit ones are checked now
        self._explicit_placement = (rank, world_size)
        self._placement: tuple[int, int] | None = None
        self._settled = False  # whether _placement came from a source, not the (0, 1) fallback
        self.epoch: int | None = None
        """The epoch being delivered (``None`` before the first batch)."""
        self.batches = 0
        """Batches of ``epoch`` delivered to the caller."""
        self._pending: LoaderState | None = None
        self._trainer_epoch: int | None = None
        self._owner: int | None = None
        self._declared_for: LoaderState | None = None  # the restored state set_epoch followed
        self._recounted: LoaderState | None = None  # the restored state resume_batch answered
        self._counted_from: Any = None  # the count before the batch being handed over

    def handing(self) -> None:
        """A batch is about to be handed over: the counts from now on are its own, which
        ``take_back`` undoes (``delivered()`` notes the count as it was: ``_counting``)."""
        self._counted_from = None

    def take_back(self) -> bool:
        """Undo the counts since ``handing()``: their batch was not handed over (a Ctrl-C
        landed in ``next()`` after it was counted). Whether there were any."""
        before, self._counted_from = self._counted_from, None
        if before is None:
            return False
        self._count_back(before)
        return True

    def _counting(self) -> None:
        """Called by ``delivered()`` before it counts: note the count as it was, once per
        batch handed over."""
        if self._counted_from is None:
            self._counted_from = self._count_now()

    def _count_now(self) -> Any:
        """What ``delivered()`` changes, as it is now (``_count_back`` puts it back)."""
        raise NotImplementedError

    def _count_back(self, before: Any) -> None:
        raise NotImplementedError

    @property
    def placement(self) -> tuple[int, int]:
        """``(rank, world_size)``: resolved at each epoch start (what the epoch is planned and
        saved with), afresh before the first."""
        if self._placement is not None:
            return self._placement
        return resolve_rank_world(*self._explicit_placement)

    @property
    def sizing_placement(self) -> tuple[int, int]:
        """The placement ``len()`` counts for: the current epoch's, unless that was only the
        fallback ``(0, 1)`` (no process group, no environment: ``placement_settled``), which
        is resolved afresh, so that a loader read before ``Trainer.fit`` starts DDP has the
        length its rank reads there."""
        if self._placement is not None and self._settled:
            return self._placement
        return resolve_rank_world(*self._explicit_placement)

    @property
    def restoring(self) -> bool:
        """Whether a restored state waits for the next epoch start."""
        return self._pending is not None

    def set_epoch(self, epoch: int) -> None:
        """Record the trainer's epoch; it takes effect at the next epoch start."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self._trainer_epoch = epoch
        self._declared_for = self._pending

    def begin_epoch(self) -> None:
        """Fix placement and decide which epoch and batch come next (see the module
        docstring). A restored state that fails to apply stays pending, so a corrected retry
        can still resume."""
        rank, world_size = self._placement = resolve_rank_world(*self._explicit_placement)
        self._settled = placement_settled(*self._explicit_placement)
        pending, self._pending = self._pending, None
        trainer = self._trainer_epoch
        declared = trainer if pending is not None and self._declared_for is pending else None
        finished = True
        if pending is not None and pending.abandoned:  # only where that epoch stood counts
            self.epoch, self._owner = pending.epoch, pending.trainer_epoch
            self._declared_for = None
        elif pending is not None:
            try:
                self._resume(pending, rank, world_size)
            except BaseException:
                self._pending = pending
                raise
            self._declared_for = None
            if not trainer_moved_on(trainer, self._owner, self.epoch) and (
                    self._has_rest() or still_draining(declared, self._owner)
                    or self._not_begun(pending)):
                if pending.batches == 0 and self._owner is None:
                    self._owner = trainer  # the epoch begins now, as a fresh loader's would
                return
        else:
            finished = self.epoch is None or not self._has_rest()
        epoch = following_epoch(self.epoch, trainer, self._owner, finished)
        self._owner = trainer
        self._start_epoch(epoch, rank, world_size)

    def restored_epoch(self, trainer_epoch: int | None, declared: bool) -> int | None:
        """The epoch the restored state pending is read in at the next epoch start, were the
        trainer's epoch ``trainer_epoch`` then (``declared``: given after the restore), as
        ``begin_epoch`` decides it, from the state alone (``None``: no state pending)."""
        state = self._pending
        if state is None:
            return None
        owner = state.trainer_epoch
        if not state.abandoned and not trainer_moved_on(trainer_epoch, owner, state.epoch):
            if still_draining(trainer_epoch if declared else None, owner):
                return state.epoch
            try:
                rest = self._rest_of(state, *self.placement)
            except (TypeError, ValueError):
                return state.epoch
            if rest is None or rest > 0:
                return state.epoch
        return following_epoch(state.epoch, trainer_epoch, owner)

    def abandon_finished_restore(self) -> bool:
        """Mark a restored state waiting at its epoch's end ``abandoned``: the next epoch start
        begins the next epoch without reading that epoch's plan again (its data changed since,
        and the next epoch follows the change). Returns whether it did."""
        state = self._pending
        if state is None or state.abandoned:
            return state is not None
        rank, world_size = self.placement
        try:
            finished = self._rest_of(state, rank, world_size) == 0
        except (TypeError, ValueError):
            return False
        if finished:
            self._pending = replace(state, abandoned=True)
        return finished

    def resume_batch(self) -> int | None:
        """The batch of its epoch at which the restored state resumes on this placement, as
        the epoch would count it had it run here from its start: ``num_batches()`` minus the
        batches the state has left here (``num_batches()`` once they are none). ``None``
        without a restored state pending, or when it cannot be known (unknown lengths,
        ``last_batch='rollover'``, a state that will not apply).

        Computed from the state alone: nothing starts and the state stays pending (the epoch
        is decided at the first ``next()``). On the layout the state was saved on, it is the
        caller's own count of the epoch's batches; after an elastic resume (another world
        size) the rest of the epoch is dealt anew, and a trainer that counts from here
        (``ExactResume``) asks for exactly the batches left, so the warning that an elastic
        resume runs past ``len()`` is not given for this state."""
        state = self._pending
        if state is None:
            return None
        rank, world_size = self.placement
        try:
            rest = 0 if state.abandoned else self._rest_of(state, rank, world_size)
            total = self.num_batches()
        except (TypeError, ValueError):
            return None
        if rest is None:
            return None
        self._recounted = state
        return max(total - rest, 0)

    def num_batches(self) -> int:
        """Batches per epoch on this rank (equal on every rank)."""
        raise NotImplementedError

    def state_dict(self, held: int = 0) -> dict[str, Any]:
        """The cursor as a plain dict; ``held``: batches delivered but not yet used."""
        raise NotImplementedError

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a cursor; the next ``begin_epoch`` continues exactly after its last batch."""
        raise NotImplementedError

    @contextmanager
    def loading(self) -> Iterator[None]:
        """Around ``load_state_dict`` and the restoring of the rest of a loader's state: if
        anything in it raises, the schedule is as it was (nothing pending is replaced)."""
        pending = self._pending
        try:
            yield
        except BaseException:
            self._pending = pending
            raise

    def _resume(self, state: LoaderState, rank: int, world_size: int) -> None:
        raise NotImplementedError

    def _rest_of(self, state: LoaderState, rank: int, world_size: int) -> int | None:
        """Batches of its epoch a restored ``state`` has left on this placement (``None``:
        unknown); raises ``ValueError`` or ``TypeError`` as ``_resume`` would."""
        raise NotImplementedError

    def _has_rest(self) -> bool:
        raise NotImplementedError

    def _not_begun(self, state: LoaderState) -> bool:
        """Whether a restored ``state`` is at the start of an epoch its loader had not begun
        (saved before its first ``iter()``): that epoch is read next even when it has no batch,
        as by that loader. ``False`` where a state cannot tell (the default)."""
        return False

    def _start_epoch(self, epoch: int, rank: int, world_size: int) -> None:
        raise NotImplementedError


def trainer_moved_on(trainer_epoch: int | None, owner: int | None, current: int | None
                     ) -> bool:
    """Whether the trainer's epoch (its last ``set_epoch``) is later than the one the current
    epoch (``current``) began under (``owner``), or than ``current`` itself when it began
    under none (``set_epoch`` first called after an epoch read without it): the trainer has
    then abandoned the current epoch."""
    began_under = owner if owner is not None else current
    return trainer_epoch is not None and began_under is not None and trainer_epoch > began_under


def still_draining(declared_epoch: int | None, owner: int | None) -> bool:
    """Whether a restored cursor at its epoch's end stays exhausted: the trainer epoch declared
    after the restore (``None``: none) is the one that epoch began under, so the trainer is
    resuming it, not starting the next."""
    return declared_epoch is not None and declared_epoch == owner


def following_epoch(current: int | None, trainer_epoch: int | None, owner: int | None,
                    finished: bool = True) -> int:
    """The epoch to start when the current one (``None``: none yet) is ``finished`` or
    abandoned: the next one, or the trainer's epoch when the trainer has moved past it (a
    fresh loader starts at the trainer's epoch, else at 0). A current epoch begun under no
    declared epoch and left unfinished (a batch looked at before ``Trainer.fit``) starts over
    when the trainer declares that very epoch, as ``sampler.set_epoch(e)`` gives a
    ``DataLoader`` epoch ``e``'s order from its start."""
    if current is None:
        return trainer_epoch if trainer_epoch is not None else 0
    if owner is None and trainer_epoch == current and not finished:
        return current
    if trainer_moved_on(trainer_epoch, owner, current):
        assert trainer_epoch is not None
        return max(current + 1, trainer_epoch)
    return current + 1


def warn_past_len(saved_world: int, world_size: int, batches: int, remaining: int,
                  full_epoch: int) -> None:
    """Warn that an elastic resume after ``batches`` leaves ``remaining`` batches, more than a
    trainer stopping at ``len()`` (``full_epoch``) would read."""
    if remaining and batches + remaining > full_epoch:
        warnings.warn(
            f"elastic resume from world size {saved_world} to {world_size} after {batches} "
            f"batches leaves {remaining} batches in this epoch, past len()={full_epoch}: a "
            "trainer that stops at len() (Lightning does) would skip the last ones. Resume "
            "with lightning_loaders.ExactResume (it recounts Lightning's batches), at an epoch "
            "end, or on fewer ranks.",
            stacklevel=5,
        )
