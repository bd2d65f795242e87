"""A DALI pipeline (decode, resize, crop-mirror-normalize) feeding ``Trainer.fit``.

Generates small JPEG files of two classes (horizontal or vertical stripes) and trains a tiny CNN
on them through ``DALILoader``. The same code runs on the CPU and, when a GPU is available, on
the GPU: the loader takes the device from ``trainer.strategy.root_device`` and tells the pipeline
(``device="gpu"``), which then decodes with DALI's ``"mixed"`` decoder. Under DDP every rank
reads its own shard; checkpoints resume mid-epoch exactly.

    python examples/dali_pipeline.py [--mode reader|source] [--epochs 3] [--images 96]

``--mode reader``: DALI's file reader shards and shuffles (resume through DALI checkpoints).
``--mode source``: our global plan picks the samples, DALI's parallel external source reads
them (any sampler, elastic resume).
"""

from __future__ import annotations

import argparse
import functools
import logging
import sys
import tempfile
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import torch
from nvidia.dali import fn, pipeline_def
from nvidia.dali.types import DALIDataType
from PIL import Image

from lightning_loaders.adapters.dali import DALILoader, FileSamples

SIDE = 48
CROP = 32
MEAN = [0.485 * 255, 0.456 * 255, 0.406 * 255]
STD = [0.229 * 255, 0.224 * 255, 0.225 * 255]


def write_stripes(directory: Path, n: int) -> tuple[list[str], list[int]]:
    """``n`` noisy JPEG images; label 0: horizontal stripes, label 1: vertical stripes."""
    rng = np.random.default_rng(0)
    paths, labels = [], []
    for i in range(n):
        label = i % 2
        period = int(rng.integers(4, 9))
        stripes = (np.arange(SIDE) // (period // 2) % 2 * 160 + 40).astype(np.float32)
        image = np.repeat(stripes[:, None], SIDE, axis=1) if label == 0 else \
            np.repeat(stripes[None, :], SIDE, axis=0)
        noisy = image[..., None] + rng.normal(0, 20, (SIDE, SIDE, 3))
        path = directory / f"{i:04d}.jpg"
        Image.fromarray(noisy.clip(0, 255).astype(np.uint8)).save(path, quality=90)
        paths.append(str(path))
        labels.append(label)
    return paths, labels


@pipeline_def
def stripes_pipeline(files: list[str], labels: list[int], shard_id: int, num_shards: int,
                     device: str, source: Any = None) -> Any:
    """Reader mode when ``source`` is None, external-source mode otherwise."""
    outputs: Any
    if source is None:
        outputs = fn.readers.file(files=files, labels=labels, shard_id=shard_id,
                                  num_shards=num_shards, random_shuffle=True,
                                  pad_last_batch=True, name="Reader")
    else:
        outputs = fn.external_source(source=source, num_outputs=2, batch=False, parallel=True,
                                     dtype=[DALIDataType.UINT8, DALIDataType.INT64])
    jpegs, label = outputs
    images: Any = fn.decoders.image(jpegs, device="mixed" if device == "gpu" else "cpu")
    images = fn.resize(images, resize_shorter=40)
    images = fn.crop_mirror_normalize(
        images, crop=(CROP, CROP), crop_pos_x=fn.random.uniform(range=(0.0, 1.0)),
        crop_pos_y=fn.random.uniform(range=(0.0, 1.0)), mirror=fn.random.coin_flip(),
        mean=MEAN, std=STD, dtype=DALIDataType.FLOAT)
    return images, label


class StripesNet(L.LightningModule):
    def __init__(self, files: list[str], labels: list[int], mode: str, batch_size: int) -> None:
        super().__init__()
        self.files, self.labels, self.mode, self.batch_size = files, labels, mode, batch_size
        self.net = torch.nn.Sequential(
            torch.nn.Conv2d(3, 8, 5, stride=2), torch.nn.ReLU(),
            torch.nn.Conv2d(8, 16, 3, stride=2), torch.nn.ReLU(),
            torch.nn.AdaptiveAvgPool2d(1), torch.nn.Flatten(), torch.nn.Linear(16, 2))
        self.history: list[tuple[int, float, float]] = []
        self._epoch: list[tuple[float, float]] = []

    def train_dataloader(self) -> DALILoader:
        mode: dict[str, Any] = ({"reader_name": "Reader"} if self.mode == "reader" else
                                {"dataset": FileSamples(self.files, self.labels),
                                 "shuffle": True})
        # The loader calls the pipeline definition (with shard, device and seed) when it needs
        # the pipeline; bind this dataset's files with a partial.
        pipeline = functools.partial(stripes_pipeline, files=self.files, labels=self.labels)
        return DALILoader(pipeline, ["images", "labels"],
                          batch_size=self.batch_size, trainer=self.trainer,
                          batch_format="tuple", seed=0, **mode)

    def training_step(self, batch: tuple[torch.Tensor, torch.Tensor], batch_idx: int
                      ) -> torch.Tensor:
        images, labels = batch
        labels = labels.view(-1).long().to(images.device)
        logits = self.net(images)
        loss = torch.nn.functional.cross_entropy(logits, labels)
        accuracy = (logits.argmax(1) == labels).float().mean()
        self._epoch.append((loss.item(), accuracy.item()))
        return loss

    def on_train_epoch_end(self) -> None:
        loss, accuracy = np.mean(self._epoch, axis=0)
        self.history.append((self.current_epoch, float(loss), float(accuracy)))
        self._epoch = []

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.Adam(self.parameters(), lr=3e-3)


def main() -> int:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore", message=".*(LeafSpec|does not have many workers).*")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--mode", choices=["reader", "source"], default="reader")
    parser.add_argument("--images", type=int, default=96)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=3)
    args = parser.parse_args()

    L.seed_everything(0, verbose=False)
    with tempfile.TemporaryDirectory() as tmp:
        files, labels = write_stripes(Path(tmp), args.images)
        model = StripesNet(files, labels, args.mode, args.batch_size)
        trainer = L.Trainer(max_epochs=args.epochs, accelerator="auto", devices=1, logger=False,
                            enable_checkpointing=False, enable_progress_bar=False,
                            enable_model_summary=False)
        trainer.fit(model)
    print(f"device: {trainer.strategy.root_device}, mode: {args.mode}, "
          f"{trainer.num_training_batches} batches per epoch")
    for epoch, loss, accuracy in model.history:
        print(f"epoch {epoch}: loss {loss:.3f}, train accuracy {accuracy:.2f}")
    return 0 if len(model.history) == args.epochs else 1


if __name__ == "__main__":
    sys.exit(main())
