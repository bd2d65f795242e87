"""``ExactResume`` under a real Lightning ``Trainer`` (CPU): a resumed ``fit`` repeats the
uninterrupted run's training *and* validation, from every checkpoint.

The model records ``("epoch", epoch)`` at each epoch start, ``("train", epoch, batch_idx,
ids)`` and ``("val", epoch, dataloader_idx, batch_idx, ids)``, and keeps the events so far in
each checkpoint, so a resumed run ends with the whole stream: the prefix up to its checkpoint
plus what it did itself.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader

from lightning_loaders import GeneratorSource, ResumableLoader, make_resumable
from lightning_loaders.lightning.datamodule import ResumableDataModule
from lightning_loaders.lightning.exact_resume import ExactResume
from tests.conftest import IndexDataset
from tests.ddp_harness import REPO, run_ddp
from tests.lightning_harness import checkpoint_at, default_key, every_step_checkpoints, make_trainer

Event = tuple[Any, ...]
Loaders = Callable[[], tuple[Any, Any]]
STEPS = 12  # 2 epochs of 6 training batches


class EventModule(L.LightningModule):
    """Records what every training and validation step saw; checkpoints carry the record."""

    def __init__(self) -> None:
        super().__init__()
        self.weight = torch.nn.Parameter(torch.zeros(1))
        self.events: list[Event] = []

    def on_train_epoch_start(self) -> None:
        self.events.append(("epoch", self.current_epoch))

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.events.append(("train", self.current_epoch, batch_idx, default_key(batch)))
        return (self.weight - 1.0).pow(2).sum()

    def validation_step(self, batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self.events.append(("val", self.current_epoch, dataloader_idx, batch_idx,
                            default_key(batch)))

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.1)

    def on_save_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        checkpoint["events"] = list(self.events)

    def on_load_checkpoint(self, checkpoint: dict[str, Any]) -> None:
        self.events = [tuple(event) for event in checkpoint["events"]]


class SaveDuringValidation(L.Callback):
    """Writes ``path`` from inside validation pass ``pass_index`` (0-based, fit only), when
    ``hook`` runs for batch ``batch_idx`` of loader ``dataloader_idx``, as a preemption
    handler would."""

    def __init__(self, path: Path, pass_index: int, batch_idx: int, dataloader_idx: int = 0,
                 hook: str = "on_validation_batch_end") -> None:
        self.path = path
        self.target = (pass_index, dataloader_idx, batch_idx)
        self.hook = hook
        self.passes = -1

    def on_validation_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if not trainer.sanity_checking:
            self.passes += 1
            self._maybe_save(trainer, "on_validation_start", 0, 0)

    def _maybe_save(self, trainer: L.Trainer, hook: str, batch_idx: int,
                    dataloader_idx: int) -> None:
        if hook == self.hook and (self.passes, dataloader_idx, batch_idx) == self.target:
            trainer.save_checkpoint(self.path)

    def on_validation_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                  batch: Any, batch_idx: int, dataloader_idx: int = 0) -> None:
        self._maybe_save(trainer, "on_validation_batch_start", batch_idx, dataloader_idx)

    def on_validation_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule,
                                outputs: Any, batch: Any, batch_idx: int,
                                dataloader_idx: int = 0) -> None:
        self._maybe_save(trainer, "on_validation_batch_end", batch_idx, dataloader_idx)


def resumable(val_batches: int = 3, val_loaders: int = 1, shuffle_val: bool = False) -> Loaders:
    """12 shuffled training samples in batches of 2; validation over ``val_batches`` batches
    of 2 per loader, with ``ResumableLoader(..., evaluation=True)``."""

    def make() -> tuple[Any, Any]:
        train = ResumableLoader(IndexDataset(12), batch_size=2, shuffle=True, seed=3)
        val = [ResumableLoader(IndexDataset(2 * val_batches + 10 * i), batch_size=2,
                               shuffle=shuffle_val, seed=4, evaluation=True)
               for i in range(val_loaders)]
        return train, val[0] if val_loaders == 1 else val

    return make


def plain_validation(kind: str) -> Loaders:
    """Validation with a plain ``DataLoader``, or one through ``make_resumable``."""

    def make() -> tuple[Any, Any]:
        train, _ = resumable()()
        val = DataLoader(IndexDataset(6), batch_size=2)
        return train, make_resumable(val, evaluation=True) if kind == "make_resumable" else val

    return make


def plain_loaders() -> tuple[Any, Any]:
    """What a user writes: plain shuffled training and validation ``DataLoader``s."""
    return (DataLoader(IndexDataset(12), batch_size=2, shuffle=True),
            DataLoader(IndexDataset(6), batch_size=2, shuffle=True))


def fit(loaders: Loaders, root: Path, callbacks: Iterable[Any] = (), exact: bool = True,
        ckpt_path: Path | None = None, max_epochs: int = 2,
        module: Callable[[], EventModule] = EventModule, **trainer_kwargs: Any) -> list[Event]:
    """One ``fit`` with fresh loaders and model; returns the whole event stream."""
    model = module()
    callbacks = [*([ExactResume()] if exact else []), *callbacks]
    trainer = make_trainer(root, max_epochs, callbacks, **trainer_kwargs)
    train, val = loaders()
    trainer.fit(model, train, val, ckpt_path=str(ckpt_path) if ckpt_path else None)
    return model.events


def resume_from_every_step(loaders: Loaders, root: Path, exact: bool = True,
                           **trainer_kwargs: Any) -> tuple[list[Event], list[int], list[int]]:
    """The uninterrupted stream, the optimizer steps checkpointed (all of them), and those
    whose checkpoint resumes to exactly that stream."""
    directory = root / "checkpoints"
    full = fit(loaders, root, [every_step_checkpoints(directory)], exact=exact,
               **trainer_kwargs)
    steps = sorted(int(path.stem.removeprefix("step=")) for path in directory.glob("*.ckpt"))
    exact_steps = [step for step in steps
                   if fit(loaders, root, exact=exact, ckpt_path=checkpoint_at(directory, step),
                          **trainer_kwargs) == full]
    return full, steps, exact_steps


def validation_passes(events: list[Event]) -> list[int]:
    """How many training steps came before each validation pass."""
    passes: list[int] = []
    steps, in_pass = 0, False
    for event in events:
        if event[0] == "val" and not in_pass:
            passes.append(steps)
        in_pass = event[0] == "val"
        steps += event[0] == "train"
    return passes


@pytest.mark.parametrize("loaders", [resumable(), plain_validation("plain"),
                                     plain_validation("make_resumable"),
                                     resumable(shuffle_val=True)],
                         ids=["ResumableLoader", "DataLoader", "make_resumable", "shuffled"])
def test_every_checkpoint_resumes_to_the_uninterrupted_run(tmp_path: Path,
                                                           loaders: Loaders) -> None:
    full, steps, exact_steps = resume_from_every_step(loaders, tmp_path, val_check_interval=0.5)
    assert validation_passes(full) == [3, 6, 9, 12]
    assert sum(event[0] == "val" for event in full) == 4 * 3
    assert exact_steps == steps == list(range(1, STEPS + 1))  # 12/12


def test_plain_dataloaders_passed_to_fit_are_made_resumable(tmp_path: Path) -> None:
    """No glue: the ``DataLoader``s given to ``fit`` are converted as a
    ``ResumableDataModule`` converts its hooks' (a training epoch resumed mid-way would
    otherwise restart, as Lightning's ``DistributedSampler`` does)."""
    trainer = make_trainer(tmp_path, 1, [ExactResume()])
    trainer.fit(EventModule(), *plain_loaders())
    assert isinstance(trainer.train_dataloader, ResumableLoader)
    assert isinstance(trainer.val_dataloaders, ResumableLoader)
    full, steps, exact_steps = resume_from_every_step(plain_loaders, tmp_path / "run",
                                                      val_check_interval=0.5)
    assert exact_steps == steps == list(range(1, STEPS + 1))


