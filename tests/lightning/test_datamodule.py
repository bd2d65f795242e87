import functools
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader

from lightning_loaders import ResumableLoader
from lightning_loaders.lightning.datamodule import STATE_KEY, ResumableDataModule
from lightning_loaders.lightning.exact_resume import ExactResume
from lightning_loaders.loaders.convert import make_resumable
from lightning_loaders.orders.dynamic_weighted import DynamicWeightedSampler
from lightning_loaders.testing import checkpoint_roundtrip, run_epochs, set_epoch
from tests.conftest import IndexDataset
from tests.ddp_harness import REPO, run_ddp
from tests.lightning_harness import (
    RecordingModule,
    checkpoint_at,
    every_step_checkpoints,
    fit_recording,
)
from tests.scripts import datamodule_ddp as ddp

SCRIPT = REPO / "tests" / "scripts" / "datamodule_ddp.py"


def indices(batch) -> list[int]:
    return batch["index"].tolist()


def _shuffled(n: int = 20) -> DataLoader:
    return DataLoader(IndexDataset(n), batch_size=4, shuffle=True,
                      generator=torch.Generator().manual_seed(3))


class Structures(ResumableDataModule):
    def train_dataloader(self) -> Any:
        return _shuffled()

    def val_dataloader(self) -> Any:
        return [DataLoader(IndexDataset(5), batch_size=1), [0, 1, 2]]

    def test_dataloader(self) -> Any:
        return {"plain": DataLoader(IndexDataset(5)), "ours": ResumableLoader(IndexDataset(3))}

    def predict_dataloader(self) -> Any:
        return CombinedLoader({"a": DataLoader(IndexDataset(4)), "b": DataLoader(IndexDataset(6))},
                              "sequential")


def test_whatever_the_hooks_return_comes_back_as_resumable_loaders() -> None:
    data = Structures()
    assert isinstance(data.train_dataloader(), ResumableLoader)
    val, untouched = data.val_dataloader()
    assert isinstance(val, ResumableLoader) and untouched == [0, 1, 2]
    assert val.schedule.merge_short_tail, "evaluation loaders read every sample once"
    test = data.test_dataloader()
    assert isinstance(test["plain"], ResumableLoader) and isinstance(test["ours"], ResumableLoader)
    predict = data.predict_dataloader()
    assert isinstance(predict, CombinedLoader)
    assert all(isinstance(dl.batch_sampler, _IndexBatchSamplerWrapper) for dl in predict.flattened)
    assert not data.train_dataloader().schedule.merge_short_tail


def _consume(loader: Any, batches: int) -> list[list[int]]:
    iterator = iter(loader)
    return [indices(next(iterator)) for _ in range(batches)]


def test_the_cursor_travels_in_the_datamodule_state_and_applies_once() -> None:
    reference = run_epochs(make_resumable(_shuffled()), range(2), key=indices)
    source = Structures()
    _consume(source.train_dataloader(), 2)
    state = checkpoint_roundtrip(source.state_dict())
    assert set(state) == {STATE_KEY}

    restored = Structures()
    restored.load_state_dict(state)
    loader = restored.train_dataloader()
    assert run_epochs(loader, [0], key=indices)[0] == reference[0][2:]
    reloaded = restored.train_dataloader()  # reload_dataloaders_every_n_epochs: not the cursor
    assert run_epochs(reloaded, [1], key=indices)[0] == reference[1]

    early = Structures()  # loaders built before the state arrives (estimated_stepping_batches)
    loader = early.train_dataloader()
    early.load_state_dict(state)
    assert run_epochs(loader, [0], key=indices)[0] == reference[0][2:]

    reused = Structures()  # a module that trained before is given a checkpoint
    run_epochs(reused.train_dataloader(), range(2))
    reused.load_state_dict(state)
    assert run_epochs(reused.train_dataloader(), [0], key=indices)[0] == reference[0][2:]


def test_loading_twice_before_training_is_harmless() -> None:
    reference = run_epochs(make_resumable(_shuffled()), [0], key=indices)[0]
    source = Structures()
    loader = source.train_dataloader()
    _consume(loader, 3)
    state, loader_state = source.state_dict(), loader.state_dict()
    restored = Structures()
    restored.load_state_dict(state)  # Lightning: restore_datamodule()
    fresh = restored.train_dataloader()
    fresh.load_state_dict(loader_state)  # Lightning: _load_combined_loader_states()
    set_epoch(fresh, 0)
    assert [indices(b) for b in fresh] == reference[3:]


