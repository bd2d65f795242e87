"""Rank script: a ``ResumableDataModule`` of plain ``DataLoader``s under real DDP.

One training loader per sampler kind (a dict, so Lightning combines them), trained for two
epochs with a checkpoint after every step and ``use_distributed_sampler=True``, then resumed from
mid-epoch checkpoints with ``use_distributed_sampler=False``. ``configure_optimizers`` reads
``trainer.estimated_stepping_batches`` (Lightning #20550), so only the datamodule's state can
restore the cursors. A callback re-weights the dynamic sampler after every step. Validation uses
dataset sizes not divisible by the world size (one with ``batch_size=1``); prediction goes
through a ``BasePredictionWriter``.

    python tests/scripts/datamodule_ddp.py ROOT   (launched by tests/ddp_harness.run_ddp)
"""

from __future__ import annotations

import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import BasePredictionWriter, ModelCheckpoint
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    RandomSampler,
    Sampler,
    SequentialSampler,
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from lightning_loaders import DynamicWeightedSampler, ResumableDataModule
from tests.conftest import IndexDataset

SEED = 7
N = 22  # with batch_size 4 on 2 ranks: 3 batches per epoch for every kind below
BATCH = 4
EPOCHS = 2
RESUME_STEPS = (2, 4)
VAL_SIZES = ((7, 1), (9, 2))  # (samples, batch_size): neither divisible by the world size
PREDICT_N = 9
WEIGHTS = [float(i % 3) for i in range(N)]  # every third weight is zero


class Drawn(Sampler[int]):
    """A user sampler with no known semantics: shuffles with torch's global RNG."""

    def __len__(self) -> int:
        return N

    def __iter__(self) -> Any:
        return iter(torch.randperm(N).tolist())


class Chunks(Sampler[list[int]]):
    """A user batch sampler: fixed-size chunks of a global-RNG permutation."""

    def __len__(self) -> int:
        return (N + BATCH - 1) // BATCH

    def __iter__(self) -> Any:
        perm = torch.randperm(N).tolist()
        return iter([perm[i:i + BATCH] for i in range(0, N, BATCH)])


def train_loaders(dynamic: Sampler[int]) -> dict[str, DataLoader[Any]]:
    """The plain loaders a user would write, one per sampler kind."""
    ds = IndexDataset(N)
    samplers: dict[str, Any] = {
        "sequential": SequentialSampler(ds),
        "random": RandomSampler(ds),
        "random_replacement": RandomSampler(ds, replacement=True, num_samples=20),
        "random_num_samples": RandomSampler(ds, num_samples=18),
        "subset": SubsetRandomSampler(list(range(1, 20))),
        "weighted": WeightedRandomSampler(WEIGHTS, 24),
        "weighted_no_replacement": WeightedRandomSampler(np.arange(1, N + 1.0), 17,
                                                         replacement=False),
        "drawn": Drawn(),
        "dynamic": dynamic,
    }
    loaders = {kind: DataLoader(ds, batch_size=BATCH, sampler=s) for kind, s in samplers.items()}
    loaders["batch_sampler"] = DataLoader(ds, batch_sampler=BatchSampler(RandomSampler(ds), BATCH,
                                                                         False))
    loaders["drawn_batches"] = DataLoader(ds, batch_sampler=Chunks())
    loaders["shuffle"] = DataLoader(ds, batch_size=BATCH, shuffle=True)
    return loaders


def reweigh(weights: DynamicWeightedSampler, seen: torch.Tensor) -> None:
    """The re-weighting after each step (every rank passes its own samples)."""
    weights.update_weights(seen, weights.weights[seen.numpy()] * 0.25 + 0.01)


class Data(ResumableDataModule):
    def __init__(self) -> None:
        super().__init__()
        self.dynamic = DynamicWeightedSampler(torch.ones(N), num_samples=24)

    def train_dataloader(self) -> dict[str, DataLoader[Any]]:
        return train_loaders(self.dynamic)

    def val_dataloader(self) -> list[DataLoader[Any]]:
        return [DataLoader(IndexDataset(n), batch_size=bs) for n, bs in VAL_SIZES]

    def predict_dataloader(self) -> DataLoader[Any]:
        return DataLoader(IndexDataset(PREDICT_N), batch_size=1)


class Model(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.train_seen: list[Any] = []
        self.val_seen: list[Any] = []

    def training_step(self, batch: dict[str, Any], batch_idx: int) -> torch.Tensor:
        self.train_seen.append([self.current_epoch, batch_idx,
                                {kind: b["index"].tolist() for kind, b in batch.items()}])
        return (self.weight - 1.0).pow(2).sum()

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.val_seen.append([self.current_epoch, dataloader_idx, batch_idx,
                              batch["index"].tolist()])

    def predict_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        return batch["index"]

    def configure_optimizers(self) -> torch.optim.Optimizer:
        assert self.trainer.estimated_stepping_batches > 0  # Lightning #20550's trigger
        return torch.optim.SGD(self.parameters(), lr=0.1)


class Reweigh(L.Callback):
    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        batch = args[2]
        reweigh(trainer.datamodule.dynamic, batch["dynamic"]["index"])


class Writer(BasePredictionWriter):
    def __init__(self) -> None:
        super().__init__("batch")
        self.rows: list[Any] = []

    def write_on_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                           prediction: Any, batch_indices: Any, *args: Any) -> None:
        self.rows.append([list(batch_indices), prediction.tolist()])


def trainer(root: Path, use_distributed_sampler: bool, callbacks: list[Any]) -> L.Trainer:
    return L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=EPOCHS,
                     logger=False, enable_progress_bar=False, enable_model_summary=False,
                     num_sanity_val_steps=0, default_root_dir=str(root),
                     use_distributed_sampler=use_distributed_sampler,
                     enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks),
                     callbacks=[Reweigh(), *callbacks])


def main() -> None:
    from tests.ddp_harness import write_result

    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    root = Path(sys.argv[1])
    L.seed_everything(SEED, verbose=False)
    checkpoints = root / "checkpoints"
    model = Model()
    every_step = ModelCheckpoint(dirpath=checkpoints, every_n_train_steps=1, save_top_k=-1,
                                 filename="{step}")
    trainer(root, True, [every_step]).fit(model, datamodule=Data())
    resumed = {}
    for step in RESUME_STEPS:
        again = Model()
        trainer(root, False, []).fit(again, datamodule=Data(),
                                     ckpt_path=str(checkpoints / f"step={step}.ckpt"))
        resumed[step] = again.train_seen
    writer = Writer()
    trainer(root, False, [writer]).predict(Model(), datamodule=Data(), return_predictions=False)
    write_result({"full": model.train_seen, "resumed": resumed, "val": model.val_seen,
                  "predict": writer.rows})


if __name__ == "__main__":
    main()
