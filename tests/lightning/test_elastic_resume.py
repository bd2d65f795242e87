"""An elastic mid-epoch resume under a real Lightning ``Trainer`` (CPU) with ``ExactResume``:
a checkpoint written after ``g`` batches on ``W`` ranks, resumed on ``W'`` ranks, trains the
rest of its epoch exactly once, with ``batch_idx`` counted on the new layout.

Two ranks are simulated in one process (``rank=``/``world_size=`` given explicitly): each
rank's run is its own ``fit``. Lightning alone counts the resumed epoch in the old layout's
batches and, on more ranks, ends it early (10 of 32 samples lost in the first case below);
``ExactResume`` counts it from the loaders' ``resume_batch()``.
"""

from __future__ import annotations

import warnings
from collections import Counter
from collections.abc import Callable
from pathlib import Path
from typing import Any

import pytest
from lightning.pytorch.utilities import CombinedLoader

from lightning_loaders import ExactResume, ResumableDataModule, ResumableLoader
from lightning_loaders.sources.shards import GeneratorSource, SequenceSource
from tests.conftest import IndexDataset
from tests.ddp_harness import REPO, run_ddp
from tests.lightning_harness import (
    RecordingModule,
    Step,
    checkpoint_at,
    every_step_checkpoints,
    fit_recording,
    make_trainer,
)

SAMPLES, BATCH, EPOCHS = 32, 2, 2
Make = Callable[[int | None, int | None], Any]  # (rank, world_size) -> a training loader


def map_style(rank: int | None, world_size: int | None) -> ResumableLoader:
    return ResumableLoader(IndexDataset(SAMPLES), batch_size=BATCH, shuffle=True, seed=3,
                           rank=rank, world_size=world_size)


def iterable(rank: int | None, world_size: int | None) -> ResumableLoader:
    """Four shards of known length over canonical partitions (4: a multiple of 1 and 2)."""
    shards = [list(range(start, start + 8)) for start in range(0, SAMPLES, 8)]
    return ResumableLoader(SequenceSource(shards), batch_size=BATCH, shuffle=True, seed=3,
                           partitions=4, rank=rank, world_size=world_size)


LOADERS = {"map-style": map_style, "iterable": iterable}


def _fit(make: Make, rank: int, world_size: int, root: Path, ckpt: Path | None = None,
         exact: bool = True, save: bool | None = None, model: RecordingModule | None = None,
         **kwargs: Any) -> list[Step]:
    """What each training step of one rank saw, from the start or resumed from ``ckpt``;
    ``save`` (default: when not resumed): a checkpoint at every step under
    ``root / "checkpoints"``."""
    callbacks: list[Any] = [ExactResume()] if exact else []
    if save or (save is None and ckpt is None):
        callbacks.append(every_step_checkpoints(root / "checkpoints"))
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return fit_recording(lambda: make(rank, world_size), root, EPOCHS, callbacks,
                             ckpt_path=ckpt, model=model, **kwargs)


def _runs(make: Make, world_size: int, root: Path) -> list[list[Step]]:
    """Every rank's uninterrupted run on ``world_size`` ranks, each checkpointing every step."""
    return [_fit(make, rank, world_size, root / f"rank{rank}") for rank in range(world_size)]


def _resumed(make: Make, root: Path, step: int, world_size: int, out: Path,
             exact: bool = True) -> list[list[Step]]:
    """Every rank of ``world_size`` resumed from checkpoint ``step`` of rank 0's run under
    ``root``."""
    ckpt = checkpoint_at(root / "rank0" / "checkpoints", step)
    return [_fit(make, rank, world_size, out / f"resumed{rank}", ckpt, exact)
            for rank in range(world_size)]


def _check_exactly_once(runs: list[list[Step]], step: int, resumed: list[list[Step]]) -> None:
    """The ranks' steps before checkpoint ``step`` plus the resumed ranks' steps hold every
    sample once in every epoch."""
    trained = [(e, i) for run in runs for e, _, ids in run[:step] for i in ids]
    trained += [(e, i) for run in resumed for e, _, ids in run for i in ids]
    for epoch in range(EPOCHS):
        ids = Counter(i for e, i in trained if e == epoch)
        assert sorted(ids) == list(range(SAMPLES)) and set(ids.values()) == {1}, (
            step, epoch, sorted(ids.items()))


