"""Lightning's one-batch prefetch of unsized loaders, seen from the loader.

For a loader without ``len()`` Lightning's ``_PrefetchDataFetcher`` pulls one batch ahead of the
training step, so "batches delivered" runs one ahead of "batches trained on". A loader finds
the fetcher that iterates it (at ``iter()``, from the calling frames) and subtracts the batches
the fetcher still holds when it saves its state. Sized loaders are never prefetched.

The fit loop's ``setup_data`` also makes that first fetch before ``on_advance_start`` gives the
loader the epoch (``loops/fit_loop.py:276`` before ``:445``): ``fit_epoch()`` reads the epoch it
is about to give, so the loader can take it first (a fresh loader in a resumed or reloaded
epoch would otherwise start at epoch 0).
"""

from __future__ import annotations

import sys
import weakref
from types import FrameType
from typing import Any

__all__ = ["batches_held", "find_prefetcher", "fit_epoch"]

_FETCHER_MODULES = ("lightning.pytorch.loops.fetchers", "pytorch_lightning.loops.fetchers")
_FIT_LOOP_MODULES = ("lightning.pytorch.loops.fit_loop", "pytorch_lightning.loops.fit_loop")
_SEARCH_DEPTH = 8


def find_prefetcher() -> weakref.ref[Any] | None:
    """The Lightning prefetching data fetcher calling ``iter()`` on us, if any.

    Only frames running a fetcher's own ``__iter__`` are looked into: reading ``f_locals`` of
    any other frame would pin that frame's locals (a user's loader and its workers, say).
    """
    classes = tuple(
        cls for name in _FETCHER_MODULES
        if (module := sys.modules.get(name)) is not None
        and (cls := getattr(module, "_PrefetchDataFetcher", None)) is not None
    )
    codes = {
        method.__code__ for cls in classes for klass in cls.__mro__
        if (method := klass.__dict__.get("__iter__")) is not None and hasattr(method, "__code__")
    }
    frame: FrameType | None = sys._getframe(1)
    for _ in range(_SEARCH_DEPTH):
        if frame is None:
            return None
        if frame.f_code in codes:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, classes):
                return weakref.ref(candidate)
        frame = frame.f_back
    return None


def fit_epoch() -> int | None:
    """The epoch Lightning's fit loop gives its training loaders next (``set_epoch``), when
    its ``setup_data`` is what calls ``iter()`` on us; else ``None``."""
    loops = tuple(
        cls for name in _FIT_LOOP_MODULES
        if (module := sys.modules.get(name)) is not None
        and (cls := getattr(module, "_FitLoop", None)) is not None
    )
    codes = {cls.setup_data.__code__ for cls in loops}
    frame: FrameType | None = sys._getframe(1)
    for _ in range(2 * _SEARCH_DEPTH):
        if frame is None:
            return None
        if frame.f_code in codes:
            loop = frame.f_locals.get("self")
            return int(loop.epoch_progress.current.processed) if isinstance(loop, loops) else None
        frame = frame.f_back
    return None


def batches_held(prefetcher: weakref.ref[Any] | None) -> int:
    """Batches the fetcher has taken from the loader but not yet handed to a training step."""
    fetcher = prefetcher() if prefetcher is not None else None
    if fetcher is None or getattr(fetcher, "length", None) is not None:
        return 0
    return len(getattr(fetcher, "batches", ()))
