"""One rank of 2-process DDP runs with ``DALILoader`` (run by tests/ddp_harness).

First, loaders whose plan differs between ranks (a seed or a file list per rank) read two
epochs as Lightning's loops read them (through its data fetcher, where the ranks compare their
plans): reported per case as the labels this rank received in each epoch, or the error it
raised. Then, for each mode (reader, external source), ``Trainer.fit``: an uninterrupted run
checkpointing every step, then runs resumed from the checkpoints after ``--resume-steps``.
Reports per mode what every step saw on this rank, and ``len(loader)``.
"""

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch.distributed as dist

from tests.ddp_harness import write_result
from tests.lightning_harness import (
    RecordingModule,
    checkpoint_at,
    every_step_checkpoints,
    fetched_cases,
    fit_recording,
)
from tests.scripts.dali_common import key, make_loader

parser = argparse.ArgumentParser()
parser.add_argument("--files", type=Path, required=True)
parser.add_argument("--root", type=Path, required=True)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--batch-size", type=int, default=6)
parser.add_argument("--resume-steps", type=int, nargs="*", default=[])
args = parser.parse_args()
files = sorted(str(p) for p in args.files.glob("*.jpg"))

dist.init_process_group("gloo")  # the Trainers below join it
rank = dist.get_rank()
cases: dict[str, Callable[[], Any]] = {
    "source-seed-per-rank": lambda: make_loader("source", files, seed=7 + rank),
    "source-files-per-rank": lambda: make_loader("source", files[:len(files) - rank]),
    "reader-files-per-rank": lambda: make_loader("reader", files[:len(files) - 2 * rank]),
}
differing = fetched_cases(cases, key=lambda batch: key(batch)[0])  # the labels

result = {}
for mode in ("reader", "source"):
    def make(mode: str = mode) -> object:
        return make_loader(mode, files, args.batch_size)

    directory = args.root / mode
    full = fit_recording(make, directory, args.epochs, [every_step_checkpoints(directory)],
                         model=RecordingModule(key), strategy="ddp", devices=2)
    resumed = {
        step: fit_recording(make, directory, args.epochs, model=RecordingModule(key),
                            ckpt_path=checkpoint_at(directory, step), strategy="ddp", devices=2)
        for step in args.resume_steps
    }
    result[mode] = {"len": len(make_loader(mode, files, args.batch_size)), "full": full,
                    "resumed": resumed}
write_result({"rank": rank, "differing": differing, **result})