def _batch_indices(run: list[Step], epoch: int) -> list[int]:
    return [b for e, b, _ in run if e == epoch]


def _resume_batch(make: Make, root: Path, step: int, world_size: int) -> int:
    """Where a loader on ``world_size`` ranks resumes from checkpoint ``step``'s state."""
    import torch

    ckpt = torch.load(checkpoint_at(root / "rank0" / "checkpoints", step), weights_only=False)
    (state,) = ckpt["loops"]["fit_loop"]["state_dict"]["combined_loader"]
    loader = make(0, world_size)
    loader.load_state_dict(state)
    batch = loader.resume_batch()
    assert batch is not None
    return batch


@pytest.mark.parametrize("kind", LOADERS)
def test_a_mid_epoch_checkpoint_resumes_on_more_ranks_with_the_whole_rest_of_the_epoch(
        kind: str, tmp_path: Path) -> None:
    """1 rank (16 batches per epoch) -> 2 ranks (8 per rank): e.g. after 5 batches (10 of 32
    samples) the rest, 22 samples, is 6 batches per rank, ``batch_idx`` 2..7."""
    make = LOADERS[kind]
    runs = _runs(make, 1, tmp_path)
    for step in (1, 5, 10, 15):
        resumed = _resumed(make, tmp_path, step, 2, tmp_path / f"up{step}")
        _check_exactly_once(runs, step, resumed)
        first = _resume_batch(make, tmp_path, step, 2)
        rest = -(-(SAMPLES - step * BATCH) // (2 * BATCH))  # batches per rank left
        assert first == SAMPLES // (2 * BATCH) - rest, (step, first)
        for run in resumed:
            assert _batch_indices(run, 0) == list(range(first, 8)), step
            assert _batch_indices(run, 1) == list(range(8)), step


@pytest.mark.parametrize("kind", LOADERS)
def test_a_mid_epoch_checkpoint_resumes_on_fewer_ranks_with_batch_idx_of_the_new_layout(
        kind: str, tmp_path: Path) -> None:
    """2 ranks (8 batches per rank) -> 1 rank (16): after ``g`` batches per rank the rest is
    16 - 2g batches, ``batch_idx`` 2g..15."""
    make = LOADERS[kind]
    runs = _runs(make, 2, tmp_path)
    for step in (1, 3, 6):
        resumed = _resumed(make, tmp_path, step, 1, tmp_path / f"down{step}")
        _check_exactly_once(runs, step, resumed)
        assert _batch_indices(resumed[0], 0) == list(range(2 * step, 16)), step
        assert _batch_indices(resumed[0], 1) == list(range(16)), step


def test_real_ddp_resumes_a_one_rank_checkpoint_on_two_ranks(tmp_path: Path) -> None:
    """One 2-process DDP launch (gloo, ranks placed by Lightning) resumes 1-rank checkpoints
    of both loader kinds mid-epoch: every sample of every epoch once, ``batch_idx`` counted
    on the 2-rank layout."""
    steps = (5, 10)
    runs = {kind: _runs(make, 1, tmp_path / kind) for kind, make in LOADERS.items()}
    ranks = run_ddp(REPO / "tests" / "scripts" / "elastic_resume_ddp.py",
                    ["--ckpt-root", str(tmp_path),
                     *[arg for kind in LOADERS for step in steps
                       for arg in ("--resume", kind, str(step))]], tmp_path / "ddp")
    assert [rank["rank"] for rank in ranks] == [0, 1]
    for kind in LOADERS:
        for step in steps:
            resumed = [[(e, b, ids) for e, b, ids in rank["resumes"][f"{kind} {step}"]]
                       for rank in ranks]
            _check_exactly_once(runs[kind], step, resumed)
            first = 8 - -(-(SAMPLES - step * BATCH) // (2 * BATCH))
            assert [_batch_indices(run, 0) for run in resumed] == [list(range(first, 8))] * 2


class _Data(ResumableDataModule):
    """The map-style loader from a data module, which carries the training cursor itself."""

    def __init__(self, rank: int, world_size: int) -> None:
        super().__init__()
        self.rank, self.world_size = rank, world_size

    def train_dataloader(self) -> Any:
        return map_style(self.rank, self.world_size)


def test_with_resumable_data_module(tmp_path: Path) -> None:
    """The cursor the data module restores is the one counted from: 1 -> 2 ranks after 5."""
    full = _fit_data(0, 1, tmp_path / "rank0")
    ckpt = checkpoint_at(tmp_path / "rank0" / "checkpoints", 5)
    resumed = [_fit_data(rank, 2, tmp_path / f"up{rank}", ckpt) for rank in (0, 1)]
    _check_exactly_once([full], 5, resumed)
    assert [_batch_indices(run, 0) for run in resumed] == [list(range(2, 8))] * 2


def _fit_data(rank: int, world_size: int, root: Path, ckpt: Path | None = None) -> list[Step]:
    callbacks: list[Any] = [ExactResume()]
    if ckpt is None:
        callbacks.append(every_step_checkpoints(root / "checkpoints"))
    model = RecordingModule()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        make_trainer(root, EPOCHS, callbacks).fit(model, datamodule=_Data(rank, world_size),
                                                  ckpt_path=ckpt)
    return model.seen


def test_without_it_a_resume_on_more_ranks_loses_the_rest_of_the_epoch(tmp_path: Path) -> None:
    """What ``ExactResume`` repairs: Lightning counts the 5 batches of the 1-rank layout into
    the 8 of the 2-rank one and asks for 3 of the 6 batches left (10 of 32 samples lost)."""
    runs = _runs(map_style, 1, tmp_path)
    resumed = _resumed(map_style, tmp_path, 5, 2, tmp_path / "up", exact=False)
    assert [_batch_indices(run, 0) for run in resumed] == [[5, 6, 7]] * 2
    with pytest.raises(AssertionError):
        _check_exactly_once(runs, 5, resumed)


@pytest.mark.parametrize("kind", LOADERS)
def test_on_the_same_layout_the_counts_agree_and_nothing_changes(kind: str,
                                                                 tmp_path: Path) -> None:
    """The loader resumes at the very batch Lightning counted, and the resumed run is the
    uninterrupted one's rest, with or without ``ExactResume``."""
    make = LOADERS[kind]
    runs = _runs(make, 1, tmp_path)
    for step in (1, 7, 16, 20):
        assert _resume_batch(make, tmp_path, step, 1) == (step if step <= 16
                                                                else step - 16)
        for exact in (True, False):
            (resumed,) = _resumed(make, tmp_path, step, 1, tmp_path / f"same{step}", exact)
            assert resumed == runs[0][step:], (step, exact)


def test_a_resumed_resume_on_a_third_layout_is_exact(tmp_path: Path) -> None:
    """1 rank -> 2 ranks after 5 batches -> back to 1 rank after 2 more batches per rank: the
    saved count is then in the 2-rank layout's units on top of the 1-rank offset."""
    runs = _runs(map_style, 1, tmp_path)
    ckpt = checkpoint_at(tmp_path / "rank0" / "checkpoints", 5)
    middle = [_fit(map_style, rank, 2, tmp_path / f"middle{rank}", ckpt, save=True)
              for rank in (0, 1)]
    middle_ckpt = checkpoint_at(tmp_path / "middle0" / "checkpoints", 7)
    last = _fit(map_style, 0, 1, tmp_path / "last", middle_ckpt)
    trained = [(e, i) for e, _, ids in runs[0][:5] for i in ids]
    trained += [(e, i) for run in middle for e, b, ids in run if (e, b) in {(0, 2), (0, 3)}
                for i in ids]
    trained += [(e, i) for e, _, ids in last for i in ids]
    for epoch in range(EPOCHS):
        assert sorted(i for e, i in trained if e == epoch) == list(range(SAMPLES)), epoch
    assert _batch_indices(last, 0) == list(range(18 // 2, 16))  # 18 of 32 samples read


def test_gradient_accumulation_keeps_the_logger_step(tmp_path: Path) -> None:
    """``accumulate_grad_batches=2``: resumed on 2 ranks after 4 batches (the 2-rank count:
    2), the logger step of the first step after the resume is the saved one, and the epoch is
    whole."""
    runs = [_fit(map_style, 0, 1, tmp_path / "rank0", accumulate_grad_batches=2)]
    model = _StepModule()
    ckpt = checkpoint_at(tmp_path / "rank0" / "checkpoints", 3)  # after 6 batches
    _fit(map_style, 0, 2, tmp_path / "up", ckpt, model=model, accumulate_grad_batches=2)
    assert [b for e, b, _ in model.seen if e == 0] == [3, 4, 5, 6, 7]
    assert model.logger_steps[0] == 3  # as after 6 batches of 2-step accumulation
    other = _fit(map_style, 1, 2, tmp_path / "up1", ckpt, accumulate_grad_batches=2)
    _check_exactly_once(runs, 6, [model.seen, other])


class _StepModule(RecordingModule):
    """Also records the logger step (``_batches_that_stepped``) each training step sees."""

    def __init__(self) -> None:
        super().__init__()
        self.logger_steps: list[int] = []

    def training_step(self, batch: Any, batch_idx: int) -> Any:
        self.logger_steps.append(self.trainer.fit_loop.epoch_loop._batches_that_stepped)
        return super().training_step(batch, batch_idx)


@pytest.mark.parametrize("mode", ["max_size_cycle", "min_size", "max_size"])
def test_a_combined_loader_follows_the_member_its_mode_ends_the_epoch_with(
        mode: str, tmp_path: Path) -> None:
    """Two map-style members (32 and 16 samples); resumed on 2 ranks after 5 batches, each
    mode asks for as many combined batches as its rule leaves, counted from batch 2 of the
    new layout: every sample of the member it follows once in the epoch."""
    def make(rank: int | None, world_size: int | None) -> CombinedLoader:
        short = ResumableLoader(IndexDataset(16), batch_size=BATCH, shuffle=True, seed=4,
                                rank=rank, world_size=world_size)
        return CombinedLoader({"long": map_style(rank, world_size), "short": short}, mode)

    runs = [_fit(make, 0, 1, tmp_path / "rank0")]
    resumed = _resumed(make, tmp_path, 5, 2, tmp_path / "up")
    member, samples = ("short", 16) if mode == "min_size" else ("long", SAMPLES)
    per_rank = samples // (2 * BATCH)  # the combined batches of an epoch on 2 ranks
    assert [_batch_indices(run, 0) for run in resumed] == [list(range(2, per_rank))] * 2
    ids = [i for e, _, batch in runs[0][:5] if e == 0 for i in batch[member] or []]
    ids += [i for run in resumed for e, _, batch in run if e == 0 for i in batch[member] or []]
    assert sorted(ids) == list(range(samples)), mode


def test_the_loaders_resume_batch_starts_nothing(tmp_path: Path) -> None:
    """``resume_batch()`` is computed from the pending state: asking it does not change what
    the loader delivers; ``None`` without a restored state or with unknown lengths."""
    loader = map_style(0, 1)
    assert loader.resume_batch() is None
    source = iter(loader)
    for _ in range(5):
        next(source)
    state = loader.state_dict()
    expected = map_style(1, 2)
    expected.load_state_dict(state)
    asked = map_style(1, 2)
    asked.load_state_dict(state)
    assert asked.resume_batch() == asked.resume_batch() == 2
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # asked: no "past len()" warning
        got = [batch["index"].tolist() for batch in asked]
    with pytest.warns(UserWarning, match="past len"):
        assert got == [batch["index"].tolist() for batch in expected]
    assert asked.resume_batch() is None
    unknown = ResumableLoader(GeneratorSource(_shard, [0, 1]), batch_size=BATCH)
    unknown_source = iter(unknown)
    next(unknown_source)
    state = unknown.state_dict()
    unknown.close()
    again = ResumableLoader(GeneratorSource(_shard, [0, 1]), batch_size=BATCH)
    again.load_state_dict(state)
    assert again.resume_batch() is None


def _shard(shard: int) -> Any:
    return iter(range(shard * 8, shard * 8 + 8))
