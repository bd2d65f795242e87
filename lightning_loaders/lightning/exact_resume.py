"""``ExactResume``: a callback with which a resumed ``fit`` repeats the uninterrupted run's whole
loop, validation included.

Lightning 2.6 restores where training stood, but not where validation stood:

- A checkpoint written after a training step at which validation is due precedes that
  validation: ``ModelCheckpoint(every_n_train_steps=...)`` saves in ``on_train_batch_end``, and
  the epoch loop validates after those hooks (``loops/training_epoch_loop.py:375-408``). On
  restart Lightning counts that validation as done (``training_epoch_loop.py:281-292``) and
  trains on (Lightning #19549, #20277, #20288): with validation twice per epoch, 4 of 12
  per-step checkpoints resume without a validation pass that the uninterrupted run made.
- A checkpoint written during validation (a preemption handler saving in
  ``on_validation_batch_end``) restarts "on last" and skips the rest of the pass
  (``training_epoch_loop.py:286-289``). Lightning saves no validation loader's state either,
  only the training loaders' (``loops/fit_loop.py:520-530``).
- A restart from the last batch of an epoch finishes that epoch in ``FitLoop.reset``
  (``loops/fit_loop.py:398-404``) but then skips the next epoch's ``on_train_epoch_start`` and
  its progress counts (``fit_loop.py:447-454``); a checkpoint written later in that epoch then
  resumes at the epoch's first batch. Resumed on fewer ranks (an elastic iterable, with more
  batches per rank), that checkpoint's batch count is not taken for the epoch's end at all:
  the next epoch counts on from it and ends early.
- A mid-epoch restart on another world size keeps Lightning's per-rank batch count of the
  epoch in the old layout's batches, while the loaders deal the rest of the epoch to the new
  layout: on more ranks Lightning ends the epoch before the loaders' rest (1 rank to 2 after 5
  of 16 batches: 3 of the 6 batches left, 10 of 32 samples lost), on fewer ``batch_idx`` is off.

``ExactResume`` saves, with every checkpoint, which validation is pending and the validation
loaders' states; on restore it runs the pending validation (or the rest of it) once, before
training goes on, lets the next epoch start as usual, and counts a resumed epoch's batches from
where the training loaders resume (their ``resume_batch()``). It also logs, once per checkpoint
save, each training loader's cursor and resume-audit digest, so that two runs can be compared
from their logs.
"""

from __future__ import annotations

import logging
import warnings
import weakref
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass
from itertools import repeat
from typing import Any

import lightning as L
from lightning.fabric.utilities.data import _set_sampler_epoch, sized_len
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.trainer.states import TrainerFn
from lightning.pytorch.utilities import CombinedLoader

from lightning_loaders.lightning.datamodule import (
    ResumableDataModule,
    convert_passed_loaders,
    user_shards,
)
from lightning_loaders.lightning.in_flight import state_before_step, step_loaders
from lightning_loaders.schedule.audit import saved_digest
from lightning_loaders.state import abandoned, is_stateful

__all__ = ["ExactResume"]

_VERSION = 1
_log = logging.getLogger(__name__)


@dataclass(frozen=True, kw_only=True)
class _Pending:
    """A validation pass to run on restore, from batch ``batch_idx`` of validation loader
    ``dataloader_idx`` on (``0, 0``: all of it). ``replay`` batches of that loader are fetched
    and dropped first, from its state at the start of the interrupted pass, when its cursor
    cannot say where the pass stood. ``origin``: every validation loader's state at the start
    of the interrupted pass (``None``: not interrupted)."""

    dataloader_idx: int = 0
    batch_idx: int = 0
    replay: int = 0
    origin: list[Any] | None = None

    @property
    def positioned(self) -> bool:
        """Whether the pass goes on from anywhere but its start."""
        return (self.dataloader_idx, self.batch_idx) != (0, 0)

    def to_dict(self) -> dict[str, Any]:
        return {"dataloader_idx": self.dataloader_idx, "batch_idx": self.batch_idx,
                "replay": self.replay, "origin": self.origin}

    @classmethod
    def from_dict(cls, state: dict[str, Any]) -> _Pending:
        return cls(dataloader_idx=int(state["dataloader_idx"]), batch_idx=int(state["batch_idx"]),
                   replay=int(state["replay"]), origin=state["origin"])


@dataclass(kw_only=True)
class _Pass:
    """The validation pass under way: it began at batch ``start`` (``(dataloader_idx,
    batch_idx)``) with the loaders in states ``origin``. ``current`` is the batch whose
    ``on_validation_batch_start`` we saw last, when ``mark`` batches of the pass had been handed
    to steps before it; ``complete`` once ``on_validation_epoch_end`` has run (and until the
    next pass starts: ``ModelCheckpoint`` saves in ``on_validation_end``, after ours)."""

    start: tuple[int, int]
    origin: list[Any]
    current: tuple[int, int] | None = None
    mark: int = 0
    complete: bool = False


