"""A bucketing batch sampler (batches of many sizes, a number of batches that changes between
epochs) and a curriculum sampler (whose ``len()`` grows with its ``set_epoch``) in a plain
``DataLoader``, made resumable with ``make_resumable``, under a real Lightning ``Trainer`` on
CPU.

Lightning reads ``len()`` when it sets the data up and stops every epoch there, so epochs whose
lengths differ need ``reload_dataloaders_every_n_epochs=1``; ``ExactResume`` then also resumes a
checkpoint written at an epoch's last batch into a next epoch of another length. Under real
2-process DDP, the plain ``DataLoader`` passed to ``fit`` is dealt whole over the ranks.
"""

from __future__ import annotations

from pathlib import Path

import pytest
from torch.utils.data import DataLoader

from lightning_loaders import ExactResume, ResumableLoader, make_resumable
from tests.buckets import (
    GrowingCurriculum,
    LengthBuckets,
    curriculum_epochs,
    dealt,
    flat,
    sampler_epochs,
)
from tests.conftest import IndexDataset
from tests.ddp_harness import REPO, run_ddp
from tests.lightning_harness import checkpoint_at, every_step_checkpoints, fit_recording

N, EPOCHS = 37, 3
DDP_SCRIPT = REPO / "tests" / "scripts" / "bucketing_ddp_fit.py"
RELOAD = {"reload_dataloaders_every_n_epochs": 1}


def make() -> ResumableLoader:
    return make_resumable(DataLoader(IndexDataset(N), batch_sampler=LengthBuckets(N)))


def flat_epochs(epochs: list[list[list[int]]]) -> list[list[int]]:
    return [batch for epoch in epochs for batch in epoch]


def per_epoch(seen: list) -> list[list[list[int]]]:
    return [[batch for e, _, batch in seen if e == epoch] for epoch in range(EPOCHS)]


def test_every_epoch_trains_the_samplers_batches_whole(tmp_path: Path) -> None:
    expected = sampler_epochs(N, EPOCHS)
    assert len({len(epoch) for epoch in expected}) > 1
    seen = fit_recording(make, tmp_path, EPOCHS, **RELOAD)
    assert per_epoch(seen) == expected
    assert [i for _, i, _ in seen] == [i for epoch in expected for i in range(len(epoch))]


