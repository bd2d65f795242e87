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
from typing import TYPE_CHECKING, Any, TypeVar

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
    "exception_text",
    "fetch_error",
    "signal_name",
    "user_error",
    "user_error_type",
]

_E = TypeVar("_E", bound="LoaderError")


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
            ``collate_fn`` or ``__getitems__``; and for an iterable dataset, which has none).
        position: the sample's position in its epoch's order (``None`` with ``index``). For
            an iterable dataset: the position in its stream of the sample that raised (a
            ``ShardedSource``'s shards in order; the message also names the shard and the
            sample in it), ``None`` where unknown (past a shard of unknown length, a failure
            of the whole batch).
        epoch, batch, rank: the batch of the plan being fetched and the rank fetching it.
        worker: the worker id, or ``None`` in the main process.
        pid: the process that ran the user code.
        cause_type: the original exception's type name (kept even when it cannot be pickled).
        worker_traceback: the original traceback formatted in the worker (``None`` in the main
            process, where the chained ``__cause__`` carries the live traceback).
        loader_fields: all of the above as a dict. On an error that is also of the original
            exception's type, an attribute of that exception with one of these names keeps
            its own value (``except ParseError as e: e.position``); this dict keeps ours.
    """

    index: int | None
    position: int | None
    epoch: int | None
    batch: int | None
    rank: int | None
    worker: int | None
    pid: int | None
    cause_type: str
    worker_traceback: str | None
    loader_fields: dict[str, Any]

    def __init__(self, message: str, *, index: int | None = None, position: int | None = None,
                 epoch: int | None = None, batch: int | None = None, rank: int | None = None,
                 worker: int | None = None, pid: int | None = None, cause_type: str = "",
                 worker_traceback: str | None = None) -> None:
        super().__init__(message)
        _set_fields(self, index=index, position=position, epoch=epoch, batch=batch, rank=rank,
                    worker=worker, pid=pid, cause_type=cause_type,
                    worker_traceback=worker_traceback)


class WorkerInitError(LoaderError, RuntimeError):
    """``worker_init_fn`` raised in a worker process; the cause is the original exception.

    Attributes: ``worker``, ``pid``, ``rank``, ``epoch`` (the one the worker started in),
    ``cause_type``, ``worker_traceback``, ``loader_fields`` (as in ``SampleFetchError``).
    """

    worker: int | None
    pid: int | None
    rank: int | None
    epoch: int | None
    cause_type: str
    worker_traceback: str | None
    loader_fields: dict[str, Any]

    def __init__(self, message: str, *, worker: int | None = None, pid: int | None = None,
                 rank: int | None = None, epoch: int | None = None, cause_type: str = "",
                 worker_traceback: str | None = None) -> None:
        super().__init__(message)
        _set_fields(self, worker=worker, pid=pid, rank=rank, epoch=epoch, cause_type=cause_type,
                    worker_traceback=worker_traceback)


def _set_fields(error: SampleFetchError | WorkerInitError, **fields: Any) -> None:
    """Set ``fields`` as attributes, and as ``loader_fields``; a read-only attribute of the
    original exception's type (on a combined error) keeps its own."""
    error.loader_fields = fields
    for name, value in fields.items():
        try:
            setattr(error, name, value)
        except AttributeError:
            pass


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


def exception_text(exc: BaseException) -> str:
    """``str(exc)``, or what ``traceback`` prints when the exception's ``__str__`` raises (a
    user's error must keep its type and fields through our message, not be replaced)."""
    try:
        return str(exc)
    except Exception:
        return "<exception str() failed>"


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
    message = (f"{type(exc).__name__} in {what} of epoch {epoch}, in {where} on rank {rank}: "
               f"{exception_text(exc)}")
    fields: dict[str, Any] = {"index": index, "position": position, "epoch": epoch,
                              "batch": batch, "rank": rank, "worker": worker, "pid": pid,
                              "cause_type": type(exc).__name__}
    return user_error(SampleFetchError, exc, message, fields)


