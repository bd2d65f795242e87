"""``num_workers="auto"``: a loader's iterator timed for its ``Autotuner``, and the changes it
decides applied by rebuilding the worker pool from the cursor.

The rule is ``lightning_loaders.engines.autotune``'s. Here each delivered batch is timed: the
caller's wait inside ``next()`` and its work since the previous ``next()`` returned; the first
batch of every iterator (an epoch's start, or a new ``iter()``) is left out, and so is the time
between epochs. A decided setting is applied by ``apply`` (the loader sets ``num_workers`` and
``prefetch_factor`` and closes its pool; the next batch comes from a new pool, at the cursor),
at once when ``window`` batches or more are left in the epoch, else at the epoch's end, where
no prefetched batch is thrown away. Batches are not measured while the workers are not yet
what they will stay (``backend="auto"`` trying threads, then switching to processes), and
``warmup`` batches after that are left out too: a window times one kind of pool. Because the
order never depends on the layout, this changes speed, never data, and ``state_dict()`` is the
same cursor.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, nullcontext
from typing import Any

from lightning_loaders.engines.autotune import AutotuneConfig, Autotuner, Setting

__all__ = ["AUTO", "TunedDelivery", "autotuner_for", "is_auto"]

AUTO = "auto"


def is_auto(num_workers: Any) -> bool:
    """Whether ``num_workers`` asks for autotuning (``"auto"`` or an ``AutotuneConfig``)."""
    return isinstance(num_workers, AutotuneConfig) or (isinstance(num_workers, str)
                                                       and num_workers == AUTO)


def autotuner_for(num_workers: Any, prefetch_factor: int | None) -> Autotuner | None:
    """The autotuner ``num_workers`` asks for (``None`` for a fixed count). A given
    ``prefetch_factor`` is kept; otherwise prefetch starts at 2 (``DataLoader``'s default)."""
    if not is_auto(num_workers):
        return None
    config = num_workers if isinstance(num_workers, AutotuneConfig) else AutotuneConfig()
    return Autotuner(config.resolved(prefetch_factor), prefetch_factor or 2)


class TunedDelivery:
    """A loader's iterator (``inner``) whose batches are timed for ``tuner``; ``apply`` runs a
    setting (the pool restarts from the cursor), ``batches_left`` says how many batches the
    epoch has left (``None``: unknown) and ``untunable``, asked after an iterator's first
    batch, why no setting could change the speed (``None``: it can), which stops the tuning;
    ``settled`` says whether the workers are what they will stay (``False`` while
    ``backend="auto"`` is still choosing: those batches are not measured); ``serial()``, the
    loader's lock, is held through each ``next()``, so that a setting is applied while no
    other thread drives the pool; ``take_back``, called when this ``next()`` raises after
    ``inner``'s returned a batch, takes that batch's count back."""

    def __init__(self, inner: Iterator[Any], tuner: Autotuner,
                 apply: Callable[[Setting], None], batches_left: Callable[[], int | None],
                 untunable: Callable[[], str | None], *,
                 settled: Callable[[], bool] = lambda: True,
                 serial: Callable[[], AbstractContextManager[Any]] = nullcontext,
                 take_back: Callable[[], None] = lambda: None) -> None:
        self._serial = serial
        self._take_back = take_back
        self._inner = inner
        self._tuner = tuner
        self._apply = apply
        self._batches_left = batches_left
        self._untunable = untunable
        self._settled = settled
        self._settling = False  # a batch came from workers that were not settled
        self._returned: float | None = None  # when the previous next() returned a batch

    def __iter__(self) -> TunedDelivery:
        return self

    def __next__(self) -> Any:
        counted = False  # the inner next() returned a batch, which this one has to return
        try:
            with self._serial():
                if self._returned is None:
                    self._apply_pending()
                called = time.perf_counter()
                try:
                    batch = next(self._inner)
                except BaseException:
                    self._returned = None
                    self._apply_pending()  # at the epoch's end, or before a retry
                    raise
                counted = True
                now = time.perf_counter()
                if self._returned is None and not self._tuner.done:
                    reason = self._untunable()
                    if reason is not None:
                        self._tuner.stop(reason)
                elif self._returned is not None:
                    self._measure(now - called, called - self._returned)
                self._returned = now
                return batch
        except BaseException:
            if counted:  # a Ctrl-C after the inner next() returned: the batch comes again
                self._returned = None
                self._take_back()
            raise

    def _measure(self, wait_s: float, work_s: float) -> None:
        """Time a batch for the tuner, and apply a decided setting when enough of the epoch is
        left; a batch from workers not yet settled restarts the window instead (and the first
        settled one too: a warmup follows the switch)."""
        if self._tuner.done:
            return
        settled = self._settled()
        if self._settling or not settled:
            self._settling = not settled
            self._tuner.restart()
            return
        decided = self._tuner.observe(wait_s, work_s)
        left = self._batches_left() if decided is not None else None
        if decided is not None and (left is None or left >= self._tuner.config.window):
            self._apply_pending()

    def _apply_pending(self) -> None:
        setting = self._tuner.pending
        if setting is not None:
            self._apply(setting)
            self._tuner.applied()