def test_a_webloader_passed_to_fit_is_made_resumable(tmp_path: Path) -> None:
    """``webdataset.WebLoader`` is no DataLoader (a WebDataset pipeline over one): it is
    converted as the DataLoader it wraps, where it was left to restart on resume."""
    wds = pytest.importorskip("webdataset")
    from tests.sources.test_webdataset import write_shards

    dataset = wds.WebDataset(write_shards(tmp_path / "shards"), shardshuffle=False)
    trainer = make_trainer(tmp_path, 1, [ExactResume()], max_steps=2)
    trainer.fit(EventModule(), wds.WebLoader(dataset.decode().to_tuple("cls"), batch_size=4))
    assert isinstance(trainer.train_dataloader, ResumableLoader)


def test_without_it_a_shuffled_validation_loader_restarts_its_order(tmp_path: Path) -> None:
    """Each pass is a new epoch of the validation loader: its state must travel with the
    checkpoint even between passes (Lightning saves only the training loaders')."""
    full, _, exact_steps = resume_from_every_step(resumable(shuffle_val=True), tmp_path,
                                                  exact=False, val_check_interval=0.5)
    orders = [tuple(i for e in full if e[0] == "val" for i in e[4])[p * 6:p * 6 + 6]
              for p in range(4)]
    assert len(set(orders)) == 4
    assert exact_steps == [1, 2]  # from the second pass on, a fresh loader repeats pass 0


class Recording(IndexDataset):
    """Remembers every index it was asked for, in ``fetched``."""

    def __init__(self, n: int, fetched: list[int]) -> None:
        super().__init__(n)
        self.fetched = fetched

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        self.fetched.append(index)
        return super().__getitem__(index)


@pytest.mark.parametrize("kind", ["ResumableLoader", "DataLoader"])
def test_the_rest_of_a_pass_comes_from_the_cursor_or_a_replay(tmp_path: Path,
                                                              kind: str) -> None:
    """A resumable validation loader jumps to where the pass stood; a plain one (from the
    module's own hook, which ``ExactResume`` leaves as it is) is read from its start and the
    validated batches are dropped."""
    fetched: list[int] = []

    class ValidatesFromItsHook(EventModule):
        def val_dataloader(self) -> DataLoader[Any]:
            return DataLoader(Recording(10, fetched), batch_size=2)

    def loaders() -> tuple[Any, Any]:
        train, _ = resumable()()
        if kind == "DataLoader":
            return train, None
        return train, ResumableLoader(Recording(10, fetched), batch_size=2, evaluation=True)

    module = ValidatesFromItsHook if kind == "DataLoader" else EventModule
    path = tmp_path / "inside.ckpt"
    full = fit(loaders, tmp_path, [SaveDuringValidation(path, 1, 2)], module=module,
               val_check_interval=0.5)
    fetched.clear()
    assert fit(loaders, tmp_path, ckpt_path=path, module=module, val_check_interval=0.5) == full
    rest = [6, 7, 8, 9]
    expected = list(range(6)) + rest if kind == "DataLoader" else rest
    assert fetched[:len(expected)] == expected


@pytest.mark.parametrize("loaders", [resumable(), plain_validation("plain")],
                         ids=["ResumableLoader", "DataLoader"])
def test_without_it_the_validation_due_at_the_checkpointed_step_is_lost(
        tmp_path: Path, loaders: Loaders) -> None:
    """The upstream behaviour ExactResume fixes (Lightning #19549, #20277, #20288)."""
    full, steps, exact_steps = resume_from_every_step(loaders, tmp_path, exact=False,
                                                      val_check_interval=0.5)
    assert validation_passes(full) == [3, 6, 9, 12]
    assert steps == list(range(1, STEPS + 1))
    assert exact_steps == [1, 2, 4, 5, 7, 8, 10, 11]  # 8/12: not the steps that validate


@pytest.mark.parametrize(("options", "passes", "checkpoints"), [
    ({"val_check_interval": 2}, [2, 4, 6, 8, 10, 12], 12),
    ({"val_check_interval": 4, "check_val_every_n_epoch": None}, [4, 8, 12], 12),
    ({"val_check_interval": 0.5, "check_val_every_n_epoch": 2}, [9, 12], 12),
    ({"check_val_every_n_epoch": 2, "max_epochs": 4}, [12, 24], 24),
    ({"val_check_interval": 0.5, "num_sanity_val_steps": 2}, [0, 3, 6, 9, 12], 12),
    ({"val_check_interval": 2, "accumulate_grad_batches": 2}, [2, 4, 6, 8, 10, 12], 6),
], ids=["int", "int-across-epochs", "every-2-epochs-twice", "every-2-epochs", "sanity-check",
        "accumulate"])
def test_validation_schedules(tmp_path: Path, options: dict[str, Any], passes: list[int],
                              checkpoints: int) -> None:
    full, steps, exact_steps = resume_from_every_step(resumable(shuffle_val=True), tmp_path,
                                                      **options)
    assert validation_passes(full) == passes
    assert exact_steps == steps == list(range(1, checkpoints + 1))


def test_limit_val_batches_and_the_validation_cursor(tmp_path: Path) -> None:
    """Each pass reads 2 of the shuffled loader's 5 batches, then the live loader starts its
    next epoch at the next pass; a restored one must too, in that epoch's order."""
    full, steps, exact_steps = resume_from_every_step(resumable(val_batches=5,
                                                                shuffle_val=True), tmp_path,
                                                      val_check_interval=0.5,
                                                      limit_val_batches=2)
    assert validation_passes(full) == [3, 6, 9, 12]
    assert sum(event[0] == "val" for event in full) == 4 * 2
    assert exact_steps == steps == list(range(1, STEPS + 1))


def test_several_validation_loaders(tmp_path: Path) -> None:
    full, steps, exact_steps = resume_from_every_step(resumable(val_loaders=2), tmp_path,
                                                      val_check_interval=0.5)
    assert {event[2] for event in full if event[0] == "val"} == {0, 1}
    assert exact_steps == steps == list(range(1, STEPS + 1))


def combined(mode: str, shuffle: bool = False) -> Loaders:
    """Validation over a ``CombinedLoader`` of two resumable loaders in ``mode``."""

    def make() -> tuple[Any, Any]:
        train, _ = resumable()()
        val = CombinedLoader({name: ResumableLoader(IndexDataset(n), batch_size=2, seed=5,
                                                    shuffle=shuffle, evaluation=True)
                              for name, n in (("a", 6), ("b", 4))}, mode)
        return train, val

    return make


HALF = {"val_check_interval": 0.5}


def unsized_then_sized_validation() -> Loaders:
    """Validation over a loader of unknown length (3 batches), then ``resumable``'s."""

    def make() -> tuple[Any, Any]:
        train, sized = resumable()()
        first = ResumableLoader(GeneratorSource(samples, [(0, 3), (3, 5)]), batch_size=2,
                                evaluation=True)
        return train, [first, sized]

    return make


