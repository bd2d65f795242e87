"""The autotuning rule as a pure function: measurement sequences in, decisions out."""

from __future__ import annotations

import os
from dataclasses import replace

import pytest

from lightning_loaders.engines.autotune import (
    PAUSE,
    PAUSE_MIN_S,
    AutotuneConfig,
    Autotuner,
    CpuTimes,
    Setting,
    Tuning,
    Window,
    available_cpus,
    busy_fraction,
    decide,
    parse_cpu_times,
    read_cpu_times,
    start,
)

CONFIG = AutotuneConfig(max_workers=4, probe=4, window=4, warmup=1, high_wait=0.1, min_gain=0.05,
                        max_prefetch=8, max_changes=8, min_window_s=0.0)


def window(ms_per_batch: float, wait_fraction: float, batches: int = 4,
           cpu_busy: float | None = None) -> Window:
    wall = ms_per_batch * batches / 1e3
    return Window(batches, wait_fraction * wall, wall, cpu_busy)


def unknown_cpu_times() -> CpuTimes | None:
    """A platform without ``/proc/stat``."""
    return None


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
    # 0 workers: fetch 16 ms, own work 24 ms per batch, ceil(1.25 * 16 / 24) = 1 worker
    measure = {Setting(0, 2): window(40, 0.4), Setting(1, 2): window(30, 0.7),
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
    measure = {Setting(0, 2): window(40, 0.4), Setting(1, 2): window(20, 0.5),
               Setting(2, 2): window(19.5, 0.5),  # under min_gain: not kept
               Setting(1, 4): window(15, 0.2), Setting(1, 8): window(15, 0.2)}
    tuning = run(CONFIG, measure)
    assert [t.setting for t in tuning.trials] == [Setting(0, 2), Setting(1, 2), Setting(2, 2),
                                                  Setting(1, 4), Setting(1, 8)]
    assert tuning.setting == Setting(1, 4)
    assert "did not help" in tuning.reason


def test_workers_stop_at_max_workers() -> None:
    config = AutotuneConfig(max_workers=3, window=4, max_prefetch=2)
    measure = {Setting(0, 2): window(40, 0.4), Setting(1, 2): window(30, 0.9),
               Setting(2, 2): window(20, 0.9), Setting(3, 2): window(15, 0.9)}
    tuning = run(config, measure)
    assert tuning.setting == Setting(3, 2)  # 2 * 2 capped at 3; prefetch is not tuned
    assert max(t.setting.workers for t in tuning.trials) == 3


def test_a_given_prefetch_factor_is_kept() -> None:
    config = CONFIG.resolved(prefetch_factor=3)
    measure = {Setting(0, 3): window(40, 0.4), Setting(1, 3): window(30, 0.9),
               Setting(2, 3): window(20, 0.9), Setting(4, 3): window(10, 0.9)}
    tuning = run(config, measure, prefetch=3)
    assert [t.setting for t in tuning.trials] == [Setting(0, 3), Setting(1, 3), Setting(2, 3),
                                                  Setting(4, 3)]
    assert tuning.setting == Setting(4, 3)


def test_max_changes_bounds_the_steps_and_returns_to_the_best() -> None:
    config = AutotuneConfig(max_workers=16, window=4, max_changes=2)
    measure = {Setting(0, 2): window(40, 0.4), Setting(1, 2): window(20, 0.9),
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
    tuner = Autotuner(CONFIG, 2, cpu_times=unknown_cpu_times)
    decisions = [tuner.observe(0.003, 0.007) for _ in range(4)]  # 1.25 * 3 / 7 < 1: 1 worker
    assert decisions == [None, None, None, Setting(1, 2)]
    assert all(tuner.observe(0.0, 1.0) is None for _ in range(10))  # not applied yet: ignored
    tuner.applied()
    assert tuner.observe(0.5, 0.5) is None  # warmup=1: left out
    assert [tuner.observe(0.001, 0.004) for _ in range(4)] == [None, None, None, Setting(2, 2)]
    assert tuner.tuning.trials[1].window == Window(4, pytest.approx(0.004),
                                                   pytest.approx(0.02))


def test_a_window_lasts_at_least_min_window_s() -> None:
    """Fast batches extend a window past its batch count until ``min_window_s`` of wall time:
    the probe of 4 batches of 10 ms decides at the 10th batch (95 ms reached), not the 4th."""
    config = AutotuneConfig(max_workers=4, probe=4, min_window_s=0.095)
    tuner = Autotuner(config.resolved(), 2, cpu_times=unknown_cpu_times)
    decisions = [tuner.observe(0.01, 0.0) for _ in range(10)]
    assert decisions == [None] * 9 + [Setting(4, 2)]
    assert tuner.tuning.trials[0].window.batches == 10


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
    ("max_workers", 0), ("probe", 0), ("probe", True), ("saturated", 0.0), ("saturated", 1.01),
    ("saturated", True), ("saturated", "0.9"), ("min_window_s", -0.1), ("min_window_s", None),
])
def test_bad_config_is_refused_naming_the_field(field: str, value: object) -> None:
    with pytest.raises(ValueError, match=f"AutotuneConfig.{field}"):
        AutotuneConfig(**{field: value})  # type: ignore[arg-type]


