"""Autotuning of the worker count and prefetch depth from the measured data-wait fraction.

The loaders' order is a function of ``(seed, epoch, world size, rank)``, never of the number of
workers or of how far they prefetch, so tuning these changes speed, never data. A loader built
with ``num_workers="auto"`` (or an ``AutotuneConfig``) measures, per delivered batch, the time
its caller waited inside ``next()`` (the data wait) and the time the caller spent between two
``next()`` calls (its own work), the signal ``DataStallMonitor`` logs, and how busy the CPUs it
may use were (``cpu_busy``, from ``/proc/stat``: any process on the machine counts).
``Autotuner`` sums them over windows and ``decide`` turns each window into the next setting:

1. The first window, a short *probe* of ``probe`` batches, measures the starting setting
   (``start_workers``, prefetch 2 or the given ``prefetch_factor``); it is the best so far.
   Later windows last ``window`` batches.
2. *Workers*: while the last window's wait fraction (wait / wall time) is above ``high_wait``,
   add workers, at most ``max_workers``. From 0 workers the main process fetched, so the
   window gives the fetch time per batch ``f = wait_s / batches`` and the caller's own work per
   batch ``w = (wall_s - wait_s) / batches``; data keeps up with ``k = ceil(1.25 * f / w)``
   workers (``w == 0``: ``max_workers``), tried at once (clamped to ``[1, max_workers]``).
   From ``k > 0`` workers, double them.
3. A step is kept when its seconds per batch are at least ``min_gain`` (a fraction) below the
   best's; otherwise the setting goes back to the best one and the next phase begins.
4. *Saturated*: a kept window with workers whose ``cpu_busy`` is at least ``saturated`` ends
   the tuning at its setting: the CPUs are busy, so neither more workers nor more prefetch can
   make batches faster (without ``/proc/stat``, ``cpu_busy`` is ``None`` and this never applies).
5. *Prefetch* (with workers, when ``prefetch_factor`` was not given): the same, doubling the
   batches each worker prepares ahead, up to ``max_prefetch``.
6. *Done*: the best setting stays for the rest of the run; nothing is measured any more.

Every change rebuilds the worker pool from the cursor (a fork per worker), so the rule changes
the setting at most once per window, tries at most ``max_changes`` steps (plus one return to
the best), ignores ``warmup`` batches after each change (worker start-up), and leaves out the
first batch of every epoch and the time between epochs. It also leaves out the *pauses* of the
caller's loop: a batch whose own work is at least ``PAUSE_MIN_S`` and more than ``PAUSE``
times the caller's typical work per batch (validation or a checkpoint inside an epoch,
counted as one step's work, would make the setting that ran then look slow, and send the
tuning back to a worse one for the whole run). ``decide`` is a pure function of its
arguments, so the rule is tested by feeding it measurements.
"""

from __future__ import annotations

import logging
import math
import os
import statistics
from collections.abc import Callable, Collection
from dataclasses import dataclass, replace
from typing import Literal

__all__ = [
    "PAUSE",
    "PAUSE_MIN_S",
    "AutotuneConfig",
    "Autotuner",
    "CpuTimes",
    "Phase",
    "Setting",
    "Trial",
    "Tuning",
    "Window",
    "available_cpus",
    "busy_fraction",
    "decide",
    "parse_cpu_times",
    "read_cpu_times",
    "run_delay_s",
    "threads_run_delay_s",
    "start",
]

_log = logging.getLogger(__name__)
Phase = Literal["workers", "prefetch", "done"]
_NEXT_PHASE: dict[Phase, Phase] = {"workers": "prefetch", "prefetch": "done", "done": "done"}
_PROC_STAT = "/proc/stat"
_HEADROOM = 1.25  # workers asked for from 0 workers: this much more fetch capacity than needed
PAUSE = 10.0
"""How many times the caller's typical own work per batch a batch's own work must exceed to
be a pause of its loop (validation, a checkpoint), left out of its window."""
PAUSE_MIN_S = 0.05
"""The shortest own work of a batch that can be a pause: fast loops jitter by more than
``PAUSE`` times a few microseconds of work, and such a batch weighs nothing anyway."""


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass(frozen=True)
class CpuTimes:
    """Jiffies the CPUs spent busy, and in all, since boot (summed over some CPUs)."""

    busy: int
    total: int


