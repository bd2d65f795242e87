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