def test_max_workers_below_start_workers_is_refused() -> None:
    with pytest.raises(ValueError, match="start_workers=3"):
        AutotuneConfig(start_workers=3, max_workers=2)


def test_stop_keeps_the_setting_and_measures_no_more() -> None:
    tuner = Autotuner(CONFIG, 2, cpu_times=unknown_cpu_times)
    assert [tuner.observe(0.009, 0.001) for _ in range(4)][-1] == Setting(4, 2)
    tuner.stop("nothing to tune")
    assert tuner.done and tuner.pending is None and tuner.tuning.reason == "nothing to tune"
    assert tuner.tuning.setting == Setting(0, 2)  # decided, never applied
    assert tuner.observe(1.0, 0.0) is None


def test_restart_drops_the_window_and_waits_for_the_warmup() -> None:
    config = AutotuneConfig(min_window_s=0.0, max_workers=4, probe=3, window=3, warmup=2,
                            high_wait=0.0, saturated=None)
    tuner = Autotuner(config, 2, cpu_times=unknown_cpu_times)
    assert [tuner.observe(1.0, 1.0) for _ in range(2)] == [None, None]
    tuner.restart()  # the two batches above are dropped, the next two are the warmup
    assert [tuner.observe(1.0, 1.0) for _ in range(2)] == [None, None]
    assert [tuner.observe(0.003, 0.007) for _ in range(3)] == [None, None, Setting(1, 2)]
    measured = tuner.tuning.trials[0].window
    assert (measured.batches, measured.wait_s, measured.wall_s) == (3, pytest.approx(0.009),
                                                                    pytest.approx(0.03))
    tuner.restart()  # a decision waits to be applied: nothing to drop
    assert tuner.pending == Setting(1, 2)


# -- the short probe ---------------------------------------------------------------------------


def test_the_first_window_lasts_probe_batches_and_later_ones_window() -> None:
    config = AutotuneConfig(min_window_s=0.0, max_workers=4, probe=2, window=5, warmup=0,
                            high_wait=0.0, min_gain=0.0, saturated=None)
    tuner = Autotuner(config, 2, cpu_times=unknown_cpu_times)
    assert [tuner.observe(0.003, 0.007) for _ in range(2)] == [None, Setting(1, 2)]
    tuner.applied()
    assert [tuner.observe(0.001, 0.004) for _ in range(5)] == [None] * 4 + [Setting(2, 2)]
    assert [t.window.batches for t in tuner.tuning.trials] == [2, 5]


def test_probe_defaults_to_two_batches() -> None:
    assert AutotuneConfig().probe == 2 and AutotuneConfig().window == 16


# -- pauses of the caller's loop (validation, checkpoints) ----------------------------------------


PAUSING = AutotuneConfig(max_workers=2, probe=2, window=4, warmup=0, high_wait=0.05,
                         min_gain=0.05, max_prefetch=2, saturated=None, min_window_s=0.0)