def parse_cpu_times(text: str, cpus: Collection[int]) -> CpuTimes | None:
    """The busy and total jiffies of ``cpus`` in ``text``, a ``/proc/stat`` (its ``cpuN``
    lines: user nice system idle iowait irq softirq steal ...; busy is all but idle and iowait;
    guest time, already counted in user and nice, is left out). ``None`` when a CPU of
    ``cpus`` has no line."""
    wanted = {f"cpu{cpu}" for cpu in cpus}
    busy = total = 0
    found = 0
    for line in text.splitlines():
        fields = line.split()
        if not fields or fields[0] not in wanted:
            continue
        jiffies = [int(value) for value in fields[1:9]]
        idle = sum(jiffies[3:5])
        total += sum(jiffies)
        busy += sum(jiffies) - idle
        found += 1
    return CpuTimes(busy, total) if wanted and found == len(wanted) else None


def read_cpu_times() -> CpuTimes | None:
    """``parse_cpu_times`` of ``/proc/stat`` for the CPUs this process may run on (its
    affinity mask); ``None`` where there is no such file or mask (not Linux)."""
    if not hasattr(os, "sched_getaffinity"):
        return None
    try:
        with open(_PROC_STAT, encoding="ascii") as file:
            text = file.read()
    except OSError:
        return None
    return parse_cpu_times(text, os.sched_getaffinity(0))


def run_delay_s(schedstat: str = "/proc/thread-self/schedstat") -> float:
    """Seconds a thread (by default the calling one) spent runnable but waiting for a core:
    the second field of the kernel's ``schedstat``. On a busy machine a thread that computes
    waits there, one that waits on I/O does not. 0 where there is no such file."""
    try:
        with open(schedstat, "rb") as file:
            return int(file.read().split()[1]) / 1e9
    except (OSError, IndexError, ValueError):
        return 0.0


def threads_run_delay_s() -> dict[str, float]:
    """``run_delay_s`` of each of this process's threads, by kernel id (none without
    ``/proc``)."""
    try:
        tids = os.listdir("/proc/self/task")
    except OSError:
        return {}
    return {tid: run_delay_s(f"/proc/self/task/{tid}/schedstat") for tid in tids}


def busy_fraction(start: CpuTimes | None, end: CpuTimes | None) -> float | None:
    """The fraction of CPU time that was busy between two readings (``None``: unknown)."""
    if start is None or end is None or end.total <= start.total:
        return None
    return min(1.0, max(0.0, (end.busy - start.busy) / (end.total - start.total)))


