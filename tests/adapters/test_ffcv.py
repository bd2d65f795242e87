"""FFCVLoader on real .beton files and FFCV Loaders (CPU), real Trainers and real 2-rank DDP."""

from __future__ import annotations

import gc
import os
import subprocess
import sys
import threading
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("ffcv")

from ffcv.fields.decoders import IntDecoder, SimpleRGBImageDecoder  # noqa: E402
from ffcv.loader import OrderOption  # noqa: E402
from ffcv.loader.epoch_iterator import EpochIterator  # noqa: E402
from ffcv.transforms import ToDevice, ToTensor  # noqa: E402
from lightning.pytorch.utilities import CombinedLoader  # noqa: E402

from lightning_loaders import LastBatch, ResumableLoader  # noqa: E402
from lightning_loaders.adapters.ffcv import FFCV_INSTALL_HINT, FFCVLoader, require_ffcv  # noqa: E402
from lightning_loaders.adapters.ffcv.beton import write_beton  # noqa: E402
from lightning_loaders.adapters.ffcv.loader import _device_pipelines  # noqa: E402
from lightning_loaders.testing import check_resume_at_every_step, run_epochs, set_epoch  # noqa: E402
from tests.conftest import IndexDataset  # noqa: E402
from tests.ddp_harness import REPO, run_ddp  # noqa: E402
from tests.lightning_harness import (  # noqa: E402
    RecordingModule,
    check_trainer_resume,
    checkpoint_at,
    evaluate_recording,
    fit_recording,
)
from tests.scripts.ffcv_fit import PIXEL_MODULUS, labels_key  # noqa: E402

N = 41  # with 2 ranks and batch_size 4 (or 5) one sample is left over: the short-tail case
LABELS_ONLY = {"image": None}


class _Images:
    """Sample ``i`` of ``n``: a 16x16 RGB image filled with ``i % 251``, and the label ``i``."""

    def __init__(self, n: int = N) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[np.ndarray, int]:
        return np.full((16, 16, 3), index % PIXEL_MODULUS, dtype=np.uint8), index


@pytest.fixture(scope="module")
def beton(tmp_path_factory: pytest.TempPathFactory) -> Path:
    path = tmp_path_factory.mktemp("ffcv") / "images.beton"
    return write_beton(path, _Images(), ["image", "label"], num_workers=1, progress=False)


def labels(batch: tuple[torch.Tensor, ...]) -> list[int]:
    return batch[-1].ravel().tolist()


def core_batches(world: int, rank: int, batch_size: int, policy: LastBatch, epochs: int,
                 seed: int = 11) -> list[list[list[int]]]:
    """What the core loader's plan gives this rank (the reference order)."""
    loader = ResumableLoader(IndexDataset(N), batch_size=batch_size, shuffle=True, seed=seed,
                             last_batch=policy, rank=rank, world_size=world)
    return run_epochs(loader, range(epochs), key=lambda b: b["index"].tolist())


@pytest.mark.parametrize(("world", "batch_size", "policy"),
                         [(2, 4, "keep"), (2, 5, "keep"), (3, 4, "pad"), (2, 4, "drop"),
                          (1, 4, "rollover")])
def test_batches_are_the_plans_on_every_rank(beton: Path, world: int, batch_size: int,
                                             policy: LastBatch) -> None:
    per_rank = []
    for rank in range(world):
        loader = FFCVLoader(beton, batch_size=batch_size, num_workers=1, order="random",
                            seed=11, last_batch=policy, rank=rank, world_size=world,
                            pipelines=LABELS_ONLY)
        got = run_epochs(loader, range(2), key=labels)
        assert got == core_batches(world, rank, batch_size, policy, 2)
        if policy != "rollover":
            assert all(len(epoch) == len(loader) for epoch in got)
        per_rank.append(got)
        loader.close()
    for epoch in range(2):
        assert len({len(rank[epoch]) for rank in per_rank}) == 1, "unequal batch counts"
        seen = sorted(i for rank in per_rank for batch in rank[epoch] for i in batch)
        if policy == "keep":
            assert seen == list(range(N)), "keep must read every sample exactly once"


