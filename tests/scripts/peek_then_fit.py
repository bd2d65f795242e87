"""A batch looked at before ``Trainer(strategy=..., devices=2).fit`` starts DDP (a notebook's
habit): each rank writes the indices it trained on to ``<out>.rank<r>``.

Usage: ``python peek_then_fit.py STRATEGY NUM_WORKERS OUT``."""

import json
import logging
import sys
import warnings

import lightning as L
import torch

from lightning_loaders import ResumableLoader
from tests.conftest import RangeDataset


class Recorder(L.LightningModule):
    def __init__(self, out: str) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(1, 1)
        self.out = out

    def training_step(self, batch: torch.Tensor, batch_idx: int) -> torch.Tensor:
        with open(f"{self.out}.rank{self.global_rank}", "a") as file:
            file.write(json.dumps(batch.tolist()) + "\n")
        return self.layer(batch.float()[:, None]).pow(2).mean()

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


if __name__ == "__main__":
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)
    warnings.filterwarnings("ignore")
    strategy, workers, out = sys.argv[1], int(sys.argv[2]), sys.argv[3]
    loader = ResumableLoader(RangeDataset(24), batch_size=3, shuffle=True, seed=1,
                             num_workers=workers)
    next(iter(loader))
    trainer = L.Trainer(strategy=strategy, accelerator="cpu", devices=2, max_epochs=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        enable_checkpointing=False)
    trainer.fit(Recorder(out), loader)