def test_overridden_state_hooks_keep_the_cursor() -> None:
    class Mine(Structures):
        def __init__(self) -> None:
            super().__init__()
            self.counter = 0

        def state_dict(self) -> dict[str, Any]:
            return {"counter": self.counter}

        def load_state_dict(self, state_dict: dict[str, Any]) -> None:
            assert set(state_dict) == {"counter"}
            self.counter = state_dict["counter"]

    source = Mine()
    source.counter = 5
    _consume(source.train_dataloader(), 1)
    state = source.state_dict()
    assert state["counter"] == 5 and state[STATE_KEY]["train"][""]["batches"] == 1
    restored = Mine()
    restored.load_state_dict(state)
    assert restored.counter == 5
    assert restored.train_dataloader().state_dict()["batches"] == 1


def test_an_unknown_state_version_is_refused() -> None:
    with pytest.raises(ValueError, match="version 9"):
        Structures().load_state_dict({STATE_KEY: {"version": 9, "train": {}}})


# -- Lightning #20550: loader state never restored when configure_optimizers reads
#    trainer.estimated_stepping_batches --------------------------------------------------------

class SteppingModule(RecordingModule):
    def configure_optimizers(self) -> torch.optim.Optimizer:
        assert self.trainer.estimated_stepping_batches == 10
        return super().configure_optimizers()


class PlainData(L.LightningDataModule):
    def train_dataloader(self) -> ResumableLoader:
        return make_resumable(_shuffled())


class OurData(ResumableDataModule):
    def train_dataloader(self) -> DataLoader:
        return _shuffled()


def _fit(data: type, root: Path, callbacks=(), ckpt_path=None, model=SteppingModule, **kw):
    return fit_recording(data, root, 2, callbacks, ckpt_path=ckpt_path, model=model(), **kw)


def test_lightning_alone_loses_the_cursor_in_issue_20550(tmp_path: Path) -> None:
    directory = tmp_path / "checkpoints"
    full = _fit(PlainData, tmp_path, [every_step_checkpoints(directory)])
    resumed = _fit(PlainData, tmp_path, ckpt_path=checkpoint_at(directory, 7))
    assert resumed != full[7:]
    epoch_1 = [i for _, _, b in full[5:7] + resumed for i in b]
    assert sorted(epoch_1) != list(range(20)), "samples of the resumed epoch are skipped"


@pytest.mark.parametrize(("model", "trainer_kwargs"), [
    (SteppingModule, {}),
    (RecordingModule, {}),
    (SteppingModule, {"reload_dataloaders_every_n_epochs": 1}),
])
def test_a_resumable_datamodule_resumes_exactly(tmp_path: Path, model, trainer_kwargs) -> None:
    directory = tmp_path / "checkpoints"
    full = _fit(OurData, tmp_path, [every_step_checkpoints(directory)], model=model,
                **trainer_kwargs)
    assert [sorted(i for e, _, b in full if e == epoch for i in b) for epoch in (0, 1)] == [
        list(range(20))] * 2
    for step in (2, 5, 7):
        resumed = _fit(OurData, tmp_path, ckpt_path=checkpoint_at(directory, step), model=model,
                       **trainer_kwargs)
        assert resumed == full[step:], f"resume from step {step}"


class CycledData(ResumableDataModule):
    """Two shuffled members; ``max_size_cycle`` starts the shorter one's next epoch mid-way."""

    def train_dataloader(self) -> CombinedLoader:
        short = DataLoader(IndexDataset(6), batch_size=2, shuffle=True,
                           generator=torch.Generator().manual_seed(5))
        return CombinedLoader({"a": _shuffled(), "b": short}, "max_size_cycle")


@pytest.mark.parametrize("reload", [0, 1])
def test_a_cursor_at_an_epochs_end_is_not_given_to_loaders_reloaded_for_the_next(
        tmp_path: Path, reload: int) -> None:
    """Reloaded for epoch 1, the loaders start afresh in the uninterrupted run; resumed from
    the end of epoch 0 they must too (the cycled member would go on with its own next epoch).
    Kept across epochs, they go on from the cursor. ``ExactResume`` starts the epoch after a
    restart at an epoch's end as usual (Lightning skips its start)."""
    directory = tmp_path / "checkpoints"
    options = {"reload_dataloaders_every_n_epochs": reload}
    full = _fit(CycledData, tmp_path, [ExactResume(), every_step_checkpoints(directory)],
                **options)
    assert len(full) == 10
    for step in (3, 5, 7):
        resumed = _fit(CycledData, tmp_path, [ExactResume()],
                       ckpt_path=checkpoint_at(directory, step), **options)
        assert resumed == full[step:], f"resume from step {step}"