def test_rank_comes_from_the_environment_without_a_process_group(
        beton: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "1")
    loader = FFCVLoader(beton, batch_size=4, num_workers=1, order="random", seed=11,
                        pipelines=LABELS_ONLY)
    assert len(loader) == 6 and not torch.distributed.is_initialized()
    assert [labels(b) for b in loader] == core_batches(2, 1, 4, "keep", 1)[0]
    assert loader.state_dict()["world_size"] == 2


def test_resume_at_every_step_with_two_ffcv_workers(beton: Path) -> None:
    def make() -> FFCVLoader:
        return FFCVLoader(beton, batch_size=14, num_workers=2, order=OrderOption.RANDOM,
                          seed=3, pipelines=LABELS_ONLY)

    full = check_resume_at_every_step(make, epochs=3, key=labels)
    assert all(sorted(i for b in epoch for i in b) == list(range(N)) for epoch in full)
    assert full[0] != full[1] != full[2], "every epoch needs its own shuffle"


def test_resume_at_every_step_on_a_rank_with_a_rebalanced_tail(beton: Path) -> None:
    def make() -> FFCVLoader:
        return FFCVLoader(beton, batch_size=5, num_workers=2, order="random", seed=3,
                          rank=1, world_size=2, pipelines=LABELS_ONLY)

    full = check_resume_at_every_step(make, epochs=1, key=labels)
    assert [len(b) for b in full[0]] == [5, 5, 5, 4, 1]


def test_iter_is_free_and_does_not_burn_an_epoch(beton: Path) -> None:
    loader = FFCVLoader(beton, batch_size=8, num_workers=1, order="random", seed=3,
                        pipelines=LABELS_ONLY)
    for _ in range(3):
        iter(loader)  # what Lightning's _check_dataloader_iterable does
    assert loader._ffcv_loader is None and loader.epoch is None
    expected = core_batches(1, 0, 8, "keep", 6, seed=3)
    assert run_epochs(loader, range(2), key=labels) == expected[:2]
    set_epoch(loader, 5)
    assert [labels(b) for b in loader] == expected[5]


def test_a_replaced_iterator_fails_and_its_ffcv_thread_stops(beton: Path) -> None:
    loader = FFCVLoader(beton, batch_size=4, num_workers=1, pipelines=LABELS_ONLY,
                        batches_ahead=1)
    old = iter(loader)
    assert labels(next(old)) == [0, 1, 2, 3]
    new = iter(loader)
    assert labels(next(new)) == [0, 1, 2, 3] and loader.epoch == 1, "a new iter() starts the "\
        "next epoch, as in the core loader"
    with pytest.raises(RuntimeError, match="replaced by a newer iter"):
        next(old)
    loader.close()
    assert _epoch_threads() == []
    dropped = FFCVLoader(beton, batch_size=4, num_workers=1, pipelines=LABELS_ONLY,
                         batches_ahead=1)
    next(iter(dropped))  # FFCV has now read ahead of the consumer
    del dropped
    gc.collect()
    assert _epoch_threads() == [], "a collected loader stops its FFCV thread"


def _epoch_threads() -> list[threading.Thread]:
    return [t for t in threading.enumerate() if isinstance(t, EpochIterator) and t.is_alive()]


def test_batches_outlive_the_step_unless_copy_is_off(beton: Path) -> None:
    kept = {}
    for copy in (True, False):
        loader = FFCVLoader(beton, batch_size=4, num_workers=1, batches_ahead=1, copy=copy)
        batches = list(loader)
        kept[copy] = [labels(b) for b in batches]
        loader.close()
    assert kept[True] == [list(range(i, min(i + 4, N))) for i in range(0, N, 4)]
    # FFCV refills a ring of batches_ahead + 2 = 3 output slots: zero-copy batches are reused
    assert kept[False] != kept[True]


