"""The autotuning rule as a pure function: measurement sequences in, decisions out."""

from __future__ import annotations

import pytest

from lightning_loaders.engines.autotune import (
    AutotuneConfig,
    Autotuner,
    Setting,
    Tuning,
    Window,
    available_cpus,
    decide,
    start,
)

CONFIG = AutotuneConfig(max_workers=4, window=4, warmup=1, high_wait=0.1, min_gain=0.05,
                        max_prefetch=8, max_changes=8)


def window(ms_per_batch: float, wait_fraction: float, batches: int = 4) -> Window:
    wall = ms_per_batch * batches / 1e3
    return Window(batches, wait_fraction * wall, wall)


def run(config: AutotuneConfig, measure: dict[Setting, Window], prefetch: int = 2,
        limit: int = 20) -> Tuning:
    """Feed ``decide`` what each setting measures until it is done."""
    tuning = start(config, prefetch)
    for _ in range(limit):
        if tuning.phase == "done":
            return tuning
        tuning = decide(config, tuning, measure[tuning.setting])
    raise AssertionError(f"not done after {limit} windows: {tuning}")


def test_window_fraction_and_speed() -> None:
    w = Window(4, 0.3, 1.2)
    assert w.wait_fraction == pytest.approx(0.25)
    assert w.seconds_per_batch == pytest.approx(0.3)
    assert Window(1, 0.0, 0.0).wait_fraction == 0.0


def test_low_wait_settles_on_the_start_without_any_change() -> None:
    tuning = decide(CONFIG, start(CONFIG, 2), window(10, 0.02))
    assert tuning.phase == "done"
    assert tuning.setting == Setting(0, 2)
    assert tuning.changes == 0
    assert "high_wait" in tuning.reason


def test_high_wait_doubles_workers_while_it_helps_then_tunes_prefetch() -> None:
    measure = {Setting(0, 2): window(40, 0.9), Setting(1, 2): window(30, 0.7),
               Setting(2, 2): window(20, 0.5), Setting(4, 2): window(12, 0.3),
               Setting(4, 4): window(10, 0.2), Setting(4, 8): window(10, 0.2)}
    tuning = run(CONFIG, measure)
    tried = [trial.setting for trial in tuning.trials]
    assert tried == [Setting(0, 2), Setting(1, 2), Setting(2, 2), Setting(4, 2), Setting(4, 4),
                     Setting(4, 8)]
    assert tuning.setting == Setting(4, 4)  # prefetch 8 did not help: back to the best
    assert tuning.best is not None and tuning.best.setting == Setting(4, 4)
    assert tuning.changes == 6  # five steps and one return


def test_a_step_that_does_not_help_goes_back_to_the_best_and_moves_to_prefetch() -> None:
    measure = {Setting(0, 2): window(40, 0.9), Setting(1, 2): window(20, 0.5),
               Setting(2, 2): window(19.5, 0.5),  # under min_gain: not kept
               Setting(1, 4): window(15, 0.2), Setting(1, 8): window(15, 0.2)}
    tuning = run(CONFIG, measure)
    assert [t.setting for t in tuning.trials] == [Setting(0, 2), Setting(1, 2), Setting(2, 2),
                                                  Setting(1, 4), Setting(1, 8)]
    assert tuning.setting == Setting(1, 4)
    assert "did not help" in tuning.reason


def test_workers_stop_at_max_workers() -> None:
    config = AutotuneConfig(max_workers=3, window=4, max_prefetch=2)
    measure = {Setting(0, 2): window(40, 0.9), Setting(1, 2): window(30, 0.9),
               Setting(2, 2): window(20, 0.9), Setting(3, 2): window(15, 0.9)}
    tuning = run(config, measure)
    assert tuning.setting == Setting(3, 2)  # 2 * 2 capped at 3; prefetch is not tuned
    assert max(t.setting.workers for t in tuning.trials) == 3


def test_a_given_prefetch_factor_is_kept() -> None:
    config = CONFIG.resolved(prefetch_factor=3)
    measure = {Setting(0, 3): window(40, 0.9), Setting(1, 3): window(30, 0.9),
               Setting(2, 3): window(20, 0.9), Setting(4, 3): window(10, 0.9)}
    tuning = run(config, measure, prefetch=3)
    assert {t.setting.prefetch for t in tuning.trials} == {3}
    assert tuning.setting == Setting(4, 3)


def test_max_changes_bounds_the_steps_and_returns_to_the_best() -> None:
    config = AutotuneConfig(max_workers=16, window=4, max_changes=2)
    measure = {Setting(0, 2): window(40, 0.9), Setting(1, 2): window(20, 0.9),
               Setting(2, 2): window(25, 0.9)}
    tuning = run(config, measure)
    assert [t.setting for t in tuning.trials] == [Setting(0, 2), Setting(1, 2), Setting(2, 2)]
    assert tuning.setting == Setting(1, 2)
    assert tuning.changes == 3  # two steps, one return
    assert "max_changes" in tuning.reason


def test_done_is_final() -> None:
    tuning = decide(CONFIG, start(CONFIG, 2), window(10, 0.0))
    assert decide(CONFIG, tuning, window(100, 1.0)) is tuning


def test_autotuner_decides_once_per_window_and_waits_for_the_change() -> None:
    tuner = Autotuner(CONFIG, 2)
    decisions = [tuner.observe(0.009, 0.001) for _ in range(4)]
    assert decisions == [None, None, None, Setting(1, 2)]
    assert all(tuner.observe(0.0, 1.0) is None for _ in range(10))  # not applied yet: ignored
    tuner.applied()
    assert tuner.observe(0.5, 0.5) is None  # warmup=1: left out
    assert [tuner.observe(0.001, 0.004) for _ in range(4)] == [None, None, None, Setting(2, 2)]
    assert tuner.tuning.trials[1].window == Window(4, pytest.approx(0.004),
                                                   pytest.approx(0.02))


def test_autotuner_stops_measuring_when_done() -> None:
    tuner = Autotuner(CONFIG, 2)
    assert [tuner.observe(0.0, 0.01) for _ in range(4)] == [None] * 4
    assert tuner.done
    assert tuner.observe(1.0, 0.0) is None
    assert len(tuner.tuning.trials) == 1


def test_resolved_max_workers_defaults_to_the_usable_cpus() -> None:
    assert AutotuneConfig().resolved().max_workers == max(1, available_cpus())
    assert AutotuneConfig(max_workers=3).resolved().max_workers == 3
    assert AutotuneConfig().resolved().max_prefetch == 8


@pytest.mark.parametrize(("field", "value"), [
    ("window", 0), ("warmup", -1), ("start_workers", -1), ("max_prefetch", 0),
    ("max_changes", -1), ("high_wait", 1.0), ("min_gain", -0.1), ("window", 2.5),
    ("max_workers", 0),
])
def test_bad_config_is_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"AutotuneConfig.{field}"):
        AutotuneConfig(**{field: value})  # type: ignore[arg-type]


def test_max_workers_below_start_workers_is_refused() -> None:
    with pytest.raises(ValueError, match="start_workers=3"):
        AutotuneConfig(start_workers=3, max_workers=2)


def test_stop_keeps_the_setting_and_measures_no_more() -> None:
    tuner = Autotuner(CONFIG, 2)
    assert [tuner.observe(0.009, 0.001) for _ in range(4)][-1] == Setting(1, 2)
    tuner.stop("nothing to tune")
    assert tuner.done and tuner.pending is None and tuner.tuning.reason == "nothing to tune"
    assert tuner.tuning.setting == Setting(0, 2)  # decided, never applied
    assert tuner.observe(1.0, 0.0) is None