MID_VALIDATION = [
    # loaders, pass, dataloader_idx, batch_idx, hook, ExactResume listed first, Trainer options
    pytest.param(resumable(), 1, 0, 1, "on_validation_batch_end", True, HALF,
                 id="end-of-epoch-pass"),
    pytest.param(resumable(), 2, 0, 0, "on_validation_batch_end", True, HALF, id="first-batch"),
    pytest.param(resumable(), 3, 0, 1, "on_validation_batch_end", False, HALF, id="last-pass"),
    pytest.param(resumable(), 1, 0, 1, "on_validation_batch_start", True, HALF,
                 id="step-not-run"),
    pytest.param(resumable(), 1, 0, 2, "on_validation_batch_start", False, HALF,
                 id="before-our-hook"),
    pytest.param(plain_validation("plain"), 2, 0, 1, "on_validation_batch_end", True, HALF,
                 id="DataLoader"),
    pytest.param(plain_validation("plain"), 2, 0, 1, "on_validation_batch_start", True, HALF,
                 id="DataLoader-step-not-run"),
    pytest.param(resumable(shuffle_val=True), 2, 0, 1, "on_validation_batch_end", True, HALF,
                 id="shuffled"),
    pytest.param(resumable(val_batches=5), 2, 0, 0, "on_validation_batch_end", True,
                 {**HALF, "limit_val_batches": 2}, id="limit_val_batches"),
    pytest.param(resumable(), 1, 0, 1, "on_validation_batch_end", True,
                 {"val_check_interval": 4, "check_val_every_n_epoch": None}, id="int-interval"),
    pytest.param(resumable(val_loaders=2), 1, 1, 1, "on_validation_batch_end", True, HALF,
                 id="second-loader"),
    pytest.param(resumable(val_loaders=2), 1, 0, 2, "on_validation_batch_end", True, HALF,
                 id="end-of-first-loader"),
    pytest.param(resumable(val_loaders=2), 2, 1, 0, "on_validation_batch_start", False, HALF,
                 id="second-loader-before-our-hook"),
    pytest.param(combined("max_size"), 2, 0, 1, "on_validation_batch_end", True, HALF,
                 id="CombinedLoader-max_size"),
    # a pass followed by another in the same epoch: the loaders done before the checkpoint
    # must start their next epoch in it, not stay at their epoch's end
    pytest.param(resumable(val_loaders=2), 0, 0, 2, "on_validation_batch_end", True, HALF,
                 id="end-of-first-loader-then-a-pass"),
    pytest.param(resumable(val_loaders=2), 0, 1, 0, "on_validation_batch_end", True, HALF,
                 id="second-loader-then-a-pass"),
    pytest.param(resumable(val_loaders=2, shuffle_val=True), 0, 1, 0, "on_validation_batch_end",
                 True, HALF, id="shuffled-second-loader-then-a-pass"),
    # the next loader's part has not begun: it goes on as the earlier pass (the sanity
    # check, a limited pass) left it, not from its cursor in that pass
    pytest.param(resumable(val_loaders=2), 0, 0, 2, "on_validation_batch_end", True,
                 {**HALF, "num_sanity_val_steps": 2}, id="end-of-first-loader-after-sanity"),
    pytest.param(resumable(val_loaders=2, shuffle_val=True), 1, 0, 0, "on_validation_batch_end",
                 True, {**HALF, "limit_val_batches": 1}, id="end-of-first-loader-limited"),
    # a replay from the pass's start, which leaves the loader mid-epoch, replays its epoch
    pytest.param(resumable(shuffle_val=True), 0, 0, 1, "on_validation_batch_start", True,
                 {**HALF, "limit_val_batches": 2}, id="first-pass-limited-replayed"),
    pytest.param(combined("max_size_cycle", shuffle=True), 0, 0, 1, "on_validation_batch_end",
                 True, HALF, id="first-pass-CombinedLoader-max_size_cycle-shuffled"),
    # the batch Lightning's fetcher holds then is the second loader's, not the first's
    pytest.param(unsized_then_sized_validation(), 0, 1, 0, "on_validation_batch_end", True,
                 HALF, id="unsized-loader-then-a-sized-one-then-a-pass"),
    # a mode leaving a member mid-epoch: the next pass starts it afresh
    pytest.param(combined("max_size_cycle"), 1, 0, 1, "on_validation_batch_end", True, HALF,
                 id="CombinedLoader-max_size_cycle"),
    pytest.param(combined("min_size"), 1, 0, 0, "on_validation_batch_end", True, HALF,
                 id="CombinedLoader-min_size"),
]


@pytest.mark.parametrize("mode", ["max_size_cycle", "min_size"])
def test_a_combined_validation_loader_that_leaves_a_member_mid_epoch(tmp_path: Path,
                                                                     mode: str) -> None:
    """``max_size_cycle`` cycles the shorter member and ``min_size`` stops the longer one
    inside its epoch; the live loader starts that member's next epoch at the next pass, so a
    restored one must too, in that epoch's order."""
    full, steps, exact_steps = resume_from_every_step(combined(mode, shuffle=True), tmp_path,
                                                      val_check_interval=0.5)
    assert validation_passes(full) == [3, 6, 9, 12]
    assert exact_steps == steps == list(range(1, STEPS + 1))


def samples(shard: tuple[int, int]) -> Iterator[dict[str, torch.Tensor]]:
    return ({"index": torch.tensor(i)} for i in range(*shard))


def unsized() -> Loaders:
    """12 training samples of unknown length (3 uneven shards), 6 batches an epoch."""

    def make() -> tuple[Any, Any]:
        train = ResumableLoader(GeneratorSource(samples, [(0, 5), (5, 9), (9, 12)]),
                                batch_size=2, shuffle=True, shuffle_buffer=4, seed=3)
        return train, resumable()()[1]

    return make


def test_an_unsized_training_loader_restarted_at_an_epochs_end(tmp_path: Path) -> None:
    """Lightning clears an epoch's batch count when it reaches ``num_training_batches``,
    never for an unsized loader: the next epoch's ``batch_idx``, and the validations an
    integer ``val_check_interval`` places by it, would go on from the restored epoch's."""
    full, steps, exact_steps = resume_from_every_step(unsized(), tmp_path, val_check_interval=4)
    assert validation_passes(full) == [4, 10]
    assert exact_steps == steps == list(range(1, STEPS + 1))


@pytest.mark.parametrize("loaders", [resumable(), unsized()], ids=["sized", "unsized"])
def test_checkpoints_at_each_epochs_end_under_max_steps(tmp_path: Path, loaders: Loaders
                                                        ) -> None:
    """``ModelCheckpoint`` saving in ``on_train_epoch_end`` with step-based training: the next
    epoch runs whole, in its own order, from ``batch_idx`` 0 and with its start hook."""
    directory = tmp_path / "checkpoints"
    saver = ModelCheckpoint(dirpath=directory, filename="{step}", save_top_k=-1,
                            save_on_train_epoch_end=True)
    full = fit(loaders, tmp_path, [saver], max_epochs=-1, max_steps=15)
    assert [event for event in full if event[0] == "epoch"] == [("epoch", e) for e in range(3)]
    for step in (6, 12):
        path = checkpoint_at(directory, step)
        assert fit(loaders, tmp_path, ckpt_path=path, max_epochs=-1, max_steps=15) == full, step
    again = tmp_path / "again"  # checkpoints written by a resumed run resume exactly too
    saver = ModelCheckpoint(dirpath=again, filename="{step}", every_n_train_steps=1,
                            save_top_k=-1)
    fit(loaders, tmp_path, [saver], ckpt_path=checkpoint_at(directory, 6), max_epochs=-1,
        max_steps=15)
    for step in range(7, 16):
        path = checkpoint_at(again, step)
        assert fit(loaders, tmp_path, ckpt_path=path, max_epochs=-1, max_steps=15) == full, step


