"""What the loaders raise when user code or a worker process fails.

Every error is a ``LoaderError``. Each names where it happened (worker id and pid, rank, epoch,
batch, sample), and keeps those as attributes, so a failure inside a worker process reads like
one in the main process. They survive pickling (a worker sends them to the main process) with
their attributes. Wrong arguments raise ``ValueError``/``TypeError`` at construction, as in
``DataLoader``.
"""

from __future__ import annotations

import importlib
import os
import signal
import types
from typing import TYPE_CHECKING, Any

from torch.utils.data import get_worker_info

from lightning_loaders.context import worker_info

__all__ = [
    "LoaderError",
    "SampleFetchError",
    "StateMismatchError",
    "WorkerCrashedError",
    "WorkerInitError",
    "WorkerTimeoutError",
    "describe_exit",
    "fetch_error",
    "fetch_error_type",
    "signal_name",
]


class LoaderError(Exception):
    """Base of the errors a loader raises while loading or restoring (catch this to handle
    them all)."""


class StateMismatchError(LoaderError, ValueError):
    """A ``state_dict`` that cannot be restored into this loader: saved for another dataset or
    configuration (each differing field is named with both values), of an unknown version, or
    corrupted. A ``ValueError`` too, as a bad argument to ``load_state_dict`` is one."""


class SampleFetchError(LoaderError, RuntimeError):
    """User code (``__getitem__``, ``__getitems__``, a transform or ``collate_fn``) raised.

    The message names the sample and where it was fetched; the original exception is the
    ``__cause__`` (in a worker process: its unpickled copy, with the worker's traceback as text
    in the message and in ``worker_traceback``).

    Attributes:
        index: the dataset index being fetched (``None`` for a failure of the whole batch:
            ``collate_fn`` or ``__getitems__``).
        position: the sample's position in its epoch's order (``None`` with ``index``).
        epoch, batch, rank: the batch of the plan being fetched and the rank fetching it.
        worker: the worker id, or ``None`` in the main process.
        pid: the process that ran the user code.
        cause_type: the original exception's type name (kept even when it cannot be pickled).
        worker_traceback: the original traceback formatted in the worker (``None`` in the main
            process, where the chained ``__cause__`` carries the live traceback).
    """

    def __init__(self, message: str, *, index: int | None = None, position: int | None = None,
                 epoch: int | None = None, batch: int | None = None, rank: int | None = None,
                 worker: int | None = None, pid: int | None = None, cause_type: str = "",
                 worker_traceback: str | None = None) -> None:
        super().__init__(message)
        self.index, self.position = index, position
        self.epoch, self.batch, self.rank = epoch, batch, rank
        self.worker, self.pid = worker, pid
        self.cause_type = cause_type
        self.worker_traceback = worker_traceback


class WorkerInitError(LoaderError, RuntimeError):
    """``worker_init_fn`` raised in a worker process; the cause is the original exception.

    Attributes: ``worker``, ``pid``, ``rank``, ``cause_type``, ``worker_traceback`` (as in
    ``SampleFetchError``).
    """

    def __init__(self, message: str, *, worker: int | None = None, pid: int | None = None,
                 rank: int | None = None, cause_type: str = "",
                 worker_traceback: str | None = None) -> None:
        super().__init__(message)
        self.worker, self.pid, self.rank = worker, pid, rank
        self.cause_type = cause_type
        self.worker_traceback = worker_traceback


class WorkerCrashedError(LoaderError, RuntimeError):
    """A worker process died (killed by a signal, or exited) and was not, or no longer,
    recovered.

    Attributes:
        worker: the id of the worker that died; pid: its process id.
        exitcode: its exit code (``-N`` when killed by signal ``N``).
        signal: the signal's name (``"SIGKILL"``), or ``None`` when it exited by itself.
        epoch, batch, rank: where the loader was (``batch`` = the next batch due).
        restarts: worker restarts already made in this epoch.
    """

    def __init__(self, message: str, *, worker: int | None = None, pid: int | None = None,
                 exitcode: int | None = None, epoch: int | None = None,
                 batch: int | None = None, rank: int | None = None, restarts: int = 0) -> None:
        super().__init__(message)
        self.worker, self.pid, self.exitcode = worker, pid, exitcode
        self.signal = signal_name(exitcode)
        self.epoch, self.batch, self.rank = epoch, batch, rank
        self.restarts = restarts


class WorkerTimeoutError(LoaderError, RuntimeError):
    """No batch arrived within ``timeout`` seconds; names the worker whose batch is due.

    Attributes: ``worker``, ``pid``, ``timeout``, ``epoch``, ``batch`` (the batch waited for),
    ``rank``.
    """

    def __init__(self, message: str, *, worker: int | None = None, pid: int | None = None,
                 timeout: float = 0.0, epoch: int | None = None, batch: int | None = None,
                 rank: int | None = None) -> None:
        super().__init__(message)
        self.worker, self.pid, self.timeout = worker, pid, timeout
        self.epoch, self.batch, self.rank = epoch, batch, rank


