"""The crash-and-resume demonstration the examples share.

``crash_and_resume`` trains three times: uninterrupted; crashing on purpose after a given
step, with a checkpoint written at every step; and resumed from that step's checkpoint with
``Trainer.fit(..., ckpt_path=...)``. ``report`` prints where the streams meet and whether the
crashed run plus the resumed one saw exactly the batches of the uninterrupted run.
"""

from __future__ import annotations

import logging
import tempfile
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any, TypeVar

import lightning as L
from lightning.pytorch.callbacks import Callback, ModelCheckpoint

__all__ = ["SimulatedCrash", "crash_and_resume", "quiet", "report", "train"]

T = TypeVar("T")


class SimulatedCrash(RuntimeError):
    """Raised on purpose: the run ends here as if the machine had died."""


class _CrashAfterStep(Callback):
    def __init__(self, step: int) -> None:
        self.step = step
        self.crashed = False

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            self.crashed = True
            raise SimulatedCrash(f"simulated crash after step {self.step}")


def quiet(*expected_warnings: str) -> None:
    """Silence Lightning's info logging, its warning about callbacks with ``ckpt_path``, its
    deprecation warning under newer torch (``LeafSpec``), and the warnings (message regexes)
    the example expects."""
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    for message in (".*ckpt_path.*callbacks used to create", ".*LeafSpec",
                    *expected_warnings):
        warnings.filterwarnings("ignore", message=message)


def train(model: L.LightningModule, epochs: int, callbacks: Sequence[Callback],
          ckpt_path: str | None = None, **fit_kwargs: Any) -> None:
    """``Trainer.fit`` on the CPU without logs or progress bars; a ``SimulatedCrash`` ends it
    as a killed run would end (what the checkpoints hold is all that is left)."""
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, callbacks=list(callbacks),
                        enable_checkpointing=any(isinstance(c, ModelCheckpoint)
                                                 for c in callbacks))
    try:
        trainer.fit(model, ckpt_path=ckpt_path, **fit_kwargs)
    except SimulatedCrash:
        pass


def crash_and_resume(run: Callable[[list[Callback], str | None], T], crash_at_step: int
                     ) -> tuple[T, T, T]:
    """``run(callbacks, ckpt_path)`` three times: uninterrupted; crashing after
    ``crash_at_step`` with a checkpoint at every step; resumed from that step's checkpoint.
    Returns what the three runs returned."""
    if crash_at_step < 1:
        raise SystemExit(f"--crash-at-step must be at least 1 (a step to resume after), got "
                         f"{crash_at_step}")
    full = run([], None)
    with tempfile.TemporaryDirectory() as tmp:
        every_step = ModelCheckpoint(dirpath=tmp, every_n_train_steps=1, save_top_k=-1,
                                     filename="{step}")
        crash = _CrashAfterStep(crash_at_step)
        before = run([every_step, crash], None)
        if not crash.crashed:
            raise SystemExit(f"--crash-at-step {crash_at_step}: the run ended before a step "
                             "came after it; choose an earlier step")
        after = run([], str(Path(tmp) / f"step={crash_at_step}.ckpt"))
    return full, before, after


def report(full: Sequence[Any], before: Sequence[Any], after: Sequence[Any]) -> bool:
    """Print the batches (one entry per training step) around the resume; whether the crashed
    run plus the resumed one equal the uninterrupted run."""
    print(f"batches before crash:    {len(before)}; after resume: {len(after)}")
    print(f"first batch after resume: {after[0]}")
    print(f"uninterrupted run there:  {full[len(before)]}")
    identical = [*before, *after] == list(full)
    print(f"identical to an uninterrupted run: {'yes' if identical else 'NO'}")
    return identical