def test_a_pause_in_a_window_is_left_out_of_it() -> None:
    """A 2 s validation between two 10 ms steps of 2 workers: without it the window is 4
    batches of 20 ms (10 ms waited), faster than the probe's 50 ms at 0 workers, and kept; the
    pause's batch counts in ``paused`` and the reason, not in the window's time."""
    tuner = Autotuner(PAUSING, 2, cpu_times=unknown_cpu_times)
    assert [tuner.observe(0.04, 0.01) for _ in range(2)] == [None, Setting(2, 2)]
    tuner.applied()
    decisions = [tuner.observe(wait, work) for wait, work in
                 [(0.01, 0.01), (0.0, 2.0), (0.01, 0.01), (0.01, 0.01), (0.01, 0.01)]]
    assert decisions == [None] * 5  # kept, and max_workers and max_prefetch reached: done
    trial = tuner.tuning.trials[1]
    assert trial.setting == Setting(2, 2)
    assert trial.window == Window(4, pytest.approx(0.04), pytest.approx(0.08), paused=1)
    assert tuner.tuning.setting == Setting(2, 2) and tuner.done
    assert "20 ms/batch, 1 pause of the loop left out" in tuner.tuning.reason


def test_without_leaving_pauses_out_one_would_send_the_tuning_back_to_no_workers() -> None:
    """What the rule makes of the same window with the pause counted as a step: 520 ms per
    batch, far slower than the probe, so it goes back to 0 workers for the whole run."""
    probe = Window(2, 0.08, 0.1)
    counted = Window(4, 0.03, 2.06)
    tuning = decide(PAUSING, start(PAUSING, 2), probe)
    assert decide(PAUSING, tuning, counted).setting == Setting(0, 2)


def test_a_pause_as_a_window_s_first_batch_is_judged_by_the_last_window() -> None:
    tuner = Autotuner(PAUSING, 2, cpu_times=unknown_cpu_times)
    assert [tuner.observe(0.04, 0.01) for _ in range(2)] == [None, Setting(2, 2)]
    tuner.applied()
    for wait, work in [(0.0, 1.0), (0.01, 0.01), (0.01, 0.01), (0.01, 0.01), (0.01, 0.01)]:
        tuner.observe(wait, work)
    assert tuner.tuning.trials[1].window.paused == 1
    assert tuner.tuning.trials[1].window.batches == 4


@pytest.mark.parametrize("works", [
    [0.002, 0.04, 0.002, 0.002],  # 20x the others, but under PAUSE_MIN_S: jitter of a fast loop
    [0.1, 0.9, 0.1, 0.1],  # 9x the others: a slow step, not a pause
])
def test_what_is_not_a_pause_stays_in_the_window(works: list[float]) -> None:
    config = replace(PAUSING, probe=4)
    tuner = Autotuner(config, 2, cpu_times=unknown_cpu_times)
    for work in works:
        tuner.observe(0.01, work)
    window = tuner.tuning.trials[0].window
    assert window.paused == 0 and window.batches == 4
    assert window.wall_s == pytest.approx(0.04 + sum(works))


def test_when_the_loop_s_steps_become_slower_the_median_follows_them() -> None:
    """The first 2 s step after 0.1 s ones looks like a pause; from the next one on, the
    median is 2 s and they count."""
    config = replace(PAUSING, probe=4)
    tuner = Autotuner(config, 2, cpu_times=unknown_cpu_times)
    for work in [0.1, 2.0, 2.0, 2.0, 2.0]:
        tuner.observe(0.01, work)
    window = tuner.tuning.trials[0].window
    assert (window.batches, window.paused) == (4, 1)
    assert window.wall_s == pytest.approx(0.04 + 6.1)


def test_pauses_are_judged_only_above_pause_min_s_and_pause_times_the_median() -> None:
    assert PAUSE_MIN_S == 0.05 and PAUSE == 10.0
    config = replace(PAUSING, probe=4)
    tuner = Autotuner(config, 2, cpu_times=unknown_cpu_times)
    for work in [0.01, 0.101, 0.01, 0.01, 0.01]:  # 0.101 > 10 * 0.01 and > 0.05: a pause
        tuner.observe(0.01, work)
    assert tuner.tuning.trials[0].window.paused == 1


