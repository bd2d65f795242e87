"""ResumableLoader under a real Lightning Trainer (CPU): resume, epochs and the known traps."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader

from lightning_loaders import ExactResume, GeneratorSource, ResumableLoader
from tests.conftest import IndexDataset
from tests.lightning_harness import (
    RecordingModule,
    check_trainer_resume,
    checkpoint_at,
    every_step_checkpoints,
    fit_recording,
    make_trainer,
)


def loader_factory(n: int = 7, batch_size: int = 2, **kwargs):
    def make() -> ResumableLoader:
        return ResumableLoader(IndexDataset(n), batch_size=batch_size, shuffle=True, seed=7,
                               **kwargs)

    return make


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("last_batch", ["keep", "drop", "pad", "rollover"])
def test_resume_from_every_checkpoint_equals_the_uninterrupted_run(
        tmp_path: Path, num_workers: int, last_batch: str) -> None:
    make = loader_factory(num_workers=num_workers, last_batch=last_batch)
    full = check_trainer_resume(make, tmp_path, max_epochs=2,
                                batch_idx=last_batch != "rollover")
    epochs = sorted({epoch for epoch, _, _ in full})
    assert epochs == [0, 1], "no epoch may be skipped or merged"
    per_epoch = [[i for e, _, b in full if e == epoch for i in b] for epoch in epochs]
    if last_batch == "keep":
        assert all(sorted(seen) == list(range(7)) for seen in per_epoch)
    assert per_epoch[0] != per_epoch[1], "each epoch needs its own shuffle"


def test_the_first_resumed_epoch_gets_its_own_shuffle(tmp_path: Path) -> None:
    """Lightning #21938: resuming into epoch 1 must not replay epoch 0's order."""
    make = loader_factory(n=12, batch_size=4)
    directory = tmp_path / "ckpt"
    full = fit_recording(make, tmp_path, 3, [every_step_checkpoints(directory)])
    end_of_epoch_0 = checkpoint_at(directory, 3)
    resumed = fit_recording(make, tmp_path, 3, ckpt_path=end_of_epoch_0)
    assert resumed == full[3:]
    assert [b for e, _, b in resumed if e == 1] != [b for e, _, b in full if e == 0]


def _stream(shard: tuple[int, int]):
    return ({"index": torch.tensor(i)} for i in range(*shard))


def unsized(**kwargs):
    """12 samples of unknown length: Lightning prefetches a batch before ``set_epoch``."""

    def make() -> ResumableLoader:
        return ResumableLoader(GeneratorSource(_stream, [(0, 5), (5, 9), (9, 12)]),
                               batch_size=2, shuffle=True, shuffle_buffer=4, seed=7, **kwargs)

    return make


def test_an_unsized_loader_starts_the_fit_loops_epoch_before_it_is_told(tmp_path: Path
                                                                       ) -> None:
    """A fresh loader in a resumed run (a checkpoint written at an epoch's end, which Lightning
    does not restore loaders from) or in a reloaded epoch is fetched from before ``set_epoch``:
    it takes the epoch from the fit loop, not epoch 0's order."""
    directory = tmp_path / "ckpt"
    epoch_ends = ModelCheckpoint(dirpath=directory, every_n_epochs=1, save_top_k=-1,
                                 filename="{epoch}")
    full = fit_recording(unsized(), tmp_path, 3, [epoch_ends])
    orders = [[b for e, _, b in full if e == epoch] for epoch in range(3)]
    assert orders[0] != orders[1] != orders[2]
    resumed = fit_recording(unsized(), tmp_path, 3, ckpt_path=directory / "epoch=0.ckpt")
    assert resumed == full[len(orders[0]):]
    assert fit_recording(unsized(), tmp_path, 3, reload_dataloaders_every_n_epochs=1) == full


def test_an_unsized_loader_reloaded_every_epoch_resumes_from_every_checkpoint(tmp_path: Path
                                                                             ) -> None:
    """Resumed at an epoch's last batch, the fit loop sets the data up twice (its reload
    epoch is not restored): the first fetcher takes the next epoch's first batch and is
    dropped holding it. The second goes on from before it, not with the epoch after."""
    full = check_trainer_resume(unsized(), tmp_path, 3, batch_idx=False,
                                reload_dataloaders_every_n_epochs=1)
    assert len({tuple(map(tuple, (b for e, _, b in full if e == epoch))) for epoch in range(3)
                }) == 3, "each epoch needs its own order"