@pytest.mark.filterwarnings("ignore:.*ckpt_path")
def test_every_checkpoint_resumes_exactly(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    full = fit_recording(make, tmp_path, EPOCHS, [ExactResume(), every_step_checkpoints(directory)],
                         **RELOAD)
    assert per_epoch(full) == sampler_epochs(N, EPOCHS)
    for step in range(1, len(full) + 1):
        resumed = fit_recording(make, tmp_path / "resumed", EPOCHS, [ExactResume()],
                                ckpt_path=checkpoint_at(directory, step), **RELOAD)
        assert resumed == full[step:], f"resume from step {step} diverged"


def test_without_reloads_a_longer_epoch_is_cut_at_the_first_len_with_a_warning(
        tmp_path: Path) -> None:
    expected = sampler_epochs(N, EPOCHS)
    assert len(expected[2]) > len(expected[0])
    with pytest.warns(UserWarning, match="epoch 2 has 14 batches.*Lightning read len\\(\\)=13"
                      ".*reload_dataloaders_every_n_epochs=1"):
        seen = fit_recording(make, tmp_path, EPOCHS)
    assert per_epoch(seen) == [*expected[:2], expected[2][:len(expected[0])]]


def curriculum() -> ResumableLoader:
    return make_resumable(DataLoader(IndexDataset(N), batch_size=4, sampler=GrowingCurriculum()))


def samples_per_epoch(seen: list) -> list[list[int]]:
    return [sorted(i for e, _, batch in seen if e == epoch for i in batch)
            for epoch in range(EPOCHS)]


def test_a_curriculum_trains_every_epochs_samples_with_reloads(tmp_path: Path) -> None:
    """Lightning sets the loader's epoch, not the sampler's: every epoch read the length the
    sampler had when the loader was built (10/10/10); it reads the sampler's ``len()`` of that
    epoch (10/14/18), as the sampler gives them by hand."""
    seen = fit_recording(curriculum, tmp_path, EPOCHS, **RELOAD)
    assert samples_per_epoch(seen) == curriculum_epochs(EPOCHS)


def test_without_reloads_a_curriculums_longer_epochs_are_cut_with_a_warning(
        tmp_path: Path) -> None:
    with pytest.warns(UserWarning, match="epoch 1 has 4 batches.*Lightning read len\\(\\)=3"
                      ".*reload_dataloaders_every_n_epochs=1"):
        seen = fit_recording(curriculum, tmp_path, EPOCHS)
    assert [len(samples) for samples in samples_per_epoch(seen)] == [10, 12, 12]


@pytest.mark.filterwarnings("ignore:.*ckpt_path")
def test_every_checkpoint_of_a_curriculum_resumes_exactly(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    full = fit_recording(curriculum, tmp_path, EPOCHS,
                         [ExactResume(), every_step_checkpoints(directory)], **RELOAD)
    assert samples_per_epoch(full) == curriculum_epochs(EPOCHS)
    for step in range(1, len(full) + 1):
        resumed = fit_recording(curriculum, tmp_path / "resumed", EPOCHS, [ExactResume()],
                                ckpt_path=checkpoint_at(directory, step), **RELOAD)
        assert resumed == full[step:], f"resume from step {step} diverged"


@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory) -> tuple[Path, list]:
    root = tmp_path_factory.mktemp("bucketing_ddp")
    ckpt = root / "ckpt"
    return ckpt, run_ddp(DDP_SCRIPT, ["--ckpt-dir", str(ckpt)], root / "full")


def test_two_ddp_ranks_read_the_samplers_batches_whole_with_equal_counts(ddp_run) -> None:
    _, ranks = ddp_run
    for epoch, batches in enumerate(sampler_epochs(N, EPOCHS)):
        per_rank = [[b for e, _, b in rank["seen"] if e == epoch] for rank in ranks]
        assert per_rank == dealt(batches, 2)
        assert sorted(i for batches in per_rank for i in flat(batches)) == list(range(N))


def test_ddp_checkpoints_resume_every_rank_exactly(ddp_run, tmp_path: Path) -> None:
    ckpt, ranks = ddp_run
    epoch_ends = [sum(len(dealt(e, 2)[0]) for e in sampler_epochs(N, EPOCHS)[:k + 1])
                  for k in range(EPOCHS - 1)]
    for step in (3, epoch_ends[0], epoch_ends[1] + 2):
        resumed = run_ddp(DDP_SCRIPT, ["--resume", str(checkpoint_at(ckpt, step))],
                          tmp_path / str(step))
        for full, again in zip(ranks, resumed, strict=True):
            assert again["seen"] == full["seen"][step:], step


@pytest.mark.filterwarnings("ignore:.*ckpt_path")
@pytest.mark.parametrize("step", [3, 8])
def test_a_ddp_checkpoint_resumes_on_one_rank_from_the_next_batch(ddp_run, tmp_path: Path,
                                                                  step: int) -> None:
    ckpt, ranks = ddp_run
    expected = sampler_epochs(N, EPOCHS)
    epoch, batch = ranks[0]["seen"][step - 1][:2]  # the checkpoint's epoch and batch_idx

    def plain() -> DataLoader:
        return DataLoader(IndexDataset(N), batch_sampler=LengthBuckets(N))

    seen = fit_recording(plain, tmp_path, EPOCHS, [ExactResume()],
                         ckpt_path=checkpoint_at(ckpt, step), **RELOAD)
    rest = expected[epoch][2 * (batch + 1):]
    assert [b for _, _, b in seen] == flat_epochs([rest, *expected[epoch + 1:]])