def fetch_error(exc: BaseException, what: str, *, epoch: int, batch: int, rank: int,
                index: int | None = None, position: int | None = None,
                where: str | None = None) -> SampleFetchError:
    """The ``SampleFetchError`` for ``exc``, raised by user code while fetching ``what`` (for
    example ``"sample index 3 (epoch position 7, batch 1)"``): the one message every engine
    gives, naming the epoch, the worker (process or thread: its id and the pid, or ``where``)
    and the rank.
    Raise it chained: ``raise fetch_error(...) from exc``."""
    info: Any = get_worker_info() or worker_info()  # a worker process, or a worker thread
    worker = info.id if info is not None else None
    pid = os.getpid()
    if where is None:
        where = f"worker {worker} (pid {pid})" if info is not None else "the main process"
    message = f"{type(exc).__name__} in {what} of epoch {epoch}, in {where} on rank {rank}: {exc}"
    fields: dict[str, Any] = {"index": index, "position": position, "epoch": epoch,
                              "batch": batch, "rank": rank, "worker": worker, "pid": pid,
                              "cause_type": type(exc).__name__}
    kind = fetch_error_type(type(exc))
    if kind is not SampleFetchError:
        try:
            error = kind(message, **fields)
        except Exception:  # the original type's constructor refuses one message
            pass
        else:
            for name, value in _attributes(exc).items():
                if name not in fields:  # ``except OSError as e: if e.errno == ENOENT`` holds
                    try:
                        setattr(error, name, value)
                    except (AttributeError, TypeError):
                        pass
            return error
    return SampleFetchError(message, **fields)


def _attributes(exc: BaseException) -> dict[str, Any]:
    """What ``exc`` holds besides its message: its own attributes (``e.code = 42``) and the
    fields of the built-in exception types it derives from (``OSError.errno`` and
    ``filename``, ``ImportError.name``, ...)."""
    found = dict(vars(exc))
    for name in _builtin_fields(type(exc)):
        try:
            found[name] = getattr(exc, name)
        except AttributeError:  # not set (``OSError.characters_written``)
            pass
    return found


def _builtin_fields(kind: type[BaseException]) -> tuple[str, ...]:
    """The data descriptors of the built-in exception types in ``kind``'s bases."""
    return tuple(dict.fromkeys(
        name for base in kind.__mro__
        if base.__module__ == "builtins" and base not in (BaseException, object)
        for name, field in vars(base).items()
        if isinstance(field, types.MemberDescriptorType | types.GetSetDescriptorType)
        and not name.startswith("__")))


def _reduce_fetch_error(error: SampleFetchError) -> tuple[Any, ...]:
    """Pickled with its built-in fields (``errno``, ...), which ``BaseException``'s own
    ``__reduce__`` leaves out: ``BaseException.__setstate__`` sets them back."""
    return type(error), error.args, _attributes(error)


_FETCH_ERROR_TYPES: dict[type[BaseException], type[SampleFetchError]] = {}
_PREFIX = "SampleFetchError["


def fetch_error_type(original: type[BaseException]) -> type[SampleFetchError]:
    """The class of the error raised for user code that raised ``original``: a subclass of
    both ``SampleFetchError`` and ``original`` (made once per type), so that ``except
    KeyError:`` around the loop still catches a ``KeyError`` from ``__getitem__``, as with
    ``DataLoader``. ``SampleFetchError`` itself when ``original`` cannot be combined with it:
    a ``BaseException`` that is no ``Exception``, ``StopIteration`` (which would end the loop
    instead of failing it), a type that cannot be imported by name (defined in a function:
    another process could not rebuild the error), an incompatible layout.

    The class is named ``SampleFetchError[module:qualname]`` (dots as ``/``) and found under
    that name in this module, so it pickles by reference into any process.
    """
    if (issubclass(original, SampleFetchError | StopIteration | StopAsyncIteration)
            or not issubclass(original, Exception)):
        return SampleFetchError
    found = _FETCH_ERROR_TYPES.get(original)
    if found is not None:
        return found
    name = f"{_PREFIX}{original.__module__}:{original.__qualname__}]".replace(".", "/")
    kind: type[SampleFetchError] = SampleFetchError
    if _importable(original):
        try:
            kind = type(name, (SampleFetchError, original),
                        {"__module__": __name__, "__qualname__": name,
                         "__str__": BaseException.__str__,
                         "__reduce__": _reduce_fetch_error,
                         "__setstate__": BaseException.__setstate__})
        except TypeError:
            pass
    _FETCH_ERROR_TYPES[original] = kind
    return kind


if not TYPE_CHECKING:  # hidden from mypy, which would accept any name imported from here

    def __getattr__(name: str) -> type[SampleFetchError]:
        """Find a combined error class by its name (unpickling in another process)."""
        if name.startswith(_PREFIX) and name.endswith("]"):
            module, _, qualname = name[len(_PREFIX):-1].replace("/", ".").partition(":")
            original = _lookup(module, qualname)
            if isinstance(original, type) and issubclass(original, BaseException):
                kind = fetch_error_type(original)
                if kind is not SampleFetchError:
                    return kind
        raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


def _importable(original: type) -> bool:
    return _lookup(original.__module__, original.__qualname__) is original


def _lookup(module: str, qualname: str) -> Any:
    try:
        found: Any = importlib.import_module(module)
        for part in qualname.split("."):
            found = getattr(found, part)
    except (ImportError, AttributeError, ValueError):
        return None
    return found


def signal_name(exitcode: int | None) -> str | None:
    """``"SIGKILL"`` for exit code ``-9``; ``None`` for a process that exited by itself."""
    if exitcode is None or exitcode >= 0:
        return None
    try:
        return signal.Signals(-exitcode).name
    except ValueError:
        return f"signal {-exitcode}"


def describe_exit(exitcode: int | None) -> str:
    """How a process ended, in words (with the usual reason for the common signals)."""
    name = signal_name(exitcode)
    if name is None:
        return "is still running" if exitcode is None else f"exited with code {exitcode}"
    reason = {
        "SIGKILL": " (often the kernel's out-of-memory killer)",
        "SIGSEGV": " (a crash in native code)",
        "SIGBUS": " (often a full /dev/shm: raise its size, e.g. docker --shm-size)",
    }.get(name, "")
    return f"was killed by {name}{reason}"