def test_images_follow_the_plan_to_the_trainers_device(beton: Path) -> None:
    """Rank 1 of 2 gets batches of 4, 4, 4, 4, 3, 1: FFCV reads the 3 padded, we cut it."""
    import lightning as L

    trainer = L.Trainer(accelerator="cpu", devices=1, logger=False)
    pipelines = {"image": [SimpleRGBImageDecoder(), ToTensor(), ToDevice(torch.device("cuda", 0))],
                 "label": [IntDecoder(), ToTensor()]}
    loader = FFCVLoader(beton, batch_size=4, num_workers=2, order="random", seed=11, rank=1,
                        world_size=2, pipelines=pipelines, trainer=trainer)
    batches = list(loader)
    assert all(loader.device == trainer.strategy.root_device == value.device
               for batch in batches for value in batch)
    keys = [labels_key(batch) for batch in batches]  # checks every image against its label
    assert [len(b) for b in keys] == [4, 4, 4, 4, 3, 1]
    assert keys == core_batches(2, 1, 4, "keep", 1)[0]
    assert isinstance(pipelines["image"][2], ToDevice) and len(pipelines["image"]) == 3, (
        "the user's pipelines must not be modified")
    loader.close()


def test_device_pipelines_replace_and_append_todevice() -> None:
    gpu = torch.device("cuda", 1)
    user = {"image": [SimpleRGBImageDecoder(), ToTensor(), ToDevice(torch.device("cuda", 0),
                                                                    non_blocking=False)],
            "label": [IntDecoder(), ToTensor()], "raw": [IntDecoder()], "off": None}
    placed = _device_pipelines(user, ["image", "label", "raw", "off", "extra"], gpu)
    assert placed["image"][2].device == gpu and placed["image"][2].non_blocking is False
    assert isinstance(placed["label"][-1], ToDevice) and placed["label"][-1].device == gpu
    assert len(placed["raw"]) == 1, "a numpy pipeline stays on the host"
    assert placed["off"] is None
    assert [type(op) for op in placed["extra"]] == [ToTensor, ToDevice]
    on_cpu = _device_pipelines(user, ["image", "label", "raw", "off", "extra"],
                               torch.device("cpu"))
    assert on_cpu["image"][2].device == torch.device("cpu") and "extra" not in on_cpu
    assert len(on_cpu["label"]) == 2


def test_state_is_rank_independent_and_resumes_on_another_world_size(beton: Path) -> None:
    def make(rank: int, world: int) -> FFCVLoader:
        return FFCVLoader(beton, batch_size=4, num_workers=1, order="random", seed=5,
                          rank=rank, world_size=world, pipelines=LABELS_ONLY)

    consumed, states = [], []
    for rank in range(2):
        loader = make(rank, 2)
        it = iter(loader)
        consumed += [i for _ in range(3) for i in labels(next(it))]
        states.append(loader.state_dict())
        loader.close()
    audits = [state["parts"].pop("audit") for state in states]
    assert states[0] == states[1], "the cursor is the same on every rank"
    assert [audit["rank"] for audit in audits] == [0, 1], "the audit digest is each rank's"
    states[0]["parts"]["audit"] = audits[0]
    single = make(0, 1)
    single.load_state_dict(states[0])
    rest = [i for batch in single for i in labels(batch)]
    assert sorted(consumed + rest) == list(range(N)), "each sample exactly once in the epoch"
    assert single.epoch == 0


def test_subset_indices_and_sequential_order(beton: Path) -> None:
    subset = [40, 3, 17, 8, 9, 22, 0]
    loader = FFCVLoader(beton, batch_size=3, num_workers=1, indices=subset,
                        pipelines=LABELS_ONLY)
    assert [labels(b) for b in loader] == [[40, 3, 17], [8, 9, 22], [0]]
    assert len(loader) == 3
    other = FFCVLoader(beton, batch_size=3, num_workers=1, indices=subset[::-1],
                       pipelines=LABELS_ONLY)
    with pytest.raises(ValueError, match="order"):
        other.load_state_dict(loader.state_dict())