class WebLoaderData(ResumableDataModule):
    """``webdataset.WebLoader``, the loader WebDataset's documentation uses."""

    def __init__(self, urls: list[str]) -> None:
        super().__init__()
        self.urls = urls

    def train_dataloader(self) -> Any:
        import webdataset as wds

        dataset = wds.WebDataset(self.urls, shardshuffle=False).decode().to_tuple("cls")
        return wds.WebLoader(dataset, batch_size=4)


def test_a_webloader_from_a_hook_is_converted_and_resumes_exactly(tmp_path: Path) -> None:
    """A WebLoader is no DataLoader: it passed through unconverted and in silence, and a
    resume after step 3 restarted the epoch ([[0..3], [4..7]] where [[12..15], [16..19]] were
    next)."""
    pytest.importorskip("webdataset")
    from tests.sources.test_webdataset import write_shards

    urls = write_shards(tmp_path / "shards")  # 40 samples: 10 batches of 4 per epoch
    data = functools.partial(WebLoaderData, urls)
    assert isinstance(data().train_dataloader(), ResumableLoader)
    directory = tmp_path / "checkpoints"
    full = _fit(data, tmp_path, [every_step_checkpoints(directory)], model=RecordingModule)
    assert [b for _, _, b in full[3:5]] == [[list(range(12, 16))], [list(range(16, 20))]]
    for step in (3, 7, 14):
        resumed = _fit(data, tmp_path, ckpt_path=checkpoint_at(directory, step),
                       model=RecordingModule)
        assert resumed == full[step:], f"resume from step {step}"


class _Batches:
    """An iterable of batches that is no DataLoader and has no state of its own."""

    def __iter__(self) -> Any:
        return iter([torch.arange(2), torch.arange(2, 4)])


class UnconvertibleData(ResumableDataModule):
    def train_dataloader(self) -> Any:
        return _Batches()

    def val_dataloader(self) -> Any:
        return {"plain": DataLoader(IndexDataset(3)), "other": _Batches()}


def test_a_loader_it_cannot_convert_is_named_in_a_warning() -> None:
    """It reaches the Trainer as it is (a training one restarts its epoch on resume): never in
    silence, and the fix is one that applies inside a ResumableDataModule."""
    data = UnconvertibleData()
    with pytest.warns(UserWarning, match=r"train_dataloader\(\) returned \(_Batches\) that "
                      r"ResumableDataModule cannot make resumable.*a resume restarts its "
                      r"epoch.*ResumableLoader\(dataset, batch_size=\.\.\.\) from "
                      r"train_dataloader\(\)"):
        data.train_dataloader()
    with pytest.warns(UserWarning, match=r"val_dataloader\(\) returned loader 'other' "
                                         r"\(_Batches\)") as caught:
        val = data.val_dataloader()
    assert len(caught) == 1 and "resume" not in str(caught[0].message)
    assert isinstance(val["plain"], ResumableLoader)


def test_what_converts_or_is_no_loader_is_not_warned_about() -> None:
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        data = Structures()  # its val_dataloader returns [0, 1, 2] too
        for hook in (data.train_dataloader, data.val_dataloader, data.test_dataloader,
                     data.predict_dataloader):
            hook()
    assert [str(w.message) for w in caught if "ResumableDataModule" in str(w.message)] == []


# -- real 2-process DDP --------------------------------------------------------------------------

@pytest.fixture(scope="module")
def ddp_run(tmp_path_factory: pytest.TempPathFactory) -> list[dict[str, Any]]:
    root = tmp_path_factory.mktemp("datamodule_ddp")
    return run_ddp(SCRIPT, [str(root)], root / "results", world_size=2)


def test_ddp_resume_from_mid_epoch_is_exact_on_every_rank(ddp_run) -> None:
    for rank in ddp_run:
        assert len(rank["full"]) == ddp.EPOCHS * 3
        for step in ddp.RESUME_STEPS:
            assert rank["resumed"][str(step)] == rank["full"][step:], f"step {step}"


def _epochs(ddp_run, kind: str) -> list[list[int]]:
    """Each epoch's stream: rank 0's then rank 1's share of every global batch."""
    out: list[list[int]] = [[] for _ in range(ddp.EPOCHS)]
    for step0, step1 in zip(ddp_run[0]["full"], ddp_run[1]["full"], strict=True):
        assert step0[:2] == step1[:2]
        out[step0[0]] += step0[2][kind] + step1[2][kind]
    return out


