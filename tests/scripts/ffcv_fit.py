"""One rank of the FFCV DDP test (launched by ``tests.ddp_harness.run_ddp``).

First, loaders whose plan differs between ranks (a seed, a ``.beton`` or ``indices`` per rank)
read two epochs as Lightning's loops read them (through its data fetcher, where the ranks
compare their plans): reported per case as the labels this rank received in each epoch, or
the error it raised. Then it fits with checkpoints after every step, and resumes from the
checkpoints after each of ``--resume-steps`` in new Trainers and models; reports what every
step saw on this rank.

    python tests/scripts/ffcv_fit.py --beton F --shorter G --root DIR --batch-size 4 \
        --epochs 2 --resume-steps 4 6
"""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from lightning_loaders.adapters.ffcv import FFCVLoader
from tests.ddp_harness import write_result
from tests.lightning_harness import (
    RecordingModule,
    checkpoint_at,
    every_step_checkpoints,
    fetched_cases,
    fit_recording,
)

PIXEL_MODULUS = 251  # the test images hold ``index % 251`` in every pixel


def labels_key(batch: tuple[torch.Tensor, torch.Tensor]) -> list[int]:
    """The batch's labels, after checking that each image is the one its label names."""
    images, labels = batch
    labels = labels.ravel().long()
    pixels = images[:, 0, 0, 0].long()
    if not torch.equal(pixels, labels % PIXEL_MODULUS):
        raise AssertionError(f"images {pixels.tolist()} do not belong to labels "
                             f"{labels.tolist()}")
    return labels.tolist()


def loader_factory(beton: str | Path, batch_size: int, num_workers: int, seed: int = 11,
                   **kwargs: Any) -> Callable[[], FFCVLoader]:
    def make() -> FFCVLoader:
        return FFCVLoader(beton, batch_size=batch_size, num_workers=num_workers, order="random",
                          seed=seed, **kwargs)

    return make


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--beton", required=True)
    parser.add_argument("--shorter", required=True, help="a .beton of fewer samples")
    parser.add_argument("--root", required=True, type=Path)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--resume-steps", type=int, nargs="*", default=[])
    args = parser.parse_args()

    dist.init_process_group("gloo")  # the Trainers below join it
    rank = dist.get_rank()
    labels = {"image": None}  # the label field alone
    cases = {
        "seed-per-rank": loader_factory(args.beton, 4, 1, seed=11 + rank, pipelines=labels),
        "beton-per-rank": loader_factory(args.shorter if rank else args.beton, 4, 1,
                                         pipelines=labels),
        "indices-per-rank": loader_factory(args.beton, 4, 1, indices=range(rank, 40, 2),
                                           pipelines=labels),
    }
    differing = fetched_cases(cases, key=lambda batch: batch[-1].ravel().tolist())

    ddp: dict[str, Any] = {"strategy": "ddp", "devices": 2}
    make = loader_factory(args.beton, args.batch_size, num_workers=1)
    directory = args.root / "checkpoints"
    full = fit_recording(make, args.root, args.epochs, [every_step_checkpoints(directory)],
                         model=RecordingModule(labels_key), **ddp)
    resumed = {
        str(step): fit_recording(make, args.root, args.epochs,
                                 ckpt_path=checkpoint_at(directory, step),
                                 model=RecordingModule(labels_key), **ddp)
        for step in args.resume_steps
    }
    write_result({"differing": differing, "full": full, "resumed": resumed, "len": len(make())})


if __name__ == "__main__":
    main()
