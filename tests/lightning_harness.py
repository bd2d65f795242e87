"""Real Lightning ``Trainer`` runs that record what every training step saw.

``fit_recording`` trains a tiny model and returns ``(epoch, batch_idx, key(batch))`` per step;
``check_trainer_resume`` checkpoints after every step, resumes from each checkpoint with
``Trainer.fit(ckpt_path=...)`` in a new Trainer and model, and compares with the uninterrupted
run. Used for the core loader, iterables and adapters alike. ``fetched_cases`` reads several
loaders through Lightning's data fetcher alone (``ddp_harness.through_lightning``), without a
Trainer, on every rank of a process group.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from tests.ddp_harness import through_lightning

Step = tuple[int, int, Any]

logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
warnings.filterwarnings("ignore", message=".*(does not have many workers|ckpt_path|LeafSpec).*")


def default_key(batch: Any) -> Any:
    """Sample indices of a batch from ``tests.conftest.IndexDataset`` (or a dict of them)."""
    if isinstance(batch, dict) and "index" in batch:
        return batch["index"].tolist()
    if isinstance(batch, dict):
        return {name: default_key(b) for name, b in batch.items()}
    if isinstance(batch, list | tuple):
        return [default_key(b) for b in batch]
    return batch.tolist() if isinstance(batch, torch.Tensor) else batch


class RecordingModule(L.LightningModule):
    """A one-parameter model whose ``seen`` lists every training step's batch key."""

    def __init__(self, key: Callable[[Any], Any] = default_key) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.key = key
        self.seen: list[Step] = []

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.seen.append((self.current_epoch, batch_idx, self.key(batch)))
        return (self.weight - 1.0).pow(2).sum()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


class EvaluatingModule(RecordingModule):
    """Records the batch keys of every validation, test and predict step, by stage."""

    def __init__(self, key: Callable[[Any], Any] = default_key) -> None:
        super().__init__(key)
        self.evaluated: dict[str, list[Any]] = {"validate": [], "test": [], "predict": []}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluated["validate"].append(self.key(batch))

    def test_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluated["test"].append(self.key(batch))

    def predict_step(self, batch: Any, batch_idx: int) -> None:
        self.evaluated["predict"].append(self.key(batch))


def fetched_cases(cases: Mapping[str, Callable[[], Any]],
                  key: Callable[[Any], list[Any]] = default_key,
                  read: Callable[[Any], Iterable[Any]] = through_lightning) -> dict[str, Any]:
    """One rank's reading of each case's loader under a process group: built, two epochs read
    by ``read`` (``through_lightning``, else ``iter`` for a loop of the user's; each ``iter()``
    begins the next epoch), closed, then a barrier. Per case ``{"epochs": [[...], [...]]}``
    (each epoch's samples, as ``key`` lists a batch's), with ``"error": "<type>: <message>"``
    when it raised (after the epochs it read)."""
    results: dict[str, Any] = {}
    for name, build in cases.items():
        loader = build()
        epochs: list[list[Any]] = []
        try:
            for _ in range(2):
                epochs.append([item for batch in read(loader) for item in key(batch)])
            results[name] = {"epochs": epochs}
        except Exception as exc:  # reported to the launching test
            results[name] = {"error": f"{type(exc).__name__}: {exc}", "epochs": epochs}
        loader.close()
        torch.distributed.barrier()
    return results


def evaluate_recording(make_loader: Callable[[], Any], root: Path,
                       key: Callable[[Any], Any] = default_key) -> dict[str, list[Any]]:
    """``Trainer.validate``, ``test`` and ``predict`` on fresh loaders; the keys each saw."""
    model = EvaluatingModule(key)
    trainer = make_trainer(root, 1)
    trainer.validate(model, make_loader(), verbose=False)
    trainer.test(model, make_loader(), verbose=False)
    trainer.predict(model, make_loader(), return_predictions=False)
    return model.evaluated


def make_trainer(root: Path, max_epochs: int, callbacks: Iterable[Any] = (),
                 **kwargs: Any) -> L.Trainer:
    callbacks = list(callbacks)
    options: dict[str, Any] = {
        "max_epochs": max_epochs, "accelerator": "cpu", "devices": 1, "logger": False,
        "enable_progress_bar": False, "enable_model_summary": False,
        "num_sanity_val_steps": 0, "default_root_dir": str(root),
        "enable_checkpointing": any(isinstance(c, ModelCheckpoint) for c in callbacks),
        "callbacks": callbacks,
    }
    options.update(kwargs)
    return L.Trainer(**options)


def every_step_checkpoints(directory: Path) -> ModelCheckpoint:
    return ModelCheckpoint(dirpath=directory, every_n_train_steps=1, save_top_k=-1,
                           filename="{step}")


def fit_recording(make_loader: Callable[[], Any], root: Path, max_epochs: int,
                  callbacks: Iterable[Any] = (), ckpt_path: Path | None = None,
                  model: RecordingModule | None = None, **trainer_kwargs: Any) -> list[Step]:
    """Train with a fresh loader (and model); returns what each step saw."""
    model = model or RecordingModule()
    trainer = make_trainer(root, max_epochs, callbacks, **trainer_kwargs)
    trainer.fit(model, make_loader(), ckpt_path=str(ckpt_path) if ckpt_path else None)
    return model.seen


def checkpoint_at(directory: Path, step: int) -> Path:
    return directory / f"step={step}.ckpt"


def check_trainer_resume(make_loader: Callable[[], Any], root: Path, max_epochs: int,
                         steps: Iterable[int] | None = None, batch_idx: bool = True,
                         **trainer_kwargs: Any) -> list[Step]:
    """Resume from the checkpoint after each of ``steps`` (default: all) and compare.

    ``batch_idx=False`` compares epochs and batches only: for unsized loaders Lightning itself
    keeps counting ``batch_idx`` across an epoch boundary when restarted at an epoch's end.
    """
    directory = root / "checkpoints"
    full = fit_recording(make_loader, root, max_epochs, [every_step_checkpoints(directory)],
                         **trainer_kwargs)
    assert full, "the uninterrupted run trained on nothing"
    for step in steps if steps is not None else range(1, len(full) + 1):
        resumed = fit_recording(make_loader, root, max_epochs,
                                ckpt_path=checkpoint_at(directory, step), **trainer_kwargs)
        if not batch_idx:
            resumed = [(e, 0, b) for e, _, b in resumed]
            full = [(e, 0, b) for e, _, b in full]
        assert resumed == full[step:], (
            f"resume from step {step} diverged:\n  got      {resumed[:3]}\n"
            f"  expected {full[step:step + 3]}"
        )
    return full
