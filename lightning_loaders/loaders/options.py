"""The loader's options (``LoaderOptions``) and their construction-time checks: each error
names the value and the fix.

Shared by the loaders of this package so that an impossible setting fails when the loader is
built, not minutes later in a worker process or at the first batch.
"""

from __future__ import annotations

import multiprocessing
import operator
import pickle
from collections.abc import Callable
from dataclasses import dataclass, replace
from multiprocessing import context as mp_context
from multiprocessing.reduction import ForkingPickler
from typing import Any, Literal, cast

import torch
from torch.utils.data import default_convert

from lightning_loaders.engines.autotune import AutotuneConfig
from lightning_loaders.engines.faults import ON_ERROR, OnError
from lightning_loaders.loaders.tuned import is_auto
from lightning_loaders.schedule.map_plan import LastBatch

__all__ = ["BACKENDS", "LoaderOptions", "check_loader_arguments", "check_picklable",
           "int_counts", "start_method", "unbatched_conversion"]

BACKENDS: tuple[str, ...] = ("process", "thread", "auto")
"""What ``num_workers`` workers are: worker processes, threads of this process, or
threads measured during the first batches and swapped for processes where those pay more."""


@dataclass(frozen=True)
class LoaderOptions:
    """What a loader was constructed with besides the dataset: one field per argument of
    ``ResumableLoader`` (see its docstring), as given."""

    batch_size: int | None
    shuffle: bool | None
    sampler: Any
    batch_sampler: Any
    num_workers: int | Literal["auto"] | AutotuneConfig
    collate_fn: Callable[[list[Any]], Any] | None
    pin_memory: bool
    drop_last: bool
    timeout: float
    worker_init_fn: Callable[[int], None] | None
    multiprocessing_context: Any
    generator: torch.Generator | None
    prefetch_factor: int | None
    persistent_workers: bool | None
    pin_memory_device: str
    in_order: bool
    seed: int | None
    last_batch: LastBatch | None
    rank: int | None
    world_size: int | None
    on_error: OnError
    max_worker_restarts: int
    evaluation: bool
    shuffle_buffer: int
    sync_interval: int
    partitions: int | None = None
    snapshot_every_n_steps: int | None = None
    backend: str = "process"
    compare_ranks: bool | None = None


def check_loader_arguments(*, batch_size: Any, num_workers: Any, timeout: Any,
                           prefetch_factor: Any, persistent_workers: Any, collate_fn: Any,
                           worker_init_fn: Any, multiprocessing_context: Any, on_error: Any,
                           max_worker_restarts: Any, snapshot_every_n_steps: Any = None,
                           backend: Any = "process", compare_ranks: Any = None) -> None:
    """Raise ``ValueError``/``TypeError`` for arguments no loader can run with."""
    if not _is_int(batch_size) or batch_size < 1:
        raise ValueError(f"batch_size must be an int >= 1, got {batch_size!r} (or None, for "
                         "unbatched loading)")
    if snapshot_every_n_steps is not None and (not _is_int(snapshot_every_n_steps)
                                               or snapshot_every_n_steps < 1):
        raise ValueError(f"snapshot_every_n_steps must be an int >= 1, got "
                         f"{snapshot_every_n_steps!r} (it is accepted and ignored: the state "
                         "is exact at every step)")
    if not is_auto(num_workers) and (not _is_index(num_workers) or num_workers < 0):
        raise ValueError(f"num_workers must be an int >= 0, got {num_workers!r}: use 0 to load "
                         "in the main process, the number of worker processes to start, or "
                         "'auto' (or an AutotuneConfig) to tune it while loading")
    if not isinstance(timeout, int | float) or isinstance(timeout, bool) or timeout < 0:
        raise ValueError(f"timeout must be a number >= 0, got {timeout!r}: use 0 to wait "
                         "without limit, or the seconds a worker may take for one batch")
    if timeout > 0 and num_workers == 0:
        raise ValueError(f"timeout={timeout} needs worker processes: it limits how long the "
                         "main process waits for a worker; set num_workers > 0 or timeout=0")
    if prefetch_factor is not None:
        if num_workers == 0:
            raise ValueError(f"prefetch_factor={prefetch_factor} needs num_workers > 0 (as in "
                             "DataLoader): set num_workers, or drop prefetch_factor")
        if not _is_index(prefetch_factor) or prefetch_factor < 1:
            raise ValueError(f"prefetch_factor must be an int >= 1, got {prefetch_factor!r} "
                             "(batches each worker prepares ahead; default 2)")
    if persistent_workers and num_workers == 0:
        raise ValueError("persistent_workers=True needs num_workers > 0 (as in DataLoader): "
                         "set num_workers, or drop persistent_workers")
    for name, fn in (("collate_fn", collate_fn), ("worker_init_fn", worker_init_fn)):
        if fn is not None and not callable(fn):
            raise TypeError(f"{name} must be callable, got a {type(fn).__name__}: {fn!r}")
    if multiprocessing_context is not None and num_workers == 0:
        raise ValueError(f"multiprocessing_context={multiprocessing_context!r} needs "
                         "num_workers > 0 (as in DataLoader): set num_workers, or drop it")
    if isinstance(multiprocessing_context, str):
        methods = multiprocessing.get_all_start_methods()
        if multiprocessing_context not in methods:
            raise ValueError(f"multiprocessing_context={multiprocessing_context!r} is not a "
                             f"start method on this platform: use one of {methods}")
    elif multiprocessing_context is not None and not callable(
            getattr(multiprocessing_context, "get_start_method", None)):
        raise TypeError(f"multiprocessing_context must be a start method's name or a "
                        f"multiprocessing context, got {multiprocessing_context!r}")
    if backend not in BACKENDS:
        raise ValueError(f"backend must be one of {BACKENDS}, got {backend!r}: 'process' for "
                         "worker processes, 'thread' for worker threads (when fetching releases "
                         "the GIL), 'auto' to measure which pays during the first batches")
    if compare_ranks is not None and not isinstance(compare_ranks, bool):
        raise ValueError(f"compare_ranks must be None, True or False, got {compare_ranks!r}: "
                         "None compares the ranks' epochs in Lightning's loops only, True in "
                         "any loop (every rank iterates alike, on its main thread), False never")
    if on_error not in ON_ERROR:
        raise ValueError(f"on_error must be one of {ON_ERROR}, got {on_error!r}")
    if not _is_int(max_worker_restarts) or max_worker_restarts < 0:
        raise ValueError(f"max_worker_restarts must be an int >= 0, got "
                         f"{max_worker_restarts!r}: use 0 to raise at the first worker crash")


