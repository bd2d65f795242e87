"""One rank of a 2-process DDP ``Trainer.fit`` with ``ResumableLoader`` (run by tests/ddp_harness).

Reports what every training step saw on this rank; with ``--ckpt-dir`` checkpoints every step,
with ``--resume`` continues from that checkpoint.
"""

import argparse
from pathlib import Path
from typing import Any

import torch.distributed as dist
from torch.utils.data import DataLoader

from lightning_loaders import ExactResume, ResumableLoader
from lightning_loaders.sources.shards import SequenceSource
from tests.conftest import IndexDataset
from tests.ddp_harness import write_result
from tests.lightning_harness import default_key, every_step_checkpoints, fit_recording

parser = argparse.ArgumentParser()
parser.add_argument("--samples", type=int, default=13)
parser.add_argument("--batch-size", type=int, default=2)
parser.add_argument("--epochs", type=int, default=2)
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--last-batch", default="keep")
parser.add_argument("--ckpt-dir", type=Path)
parser.add_argument("--resume", type=Path)
parser.add_argument("--out-of-order", action="store_true", help="in_order=False")
parser.add_argument("--iterable", action="store_true",
                    help="a ShardedSource of 4 shards (known lengths) instead of IndexDataset")
parser.add_argument("--plain", action="store_true",
                    help="a plain shuffled DataLoader passed to fit, with ExactResume")
args = parser.parse_args()


def make_loader(**overrides: Any) -> ResumableLoader:
    dataset = IndexDataset(args.samples)
    if args.iterable:
        samples = list(range(args.samples))
        dataset = SequenceSource([samples[shard::4] for shard in range(4)])
    options: dict[str, Any] = {"num_workers": args.workers, "in_order": not args.out_of_order,
                               **overrides}
    return ResumableLoader(dataset, batch_size=args.batch_size, shuffle=True, seed=3,
                           last_batch=args.last_batch, **options)


def plain_loader() -> DataLoader[Any]:
    return DataLoader(IndexDataset(args.samples), batch_size=args.batch_size, shuffle=True,
                      num_workers=args.workers)


callbacks = [every_step_checkpoints(args.ckpt_dir)] if args.ckpt_dir else []
if args.plain:
    callbacks.append(ExactResume())
seen = fit_recording(plain_loader if args.plain else make_loader, Path(args.ckpt_dir or "."),
                     args.epochs, callbacks, ckpt_path=args.resume, strategy="ddp", devices=2)
rank = dist.get_rank()
plans = []  # this rank's planned batches per epoch, in order
for epoch in range(args.epochs):
    planned = make_loader(in_order=True)
    planned.set_epoch(epoch)
    plans.append([default_key(batch) for batch in planned])
write_result({"rank": rank, "len": len(make_loader()), "seen": seen, "plans": plans})
