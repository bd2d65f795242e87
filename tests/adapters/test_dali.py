"""DALILoader on real DALI CPU pipelines over generated JPEG files, with a real Trainer and
real 2-process DDP."""

from __future__ import annotations

import functools
import gc
import logging
import sys
import warnings
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import psutil
import pytest
import torch
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DistributedSampler, RandomSampler

pytest.importorskip("nvidia.dali", reason="the pipelines are real DALI ones (nvidia-dali-cuda120)")

from nvidia.dali import fn, pipeline_def  # noqa: E402
from nvidia.dali.types import DALIDataType as DType  # noqa: E402

from lightning_loaders import ResumableLoader, StateMismatchError, sample_rng  # noqa: E402
from lightning_loaders.adapters.dali import DALILoader, FileSamples  # noqa: E402
from lightning_loaders.testing import check_resume_at_every_step, run_epochs, set_epoch  # noqa: E402
from tests.conftest import IndexDataset, ctrl_c_after  # noqa: E402
from tests.ddp_harness import REPO, run_ddp  # noqa: E402
from tests.lightning_harness import (  # noqa: E402
    check_trainer_resume,
    checkpoint_at,
    evaluate_recording,
    every_step_checkpoints,
    fit_recording,
    make_trainer,
)
from tests.scripts.dali_common import (  # noqa: E402
    key,
    make_loader,
    read_files,
    read_source,
    reader_pipeline,
    source_pipeline,
    write_jpegs,
)

N = 41  # over 2 shards: 20 and 21 samples
MODES = ["reader", "source"]


@pytest.fixture(scope="module")
def jpeg_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    directory = tmp_path_factory.mktemp("jpegs")
    write_jpegs(directory, N)
    return directory


@pytest.fixture(scope="module")
def files(jpeg_dir: Path) -> list[str]:
    return sorted(str(p) for p in jpeg_dir.glob("*.jpg"))


def labels(batches: list[Any]) -> list[int]:
    return [i for labels_, _ in batches for i in labels_]


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("last_batch", ["keep", "drop", "pad"])
def test_resume_at_every_step_is_exact_including_augmentations(files, mode, last_batch):
    def make() -> DALILoader:
        return make_loader(mode, files, 8, last_batch=last_batch)

    full = check_resume_at_every_step(make, epochs=3, key=key)
    expected_len = {"keep": 6, "drop": 5, "pad": 6}[last_batch]
    assert [len(epoch) for epoch in full] == [expected_len] * 3 == [len(make())] * 3
    per_epoch = [labels(epoch) for epoch in full]
    if last_batch == "keep":
        assert all(sorted(epoch) == list(range(N)) for epoch in per_epoch)
    if last_batch == "drop":
        assert all(len(set(epoch)) == len(epoch) == 40 for epoch in per_epoch)
    if last_batch == "pad":
        assert all(set(epoch) == set(range(N)) and len(epoch) == 48 for epoch in per_epoch)
    assert per_epoch[0] != per_epoch[1], "every epoch must have its own shuffle"


@pytest.mark.parametrize("mode", MODES)
def test_trainer_checkpoint_at_every_step_resumes_exactly(files, tmp_path, mode, caplog):
    # 21 files in batches of 8: three steps per epoch, the last one short. Batches are compared
    # pixel for pixel.
    def make() -> DALILoader:
        return make_loader(mode, files[:21], 8)

    with caplog.at_level(logging.WARNING):
        full = check_trainer_resume(make, tmp_path, max_epochs=3)
    assert [r.getMessage() for r in caplog.records if "nvidia" in r.pathname] == []
    assert [(epoch, batch) for epoch, batch, _ in full] == [(e, b) for e in range(3)
                                                             for b in range(3)]
    assert [len(batch["y"]) for _, _, batch in full] == [8, 8, 5] * 3