def _fit_arguments(source: str) -> dict[str, Any]:
    """What ``fit`` gets: plain ``DataLoader``s, ``ResumableLoader``s or a data module."""
    if source == "ResumableDataModule":
        return {"datamodule": Data()}
    loaders = plain_loaders() if source == "DataLoader" else resumable()()
    return dict(zip(("train_dataloaders", "val_dataloaders"), loaders, strict=True))


def _fit_until(source: str, root: Path, max_steps: int, callbacks: Iterable[Any] = (),
               ckpt_path: Path | None = None, save_to: Path | None = None
               ) -> tuple[list[Event], int]:
    """One ``fit`` to ``max_steps``, validating every 3 batches (``save_to``: the checkpoint
    written after it returns); the events and the logger step it ends at."""
    model = EventModule()
    trainer = make_trainer(root, -1, [ExactResume(), *callbacks], max_steps=max_steps,
                           val_check_interval=3)
    trainer.fit(model, **_fit_arguments(source), ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    return model.events, trainer.fit_loop.epoch_loop._batches_that_stepped


@pytest.mark.parametrize("source", ["DataLoader", "ResumableLoader", "ResumableDataModule"])
def test_an_epoch_max_steps_cut_short_goes_on_after_a_resume(tmp_path: Path, source: str
                                                             ) -> None:
    """``max_steps`` ends the epoch loop inside epoch 0 (6 batches); Lightning calls
    ``on_train_epoch_end`` there (``ModelCheckpoint`` saves) and ``fit`` returns. Resumed with
    a larger ``max_steps`` from either checkpoint, epoch 0 goes on where it was cut, as in the
    uninterrupted run (it was counted ended: 3 of its batches lost after ``max_steps=3``, and
    after ``fit`` returned at its last batch, epoch 1 was); the logger step too, also where
    the cut step validated."""
    full = _fit_until(source, tmp_path, 10)
    assert [event for event in full[0] if event[0] == "epoch"] == [("epoch", 0), ("epoch", 1)]
    for stop in (3, 4, 6):
        directory = tmp_path / f"stop{stop}"
        saver = ModelCheckpoint(dirpath=directory, save_last=True, save_on_train_epoch_end=True)
        _fit_until(source, tmp_path, stop, [saver], save_to=directory / "after_fit.ckpt")
        for path in (directory / "last.ckpt", directory / "after_fit.ckpt"):
            assert _fit_until(source, tmp_path, 10, ckpt_path=path) == full, path


@pytest.mark.parametrize("source", ["DataLoader", "ResumableLoader"])
def test_a_step_checkpoint_at_an_epochs_last_batch_under_max_steps(tmp_path: Path, source: str
                                                                   ) -> None:
    """``ModelCheckpoint(every_n_train_steps=6)`` saves at epoch 0's last batch (6 batches) in
    ``on_train_batch_end``; resumed under ``max_steps``, epoch 1 runs whole and the logger step
    is the uninterrupted run's (it was one behind: 9 after 10 steps)."""
    full = _fit_until(source, tmp_path, 10)
    saver = ModelCheckpoint(dirpath=tmp_path / "ck", filename="{step}", every_n_train_steps=6,
                            save_top_k=-1)
    _fit_until(source, tmp_path, 10, [saver])
    assert _fit_until(source, tmp_path, 10, ckpt_path=tmp_path / "ck" / "step=6.ckpt") == full


class _StopAt(L.Callback):
    """Sets ``should_stop`` after global step ``step``, as ``EarlyStopping`` and ``Timer`` do."""

    def __init__(self, step: int) -> None:
        self.step = step

    def on_train_batch_end(self, trainer: L.Trainer, pl_module: L.LightningModule, outputs: Any,
                           batch: Any, batch_idx: int) -> None:
        if trainer.global_step == self.step:
            trainer.should_stop = True


def _trained_until(source: str, root: Path, callbacks: Iterable[Any] = (),
                   ckpt_path: Path | None = None, save_to: Path | None = None, **limits: Any
                   ) -> tuple[list[Event], int]:
    """One ``fit`` under ``limits``, validating every 3 batches (``save_to``: the checkpoint
    written after it returns); its training events and the logger step it ends at."""
    model = EventModule()
    trainer = make_trainer(root, limits.pop("max_epochs", 2), [ExactResume(), *callbacks],
                           val_check_interval=3, **limits)
    trainer.fit(model, **_fit_arguments(source), ckpt_path=ckpt_path)
    if save_to is not None:
        trainer.save_checkpoint(save_to)
    trained = [event for event in model.events if event[0] != "val"]
    return trained, trainer.fit_loop.epoch_loop._batches_that_stepped


@pytest.mark.parametrize("source", ["DataLoader", "ResumableLoader", "ResumableDataModule"])
@pytest.mark.parametrize("stop", ["should_stop", "max_steps"])
def test_an_epoch_cut_short_goes_on_under_max_epochs(tmp_path: Path, source: str, stop: str
                                                     ) -> None:
    """Epoch 0 (6 batches) ends early, at step 4 by ``should_stop`` under ``max_epochs`` or at
    step 3 by ``max_steps``; resumed under ``max_epochs=2`` from the checkpoint of its
    ``on_train_epoch_end`` or after ``fit`` returned, it goes on where it was cut, as the
    uninterrupted run (whether it was reopened hung on the resuming trainer's ``max_steps``:
    its 2 or 3 unread batches were lost)."""
    full = _trained_until(source, tmp_path)
    directory = tmp_path / "cut"
    saver = ModelCheckpoint(dirpath=directory, save_last=True, save_on_train_epoch_end=True)
    if stop == "should_stop":
        _trained_until(source, tmp_path, [_StopAt(4), saver], save_to=directory / "after_fit.ckpt")
    else:
        _trained_until(source, tmp_path, [saver], save_to=directory / "after_fit.ckpt",
                       max_epochs=-1, max_steps=3)
    for path in (directory / "last.ckpt", directory / "after_fit.ckpt"):
        assert _trained_until(source, tmp_path, ckpt_path=path) == full, path


class _SkippingRest(EventModule):
    """Skips the rest of epoch 0 at its ``batch_idx`` 3 (of 6): ``on_train_batch_start``
    returns -1."""

    def on_train_batch_start(self, batch: Any, batch_idx: int) -> int | None:
        if (self.current_epoch, batch_idx) == (0, 3):
            self.events.append(("skip", self.current_epoch, batch_idx))
            return -1
        return None


@pytest.mark.parametrize("source", ["DataLoader", "ResumableLoader", "ResumableDataModule"])
@pytest.mark.parametrize("limit", ["max_epochs", "max_steps"])
def test_an_epoch_whose_rest_was_skipped_is_not_reopened(tmp_path: Path, source: str,
                                                        limit: str) -> None:
    """``on_train_batch_start`` returning -1 ends the epoch with its data unread, as
    ``max_steps`` and ``should_stop`` do, but Lightning's contract is that the rest is skipped:
    resumed from the checkpoint of that epoch's ``on_train_epoch_end``, or one written after
    ``fit`` returned there (``max_epochs=1``), the next epoch starts, as in the uninterrupted
    run, with the logger step the same (Lightning counts the skipping batch processed, not
    completed, and the epoch at its last batch: it is not taken for a cut epoch)."""
    limits = {"max_epochs": 3} if limit == "max_epochs" else {"max_epochs": -1, "max_steps": 12}

    def run(callbacks: Iterable[Any] = (), ckpt_path: Path | None = None,
            save_to: Path | None = None, **overrides: Any) -> tuple[list[Event], int]:
        model = _SkippingRest()
        options = {**limits, **overrides}
        trainer = make_trainer(tmp_path, options.pop("max_epochs"), [ExactResume(), *callbacks],
                               **options)
        trainer.fit(model, **_fit_arguments(source), ckpt_path=ckpt_path)
        if save_to is not None:
            trainer.save_checkpoint(save_to)
        return model.events, trainer.fit_loop.epoch_loop._batches_that_stepped

    full = run()
    assert full[0][4:6] == [("skip", 0, 3), ("epoch", 1)]
    directory = tmp_path / "checkpoints"
    run([ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1,
                         save_on_train_epoch_end=True)], save_to=tmp_path / "end.ckpt",
        max_epochs=1)
    for path in (directory / "epoch=0.ckpt", tmp_path / "end.ckpt"):
        assert run(ckpt_path=path) == full, path