class ExactResume(Callback):
    """Make ``Trainer.fit(ckpt_path=...)`` repeat the uninterrupted run's training and
    validation, batch for batch, from any checkpoint written during ``fit``.

    Add it to ``Trainer(callbacks=[ExactResume(), ...])`` in the run that writes the
    checkpoints and in the run that resumes from them. With it:

    - a checkpoint written after a training step at which validation is due (in
      ``on_train_batch_end``, where ``ModelCheckpoint(every_n_train_steps=...)`` writes)
      resumes with that validation pass, run once, then training;
    - a checkpoint written during a validation pass (in ``on_validation_batch_end``, say, or
      from a signal handler inside a step) resumes with the rest of that pass, each step
      getting the batch, ``batch_idx`` and ``dataloader_idx`` it would have had, then training;
    - the validation loaders' states travel with every checkpoint (Lightning saves only the
      training loaders'), so a shuffled validation loader goes on with the order of its next
      pass;
    - a checkpoint written before a training step ended (in ``on_train_batch_start``, inside
      ``training_step``: Lightning's SLURM auto-requeue saves from its signal handler wherever
      the main thread is, ``trainer/connectors/signal_connector.py``) resumes with that step
      run again on its own batch: Lightning restarts the step, and the training loaders'
      states (also a ``ResumableDataModule``'s) leave its batch out (``in_flight``); the
      logger step is not advanced for it either;
    - a checkpoint written in ``on_train_epoch_start`` resumes with that whole epoch
      (Lightning alone keeps the last epoch's batch count there and ends it after a batch);
    - after a checkpoint at the last batch of an epoch, the next epoch starts as usual (with
      its ``on_train_epoch_start``, and ``batch_idx`` from 0 also for an unsized loader, or
      one whose ``len()`` a reload reads anew: a batch sampler's epochs differ in length), and
      checkpoints written in it resume exactly too; so it does after one written at the
      epoch's end (``on_train_epoch_end``, or after ``fit`` returned) under ``max_steps``,
      and the training loaders passed to ``fit`` get their states from such a checkpoint
      (Lightning gives none there, and a cycled ``CombinedLoader`` member's epochs are not
      the trainer's);
    - a checkpoint written where ``max_steps`` cut an epoch short (``on_train_epoch_end``,
      which Lightning calls there, or after ``fit`` returned) resumes inside that epoch, at
      its next batch, when a run goes on with a larger ``max_steps``;
    - after a mid-epoch checkpoint resumed on another world size (an elastic resume), the
      epoch's batches are counted from where the training loaders resume on the new layout
      (``resume_batch()`` of this package's loaders), so Lightning asks for exactly the batches
      they have left and ``batch_idx`` runs on as the new layout counts. Several training
      loaders in a ``CombinedLoader`` are counted by the one their mode ends the epoch with
      (``max_size_cycle``: the longest; ``max_size``: most batches left; ``min_size``: fewest);
      ``sequential`` and a ``limit_train_batches`` below a loader's length are left as they
      are. With ``accumulate_grad_batches`` the optimizer steps follow the new layout's count
      (the first may accumulate fewer batches); the logger step goes on from the saved one.

    This holds for ``val_check_interval`` as a fraction or an integer (also with
    ``check_val_every_n_epoch=None``), ``check_val_every_n_epoch > 1``, ``limit_val_batches``,
    ``reload_dataloaders_every_n_epochs`` (rebuilt validation loaders start afresh, in the
    epochs the uninterrupted run rebuilt them), several validation loaders, and DDP (every
    rank runs the pending pass; rank 0's checkpoint carries the state, as for the training
    loaders). The pending pass runs at
    ``on_train_start``, with ``trainer.current_epoch`` the epoch it belongs to. A pass resumed
    mid-way starts again with ``on_validation_start`` and ``on_validation_epoch_start``, so
    epoch-level metrics cover the batches run after the resume, unless their state is in the
    checkpoint.

    Validation loaders with ``state_dict``/``load_state_dict`` (``ResumableLoader(...,
    evaluation=True)``, ``make_resumable(DataLoader(...), evaluation=True)``, and what
    ``ResumableDataModule.val_dataloader`` returns) jump to the batch where the pass stood. Any
    other loader is read from its start and the batches already validated are fetched and
    dropped, which is exact for a fixed order (``shuffle=False``, as Lightning's validation
    samplers have). A pass interrupted inside a step (its batch fetched, its step not finished)
    and a ``CombinedLoader`` in another mode than ``"sequential"`` replay the same way. After a
    pass that stops before the loader's epoch ends (``limit_val_batches``, the sanity check's
    ``num_sanity_val_steps``, or a ``CombinedLoader`` mode: ``"max_size_cycle"`` cycling the
    shorter members, ``"min_size"`` stopping the longer ones) the live loader starts its next
    epoch at the next pass: this package's loaders are restored to do the same (their state
    is saved ``abandoned``); any other loader starts afresh, which is exact for a fixed order
    without epoch-dependent randomness. A loader no pass has read yet starts afresh too, at
    the trainer's epoch, as the live one does; one whose part of an interrupted pass was over
    gets its state at the next pass.

    With ``ResumableDataModule``: the data module carries the training loaders' cursors in its
    own state and makes its validation loaders resumable; ``ExactResume`` carries the pending
    validation and the validation loaders' states. Use both:
    ``Trainer(callbacks=[ExactResume(), ModelCheckpoint(...)])`` and
    ``trainer.fit(model, datamodule=data, ckpt_path=...)``.

    Not covered: a validation due at the step that reaches ``max_steps`` (Lightning's fit loop
    returns before any hook runs, ``loops/fit_loop.py:209-211``); ``on_train_epoch_end`` of the
    epoch whose last step wrote the checkpoint (``FitLoop.reset`` counts that epoch finished);
    time-based ``val_check_interval``.

    Lightning 2.6 internals this relies on (file:line in ``lightning/pytorch``):

    - ``trainer/trainer.py:1044-1070``, ``trainer/connectors/checkpoint_connector.py:406-413``:
      callbacks' ``on_load_checkpoint`` gets the checkpoint before the loops are restored from
      it (``restore_training_state``), where ``ExactResume`` counts an epoch that
      ``max_steps`` cut short (``is_last_batch`` false in the epoch loop's
      ``batch_progress``) unfinished.
    - ``loops/training_epoch_loop.py:529-562``, ``_should_check_val_fx(data_fetcher)``: whether
      validation is due after the step, asked at save time with ``fit_loop._data_fetcher``
      (``loops/fit_loop.py:109``); ``_skip_next_val`` (``training_epoch_loop.py:96``);
      ``batch_progress`` (``:82``), whose ``completed == processed - 1`` marks
      ``on_train_batch_end`` (``:356-379``).
    - ``loops/training_epoch_loop.py:396-408``: how the epoch loop runs validation; the pending
      pass runs the same way from ``on_train_start`` (``loops/fit_loop.py:431``, after
      ``FitLoop.reset`` restored the loops), honouring ``fit_loop._should_accumulate()``
      (``fit_loop.py:545-547``), and puts ``_EvaluationLoop._has_run``
      (``loops/evaluation_loop.py:77``) back so that ``_is_validation_done``
      (``training_epoch_loop.py:125-127``) decides as it would have.
    - ``loops/fit_loop.py:398-404``: a restart after an epoch's last batch counts that epoch
      finished before ``on_train_start``: the pending pass then runs with
      ``fit_loop.epoch_progress.current`` one back, for ``current_epoch`` and the loaders'
      ``set_epoch`` (``loops/evaluation_loop.py:252-255``); ``fit_loop.reset_restart_stage()``
      (``fit_loop.py:380-381``) lets ``on_advance_start`` (``:447-454``) start the next epoch.
    - ``loops/training_epoch_loop.py:191-230`` (``reset``) and ``:442-454``
      (``_num_ready_batches_reached``, ``_should_accumulate``): a restart goes on counting
      ``batch_progress.current.ready`` (``batch_idx`` is ``ready - 1``, ``:106-110, 314``)
      from the saved count and ends the epoch when it reaches ``num_training_batches``; ``reset``
      advances ``_batches_that_stepped`` when ``_should_accumulate()`` is false. It runs after
      ``on_train_start``, where ``ExactResume`` moves the count.
    - ``loops/training_epoch_loop.py:281-295``: afterwards Lightning does not validate at that
      step again (it counts the pass done, or skips it when restarted "on last"); the pass's
      ``on_iteration_done`` (``loops/loop.py:109-113``) clears the validation loop's restart
      stage, so a checkpoint written inside a step is not validated twice either.
    - ``loops/evaluation_loop.py:229-266``: ``reset()`` makes the iterator of
      ``_combined_loader`` (``:81``) in ``_data_fetcher`` (``:82``) before
      ``on_validation_start`` (``:281-287``), where ``ExactResume`` moves it:
      ``CombinedLoader._iterator`` (``utilities/combined_loader.py:348-352``), for the
      sequential mode ``_Sequential._iterator_idx``, ``_idx`` and ``_load_current_iterator()``
      (``combined_loader.py:123-181``); then the fetcher's ``fetched`` count and prefetched
      ``batches`` (``loops/fetchers.py:33, 101``).
    - ``loops/evaluation_loop.py:109-112, 155-173``: the validation loaders are rebuilt when
      ``current_epoch - _last_val_dl_reload_epoch >= reload_dataloaders_every_n_epochs``;
      ``ExactResume`` saves that epoch and puts it back on restore.
    - ``utilities/combined_loader.py:68-95``: a ``"max_size_cycle"`` iterator's ``_consumed``
      (which members have ended in the epoch: it ends when the last does), which a restart
      makes anew; ``ExactResume`` saves it after a step and puts it back at ``on_train_start``
      (an unsized member is fetched past its end there, and cycled where it should not).
    - ``batch_progress`` of the validation loop (``loops/evaluation_loop.py:423-460``):
      ``current.ready`` counts batches handed to steps, ``current.processed`` steps done;
      ``max_batches`` (``:96-101``) the batches of each loader per pass.
    """

    def __init__(self) -> None:
        self._trainer: weakref.ref[L.Trainer] | None = None
        self._epoch = 0  # current_epoch when the restored state was saved
        self._pending: _Pending | None = None  # restored, runs at on_train_start
        self._resuming: _Pending | None = None  # that pass, positioned when it starts
        self._loader_states: list[Any] | None = None  # restored, applied at the next pass
        self._loaded_at: int | None = None  # the epoch the loaders of those states were built
        self._pass: _Pass | None = None
        self._after_sanity = False  # the sanity check was the loaders' last pass
        self._reopened = False  # the restored epoch was counted ended where max_steps cut it
        self._cycled: list[bool] | None = None  # restored: max_size_cycle members cycled
        self._exhausted: bool | None = None  # the training data at fit's end (None: unknown)

    # -- checkpoint state -------------------------------------------------------------------

    def state_dict(self) -> dict[str, Any]:
        """Which validation is pending (``None``: none), the validation loaders' states, and
        whether the training data of the epoch was exhausted (the data fetcher's ``done``:
        an epoch ended with it unread was cut short, by ``max_steps`` or ``should_stop``)."""
        trainer = self._trainer() if self._trainer is not None else None
        if self._pending is not None or trainer is None:  # restored, not run yet
            return _state(self._epoch, self._pending, self._loader_states, self._loaded_at,
                          self._cycled, self._exhausted)
        loaders = _val_loaders(trainer)
        states = _overlaid(self._loader_states, _states(trainer, loaders, self._after_sanity))
        pending: _Pending | None = None
        if _fitting(trainer) and trainer.validating:
            pending, states = self._rest_of_pass(trainer, loaders, states)
        elif _fitting(trainer) and _validation_due(trainer):
            pending = _Pending()
        fetcher = trainer.fit_loop._data_fetcher
        exhausted = fetcher.done if fetcher is not None else self._exhausted
        return _state(trainer.current_epoch, pending, states, _loaded_at(trainer),
                      _cycled(trainer), exhausted)

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore; the pending validation runs at ``on_train_start``."""
        version = state_dict.get("version") if isinstance(state_dict, dict) else None
        if version != _VERSION:
            raise ValueError(f"unsupported ExactResume state (version {version!r}); this "
                             f"ExactResume reads version {_VERSION}: resume with the version of "
                             "lightning-loaders that wrote the checkpoint")
        self._epoch = int(state_dict["epoch"])
        pending = state_dict["pending"]
        self._pending = _Pending.from_dict(pending) if pending is not None else None
        self._loader_states = state_dict["loaders"]
        self._loaded_at = state_dict.get("loaded_at")  # absent from older checkpoints
        self._cycled = state_dict.get("cycled")  # likewise
        self._exhausted = state_dict.get("exhausted")  # likewise

    def on_load_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """Give the training loaders passed to ``fit`` their saved states, and the next epoch,
        after an epoch's end (``ModelCheckpoint`` saves in ``on_train_epoch_end`` by default
        without validation): Lightning restores no loader there (``loops/fit_loop.py:139,
        553``), and a new one starts at the trainer's next epoch. That is the live one's place
        only if it counts its epochs as the trainer does; a ``CombinedLoader`` member that
        cycles (``max_size_cycle``) has epochs of its own. Under ``max_steps`` Lightning
        restores them, but gives the next epoch only after it fetched a batch of an unsized
        loader: a ``min_size`` member left mid-epoch read on in that epoch.
        Count an epoch cut short (by ``max_steps`` or ``should_stop``) unfinished first
        (Lightning restores the loops after this hook, and restarts inside it), whatever ends
        the resumed run: it was cut when it was saved. A checkpoint that does not record it
        is read under ``max_steps`` only, as before."""
        loop = checkpoint.get("loops", {}).get("fit_loop", {})
        exhausted = checkpoint.get("callbacks", {}).get(self.state_key, {}).get("exhausted")
        self._reopened = ((exhausted is not None or trainer.fit_loop._iteration_based_training())
                          and _reopen_cut_epoch(loop, exhausted))
        states = loop.get("state_dict", {}).get("combined_loader")
        epoch = loop.get("epoch_progress", {}).get("current", {})
        source = trainer.fit_loop._data_source
        if (not states or source.instance is None or source.is_module()
                or not epoch.get("ready") == epoch.get("started") == epoch.get("processed")):
            return  # nothing passed to fit, or Lightning restores them (an epoch unfinished)
        instance = source.instance
        combined = instance if isinstance(instance, CombinedLoader) else CombinedLoader(instance)
        loaders = combined.flattened
        if sum(map(is_stateful, loaders)) != len(states):
            warnings.warn(f"the checkpoint holds the states of {len(states)} training loaders "
                          f"but fit() was given {sum(map(is_stateful, loaders))} with a "
                          "state_dict(): they start afresh", stacklevel=2)
            return
        combined._load_state_dicts(states)
        for loader in loaders:  # the next epoch, as the live loaders are told before it starts
            _set_sampler_epoch(loader, int(epoch["processed"]))

    def on_save_checkpoint(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           checkpoint: dict[str, Any]) -> None:
        """Save the training loaders' states without the batch of a training step in
        progress (``in_flight``), which Lightning runs again on restart; log at INFO each
        training loader's saved cursor (epoch, batches) and its resume audit digest
        (``lightning_loaders.schedule.audit``; ``-`` where the loader has none): the same line
        in two runs means the same batch stood before the cursor."""
        loop = checkpoint.get("loops", {}).get("fit_loop", {}).get("state_dict", {})
        in_step = step_loaders(trainer)
        combined = trainer.fit_loop._combined_loader
        if in_step and combined is not None and "combined_loader" in loop:
            stateful = [loader for loader in combined.flattened if is_stateful(loader)]
            loop["combined_loader"] = [
                state_before_step(loader) if any(loader is other for other in in_step) else state
                for loader, state in zip(stateful, loop["combined_loader"], strict=True)]
        for index, state in enumerate(loop.get("combined_loader", [])):
            if isinstance(state, dict) and "epoch" in state and "batches" in state:
                _log.info("checkpoint at global step %d, rank %d: training loader %d at epoch "
                          "%s, batch %s, digest %s", trainer.global_step, trainer.global_rank,
                          index, state["epoch"], state["batches"], saved_digest(state) or "-")

    # -- hooks ------------------------------------------------------------------------------

    def setup(self, trainer: L.Trainer, pl_module: L.LightningModule, stage: str) -> None:
        """Keep the trainer; in ``fit``, make the plain ``DataLoader``s passed straight to it
        resumable (``datamodule.convert_passed_loaders``)."""
        self._trainer = weakref.ref(trainer)
        if stage == TrainerFn.FITTING:
            convert_passed_loaders(trainer)

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Let the next epoch start as usual after a restart at an epoch's last batch (also
        on another world size, where that epoch had fewer or more batches per rank), run the
        validation pending in the checkpoint as the epoch loop runs it, and, mid-epoch, count
        the epoch's batches from where the training loaders resume on this layout."""
        fit_loop = trainer.fit_loop
        epoch_loop = fit_loop.epoch_loop
        if _ended_under_max_steps(fit_loop):
            _resume_as_epoch_based(fit_loop)
        if self._reopened:
            _step_counted_once(fit_loop)
        if fit_loop.restarted_on_epoch_start:  # saved in on_train_epoch_start
            epoch_loop.batch_progress.reset_on_run()  # not the last epoch's count
        if (fit_loop.restarted_mid_epoch and epoch_loop.restarted_on_train_batch_end
                and epoch_loop.batch_progress.is_last_batch):
            fit_loop.reset_restart_stage()
            # a reload before the next epoch reads len() again, which may change (a batch
            # sampler's epochs differ in length): then the end is counted as for no len()
            reload = fit_loop._should_reload_train_dl
            _count_as_epoch_end(epoch_loop, float("inf") if reload
                                else trainer.num_training_batches)
        self._run_pending(trainer, pl_module)
        if fit_loop.restarted_mid_epoch:
            _count_from_loaders(trainer)
            _restore_cycled(trainer, self._cycled)
        self._cycled = None
        _warn_unresumable(trainer)

    def on_train_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Keep whether the training data was exhausted, for a checkpoint written after
        ``fit`` returns (Lightning drops the data fetcher then)."""
        fetcher = trainer.fit_loop._data_fetcher
        if fetcher is not None:
            self._exhausted = fetcher.done

    def _run_pending(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Run the validation pending in the checkpoint as the epoch loop runs it."""
        fit_loop = trainer.fit_loop
        pending, self._pending = self._pending, None
        if pending is None:
            return
        val_loop = fit_loop.epoch_loop.val_loop
        has_run = val_loop._has_run
        self._resuming = pending
        with _epoch_as(trainer, self._epoch):
            val_loop.restarting = False  # the pass counts its batches from 0
            trainer.validating = True
            if not fit_loop._should_accumulate():
                pl_module.on_validation_model_zero_grad()
            val_loop.run()
            trainer.training = True
        self._resuming = None
        val_loop._has_run = has_run
        # Lightning then counts that validation done (``increment_progress_to_evaluation_end``),
        # whose ``reset()`` fetches a batch of an unsized loader: a pass that never runs, which
        # would move its next pass on an epoch. The next pass starts from the states of now,
        # and a loader whose part of the pass was over before the checkpoint from the state
        # set aside for it (this process never read it).
        self._loader_states = _overlaid(self._loader_states,
                                        _states(trainer, _val_loaders(trainer), False))
        self._loaded_at = _loaded_at(trainer)

    def on_sanity_check_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        self._after_sanity = True

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        """Restore the loaders' states and position the pass (first pass after a restore),
        and start following it."""
        if not _fitting(trainer):
            return
        resuming, self._resuming = self._resuming, None
        states, self._loader_states = self._loader_states, None
        loaded_at, self._loaded_at = self._loaded_at, None
        if states is not None and _rebuilt_since(trainer, loaded_at):
            states = None  # their loaders were rebuilt since: these start afresh, as those did
        loaders = _val_loaders(trainer)
        if states is not None and len(states) != len(loaders):
            warnings.warn(f"the checkpoint holds the states of {len(states)} validation loaders "
                          f"but val_dataloader() returned {len(loaders)}: they start afresh",
                          stacklevel=2)
            states = None
            resuming = None if resuming is None else _Pending()
        start = (0, 0)
        restored = states is not None and any(state is not None for state in states)
        if restored or (resuming is not None and resuming.positioned):
            start = _reposition(trainer, states, resuming)
        if states is not None and start[0] > 0:  # those loaders' pass is over: next pass
            self._loader_states = _overlaid(states[:start[0]], [None] * len(states))
            self._loaded_at = _loaded_at(trainer)
        origin = resuming.origin if resuming is not None else None
        if origin is None:
            origin = _states(trainer, loaders, self._after_sanity) or []
        self._after_sanity = False
        self._pass = _Pass(start=start, origin=origin)

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                  batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        if self._pass is not None and _fitting(trainer):
            self._pass.current = (dataloader_idx, batch_idx)
            self._pass.mark = _counts(trainer.fit_loop.epoch_loop.val_loop)[0] - 1

    def on_validation_epoch_end(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if self._pass is not None and _fitting(trainer):
            self._pass.complete = True

    # -- where a pass stands ----------------------------------------------------------------

    def _rest_of_pass(self, trainer: L.Trainer, loaders: list[Any], between: list[Any] | None
                      ) -> tuple[_Pending | None, list[Any] | None]:
        """The rest of the pass under way and the loader states to resume it from
        (``between``: the states to restore between passes)."""
        tracker = self._pass
        val_loop = trainer.fit_loop.epoch_loop.val_loop
        handed, stepped, _ = _counts(val_loop)
        if tracker is None or (tracker.complete and handed == 0):  # the last pass's: this one
            return _Pending(), between  # began, but our on_validation_start has not run yet
        if tracker.complete or (val_loop.batch_progress.is_last_batch and 0 < handed == stepped):
            return None, between
        j, k = tracker.start if tracker.current is None else tracker.current
        if tracker.current is not None and stepped > tracker.mark:  # its step is done
            k += 1
        origin = tracker.origin
        if not _sequential(trainer):
            return _Pending(batch_idx=k, replay=k, origin=origin), origin
        limits = val_loop.max_batches
        while j < len(loaders) and k >= limits[j]:  # that loader's part of the pass is done
            j, k = j + 1, 0
        if j == len(loaders):
            return None, between
        between = between if between is not None else [None] * len(loaders)
        states = [between[i] if i < j else origin[i] for i in range(len(loaders))]
        exact = handed == stepped and not _prefetched(trainer)
        if exact and k > 0 and _is_stateful(loaders[j]):
            states[j] = loaders[j].state_dict()  # its cursor is where the pass stands
            return _Pending(dataloader_idx=j, batch_idx=k, origin=origin), states
        return _Pending(dataloader_idx=j, batch_idx=k, replay=k, origin=origin), states


def _ended_under_max_steps(fit_loop: Any) -> bool:
    """Whether step-based training restarts from a checkpoint written after an epoch's last
    step, once the epoch loop ended: in ``on_train_epoch_end`` (``ModelCheckpoint``'s default
    without validation), or with the epoch counted completed (``trainer.save_checkpoint``
    after ``fit`` returned). Lightning keeps restarting there under ``max_steps``
    (``loops/fit_loop.py:139``). An epoch that ``max_steps`` cut short is no longer counted
    ended here (``_reopen_cut_epoch``). Nor is one at the epoch's last batch in
    ``on_train_batch_end``, which Lightning counts completed when it restarts there:
    ``on_train_start`` counts it ended, and the epoch loop's reset then steps the logger step
    (left restarting false here, it was one behind: 13 after 14 steps)."""
    if not fit_loop._iteration_based_training():
        return False
    total = fit_loop.epoch_progress.total
    completed = 0 < total.ready == total.started == total.processed == total.completed
    at_last_batch = fit_loop.epoch_loop.restarted_on_train_batch_end
    return fit_loop.restarted_on_epoch_end or (fit_loop.restarting and completed
                                               and not at_last_batch)


def _reopen_cut_epoch(loop: dict[str, Any], exhausted: bool | None) -> bool:
    """Count an epoch cut short (by ``max_steps``, or ``should_stop`` as ``EarlyStopping`` and
    ``Timer`` set it), in the fit loop's saved state ``loop``, as started and not processed,
    as a checkpoint after any of its other steps counts it, so that Lightning restarts inside
    it. Lightning ends the epoch loop there and
    counts the epoch processed before ``on_train_epoch_end`` (where ``ModelCheckpoint`` saves),
    and completed after it (where ``fit`` returns): resumed from either, the unread batches of
    the epoch were lost (3 of 6 after ``max_steps=3``, 2 after ``should_stop`` at step 4) or,
    once completed, the next epoch
    started from the cut one's batch count. An epoch ended at its last batch is left ended,
    and so is one whose data ran out before its ``len()``: ``exhausted``, the data fetcher's
    ``done`` when the checkpoint was written, tells them apart (``None``, from a checkpoint
    without it: not at its last batch, which took the second for a cut one and reopened it
    into the next epoch's batches). Returns whether the epoch was reopened."""
    epochs = loop.get("epoch_progress")
    batches = loop.get("epoch_loop.batch_progress")
    if not epochs or not batches:
        return False
    if exhausted if exhausted is not None else batches.get("is_last_batch", True):
        return False
    step = batches["current"]
    total = epochs["total"]
    if not (step["ready"] == step["processed"] == step["completed"] > 0
            and total["ready"] == total["started"] == total["processed"] > 0):
        return False
    for counts in (epochs["current"], total):
        counts["completed"] -= counts["completed"] == counts["processed"]
        counts["processed"] -= 1
    return True


def _step_counted_once(fit_loop: Any) -> None:
    """Keep the logger step (``_batches_that_stepped``) of a reopened epoch whose last step
    validated: Lightning restarts it as it does a checkpoint written at that validation's end
    (``on_validation_end``), with an iteration that trains nothing and counts the step
    (``loops/training_epoch_loop.py:286-289, 413-415``), which the epoch loop had counted
    before it ended (one more than the uninterrupted run: 11 after 10 steps)."""
    epoch_loop = fit_loop.epoch_loop
    fetcher = fit_loop._data_fetcher
    if (epoch_loop.restarted_on_last and fetcher is not None
            and epoch_loop._should_check_val_fx(fetcher) and not epoch_loop._should_accumulate()):
        epoch_loop._batches_that_stepped -= 1


def _resume_as_epoch_based(fit_loop: Any) -> None:
    """A checkpoint written after an epoch's last step resumes under ``max_steps`` as it does
    without: the finished epoch counted, nothing restarting, the next epoch started with its
    hooks and its batches counted from 0. Lightning counts that epoch unfinished
    (``loops/fit_loop.py:417``), or, counted, restarts the next epoch from the last one's
    batch count: the next epoch's first batch then ran as the finished epoch's ``batch_idx``
    ``len()``, and the epoch after it began; or that whole epoch was over at once."""
    progress = fit_loop.epoch_progress
    if progress.total.completed < progress.total.processed:
        progress.increment_completed()  # in its totals too, which a resume reads
    fit_loop._restarting = False  # its setter keeps it under max_steps
    fit_loop.epoch_loop.restarting = False
    fit_loop.reset_restart_stage()


def _count_as_epoch_end(epoch_loop: Any, batches: float) -> None:
    """Count a checkpoint at an epoch's last batch as that epoch's end on this layout too.

    Lightning clears an epoch's counts when, restarted there, its batch count reaches
    ``num_training_batches`` (``loops/training_epoch_loop.py`` ``reset``, after one more
    ``completed``). Resumed on fewer ranks (more batches per rank), an elastic loader's saved
    count falls short of the new ``num_training_batches``, and for an unsized loader it never
    reaches it: Lightning would take the next epoch for the rest of that one, ending it early
    or counting its ``batch_idx`` (and the validations an integer ``val_check_interval``
    places by it) on from the restored epoch's. As saved on the same layout: every batch
    handed over and done, the last not yet completed; an unsized loader's counts are cleared
    here, one short of the ``completed`` that ``reset`` adds."""
    current = epoch_loop.batch_progress.current
    if batches == float("inf"):
        for progress in (epoch_loop.batch_progress, epoch_loop.scheduler_progress,
                         epoch_loop.automatic_optimization.optim_progress):
            progress.reset_on_run()
        epoch_loop.val_loop.batch_progress.total.reset()
        current.completed = -1
        return
    if current.ready >= batches:
        return
    current.ready = current.started = current.processed = int(batches)
    current.completed = int(batches) - 1


def _count_from_loaders(trainer: L.Trainer) -> None:
    """Mid-epoch restart: count the epoch's batches (``batch_progress.current``, hence
    ``batch_idx``) from where the training loaders resume on this layout, so that Lightning,
    which ends the epoch when the count reaches ``num_training_batches``, asks for exactly
    the batches they have left. ``reset`` counts on from the saved ``completed``, one more
    when saved in ``on_train_batch_end``: a step a checkpoint interrupted runs again.

    Saved on another world size (an elastic resume), the count is in the old layout's units:
    resumed on more ranks, Lightning would stop early and the loaders' tail of the epoch be
    lost; on fewer, ``batch_idx`` would be off. On the same layout the counts agree and
    nothing changes. The logger step (``_batches_that_stepped``, which ``reset`` advances as
    if the saved step had stepped the optimizer) is kept as the saved count gives it, not
    advanced for an interrupted step (it steps when it runs again); with
    ``accumulate_grad_batches`` the accumulation then follows this layout's count."""
    target = _resume_batch(trainer)
    epoch_loop = trainer.fit_loop.epoch_loop
    current: Any = epoch_loop.batch_progress.current  # a _BatchProgress tracker
    interrupted = current.ready > current.processed
    stepped = not interrupted and not epoch_loop._should_accumulate()
    restart = current.completed + int(epoch_loop.restarted_on_train_batch_end)
    if target is not None and target != restart:
        shift = target - restart
        current.ready += shift
        current.started += shift
        current.processed += shift
        current.completed += shift
    if epoch_loop.restarted_on_train_batch_end or not epoch_loop.restarted_on_last:
        epoch_loop._batches_that_stepped += int(stepped) - int(not epoch_loop._should_accumulate())


def _resume_batch(trainer: L.Trainer) -> int | None:
    """The batch of the epoch at which the training loaders resume on this layout, counted as
    ``num_training_batches`` counts (``None``: not known, or nothing to count from).

    Each loader's ``resume_batch()`` says where it resumes in its own ``len()``; the combined
    count follows the loaders the mode ends the epoch with: a lone loader; in a
    ``CombinedLoader``, ``"max_size_cycle"`` the longest (the shorter ones cycle),
    ``"max_size"`` the one with most batches left, ``"min_size"`` the one with fewest;
    ``"sequential"`` and ``limit_train_batches`` below a loader's length are not counted."""
    combined = trainer.fit_loop._combined_loader
    total = trainer.num_training_batches
    if combined is None or total == float("inf") or combined._mode == "sequential":
        return None
    rests: list[tuple[int, int | None]] = []  # (length, batches left) per loader
    for loader, limit in zip(combined.flattened, combined.limits or repeat(float("inf")),
                             strict=False):
        length = sized_len(loader)
        if length is None or limit < length:
            return None
        resume_batch = getattr(loader, "resume_batch", None)
        batch = resume_batch() if callable(resume_batch) else None
        rests.append((length, None if batch is None else length - batch))
    if combined._mode == "max_size_cycle":
        longest = max(length for length, _ in rests)
        rests = [(length, rest) for length, rest in rests if length == longest]
    left = [rest for _, rest in rests if rest is not None]
    if not left or len(left) < len(rests):
        return None
    rest = min(left) if combined._mode == "min_size" else max(left)
    return min(max(int(total) - rest, 0), int(total))


def _state(epoch: int, pending: _Pending | None, loaders: list[Any] | None,
           loaded_at: int | None, cycled: list[bool] | None,
           exhausted: bool | None) -> dict[str, Any]:
    return {"version": _VERSION, "epoch": epoch,
            "pending": pending.to_dict() if pending is not None else None, "loaders": loaders,
            "loaded_at": loaded_at, "cycled": cycled, "exhausted": exhausted}


def _cycled(trainer: L.Trainer) -> list[bool] | None:
    """Which training loaders of a ``"max_size_cycle"`` ``CombinedLoader`` have ended in the
    epoch under way (its iterator's ``_consumed``, ``utilities/combined_loader.py:68-95``): the
    epoch ends when the last of them does. ``None`` in another mode, outside ``fit``, and
    inside a step (the batch fetched after the step's may have ended one)."""
    combined = trainer.fit_loop._combined_loader
    iterator = getattr(combined, "_iterator", None) if _fitting(trainer) else None
    consumed = getattr(iterator, "_consumed", None)
    if combined is None or combined._mode != "max_size_cycle" or not isinstance(consumed, list):
        return None
    return None if step_loaders(trainer) else list(consumed)


def _restore_cycled(trainer: L.Trainer, cycled: list[bool] | None) -> None:
    """Mid-epoch restart: put back which ``"max_size_cycle"`` members had ended (``_cycled``).
    A new iterator counts none, so the longest member, at its end, was iterated again into
    its next epoch where the uninterrupted run ended the combined epoch (its next epoch then
    began in the trainer's next, one epoch on: another order when shuffled)."""
    combined = trainer.fit_loop._combined_loader
    consumed = getattr(getattr(combined, "_iterator", None), "_consumed", None)
    if cycled is not None and isinstance(consumed, list) and len(consumed) == len(cycled):
        consumed[:] = cycled


def _loaded_at(trainer: L.Trainer) -> int | None:
    """The epoch in which the validation loaders were last built (``None``: not yet)."""
    epoch = trainer.fit_loop.epoch_loop.val_loop._last_val_dl_reload_epoch
    return int(epoch) if epoch != float("-inf") else None


def _rebuilt_since(trainer: L.Trainer, loaded_at: int | None) -> bool:
    """Whether the uninterrupted run, whose validation loaders were built in epoch
    ``loaded_at``, built them anew for the pass starting now (``reload_dataloaders_every_n_
    epochs``, by Lightning's rule, from a module's or datamodule's hook: loaders passed to
    ``fit`` are the same objects at every reload, and go on). If it did not, this also puts
    Lightning's record of that build back, so the next rebuild comes where that run's came
    (the resumed run built its loaders in its own first epoch)."""
    every = getattr(trainer, "reload_dataloaders_every_n_epochs", 0)  # set by its data connector
    if not every or loaded_at is None:
        return False
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    if trainer.current_epoch - loaded_at >= every and val_loop._data_source.is_module():
        return True
    val_loop._last_val_dl_reload_epoch = loaded_at
    return False


def _warn_unresumable(trainer: L.Trainer) -> None:
    """Warn of training loaders without ``state_dict()`` (a plain ``DataLoader`` returned by a
    module's or a plain datamodule's hook, which is left to it): Lightning restarts their epoch
    on resume, so its first samples repeat and the others are lost. A ``ResumableDataModule``
    has warned of those it could not convert already, as its hook returned them."""
    if isinstance(trainer.fit_loop._data_source.instance, ResumableDataModule):
        return
    combined = trainer.fit_loop._combined_loader
    plain = [f"{index} ({type(loader).__name__})"
             for index, loader in enumerate(combined.flattened if combined is not None else [])
             if not is_stateful(loader)]
    if not plain:
        return
    if user_shards(trainer):
        fix = ("Under Trainer(use_distributed_sampler=False) on several processes, ExactResume "
               "leaves the DataLoaders passed to fit() as they are: each rank reads its own as "
               "given, so one whose sampler splits the data by rank is not split again. For "
               "an exact resume pass make_resumable(loader) over the whole dataset's sampler "
               "(it gives each rank its share)")
    else:
        fix = ("ExactResume converts plain DataLoaders and webdataset.WebLoaders passed to "
               "fit() only; return a resumable one from the hook "
               "(lightning_loaders.make_resumable, or a ResumableDataModule)")
    warnings.warn(f"training loader {', '.join(plain)} has no state_dict(): a resume restarts "
                  "its epoch, repeating the samples read before the checkpoint and losing "
                  f"others. {fix}", stacklevel=2)


def _fitting(trainer: L.Trainer) -> bool:
    return trainer.state.fn == TrainerFn.FITTING and not trainer.sanity_checking


def _counts(loop: Any) -> tuple[int, int, int]:
    """``(ready, processed, completed)`` of a loop's batches in the current epoch or pass."""
    current = loop.batch_progress.current
    return current.ready, current.processed, current.completed


def _validation_due(trainer: L.Trainer) -> bool:
    """Whether this is ``on_train_batch_end`` of a step after which validation runs."""
    fit_loop = trainer.fit_loop
    epoch_loop = fit_loop.epoch_loop
    ready, processed, completed = _counts(epoch_loop)
    after_step = 0 < ready == processed == completed + 1
    if not trainer.training or not after_step or epoch_loop._skip_next_val:
        return False
    data_fetcher = fit_loop._data_fetcher
    return data_fetcher is not None and bool(epoch_loop._should_check_val_fx(data_fetcher))


def _val_loaders(trainer: L.Trainer) -> list[Any]:
    combined = trainer.fit_loop.epoch_loop.val_loop._combined_loader
    return list(combined.flattened) if combined is not None else []


def _sequential(trainer: L.Trainer) -> bool:
    combined = trainer.fit_loop.epoch_loop.val_loop._combined_loader
    return combined is not None and combined._mode == "sequential"


def _prefetched(trainer: L.Trainer) -> bool:
    """Whether Lightning holds batches it fetched ahead (an unsized validation loader)."""
    fetcher = trainer.fit_loop.epoch_loop.val_loop._data_fetcher
    return bool(getattr(fetcher, "batches", None))


def _is_stateful(loader: Any) -> bool:
    return callable(getattr(loader, "state_dict", None)) and callable(
        getattr(loader, "load_state_dict", None))


def _states(trainer: L.Trainer, loaders: Sequence[Any], after_sanity: bool
            ) -> list[Any] | None:
    """The validation loaders' states to restore between passes (``None``: no loaders yet);
    ``None`` for a loader without state and one no pass has read yet (it starts at the
    trainer's epoch when restored as when new). A loader whose last pass (``after_sanity``:
    the sanity check) left it mid-epoch starts its next epoch at the next pass, where its
    state would continue: this package's state is marked ``abandoned`` (it then does the
    same), another loader's is ``None`` (it starts afresh)."""
    if not loaders:
        return None
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    limits = val_loop.max_batches
    if after_sanity:
        limits = [min(limit, trainer.num_sanity_val_steps) for limit in limits]
    combined = val_loop._combined_loader
    mode = combined._mode if combined is not None else "sequential"
    states: list[Any] = []
    for loader, read in zip(loaders, _batches_read(mode, loaders, limits), strict=True):
        state = loader.state_dict() if _is_stateful(loader) else None
        if state is not None and _mid_epoch(loader, read) and not _epoch_unread(state):
            state = abandoned(state)
        states.append(None if state is None or _unread(state) else state)
    return states


def _batches_read(mode: str, loaders: Sequence[Any], limits: Sequence[float]) -> list[float]:
    """Batches a pass reads of each loader: its limit, at most its length; in the modes that
    read every loader alike, the longest's (``max_size_cycle``, which cycles the others) or
    the shortest's (``min_size``)."""
    own = [min(limit, _length(loader)) for loader, limit in zip(loaders, limits, strict=True)]
    if mode == "max_size_cycle":
        return [max(own)] * len(own)
    if mode == "min_size":
        return [min(own)] * len(own)
    return own


def _length(loader: Any) -> float:
    length = sized_len(loader)
    return float("inf") if length is None else length


def _mid_epoch(loader: Any, read: float) -> bool:
    """Whether reading ``read`` batches leaves the loader inside an epoch; with a length
    unknown it may, and is taken to: a state marked ``abandoned`` at its epoch's end begins
    the same next epoch as the state itself (``EpochOwner.begin_epoch``)."""
    length = _length(loader)
    if float("inf") in (read, length):
        return True
    return read % length != 0


def _epoch_unread(state: Any) -> bool:
    """Whether a loader's state (this package's) has handed over nothing of its epoch: the
    pass that leaves it mid-epoch is the one starting (its state at ``on_validation_start``),
    not one before it."""
    return isinstance(state, dict) and state.get("batches") == 0


def _unread(state: Any) -> bool:
    """Whether a loader's state (this package's) is a loader's no pass has read: at batch 0,
    under no trainer epoch (every pass declares one)."""
    return (isinstance(state, dict) and state.get("batches") == 0 and "trainer_epoch" in state
            and state["trainer_epoch"] is None)


def _overlaid(first: Sequence[Any] | None, then: list[Any] | None) -> list[Any] | None:
    """``first``'s states where it has one (a restored state not yet applied), else
    ``then``'s, over ``then``'s loaders."""
    if first is None or then is None:
        return then if first is None else list(first)
    return [first[i] if i < len(first) and first[i] is not None else state
            for i, state in enumerate(then)]


def _reposition(trainer: L.Trainer, states: list[Any] | None, resuming: _Pending | None
                ) -> tuple[int, int]:
    """Give the validation loaders the pass still reads their ``states`` and move the
    pass's iterator, made by the loop's ``reset()`` and not read yet, to where ``resuming``
    goes on; returns that ``(dataloader_idx, batch_idx)``. The loaders before it are done
    with this pass: restored now, before the next pass's ``set_epoch``, they would stay at
    their epoch's end through that pass."""
    val_loop = trainer.fit_loop.epoch_loop.val_loop
    combined = val_loop._combined_loader
    fetcher = val_loop._data_fetcher
    assert combined is not None and fetcher is not None
    loaders = combined.flattened
    resuming = resuming or _Pending()
    j, k, replay = resuming.dataloader_idx, resuming.batch_idx, resuming.replay
    for loader, state in list(zip(loaders, states or [None] * len(loaders), strict=True))[j:]:
        if state is not None and _is_stateful(loader):
            loader.load_state_dict(state)
    iterator: Any = combined._iterator
    replayed = loaders[j:j + 1] if combined._mode == "sequential" else loaders
    if replay and any(getattr(loader, "in_order", True) is False for loader in replayed):
        warnings.warn(f"ExactResume resumes this validation pass by replaying its first {replay} "
                      "batches in the plan's order, but a validation loader has in_order=False: "
                      "the batches validated before the checkpoint came in the order its workers "
                      "finished them, so some may now be validated twice and others not at all. "
                      "Give validation loaders in_order=True where a checkpoint may fall inside "
                      "a validation pass", stacklevel=2)
    if combined._mode == "sequential":
        iterator._iterator_idx = j
        iterator._idx = k - replay
        iterator._load_current_iterator()
        before = sum(val_loop.max_batches[:j]) + k
    else:
        iter(iterator)
        before = k
    for _ in range(replay):
        next(iterator)
    fetcher.fetched = int(before) if before != float("inf") else 0
    prefetched = getattr(fetcher, "batches", None)
    if prefetched:
        prefetched.clear()
    return j, k


@contextmanager
def _epoch_as(trainer: L.Trainer, epoch: int) -> Iterator[None]:
    """``trainer.current_epoch == epoch`` inside (``FitLoop.reset`` may have moved it on), in
    the epoch counts' totals too: a checkpoint written inside (``ModelCheckpoint`` saves in
    ``on_validation_end``) then counts that epoch unfinished, as the uninterrupted run's does.
    With the totals counting it finished Lightning took it for no restart and ran that epoch
    again, empty, with its ``on_train_epoch_start`` and ``on_train_epoch_end``."""
    progress = trainer.fit_loop.epoch_progress
    trackers: tuple[Any, ...] = (progress.current, progress.total)  # _ProcessedTrackers
    shift = progress.current.completed - epoch
    for counts in trackers:
        counts.completed -= shift
        counts.processed -= shift
    try:
        yield
    finally:
        for counts in trackers:
            counts.completed += shift
            counts.processed += shift