@dataclass(frozen=True, kw_only=True)
class AutotuneConfig:
    """How ``num_workers="auto"`` tunes (``num_workers=AutotuneConfig(...)`` to change it).

    Attributes:
        max_workers: the most workers tried; ``None``: the CPUs this process may run on
            (``available_cpus()``), fixed when the loader is built.
        start_workers: the workers of the first window (0: load in the main process, no fork
            until the wait fraction asks for workers).
        probe: batches of the first window (the starting setting), short so that a run that
            needs workers gets them early.
        window: batches per later measurement window (one decision per window).
        min_window_s: the least wall time of a window, which goes on past its batches until
            then: a few milliseconds of fast batches measure mostly noise.
        warmup: batches left out after each change (worker start-up, first prefetch).
        high_wait: the wait fraction above which more workers (then more prefetch) are tried.
        min_gain: how much faster (fraction of seconds per batch) a step must make delivery
            to be kept.
        max_prefetch: the deepest prefetch tried (batches per worker), when the loader's
            ``prefetch_factor`` is not given (a given one is kept).
        max_changes: steps tried at most in a run (each one rebuilds the worker pool).
        saturated: the busy fraction of the usable CPUs at which a kept setting with workers
            ends the tuning (more workers or prefetch cannot help); ``None``: never (the rule
            then ignores CPU load, as on platforms without ``/proc/stat``).
    """

    max_workers: int | None = None
    start_workers: int = 0
    probe: int = 2
    window: int = 16
    min_window_s: float = 0.02
    warmup: int = 4
    high_wait: float = 0.05
    min_gain: float = 0.05
    max_prefetch: int = 8
    max_changes: int = 8
    saturated: float | None = 0.9

    def __post_init__(self) -> None:
        for name, low in (("start_workers", 0), ("probe", 1), ("window", 1), ("warmup", 0),
                          ("max_prefetch", 1), ("max_changes", 0)):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"AutotuneConfig.{name} must be an int >= {low}, got {value!r}")
        workers = self.max_workers
        if workers is not None and (not isinstance(workers, int) or isinstance(workers, bool)
                                    or workers < max(1, self.start_workers)):
            raise ValueError(f"AutotuneConfig.max_workers must be None or an int >= "
                             f"max(1, start_workers={self.start_workers}), got {workers!r}")
        for name in ("high_wait", "min_gain"):
            value = getattr(self, name)
            if not isinstance(value, int | float) or isinstance(value, bool) or not 0 <= value < 1:
                raise ValueError(f"AutotuneConfig.{name} must be a number in [0, 1), got "
                                 f"{value!r}")
        value = self.min_window_s
        if not isinstance(value, int | float) or isinstance(value, bool) or value < 0:
            raise ValueError(f"AutotuneConfig.min_window_s must be a number >= 0, got {value!r}")
        value = self.saturated
        if value is not None and (not isinstance(value, int | float) or isinstance(value, bool)
                                  or not 0 < value <= 1):
            raise ValueError(f"AutotuneConfig.saturated must be None or a number in (0, 1], got "
                             f"{value!r}")

    def resolved(self, prefetch_factor: int | None = None) -> AutotuneConfig:
        """This config with ``max_workers`` fixed (``None``: ``available_cpus()``, at least
        ``start_workers``) and ``max_prefetch`` set to a given ``prefetch_factor``."""
        workers = self.max_workers or max(1, self.start_workers, available_cpus())
        prefetch = self.max_prefetch if prefetch_factor is None else prefetch_factor
        return replace(self, max_workers=workers, max_prefetch=prefetch)


@dataclass(frozen=True)
class Setting:
    """What is tuned: worker processes and batches each prepares ahead (``prefetch_factor``,
    unused without workers)."""

    workers: int
    prefetch: int

    def __str__(self) -> str:
        if self.workers == 0:
            return "0 workers"
        return f"{self.workers} worker{'s' * (self.workers > 1)} (prefetch {self.prefetch})"


@dataclass(frozen=True)
class Window:
    """A measurement window: ``batches`` delivered, seconds the caller waited for them in
    ``next()``, wall seconds (waits plus the caller's work between ``next()`` calls), the
    busy fraction of the usable CPUs over it (``None``: unknown), and the ``paused`` batches
    left out of it (pauses of the caller's loop, module docstring)."""

    batches: int
    wait_s: float
    wall_s: float
    cpu_busy: float | None = None
    paused: int = 0

    @property
    def wait_fraction(self) -> float:
        """Waiting time / wall time (0: never waits for data, 1: only waits)."""
        return self.wait_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def seconds_per_batch(self) -> float:
        return self.wall_s / self.batches

    @property
    def fetch_s(self) -> float:
        """Seconds waited per batch (with 0 workers: the fetch time of a batch)."""
        return self.wait_s / self.batches

    @property
    def work_s(self) -> float:
        """Seconds of the caller's own work per batch."""
        return (self.wall_s - self.wait_s) / self.batches


@dataclass(frozen=True)
class Trial:
    """A setting and what was measured with it."""

    setting: Setting
    window: Window


@dataclass(frozen=True)
class Tuning:
    """Where tuning stands (``loader.autotune``): the ``setting`` decided last (running, or
    about to run), the ``best`` trial so far, the ``phase``, the ``changes`` made, every
    ``trial`` in order, and the ``reason`` for the last decision."""

    setting: Setting
    best: Trial | None
    phase: Phase
    changes: int
    trials: tuple[Trial, ...]
    reason: str


def start(config: AutotuneConfig, prefetch: int) -> Tuning:
    """The tuning before the first window: ``config.start_workers`` with ``prefetch``."""
    return Tuning(Setting(config.start_workers, prefetch), None, "workers", 0, (),
                  "measuring the starting setting")