EXACTLY_ONCE = {"sequential", "random", "batch_sampler", "drawn", "drawn_batches", "shuffle"}


def test_ddp_draws_are_the_single_process_draws_split_across_ranks(ddp_run) -> None:
    reference = ddp.train_loaders(DynamicWeightedSampler(np.ones(ddp.N)))
    for kind, loader in reference.items():
        if kind == "dynamic":
            continue
        single = make_resumable(loader, seed=ddp.SEED, rank=0, world_size=1)
        expected = [[i for b in e for i in b]
                    for e in run_epochs(single, range(ddp.EPOCHS), key=indices)]
        streams = _epochs(ddp_run, kind)
        assert streams == expected, kind
        if kind in EXACTLY_ONCE:
            assert all(sorted(s) == list(range(ddp.N)) for s in streams), kind
    assert all(sorted(s) == list(range(1, 20)) for s in _epochs(ddp_run, "subset"))
    assert not {i for s in _epochs(ddp_run, "weighted") for i in s if ddp.WEIGHTS[i] == 0}


def test_ddp_reweighting_is_identical_on_every_rank(ddp_run) -> None:
    """The same draws as one process re-weighting after each global batch."""
    weights = DynamicWeightedSampler(np.ones(ddp.N), num_samples=24)
    single = ResumableLoader(IndexDataset(ddp.N), sampler=weights, batch_size=2 * ddp.BATCH,
                             seed=ddp.SEED, rank=0, world_size=1)
    expected: list[list[int]] = []
    for epoch in range(ddp.EPOCHS):
        set_epoch(single, epoch)
        stream = []
        for batch in single:
            stream += indices(batch)
            ddp.reweigh(weights, batch["index"])
        expected.append(stream)
    assert _epochs(ddp_run, "dynamic") == expected


def test_ddp_validation_sees_every_sample_exactly_once(ddp_run) -> None:
    for epoch in range(ddp.EPOCHS):
        for loader_idx, (n, _) in enumerate(ddp.VAL_SIZES):
            per_rank = [[b for e, d, _, b in rank["val"] if (e, d) == (epoch, loader_idx)]
                        for rank in ddp_run]
            assert len(per_rank[0]) == len(per_rank[1]) > 0
            seen = sorted(i for batches in per_rank for b in batches for i in b)
            assert seen == list(range(n)), (epoch, loader_idx)


def test_ddp_prediction_writers_get_each_batchs_dataset_indices(ddp_run) -> None:
    rows = [row for rank in ddp_run for row in rank["predict"]]
    assert len(ddp_run[0]["predict"]) == len(ddp_run[1]["predict"])
    assert all(batch_indices == prediction for batch_indices, prediction in rows)
    assert sorted(i for batch_indices, _ in rows for i in batch_indices) == list(
        range(ddp.PREDICT_N))


def test_ddp_a_sampler_that_splits_by_rank_itself_is_refused_with_the_data_modules_fix(
        tmp_path: Path) -> None:
    """Its hook's loader is converted whatever ``use_distributed_sampler`` says, so the ranks'
    orders differ and every rank refuses it: the refusal advised
    ``Trainer(use_distributed_sampler=False)``, which was set; it names the data module's fix,
    ``convert`` returning the loader as it is, with which each rank reads it as given (all 11
    samples per epoch) and the warning no longer advises returning a DataLoader."""
    script = REPO / "tests" / "scripts" / "passed_loaders_ddp.py"
    refused = run_ddp(script, ["datamodule-user-shards", str(tmp_path)], tmp_path / "refused")
    for run in refused:
        assert run["error"].startswith("ValueError: the order differs between ranks in epoch 0")
        assert ("a ResumableDataModule converts its hooks' DataLoaders whatever that setting "
                "says: override its convert(loader, stage) to return that one as it is"
                ) in run["error"]
        assert run["seen"] == []
    kept = run_ddp(script, ["datamodule-user-shards-kept", str(tmp_path)], tmp_path / "kept")
    for epoch in range(2):
        seen = {i for run in kept for e, _, b in run["seen"] if e == epoch for i in b}
        assert sorted(seen) == list(range(11)), epoch
    for run in kept:
        [warning] = run["warnings"]
        assert warning.startswith("train_dataloader() returned (DataLoader) that convert() left "
                                  "as it is, with no state_dict()")
