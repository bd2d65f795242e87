"""One rank of Trainer runs over files of records (launched by ``tests/ddp_harness.run_ddp``).

For every ``--run LENGTHS:WORKERS[:plain]`` (``known`` or ``unknown`` shard lengths; ``plain``
reads the files through a plain ``IterableDataset`` instead of ``RecordFiles``) it trains
uninterrupted with a checkpoint at every step, then resumes from ``--resumes`` checkpoints
spread over the run plus the last step of epoch 0 (each a fresh ``Trainer.fit(ckpt_path=...)``),
and reports what every step saw and what every resumed run saw.

    python tests/scripts/iterable_fit.py DATA_DIR CKPT_DIR --run known:2 [--run unknown:0]
        [--epochs 2] [--batch-size 4] [--resumes 2]
"""

from __future__ import annotations

import argparse
import json
import logging
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import ModelCheckpoint
from torch.utils.data import IterableDataset

from lightning_loaders import ResumableLoader
from lightning_loaders.sources.shards import RecordFiles, count_records
from tests.ddp_harness import write_result


def decode(payload: bytes) -> dict[str, torch.Tensor]:
    sample_id = json.loads(payload)["id"]
    return {"id": torch.tensor(sample_id), "x": torch.tensor([sample_id / 100.0])}


class AllRecords(IterableDataset[dict[str, torch.Tensor]]):
    """A plain iterable dataset (no shards): every record of every file, in order."""

    def __init__(self, paths: list[Path], sized: bool) -> None:
        self.paths, self.sized = paths, sized
        self.total = sum(count_records(path) for path in paths)

    def __iter__(self) -> Any:
        return iter(RecordFiles(self.paths, decode=decode))

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("unsized")
        return self.total


class Recorder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[tuple[int, list[int]]] = []

    def training_step(self, batch: dict[str, torch.Tensor], batch_idx: int) -> torch.Tensor:
        self.seen.append((self.current_epoch, batch["id"].tolist()))
        return self.layer(batch["x"]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(args: argparse.Namespace, run: str, ckpt_dir: Path, ckpt_path: str | None = None
        ) -> tuple[list[tuple[int, list[int]]], Any]:
    lengths, workers, *plain = run.split(":")
    known = lengths == "known"
    paths = sorted(Path(args.data).glob("*.rec"))
    if plain:
        dataset: IterableDataset[Any] = AllRecords(paths, sized=known)
    else:
        dataset = RecordFiles(paths, lengths="scan" if known else None, decode=decode)
    loader = ResumableLoader(dataset, batch_size=args.batch_size, shuffle=not plain,
                             shuffle_buffer=3 if plain else 0, seed=7,
                             num_workers=int(workers), last_batch=args.policy, sync_interval=3)
    callbacks = [ModelCheckpoint(dirpath=ckpt_dir, filename="{step}", every_n_train_steps=1,
                                 save_top_k=-1)] if ckpt_path is None else []
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=args.epochs,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=ckpt_path is None, callbacks=callbacks,
                        num_sanity_val_steps=0)
    model = Recorder()
    trainer.fit(model, loader, ckpt_path=ckpt_path)
    try:
        length = len(loader)
    except TypeError:
        length = None
    loader.close()
    dist.barrier()  # rank 0 has written every checkpoint before any rank reads one
    return model.seen, length


def resume_points(seen: list[tuple[int, list[int]]], count: int) -> list[int]:
    """``count`` global steps spread over the run, plus the last step of epoch 0."""
    total = len(seen)
    spread = {1 + round(i * (total - 2) / max(count - 1, 1)) for i in range(count)}
    return sorted(spread | {sum(1 for epoch, _ in seen if epoch == 0)})


def main() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser()
    parser.add_argument("data")
    parser.add_argument("ckpt")
    parser.add_argument("--run", action="append", default=[])
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--policy", default="keep")
    parser.add_argument("--resumes", type=int, default=3)
    args = parser.parse_args()
    results = {}
    for run in args.run:
        ckpt_dir = Path(args.ckpt) / run.replace(":", "-")
        seen, length = fit(args, run, ckpt_dir)
        resumes = {}
        for step in resume_points(seen, args.resumes):
            after, _ = fit(args, run, ckpt_dir, str(ckpt_dir / f"step={step}.ckpt"))
            resumes[step] = [ids for _, ids in after]
        results[run] = {"seen": seen, "len": length, "resumes": resumes}
    write_result(results)


if __name__ == "__main__":
    main()
