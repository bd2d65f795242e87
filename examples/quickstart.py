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
import logging
import sys
import tempfile
import warnings
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import Dataset

from lightning_loaders import ResumableLoader


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


class SimulatedCrash(RuntimeError):
    pass


class CrashAfterStep(Callback):
    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_start(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            raise SimulatedCrash(f"simulated crash after step {self.step}")


def fit(args: argparse.Namespace, callbacks: list[Callback], ckpt_path: str | None = None
        ) -> list[list[int]]:
    model = LineModel()
    loader = ResumableLoader(NoisyLine(args.samples), batch_size=args.batch_size, shuffle=True,
                             seed=42, num_workers=args.num_workers)
    trainer = L.Trainer(max_epochs=args.epochs, accelerator="cpu", devices=1, logger=False,
                        enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks, enable_checkpointing=any(
                            isinstance(c, ModelCheckpoint) for c in callbacks))
    try:
        trainer.fit(model, loader, ckpt_path=ckpt_path)
    except SimulatedCrash:
        pass
    return model.seen


def main() -> int:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*ckpt_path.*callbacks used to create")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=103)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--epochs", type=int, default=3)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--crash-at-step", type=int, default=17)
    args = parser.parse_args()

    full = fit(args, [])
    with tempfile.TemporaryDirectory() as tmp:
        every_step = ModelCheckpoint(dirpath=tmp, every_n_train_steps=1, save_top_k=-1,
                                     filename="{step}")
        before = fit(args, [every_step, CrashAfterStep(args.crash_at_step)])
        last = Path(tmp) / f"step={args.crash_at_step}.ckpt"
        after = fit(args, [], ckpt_path=str(last))

    per_epoch = len(full) // args.epochs
    epoch, batch = divmod(len(before), per_epoch)
    print(f"uninterrupted run:      {len(full)} batches ({args.epochs} epochs x {per_epoch})")
    print(f"batches before crash:   {len(before)} (crashed in epoch {epoch} after batch {batch})")
    print(f"batches after resume:   {len(after)} (resumed from {last.name})")
    print(f"first batch after resume: {after[0]}")
    print(f"uninterrupted run there:  {full[len(before)]}")
    identical = before + after == full
    print(f"identical to an uninterrupted run: {'yes' if identical else 'NO'}")
    return 0 if identical else 1


if __name__ == "__main__":
    sys.exit(main())
