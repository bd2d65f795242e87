"""Several training loaders in a ``CombinedLoader``, every mode ``fit`` supports, under a real
``Trainer``: a resume from the checkpoint after every step repeats the uninterrupted run.

``max_size`` is the trap (DESIGN.md section 2): a member that ends before the longest one must
stay exhausted for the rest of that combined epoch, also when restored at its end; under
``max_size_cycle`` it is iterated again in the same trainer epoch, which starts its next epoch.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.utilities import CombinedLoader

from lightning_loaders import ExactResume, ResumableLoader
from lightning_loaders.sources.shards import GeneratorSource, SequenceSource
from tests.conftest import IndexDataset
from tests.lightning_harness import (
    check_trainer_resume,
    checkpoint_at,
    every_step_checkpoints,
    fit_recording,
)

MODES = ["max_size", "max_size_cycle", "min_size"]
LONG, SHORT = 6, 3  # batches per epoch of the members


def combined(mode: str, num_workers: int, iterable: bool = False) -> Callable[[], CombinedLoader]:
    """Member ``a`` of ``LONG`` batches and ``b`` of ``SHORT`` (map-style, or iterable)."""

    def make() -> CombinedLoader:
        short: Any = (SequenceSource([list(range(2 * SHORT - 2)), [100, 101]]) if iterable
                      else IndexDataset(2 * SHORT))
        return CombinedLoader({
            "a": ResumableLoader(IndexDataset(2 * LONG), batch_size=2, shuffle=True, seed=1,
                                 num_workers=num_workers),
            "b": ResumableLoader(short, batch_size=2, shuffle=True, seed=2,
                                 num_workers=num_workers),
        }, mode=mode)

    return make


def members_per_epoch(full: list[tuple[int, int, Any]], name: str) -> list[list[Any]]:
    return [[step[2][name] for step in full if step[0] == epoch] for epoch in (0, 1)]


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("mode", MODES)
def test_every_checkpoint_resumes_every_member_exactly(tmp_path: Path, mode: str,
                                                        num_workers: int) -> None:
    make = combined(mode, num_workers)
    full = check_trainer_resume(make, tmp_path, max_epochs=2)
    steps = SHORT if mode == "min_size" else LONG
    assert [e for e, _, _ in full] == [0] * steps + [1] * steps
    a, b = members_per_epoch(full, "a"), members_per_epoch(full, "b")
    if mode != "min_size":
        assert all(sorted(i for batch in epoch for i in batch) == list(range(2 * LONG))
                   for epoch in a)
    if mode == "max_size":
        assert all(epoch[SHORT:] == [None] * (LONG - SHORT) for epoch in b)
        chained = tmp_path / "chained"  # checkpoints written while ``b`` stays finished
        fit_recording(make, tmp_path, 2, [every_step_checkpoints(chained)],
                      ckpt_path=checkpoint_at(tmp_path / "checkpoints", SHORT))
        for step in (SHORT + 1, LONG - 1):
            assert fit_recording(make, tmp_path, 2,
                                 ckpt_path=checkpoint_at(chained, step)) == full[step:]
    if mode == "max_size_cycle":
        assert all(epoch[:SHORT] != epoch[SHORT:] for epoch in b), "a cycle is a new epoch"
    assert b[0][:SHORT] != b[1][:SHORT], "each epoch of a member has its own order"


@pytest.mark.parametrize("mode", MODES)
def test_an_iterable_member_resumes_exactly(tmp_path: Path, mode: str) -> None:
    full = check_trainer_resume(combined(mode, 2, iterable=True), tmp_path, max_epochs=2)
    assert len(full) == 2 * (SHORT if mode == "min_size" else LONG)


def _ids(shard: tuple[int, int]) -> Any:
    return iter(range(*shard))


def unsized(mode: str, shuffle: bool = False) -> Callable[[], CombinedLoader]:
    """Members of unknown length (``GeneratorSource`` without lengths): ``a`` of ``LONG``
    batches, ``b`` of ``SHORT``. Lightning then prefetches a combined batch ahead of
    the step."""

    def make() -> CombinedLoader:
        return CombinedLoader({
            "a": ResumableLoader(GeneratorSource(_ids, [(0, 5), (5, 9), (9, 2 * LONG)]),
                                 batch_size=2, shuffle=shuffle, seed=1),
            "b": ResumableLoader(GeneratorSource(_ids, [(100, 103), (103, 100 + 2 * SHORT)]),
                                 batch_size=2, shuffle=shuffle, seed=2),
        }, mode=mode)

    return make


@pytest.mark.parametrize("mode", MODES)
def test_unsized_members_resume_exactly(tmp_path: Path, mode: str) -> None:
    """Lightning's fit loop fetches a batch of the restored members before it gives them the
    epoch: under ``max_size`` ``b``, restored at its end, began its next epoch there (resumed
    after step 3 with ``[100, 101]`` where it stays over); under ``min_size`` ``a``, restored
    mid-epoch after the epoch's last step, read on in that epoch in the next. Under
    ``max_size_cycle`` the batch of ``b``'s next epoch that the fetcher held (``b`` iterated
    again inside the fetcher's ``next()``) was counted delivered, and skipped on resume."""
    full = check_trainer_resume(unsized(mode), tmp_path, max_epochs=2, batch_idx=False)
    assert len(full) == 2 * (SHORT if mode == "min_size" else LONG)


def test_a_shuffled_unsized_member_cycles_as_before_a_resume(tmp_path: Path) -> None:
    """Under ``max_size_cycle`` the epoch ends when ``a`` ends after ``b`` cycled; resumed
    mid-epoch after ``b`` cycled, a new iterator counted ``b`` not cycled, so ``a`` was
    iterated again at its end and read the next trainer epoch in its own epoch 2 (resumed
    after steps 3-5: ``[11, 0]`` where ``[11, 5]`` came, shards in another order).
    ``ExactResume`` carries which members cycled."""
    directory = tmp_path / "checkpoints"
    full = fit_recording(unsized("max_size_cycle", shuffle=True), tmp_path, 2,
                         [every_step_checkpoints(directory), ExactResume()])
    for step in range(1, len(full)):
        resumed = fit_recording(unsized("max_size_cycle", shuffle=True), tmp_path, 2,
                                [ExactResume()], ckpt_path=checkpoint_at(directory, step))
        assert resumed == full[step:], step
