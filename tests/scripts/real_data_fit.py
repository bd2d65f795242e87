"""One rank of real Trainer runs over user-built datasets (launched by
``tests/real_data_harness.check_real_data_ddp``, or ``tests/ddp_harness.run_ddp``).

``--dataset module:function`` (repeatable: one launch, several datasets) names a module-level
function; ``function(--data)`` builds the dataset (an ``IterableDataset`` or a map-style
``Dataset``) whose samples carry an integer ``"id"`` in ``0..--total - 1``. For each, the script
trains ``Trainer(strategy="ddp", accelerator="cpu", devices=2)`` over
``ResumableLoader(dataset, ...)`` with a checkpoint at every step, resumes from a checkpoint in
the middle of epoch 0 and one at its end (plus ``--resume-step``s), each in a fresh
``Trainer.fit(ckpt_path=...)``, and reports per rank what every step saw::

    {"<module:function>": {"seen": [[epoch, [ids]], ...], "len": len(loader) or None,
                           "resumes": {"<step>": [[epoch, [ids]], ...]}}, ...}

    python tests/scripts/real_data_fit.py --dataset tests.sources.test_x:ddp_dataset
        --data DIR --total N [--workers 2] [--batch-size 4] [--epochs 2] [--shuffle]
        [--shuffle-buffer 0] [--last-batch keep] [--resume-step S ...]
"""

from __future__ import annotations

import argparse
import importlib
import logging
import os
import warnings
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_loaders import ResumableLoader
from tests.ddp_harness import RESULT_DIR_ENV, write_result
from tests.lightning_harness import (
    RecordingModule,
    checkpoint_at,
    every_step_checkpoints,
    make_trainer,
)

Seen = list[tuple[int, list[int]]]


def sample_ids(batch: Any) -> list[int]:
    """The ``"id"`` field of a collated batch (a dict, or an object with an ``id`` field)."""
    ids = batch["id"] if isinstance(batch, dict) else batch.id
    return ids.tolist() if isinstance(ids, torch.Tensor) else [int(i) for i in ids]


def build_dataset(spec: str, data: str) -> Any:
    module, _, function = spec.partition(":")
    if not function:
        raise SystemExit(f"--dataset must be module:function, got {spec!r}")
    return getattr(importlib.import_module(module), function)(data)


def fit(args: argparse.Namespace, spec: str, ckpt_dir: Path, ckpt_path: Path | None = None
        ) -> tuple[Seen, int | None]:
    """One Trainer run (from scratch, or resumed from ``ckpt_path``): what each step saw."""
    dataset = build_dataset(spec, args.data)
    options: dict[str, Any] = {"shuffle_buffer": args.shuffle_buffer} if args.shuffle_buffer \
        else {}
    loader = ResumableLoader(dataset, batch_size=args.batch_size, num_workers=args.workers,
                             seed=args.seed, shuffle=args.shuffle, last_batch=args.last_batch,
                             **options)
    callbacks = [every_step_checkpoints(ckpt_dir)] if ckpt_path is None else []
    model = RecordingModule(key=sample_ids)
    trainer = make_trainer(ckpt_dir.parent, args.epochs, callbacks, strategy="ddp", devices=2)
    trainer.fit(model, loader, ckpt_path=str(ckpt_path) if ckpt_path is not None else None)
    try:
        length: int | None = len(loader)
    except TypeError:
        length = None
    loader.close()
    dist.barrier()  # rank 0 has written every checkpoint before any rank reads one
    return [(epoch, ids) for epoch, _, ids in model.seen], length


def resume_steps(seen: Seen, extra: list[int]) -> list[int]:
    """The middle of epoch 0, its last step, and the ``extra`` steps (inside the run)."""
    first_epoch = sum(1 for epoch, _ in seen if epoch == 0)
    steps = {max(1, first_epoch // 2), first_epoch, *extra}
    return sorted(step for step in steps if 1 <= step < len(seen))


def main() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    parser = argparse.ArgumentParser()
    parser.add_argument("--dataset", action="append", required=True)
    parser.add_argument("--data", required=True)
    parser.add_argument("--total", type=int, required=True)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--seed", type=int, default=7)
    parser.add_argument("--shuffle", action="store_true")
    parser.add_argument("--shuffle-buffer", type=int, default=0)
    parser.add_argument("--last-batch", default="keep")
    parser.add_argument("--resume-step", type=int, action="append", default=[])
    args = parser.parse_args()
    results = {}
    for index, spec in enumerate(args.dataset):
        ckpt_dir = Path(os.environ[RESULT_DIR_ENV]) / f"checkpoints-{index}"
        seen, length = fit(args, spec, ckpt_dir)
        resumes = {step: fit(args, spec, ckpt_dir, checkpoint_at(ckpt_dir, step))[0]
                   for step in resume_steps(seen, args.resume_step)}
        results[spec] = {"seen": seen, "len": length, "resumes": resumes}
    write_result(results)


if __name__ == "__main__":
    main()
