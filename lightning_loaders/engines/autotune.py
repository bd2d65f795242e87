"""Autotuning of the worker count and prefetch depth from the measured data-wait fraction.

The loaders' order is a function of ``(seed, epoch, world size, rank)``, never of the number of
workers or of how far they prefetch, so tuning these changes speed, never data. A loader built
with ``num_workers="auto"`` (or an ``AutotuneConfig``) measures, per delivered batch, the time
its caller waited inside ``next()`` (the data wait) and the time the caller spent between two
``next()`` calls (its own work), the signal ``DataStallMonitor`` logs. ``Autotuner`` sums them
over windows of ``window`` batches and ``decide`` turns each window into the next setting:

1. The first window measures the starting setting (``start_workers``, prefetch 2 or the given
   ``prefetch_factor``); it is the best so far.
2. *Workers*: while the last window's wait fraction (wait / wall time) is above ``high_wait``,
   double the workers (0 -> 1 -> 2 -> 4 ..., at most ``max_workers``).
3. A step is kept when its seconds per batch are at least ``min_gain`` (a fraction) below the
   best's; otherwise the setting goes back to the best one and the next phase begins.
4. *Prefetch* (with workers, when ``prefetch_factor`` was not given): the same, doubling the
   batches each worker prepares ahead, up to ``max_prefetch``.
5. *Done*: the best setting stays for the rest of the run; nothing is measured any more.

Every change rebuilds the worker pool from the cursor (a fork per worker), so the rule changes
the setting at most once per window, tries at most ``max_changes`` steps (plus one return to
the best), ignores ``warmup`` batches after each change (worker start-up), and leaves out the
first batch of every epoch and the time between epochs. ``decide`` is a pure function of its
arguments, so the rule is tested by feeding it measurements.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, replace
from typing import Literal

__all__ = [
    "AutotuneConfig",
    "Autotuner",
    "Phase",
    "Setting",
    "Trial",
    "Tuning",
    "Window",
    "available_cpus",
    "decide",
    "start",
]

_log = logging.getLogger(__name__)
Phase = Literal["workers", "prefetch", "done"]
_NEXT_PHASE: dict[Phase, Phase] = {"workers": "prefetch", "prefetch": "done", "done": "done"}


def available_cpus() -> int:
    """CPUs this process may run on (its affinity mask where the platform has one)."""
    if hasattr(os, "sched_getaffinity"):
        return len(os.sched_getaffinity(0))
    return os.cpu_count() or 1


@dataclass(frozen=True, kw_only=True)
class AutotuneConfig:
    """How ``num_workers="auto"`` tunes (``num_workers=AutotuneConfig(...)`` to change it).

    Attributes:
        max_workers: the most workers tried; ``None``: the CPUs this process may run on
            (``available_cpus()``), fixed when the loader is built.
        start_workers: the workers of the first window (0: load in the main process, no fork
            until the wait fraction asks for workers).
        window: batches per measurement window (one decision per window).
        warmup: batches left out after each change (worker start-up, first prefetch).
        high_wait: the wait fraction above which more workers (then more prefetch) are tried.
        min_gain: how much faster (fraction of seconds per batch) a step must make delivery
            to be kept.
        max_prefetch: the deepest prefetch tried (batches per worker), when the loader's
            ``prefetch_factor`` is not given (a given one is kept).
        max_changes: steps tried at most in a run (each one rebuilds the worker pool).
    """

    max_workers: int | None = None
    start_workers: int = 0
    window: int = 16
    warmup: int = 4
    high_wait: float = 0.05
    min_gain: float = 0.05
    max_prefetch: int = 8
    max_changes: int = 8

    def __post_init__(self) -> None:
        for name, low in (("start_workers", 0), ("window", 1), ("warmup", 0),
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
    ``next()``, and wall seconds (waits plus the caller's work between ``next()`` calls)."""

    batches: int
    wait_s: float
    wall_s: float

    @property
    def wait_fraction(self) -> float:
        """Waiting time / wall time (0: never waits for data, 1: only waits)."""
        return self.wait_s / self.wall_s if self.wall_s > 0 else 0.0

    @property
    def seconds_per_batch(self) -> float:
        return self.wall_s / self.batches


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
    docstring for the rule). ``config`` must be ``resolved()``."""
    assert config.max_workers is not None
    if tuning.phase == "done":
        return tuning
    trial = Trial(tuning.setting, window)
    best: Trial | None = tuning.best
    phase: Phase = tuning.phase
    speed = f"{window.seconds_per_batch * 1e3:.3g} ms/batch"
    if best is None or window.seconds_per_batch < (best.window.seconds_per_batch
                                                   * (1 - config.min_gain)):
        best = base = trial
        reason = f"{trial.setting}: wait fraction {window.wait_fraction:.2f}, {speed}"
    else:
        base, phase = best, _NEXT_PHASE[phase]
        best_speed = f"{best.window.seconds_per_batch * 1e3:.3g} ms/batch"
        reason = f"{trial.setting} did not help ({speed}, best {best_speed})"
    step: Setting | None = None
    if tuning.changes < config.max_changes:
        phase, step = _next_step(config, phase, base)
    else:
        phase, reason = "done", f"{reason}; no more changes (max_changes={config.max_changes})"
    target = step or best.setting
    if step is not None:
        reason = f"{reason}: trying {step}"
    else:
        phase = "done"
        if base.window.wait_fraction <= config.high_wait:
            reason = f"{reason}: wait fraction at most high_wait={config.high_wait}"
        reason = f"{reason}; settled on {target}"
    changes = tuning.changes + (target != tuning.setting)
    return Tuning(target, best, phase, changes, (*tuning.trials, trial), reason)


def _next_step(config: AutotuneConfig, phase: Phase, base: Trial) -> tuple[Phase, Setting | None]:
    """The next setting to try from ``base`` (``None``: nothing left to try)."""
    assert config.max_workers is not None
    setting = base.setting
    if base.window.wait_fraction <= config.high_wait:
        return "done", None
    if phase == "workers" and setting.workers < config.max_workers:
        workers = min(config.max_workers, max(1, 2 * setting.workers))
        return phase, replace(setting, workers=workers)
    if phase in ("workers", "prefetch") and 0 < setting.workers and (
            setting.prefetch < config.max_prefetch):
        return "prefetch", replace(setting, prefetch=min(config.max_prefetch,
                                                         2 * setting.prefetch))
    return "done", None


class Autotuner:
    """Feeds ``decide`` one window at a time from per-batch measurements.

    ``observe(wait_s, work_s)`` takes one delivered batch (the caller's wait for it in
    ``next()``, and its work since the previous ``next()`` returned; the caller leaves out the
    first batch of an epoch) and returns a new setting when one is decided. The caller applies
    it (now, or at the epoch's end) and then calls ``applied()``; batches observed meanwhile,
    and ``warmup`` batches after it, are not measured.
    """

    def __init__(self, config: AutotuneConfig, prefetch: int) -> None:
        self.config = config
        self.tuning = start(config, prefetch)
        self._running = self.tuning.setting  # the setting applied now
        self._ignore = 0
        self._pending = False
        self._batches, self._wait_s, self._wall_s = 0, 0.0, 0.0

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
            return None
        self._batches += 1
        self._wait_s += wait_s
        self._wall_s += wait_s + work_s
        if self._batches < self.config.window:
            return None
        window = Window(self._batches, self._wait_s, self._wall_s)
        self._batches, self._wait_s, self._wall_s = 0, 0.0, 0.0
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
        self._ignore = self.config.warmup