class _ShortOfItsLength(torch.utils.data.IterableDataset):
    """12 samples where ``len()`` says 16: its epochs end before their ``len()``."""

    def __iter__(self) -> Iterator[dict[str, torch.Tensor]]:
        return iter({"index": torch.tensor(index)} for index in range(12))

    def __len__(self) -> int:
        return 16


class _ShortData(L.LightningDataModule):
    """A plain data module, whose loader ``ExactResume`` leaves as it is."""

    def train_dataloader(self) -> DataLoader:
        return DataLoader(_ShortOfItsLength(), batch_size=2)


def test_an_epoch_that_ran_out_before_its_len_is_not_reopened(tmp_path: Path) -> None:
    """Epoch 0 ends at its 6th batch where ``len()`` says 8, and ``ModelCheckpoint`` saves in
    ``on_train_epoch_end``: not at its last batch, but not cut by ``max_steps`` either.
    Resumed, epoch 1 starts (epoch 0 was reopened: epoch 1's first 2 batches ran as its
    ``batch_idx`` 6 and 7)."""
    def fit(callbacks: Iterable[Any] = (), ckpt_path: Path | None = None) -> list[Event]:
        model = EventModule()
        trainer = make_trainer(tmp_path, -1, [ExactResume(), *callbacks], max_steps=14)
        trainer.fit(model, datamodule=_ShortData(), ckpt_path=ckpt_path)
        return model.events

    saver = ModelCheckpoint(dirpath=tmp_path / "ck", filename="{step}", save_top_k=-1,
                            save_on_train_epoch_end=True)
    full = fit([saver])
    assert full[7] == ("epoch", 1)
    assert fit(ckpt_path=tmp_path / "ck" / "step=6.ckpt") == full


def cycled_members() -> tuple[Any, Any]:
    """A dict of training loaders (Lightning's ``max_size_cycle``): ``b`` cycles."""
    return {"a": ResumableLoader(IndexDataset(10), batch_size=2, shuffle=True, seed=1),
            "b": DataLoader(IndexDataset(6), batch_size=2, shuffle=True)}, None


def rollover() -> tuple[Any, Any]:
    """Leftovers open the next epoch (11 samples in batches of 2): no ``len()``, so
    Lightning fetches a batch of the restored loader before it gives the epoch."""
    return ResumableLoader(IndexDataset(11), batch_size=2, shuffle=True, seed=1,
                           last_batch="rollover"), None


def unsized_min_size() -> tuple[Any, Any]:
    """``min_size`` over two training loaders of unknown length (``a`` is left mid-epoch)."""
    members = {name: ResumableLoader(GeneratorSource(samples, shards), batch_size=2,
                                     shuffle=True, shuffle_buffer=4, seed=seed)
               for name, shards, seed in (("a", [(0, 6), (6, 12)], 3), ("b", [(0, 3), (3, 6)], 9))}
    return CombinedLoader(members, "min_size"), None


@pytest.mark.parametrize("max_steps", [-1, 100], ids=["epochs", "max_steps"])
@pytest.mark.parametrize("loaders", [cycled_members, rollover, unsized_min_size])
def test_checkpoints_at_each_epochs_end_restore_the_loaders(tmp_path: Path, loaders: Loaders,
                                                            max_steps: int) -> None:
    """Lightning restores no loader from a checkpoint at an epoch's end, and a new one starts
    at the trainer's next epoch, where a cycled member was not. Under ``max_steps`` it
    restores them, after it fetched a batch of an unsized loader: a ``min_size`` member left
    mid-epoch then went on with that epoch, which ended the next one early (2 of 3 batches)."""
    directory = tmp_path / "checkpoints"
    saver = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1)
    full = fit(loaders, tmp_path, [saver], max_epochs=3, max_steps=max_steps)
    for epoch in (0, 1):
        path = directory / f"epoch={epoch}.ckpt"
        assert fit(loaders, tmp_path, ckpt_path=path, max_epochs=3, max_steps=max_steps
                   ) == full, epoch


class _UnsizedMinSizeData(ResumableDataModule):
    def train_dataloader(self) -> Any:
        return unsized_min_size()[0]


@pytest.mark.parametrize(("limit", "stop"), [("max_steps", 3), ("max_epochs", 1)])
def test_a_data_modules_unsized_min_size_loader_from_a_runs_end(tmp_path: Path, limit: str,
                                                               stop: int) -> None:
    """A ``ResumableDataModule`` whose ``train_dataloader()`` is an unsized ``min_size``
    ``CombinedLoader`` (``a`` left mid-epoch): a run stopped at epoch 0's end (3 batches) and
    resumed from its ``last.ckpt`` or a checkpoint written after ``fit`` returned repeats
    the uninterrupted run (9 steps, 3 epochs)."""
    def run(until: int, callbacks: Iterable[Any] = (), ckpt_path: Path | None = None,
            save_to: Path | None = None) -> list[Event]:
        model = EventModule()
        limits = {"max_epochs": until} if limit == "max_epochs" else {"max_steps": until}
        trainer = make_trainer(tmp_path, limits.pop("max_epochs", -1), [ExactResume(), *callbacks],
                               **limits)
        trainer.fit(model, datamodule=_UnsizedMinSizeData(), ckpt_path=ckpt_path)
        if save_to is not None:
            trainer.save_checkpoint(save_to)
        return model.events

    full = run(3 * stop)
    assert [event for event in full if event[0] == "epoch"] == [("epoch", e) for e in range(3)]
    directory = tmp_path / "checkpoints"
    run(stop, [ModelCheckpoint(dirpath=directory, save_last=True)], save_to=tmp_path / "end.ckpt")
    for path in (directory / "last.ckpt", tmp_path / "end.ckpt"):
        assert run(3 * stop, ckpt_path=path) == full, path


