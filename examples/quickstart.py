"""Quickstart: a run killed mid-epoch resumes with exactly the batches it would have seen.

Trains a tiny model three times on generated data with ``ResumableLoader``:
  1. uninterrupted, recording which samples every step saw;
  2. crashed on purpose after step ``--crash-at-step`` (checkpoints are written every step);
  3. resumed from the last checkpoint with ``Trainer.fit(..., ckpt_path=...)``.
It prints both streams side by side and whether 2 + 3 equals 1.

    python examples/quickstart.py [--num-workers 2] [--crash-at-step 17]
"""

from __future__ import annotations

import argparse
import sys
from functools import partial

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback
from torch.utils.data import Dataset

from lightning_loaders import ResumableLoader

from _crash_resume import crash_and_resume, quiet, report, train


class NoisyLine(Dataset[tuple[torch.Tensor, torch.Tensor, int]]):
    """Generated regression data: ``y = 3x + 1 + noise``; each sample also says its index."""

    def __init__(self, n: int) -> None:
        generator = torch.Generator().manual_seed(0)
        self.x = torch.rand(n, 1, generator=generator)
        self.y = 3 * self.x + 1 + 0.05 * torch.randn(n, 1, generator=generator)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, torch.Tensor, int]:
        return self.x[index], self.y[index], index


class LineModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[list[int]] = []

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, y, index = batch
        self.seen.append(index.tolist())
        return torch.nn.functional.mse_loss(self.layer(x), y)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def fit(args: argparse.Namespace, callbacks: list[Callback], ckpt_path: str | None = None
        ) -> list[list[int]]:
    """One training run; the dataset indices of every batch it trained on."""
    model = LineModel()
    loader = ResumableLoader(NoisyLine(args.samples), batch_size=args.batch_size, shuffle=True,
                             seed=42, num_workers=args.num_workers)
    train(model, args.epochs, callbacks, ckpt_path, train_dataloaders=loader)
    return model.seen


def main() -> int:
    quiet()
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=103)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--crash-at-step", type=int, default=17)
    args = parser.parse_args()

    full, before, after = crash_and_resume(partial(fit, args), args.crash_at_step)
    per_epoch = len(full) // args.epochs
    epoch, batch = divmod(len(before), per_epoch)
    print(f"uninterrupted run:       {len(full)} batches ({args.epochs} epochs x {per_epoch})")
    print(f"crashed in epoch {epoch} after batch {batch}; resumed from the checkpoint of step "
          f"{args.crash_at_step}")
    return 0 if report(full, before, after) else 1


if __name__ == "__main__":
    sys.exit(main())
