"""One rank of a real 2-process DDP ``Trainer.fit`` with ``ExactResume`` resuming checkpoints
that a 1-rank run wrote mid-epoch (run by tests/ddp_harness).

For every ``--resume KIND STEP``: the 1-rank checkpoint ``STEP`` under ``--ckpt-root``/KIND
resumed on these 2 ranks, the loader ``KIND`` of ``tests/lightning/test_elastic_resume.py``
placed by Lightning. Reports per rank what every step saw::

    {"rank": r, "resumes": {"KIND STEP": [[epoch, batch_idx, ids], ...]}}
"""

from __future__ import annotations

import argparse
import logging
import os
import warnings
from pathlib import Path

import torch.distributed as dist

from lightning_loaders import ExactResume
from tests.ddp_harness import RESULT_DIR_ENV, write_result
from tests.lightning.test_elastic_resume import EPOCHS, LOADERS
from tests.lightning_harness import checkpoint_at, fit_recording


def main() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser()
    parser.add_argument("--ckpt-root", type=Path, required=True)
    parser.add_argument("--resume", nargs=2, action="append", default=[],
                        metavar=("KIND", "STEP"))
    args = parser.parse_args()
    root = Path(os.environ[RESULT_DIR_ENV])
    resumes = {}
    for kind, step in args.resume:
        make = LOADERS[kind]
        ckpt = checkpoint_at(args.ckpt_root / kind / "rank0" / "checkpoints", int(step))
        resumes[f"{kind} {step}"] = fit_recording(
            lambda make=make: make(None, None), root / f"{kind}-{step}", EPOCHS,
            [ExactResume()], ckpt_path=ckpt, strategy="ddp", devices=2)
    write_result({"rank": dist.get_rank(), "resumes": resumes})


if __name__ == "__main__":
    main()
