"""DataStallMonitor under a real Trainer on CPU: slow data is reported and warned about, a slow
step is not, values reach the logger, and throughput agrees with the step rate."""

from __future__ import annotations

import csv
import logging
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import lightning as L
import numpy as np
import pytest
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.loggers import CSVLogger
from lightning.pytorch.profilers import SimpleProfiler
from torch.utils.data import DataLoader, Dataset, IterableDataset, TensorDataset

from lightning_loaders import AutotuneConfig, ResumableLoader
from lightning_loaders.engines.autotune import available_cpus
from lightning_loaders.lightning.monitor import (
    DataStallMonitor,
    DataStallWarning,
    _FetchTimer,
    _infer_batch_size,
    _stall_hints,
)

BATCH = 4
SAMPLE_DELAY = 0.03  # a slow fetch: BATCH * 30 ms per batch
STEP_DELAY = 0.05  # a slow step


@pytest.fixture(autouse=True)
def _quiet_lightning() -> None:
    logging.getLogger("lightning.pytorch").setLevel(logging.ERROR)


class SlowSamples(Dataset[torch.Tensor]):
    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        time.sleep(self.delay)
        return torch.full((3,), float(index))


class SlowStream(IterableDataset[torch.Tensor]):
    """No ``__len__``: Lightning prefetches one batch ahead for it."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __iter__(self) -> Iterator[torch.Tensor]:
        for index in range(self.n):
            time.sleep(self.delay)
            yield torch.full((3,), float(index))


class Model(L.LightningModule):
    """A linear model whose step can be made slow; records when each step ran."""

    def __init__(self, step_delay: float = 0.0) -> None:
        super().__init__()
        self.layer = torch.nn.Linear(3, 1)
        self.step_delay = step_delay
        self.step_times: list[float] = []
        self.val_times: list[float] = []
        self.val_delay = 0.0

    def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
        self.step_times.append(time.perf_counter())
        time.sleep(self.step_delay)
        x = batch[0] if isinstance(batch, list) else batch
        return self.layer(x).pow(2).mean()

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        self.val_times.append(time.perf_counter())
        time.sleep(self.val_delay)

    def configure_optimizers(self) -> torch.optim.Optimizer:
        return torch.optim.SGD(self.parameters(), lr=0.01)


def fit(tmp_path: Path, loader: Any, model: Model, *callbacks: Callback, epochs: int = 1,
        val: Any = None, **trainer_kwargs: Any
        ) -> tuple[L.Trainer, list[warnings.WarningMessage]]:
    options = {"log_every_n_steps": 1, **trainer_kwargs}
    trainer = L.Trainer(max_epochs=epochs, accelerator="cpu", devices=1,
                        logger=CSVLogger(tmp_path, name="logs"), enable_progress_bar=False,
                        enable_model_summary=False, enable_checkpointing=False,
                        callbacks=list(callbacks), **options)
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        trainer.fit(model, loader, val)
    return trainer, caught


def logged(trainer: L.Trainer, key: str) -> list[float]:
    assert trainer.logger is not None and trainer.logger.log_dir is not None
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        return [float(row[key]) for row in csv.DictReader(f) if row.get(key)]


def stalls(caught: list[warnings.WarningMessage]) -> list[str]:
    return [str(w.message) for w in caught if issubclass(w.category, DataStallWarning)]


def slow_loader(kind: str) -> Any:
    if kind == "resumable":
        return ResumableLoader(SlowSamples(32, SAMPLE_DELAY), batch_size=BATCH)
    if kind == "resumable-1-worker":
        return ResumableLoader(SlowSamples(32, SAMPLE_DELAY), batch_size=BATCH, num_workers=1)
    if kind == "dataloader":
        return DataLoader(SlowSamples(32, SAMPLE_DELAY), batch_size=BATCH)
    return DataLoader(SlowStream(32, SAMPLE_DELAY), batch_size=BATCH)


@pytest.mark.parametrize("kind", ["resumable", "resumable-1-worker", "dataloader", "stream"])
def test_slow_data_is_reported_and_warned_about_once(tmp_path: Path, kind: str) -> None:
    monitor = DataStallMonitor(window=4, warmup_steps=1)
    trainer, caught = fit(tmp_path, slow_loader(kind), Model(), monitor, epochs=2)

    fraction = float(trainer.callback_metrics["data_wait_fraction"])
    assert fraction > 0.5
    assert fraction == pytest.approx(monitor.data_wait_fraction)
    rows = logged(trainer, "data_wait_fraction")
    # 8 batches per epoch; only the run's first two have no value yet (no interval before the
    # first batch, the interval before the second is the warm-up)
    assert len(rows) == 2 * 8 - 2
    # Every window is a fraction; most are dominated by the wait. (One window can dip under
    # 0.5 when another process takes the core during a training step: this is wall clock.)
    assert all(0 < value <= 1 for value in rows)
    assert sorted(rows)[len(rows) // 2] > 0.5
    assert len(logged(trainer, "samples_per_sec")) == len(rows)

    messages = stalls(caught)
    assert len(messages) == 1, messages
    assert not any("upper bound" in str(w.message) for w in caught), "fetches must be timed"
    if kind == "resumable-1-worker":
        assert "num_workers=1 now" in messages[0]
    else:
        assert "num_workers=0 fetches every batch inside the training loop" in messages[0]
    if kind == "stream":  # no batched fetch to offer for an iterable dataset
        assert "__getitems__" not in messages[0]
    else:
        assert "give SlowSamples a __getitems__(indices)" in messages[0]


def test_in_memory_data_gets_advice_that_fits_it(tmp_path: Path) -> None:
    """Workers do not help a loader that gathers in-memory tensors: the hint says what does."""
    in_memory = ResumableLoader(TensorDataset(torch.randn(16, 3)), batch_size=BATCH,
                                num_workers=2)
    per_sample = ResumableLoader(SlowSamples(16, 0.0), batch_size=BATCH, num_workers=2)
    assert in_memory.gathers_in_memory and not per_sample.gathers_in_memory
    for loader, expected, unexpected in ((in_memory, "index them there", "num_workers"),
                                         (per_sample, "vectorised fetch", "index them there")):
        trainer, _ = fit(tmp_path, loader, Model(), max_steps=2)
        hints = "\n".join(_stall_hints(trainer))
        assert expected in hints and unexpected not in hints


@pytest.mark.skipif(available_cpus() < 2, reason="needs 2 CPUs to advise more than 1 worker")
def test_num_workers_auto_is_offered_only_to_a_loader_that_takes_it(tmp_path: Path) -> None:
    ours = ResumableLoader(SlowSamples(16, 0.0), batch_size=BATCH, num_workers=1)
    plain = DataLoader(SlowSamples(16, 0.0), batch_size=BATCH, num_workers=1)
    for loader, offered in ((ours, True), (plain, False)):
        trainer, _ = fit(tmp_path, loader, Model(), max_steps=2)
        hints = "\n".join(_stall_hints(trainer))
        assert "more worker processes: num_workers=1 now" in hints
        assert ("num_workers='auto'" in hints) is offered


def test_an_autotuned_loader_is_told_where_its_tuning_stands(tmp_path: Path) -> None:
    """A loader already on ``num_workers="auto"`` is not told to try it: the hint says what
    the tuner decided, while it tunes and once it settled."""
    tuning = AutotuneConfig(max_workers=1, probe=1, window=1, warmup=0, min_window_s=0.0,
                            high_wait=0.0, max_prefetch=2, saturated=None)
    loader = ResumableLoader(SlowSamples(32, 0.002), batch_size=BATCH, num_workers=tuning)
    trainer, _ = fit(tmp_path, loader, Model(), max_steps=1)
    assert loader.autotune is not None and loader.autotune.phase != "done"
    hints = "\n".join(_stall_hints(trainer))
    assert "num_workers='auto' is still tuning: 0 workers run now" in hints
    assert "or num_workers='auto'" not in hints
    for _ in loader:  # the tuning goes on, and ends
        pass
    assert loader.autotune.phase == "done"
    hints = "\n".join(_stall_hints(trainer))
    assert f"num_workers='auto' settled on {loader.autotune.setting}" in hints
    loader.close()


def test_values_are_logged_at_the_trainers_cadence(tmp_path: Path) -> None:
    monitor = DataStallMonitor(window=4, warmup_steps=1)
    data = TensorDataset(torch.randn(32, 3))
    trainer, _ = fit(tmp_path, ResumableLoader(data, batch_size=BATCH), Model(), monitor,
                     epochs=2, log_every_n_steps=3)
    assert trainer.logger is not None and trainer.logger.log_dir is not None
    with open(Path(trainer.logger.log_dir) / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("data_wait_fraction")]
    # the Trainer writes after steps 2, 5, 8, ... (0-based); a value exists from step 2 on
    assert [int(row["step"]) for row in rows] == [2, 5, 8, 11, 14]
    assert all(row["samples_per_sec"] for row in rows)
    assert float(trainer.callback_metrics["data_wait_fraction"]) == pytest.approx(
        float(rows[-1]["data_wait_fraction"]))


def test_slow_step_with_fast_data_reports_little_waiting_and_no_warning(tmp_path: Path) -> None:
    data = TensorDataset(torch.randn(32, 3))
    monitor = DataStallMonitor(window=4, warmup_steps=1)
    trainer, caught = fit(tmp_path, ResumableLoader(data, batch_size=BATCH), Model(STEP_DELAY),
                          monitor)

    fraction = float(trainer.callback_metrics["data_wait_fraction"])
    assert fraction < 0.5
    assert all(value < 0.5 for value in logged(trainer, "data_wait_fraction"))
    assert stalls(caught) == []


class SlowAfterStep(Callback):
    """Slow work after the step (like saving a checkpoint): not waiting for data."""

    def on_train_batch_end(self, *args: Any) -> None:
        time.sleep(STEP_DELAY)


def test_slow_hooks_between_steps_do_not_count_as_waiting(tmp_path: Path) -> None:
    monitor = DataStallMonitor(window=4, warmup_steps=1)
    data = TensorDataset(torch.randn(32, 3))
    trainer, caught = fit(tmp_path, ResumableLoader(data, batch_size=BATCH), Model(), monitor,
                          SlowAfterStep())
    assert float(trainer.callback_metrics["data_wait_fraction"]) < 0.5
    assert stalls(caught) == []


def test_waiting_fraction_orders_slow_data_above_slow_steps(tmp_path: Path) -> None:
    slow_data = DataStallMonitor(window=4, warmup_steps=1)
    fit(tmp_path / "a", slow_loader("resumable"), Model(), slow_data)
    slow_step = DataStallMonitor(window=4, warmup_steps=1)
    fit(tmp_path / "b", ResumableLoader(SlowSamples(32, 0.0), batch_size=BATCH),
        Model(STEP_DELAY), slow_step)
    assert slow_data.data_wait_fraction is not None and slow_step.data_wait_fraction is not None
    assert slow_data.data_wait_fraction > slow_step.data_wait_fraction


@pytest.mark.parametrize(("batch_size", "samples"), [
    (None, BATCH), (1000, 1000), (lambda batch: 2 * len(batch[0]), 2 * BATCH)])
def test_throughput_matches_the_rate_of_training_steps(tmp_path: Path, batch_size: Any,
                                                       samples: int) -> None:
    model = Model(STEP_DELAY)
    monitor = DataStallMonitor(window=4, warmup_steps=1, batch_size=batch_size)
    data = TensorDataset(torch.randn(32, 3))
    trainer, _ = fit(tmp_path, ResumableLoader(data, batch_size=BATCH), model, monitor)

    throughput = float(trainer.callback_metrics["samples_per_sec"])
    # the median: a pause in Lightning's code between two steps (not the monitor's to count)
    # stretches one interval
    step_interval = float(np.median(np.diff(model.step_times)[-4:]))
    assert throughput == pytest.approx(samples / step_interval, rel=0.5)
    assert logged(trainer, "samples_per_sec")[-1] == pytest.approx(throughput)


def test_validation_time_is_neither_waiting_nor_training_time(tmp_path: Path) -> None:
    model = Model(STEP_DELAY)
    model.val_delay = 4 * STEP_DELAY
    monitor = DataStallMonitor(window=8, warmup_steps=0)
    data = TensorDataset(torch.randn(40, 3))
    val = DataLoader(TensorDataset(torch.randn(4, 3)), batch_size=BATCH)
    trainer, caught = fit(tmp_path, ResumableLoader(data, batch_size=BATCH), model, monitor,
                          val=val, val_check_interval=2, num_sanity_val_steps=0)
    steps = model.step_times
    plain = [b - a for a, b in zip(steps, steps[1:], strict=False)
             if not any(a < v < b for v in model.val_times)]
    assert len(model.val_times) == 5 and len(plain) == 5, "validation ran after every 2 steps"
    throughput = float(trainer.callback_metrics["samples_per_sec"])
    assert throughput == pytest.approx(BATCH / float(np.mean(plain)), rel=0.5)
    assert stalls(caught) == []


def test_a_users_profiler_keeps_recording_and_is_given_back(tmp_path: Path) -> None:
    profiler = SimpleProfiler()
    trainer, _ = fit(tmp_path, ResumableLoader(TensorDataset(torch.randn(16, 3)),
                                               batch_size=BATCH),
                     Model(), DataStallMonitor(window=2, warmup_steps=0), profiler=profiler)
    assert getattr(trainer, "profiler") is profiler  # noqa: B009 (untyped attribute)
    assert len(profiler.recorded_durations["run_training_batch"]) == 4
    fetches = [k for k in profiler.recorded_durations if k.endswith("train_dataloader_next")]
    assert fetches and len(profiler.recorded_durations[fetches[0]]) >= 4


class HideFetches(Callback):
    """Takes the monitor's profiler wrapper out, as if Lightning stopped reporting fetches."""

    def on_train_start(self, trainer: L.Trainer, pl_module: L.LightningModule) -> None:
        holder: Any = trainer
        assert isinstance(holder.profiler, _FetchTimer)
        holder.profiler = holder.profiler.inner


