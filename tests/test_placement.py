import json
import os
from pathlib import Path

import pytest
import torch

from lightning_loaders import ResumableLoader
from lightning_loaders.placement import resolve_device, resolve_rank_world


def test_explicit_placement_wins(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.setenv("RANK", "3")
    assert resolve_rank_world(1, 2) == (1, 2)
    assert resolve_rank_world() == (3, 4)


def test_defaults_to_a_single_process(monkeypatch) -> None:
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    assert resolve_rank_world() == (0, 1)


@pytest.mark.parametrize(("rank", "world"), [(1, None), (2, 2), (-1, 2)])
def test_bad_placement_is_refused(rank, world) -> None:
    with pytest.raises(ValueError):
        resolve_rank_world(rank, world)


@pytest.mark.parametrize(("rank", "world", "named"), [(0.5, 2, "rank"), (True, 2, "rank"),
                                                      (0, 2.0, "world_size"), ("0", 2, "rank")])
def test_a_placement_that_is_no_int_is_refused_at_construction(rank, world, named) -> None:
    """A float read from a config file, say: it used to fail at the first batch, in numpy."""
    with pytest.raises(TypeError, match=f"{named} must be an int, got"):
        ResumableLoader(list(range(4)), rank=rank, world_size=world)


def test_a_bad_environment_is_named(monkeypatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "abc")
    with pytest.raises(ValueError, match="environment variable WORLD_SIZE='abc' is not an int"):
        resolve_rank_world()
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "2")
    with pytest.raises(ValueError, match="the environment says rank=2, world_size=2"):
        resolve_rank_world()


def test_device_comes_from_the_trainer_strategy() -> None:
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    assert resolve_device(trainer) == trainer.strategy.root_device == torch.device("cpu")
    assert resolve_device(trainer, "cpu") == torch.device("cpu")
    alone = torch.device("cuda", 0) if torch.cuda.is_available() else torch.device("cpu")
    assert resolve_device() == alone


def test_a_loader_read_before_ddp_starts_is_placed_when_it_does(monkeypatch) -> None:
    """Read with no process group or environment, a loader falls back to rank 0 of 1; once
    DDP is there (here: its environment) the next epoch and ``len()`` follow it, starting at
    the declared epoch: what was read before does not shift the training."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    loader = ResumableLoader(list(range(24)), batch_size=3, shuffle=True, seed=1)
    next(iter(loader))
    assert len(loader) == 8
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    assert len(loader) == 4
    loader.set_epoch(0)
    got = [i for batch in loader for i in batch.tolist()]
    expected = ResumableLoader(list(range(24)), batch_size=3, shuffle=True, seed=1)
    assert got == [i for batch in expected for i in batch.tolist()]


@pytest.mark.parametrize("strategy", ["ddp_spawn", "ddp"])
def test_a_batch_looked_at_before_fit_leaves_ddp_sharded(tmp_path, strategy) -> None:
    """Real DDP started by ``Trainer.fit`` from this process (the ranks then had rank 0 of 1
    fixed, read the whole epoch each, and under ``ddp`` ran uneven batch counts)."""
    import subprocess
    import sys

    from tests.ddp_harness import REPO

    out = tmp_path / "run"
    env = {name: value for name, value in os.environ.items()
           if name not in ("WORLD_SIZE", "RANK", "LOCAL_RANK")}
    env["PYTHONPATH"] = str(REPO)
    subprocess.run([sys.executable, str(REPO / "tests" / "scripts" / "peek_then_fit.py"),
                    strategy, "0", str(out)], check=True, env=env, cwd=tmp_path, timeout=300,
                   capture_output=True)
    ranks = [[json.loads(line) for line in Path(f"{out}.rank{r}").read_text().splitlines()]
             for r in range(2)]
    assert [len(batches) for batches in ranks] == [4, 4]
    assert sorted(i for batches in ranks for batch in batches for i in batch) == list(range(24))


def test_a_state_saved_after_ddp_appears_mid_epoch_keeps_the_epochs_placement(
        monkeypatch) -> None:
    """The epoch was planned on the fallback rank 0 of 1: its state says so (it said world
    size 2 with the batches of 1, and a resume lost two batches)."""
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK"):
        monkeypatch.delenv(name, raising=False)
    loader = ResumableLoader(list(range(12)), batch_size=2, shuffle=True, seed=0)
    source = iter(loader)
    next(source), next(source)
    rest = [batch.tolist() for batch in source]
    fresh = ResumableLoader(list(range(12)), batch_size=2, shuffle=True, seed=0)
    source = iter(fresh)
    next(source), next(source)
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    state = fresh.state_dict()
    monkeypatch.delenv("WORLD_SIZE")
    monkeypatch.delenv("RANK")
    assert state["world_size"] == 1
    resumed = ResumableLoader(list(range(12)), batch_size=2, shuffle=True, seed=0)
    resumed.load_state_dict(state)
    assert [batch.tolist() for batch in resumed] == rest
