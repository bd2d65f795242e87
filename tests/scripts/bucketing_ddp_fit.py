"""One rank of a 2-process DDP ``Trainer.fit`` over a plain ``DataLoader`` with a bucketing
batch sampler, passed straight to ``fit`` with ``ExactResume`` (run by tests/ddp_harness).

Reports what every training step saw on this rank; with ``--ckpt-dir`` checkpoints every step,
with ``--resume`` continues from that checkpoint.
"""

import argparse
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_loaders import ExactResume
from tests.buckets import LengthBuckets
from tests.conftest import IndexDataset
from tests.ddp_harness import write_result
from tests.lightning_harness import every_step_checkpoints, fit_recording

N, EPOCHS = 37, 3

parser = argparse.ArgumentParser()
parser.add_argument("--ckpt-dir", type=Path)
parser.add_argument("--resume", type=Path)
args = parser.parse_args()


def plain_loader() -> DataLoader[Any]:
    return DataLoader(IndexDataset(N), batch_sampler=LengthBuckets(N))


callbacks: list[Any] = [ExactResume()]
if args.ckpt_dir:
    callbacks.append(every_step_checkpoints(args.ckpt_dir))
seen = fit_recording(plain_loader, Path(args.ckpt_dir or "."), EPOCHS, callbacks,
                     ckpt_path=args.resume, strategy="ddp", devices=2,
                     reload_dataloaders_every_n_epochs=1)
write_result({"rank": dist.get_rank(), "seen": seen})
