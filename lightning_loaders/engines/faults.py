"""What a fetch sends to the main process instead of a plain batch when user code failed.

``Failed`` carries an error raised in a worker (re-raised by the loader in the main process,
with the worker's traceback as text and the original exception as its cause; ``Raised``, one
that the pool itself re-raises); ``Skipped``
carries a batch fetched with ``on_error="skip"`` together with the samples left out of it. The
loader unwraps both on delivery, so skip counts and the cursor move together.
"""

from __future__ import annotations

import pickle
import sys
import traceback
from dataclasses import dataclass
from typing import Any, Literal, NamedTuple, NoReturn

from torch.utils.data import _utils as torch_data_utils

from lightning_loaders.errors import SampleFetchError, WorkerInitError

__all__ = ["ON_ERROR", "Escaped", "Failed", "OnError", "Raised", "SkippedSample", "Skipped",
           "captured"]

OnError = Literal["raise", "skip"]
ON_ERROR: tuple[str, ...] = ("raise", "skip")


@dataclass(frozen=True)
class SkippedSample:
    """A sample left out under ``on_error="skip"``.

    Attributes:
        epoch: the epoch of the batch it was planned in; batch: that batch's number.
        position: its position in its epoch's order; index: its dataset index.
        error: ``"TypeName: message"`` of what its fetch raised.
    """

    epoch: int
    batch: int
    position: int
    index: int
    error: str


class Skipped(NamedTuple):
    """A batch with samples skipped; ``empty`` when every sample failed (nothing to deliver)."""

    batch: Any
    skipped: tuple[SkippedSample, ...]
    empty: bool = False


class Failed:
    """An error raised by user code in a worker, captured so it crosses the process boundary
    with its attributes (torch's own wrapper keeps only the type and the text). What does not
    pickle is dropped only when it crosses (a thread's error keeps its type and cause)."""

    def __init__(self, error: SampleFetchError | WorkerInitError) -> None:
        cause = error.__cause__
        if cause is not None:
            error.worker_traceback = "".join(traceback.format_exception(cause))
            error.loader_fields["worker_traceback"] = error.worker_traceback
            error.args = (f"{error.args[0]}\n\nOriginal traceback in worker {error.worker} (pid "
                          f"{error.pid}):\n{error.worker_traceback}",)
        self.error = error
        self.cause = cause

    def __getstate__(self) -> dict[str, Any]:
        return {"error": _crossing(self.error), "cause": _cause_crossing(self.cause)}

    def reraise(self) -> NoReturn:
        """Raise the error in the main process, chained to the original exception."""
        raise self.error from self.cause


class Raised(Failed):
    """A loader error that a fetcher raised rather than returned (a shard reader's, or a
    ``worker_init_fn``'s in a worker without a batch fetcher): the pool re-raises it with the
    batch, worker and cause it names, where torch's ``ExceptionWrapper`` keeps only text."""


def captured(where: str) -> Raised | torch_data_utils.ExceptionWrapper:
    """The exception being handled in a worker, to send to the caller: a loader error whole
    (``Raised``), one that is no ``Exception`` (``SystemExit``, ``KeyboardInterrupt``: only a
    worker thread sends those) as itself (``Escaped``), any other as torch's
    ``ExceptionWrapper`` (``where`` names the worker)."""
    error = sys.exc_info()[1]
    if isinstance(error, SampleFetchError | WorkerInitError):
        return Raised(error)
    if error is not None and not isinstance(error, Exception):
        return Escaped(error)
    return torch_data_utils.ExceptionWrapper(where=where)


class Escaped(torch_data_utils.ExceptionWrapper):
    """A ``SystemExit`` or ``KeyboardInterrupt`` raised by user code in a worker thread,
    re-raised as it was, as it leaves the loop without workers (``ExceptionWrapper`` would
    rebuild it from a message: ``SystemExit``'s code became that text)."""

    def __init__(self, error: BaseException) -> None:
        super().__init__((type(error), error, error.__traceback__))
        self.error = error

    def reraise(self) -> NoReturn:
        raise self.error


def _crossing(error: SampleFetchError | WorkerInitError) -> SampleFetchError | WorkerInitError:
    """``error`` as it can cross to the main process: whole where it pickles; else with only
    the attributes that pickle (the sample index, worker, epoch and message always do), as
    its own combined type, or as the plain loader error where that type does not unpickle
    (an original whose ``__init__`` takes more than the message)."""
    if _picklable(error):
        return error
    kept = {name: value for name, value in error.__dict__.items() if _picklable(value)}
    base = SampleFetchError if isinstance(error, SampleFetchError) else WorkerInitError
    for kind in (type(error), base):
        candidate = kind.__new__(kind, *error.args)
        candidate.args = error.args
        candidate.__dict__.update(kept)
        if _picklable(candidate):
            return candidate
    return error


def _cause_crossing(cause: BaseException | None) -> Any:
    """The original exception as it can cross: whole where it pickles; else rebuilt there
    without its ``__init__`` (one that takes more than the message fails to unpickle), with
    its type, ``args`` and the attributes that pickle; ``None`` where even that fails."""
    if cause is None or _picklable(cause):
        return cause
    rebuilt = _Rebuilt(cause)
    return rebuilt if _picklable(rebuilt) else None


class _Rebuilt:
    """Pickles as its exception, unpickled by ``_rebuild`` rather than by calling the type."""

    def __init__(self, exc: BaseException) -> None:
        self.exc = exc

    def __reduce__(self) -> tuple[Any, ...]:
        kept = {name: value for name, value in vars(self.exc).items() if _picklable(value)}
        return _rebuild, (type(self.exc), self.exc.args, kept)


def _rebuild(kind: type[BaseException], args: tuple[Any, ...], attributes: dict[str, Any]
             ) -> BaseException:
    exc = kind.__new__(kind, *args)
    exc.args = args
    exc.__dict__.update(attributes)
    return exc


def _picklable(value: Any) -> bool:
    """Whether ``value`` crosses to the main process: pickled, and unpickled there (an error
    class whose ``__init__`` takes more than the message pickles, and fails to unpickle)."""
    try:
        pickle.loads(pickle.dumps(value))
    except Exception:
        return False
    return True
