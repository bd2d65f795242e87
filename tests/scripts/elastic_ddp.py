"""One rank of real 2-process DDP runs over an elastic iterable (run by tests/ddp_harness).

``Trainer(strategy="ddp", accelerator="cpu", devices=2)`` trains over
``ResumableLoader(ParquetSource(uneven shards), num_workers=--workers, shuffle=True,
shuffle_buffer=...)`` with a checkpoint after every step; then, in the same launch, every
``--resume-step``'s checkpoint is resumed on these 2 ranks with ``--resume-workers`` workers,
each in a fresh ``Trainer.fit(ckpt_path=...)``. Reports per rank what every step saw::

    {"rank": r, "seen": [[epoch, [ids]], ...], "resumes": {"<step>": [[epoch, [ids]], ...]}}

    python tests/scripts/elastic_ddp.py --data DIR [--workers 2] [--resume-workers 0]
        [--resume-step S ...]

The tests resume the same checkpoints on other layouts with ``make_loader``.
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_loaders import ResumableLoader
from lightning_loaders.sources.parquet import ParquetSource
from tests.ddp_harness import RESULT_DIR_ENV, write_result
from tests.lightning_harness import (
    RecordingModule,
    checkpoint_at,
    every_step_checkpoints,
    fit_recording,
)

BATCH_SIZE, SHUFFLE_BUFFER, EPOCHS, SEED = 3, 4, 2, 5


def make_loader(data: Path, num_workers: int) -> ResumableLoader:
    """The loader every run and resume uses (placed over the ranks by Lightning)."""
    return ResumableLoader(ParquetSource(sorted(data.glob("*.parquet"))), batch_size=BATCH_SIZE,
                           shuffle=True, shuffle_buffer=SHUFFLE_BUFFER, seed=SEED,
                           num_workers=num_workers)


def sample_ids(batch: Any) -> list[int]:
    return [int(i) for i in batch["id"].tolist()]


def fit(data: Path, workers: int, root: Path, ckpt_path: Path | None = None
        ) -> list[tuple[int, list[int]]]:
    """One DDP fit (from scratch with every-step checkpoints, or resumed): what each step saw."""
    callbacks = [every_step_checkpoints(root / "checkpoints")] if ckpt_path is None else []
    model = RecordingModule(key=sample_ids)
    fit_recording(lambda: make_loader(data, workers), root, EPOCHS, callbacks,
                  ckpt_path=ckpt_path, model=model, strategy="ddp", devices=2)
    dist.barrier()  # rank 0 has written every checkpoint before any rank reads one
    return [(epoch, ids) for epoch, _, ids in model.seen]


def main() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser()
    parser.add_argument("--data", type=Path, required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--resume-workers", type=int, default=0)
    parser.add_argument("--resume-step", type=int, action="append", default=[])
    args = parser.parse_args()
    root = Path(os.environ[RESULT_DIR_ENV])
    seen = fit(args.data, args.workers, root)
    resumes = {step: fit(args.data, args.resume_workers, root / f"resume-{step}",
                         checkpoint_at(root / "checkpoints", step))
               for step in args.resume_step}
    write_result({"rank": dist.get_rank(), "seen": seen, "resumes": resumes})


if __name__ == "__main__":
    main()