def test_an_epoch_end_checkpoint_of_other_training_loaders_starts_them_afresh(tmp_path: Path
                                                                             ) -> None:
    directory = tmp_path / "checkpoints"
    saver = ModelCheckpoint(dirpath=directory, filename="{epoch}", save_top_k=-1)
    fit(cycled_members, tmp_path, [saver], max_epochs=1)
    with pytest.warns(UserWarning, match="states of 2 training loaders but fit.. was given 1"):
        events = fit(rollover, tmp_path, ckpt_path=directory / "epoch=0.ckpt", max_epochs=2)
    assert ("epoch", 1) in events


class SaveAtEpochStart(L.Callback):
    def __init__(self, path: Path, epoch: int) -> None:
        self.path, self.epoch = path, epoch

    def on_train_epoch_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        if trainer.current_epoch == self.epoch:
            trainer.save_checkpoint(self.path)


@pytest.mark.parametrize("loaders", [resumable(), unsized()], ids=["sized", "unsized"])
def test_a_checkpoint_written_at_an_epochs_start(tmp_path: Path, loaders: Loaders) -> None:
    """Lightning keeps the last epoch's batch count there and would end the new epoch after
    one batch (with any loader)."""
    path = tmp_path / "start.ckpt"
    full = fit(loaders, tmp_path, [SaveAtEpochStart(path, 1)], val_check_interval=4)
    assert fit(loaders, tmp_path, ckpt_path=path, val_check_interval=4) == full
    assert fit(loaders, tmp_path, exact=False, ckpt_path=path, val_check_interval=4) != full


class Counting(EventModule):
    """Also records, after each training step, the optimizer step and the step loggers log
    at: a resumed run counts them as the uninterrupted one does."""

    def on_train_batch_end(self, outputs: Any, batch: Any, batch_idx: int) -> None:
        loop = self.trainer.fit_loop.epoch_loop
        self.events.append(("steps", self.global_step, loop._batches_that_stepped))


class SavingInsideSteps(Counting):
    """Writes ``<batch>.ckpt`` (the batch's index in the run) into ``directory`` inside every
    training step, before recording it, as SLURM's auto-requeue does from its signal handler
    wherever the main thread is."""

    def __init__(self, directory: Path) -> None:
        super().__init__()
        self.directory = directory

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        batch_index = self.trainer.fit_loop.total_batch_idx
        self.trainer.save_checkpoint(self.directory / f"{batch_index}.ckpt")
        return super().training_step(batch, batch_idx)