def test_a_batch_held_when_fit_stops_mid_epoch_is_not_counted_as_delivered(
        tmp_path: Path) -> None:
    """``max_steps`` ends ``fit`` while Lightning's fetcher holds the next batch of an unsized
    loader: it never reached a training step, so the loader's state leaves it to deliver."""
    full = fit_recording(unsized(), tmp_path, 1)
    loader = unsized()()
    make_trainer(tmp_path, 1, max_steps=2).fit(RecordingModule(), loader)
    assert loader.state_dict()["batches"] == 2
    assert [b["index"].tolist() for b in loader] == [b for _, _, b in full][2:]


def test_limit_train_batches_leaves_no_stale_tail(tmp_path: Path) -> None:
    """With limit_train_batches each epoch starts fresh, also after a resume at the limit."""
    make = loader_factory(n=20, batch_size=2)
    directory = tmp_path / "ckpt"
    full = fit_recording(make, tmp_path, 3, [every_step_checkpoints(directory)],
                         limit_train_batches=4)
    assert len(full) == 12
    reference = make()
    for epoch in range(3):
        reference.set_epoch(epoch)
        first = next(iter(reference))["index"].tolist()
        assert [b for e, i, b in full if e == epoch and i == 0] == [first]
    for step in (2, 4, 8):
        resumed = fit_recording(make, tmp_path, 3, ckpt_path=checkpoint_at(directory, step),
                                limit_train_batches=4)
        assert resumed == full[step:]


def test_overfit_batches_reads_the_same_first_batches_every_epoch(tmp_path: Path) -> None:
    """Lightning rebuilds a loader whose sampler is no ``SequentialSampler`` (it cannot rebuild
    ours); an unshuffled one is read as it is, and a plain shuffled ``DataLoader`` passed with
    ``ExactResume`` is left to Lightning, which turns its shuffling off."""
    unshuffled = fit_recording(lambda: ResumableLoader(IndexDataset(12), batch_size=2), tmp_path,
                               3, overfit_batches=2)
    assert unshuffled == [(epoch, i, [2 * i, 2 * i + 1]) for epoch in range(3) for i in range(2)]
    plain = fit_recording(lambda: DataLoader(IndexDataset(12), batch_size=2, shuffle=True),
                          tmp_path, 3, [ExactResume()], overfit_batches=2)
    assert plain == unshuffled


def test_checkpoint_at_the_last_batch_of_an_epoch_skips_no_epoch(tmp_path: Path) -> None:
    make = loader_factory(n=9, batch_size=3)
    full = check_trainer_resume(make, tmp_path, max_epochs=3, steps=[3, 6])
    assert [e for e, _, _ in full] == [0] * 3 + [1] * 3 + [2] * 3


def test_several_training_loaders_each_keep_their_own_cursor(tmp_path: Path) -> None:
    def make() -> CombinedLoader:
        return CombinedLoader({
            "a": ResumableLoader(IndexDataset(10), batch_size=2, shuffle=True, seed=1),
            "b": ResumableLoader(IndexDataset(7), batch_size=3, shuffle=True, seed=2,
                                 last_batch="pad"),
        }, mode="max_size_cycle")

    full = check_trainer_resume(make, tmp_path, max_epochs=2, steps=[1, 3, 5, 7])
    assert {len(step[2]) for step in full} == {2}
    seen_a = [i for e, _, b in full if e == 0 for i in b["a"]]
    assert sorted(seen_a) == list(range(10))


def test_trainer_takes_len_batches_equal_to_the_plan(tmp_path: Path) -> None:
    loader = loader_factory(n=23, batch_size=4)()
    model = RecordingModule()
    fit_recording(lambda: loader, tmp_path, 1, model=model)
    assert len(model.seen) == len(loader) == 6
    assert torch.equal(torch.tensor(sorted(i for _, _, b in model.seen for i in b)),
                       torch.arange(23))