def decide(config: AutotuneConfig, tuning: Tuning, window: Window) -> Tuning:
    """The tuning after ``window`` was measured with ``tuning.setting`` (see the module
    docstring for the rule: from 0 workers the next step is ``k = ceil(1.25 * f / w)``
    workers, ``f`` and ``w`` the fetch and own-work seconds per batch; a kept window with
    workers and CPUs at least ``saturated`` busy ends the tuning). ``config`` must be
    ``resolved()``."""
    assert config.max_workers is not None
    if tuning.phase == "done":
        return tuning
    trial = Trial(tuning.setting, window)
    best: Trial | None = tuning.best
    phase: Phase = tuning.phase
    speed = f"{window.seconds_per_batch * 1e3:.3g} ms/batch"
    kept = best is None or window.seconds_per_batch < (best.window.seconds_per_batch
                                                       * (1 - config.min_gain))
    if window.paused:
        speed = f"{speed}, {window.paused} pause{'s' * (window.paused > 1)} of the loop left out"
    if kept:
        best = base = trial
        reason = f"{trial.setting}: wait fraction {window.wait_fraction:.2f}, {speed}"
    else:
        assert best is not None
        base, phase = best, _NEXT_PHASE[phase]
        best_speed = f"{best.window.seconds_per_batch * 1e3:.3g} ms/batch"
        reason = f"{trial.setting} did not help ({speed}, best {best_speed})"
    step: Setting | None = None
    busy = window.cpu_busy
    if (kept and trial.setting.workers > 0 and busy is not None
            and config.saturated is not None and busy >= config.saturated):
        phase = "done"
        reason = f"{reason}; CPUs {busy:.0%} busy: more workers or prefetch cannot help"
    elif tuning.changes < config.max_changes:
        phase, step, why = _next_step(config, phase, base)
        reason = f"{reason}{why}"
    else:
        phase, reason = "done", f"{reason}; no more changes (max_changes={config.max_changes})"
    target = step or base.setting
    if step is not None:
        reason = f"{reason}: trying {step}"
    else:
        phase = "done"
        if base.window.wait_fraction <= config.high_wait:
            reason = f"{reason}: wait fraction at most high_wait={config.high_wait}"
        reason = f"{reason}; settled on {target}"
    changes = tuning.changes + (target != tuning.setting)
    return Tuning(target, best, phase, changes, (*tuning.trials, trial), reason)


def _next_step(config: AutotuneConfig, phase: Phase, base: Trial
               ) -> tuple[Phase, Setting | None, str]:
    """The next setting to try from ``base`` (``None``: nothing left to try), and how it was
    worked out when that is worth saying."""
    assert config.max_workers is not None
    setting = base.setting
    if base.window.wait_fraction <= config.high_wait:
        return "done", None, ""
    if phase == "workers" and setting.workers == 0:
        workers, why = _workers_from_zero(config.max_workers, base.window)
        return phase, replace(setting, workers=workers), why
    if phase == "workers" and setting.workers < config.max_workers:
        workers = min(config.max_workers, 2 * setting.workers)
        return phase, replace(setting, workers=workers), ""
    if phase in ("workers", "prefetch") and 0 < setting.workers and (
            setting.prefetch < config.max_prefetch):
        return "prefetch", replace(setting, prefetch=min(config.max_prefetch,
                                                         2 * setting.prefetch)), ""
    return "done", None, ""


def _workers_from_zero(max_workers: int, window: Window) -> tuple[int, str]:
    """Workers for data to keep up, from a window measured in the main process:
    ``ceil(1.25 * f / w)`` clamped to ``[1, max_workers]``, and the reason."""
    fetch, work = window.fetch_s, window.work_s
    ratio = _HEADROOM * fetch / work if work > 0 else math.inf
    workers = max_workers if ratio >= max_workers else max(1, math.ceil(ratio))
    return workers, (f"; k = ceil({_HEADROOM} * f / w) workers with fetch f = "
                     f"{fetch * 1e3:.3g} ms and own work w = {work * 1e3:.3g} ms per batch, "
                     f"in [1, max_workers={max_workers}]: k = {workers}")


