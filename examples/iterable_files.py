"""Iterable datasets: files of records, sharded over workers, shuffled, resumed exactly.

Writes a few files of records with uneven lengths (each record a JSON ``{"id", "x", "y"}``
with ``y = 2x + 1 + noise``), then trains a tiny model on them with ``Trainer.fit`` on CPU
through ``ResumableLoader(RecordFiles(...))``, three times:
  1. uninterrupted, recording which records every step saw;
  2. crashed on purpose after step ``--crash-at-step`` (checkpoints are written every step);
  3. resumed from the last checkpoint with ``Trainer.fit(..., ckpt_path=...)``.
It prints how the records were spread over batches, whether every epoch read every record
exactly once, and whether 2 + 3 equals 1.

    python examples/iterable_files.py [--num-workers 2] [--unknown-lengths] [--crash-at-step 9]

With ``--unknown-lengths`` the files are not scanned: ``len()`` is then unknown, Lightning
prefetches a batch ahead, and the resume is still exact.
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import tempfile
from collections import Counter
from functools import partial
from pathlib import Path

import lightning as L
import torch
from lightning.pytorch.callbacks import Callback

from lightning_loaders import RecordFiles, ResumableLoader, write_records

from _crash_resume import crash_and_resume, quiet, report, train


def write_files(root: Path, files: int, seed: int = 0) -> list[Path]:
    """``files`` record files of uneven lengths (between 5 and 40 records)."""
    rng = random.Random(seed)
    paths, next_id = [], 0
    for index in range(files):
        count = rng.randint(5, 40)
        records = []
        for record_id in range(next_id, next_id + count):
            x = rng.random()
            records.append(json.dumps({"id": record_id, "x": x,
                                       "y": 2 * x + 1 + rng.gauss(0, 0.05)}).encode())
        paths.append(root / f"part-{index:03d}.rec")
        write_records(paths[-1], records)
        next_id += count
    return paths


def decode(payload: bytes) -> dict[str, torch.Tensor]:
    """One record as tensors (runs in the worker processes)."""
    record = json.loads(payload)
    return {"id": torch.tensor(record["id"]), "x": torch.tensor([record["x"]]),
            "y": torch.tensor([record["y"]])}


class LineModel(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[tuple[int, list[int]]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append((self.current_epoch, batch["id"].tolist()))
        return torch.nn.functional.mse_loss(self.layer(batch["x"]), batch["y"])

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)


def make_loader(paths: list[Path], args: argparse.Namespace) -> ResumableLoader:
    source = RecordFiles(paths, lengths=None if args.unknown_lengths else "scan", decode=decode)
    return ResumableLoader(source, batch_size=args.batch_size, shuffle=True,
                           shuffle_buffer=args.shuffle_buffer, seed=42,
                           num_workers=args.num_workers)


def fit(paths: list[Path], args: argparse.Namespace, callbacks: list[Callback],
        ckpt_path: str | None = None) -> list[tuple[int, list[int]]]:
    """One training run; (epoch, record ids) of every batch it trained on."""
    model = LineModel()
    loader = make_loader(paths, args)
    train(model, args.epochs, callbacks, ckpt_path, train_dataloaders=loader)
    loader.close()
    return model.seen


def main() -> int:
    quiet(".*(does not have many workers|IterableDataset)")
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--files", type=int, default=5)
    parser.add_argument("--batch-size", type=int, default=8)
    parser.add_argument("--shuffle-buffer", type=int, default=16)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--num-workers", type=int, default=2)
    parser.add_argument("--unknown-lengths", action="store_true")
    parser.add_argument("--crash-at-step", type=int, default=9)
    args = parser.parse_args()

    with tempfile.TemporaryDirectory() as tmp:
        paths = write_files(Path(tmp), args.files)
        lengths = RecordFiles(paths, lengths="scan").shard_lengths
        assert lengths is not None
        total = sum(lengths)
        print(f"wrote {args.files} files of {lengths} records ({total} in all)")
        loader = make_loader(paths, args)
        try:
            length = f"len(loader) = {len(loader)} batches per epoch"
        except TypeError:
            length = "len(loader) is unknown (lengths not scanned): Lightning prefetches"
        print(f"{length}; {max(1, args.num_workers)} worker slot(s) read parts of the files")

        full, before, after = crash_and_resume(partial(fit, paths, args), args.crash_at_step)

    every_epoch_once = True
    for epoch in range(args.epochs):
        batches = [ids for e, ids in full if e == epoch]
        counts = Counter(i for ids in batches for i in ids)
        once = sorted(counts) == list(range(total)) and set(counts.values()) == {1}
        every_epoch_once = every_epoch_once and once
        sizes = Counter(len(ids) for ids in batches)
        print(f"epoch {epoch}: {len(batches)} batches (sizes {dict(sorted(sizes.items()))}), "
              f"every record exactly once: {'yes' if once else 'NO'}; "
              f"first batch {batches[0]}")
    print(f"crashed after step {len(before)}, resumed from its checkpoint: {len(after)} more "
          "steps")
    resumed = report([ids for _, ids in full], [ids for _, ids in before],
                     [ids for _, ids in after])
    return 0 if resumed and every_epoch_once else 1


if __name__ == "__main__":
    sys.exit(main())
