"""Lightning's one-batch prefetch of unsized loaders, seen from the loader.

For a loader without ``len()`` Lightning's ``_PrefetchDataFetcher`` pulls one batch ahead of the
training step, so "batches delivered" runs one ahead of "batches trained on". A loader finds
the fetcher that iterates it (at ``iter()``, from the calling frames), notes at each ``next()``
the fetcher's list of held batches and how long it will then be (``HeldNote``), and subtracts
the batches held when it saves its state (also after an ``iter()`` inside the fetcher's
``next()``: a ``CombinedLoader`` in ``max_size_cycle`` iterating an ended member again). The
note keeps the list: a fetcher dropped or torn down while it held batches (a restart sets the
data up twice; ``max_steps`` ends mid-epoch) never trained on them. Sized loaders are never
prefetched.

The fit loop's ``setup_data`` also makes that first fetch before ``on_advance_start`` gives the
loader the epoch (``loops/fit_loop.py:276`` before ``:445``): ``fit_epoch()`` reads the epoch it
is about to give, so the loader can take it first (a fresh loader in a resumed or reloaded
epoch would otherwise start at epoch 0; a restored one at its epoch's end, its next epoch).
"""

from __future__ import annotations

import sys
import threading
import weakref
from types import FrameType
from typing import Any, NamedTuple

__all__ = ["HeldNote", "batches_after", "batches_held", "find_prefetcher", "fit_epoch",
           "lightning_fetches", "note_held"]

_FETCHER_MODULES = ("lightning.pytorch.loops.fetchers", "pytorch_lightning.loops.fetchers")
_FIT_LOOP_MODULES = ("lightning.pytorch.loops.fit_loop", "pytorch_lightning.loops.fit_loop")
_SEARCH_DEPTH = 8


def find_prefetcher() -> weakref.ref[Any] | None:
    """The Lightning prefetching data fetcher calling ``iter()`` on us, if any: from its
    ``__iter__``, or from its ``__next__`` where a ``CombinedLoader`` (``max_size_cycle``)
    iterates an ended member again for the batch the fetcher then holds."""
    fetcher = _caller(_FETCHER_MODULES, "_PrefetchDataFetcher", ("__iter__", "__next__"),
                      _SEARCH_DEPTH)
    return None if fetcher is None else weakref.ref(fetcher)


def lightning_fetches() -> bool:
    """Whether one of Lightning's data fetchers calls ``iter()`` on us, on the main thread:
    its loops iterate every rank's loaders alike, at the same point of the program, where the
    ranks may run a collective. A loop of the user's may iterate on one rank alone (rank-zero
    evaluation, ``prepare_data``), or in a thread beside DDP's own collectives."""
    return (threading.current_thread() is threading.main_thread()
            and _caller(_FETCHER_MODULES, "_DataFetcher", ("__iter__",), _SEARCH_DEPTH)
            is not None)


def fit_epoch() -> int | None:
    """The epoch Lightning's fit loop gives its training loaders next (``set_epoch``), when
    its ``setup_data`` is what calls ``iter()`` on us; else ``None``. A restart after an
    epoch's last step gives the next one: the loop's ``reset``, after ``setup_data``, counts
    that epoch processed (``loops/fit_loop.py:398-404``)."""
    loop = _caller(_FIT_LOOP_MODULES, "_FitLoop", ("setup_data",), 2 * _SEARCH_DEPTH)
    if loop is None:
        return None
    return int(loop.epoch_progress.current.processed) + _ends_on_restart(loop)


def _ends_on_restart(loop: Any) -> bool:
    """Whether the fit loop restarts after the last step of its epoch (in
    ``on_train_batch_end``), which its ``reset`` then counts processed: its restart stage
    and the epoch loop's, as ``update_restart_stage`` decides them, before it runs."""
    epochs, batches = loop.epoch_progress.total, loop.epoch_loop.batch_progress
    steps = batches.total
    return bool(loop.restarting and epochs.started == epochs.ready
                and epochs.processed == epochs.started - 1 == epochs.completed
                and steps.started == steps.ready == steps.processed == steps.completed + 1
                and batches.is_last_batch)


def _caller(modules: tuple[str, ...], class_name: str, methods: tuple[str, ...], depth: int
            ) -> Any:
    """The instance of ``class_name`` (from the first of ``modules`` imported) one of whose
    ``methods`` runs in one of the ``depth`` frames calling our caller, if any.

    Only frames running that method are looked into: reading ``f_locals`` of any other frame
    would pin that frame's locals (a user's loader and its workers, say).
    """
    classes = tuple(
        cls for name in modules
        if (module := sys.modules.get(name)) is not None
        and (cls := getattr(module, class_name, None)) is not None
    )
    codes = {
        function.__code__ for cls in classes for klass in cls.__mro__ for method in methods
        if (function := klass.__dict__.get(method)) is not None and hasattr(function, "__code__")
    }
    frame: FrameType | None = sys._getframe(2)
    for _ in range(depth):
        if frame is None:
            return None
        if frame.f_code in codes:
            candidate = frame.f_locals.get("self")
            if isinstance(candidate, classes):
                return candidate
        frame = frame.f_back
    return None


class HeldNote(NamedTuple):
    """A prefetching fetcher's list of held batches, and its length once the ``next()`` it
    was making on a loader returned; the list is kept, not copied."""

    batches: list[Any]
    length: int


def note_held(prefetcher: weakref.ref[Any] | None, handed: bool) -> HeldNote | None:
    """The note to keep as the fetcher's ``next()`` on us returns (``handed``: with a batch,
    which it then appends); ``None`` where nothing is prefetched."""
    fetcher = prefetcher() if prefetcher is not None else None
    batches = getattr(fetcher, "batches", None)
    if not isinstance(batches, list) or getattr(fetcher, "length", None) is not None:
        return None
    return HeldNote(batches, len(batches) + handed)


def batches_held(note: HeldNote | None) -> int:
    """Batches of ours the fetcher holds, not yet handed to a step. Its ``next()`` pops a
    held batch before it asks us for the next, so only the batch we hand over can join the
    list after our note, and it may not: a ``CombinedLoader`` drops it when a member after us
    ends (``min_size``). A fetcher dropped or torn down (which empties it by making a new list)
    leaves the list as it was."""
    return 0 if note is None else min(note.length, len(note.batches))


def batches_after(note: HeldNote | None, unused: int) -> int:
    """Batches of ours a state leaves out: those the fetcher holds (``batches_held``) or, with
    ``unused`` batches taken from it and not used yet (a training step in progress), those and
    every batch we delivered after them: the fetcher asked for one more as it handed the
    step's over, which a ``CombinedLoader`` drops when a member after us has ended
    (``min_size``) and a restarted step asks for again."""
    if not unused:
        return batches_held(note)
    return unused + (0 if note is None else note.length)