class SaveAtEachBatchStart(L.Callback):
    """Writes ``<batch>.ckpt`` into ``directory`` in ``on_train_batch_start`` of every batch."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    def on_train_batch_start(self, trainer: L.Trainer, pl_module: L.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        trainer.save_checkpoint(self.directory / f"{trainer.fit_loop.total_batch_idx}.ckpt")


def max_size_training() -> tuple[Any, Any]:
    """Two training loaders in ``max_size`` mode: ``b`` ends half-way through each epoch."""
    members = {"a": ResumableLoader(IndexDataset(12), batch_size=2, shuffle=True, seed=1),
               "b": ResumableLoader(IndexDataset(6), batch_size=2, shuffle=True, seed=2)}
    return CombinedLoader(members, "max_size"), None


@pytest.mark.parametrize(("loaders", "options"), [
    (resumable(), {}),
    (resumable(), {"accumulate_grad_batches": 2}),
    (plain_loaders, {}),
    (unsized(), {}),
    (max_size_training, {}),
    (unsized_min_size, {}),
    (lambda: (Data(), None), {}),
], ids=["ResumableLoader", "accumulated", "DataLoader", "unsized", "max_size", "min_size",
        "datamodule"])
@pytest.mark.parametrize("where", ["training_step", "on_train_batch_start"])
def test_a_checkpoint_written_before_a_step_ends_resumes_with_its_batch(
        tmp_path: Path, loaders: Loaders, options: dict[str, Any], where: str) -> None:
    """Lightning runs a step that a checkpoint interrupted again: the training loaders' states
    counted its batch delivered, so it got the next one, its own was never trained on and the
    epoch ended a step early (11 optimizer steps of 12)."""
    directory = tmp_path / "checkpoints"
    saving: tuple[Callable[[], EventModule], list[L.Callback]] = (
        (lambda: SavingInsideSteps(directory), []) if where == "training_step"
        else (Counting, [SaveAtEachBatchStart(directory)]))
    full = fit(loaders, tmp_path, saving[1], module=saving[0], val_check_interval=3, **options)
    steps = sum(event[0] == "train" for event in full)  # min_size: 3 batches an epoch
    assert steps == (6 if loaders is unsized_min_size else STEPS)
    assert [batch for batch in range(steps)
            if fit(loaders, tmp_path, ckpt_path=directory / f"{batch}.ckpt", module=Counting,
                   val_check_interval=3, **options) != full] == []


def test_a_shuffled_unsized_validation_loader(tmp_path: Path) -> None:
    """After the pass run on restore, Lightning counts the validation done, and its ``reset``
    fetches a batch of an unsized loader: the next pass must not move on an epoch for it."""

    def loaders() -> tuple[Any, Any]:
        val = ResumableLoader(GeneratorSource(samples, [(0, 3), (3, 6)]), batch_size=2,
                              shuffle=True, shuffle_buffer=4, seed=4, evaluation=True)
        return resumable()()[0], val

    full, steps, exact_steps = resume_from_every_step(loaders, tmp_path, val_check_interval=0.5)
    orders = [tuple(i for e in full if e[0] == "val" for i in e[4])[p * 6:p * 6 + 6]
              for p in range(4)]
    assert len(set(orders)) == 4
    assert exact_steps == steps == list(range(1, STEPS + 1))


def test_min_size_validation_over_unsized_loaders(tmp_path: Path) -> None:
    """``min_size`` drops the batch its longer member handed over as the shorter one ends,
    so that member starts its next epoch at the next pass, as one a pass leaves mid-epoch
    does: the dropped batch is not one Lightning's fetcher holds (to go on from before).
    Resumed after a pass, the member of unknown length (left mid-epoch, which its length
    cannot tell) starts that next epoch too, not the one after it."""

    def loaders() -> tuple[Any, Any]:
        members = {name: ResumableLoader(GeneratorSource(samples, shards), batch_size=2,
                                         shuffle=True, shuffle_buffer=4, seed=seed,
                                         evaluation=True)
                   for name, shards, seed in (("a", [(0, 4), (4, 8), (8, 12)], 3),
                                              ("b", [(0, 3), (3, 6)], 9))}
        return resumable()()[0], CombinedLoader(members, "min_size")

    full, steps, exact_steps = resume_from_every_step(loaders, tmp_path, val_check_interval=0.5)
    assert exact_steps == steps == list(range(1, STEPS + 1))
    passes = [[i for e in full if e[0] == "val" for i in e[4]["a"]][p * 6:p * 6 + 6]
              for p in range(2)]
    a = loaders()[1].flattened[0]
    orders = []
    for epoch in range(2):
        a.set_epoch(epoch)
        orders.append([i for batch in a for i in batch["index"].tolist()])
    assert passes == [orders[0][:6], orders[1][:6]]


def test_a_validation_loader_first_read_in_a_later_epoch(tmp_path: Path) -> None:
    """No pass has read it when the checkpoint is written: restored, it starts at the
    trainer's epoch as a new one does (its unread state would pin it to epoch 0's order)."""
    full, steps, exact_steps = resume_from_every_step(
        resumable(shuffle_val=True), tmp_path, val_check_interval=8,
        check_val_every_n_epoch=None)
    assert validation_passes(full) == [8]
    assert exact_steps == steps == list(range(1, STEPS + 1))


@pytest.mark.parametrize(("loaders", "pass_index", "dataloader_idx", "batch_idx", "hook",
                          "first", "options"), MID_VALIDATION)
def test_a_checkpoint_inside_validation_resumes_with_the_rest_of_the_pass(
        tmp_path: Path, loaders: Loaders, pass_index: int, dataloader_idx: int, batch_idx: int,
        hook: str, first: bool, options: dict[str, Any]) -> None:
    path = tmp_path / "inside.ckpt"
    saver = SaveDuringValidation(path, pass_index, batch_idx, dataloader_idx, hook)
    model = EventModule()
    callbacks = [ExactResume(), saver] if first else [saver, ExactResume()]
    make_trainer(tmp_path, 2, callbacks, **options).fit(model, *loaders())
    full = model.events
    saved = torch.load(path, weights_only=False)["events"]
    assert saved[-1][0] == "val", "the checkpoint was written inside a validation pass"
    assert fit(loaders, tmp_path, ckpt_path=path, **options) == full
    assert fit(loaders, tmp_path, ckpt_path=path, exact=False, **options) != full


def test_checkpoints_written_at_each_validations_end_resume_after_it(tmp_path: Path) -> None:
    """``ModelCheckpoint``'s default schedule saves in ``on_validation_end``, which Lightning
    calls after ours: the pass is over there, and must not run again on resume."""
    directory = tmp_path / "checkpoints"
    saver = ModelCheckpoint(dirpath=directory, filename="{step}", save_top_k=-1)
    full = fit(resumable(), tmp_path, [saver], val_check_interval=0.5)
    paths = sorted(directory.glob("*.ckpt"))
    assert len(paths) == 4  # two passes in each of two epochs
    for path in paths:
        assert torch.load(path, weights_only=False)["events"][-1][0] == "val"
        assert fit(resumable(), tmp_path, ckpt_path=path, val_check_interval=0.5) == full, path


def test_a_checkpoint_before_our_on_validation_start_resumes_with_the_whole_pass(
        tmp_path: Path) -> None:
    """Written by a callback listed first, as the second pass starts: the first pass is
    over, but this one is still to run."""
    path = tmp_path / "starting.ckpt"
    model = EventModule()
    make_trainer(tmp_path, 2, [SaveDuringValidation(path, 1, 0, hook="on_validation_start"),
                               ExactResume()], **HALF).fit(model, *resumable()())
    assert torch.load(path, weights_only=False)["events"][-1][0] == "train"
    assert fit(resumable(), tmp_path, ckpt_path=path, **HALF) == model.events


def test_a_checkpoint_inside_the_rest_of_a_resumed_pass(tmp_path: Path) -> None:
    """Interrupted twice in one pass: the second resume goes on from the second checkpoint."""
    first, second = tmp_path / "first.ckpt", tmp_path / "second.ckpt"
    full = fit(resumable(val_batches=5), tmp_path,
               [SaveDuringValidation(first, 1, 1)], val_check_interval=0.5)
    # the resumed run's pass 0 is the rest of the interrupted one (its batch 2 on)
    for hook in ("on_validation_batch_end", "on_validation_batch_start"):
        once = fit(resumable(val_batches=5), tmp_path,
                   [SaveDuringValidation(second, 0, 3, hook=hook)], ckpt_path=first,
                   val_check_interval=0.5)
        assert once == full
        twice = fit(resumable(val_batches=5), tmp_path, ckpt_path=second,
                    val_check_interval=0.5)
        assert twice == full, hook


@pytest.mark.parametrize("loaders", [resumable(), plain_loaders],
                         ids=["ResumableLoader", "DataLoader"])
def test_a_checkpoint_inside_the_pending_pass_of_an_epochs_last_step(tmp_path: Path,
                                                                     loaders: Loaders) -> None:
    """The checkpoint after epoch 0's last step resumes with the validation due there; one
    written during that pass (at its end by ``ModelCheckpoint``, or inside it) resumes into
    epoch 1 with each epoch's hooks once. Lightning took it for no restart, and ran epoch 0
    again, empty, with its ``on_train_epoch_start`` and ``on_train_epoch_end``."""
    first = tmp_path / "first"
    full = fit(loaders, tmp_path, [every_step_checkpoints(first)], **HALF)
    directory, inside = tmp_path / "during", tmp_path / "inside.ckpt"
    saver = ModelCheckpoint(dirpath=directory, filename="{step}", save_top_k=-1)
    assert fit(loaders, tmp_path, [saver, SaveDuringValidation(inside, 0, 1)],
               ckpt_path=checkpoint_at(first, 6), **HALF) == full
    for path in (checkpoint_at(directory, 6), inside):
        assert torch.load(path, weights_only=False)["events"][-1][0] == "val"
        assert fit(loaders, tmp_path, ckpt_path=path, **HALF) == full, path


def test_replaying_an_out_of_order_validation_pass_warns(tmp_path: Path) -> None:
    """A checkpoint inside a step resumes the pass by replaying its first batches in the plan's
    order, which an ``in_order=False`` pass did not keep: it says so, where it used to validate
    some batches twice and others never in silence."""
    def loaders() -> tuple[Any, Any]:
        return (ResumableLoader(IndexDataset(12), batch_size=2, shuffle=True, seed=3),
                ResumableLoader(IndexDataset(6), batch_size=2, num_workers=2, in_order=False,
                                evaluation=True))

    path = tmp_path / "inside.ckpt"
    fit(loaders, tmp_path, [SaveDuringValidation(path, 0, 1, hook="on_validation_batch_start")],
        max_epochs=1)
    with pytest.warns(UserWarning, match="replaying its first 1 batches.*in_order=False"):
        fit(loaders, tmp_path, ckpt_path=path, max_epochs=1)


def test_checkpoints_written_by_a_resumed_run_resume_exactly_too(tmp_path: Path) -> None:
    first = tmp_path / "first"
    full = fit(resumable(), tmp_path, [every_step_checkpoints(first)], val_check_interval=0.5)
    for start in (3, 6):  # resumed right before a validation pass, then checkpointed again
        directory = tmp_path / f"after{start}"
        again = fit(resumable(), tmp_path, [every_step_checkpoints(directory)],
                    ckpt_path=checkpoint_at(first, start), val_check_interval=0.5)
        assert again == full
        for step in range(start + 1, STEPS + 1):
            assert fit(resumable(), tmp_path, ckpt_path=checkpoint_at(directory, step),
                       val_check_interval=0.5) == full, (start, step)


class Data(ResumableDataModule):
    def __init__(self, shuffle_val: bool = False) -> None:
        super().__init__()
        self.shuffle_val = shuffle_val

    def train_dataloader(self) -> Any:
        return DataLoader(IndexDataset(12), batch_size=2, shuffle=True,
                          generator=torch.Generator().manual_seed(5))

    def val_dataloader(self) -> Any:
        return DataLoader(IndexDataset(6), batch_size=2, shuffle=self.shuffle_val)


@pytest.mark.parametrize(("max_epochs", "options"), [
    (2, {}),
    (2, {"reload_dataloaders_every_n_epochs": 1}),
    (4, {"reload_dataloaders_every_n_epochs": 2}),
], ids=["kept", "rebuilt-every-epoch", "rebuilt-every-2-epochs"])
def test_with_resumable_data_module(tmp_path: Path, max_epochs: int,
                                    options: dict[str, Any]) -> None:
    """A shuffled validation loader goes on between passes, or starts afresh where Lightning
    rebuilds it (``reload_dataloaders_every_n_epochs``): a resumed run must do the same, and
    rebuild it in the same epochs."""
    directory = tmp_path / "checkpoints"

    def run(ckpt_path: Path | None = None, callbacks: Iterable[Any] = ()) -> list[Event]:
        model = EventModule()
        trainer = make_trainer(tmp_path, max_epochs, [ExactResume(), *callbacks],
                               val_check_interval=0.5, **options)
        trainer.fit(model, datamodule=Data(shuffle_val=True),
                    ckpt_path=str(ckpt_path) if ckpt_path else None)
        return model.events

    full = run(callbacks=[every_step_checkpoints(directory)])
    steps = max_epochs * 6
    assert validation_passes(full) == list(range(3, steps + 1, 3))
    assert [step for step in range(1, steps + 1) if run(checkpoint_at(directory, step)) != full
            ] == []


def test_loaders_passed_to_fit_go_on_through_reloads(tmp_path: Path) -> None:
    """``reload_dataloaders_every_n_epochs`` asks for loaders passed to ``fit`` again and gets
    the same objects: a shuffled validation loader goes on with its next epoch, and a resumed
    run must not start it afresh as it would a hook's new loader."""
    full, steps, exact_steps = resume_from_every_step(
        resumable(shuffle_val=True), tmp_path, val_check_interval=0.5,
        reload_dataloaders_every_n_epochs=1)
    assert validation_passes(full) == [3, 6, 9, 12]
    assert exact_steps == steps == list(range(1, STEPS + 1))


