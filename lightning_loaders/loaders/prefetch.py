"""Lightning's one-batch prefetch of unsized loaders, seen from the loader.

For a loader without ``len()`` Lightning's ``_PrefetchDataFetcher`` pulls one batch ahead of the
training step, so "batches delivered" runs one ahead of "batches trained on". A loader finds
the fetcher that iterates it (at ``iter()``, from the calling frames) and subtracts the batches
the fetcher still holds when it saves its state. Sized loaders are never prefetched.
"""

from __future__ import annotations

import sys
import weakref
from types import FrameType
from typing import Any

__all__ = ["batches_held", "find_prefetcher"]

_FETCHER_MODULES = ("lightning.pytorch.loops.fetchers", "pytorch_lightning.loops.fetchers")
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


def batches_held(prefetcher: weakref.ref[Any] | None) -> int:
    """Batches the fetcher has taken from the loader but not yet handed to a training step."""
    fetcher = prefetcher() if prefetcher is not None else None
    if fetcher is None or getattr(fetcher, "length", None) is not None:
        return 0
    return len(getattr(fetcher, "batches", ()))
