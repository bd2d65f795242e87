"""``num_workers="auto"``: tuning the worker count changes speed, never data.

The tuning config below forces changes whatever the machine's speed and load: ``high_wait=0``
makes the first window (0 workers, a dataset that sleeps) always try 1 or 2 workers (the model's
``k``), and the next window either tries more workers or prefetch, or goes back to 0, a second
change either way; ``saturated=None`` keeps busy CPUs (the machine is shared) from ending the
tuning early. What is checked is the stream, the state and the processes, never timings.
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from torch.utils.data import Dataset

from lightning_loaders import AutotuneConfig, GeneratorSource, ResumableLoader
from lightning_loaders.loaders.tuned import TunedDelivery, autotuner_for
from lightning_loaders.testing import check_resume_at_every_step, run_epochs, to_plain
from tests.conftest import loader_processes
from tests.lightning_harness import RecordingModule, check_trainer_resume, make_trainer

FORCED = AutotuneConfig(max_workers=2, probe=2, window=2, warmup=0, high_wait=0.0, min_gain=0.0,
                        saturated=None, min_window_s=0.0)
SLEEP_S = 0.001


class SlowDataset(Dataset[dict[str, torch.Tensor]]):
    """Sample ``i`` is ``{"index": i, "x": ...}`` after a short sleep (so that batches are waited
    for), never gathered in memory."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        time.sleep(SLEEP_S)
        return {"index": torch.tensor(index), "x": torch.full((3,), float(index))}


def slow_shard(shard: tuple[int, int], start: int) -> Iterator[dict[str, Any]]:
    first, length = shard
    for i in range(first + start, first + length):
        time.sleep(SLEEP_S)
        yield {"index": torch.tensor(i), "x": torch.full((3,), float(i))}


def sharded_source() -> GeneratorSource[dict[str, Any]]:
    shards = [(0, 7), (7, 5), (12, 9), (21, 6)]
    return GeneratorSource(slow_shard, shards, lengths=[n for _, n in shards], seekable=True,
                           rng_free=True)  # draws nothing: backend="auto" may probe threads


def factory(kind: str, num_workers: Any, n: int = 36, backend: str = "process"
            ) -> Callable[[], ResumableLoader]:
    def make() -> ResumableLoader:
        if kind == "map":
            return ResumableLoader(SlowDataset(n), batch_size=3, shuffle=True, seed=5,
                                   num_workers=num_workers, backend=backend)
        return ResumableLoader(sharded_source(), batch_size=3, shuffle=True, seed=5,
                               partitions=4, num_workers=num_workers, backend=backend)
    return make


def recorded(loader: ResumableLoader, epochs: int) -> tuple[list[Any], list[dict[str, Any]],
                                                           list[int]]:
    """Batches, the state after each, and ``num_workers`` when each was delivered."""
    batches, states, workers = [], [], []
    for epoch in range(epochs):
        loader.sampler.set_epoch(epoch)
        for batch in loader:
            batches.append(to_plain(batch))
            states.append(loader.state_dict())
            workers.append(loader.num_workers)
    return batches, states, workers


@pytest.mark.parametrize("backend", ["process", "thread", "auto"])
@pytest.mark.parametrize("kind", ["map", "sharded"])
def test_an_autotuned_run_delivers_the_same_bytes_and_states_as_fixed_runs(
        kind: str, backend: str) -> None:
    """Under every backend: the tuned worker count runs as processes or threads;
    ``backend="auto"`` takes its fetches alone from the main process, before any worker."""
    fixed = {w: recorded(factory(kind, w)(), 2) for w in (0, 2)}
    with factory(kind, FORCED, backend=backend)() as tuned:
        batches, states, workers = recorded(tuned, 2)
        tuning = tuned.autotune
        auto = tuned._auto
    assert tuning is not None and tuning.changes >= 2
    if backend == "auto":
        assert auto is not None and auto.backend is not None  # fetches alone were timed
        assert len(auto.serial) == 2 * FORCED.max_workers and min(auto.serial) >= 3 * SLEEP_S
    assert any(trial.setting.workers > 0 for trial in tuning.trials)
    assert len(set(workers)) > 1, f"the worker count never changed while loading: {workers}"
    assert batches == fixed[0][0] == fixed[2][0]
    assert states == fixed[2][1], "state_dict() must not depend on the tuned worker count"
    if kind == "map":
        assert states == fixed[0][1]


@pytest.mark.parametrize("kind", ["map", "sharded"])
def test_autotuned_resume_at_every_step(kind: str) -> None:
    check_resume_at_every_step(factory(kind, FORCED, n=18), epochs=2)