class _PlainData(L.LightningDataModule):
    def train_dataloader(self) -> Any:
        return DataLoader(IndexDataset(12), batch_size=2, shuffle=True)


def test_a_plain_loader_from_a_hook_is_named_in_a_warning(tmp_path: Path) -> None:
    """Loaders from hooks are the hook's to make resumable; a plain one would restart its
    epoch on resume, in silence."""
    trainer = make_trainer(tmp_path, 1, [ExactResume()])
    with pytest.warns(UserWarning, match=r"training loader 0 \(DataLoader\) has no "
                                         r"state_dict\(\).*make_resumable"):
        trainer.fit(EventModule(), datamodule=_PlainData())


class _Batches:
    """An iterable of batches that is no DataLoader and has no state of its own."""

    def __iter__(self) -> Iterator[torch.Tensor]:
        return iter([torch.arange(2), torch.arange(2, 4)])


class _UnconvertibleData(ResumableDataModule):
    def train_dataloader(self) -> Any:
        return _Batches()


def test_a_loader_a_resumable_data_module_cannot_convert_is_warned_of_once(
        tmp_path: Path) -> None:
    """The user already has a ResumableDataModule: ExactResume's warning said to use one, and
    repeated the data module's own."""
    trainer = make_trainer(tmp_path, 1, [ExactResume()])
    with pytest.warns(UserWarning) as caught:
        trainer.fit(EventModule(), datamodule=_UnconvertibleData())
    [message] = [str(w.message) for w in caught if "_Batches" in str(w.message)]
    assert message.startswith("train_dataloader() returned (_Batches) that ResumableDataModule "
                              "cannot make resumable")
    assert "or a ResumableDataModule" not in message


def test_it_adds_no_warnings_or_log_records(tmp_path: Path,
                                            caplog: pytest.LogCaptureFixture) -> None:
    path = tmp_path / "inside.ckpt"
    fit(resumable(), tmp_path, [SaveDuringValidation(path, 1, 1)], val_check_interval=0.5)

    def messages(exact: bool) -> set[str]:
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            fit(resumable(), tmp_path, ckpt_path=path, exact=exact, val_check_interval=0.5)
        return {str(w.message) for w in caught if "ExactResume" not in str(w.message)}

    with caplog.at_level(logging.DEBUG, logger="lightning_loaders"):
        assert messages(exact=True) == messages(exact=False)
    assert not [r for r in caplog.records if r.name.startswith("lightning_loaders")]


def test_other_validation_loaders_on_resume_start_afresh_with_a_warning(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    fit(resumable(), tmp_path, [every_step_checkpoints(directory)], val_check_interval=0.5)
    with pytest.warns(UserWarning, match="states of 1 validation loaders but val_dataloader"):
        events = fit(resumable(val_loaders=2), tmp_path, ckpt_path=checkpoint_at(directory, 3),
                     val_check_interval=0.5)
    assert validation_passes(events) == [3, 6, 9, 12]


def test_a_state_from_another_version_is_refused() -> None:
    with pytest.raises(ValueError, match="version 99"):
        ExactResume().load_state_dict({"version": 99})


def test_two_ranks(tmp_path: Path) -> None:
    """Real 2-process DDP: resume from a step checkpoint with validation due, from one
    written inside validation, and from one written before a step over an unsized loader;
    every rank's stream equals its uninterrupted one."""
    results = run_ddp(REPO / "tests" / "scripts" / "exact_resume_ddp.py", [str(tmp_path)],
                      tmp_path / "results")
    for rank, result in enumerate(results):
        full = result["full"]
        assert validation_passes(full) == [3, 6, 9, 12], rank
        assert set(result["resumed"]) == {"step3", "step6", "inside"}
        for name, resumed in result["resumed"].items():
            assert resumed == full, (rank, name)
        in_step = result["in_step"]
        assert sum(event[0] == "train" for event in in_step["full"]) == 10, rank
        assert in_step["resumed"] == in_step["full"], rank
    validated = [i for result in results for e in result["full"] if e[0] == "val" for i in e[4]]
    assert sorted(validated) == sorted(list(range(12)) * 4), "each pass reads every sample once"


def test_a_checkpoint_at_an_epochs_last_batch_resumes_on_another_world_size(
        tmp_path: Path) -> None:
    """Rank 0 of 2 (16 samples, batch 2: 4 batches per epoch) checkpoints at every step; the
    checkpoint at the epoch's last batch resumes on one rank (8 batches per epoch). Lightning
    alone counts that epoch's 4 batches into the next one and stops it half-way (pinned by a
    strict xfail in ``tests/loaders/test_elastic.py``); with ``ExactResume`` the next epoch is
    whole: every sample once."""
    def loader(world_size: int) -> Callable[[], ResumableLoader]:
        return lambda: ResumableLoader(IndexDataset(16), batch_size=2, shuffle=True, seed=3,
                                       rank=0, world_size=world_size)

    extra = [ExactResume()]
    directory = tmp_path / "checkpoints"
    trainer = make_trainer(tmp_path, 2, [every_step_checkpoints(directory), *extra])
    trainer.fit(EventModule(), loader(2)())
    model = EventModule()
    make_trainer(tmp_path, 2, extra).fit(model, loader(1)(),
                                         ckpt_path=str(checkpoint_at(directory, 4)))
    resumed = [event[3] for event in model.events[len(_events(directory, 4)):]
               if event[0] == "train"]
    delivered = sorted(i for ids in resumed for i in ids)
    assert delivered == list(range(16)), delivered


def _events(directory: Path, step: int) -> list[Event]:
    return torch.load(checkpoint_at(directory, step), weights_only=False)["events"]