class Autotuner:
    """Feeds ``decide`` one window at a time from per-batch measurements.

    ``observe(wait_s, work_s)`` takes one delivered batch (the caller's wait for it in
    ``next()``, and its work since the previous ``next()`` returned; the caller leaves out the
    first batch of an epoch) and returns a new setting when one is decided. The caller applies
    it (now, or at the epoch's end) and then calls ``applied()``; batches observed meanwhile,
    and ``warmup`` batches after it, are not measured (``restart()`` drops a window whose pool
    changed under it, the same way). A batch whose ``work_s`` is a pause (at least
    ``PAUSE_MIN_S``, and over ``PAUSE`` times the median own work of the window's batches so
    far and of the last window) is left out of its window. The first window lasts ``probe``
    batches, the others ``window``. ``cpu_times`` (``read_cpu_times`` by default) is read where
    a window starts (after ``applied()`` and its warmup, or at its first measured batch) and
    where it ends, for the window's ``cpu_busy``.
    """

    def __init__(self, config: AutotuneConfig, prefetch: int,
                 cpu_times: Callable[[], CpuTimes | None] = read_cpu_times) -> None:
        self.config = config
        self.tuning = start(config, prefetch)
        self._cpu_times = cpu_times
        self._running = self.tuning.setting  # the setting applied now
        self._ignore = 0
        self._pending = False
        self._batches, self._wait_s, self._wall_s = 0, 0.0, 0.0
        self._works: list[float] = []  # the own work of the window's batches, pauses too
        self._typical: float | None = None  # the median own work of the last window
        self._cpu_start: CpuTimes | None = None
        self._started = False  # whether the window has its starting CPU times

    @property
    def done(self) -> bool:
        return self.tuning.phase == "done"

    @property
    def pending(self) -> Setting | None:
        """The setting decided but not yet ``applied()``."""
        return self.tuning.setting if self._pending else None

    def observe(self, wait_s: float, work_s: float) -> Setting | None:
        if self.done or self._pending:
            return None
        if self._ignore:
            self._ignore -= 1
            if not self._ignore:
                self._start_window()
            return None
        if not self._started:
            self._start_window()
        self._works.append(work_s)
        if self._paused(work_s):
            return None
        self._batches += 1
        self._wait_s += wait_s
        self._wall_s += wait_s + work_s
        batches = self.config.window if self.tuning.trials else self.config.probe
        if self._batches < batches or self._wall_s < self.config.min_window_s:
            return None
        busy = busy_fraction(self._cpu_start, self._cpu_times())
        window = Window(self._batches, self._wait_s, self._wall_s, busy,
                        paused=len(self._works) - self._batches)
        self._typical = statistics.median_low(self._works)
        self._reset_window()
        self._started = False
        before = self.tuning.setting
        self.tuning = decide(self.config, self.tuning, window)
        _log.info("autotune: %s", self.tuning.reason)
        if self.tuning.setting == before:
            return None
        self._pending = True
        return self.tuning.setting

    def stop(self, reason: str) -> None:
        """Tuning cannot change anything (``reason``): keep the setting applied now, measure
        no more."""
        self.tuning = replace(self.tuning, setting=self._running, phase="done", reason=reason)
        self._pending = False
        _log.info("autotune: %s", reason)

    def applied(self) -> None:
        """The decided setting runs from now on: measure again after ``warmup`` batches."""
        self._pending = False
        self._running = self.tuning.setting
        self._after_warmup()

    def restart(self) -> None:
        """The running setting's pool changed under it (``backend="auto"`` choosing threads or
        processes): drop the window measured so far, measure again after ``warmup`` batches."""
        if not (self.done or self._pending):
            self._after_warmup()

    def _paused(self, work_s: float) -> bool:
        """Whether the batch just added to the window, with ``work_s`` of the caller's own
        work, timed a pause of its loop (the class docstring); judged only for slow batches,
        so that fast loops never sort."""
        if work_s < PAUSE_MIN_S:
            return False
        typical = [self._typical] if self._typical is not None else []
        return work_s > PAUSE * statistics.median_low(self._works + typical)

    def _reset_window(self) -> None:
        self._batches, self._wait_s, self._wall_s = 0, 0.0, 0.0
        self._works = []

    def _after_warmup(self) -> None:
        self._reset_window()
        self._ignore = self.config.warmup
        self._started = False
        if not self._ignore:
            self._start_window()

    def _start_window(self) -> None:
        self._cpu_start = self._cpu_times()
        self._started = True