def test_augmentations_continue_after_close_and_start_each_epoch_from_the_seed(files):
    """External-source mode: ``close()`` (Lightning's teardown) keeps the pipeline's DALI
    checkpoint for the state and for an iterator going on; an epoch's augmentations are the
    same whether this loader or a fresh one (a reload, a restart at an epoch's end) reads it."""

    def make() -> DALILoader:
        return make_loader("source", files[:21], 8)

    uninterrupted = make()
    epochs = [[key(batch) for batch in uninterrupted] for _ in range(2)]
    closed = make()
    iterator = iter(closed)
    first = [key(next(iterator))]
    closed.close()
    state = closed.state_dict()
    assert first + [key(batch) for batch in iterator] == epochs[0]
    resumed = make()
    resumed.load_state_dict(state)
    assert first + [key(batch) for batch in resumed] == epochs[0]
    fresh = make()
    fresh.set_epoch(1)
    assert [key(batch) for batch in fresh] == epochs[1]


@pytest.mark.parametrize("mode", MODES)
def test_validate_test_and_predict_read_every_sample_once(files, tmp_path, mode):
    """Lightning's evaluation loops read DataLoader's ``batch_sampler``."""
    evaluated = evaluate_recording(lambda: make_loader(mode, files[:21], 8), tmp_path,
                                   key=lambda batch: key(batch)[0])
    for stage, batches in evaluated.items():
        assert sorted(i for batch in batches for i in batch) == list(range(21)), stage


@pytest.mark.parametrize("mode", MODES)
@pytest.mark.parametrize("last_batch", ["keep", "drop", "pad"])
def test_ranks_get_equal_batch_counts_and_disjoint_shards(files, mode, last_batch):
    """Reader mode drops only over shards of one size (refused otherwise, above)."""
    data = files[:40] if (mode, last_batch) == ("reader", "drop") else files
    ranks = [run_epochs(make_loader(mode, data, 6, last_batch=last_batch, rank=r,
                                    world_size=2), range(3), key=key) for r in range(2)]
    for epoch in range(3):
        counts = [len(rank[epoch]) for rank in ranks]
        assert counts[0] == counts[1] == len(make_loader(mode, data, 6, last_batch=last_batch,
                                                         rank=1, world_size=2)) > 0
        seen = labels(ranks[0][epoch]) + labels(ranks[1][epoch])
        if last_batch == "keep":
            assert sorted(seen) == list(range(len(data)))
        if last_batch == "drop":
            assert len(set(seen)) == len(seen) == 2 * 6 * counts[0]


@pytest.mark.parametrize("mode", MODES)
def test_trainer_gives_placement_and_epochs_in_order(files, tmp_path, mode):
    calls: list[tuple[str, int, int]] = []

    @pipeline_def
    def recording(shard_id: int, num_shards: int, device: str, source: Any = None) -> Any:
        calls.append((device, shard_id, num_shards))
        if source is None:
            return read_files(files, shard_id, num_shards, device)
        return read_source(source, device)

    class Module(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))
            self.seen: list[tuple[int, list[int]]] = []
            self.lengths: list[int] = []

        def train_dataloader(self) -> DALILoader:
            kwargs: dict[str, Any] = {"reader_name": "Reader"} if mode == "reader" else {
                "dataset": FileSamples(files), "shuffle": True}
            loader = DALILoader(recording, ["x", "y"], batch_size=8, num_threads=1,
                                trainer=self.trainer, batch_format="tuple", **kwargs)
            self.lengths.append(len(loader))
            return loader

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            x, y = batch
            self.seen.append((self.current_epoch, y.flatten().tolist()))
            return (self.weight - x.mean()).pow(2)

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    module = Module()
    make_trainer(tmp_path, max_epochs=2).fit(module)
    assert set(calls) == {("cpu", 0, 1)}
    assert module.lengths == [6]
    for epoch in range(2):
        seen = [i for e, batch in module.seen if e == epoch for i in batch]
        assert sorted(seen) == list(range(N))


DDP_RESUME_STEPS = [2, 4, 7]  # mid epoch 0, end of epoch 0, mid epoch 1 (4 batches per epoch)


