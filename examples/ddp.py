"""Two processes, one epoch plan: ResumableLoader under 2-process DDP on CPU (gloo).

Lightning launches the second process itself. The script trains three times on generated data:
uninterrupted; stopped after ``--stop-at-step`` (checkpoints every step); resumed from that
checkpoint. Rank 0 then prints whether every epoch covered every sample exactly once across the
two ranks, whether both ranks had the same number of batches, and whether the stopped and
resumed runs together equal the uninterrupted one on every rank.

    python examples/ddp.py [--samples 50] [--batch-size 4] [--num-workers 1]
"""

from __future__ import annotations

import argparse
import logging
import os
import shutil
import sys
import tempfile
import warnings
from collections import Counter
from pathlib import Path

import lightning as L
import torch
import torch.distributed as dist
from lightning.pytorch.callbacks import Callback, ModelCheckpoint
from torch.utils.data import Dataset

from lightning_loaders import ResumableLoader

_CKPT_DIR = "LIGHTNING_LOADERS_DDP_EXAMPLE_DIR"


class Numbers(Dataset[tuple[torch.Tensor, int]]):
    def __init__(self, n: int) -> None:
        self.x = torch.linspace(-1, 1, n).unsqueeze(1)

    def __len__(self) -> int:
        return len(self.x)

    def __getitem__(self, index: int) -> tuple[torch.Tensor, int]:
        return self.x[index], index


class Recorder(L.LightningModule):
    def __init__(self) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.seen: list[tuple[int, list[int]]] = []

    def training_step(self, batch, batch_idx: int) -> torch.Tensor:
        x, index = batch
        self.seen.append((self.current_epoch, index.tolist()))
        return self.layer(x).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


class StopAfter(Callback):
    """Stops training cleanly after a step, as a pre-empted job would after its last checkpoint."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, *args: object) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


def fit(args: argparse.Namespace, callbacks: list[Callback], ckpt: Path | None = None
        ) -> list[tuple[int, list[int]]]:
    model = Recorder()
    loader = ResumableLoader(Numbers(args.samples), batch_size=args.batch_size, shuffle=True,
                             seed=1, num_workers=args.num_workers)
    trainer = L.Trainer(strategy="ddp", accelerator="cpu", devices=2, max_epochs=args.epochs,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        callbacks=callbacks,
                        enable_checkpointing=any(isinstance(c, ModelCheckpoint) for c in callbacks))
    trainer.fit(model, loader, ckpt_path=str(ckpt) if ckpt else None)
    return model.seen


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=50)
    parser.add_argument("--batch-size", type=int, default=4)
    parser.add_argument("--epochs", type=int, default=2)
    parser.add_argument("--num-workers", type=int, default=1)
    parser.add_argument("--stop-at-step", type=int, default=5)
    args = parser.parse_args()
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")

    # Lightning starts rank 1 as a copy of this script with this environment: it finds the
    # directory rank 0 made, and rank 0 removes it at the end.
    made_here = _CKPT_DIR not in os.environ
    if made_here:
        os.environ[_CKPT_DIR] = tempfile.mkdtemp(prefix="lightning_loaders_ddp_")
    ckpt_dir = Path(os.environ[_CKPT_DIR])
    full = fit(args, [])
    every_step = ModelCheckpoint(dirpath=ckpt_dir, every_n_train_steps=1, save_top_k=-1,
                                 filename="{step}")
    before = fit(args, [every_step, StopAfter(args.stop_at_step)])
    after = fit(args, [], ckpt=ckpt_dir / f"step={args.stop_at_step}.ckpt")

    runs: list[list] = [[], [], []]
    for gathered, mine in zip(runs, (full, before, after), strict=True):
        gathered.extend([None] * dist.get_world_size())
        dist.all_gather_object(gathered, mine)
    rank = dist.get_rank()
    dist.destroy_process_group()  # before exiting, so that no rank exits with gloo's threads alive
    if made_here:  # every rank is done with the checkpoints (they all gathered above)
        shutil.rmtree(ckpt_dir, ignore_errors=True)
    if rank != 0:
        return 0
    ranks_full, ranks_before, ranks_after = runs
    exactly_once = all(
        Counter(i for seen in ranks_full for e, batch in seen if e == epoch for i in batch)
        == Counter(range(args.samples))
        for epoch in range(args.epochs)
    )
    counts = [len(seen) for seen in ranks_full]
    identical = all(b + a == f for f, b, a in zip(ranks_full, ranks_before, ranks_after,
                                                   strict=True))
    print(f"batches per rank: {counts} (len(loader) per epoch x {args.epochs} epochs)")
    print(f"every epoch covers every sample exactly once across ranks: "
          f"{'yes' if exactly_once else 'NO'}")
    print(f"same number of batches on every rank: {'yes' if len(set(counts)) == 1 else 'NO'}")
    print(f"stopped after step {args.stop_at_step}, resumed: "
          f"{[len(b) for b in ranks_before]} + {[len(a) for a in ranks_after]} batches")
    print(f"identical to an uninterrupted run on every rank: {'yes' if identical else 'NO'}")
    return 0 if exactly_once and identical and len(set(counts)) == 1 else 1


if __name__ == "__main__":
    sys.exit(main())