# -- the first step from 0 workers: k = ceil(1.25 * f / w) --------------------------------------


@pytest.mark.parametrize(("fetch_ms", "work_ms", "max_workers", "workers"), [
    (9.0, 1.0, 16, 12),  # ceil(11.25)
    (3.0, 3.0, 16, 2),  # ceil(1.25)
    (6.0, 1.0, 16, 8),  # ceil(7.5)
    (9.0, 1.0, 4, 4),  # 12, clamped at max_workers
    (1.0, 3.0, 16, 1),  # ceil(0.42), at least 1
    (5.0, 0.0, 6, 6),  # no own work: as many as allowed
])
def test_from_zero_workers_the_model_picks_the_workers(
        fetch_ms: float, work_ms: float, max_workers: int, workers: int) -> None:
    config = AutotuneConfig(max_workers=max_workers, window=4, high_wait=0.01)
    batches = 4
    measured = Window(batches, fetch_ms * batches / 1e3, (fetch_ms + work_ms) * batches / 1e3)
    tuning = decide(config, start(config, 2), measured)
    assert tuning.setting == Setting(workers, 2)
    assert tuning.phase == "workers" and tuning.changes == 1
    assert "ceil(1.25 * f / w)" in tuning.reason and f"k = {workers}" in tuning.reason


def test_after_the_jump_workers_double_from_k() -> None:
    config = AutotuneConfig(max_workers=16, window=4, max_prefetch=2)
    measure = {Setting(0, 2): window(40, 0.5),  # f = w = 20 ms: ceil(1.25) = 2 workers
               Setting(2, 2): window(25, 0.5), Setting(4, 2): window(15, 0.5),
               Setting(8, 2): window(15, 0.5)}  # no gain: back to 4
    tuning = run(config, measure)
    assert [t.setting for t in tuning.trials] == [Setting(0, 2), Setting(2, 2), Setting(4, 2),
                                                  Setting(8, 2)]
    assert tuning.setting == Setting(4, 2) and tuning.changes == 4


# -- saturated CPUs end the tuning -------------------------------------------------------------


SATURATING = {Setting(0, 2): window(40, 0.4, cpu_busy=0.99), Setting(1, 2): window(30, 0.7),
              Setting(2, 2): window(20, 0.5, cpu_busy=0.93), Setting(4, 2): window(12, 0.3),
              Setting(4, 4): window(10, 0.2), Setting(4, 8): window(10, 0.2)}


def test_a_kept_window_with_workers_on_busy_cpus_ends_the_tuning() -> None:
    """0 workers at 99% busy goes on (the main process alone); 2 workers at 93% are kept and
    end it."""
    tuning = run(CONFIG, SATURATING)
    assert [t.setting for t in tuning.trials] == [Setting(0, 2), Setting(1, 2), Setting(2, 2)]
    assert tuning.setting == Setting(2, 2) and tuning.phase == "done"
    assert tuning.changes == 2  # no return: the last step is the one kept
    assert "CPUs 93% busy: more workers or prefetch cannot help" in tuning.reason


def test_saturation_counts_from_the_threshold_itself() -> None:
    config = AutotuneConfig(max_workers=4, window=4, saturated=0.93)
    assert run(config, SATURATING).setting == Setting(2, 2)
    config = AutotuneConfig(max_workers=4, window=4, saturated=0.94)
    assert run(config, SATURATING).setting == Setting(4, 4)


def test_a_window_that_is_not_kept_does_not_end_the_tuning_on_busy_cpus() -> None:
    measure = {Setting(0, 2): window(40, 0.4), Setting(1, 2): window(20, 0.5),
               Setting(2, 2): window(19.5, 0.5, cpu_busy=1.0),  # under min_gain: not kept
               Setting(1, 4): window(15, 0.2), Setting(1, 8): window(15, 0.2)}
    tuning = run(CONFIG, measure)
    assert [t.setting for t in tuning.trials] == [Setting(0, 2), Setting(1, 2), Setting(2, 2),
                                                  Setting(1, 4), Setting(1, 8)]
    assert tuning.setting == Setting(1, 4)