@pytest.fixture(scope="module")
def ddp_runs(jpeg_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """One real 2-rank gloo DDP run of ``tests/scripts/dali_ddp.py``: its directory, and what
    each rank reported."""
    root = tmp_path_factory.mktemp("dali_ddp")
    results = run_ddp(REPO / "tests/scripts/dali_ddp.py",
                      ["--files", str(jpeg_dir), "--root", str(root), "--resume-steps",
                       *map(str, DDP_RESUME_STEPS)], root / "results")
    return root, results


def test_ddp_two_ranks_cover_each_epoch_once_and_resume_exactly(ddp_runs):
    root, results = ddp_runs
    steps = DDP_RESUME_STEPS
    for mode in MODES:
        ranks = [r[mode] for r in results]
        assert ranks[0]["len"] == ranks[1]["len"] == 4
        for epoch in range(2):
            per_rank = [[tuple(k[0]) for e, _, k in r["full"] if e == epoch] for r in ranks]
            assert len(per_rank[0]) == len(per_rank[1]) == 4
            everything = [i for rank in per_rank for batch in rank for i in batch]
            assert sorted(everything) == list(range(N)), f"{mode}: epoch {epoch} not exact"
        for rank in ranks:
            for step in steps:
                assert rank["resumed"][str(step)] == rank["full"][step:], (mode, step)
        saved = torch.load(root / mode / "step=2.ckpt", weights_only=False)
        entries = _dali_entries(saved)
        assert len(entries) == 2 and all(e is not None for e in entries)
        assert entries[0]["checkpoint"] != entries[1]["checkpoint"]


def test_ddp_plans_that_differ_between_ranks_are_refused_in_lightnings_loops(ddp_runs):
    """Each rank shards its own plan: read through Lightning's data fetcher, the ranks compare
    it at every epoch start and refuse, on every rank and showing each rank's value, a seed or
    a file list of another length on one rank, in external-source mode and in reader mode
    (where the length is the reader's epoch size: a reader given fewer files on one rank).
    Before, they read on: a seed per rank repeated 12 and lost 12 of 41 samples in
    epoch 0; 40 files on rank 1 repeated one sample and lost one, and a reader of 39 files
    repeated one and lost two."""
    length = ("ValueError: the order's length (the sampler's len(), else the dataset's) differs "
              "between ranks")
    refused = {
        "source-seed-per-rank": "ValueError: the loader's seed differs between ranks (7 on rank "
                                "0, 8 on rank 1)",
        "source-files-per-rank": f"{length} (41 on rank 0, 40 on rank 1)",
        "reader-files-per-rank": f"{length} (41 on rank 0, 39 on rank 1)",
    }
    for rank in ddp_runs[1]:
        for case, start in refused.items():
            assert rank["differing"][case].get("error", "").startswith(start), (case, rank)


def _dali_entries(tree: Any) -> Any:
    """The gathered DALI entries inside a Lightning checkpoint."""
    if isinstance(tree, dict):
        if "dali" in tree and isinstance(tree["dali"], list):
            return tree["dali"]
        for value in tree.values():
            found = _dali_entries(value)
            if found is not None:
                return found
    if isinstance(tree, list):
        for value in tree:
            found = _dali_entries(value)
            if found is not None:
                return found
    return None


def test_reader_mode_refuses_another_world_size(files):
    loader = make_loader("reader", files, 6, rank=0, world_size=2)
    next(iter(loader))
    state = loader.state_dict()
    resumed = make_loader("reader", files, 6, rank=0, world_size=1)
    resumed.load_state_dict(state)
    for _ in range(2):  # a retry is refused too, never a half-applied resume
        with pytest.raises(ValueError, match="saved 2, now 1"):
            next(iter(resumed))


def test_a_state_leaving_out_batches_taken_is_refused(files):
    """``state_dict(unused=n)`` (``ExactResume`` inside a step, for this package's own
    loaders) cannot rewind a DALI checkpoint: refused, naming why, never a state one ahead."""
    loader = make_loader("reader", files, 6)
    next(iter(loader))
    with pytest.raises(ValueError, match="cannot leave out batches already taken"):
        loader.state_dict(unused=1)
    assert loader.state_dict()["batches"] == 1


@pytest.mark.parametrize("mode", MODES)
def test_a_state_of_another_seed_is_refused_at_load_and_changes_nothing(files, mode):
    """In reader mode too, where checking it builds the pipeline (as ``len()`` does)."""
    loader = make_loader(mode, files[:21], 8)
    expected = [key(batch) for batch in loader]
    other = make_loader(mode, files[:21], 8, seed=8)
    next(iter(other))
    state = other.state_dict()
    with pytest.raises(StateMismatchError, match="seed: saved 8, this loader 7"):
        loader.load_state_dict(state)
    fresh = make_loader(mode, files[:21], 8)
    with pytest.raises(StateMismatchError):
        fresh.load_state_dict(state)
    assert [key(batch) for batch in fresh] == expected


@pytest.mark.parametrize("mode", MODES)
def test_set_epoch_before_a_restored_epoch_end_starts_the_next_epoch(files, mode):
    """The order of the calls counts (declared before the restore: the next epoch begins),
    also when both come before reader mode has sized the pipeline."""
    ended = make_loader(mode, files[:21], 8)
    ended.set_epoch(1)
    epoch_one = [key(batch) for batch in ended]
    state = ended.state_dict()
    resumed = make_loader(mode, files[:21], 8)
    resumed.set_epoch(1)
    resumed.load_state_dict(state)
    epoch_two = [key(batch) for batch in resumed]
    assert resumed.epoch == 2 and len(epoch_two) == len(epoch_one) == 3


@pytest.mark.parametrize(("old_world", "new_world"), [(2, 1), (1, 2)])
def test_external_source_mode_resumes_elastically(files, old_world, new_world):
    consumed, state = [], None
    for rank in range(old_world):
        loader = make_loader("source", files, 4, rank=rank, world_size=old_world)
        iterator = iter(loader)
        for _ in range(2):
            consumed += key(next(iterator))[0]
        state = loader.state_dict()
    rest = []
    for rank in range(new_world):
        loader = make_loader("source", files, 4, rank=rank, world_size=new_world)
        loader.load_state_dict(state)
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # past-len warning of an elastic resume
            rest += labels([key(b) for b in loader])
    assert sorted(consumed + rest) == list(range(N))


@pytest.mark.parametrize("mode", MODES)
def test_epochs_follow_the_trainer_without_dali_reset_warnings(files, mode, caplog):
    # Reader mode reads an abandoned epoch's tail past, so even augmentations match the
    # uninterrupted run; external-source mode rebuilds its pipeline at the trainer's epoch,
    # which restarts DALI's random operators: there the samples match.
    def make() -> DALILoader:
        return make_loader(mode, files, 8)

    def what(batch: Any) -> Any:
        return key(batch) if mode == "reader" else key(batch)[0]

    expected = run_epochs(make(), range(5), key=what)
    loader = make()
    with caplog.at_level(logging.WARNING), warnings.catch_warnings():
        warnings.simplefilter("error")
        partial = iter(loader)
        assert what(next(partial)) == expected[0][0]
        set_epoch(loader, 1)  # limit_train_batches: epoch 0's tail is abandoned
        assert [what(b) for b in loader] == expected[1]
        set_epoch(loader, 3)  # an epoch is skipped
        assert [what(b) for b in loader] == expected[3]
        resumed = make()
        resumed.load_state_dict(loader.state_dict())
        set_epoch(resumed, 0)  # a stale epoch from a restarted trainer
        assert [what(b) for b in resumed] == expected[4]
    assert [r.getMessage() for r in caplog.records if r.levelno >= logging.WARNING] == []
    with pytest.raises(RuntimeError, match="newer iter"):
        next(partial)


def test_iter_is_cheap_and_a_dropped_loader_stops_its_pipeline(files):
    me = psutil.Process()
    gc.collect()
    before = set(me.children())

    def started() -> int:
        return len(set(me.children()) - before)

    loader = make_loader("source", files, 4, py_num_workers=2)
    for _ in range(3):
        iter(loader)
    assert loader._engine.engine is None and started() == 0
    iterator = iter(loader)
    next(iterator)
    assert started() == 2
    loader.close()
    assert started() == 0
    second = make_loader("source", files, 4, py_num_workers=2)
    iterator = iter(second)
    next(iterator)
    assert started() == 2
    del second, iterator
    assert started() == 0, "the source workers must stop with the loader, not at a later gc"
    reader = make_loader("reader", files, 4)
    iter(reader)
    assert reader._engine.engine is None
    assert len(reader) == 11  # sizing a reader builds its pipeline
    assert reader._engine.engine is not None


class _Collecting(FileSamples):
    """Runs the garbage collector in the source worker before every sample."""

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        gc.collect()
        return super().__getitem__(index)


@pytest.mark.parametrize("mode", MODES)
def test_a_source_worker_never_finalizes_pipelines_it_inherited(files, mode):
    # A finished Trainer keeps its loader in a reference cycle: garbage with a live pipeline.
    old = make_loader(mode, files, 4)
    next(iter(old))
    cycle: list[Any] = [old]
    cycle.append(cycle)
    del old, cycle
    gc.disable()
    try:
        loader = DALILoader(source_pipeline, ["x", "y"], batch_size=4, num_threads=1,
                            dataset=_Collecting(files))
        assert sorted(labels([key(b) for b in loader])) == list(range(N))
    finally:
        gc.enable()


def test_set_epoch_on_the_users_own_sampler_chooses_the_epoch(files):
    """The DDP loop tells its own ``DistributedSampler`` the epoch: a restart at epoch 2 reads
    epoch 2, not epoch 0 again."""
    def ddp_loop(epochs: range) -> list[list[int]]:
        samples = FileSamples(files[:12])
        sampler = DistributedSampler(samples, num_replicas=1, rank=0)
        loader = DALILoader(source_pipeline, ["x", "y"], batch_size=4, num_threads=1,
                            dataset=samples, sampler=sampler, seed=7)
        out = []
        for epoch in epochs:
            sampler.set_epoch(epoch)
            out.append(labels([key(b) for b in loader]))
        return out

    full = ddp_loop(range(3))
    assert full[2] != full[0] and ddp_loop(range(2, 3)) == full[2:]


def test_tuple_batches_and_a_trimmed_last_batch(files):
    loader = make_loader("source", files, 6, batch_format="tuple")
    batches = list(loader)
    assert all(isinstance(b, tuple) and len(b) == 2 for b in batches)
    assert [len(b[1]) for b in batches] == [6] * 6 + [5] == [len(b[0]) for b in batches]
    assert batches[0][0].shape == (6, 3, 16, 16) and batches[0][0].dtype == torch.float32


class _WithDraws(FileSamples):
    """Adds a per-sample random draw from the core's ``sample_rng`` (seeded by position)."""

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        _, label = super().__getitem__(index)
        return label, np.array(sample_rng().integers(1 << 30), dtype=np.int64)


@pipeline_def
def _draws_pipeline(source: Any) -> Any:
    return tuple(fn.external_source(source=source, num_outputs=2, batch=False, parallel=True,
                                    dtype=[DType.INT64, DType.INT64]))


def test_external_source_samples_see_the_core_sample_context(files):
    runs = []
    for workers in (1, 2):
        loader = DALILoader(_draws_pipeline, ["y", "draw"], batch_size=5, num_threads=1,
                            dataset=_WithDraws(files), sampler=RandomSampler(range(N)), seed=3,
                            py_num_workers=workers)
        runs.append([(b["y"].tolist(), b["draw"].tolist()) for b in loader])
    assert runs[0] == runs[1]
    draws = [d for _, batch in runs[0] for d in batch]
    assert len(set(draws)) == N


@pipeline_def
def _unsharded(files: list[str]) -> Any:
    """A reader that ignores the shard the loader gives."""
    return read_files(files, 0, 1, "cpu")


@pytest.mark.parametrize(
    ("build", "match"),
    [
        (lambda f: DALILoader(functools.partial(reader_pipeline, files=f, pad=False), ["x", "y"],
                              batch_size=6, reader_name="Reader"), "pad_last_batch"),
        (lambda f: DALILoader(functools.partial(reader_pipeline, files=f), ["x", "y"],
                              batch_size=6, reader_name="Other"), "no reader named 'Other'"),
        (lambda f: DALILoader(functools.partial(_unsharded, files=f), ["x", "y"], batch_size=6,
                              reader_name="Reader", rank=1, world_size=2),
         "shard_id=0, num_shards=1 but this is rank 1"),
        (lambda f: make_loader("reader", f[:37], 6, rank=0, world_size=2), "empty batch"),
        (lambda f: make_loader("reader", f[:37], 6, last_batch="drop", rank=0, world_size=2),
         "needs shards of one size"),
        (lambda f: make_loader("source", f, 30, last_batch="drop", rank=0, world_size=2),
         "smaller batch_size"),
    ],
)
def test_settings_that_break_equal_batches_fail_with_a_fix(files, build, match):
    with pytest.raises(ValueError, match=match):
        len(build(files))


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({}, "exactly one of reader_name"),
        ({"reader_name": "Reader", "dataset": [1]}, "exactly one of reader_name"),
        ({"reader_name": "Reader", "shuffle": True}, "external-source mode"),
        ({"reader_name": "Reader", "last_batch": "rollover"}, "last_batch"),
        ({"reader_name": "Reader", "batch_format": "list"}, "batch_format"),
        ({"reader_name": "Reader", "batch_size": 0}, "batch_size"),
    ],
)
def test_impossible_settings_fail_at_construction(kwargs, match):
    options = {"batch_size": 4, **kwargs}
    with pytest.raises(ValueError, match=match):
        DALILoader(reader_pipeline, ["x", "y"], **options)