def test_without_fetch_timings_the_gap_between_steps_is_used(tmp_path: Path) -> None:
    monitor = DataStallMonitor(window=4, warmup_steps=1)
    trainer, caught = fit(tmp_path, slow_loader("resumable"), Model(), monitor, HideFetches())
    assert float(trainer.callback_metrics["data_wait_fraction"]) > 0.5
    assert any("upper bound" in str(w.message) for w in caught)
    assert len(stalls(caught)) == 1


def test_monitors_can_be_stacked_and_both_unwrap(tmp_path: Path) -> None:
    first, second = (DataStallMonitor(window=2, warmup_steps=0, prog_bar=False)
                     for _ in range(2))
    trainer, _ = fit(tmp_path, ResumableLoader(TensorDataset(torch.randn(16, 3)),
                                               batch_size=BATCH), Model(), first, second)
    assert not isinstance(getattr(trainer, "profiler"), _FetchTimer)  # noqa: B009
    assert first.samples_per_sec is not None and second.samples_per_sec is not None


def test_batch_size_inference() -> None:
    x, y = torch.zeros(5, 3), torch.zeros(5)
    assert _infer_batch_size(x) == 5
    assert _infer_batch_size([x, y]) == 5
    assert _infer_batch_size((torch.tensor(1.0), y)) == 5
    assert _infer_batch_size({"meta": ["a", "b"], "x": x}) == 5
    assert _infer_batch_size({"x": np.zeros((7, 2))}) == 7
    assert _infer_batch_size(["a", "b", "c"]) == 3
    assert _infer_batch_size([{"id": 1}, {"id": 2}]) == 2
    assert _infer_batch_size(torch.tensor(3.0)) is None
    assert _infer_batch_size("text") is None


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"threshold": 0}, "threshold must be in (0, 1], got 0"),
    ({"threshold": 1.5}, "threshold must be in (0, 1], got 1.5"),
    ({"window": 0}, "window must be >= 1, got 0"),
    ({"warmup_steps": -1}, "warmup_steps must be >= 0, got -1"),
    ({"batch_size": 0}, "batch_size must be >= 1 (or a function, or None), got 0"),
])
def test_bad_configuration_is_refused(kwargs: dict[str, Any], message: str) -> None:
    with pytest.raises(ValueError) as info:
        DataStallMonitor(**kwargs)
    assert str(info.value) == message