@pytest.mark.parametrize("config", [CONFIG, AutotuneConfig(
    max_workers=4, window=4, warmup=1, high_wait=0.1, min_gain=0.05, saturated=None)],
    ids=["busy-unknown", "saturated-None"])
def test_unknown_busy_or_no_threshold_tunes_as_before(config: AutotuneConfig) -> None:
    measure = dict(SATURATING)
    if config.saturated is not None:  # the CPU load is unknown (no /proc/stat)
        measure = {s: replace(w, cpu_busy=None) for s, w in measure.items()}
    tuning = run(config, measure)
    assert [t.setting for t in tuning.trials] == [Setting(0, 2), Setting(1, 2), Setting(2, 2),
                                                  Setting(4, 2), Setting(4, 4), Setting(4, 8)]
    assert tuning.setting == Setting(4, 4)


def test_the_autotuner_reads_cpu_times_where_each_window_starts_and_ends() -> None:
    """Reads: the first measured batch, the probe's end; after ``applied()`` the last warmup
    batch, the window's end."""
    readings = iter([CpuTimes(0, 100), CpuTimes(50, 200), CpuTimes(60, 300), CpuTimes(150, 400)])
    config = AutotuneConfig(min_window_s=0.0, max_workers=4, probe=2, window=3, warmup=2,
                            high_wait=0.0, min_gain=0.0, saturated=0.9)
    tuner = Autotuner(config, 2, cpu_times=lambda: next(readings))
    assert [tuner.observe(0.003, 0.007) for _ in range(2)] == [None, Setting(1, 2)]
    tuner.applied()
    assert [tuner.observe(0.5, 0.5) for _ in range(2)] == [None, None]  # warmup
    assert [tuner.observe(0.001, 0.004) for _ in range(3)] == [None] * 3
    assert [t.window.cpu_busy for t in tuner.tuning.trials] == [pytest.approx(0.5),
                                                                 pytest.approx(0.9)]
    assert tuner.done and tuner.tuning.setting == Setting(1, 2)
    assert next(readings, None) is None


# -- /proc/stat --------------------------------------------------------------------------------

PROC_STAT = """cpu  60 1 15 240 14 2 3 5 7 0
cpu0 10 1 5 80 4 2 3 0 7 0
cpu1 20 0 10 60 10 0 0 0 0 0
cpu2 30 0 0 100 0 0 0 5 0 0
intr 12345 1 2 3
ctxt 999
"""


@pytest.mark.parametrize(("cpus", "expected"), [
    ({0, 2}, CpuTimes(busy=21 + 35, total=105 + 135)),  # idle + iowait are not busy
    ({1}, CpuTimes(busy=30, total=100)),
    ({0, 1, 2}, CpuTimes(busy=86, total=340)),
    ({3}, None),  # no line for a CPU asked for
    (set(), None),
])
def test_parse_cpu_times_sums_the_affinity_cpus(cpus: set[int],
                                                expected: CpuTimes | None) -> None:
    assert parse_cpu_times(PROC_STAT, cpus) == expected


def test_busy_fraction_between_two_readings() -> None:
    assert busy_fraction(CpuTimes(10, 100), CpuTimes(40, 150)) == pytest.approx(0.6)
    assert busy_fraction(CpuTimes(10, 100), CpuTimes(10, 100)) is None  # no time passed
    assert busy_fraction(None, CpuTimes(10, 100)) is None
    assert busy_fraction(CpuTimes(10, 100), None) is None


@pytest.mark.skipif(not os.path.exists("/proc/stat") or not hasattr(os, "sched_getaffinity"),
                    reason="needs /proc/stat and an affinity mask")
def test_read_cpu_times_reads_this_machine() -> None:
    first = read_cpu_times()
    assert first is not None and 0 <= first.busy <= first.total
    later = read_cpu_times()
    assert later is not None and later.total >= first.total
