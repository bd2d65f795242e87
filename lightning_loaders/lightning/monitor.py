"""``DataStallMonitor``: how much of training is spent waiting for the next batch.

Per training batch the monitor measures the time the training loop was blocked in the loader's
``next()`` and the wall time between consecutive batches. Over a sliding window it logs

* ``data_wait_fraction``: waiting time / wall time (0 = never waits, 1 = only waits), and
* ``samples_per_sec``: samples delivered per second on this process,

to the Trainer's loggers and the progress bar, and warns once (``DataStallWarning``) with concrete
remedies when the fraction stays above a threshold. It works with any training loader.

Where the waiting time comes from: Lightning fetches the next batch between one step's
``on_train_batch_end`` and the next step's ``on_train_batch_start``, but that gap also holds
checkpoint saving, logging, progress-bar updates and, on a GPU, the wait for the previous step's
kernels (the first ``.item()`` after the step synchronises). No public hook brackets the fetch
alone. The fetch is, however, reported to ``trainer.profiler`` (the public ``Profiler.start`` /
``stop`` interface) under an action named ``...train_dataloader_next``; the monitor wraps the
Trainer's profiler for the duration of ``fit`` (forwarding every call, so a user's profiler keeps
working) to time exactly that action. The action name is a Lightning internal: if no such action
is ever seen, the monitor falls back to the public-hook gap, says so once, and the fraction
becomes an upper bound.
"""

from __future__ import annotations

import time
import warnings
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import lightning.pytorch as pl
import numpy as np
import torch
from lightning.pytorch.callbacks import Callback
from lightning.pytorch.profilers import Profiler
from torch.utils.data import IterableDataset, TensorDataset

from lightning_loaders.engines.autotune import available_cpus
from lightning_loaders.loaders.resumable import ResumableLoader

__all__ = ["DataStallMonitor", "DataStallWarning"]

_WAIT_KEY = "data_wait_fraction"
_THROUGHPUT_KEY = "samples_per_sec"
_FETCH_ACTION_SUFFIX = "train_dataloader_next"


class DataStallWarning(UserWarning):
    """The training loop spends more time waiting for data than the configured threshold."""