@pytest.mark.parametrize("kind", ["map", "sharded"])
@pytest.mark.parametrize("first", ["auto", "fixed"])
def test_states_move_between_tuned_and_fixed_loaders(kind: str, first: str) -> None:
    """The run is made by the first loader, each resume by the other kind (0 or 2 workers)."""
    calls = iter(range(1000))

    def make() -> ResumableLoader:
        call = next(calls)
        if (call == 0) == (first == "auto"):
            return factory(kind, FORCED, n=18)()
        return factory(kind, 2 * (call % 2), n=18)()

    check_resume_at_every_step(make, epochs=2)


def test_a_change_decided_near_the_epoch_end_waits_for_it() -> None:
    """5 batches per epoch and a probe of 3: the first decision comes with 1 batch left, so
    the pool is rebuilt at the epoch's end, not mid-epoch (``max_workers=1``: the one step)."""
    config = AutotuneConfig(min_window_s=0.0, max_workers=1, probe=3, window=3, warmup=0,
                            high_wait=0.0)
    loader = ResumableLoader(SlowDataset(15), batch_size=3, num_workers=config)
    _, _, workers = recorded(loader, 1)
    assert workers == [0] * 5
    assert loader.num_workers == 1 and loader.prefetch_factor == 2
    assert [batch for epoch in run_epochs(loader, [1]) for batch in epoch]
    loader.close()


def test_no_worker_outlives_the_loader_after_changes() -> None:
    loader = factory("map", FORCED)()
    processes = []
    for batch in loader:
        del batch
        processes.append(len(loader_processes()))
    assert loader.autotune is not None and loader.autotune.changes >= 2
    assert max(processes) > 0 and all(p <= 2 for p in processes), processes  # old pools stopped
    loader.close()
    assert loader_processes() == []
    iterator = iter(loader)  # goes on from the cursor: a new epoch, and workers if tuned so
    next(iterator)
    del iterator, loader
    assert loader_processes() == []


def test_batches_from_workers_not_yet_settled_are_not_measured() -> None:
    """While ``settled`` is false (``backend="auto"`` choosing), every batch restarts the
    window, and the first settled one too: the pool's switch falls in the warmup. With a probe
    and windows of 2 and a warmup of 1, the second change is decided at batch 10, not 5
    (settled throughout)."""
    config = AutotuneConfig(min_window_s=0.0, max_workers=1, probe=2, window=2, warmup=1,
                            high_wait=0.0, min_gain=0.0, saturated=None)
    tuner = autotuner_for(config, None)
    assert tuner is not None
    delivered: list[int] = []
    applied_at: list[int] = []

    def batches() -> Iterator[int]:
        for i in range(20):
            delivered.append(i)
            yield i

    delivery = TunedDelivery(
        batches(), tuner,
        lambda setting: applied_at.append(delivered[-1]), lambda: None, lambda: None,
        settled=lambda: not 3 <= delivered[-1] <= 6)
    assert list(delivery) == list(range(20))
    # batch 0: an iterator's first; 1-2: the probe; 3-6 not settled; 7: restart; 8: warmup;
    # 9-10: the window (a change whatever it measures: a step, or back to 0 workers)
    assert applied_at[:2] == [2, 10]


def test_fixed_loaders_report_no_tuning_and_auto_starts_in_the_main_process() -> None:
    assert ResumableLoader(SlowDataset(4), num_workers=2).autotune is None
    loader = ResumableLoader(SlowDataset(4), num_workers="auto")
    assert loader.num_workers == 0 and loader.prefetch_factor is None
    assert loader.persistent_workers
    tuning = loader.autotune
    assert tuning is not None and tuning.phase == "workers" and tuning.changes == 0
    assert "num_workers=0" in repr(loader)


def test_a_given_prefetch_factor_is_kept_while_tuning() -> None:
    loader = ResumableLoader(SlowDataset(4), num_workers="auto", prefetch_factor=3)
    assert loader.autotune is not None and loader.autotune.setting.prefetch == 3


@pytest.mark.parametrize("bad", ["Auto", "4", -1, 1.5, None])
def test_bad_num_workers_names_auto(bad: Any) -> None:
    with pytest.raises(ValueError, match="'auto'"):
        ResumableLoader(SlowDataset(4), num_workers=bad)


def unknown_length_source() -> GeneratorSource[dict[str, Any]]:
    return GeneratorSource(slow_shard, [(0, 4), (4, 4)], seekable=True)


@pytest.mark.parametrize("make", [
    lambda: ResumableLoader(unknown_length_source(), batch_size=2, num_workers="auto"),
    lambda: ResumableLoader(sharded_source(), batch_size=2, last_batch="rollover",
                            num_workers="auto"),
    lambda: ResumableLoader(_Plain(), batch_size=2, num_workers="auto"),
], ids=["unknown-lengths", "rollover", "plain"])
def test_layout_dependent_iterables_refuse_auto(make: Callable[[], Any]) -> None:
    with pytest.raises(ValueError, match="num_workers='auto' needs an order that does not"):
        make()


