"""``ResumableLoader`` under Lightning ``Fabric``: the loader goes in the state that
``fabric.save`` writes, and a run resumed with ``fabric.load`` from any step (epoch ends
included) trains on exactly the rest, in one process and in real 2-process DDP."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import lightning as L
import pytest

from lightning_loaders import ResumableLoader
from tests.conftest import IndexDataset
from tests.ddp_harness import REPO, run_ddp
from tests.fabric_harness import fabric_recording

SCRIPT = REPO / "tests" / "scripts" / "fabric_ddp.py"
N, BATCH, EPOCHS = 13, 2, 2


@pytest.mark.parametrize("workers", [0, 2])
def test_a_fabric_run_resumed_from_any_step_trains_on_exactly_the_rest(tmp_path: Path,
                                                                       workers: int) -> None:
    def make_loader() -> ResumableLoader:
        return ResumableLoader(IndexDataset(N), batch_size=BATCH, shuffle=True, seed=3,
                               num_workers=workers)

    fabric = L.Fabric(accelerator="cpu", devices=1)
    full = fabric_recording(fabric, make_loader, EPOCHS, ckpt_dir=tmp_path)
    per_epoch = -(-N // BATCH)
    assert len(full) == EPOCHS * per_epoch
    for epoch in range(EPOCHS):  # each epoch is every sample once, in an order of its own
        assert sorted(i for e, b in full if e == epoch for i in b) == list(range(N))
    assert [b for e, b in full if e == 0] != [b for e, b in full if e == 1]
    for step in range(1, len(full) + 1):
        rest = fabric_recording(fabric, make_loader, EPOCHS, resume=tmp_path / f"step{step}.ckpt")
        assert full[:step] + rest == full, step


def test_fabric_ddp_ranks_split_every_epoch_and_resume_exactly(tmp_path: Path) -> None:
    ckpt = tmp_path / "ckpt"
    ranks = run_ddp(SCRIPT, ["--workers", "2", "--ckpt-dir", str(ckpt)], tmp_path / "full")
    full = [rank["seen"] for rank in ranks]
    assert ranks[0]["len"] == ranks[1]["len"] == len(full[0]) // EPOCHS == len(full[1]) // EPOCHS
    for epoch in range(EPOCHS):
        counts = Counter(i for seen in full for e, b in seen if e == epoch for i in b)
        assert sorted(counts) == list(range(N)) and set(counts.values()) == {1}, epoch
    steps = len(full[0])
    for step in (1, steps // EPOCHS, steps - 1):  # mid-epoch, an epoch's last batch, the end
        resumed = run_ddp(SCRIPT, ["--workers", "2", "--resume", str(ckpt / f"step{step}.ckpt")],
                          tmp_path / f"resume{step}")
        for rank in range(2):
            assert full[rank][:step] + resumed[rank]["seen"] == full[rank], (step, rank)
