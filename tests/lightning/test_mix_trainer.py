"""A three-source ``Mix`` (map-style, Parquet, Hugging Face) with a step schedule under a real
Lightning ``Trainer``: realised proportions, resume from every step (alone, in a
``ResumableDataModule``, in a ``CombinedLoader``, with ``ExactResume``, with weights changed by a
callback), and a real 2-rank DDP checkpoint resumed on one rank."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader

from lightning_loaders import ExactResume, Mix, ResumableDataModule, ResumableLoader
from tests.conftest import IndexDataset
from tests.ddp_harness import REPO, run_ddp
from tests.lightning_harness import (
    RecordingModule,
    checkpoint_at,
    every_step_checkpoints,
    fit_recording,
)
from tests.mix_sources import three_source_mix, write_sources
from tests.orders.test_mix import proportions_match

pytest.importorskip("datasets")
pytest.importorskip("pyarrow")

SCRIPT = REPO / "tests" / "scripts" / "mix_ddp_fit.py"
EPOCHS = 2


def mix_loader(root: Path, num_workers: int = 0) -> Callable[[], ResumableLoader]:
    def make() -> ResumableLoader:
        mix = three_source_mix(root / "data", samples_per_epoch=16, seed=7)
        return ResumableLoader(mix, batch_size=4, num_workers=num_workers)

    return make


class Reweight(L.Callback):
    """Changes the mixture's weights from a callback at one step (as a curriculum would)."""

    def __init__(self, at: int) -> None:
        self.at = at

    def on_train_batch_end(self, trainer: L.Trainer, *args: Any) -> None:
        if trainer.global_step == self.at:
            trainer.train_dataloader.dataset.set_weights([0.0, 0.0, 1.0], trainer.global_step)


def resume_from_every_step(make: Callable[[], Any], root: Path,
                           callbacks: Callable[[], list[Any]] = list) -> list[Any]:
    """Checkpoint after every step, resume from each checkpoint (callbacks in both runs) and
    compare with the uninterrupted run."""
    directory = root / "checkpoints"
    full = fit_recording(make, root, EPOCHS, [*callbacks(), every_step_checkpoints(directory)])
    assert len(full) == EPOCHS * 4
    for step in range(1, len(full) + 1):
        resumed = fit_recording(make, root, EPOCHS, callbacks(),
                                ckpt_path=checkpoint_at(directory, step))
        assert resumed == full[step:], f"resume from step {step}"
    return full


def test_resume_from_every_step_is_exact(tmp_path: Path) -> None:
    full = resume_from_every_step(mix_loader(tmp_path, num_workers=2), tmp_path)
    ids = [i for _, _, batch in full for i in batch]
    assert {i // 1000 for i in ids} == {0, 1, 2}, "every source is read"


def test_weights_changed_from_a_callback_resume_exactly(tmp_path: Path) -> None:
    full = resume_from_every_step(mix_loader(tmp_path), tmp_path, lambda: [Reweight(at=2)])
    assert all(i >= 2000 for _, _, batch in full[2:] for i in batch)
    assert any(i < 2000 for _, _, batch in full[:2] for i in batch)


def test_with_exact_resume(tmp_path: Path) -> None:
    resume_from_every_step(mix_loader(tmp_path), tmp_path, lambda: [ExactResume()])


def test_in_a_resumable_datamodule(tmp_path: Path) -> None:
    class MixData(ResumableDataModule):
        def train_dataloader(self) -> DataLoader:
            mix = three_source_mix(tmp_path / "data", samples_per_epoch=16, seed=7)
            return DataLoader(mix, batch_size=4)

    resume_from_every_step(MixData, tmp_path)


def test_in_a_combined_loader(tmp_path: Path) -> None:
    def make() -> CombinedLoader:
        return CombinedLoader({"mix": mix_loader(tmp_path)(),
                               "other": ResumableLoader(IndexDataset(6), batch_size=2, seed=1,
                                                        shuffle=True)},
                              mode="max_size_cycle")

    full = resume_from_every_step(make, tmp_path)
    assert set(full[0][2]) == {"mix", "other"}


def test_realised_proportions_match_the_schedule_under_a_trainer(tmp_path: Path) -> None:
    schedule = [(0, [0.6, 0.3, 0.1]), (30, [0.1, 0.3, 0.6])]

    def make() -> ResumableLoader:
        mix = Mix(write_sources(tmp_path / "data"), schedule, batch_size=16,
                  samples_per_epoch=16 * 60, seed=11)
        return ResumableLoader(mix, batch_size=16)

    seen = fit_recording(make, tmp_path, 1, model=RecordingModule(
        key=lambda batch: batch["source"].tolist()))
    sources = np.array([batch for _, _, batch in seen])
    assert sources.shape == (60, 16)
    assert proportions_match(sources[:30].ravel(), schedule[0][1])
    assert proportions_match(sources[30:].ravel(), schedule[1][1])
    assert not proportions_match(sources[30:].ravel(), schedule[0][1])


def test_a_two_rank_ddp_checkpoint_continues_exactly_on_one_rank(tmp_path: Path) -> None:
    write_sources(tmp_path / "data")  # once, before the ranks start
    ranks = run_ddp(SCRIPT, [str(tmp_path)], tmp_path / "results")
    steps = [(e, batch0 + batch1) for (e, _, batch0), (_, _, batch1) in
             zip(ranks[0]["seen"], ranks[1]["seen"], strict=True)]
    assert len(steps) == EPOCHS * 4

    def make() -> ResumableLoader:  # the same mixture (its steps are global batches of 6)
        mix = three_source_mix(tmp_path / "data", batch_size=6, samples_per_epoch=24, seed=7)
        return ResumableLoader(mix, batch_size=3)

    for step in (1, 3, 6):  # mid-epoch (an epoch-end checkpoint: see the closing note)
        resumed = fit_recording(make, tmp_path / "one", EPOCHS,
                                ckpt_path=checkpoint_at(tmp_path / "ckpt", step))
        for epoch in range(EPOCHS):
            expected = [i for e, batch in steps[step:] if e == epoch for i in batch]
            got = [i for e, _, batch in resumed if e == epoch for i in batch]
            assert got == expected, f"step {step}, epoch {epoch}"
