"""A LightningDataModule of ordinary DataLoaders, made distributed and exactly resumable.

``ResumableDataModule`` converts what its hooks return: the training loader here samples with a
``DynamicWeightedSampler`` that a callback re-weights after every step from the per-sample
losses (hard samples are drawn more often), and validation uses ``batch_size=1``. The model
reads ``trainer.estimated_stepping_batches`` in ``configure_optimizers``, which makes Lightning
itself skip restoring loader state (Lightning #20550); the datamodule's own state carries the
cursor and the current weights instead. Trains uninterrupted, then crashes after
``--crash-at-step`` and resumes from that step's checkpoint, and compares the two streams.

    python examples/datamodule.py [--num-workers 2] [--crash-at-step 13]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial
from typing import Any

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import DataLoader, Dataset

from lightning_loaders import DynamicWeightedSampler, ResumableDataModule

from _crash_resume import crash_and_resume, quiet, report, train


class NoisyLine(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Generated regression data ``y = 3x + 1 + noise``; every tenth sample is an outlier."""

    def __init__(self, n: int, seed: int) -> None:
        generator = torch.Generator().manual_seed(seed)
        self.x = torch.rand(n, 1, generator=generator)
        self.y = 3 * self.x + 1 + 0.05 * torch.randn(n, 1, generator=generator)
        self.y[::10] += 2.0

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


class LineData(ResumableDataModule):
    """Plain DataLoaders, as anyone writes them; the base class does the rest."""

    def __init__(self, samples: int, batch_size: int, num_workers: int) -> None:
        super().__init__()
        self.train_set, self.val_set = NoisyLine(samples, 0), NoisyLine(samples // 4 + 1, 1)
        self.batch_size, self.num_workers = batch_size, num_workers
        self.weights = DynamicWeightedSampler(torch.ones(samples))

    def train_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.train_set, batch_size=self.batch_size, sampler=self.weights,
                          num_workers=self.num_workers, persistent_workers=self.num_workers > 0)

    def val_dataloader(self) -> DataLoader[Any]:
        return DataLoader(self.val_set, batch_size=1)


class LineModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[list[int]] = []
        self.validated: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> dict[str, torch.Tensor]:
        x, y, index = batch
        self.seen.append(index.tolist())
        per_sample = (self.layer(x) - y).pow(2).squeeze(1)
        return {"loss": per_sample.mean(), "per_sample": per_sample.detach()}

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.validated += batch[2].tolist()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        steps = self.trainer.estimated_stepping_batches  # what triggers Lightning #20550
        assert steps > 0
        return torch.optim.SGD(self.parameters(), lr=0.1)


class LossReweighting(Callback):
    """After every step: weight each trained sample by its loss (on every rank: the update is
    gathered across ranks, so all ranks keep drawing from the same weights)."""

    def __init__(self, weights: DynamicWeightedSampler) -> None:
        self.weights = weights

    def on_train_batch_end(self, trainer: L.Trainer, module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        self.weights.update_weights(batch[2], outputs["per_sample"] + 0.01)


def fit(args: argparse.Namespace, callbacks: list[Callback], ckpt_path: str | None = None
        ) -> LineModel:
    L.seed_everything(42, verbose=False)  # the model's initial weights, and the loaders' seed
    model = LineModel()
    data = LineData(args.samples, args.batch_size, args.num_workers)
    train(model, args.epochs, [LossReweighting(data.weights), *callbacks], ckpt_path,
          datamodule=data)
    return model


def main() -> int:
    quiet(".*does not have many workers")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--crash-at-step", type=int, default=13)
    args = parser.parse_args()

    full, before, after = crash_and_resume(partial(fit, args), args.crash_at_step)
    outliers = sum(i % 10 == 0 for batch in full.seen for i in batch)
    drawn = sum(len(batch) for batch in full.seen)
    print(f"training draws:          {drawn} ({outliers / drawn:.0%} outliers, 10% of the data: "
          "the loss re-weighting draws hard samples more often)")
    val_samples = args.samples // 4 + 1
    once = sorted(full.validated) == sorted(list(range(val_samples)) * args.epochs)
    print(f"validation, batch_size=1: each of {val_samples} samples once per epoch: {once}")
    return 0 if report(full.seen, before.seen, after.seen) and once else 1


if __name__ == "__main__":
    sys.exit(main())
