"""``lightning_loaders.testing.check_resume_at_every_step``: passes a loader that resumes
exactly and names the first snapshot of one that does not."""

from __future__ import annotations

from typing import Any

import pytest

from lightning_loaders import ResumableLoader
from lightning_loaders.testing import check_resume_at_every_step
from tests.conftest import IndexDataset


class _ForgetfulLoader:
    """Saves a cursor but restarts its epoch from batch 0 on resume: what the check exists to
    catch."""

    def __init__(self) -> None:
        self.batches: list[list[int]] = [[0, 1], [2, 3], [4]]
        self.delivered = 0

    def __iter__(self) -> Any:
        for batch in self.batches:
            self.delivered += 1
            yield batch
        self.delivered = 0

    def state_dict(self) -> dict[str, int]:
        return {"delivered": self.delivered}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.delivered = state["delivered"]


def test_an_exact_loader_passes_and_its_stream_is_returned() -> None:
    full = check_resume_at_every_step(
        lambda: ResumableLoader(IndexDataset(10), batch_size=3, shuffle=True, seed=1), epochs=2)
    assert [len(epoch) for epoch in full] == [4, 4]
    assert full[0] != full[1]


def test_a_loader_that_restarts_its_epoch_is_caught() -> None:
    with pytest.raises(AssertionError, match="resume after batch 1 of epoch 0 diverged"):
        check_resume_at_every_step(_ForgetfulLoader, epochs=1)


def test_a_loader_that_delivers_nothing_is_refused() -> None:
    class Empty(_ForgetfulLoader):
        def __init__(self) -> None:
            super().__init__()
            self.batches = []

    with pytest.raises(AssertionError, match="nothing to check"):
        check_resume_at_every_step(Empty, epochs=1)
