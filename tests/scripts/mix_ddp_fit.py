"""One rank of a 2-process DDP ``Trainer.fit`` over a three-source ``Mix`` with a step schedule
(run by tests/ddp_harness); checkpoints every step and reports what every step saw."""

import argparse
from pathlib import Path

import torch.distributed as dist

from lightning_loaders import ResumableLoader
from tests.ddp_harness import write_result
from tests.lightning_harness import every_step_checkpoints, fit_recording
from tests.mix_sources import three_source_mix

parser = argparse.ArgumentParser()
parser.add_argument("root", type=Path)
parser.add_argument("--batch-size", type=int, default=3)
args = parser.parse_args()


def make_loader() -> ResumableLoader:
    mix = three_source_mix(args.root / "data", batch_size=2 * args.batch_size,
                           samples_per_epoch=24, seed=7)
    return ResumableLoader(mix, batch_size=args.batch_size, num_workers=1)


seen = fit_recording(make_loader, args.root, 2, [every_step_checkpoints(args.root / "ckpt")],
                     strategy="ddp", devices=2)
write_result({"rank": dist.get_rank(), "seen": seen})
