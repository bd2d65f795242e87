"""One rank of a 2-process DDP ``Fabric`` loop over ``ResumableLoader`` (run by
tests/ddp_harness): reports what every step saw on this rank; with ``--ckpt-dir`` saves after
every step, with ``--resume`` continues from a checkpoint. The loader compares the ranks' plans
at every epoch start (``compare_ranks=True``, as the README's Fabric loop has it)."""

import argparse
from pathlib import Path

import lightning as L

from lightning_loaders import ResumableLoader
from tests.conftest import IndexDataset
from tests.ddp_harness import write_result
from tests.fabric_harness import fabric_recording

parser = argparse.ArgumentParser()
parser.add_argument("--workers", type=int, default=0)
parser.add_argument("--ckpt-dir", type=Path)
parser.add_argument("--resume", type=Path)
args = parser.parse_args()


def make_loader() -> ResumableLoader:
    return ResumableLoader(IndexDataset(13), batch_size=2, shuffle=True, seed=3,
                           num_workers=args.workers, compare_ranks=True)


fabric = L.Fabric(accelerator="cpu", devices=2, strategy="ddp")
fabric.launch()
seen = fabric_recording(fabric, make_loader, 2, ckpt_dir=args.ckpt_dir, resume=args.resume)
write_result({"rank": fabric.global_rank, "len": len(make_loader()), "seen": seen})
