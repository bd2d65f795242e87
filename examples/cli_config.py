"""Configure a ResumableLoader from YAML with LightningCLI.

The data module's ``__init__`` arguments (batch size, workers, shuffle, seed, last-batch policy)
become the ``data:`` section of the configuration; the Trainer, its callbacks (here the
``DataStallMonitor``) and the model are configured the same way. Any value can be overridden on
the command line:

    python examples/cli_config.py fit --config examples/cli_config.yaml
    python examples/cli_config.py fit --config examples/cli_config.yaml \\
        --data.batch_size 16 --trainer.max_epochs 1
    python examples/cli_config.py fit --print_config      # every option, with defaults

Needs ``jsonargparse[signatures]`` (LightningCLI's parser).
"""

from __future__ import annotations

import torch
from lightning.pytorch import LightningDataModule, LightningModule
from lightning.pytorch.cli import LightningCLI
from torch.utils.data import TensorDataset

from lightning_loaders import LastBatch, ResumableLoader


class LineData(LightningDataModule):
    """Generated regression data ``y = 3x + 1 + noise``, served by a ``ResumableLoader``.

    Args:
        samples: dataset size.
        batch_size: samples per batch on each process.
        num_workers: loader worker processes (0 loads in the training process).
        shuffle: a new seeded order every epoch.
        seed: keys the shuffle; ``None`` takes the CLI's ``seed_everything`` value.
        last_batch: ``keep``, ``drop``, ``pad`` or ``rollover`` (see ``ResumableLoader``).
    """

    def __init__(self, samples: int = 256, batch_size: int = 32, num_workers: int = 0,
                 shuffle: bool = True, seed: int | None = None,
                 last_batch: LastBatch = "keep") -> None:
        super().__init__()
        self.batch_size, self.num_workers, self.shuffle = batch_size, num_workers, shuffle
        self.seed, self.last_batch = seed, last_batch
        generator = torch.Generator().manual_seed(0)
        x = torch.rand(samples, 1, generator=generator)
        noise = 0.05 * torch.randn(x.shape, generator=generator)
        self.dataset = TensorDataset(x, 3 * x + 1 + noise)
        self.loader: ResumableLoader | None = None

    def train_dataloader(self) -> ResumableLoader:
        self.loader = ResumableLoader(self.dataset, batch_size=self.batch_size,
                                      shuffle=self.shuffle, num_workers=self.num_workers,
                                      seed=self.seed, last_batch=self.last_batch)
        return self.loader


class LineModel(LightningModule):
    """A one-weight linear regression.

    Args:
        lr: SGD learning rate.
    """

    def __init__(self, lr: float = 0.1) -> None:
        super().__init__()
        self.lr = lr
        self.layer = torch.nn.Linear(1, 1)

    def training_step(self, batch: list[torch.Tensor], batch_idx: int) -> torch.Tensor:
        x, y = batch
        loss = torch.nn.functional.mse_loss(self.layer(x), y)
        self.log("loss", loss, prog_bar=True)
        return loss

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=self.lr)


def main() -> None:
    cli = LightningCLI(LineModel, LineData, save_config_kwargs={"overwrite": True})
    if cli.subcommand == "fit":
        loss = cli.trainer.callback_metrics.get("loss")
        print(f"trained {cli.trainer.global_step} steps, final loss "
              f"{float('nan') if loss is None else float(loss):.4f}")
        print(f"with {cli.datamodule.loader!r}")


if __name__ == "__main__":
    main()