def test_bad_arguments_are_refused_with_both_values(beton: Path, tmp_path: Path) -> None:
    with pytest.raises(FileNotFoundError):
        FFCVLoader(tmp_path / "missing.beton", batch_size=4)
    with pytest.raises(ValueError, match="'labels'.*fields: \\['image', 'label'\\]"):
        FFCVLoader(beton, batch_size=4, pipelines={"labels": [IntDecoder()]})
    with pytest.raises(ValueError, match="QUASI_RANDOM"):
        FFCVLoader(beton, batch_size=4, order=OrderOption.QUASI_RANDOM)
    with pytest.raises(TypeError, match="TraversalOrder"):
        FFCVLoader(beton, batch_size=4, order=object())
    with pytest.raises(ValueError, match="41 samples"):
        FFCVLoader(beton, batch_size=4, indices=[0, 41])
    with pytest.raises(ValueError, match="rank=0, world_size=2"):
        FFCVLoader(beton, batch_size=4, distributed=False, rank=0, world_size=2)
    with pytest.raises(ValueError, match="drop_last=True contradicts"):
        FFCVLoader(beton, batch_size=4, drop_last=True, last_batch="pad")
    with pytest.raises(ValueError, match="batch_size"):
        FFCVLoader(beton, batch_size=0)
    too_many = os.cpu_count() or 1  # numba's NUMBA_NUM_THREADS; it used to fail at the 1st batch
    with pytest.raises(ValueError, match=f"num_workers={too_many + 1} is more than the "
                                         f"{too_many} threads"):
        FFCVLoader(beton, batch_size=4, num_workers=too_many + 1)