class DataStallMonitor(Callback):
    """Logs the fraction of training time spent waiting for batches, and throughput.

    Args:
        threshold: warn (once per ``fit``) when ``data_wait_fraction`` over a full window exceeds
            this value, in ``(0, 1]``.
        window: number of recent batches the logged values average over.
        warmup_steps: batches ignored at the start of ``fit`` (worker start-up, first-step
            compilation and caches would otherwise dominate).
        batch_size: samples per batch for ``samples_per_sec``: an int, a function of the batch,
            or ``None`` to infer it (leading dimension of the first tensor or array found in the
            batch, else the length of a list or tuple batch). If it cannot be inferred,
            throughput is not logged.
        prog_bar: also show both values in the progress bar.

    The first batch of every epoch and any batch interval that contains validation are left out:
    the values describe the steady state of the training loop. Values are per process; in
    distributed runs the loggers record rank 0's. They are logged at the Trainer's
    ``log_every_n_steps`` cadence, the steps at which it writes to its loggers, and are always
    readable as the attributes ``data_wait_fraction`` and ``samples_per_sec``.
    """

    def __init__(
        self,
        *,
        threshold: float = 0.5,
        window: int = 20,
        warmup_steps: int = 5,
        batch_size: int | Callable[[Any], int] | None = None,
        prog_bar: bool = True,
    ) -> None:
        if not 0 < threshold <= 1:
            raise ValueError(f"threshold must be in (0, 1], got {threshold!r}")
        if window < 1:
            raise ValueError(f"window must be >= 1, got {window!r}")
        if warmup_steps < 0:
            raise ValueError(f"warmup_steps must be >= 0, got {warmup_steps!r}")
        if isinstance(batch_size, int) and batch_size < 1:
            raise ValueError(f"batch_size must be >= 1 (or a function, or None), got "
                             f"{batch_size!r}")
        self.threshold = threshold
        self.window = window
        self.warmup_steps = warmup_steps
        self.batch_size = batch_size
        self.prog_bar = prog_bar
        self.data_wait_fraction: float | None = None
        """The fraction over the current window (``None`` until the warm-up is over)."""
        self.samples_per_sec: float | None = None
        """Samples per second over the current window (``None`` until known)."""
        self._timer: _FetchTimer | None = None
        self._reset()

    _intervals: deque[tuple[float, float, int | None]]
    _last_start: float | None
    _last_end: float | None
    _last_samples: int | None
    _seen: int
    _warned: bool
    _fallback_announced: bool

    # -- Lightning hooks ----------------------------------------------------------------------

    def setup(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        if stage != "fit":
            return
        self._reset()
        self._unwrap(trainer)
        holder: Any = trainer  # ``Trainer.profiler`` is a plain attribute, set in its __init__
        self._timer = _FetchTimer(holder.profiler)
        holder.profiler = self._timer

    def teardown(self, trainer: pl.Trainer, pl_module: pl.LightningModule, stage: str) -> None:
        self._unwrap(trainer)

    def on_exception(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                     exception: BaseException) -> None:
        self._unwrap(trainer)

    def on_train_epoch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_start = None

    def on_validation_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule) -> None:
        self._last_start = None

    def on_train_batch_end(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                           outputs: Any, batch: Any, batch_idx: int) -> None:
        self._last_end = time.perf_counter()

    def on_train_batch_start(self, trainer: pl.Trainer, pl_module: pl.LightningModule,
                             batch: Any, batch_idx: int) -> None:
        now = time.perf_counter()
        timer = self._timer
        fetch = timer.take() if timer is not None else 0.0
        if self._last_start is not None:
            self._record(trainer, now - self._last_start, fetch, now)
        self._last_start = now
        self._last_samples = self._samples_in(batch)
        # ``self.log`` costs Lightning a fraction of a millisecond per call, so log only on the
        # steps whose metrics the Trainer writes to its loggers; the progress bar and
        # ``callback_metrics`` keep the last value in between (0: the Trainer never logs).
        every: int = getattr(trainer, "log_every_n_steps", 1)  # set in Trainer.__init__, untyped
        if every == 0 or (trainer.global_step + 1) % every != 0:
            return
        if self.data_wait_fraction is not None:
            pl_module.log(_WAIT_KEY, self.data_wait_fraction, on_step=True, on_epoch=False,
                          prog_bar=self.prog_bar, logger=True, batch_size=1)
        if self.samples_per_sec is not None:
            pl_module.log(_THROUGHPUT_KEY, self.samples_per_sec, on_step=True, on_epoch=False,
                          prog_bar=self.prog_bar, logger=True, batch_size=1)

    # -- measurement --------------------------------------------------------------------------

    def _record(self, trainer: pl.Trainer, period: float, fetch: float, now: float) -> None:
        """Account one interval between consecutive batch starts."""
        if self._timer is None or self._timer.fetches == 0:
            wait = now - self._last_end if self._last_end is not None else 0.0
            if not self._fallback_announced:
                self._fallback_announced = True
                warnings.warn("DataStallMonitor could not observe the loader's fetch through "
                              "trainer.profiler in this Lightning version; data_wait_fraction "
                              "falls back to the time outside the training step (an upper "
                              "bound)", UserWarning, stacklevel=2)
        else:
            wait = fetch
        self._seen += 1
        if self._seen <= self.warmup_steps:
            return
        self._intervals.append((min(wait, period), period, self._last_samples))
        waited = sum(w for w, _, _ in self._intervals)
        elapsed = sum(p for _, p, _ in self._intervals)
        if elapsed <= 0:
            return
        self.data_wait_fraction = waited / elapsed
        sizes = [s for _, _, s in self._intervals]
        if all(s is not None for s in sizes):
            self.samples_per_sec = sum(s for s in sizes if s is not None) / elapsed
        if (not self._warned and len(self._intervals) == self.window
                and self.data_wait_fraction > self.threshold):
            self._warned = True
            warnings.warn(_stall_message(trainer, self.data_wait_fraction, self.threshold,
                                         self.window), DataStallWarning, stacklevel=2)

    def _samples_in(self, batch: Any) -> int | None:
        if self.batch_size is None:
            return _infer_batch_size(batch)
        if callable(self.batch_size):
            return int(self.batch_size(batch))
        return self.batch_size

    def _reset(self) -> None:
        self._intervals = deque(maxlen=self.window)
        self._last_start = None
        self._last_end = None
        self._last_samples = None
        self._seen = 0
        self._warned = False
        self._fallback_announced = False
        self.data_wait_fraction = None
        self.samples_per_sec = None

    def _unwrap(self, trainer: pl.Trainer) -> None:
        """Take our wrapper out of ``trainer.profiler``, wherever it sits in a chain of them."""
        timer, self._timer = self._timer, None
        holder: Any = trainer
        if timer is None:
            return
        if holder.profiler is timer:
            holder.profiler = timer.inner
            return
        node = holder.profiler
        while isinstance(node, _FetchTimer):
            if node.inner is timer:
                node.inner = timer.inner
                return
            node = node.inner