class _Plain(torch.utils.data.IterableDataset[int]):
    def __iter__(self) -> Iterator[int]:
        return iter(range(8))

    def __len__(self) -> int:
        return 8


def test_sharded_auto_plans_over_max_workers_slots_by_default() -> None:
    """Without ``partitions``, the epoch order is the one a fixed run with ``max_workers``
    workers has: it never depends on the tuning."""
    config = AutotuneConfig(max_workers=2, window=2, warmup=0, high_wait=0.0)

    def make(num_workers: Any) -> ResumableLoader:
        return ResumableLoader(sharded_source(), batch_size=3, shuffle=True, seed=5,
                               num_workers=num_workers)

    assert run_epochs(make(config), range(2)) == run_epochs(make(2), range(2))


def test_lightning_fit_and_resume_with_auto(tmp_path: Path) -> None:
    made: list[ResumableLoader] = []

    def make() -> ResumableLoader:
        made.append(ResumableLoader(SlowDataset(12), batch_size=2, shuffle=True, seed=3,
                                    num_workers=FORCED))
        return made[-1]

    full = check_trainer_resume(make, tmp_path, max_epochs=2, steps=[1, 4, 6, 9])
    tuning = made[0].autotune
    assert tuning is not None and tuning.changes >= 2, "the uninterrupted fit never tuned"
    assert len(full) == 12
    per_epoch = [sorted(i for e, _, b in full if e == epoch for i in b) for epoch in (0, 1)]
    assert per_epoch == [list(range(12))] * 2


class _SlowValidation(RecordingModule):
    """Validation takes ``VALIDATION_S``, far longer than a training step."""

    def validation_step(self, batch: Any, batch_idx: int) -> None:
        time.sleep(VALIDATION_S)


VALIDATION_S = 1.0


class _SleepyDataset(SlowDataset):
    """``SlowDataset`` at 10 ms a sample: 2 workers are clearly faster than the main process."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        time.sleep(0.009)
        return super().__getitem__(index)


def test_a_validation_inside_the_epoch_is_left_out_of_the_tuning(tmp_path: Path) -> None:
    """A real ``Trainer`` validating every 7 steps: after the 2-batch probe at 0 workers and 2
    warmup batches, the 2 workers' window (batches 5-10) holds the validation after step 7.
    Counted as a step's work, it made 2 workers look far slower than the main process, and
    the tuning went back to 0 workers for the whole run; left out, 2 workers stay."""
    config = AutotuneConfig(max_workers=2, probe=2, window=6, warmup=2, max_prefetch=2,
                            saturated=None, min_window_s=0.0)
    loader = ResumableLoader(_SleepyDataset(80), batch_size=4, num_workers=config)
    validation = torch.utils.data.DataLoader(torch.utils.data.TensorDataset(torch.zeros(2, 1)))
    trainer = make_trainer(tmp_path, 1, val_check_interval=7, limit_val_batches=1)
    trainer.fit(_SlowValidation(), loader, validation)
    tuning = loader.autotune
    assert tuning is not None
    assert [t.setting.workers for t in tuning.trials[:2]] == [0, 2], tuning.reason
    assert tuning.setting.workers == 2, tuning.reason
    assert tuning.trials[1].window.paused == 1, tuning.trials


def test_in_memory_data_stops_tuning_at_once() -> None:
    """A TensorDataset is gathered in the main process whatever num_workers is: nothing to
    tune, and no worker count is reported that does not run."""
    data = torch.utils.data.TensorDataset(torch.arange(30.0))
    loader = ResumableLoader(data, batch_size=3, num_workers=FORCED)
    assert len(list(loader)) == 10
    tuning = loader.autotune
    assert tuning is not None and tuning.phase == "done" and tuning.changes == 0
    assert "in memory" in tuning.reason and loader.num_workers == 0


def _touch_worker_file(worker_id: int) -> None:
    directory = os.environ["LL_TEST_WORKER_DIR"]
    Path(directory, f"worker{worker_id}").touch()


def test_in_memory_data_with_a_worker_init_fn_is_tuned(tmp_path: Path,
                                                       monkeypatch: pytest.MonkeyPatch) -> None:
    """A ``worker_init_fn`` asks for workers for in-memory data, as with a fixed count: the
    tuning tries them (it stopped at once, saying the data is gathered in this process)."""
    monkeypatch.setenv("LL_TEST_WORKER_DIR", str(tmp_path))
    data = torch.utils.data.TensorDataset(torch.arange(30.0))
    loader = ResumableLoader(data, batch_size=3, num_workers=FORCED,
                             worker_init_fn=_touch_worker_file)
    assert torch.cat([batch[0] for batch in loader]).tolist() == list(range(30))
    tuning = loader.autotune
    assert tuning is not None and "in memory" not in tuning.reason and tuning.changes > 0
    assert "worker0" in {p.name for p in tmp_path.iterdir()}  # a worker ran it
    loader.close()