def test_a_factory_must_return_a_checkpointable_pipeline(files):
    def factory(batch_size: int, shard_id: int) -> Any:
        return "not a pipeline"

    with pytest.raises(TypeError, match="must return a DALI Pipeline"):
        next(iter(DALILoader(factory, ["x"], batch_size=4, dataset=FileSamples(files))))


def test_missing_dali_names_the_extra_to_install(monkeypatch):
    monkeypatch.setitem(sys.modules, "nvidia.dali", None)
    with pytest.raises(ImportError, match=r"lightning-loaders\[dali\]"):
        DALILoader(reader_pipeline, ["x", "y"], batch_size=4, reader_name="Reader")


@pytest.mark.parametrize("mode", MODES)
def test_a_dali_member_of_a_max_size_combined_loader_stays_finished(files, tmp_path, mode):
    """``CombinedLoader(mode="max_size")``: the DALI member (2 batches) ends before the
    longer ``ResumableLoader`` and stays finished after a resume at or past its end."""
    def make() -> CombinedLoader:
        return CombinedLoader({
            "a": ResumableLoader(IndexDataset(10), batch_size=2, shuffle=True, seed=1),
            "b": make_loader(mode, files[:16], 8),
        }, mode="max_size")

    full = check_trainer_resume(make, tmp_path, max_epochs=2)
    assert [step[2]["b"] is None for step in full] == [False] * 2 + [True] * 3 + [False] * 2 + [
        True] * 3
    chained = tmp_path / "chained"  # a checkpoint written while the member stays finished
    fit_recording(make, tmp_path, 2, [every_step_checkpoints(chained)],
                  ckpt_path=checkpoint_at(tmp_path / "checkpoints", 2))
    assert fit_recording(make, tmp_path, 2, ckpt_path=checkpoint_at(chained, 3)) == full[3:]


@pytest.mark.parametrize("mode", MODES)
def test_a_ctrl_c_after_the_count_reads_the_same_batch_again(files, mode, monkeypatch):
    """A ``next()`` that raises after counting its batch takes the count back and reopens the
    pipeline at the cursor: the batch read again is the one taken back, augmentations
    included, whether the same iterator goes on or a state saved then resumes."""

    def make() -> DALILoader:
        return make_loader(mode, files[:21], 4)

    reference = [key(batch) for batch in make()]
    loader = make()
    iterator = iter(loader)
    got = [key(next(iterator)), key(next(iterator))]
    ctrl_c_after(monkeypatch, loader.schedule, "delivered")
    with pytest.raises(KeyboardInterrupt):
        next(iterator)
    state = loader.state_dict()
    assert state["batches"] == 2
    resumed = make()
    resumed.load_state_dict(state)
    assert got + [key(batch) for batch in resumed] == reference
    assert got + [key(batch) for batch in iterator] == reference