def _infer_batch_size(batch: Any) -> int | None:
    """Samples in ``batch``: the leading dimension of the first tensor or array found (depth
    first through mappings and sequences), else the length of a list or tuple batch."""
    found = _leading_dim(batch)
    if found is not None:
        return found
    if isinstance(batch, (list, tuple)):
        return len(batch)
    return None


def _leading_dim(obj: Any) -> int | None:
    if isinstance(obj, (torch.Tensor, np.ndarray)):
        return int(obj.shape[0]) if obj.ndim > 0 else None
    if isinstance(obj, Mapping):
        items: Any = obj.values()
    elif isinstance(obj, Sequence) and not isinstance(obj, (str, bytes)):
        items = obj
    else:
        return None
    for item in items:
        found = _leading_dim(item)
        if found is not None:
            return found
    return None


def _stall_message(trainer: pl.Trainer, fraction: float, threshold: float, window: int) -> str:
    """The warning text, with remedies that fit the loader actually in use."""
    head = (f"DataStallMonitor: the training loop waited for data {fraction:.0%} of the time "
            f"over the last {window} batches (threshold {threshold:.0%})")
    if trainer.world_size > 1:
        head += f" on rank {trainer.global_rank}"
    return head + "; the input pipeline is the bottleneck. Try:\n" + "\n".join(
        f"  - {hint}" for hint in _stall_hints(trainer))


