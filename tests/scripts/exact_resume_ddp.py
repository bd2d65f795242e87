"""One rank of 2-process DDP ``Trainer.fit`` runs with ``ExactResume`` (run by tests/ddp_harness).

An uninterrupted run (validation twice per epoch) checkpoints after every step and once inside
a validation pass; resumed runs continue from the step whose validation is due (3), from the
end of epoch 0 (6), and from inside validation. A run over an unsized training loader (whose
state is gathered from the ranks) checkpoints at each training batch's start, before its step;
it resumes from batch 5. Each rank reports its event streams; the checkpoint carries every
rank's events, so each resumed stream is comparable with its rank's uninterrupted one.
"""

import sys
from pathlib import Path
from typing import Any

import torch.distributed as dist

from lightning_loaders import GeneratorSource, ResumableLoader
from tests.conftest import IndexDataset
from tests.ddp_harness import write_result
from tests.lightning.test_exact_resume import (
    EventModule,
    SaveAtEachBatchStart,
    SaveDuringValidation,
    fit,
    samples,
)
from tests.lightning_harness import checkpoint_at, every_step_checkpoints


class RankEventModule(EventModule):
    """Checkpoints hold the events of every rank; each rank restores its own."""

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        gathered: list[Any] = [None] * dist.get_world_size()
        dist.all_gather_object(gathered, self.events)
        checkpoint["events"] = gathered

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.events = [tuple(event) for event in checkpoint["events"][dist.get_rank()]]


def loaders() -> tuple[ResumableLoader, ResumableLoader]:
    """Per rank: 6 training batches per epoch, 3 validation batches per pass."""
    train = ResumableLoader(IndexDataset(24), batch_size=2, shuffle=True, seed=3)
    return train, ResumableLoader(IndexDataset(12), batch_size=2, evaluation=True)


def unsized() -> tuple[ResumableLoader, None]:
    """Per rank: 24 samples of unknown length in batches of 2, no validation."""
    return ResumableLoader(GeneratorSource(samples, [(0, 9), (9, 17), (17, 24)]), batch_size=2,
                           shuffle=True, shuffle_buffer=4, seed=3), None


def main() -> None:
    root = Path(sys.argv[1])
    directory, inside = root / "checkpoints", root / "inside.ckpt"
    options: dict[str, Any] = {"strategy": "ddp", "devices": 2, "val_check_interval": 0.5,
                               "module": RankEventModule}
    full = fit(loaders, root, [every_step_checkpoints(directory),
                               SaveDuringValidation(inside, 1, 1)], **options)
    starts = {"step3": checkpoint_at(directory, 3), "step6": checkpoint_at(directory, 6),
              "inside": inside}
    resumed = {name: fit(loaders, root, ckpt_path=path, **options)
               for name, path in starts.items()}
    starts = root / "starts"
    options.pop("val_check_interval")
    in_step = fit(unsized, root, [SaveAtEachBatchStart(starts)], **options)
    in_step_resumed = fit(unsized, root, ckpt_path=starts / "5.ckpt", **options)
    write_result({"full": full, "resumed": resumed,
                  "in_step": {"full": in_step, "resumed": in_step_resumed}})


if __name__ == "__main__":
    main()