def test_missing_ffcv_gives_the_install_hint(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setitem(sys.modules, "ffcv", None)
    with pytest.raises(ImportError) as info:
        require_ffcv()
    assert FFCV_INSTALL_HINT in str(info.value)
    assert "libturbojpeg0-dev libopencv-dev pkg-config" in str(info.value)


def test_importing_the_adapter_does_not_import_ffcv() -> None:
    code = ("import sys, lightning_loaders.adapters.ffcv, lightning_loaders.adapters.ffcv.beton; "
            "print('ffcv' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         cwd=REPO, check=True)
    assert out.stdout.strip() == "False"


def test_trainer_resume_from_every_step_of_three_epochs(beton: Path, tmp_path: Path) -> None:
    def make() -> FFCVLoader:
        return FFCVLoader(beton, batch_size=21, num_workers=2, order="random", seed=11)

    full = check_trainer_resume(make, tmp_path, max_epochs=3)
    epochs = [[i for e, _, (_, batch) in full if e == epoch for i in np.ravel(batch)]
              for epoch in range(3)]
    reference = core_batches(1, 0, 21, "keep", 3)
    assert epochs == [[i for b in epoch for i in b] for epoch in reference], (
        "epoch 0 must be the plan's epoch 0 (not skipped by Lightning's extra iter())")


def test_validate_test_and_predict_read_every_sample_once(beton: Path, tmp_path: Path) -> None:
    """Lightning's evaluation loops read DataLoader's ``batch_sampler``."""
    evaluated = evaluate_recording(
        lambda: FFCVLoader(beton, batch_size=8, num_workers=2, order="sequential"), tmp_path,
        key=labels)
    for stage, batches in evaluated.items():
        assert [i for batch in batches for i in batch] == list(range(N)), stage


@pytest.fixture(scope="module")
def ddp_runs(beton: Path, tmp_path_factory: pytest.TempPathFactory) -> tuple[Path, list[Any]]:
    """One real 2-rank gloo DDP run of ``tests/scripts/ffcv_fit.py`` (its directory, and what
    each rank reported): rank 1 reads a ``.beton`` of 36 samples where one case asks."""
    root = tmp_path_factory.mktemp("ffcv_ddp")
    shorter = write_beton(root / "shorter.beton", _Images(36), ["image", "label"],
                          num_workers=1, progress=False)
    ranks = run_ddp(REPO / "tests" / "scripts" / "ffcv_fit.py",
                    ["--beton", str(beton), "--shorter", str(shorter), "--root", str(root),
                     "--batch-size", "4", "--epochs", "2", "--resume-steps", "4", "6"],
                    root / "results")
    return root, ranks


def test_two_rank_ddp_exactly_once_equal_counts_and_exact_resume(
        beton: Path, ddp_runs: tuple[Path, list[Any]], tmp_path: Path) -> None:
    """Real 2-rank gloo DDP; then the 2-rank checkpoint mid-epoch resumed on one process."""
    root, ranks = ddp_runs
    fulls = [[(e, i, b) for e, i, b in rank["full"]] for rank in ranks]
    steps = len(fulls[0]) // 2
    assert [rank["len"] for rank in ranks] == [steps, steps] == [6, 6]
    assert len(fulls[0]) == len(fulls[1]), "equal batch counts on every rank"
    for epoch in range(2):
        seen = [i for full in fulls for e, _, b in full if e == epoch for i in b]
        assert sorted(seen) == list(range(N)), f"epoch {epoch}: each sample exactly once"
    for rank, full in zip(ranks, fulls, strict=True):
        for step, resumed in rank["resumed"].items():
            assert [tuple(s) for s in resumed] == full[int(step):], f"resume after step {step}"

    mid = 4  # inside epoch 0, just before rank 1's padded batch of 3
    single = fit_recording(
        lambda: FFCVLoader(beton, batch_size=4, num_workers=1, order="random", seed=11),
        tmp_path, 2, ckpt_path=checkpoint_at(root / "checkpoints", mid),
        model=RecordingModule(labels_key))
    before = [i for full in fulls for _, _, b in full[:mid] for i in b]
    after_epoch0 = [i for e, _, b in single if e == 0 for i in b]
    assert sorted(before + after_epoch0) == list(range(N)), "epoch 0 finished exactly once"
    epoch1 = [b for e, _, b in single if e == 1]
    assert epoch1 == core_batches(1, 0, 4, "keep", 2)[1]


def test_ddp_plans_that_differ_between_ranks_are_refused_in_lightnings_loops(
        ddp_runs: tuple[Path, list[Any]]) -> None:
    """Each rank shards its own plan: read through Lightning's data fetcher, the ranks compare
    it at every epoch start and refuse a seed, a ``.beton`` length or ``indices`` per rank on
    every rank, showing each rank's value. Before, they read on: a seed per rank repeated 10
    and lost 10 of 41 samples in epoch 0, a ``.beton`` of 36 samples on rank 1 gave the ranks
    6 and 5 batches (a DDP fit hung), and ``indices`` split by rank (20 each) read 20 of their
    40 samples, each rank its share of its own."""
    refused = {
        "seed-per-rank": "ValueError: the loader's seed differs between ranks (11 on rank 0, 12 "
                         "on rank 1)",
        "beton-per-rank": "ValueError: the order's length (the sampler's len(), else the "
                          "dataset's) differs between ranks (41 on rank 0, 36 on rank 1)",
        "indices-per-rank": "ValueError: the order differs between ranks in epoch 0 (its first "
                            "indices: [14, 2, 22, 18] on rank 0, [15, 3, 23, 19] on rank 1)",
    }
    for rank in ddp_runs[1]:
        for case, start in refused.items():
            assert rank["differing"][case].get("error", "").startswith(start), (case, rank)


@pytest.mark.parametrize("mode", ["max_size", "max_size_cycle", "min_size"])
def test_an_ffcv_member_of_a_combined_loader_resumes_exactly(beton: Path, tmp_path: Path,
                                                             mode: str) -> None:
    """Beside a longer ``ResumableLoader``, the FFCV member (2 batches) stays finished under
    ``max_size`` after a resume at its end, and is read again under ``max_size_cycle``."""
    def make() -> CombinedLoader:
        return CombinedLoader({
            "a": ResumableLoader(IndexDataset(10), batch_size=2, shuffle=True, seed=1),
            "b": FFCVLoader(beton, batch_size=21, order="random", seed=11,
                            pipelines=LABELS_ONLY),
        }, mode=mode)

    full = check_trainer_resume(make, tmp_path, max_epochs=2)
    assert len(full) == (4 if mode == "min_size" else 10)
    if mode == "max_size":
        assert [step[2]["b"] for step in full if step[1] >= 2] == [None] * 6