def _stall_hints(trainer: pl.Trainer) -> list[str]:
    loader = _first_loader(trainer.train_dataloader)
    hints = []
    workers = getattr(loader, "num_workers", None)
    tunes = isinstance(loader, ResumableLoader)  # takes num_workers="auto"
    tuning = getattr(loader, "autotune", None) if tunes else None
    cpus = available_cpus()
    if getattr(loader, "gathers_in_memory", False):
        hints.append("the data is in memory and every batch is one gather in the training "
                     "process (worker processes would only add the cost of sending it): keep "
                     "the tensors on the GPU and index them there, or use larger batches")
    elif tuning is not None and tuning.phase != "done":
        hints.append(f"num_workers='auto' is still tuning: {workers} workers run now, "
                     f"{tuning.setting} decided (a change decided near an epoch's end runs "
                     f"from the next epoch)")
    elif tuning is not None:
        hints.append(f"num_workers='auto' settled on {tuning.setting} ({tuning.reason}): "
                     "cheaper per-sample work (decode, augmentation) in the dataset, or more "
                     "CPUs")
    elif workers == 0:
        auto = ", or num_workers='auto' to tune it while training" if tunes else ""
        hints.append(f"num_workers=0 fetches every batch inside the training loop: load in "
                     f"worker processes, e.g. num_workers={max(1, min(cpus - 1, 8))} (this "
                     f"process can use {cpus} CPUs){auto}")
    elif isinstance(workers, int) and 0 < workers < cpus:  # FFCV's -1: one per CPU already
        auto = " (num_workers='auto' tunes it while training)" if tunes else ""
        hints.append(f"more worker processes: num_workers={workers} now, this process can use "
                     f"{cpus} CPUs{auto}")
    else:
        hints.append("more loader worker processes, or cheaper per-sample work (decode, "
                     "augmentation) in the dataset")
    if (trainer.strategy.root_device.type == "cuda"
            and getattr(loader, "pin_memory", None) is False):
        hints.append("pin_memory=True, so host-to-GPU copies come from page-locked memory and "
                     "can overlap with compute")
    dataset = getattr(loader, "dataset", None)
    if dataset is not None and hasattr(dataset, "__getitem__") and not hasattr(
            dataset, "__getitems__") and not isinstance(dataset, IterableDataset):
        if not isinstance(dataset, TensorDataset):
            hints.append(f"vectorised fetch: give {type(dataset).__name__} a "
                         "__getitems__(indices) that reads a whole batch at once, or keep the "
                         "data in memory as tensors (TensorDataset), instead of batch_size "
                         "__getitem__ calls per batch")
        elif type(loader).__name__ != "ResumableLoader":
            hints.append("lightning_loaders.ResumableLoader gathers a TensorDataset batch with "
                         "one indexing operation instead of batch_size __getitem__ calls")
    return hints


def _first_loader(iterables: Any) -> Any:
    """The first loader in what ``trainer.train_dataloader`` returns (a loader or a collection
    of loaders)."""
    if isinstance(iterables, Mapping):
        return _first_loader(next(iter(iterables.values()), None))
    if isinstance(iterables, (list, tuple)):
        return _first_loader(iterables[0]) if iterables else None
    return iterables


class _FetchTimer(Profiler):
    """Wraps the Trainer's profiler: forwards every call and times the training fetch.

    Installed only while ``fit`` runs (see the module docstring for why this is the measuring
    point). Attributes other than its own are read from and written to the wrapped profiler.
    """

    _OWN = frozenset({"inner", "fetches", "_started", "_elapsed"})
    inner: Profiler
    fetches: int
    _started: float | None
    _elapsed: float

    def __init__(self, inner: Profiler) -> None:
        # Profiler.__init__ is not called: its attributes belong to the wrapped profiler.
        object.__setattr__(self, "inner", inner)
        object.__setattr__(self, "fetches", 0)
        object.__setattr__(self, "_started", None)
        object.__setattr__(self, "_elapsed", 0.0)

    def take(self) -> float:
        """Seconds spent fetching since the last call."""
        elapsed = self._elapsed
        self._elapsed = 0.0
        return elapsed

    def start(self, action_name: str) -> None:
        if action_name.endswith(_FETCH_ACTION_SUFFIX):
            self._started = time.perf_counter()
        self.inner.start(action_name)

    def stop(self, action_name: str) -> None:
        self.inner.stop(action_name)
        if action_name.endswith(_FETCH_ACTION_SUFFIX) and self._started is not None:
            self._elapsed += time.perf_counter() - self._started
            self._started = None
            self.fetches += 1

    def summary(self) -> str:
        return self.inner.summary()

    def describe(self) -> None:
        self.inner.describe()

    def setup(self, stage: str, local_rank: int | None = None, log_dir: str | None = None) -> None:
        self.inner.setup(stage, local_rank, log_dir)

    def teardown(self, stage: str | None) -> None:
        self.inner.teardown(stage)

    def __getattr__(self, name: str) -> Any:
        if name in _FetchTimer._OWN:
            raise AttributeError(name)
        return getattr(self.inner, name)

    def __setattr__(self, name: str, value: Any) -> None:
        if name in _FetchTimer._OWN:
            object.__setattr__(self, name, value)
        else:
            setattr(self.inner, name, value)

    def __del__(self) -> None:
        """The wrapped profiler's files are its own: nothing to close here."""
