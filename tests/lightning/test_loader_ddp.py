"""ResumableLoader in real 2-process DDP (gloo, CPU) under Lightning: coverage, resume, elastic."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import pytest

from lightning_loaders import ResumableLoader
from tests.conftest import IndexDataset
from tests.ddp_harness import REPO, run_ddp
from tests.lightning_harness import checkpoint_at, fit_recording

SCRIPT = REPO / "tests" / "scripts" / "loader_ddp_fit.py"
N, BATCH, EPOCHS = 13, 2, 2


def _as_steps(seen: list) -> list[tuple[int, int, list[int]]]:
    return [(e, i, b) for e, i, b in seen]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory) -> tuple[Path, list]:
    root = tmp_path_factory.mktemp("ddp")
    ckpt = root / "ckpt"
    ranks = run_ddp(SCRIPT, ["--workers", "2", "--ckpt-dir", str(ckpt)], root / "full")
    return ckpt, ranks


def test_every_epoch_is_covered_exactly_once_with_equal_batch_counts(uninterrupted) -> None:
    _, ranks = uninterrupted
    assert ranks[0]["len"] == ranks[1]["len"] == 4
    for epoch in range(EPOCHS):
        per_rank = [[b for e, _, b in r["seen"] if e == epoch] for r in ranks]
        assert len(per_rank[0]) == len(per_rank[1]) == 4
        assert all(len(b) >= 1 for r in per_rank for b in r), "no empty batch on any rank"
        counts = Counter(i for r in per_rank for b in r for i in b)
        assert sorted(counts) == list(range(N)) and set(counts.values()) == {1}


@pytest.mark.parametrize("step", [1, 4, 6])
def test_resume_in_ddp_continues_every_rank_exactly(uninterrupted, tmp_path: Path,
                                                     step: int) -> None:
    ckpt, ranks = uninterrupted
    resumed = run_ddp(SCRIPT, ["--workers", "2", "--resume", str(checkpoint_at(ckpt, step))],
                      tmp_path)
    for full, again in zip(ranks, resumed, strict=True):
        assert _as_steps(again["seen"]) == _as_steps(full["seen"])[step:]


@pytest.mark.parametrize("step", [2, 3])
def test_a_two_rank_checkpoint_resumes_on_one_rank_exactly_once(uninterrupted, tmp_path: Path,
                                                                 step: int) -> None:
    ckpt, ranks = uninterrupted
    consumed = [i for r in ranks for e, _, b in r["seen"][:step] if e == 0 for i in b]

    def make() -> ResumableLoader:
        return ResumableLoader(IndexDataset(N), batch_size=BATCH, shuffle=True, seed=3)

    seen = fit_recording(make, tmp_path, EPOCHS, ckpt_path=checkpoint_at(ckpt, step))
    rest_of_epoch = [i for e, _, b in seen if e == 0 for i in b]
    assert sorted(consumed + rest_of_epoch) == list(range(N))
    next_epoch = [i for e, _, b in seen if e == 1 for i in b]
    assert sorted(next_epoch) == list(range(N))


def test_plain_dataloaders_passed_to_fit_become_distributed_and_resumable(tmp_path: Path
                                                                          ) -> None:
    """No glue: with ``ExactResume``, a plain shuffled ``DataLoader`` given to ``fit`` covers
    every sample once per epoch across the ranks, and a mid-epoch checkpoint resumes every
    rank at its next batch."""
    ckpt = tmp_path / "ckpt"
    full = run_ddp(SCRIPT, ["--plain", "--workers", "2", "--ckpt-dir", str(ckpt)],
                   tmp_path / "full")
    for epoch in range(EPOCHS):
        per_rank = [[b for e, _, b in r["seen"] if e == epoch] for r in full]
        assert len(per_rank[0]) == len(per_rank[1]) == 4
        counts = Counter(i for r in per_rank for b in r for i in b)
        assert sorted(counts) == list(range(N)) and set(counts.values()) == {1}
    resumed = run_ddp(SCRIPT, ["--plain", "--workers", "2", "--resume",
                               str(checkpoint_at(ckpt, 3))], tmp_path / "resumed")
    for whole, again in zip(full, resumed, strict=True):
        assert _as_steps(again["seen"]) == _as_steps(whole["seen"])[3:]


def test_dataloaders_passed_to_fit_that_the_user_shards_are_left_as_they_are(tmp_path: Path
                                                                             ) -> None:
    """Under ``use_distributed_sampler=False`` the ranks read their ``DataLoader``s as given,
    as in plain Lightning: a sampler that splits by rank itself (Megatron's attributes) reads
    all 11 samples per epoch (the converted loader split it again: 5 of 11), and the warning
    at training start says why a resume restarts the epoch and what resumes exactly."""
    runs = run_ddp(REPO / "tests" / "scripts" / "passed_loaders_ddp.py",
                   ["user-shards", str(tmp_path)], tmp_path / "out")
    for epoch in range(EPOCHS):
        seen = Counter(i for run in runs for e, _, b in run["seen"] if e == epoch for i in b)
        assert sorted(seen) == list(range(11)), epoch
    for run in runs:
        assert run["kind"] == "DataLoader"
        [warning] = run["warnings"]
        assert "Under Trainer(use_distributed_sampler=False) on several processes" in warning


def test_a_dataloader_seeded_by_the_rank_passed_to_fit_is_refused(tmp_path: Path) -> None:
    """``generator=torch.Generator().manual_seed(rank)`` seeds the converted loader by the
    rank: the ranks would shuffle different orders (2 samples repeated and 2 lost in epoch 0,
    caught only at a resume). Every rank refuses it at the first epoch start, naming both
    seeds, before a step is trained."""
    runs = run_ddp(REPO / "tests" / "scripts" / "passed_loaders_ddp.py",
                   ["generator-per-rank", str(tmp_path)], tmp_path / "out")
    for run in runs:
        assert run["error"].startswith(
            "ValueError: the loader's seed differs between ranks (0 on rank 0, 1 on rank 1)")
        assert run["seen"] == []
