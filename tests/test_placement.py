import pytest
import torch

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


def test_device_comes_from_the_trainer_strategy() -> None:
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    assert resolve_device(trainer) == trainer.strategy.root_device == torch.device("cpu")
    assert resolve_device(trainer, "cpu") == torch.device("cpu")
    assert resolve_device() == torch.device("cpu")