def int_counts(options: LoaderOptions) -> LoaderOptions:
    """``options`` with a checked ``num_workers`` and ``prefetch_factor`` as ints: any integral
    number (a numpy integer too) is taken, as ``DataLoader`` takes it."""
    workers = options.num_workers
    if not isinstance(workers, str | AutotuneConfig):
        workers = operator.index(workers)
    prefetch = options.prefetch_factor
    return replace(options, num_workers=workers,
                   prefetch_factor=None if prefetch is None else operator.index(prefetch))


def unbatched_conversion(options: LoaderOptions) -> Callable[[Any], Any]:
    """What ``batch_size=None`` applies to each sample (or bulk read): the ``collate_fn``, else
    ``default_convert``. ``drop_last`` is refused, as ``DataLoader`` refuses it."""
    if options.drop_last:
        raise ValueError("batch_size=None option disables auto-batching and is mutually "
                         "exclusive with drop_last (as in DataLoader)")
    return default_convert if options.collate_fn is None else options.collate_fn


def start_method(multiprocessing_context: Any) -> str:
    """The start method worker processes will use (without fixing the process default)."""
    if multiprocessing_context is None:
        chosen = multiprocessing.get_start_method(allow_none=True)
        return chosen or multiprocessing.get_all_start_methods()[0]
    if isinstance(multiprocessing_context, str):
        return multiprocessing_context
    return str(multiprocessing_context.get_start_method())


def check_picklable(method: str, **objects: Any) -> None:
    """Workers started by ``spawn``/``forkserver`` receive these pickled: refuse the ones that
    cannot be, naming them and the fix (``fork`` copies the process, so anything works).

    They are pickled as a worker's start pickles them (``ForkingPickler``, with a process
    being started), so what pickles only then passes too: ``multiprocessing``'s ``Value``,
    ``Lock`` and ``Queue``, and tensors (moved to shared memory, as the start would)."""
    if method == "fork":
        return
    for name, value in objects.items():
        if value is None:
            continue
        mp_context.set_spawning_popen(cast(Any, _TrialStart()))  # stands in for a Popen
        try:
            ForkingPickler(_Discard(), pickle.HIGHEST_PROTOCOL).dump(value)
        except Exception as exc:
            raise ValueError(
                f"the {name} cannot be pickled ({type(exc).__name__}: {exc}), but worker "
                f"processes started with {method!r} receive it pickled. Define its class or "
                "function at module level (not inside a function or as a lambda) and keep "
                "open files, locks and connections out of it (open them in worker_init_fn); "
                "or use multiprocessing_context='fork' where available, or num_workers=0"
            ) from exc
        finally:
            mp_context.set_spawning_popen(None)


class _NamedFd:
    """A file descriptor named in a pickle, as a process being started would receive it."""

    def __init__(self, fd: int) -> None:
        self.fd = fd


class _TrialStart:
    """Stands in for a worker process being started while ``check_picklable`` pickles for it:
    file descriptors are named, never handed over."""

    DupFd = _NamedFd

    @staticmethod
    def duplicate_for_child(fd: int) -> int:
        return fd


class _Discard:
    """A file that forgets what is written: pickling only to check that it works."""

    def write(self, data: bytes) -> int:
        return len(data)


def _is_int(value: Any) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _is_index(value: Any) -> bool:
    """An integral number that ``operator.index`` takes (a numpy integer too), not a bool."""
    try:
        operator.index(value)
    except TypeError:
        return False
    return not isinstance(value, bool)

