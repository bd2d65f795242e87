"""FFCV with Lightning: write a small image dataset to a .beton, train on it with Trainer.fit.

The images are generated: noisy 16x16 squares whose colour is the class (red, green, blue).
``write_beton`` writes them with a progress bar; ``FFCVLoader`` reads them back with FFCV's
JIT-compiled pipelines, in a per-epoch shuffle planned from the seed, sharded by rank, resumable
from any checkpoint, on the trainer's device (CPU by default). The script then resumes from a
checkpoint written mid-epoch and checks that the remaining batches are the ones the
uninterrupted run saw.

    python examples/ffcv_pipeline.py [--samples 600] [--epochs 2] [--accelerator cpu]

Needs the optional ffcv dependency (``pip install 'lightning-loaders[ffcv]'``).
"""

from __future__ import annotations

import argparse
import logging
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lightning_loaders.adapters.ffcv import FFCVLoader, write_beton

CLASSES = 3


class ColourSquares:
    """Sample ``i``: a noisy 16x16 RGB image whose brightest channel is its label ``i % 3``."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        rng = np.random.default_rng(index)
        label = index % CLASSES
        image = rng.integers(0, 96, size=(16, 16, 3), dtype=np.uint8)
        image[..., label] += 128
        return image, label


class ColourNet(L.LightningModule):
    """A tiny CNN; ``train_dataloader`` builds the FFCV loader with the trainer's device."""

    def __init__(self, beton: str, batch_size: int, num_workers: int) -> None:
        super().__init__()
        self.beton, self.batch_size, self.num_workers = beton, batch_size, num_workers
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 3, padding=1), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(8, CLASSES))
        self.seen: list[list[int]] = []
        self.correct = 0

    def train_dataloader(self) -> FFCVLoader:
        from ffcv.fields.decoders import IntDecoder, SimpleRGBImageDecoder
        from ffcv.transforms import ToTensor, ToTorchImage

        pipelines = {"image": [SimpleRGBImageDecoder(), ToTensor(), ToTorchImage()],
                     "label": [IntDecoder(), ToTensor()]}
        return FFCVLoader(self.beton, batch_size=self.batch_size, num_workers=self.num_workers,
                          order="random", seed=0, pipelines=pipelines, trainer=self.trainer)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
                      ) -> torch.Tensor:
        images, labels = batch
        labels = labels.ravel().long()
        logits = self.net(images.float() / 255)
        self.seen.append(labels.tolist())
        self.correct += int((logits.argmax(1) == labels).sum())
        return torch.nn.functional.cross_entropy(logits, labels)

    def on_train_epoch_start(self) -> None:
        self.correct = 0

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=0.05)


def fit(args: argparse.Namespace, beton: str, ckpt_dir: Path, ckpt_path: str | None = None
        ) -> ColourNet:
    model = ColourNet(beton, args.batch_size, args.num_workers)
    options: dict[str, Any] = {}
    if ckpt_path is None:
        options["callbacks"] = [ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1,
                                                save_top_k=-1, filename="{step}")]
    trainer = L.Trainer(max_epochs=args.epochs, accelerator=args.accelerator, devices=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=ckpt_path is None, **options)
    trainer.fit(model, ckpt_path=ckpt_path)
    return model


def main() -> int:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*(ckpt_path|does not have many workers).*")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=600)
    parser.add_argument("--batch-size", type=int, default=32)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--num-workers", type=int, default=2, help="FFCV decoding threads")
    parser.add_argument("--accelerator", default="cpu")
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        beton = str(write_beton(Path(tmp) / "squares.beton", ColourSquares(args.samples),
                                ["image", "label"], num_workers=args.num_workers))
        full = fit(args, beton, Path(tmp) / "ckpt")
        steps_per_epoch = len(full.seen) // args.epochs
        step = steps_per_epoch * (args.epochs - 1) + max(1, steps_per_epoch // 2)
        resumed = fit(args, beton, Path(tmp) / "ckpt", str(Path(tmp) / "ckpt" /
                                                            f"step={step}.ckpt"))

    accuracy = full.correct / args.samples
    same = resumed.seen == full.seen[step:]
    print(f"trained {args.epochs} epochs on {args.samples} images from a .beton "
          f"({steps_per_epoch} batches per epoch)")
    print(f"last-epoch training accuracy: {accuracy:.2f}")
    epoch, batch = divmod(step, steps_per_epoch)
    print(f"resumed from the checkpoint after step {step} (epoch {epoch}, batch {batch}): "
          f"{'identical' if same else 'DIFFERENT'} sample order to the uninterrupted run")
    return 0 if same else 1


if __name__ == "__main__":
    sys.exit(main())