def user_error(base: type[_E], exc: BaseException, message: str, fields: dict[str, Any]) -> _E:
    """``base(message, **fields)`` for ``exc`` raised by user code, as an instance of
    ``user_error_type(base, type(exc))`` carrying ``exc``'s own fields (``errno``, ...), or of
    ``base`` alone when that type refuses the message. Raise it chained (``from exc``)."""
    kind = user_error_type(base, type(exc))
    if kind is not base:
        try:
            error = kind(message, **fields)
        except Exception:  # the original type's constructor refuses one message
            pass
        else:  # its own fields win: ``except OSError as e: if e.errno == ENOENT`` holds
            for name, value in _attributes(exc).items():
                try:
                    setattr(error, name, value)
                except (AttributeError, TypeError):
                    pass
            return error
    return base(message, **fields)


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


def _reduce_user_error(error: LoaderError) -> tuple[Any, ...]:
    """Pickled with its built-in fields (``errno``, ...), which ``BaseException``'s own
    ``__reduce__`` leaves out: ``BaseException.__setstate__`` sets them back. A combined
    class whose original type cannot be imported by name (defined in a function) crosses as
    its loader error alone, which another process can rebuild."""
    kind = type(error)
    original = kind.__mro__[2] if kind.__mro__[1] in _COMBINED_BASES else None
    if original is not None and not _importable(original):
        kind = kind.__mro__[1]
    return kind, error.args, _attributes(error)


_COMBINED: dict[tuple[type[LoaderError], type[BaseException]], type[Any]] = {}
_COMBINED_BASES: tuple[type[LoaderError], ...] = (SampleFetchError, WorkerInitError)


def user_error_type(base: type[_E], original: type[BaseException]) -> type[_E]:
    """The class of the error raised for user code that raised ``original`` (``base``:
    ``SampleFetchError``, or ``WorkerInitError`` for ``worker_init_fn``): a subclass of both
    (made once per pair), so that ``except KeyError:`` around the loop still catches a
    ``KeyError`` from ``__getitem__``, as with ``DataLoader``. ``base`` itself when
    ``original`` cannot be combined with it: a ``BaseException`` that is no ``Exception``,
    ``StopIteration`` (which would end the loop instead of failing it), an incompatible
    layout. A type that cannot be imported by name (defined in a function) is combined too;
    pickled, such an error crosses as ``base`` (another process could not rebuild the type).

    The class is named ``SampleFetchError[module:qualname]`` (dots as ``/``; likewise for
    ``WorkerInitError``) and found under that name in this module, so it pickles by reference
    into any process.
    """
    if (issubclass(original, LoaderError | StopIteration | StopAsyncIteration)
            or not issubclass(original, Exception)):
        return base
    found = _COMBINED.get((base, original))
    if found is not None:
        return found
    name = f"{base.__name__}[{original.__module__}:{original.__qualname__}]".replace(".", "/")
    kind: type[_E] = base
    try:
        kind = type(name, (base, original),
                    {"__module__": __name__, "__qualname__": name,
                     "__str__": BaseException.__str__,
                     "__reduce__": _reduce_user_error,
                     "__setstate__": BaseException.__setstate__})
    except TypeError:
        pass
    _COMBINED[(base, original)] = kind
    return kind


if not TYPE_CHECKING:  # hidden from mypy, which would accept any name imported from here

    def __getattr__(name: str) -> type[LoaderError]:
        """Find a combined error class by its name (unpickling in another process)."""
        for base in _COMBINED_BASES:
            prefix = f"{base.__name__}["
            if name.startswith(prefix) and name.endswith("]"):
                module, _, qualname = name[len(prefix):-1].replace("/", ".").partition(":")
                original = _lookup(module, qualname)
                if isinstance(original, type) and issubclass(original, BaseException):
                    kind = user_error_type(base, original)
                    if kind is not base:
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
