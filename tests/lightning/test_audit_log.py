"""``ExactResume`` logs each training loader's cursor and resume-audit digest per checkpoint, so
that an uninterrupted run and a resumed one can be compared from their logs."""

from __future__ import annotations

import logging
import re
from pathlib import Path

import pytest

from lightning_loaders import ExactResume, ResumableLoader
from tests.conftest import IndexDataset
from tests.lightning_harness import checkpoint_at, every_step_checkpoints, fit_recording

LOGGER = "lightning_loaders.lightning.exact_resume"
LINE = re.compile(r"checkpoint at global step (\d+), rank 0: training loader 0 at epoch (\d+), "
                  r"batch (\d+), digest ([0-9a-f]{16})$")


def make() -> ResumableLoader:
    return ResumableLoader(IndexDataset(10), batch_size=2, shuffle=True, seed=5)


def logged(caplog: pytest.LogCaptureFixture) -> list[tuple[int, int, int, str]]:
    found = [LINE.match(r.getMessage()) for r in caplog.records if r.name == LOGGER]
    assert all(found), [r.getMessage() for r in caplog.records if r.name == LOGGER]
    caplog.clear()
    return [(int(m[1]), int(m[2]), int(m[3]), m[4]) for m in found if m]


def test_a_resumed_run_logs_the_digests_of_the_uninterrupted_one(
        tmp_path: Path, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger=LOGGER)
    directory = tmp_path / "ckpt"
    fit_recording(make, tmp_path, 2, [ExactResume(), every_step_checkpoints(directory)])
    full = logged(caplog)
    assert [step for step, *_ in full] == list(range(1, 11)), "one line per checkpoint"
    assert [(epoch, batch) for _, epoch, batch, _ in full] == [
        (epoch, batch) for epoch in (0, 1) for batch in range(1, 6)]
    assert len({digest for *_, digest in full}) == 10
    resumed_from = 3
    fit_recording(make, tmp_path / "resumed", 2,
                  [ExactResume(), every_step_checkpoints(tmp_path / "resumed" / "ckpt")],
                  ckpt_path=checkpoint_at(directory, resumed_from))
    assert logged(caplog) == full[resumed_from:]
