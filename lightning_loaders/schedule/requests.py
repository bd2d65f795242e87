"""What a schedule asks an engine for, and what comes back.

A map-style schedule sends ``BatchRequest``s (the dataset indices of one planned batch); a
shard schedule sends ``SlotRequest``s (one batch of one (rank, worker) slot, from the slot's
``Cursor``) or ``PartRequest``s (one batch cut from canonical partitions), and gets a
``Delivered`` batch or a ``SlotEnd``. All are plain tuples, so they cross to worker processes
cheaply and save as plain lists.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import numpy as np

__all__ = [
    "SKIP",
    "BatchRequest",
    "Cursor",
    "Delivered",
    "PartRequest",
    "SlotEnd",
    "SlotRequest",
]


class BatchRequest(NamedTuple):
    """One batch of the plan, as sent to a worker."""

    epoch: int
    batch: int
    rank: int
    sample_epochs: np.ndarray
    positions: np.ndarray
    indices: np.ndarray

    def __reduce__(self) -> tuple[Any, tuple[Any, ...]]:
        """Pickled with its arrays as raw bytes: about half the time numpy's own pickling
        takes (10.5 against 19.6 us to pickle and unpickle 32 samples' request here), on each
        request a worker process gets."""
        arrays = (self.sample_epochs, self.positions, self.indices)
        return _batch_request, (self.epoch, self.batch, self.rank,
                                *((a.dtype.str, a.shape, a.tobytes()) for a in arrays))


def _batch_request(epoch: int, batch: int, rank: int,
                   *arrays: tuple[str, tuple[int, ...], bytes]) -> BatchRequest:
    """A pickled ``BatchRequest`` again, its arrays writable, as unpickled ones are."""
    sample_epochs, positions, indices = (np.frombuffer(bytearray(data), dtype).reshape(shape)
                                         for dtype, shape, data in arrays)
    return BatchRequest(epoch, batch, rank, sample_epochs, positions, indices)


class Cursor(NamedTuple):
    """Where a slot stands; saved as a plain list."""

    batches: int  # batches of the slot delivered
    emitted: int  # samples of the slot delivered
    window_emitted: int  # samples delivered before the current shuffle window
    piece: int  # the window's first sample: index into the slot's pieces ...
    offset: int  # ... and its position in that piece's shard
    reader_state: Any  # the shard iterator's state_dict() there, if it has one
    exhausted: bool  # the slot has delivered its last batch


class SlotRequest(NamedTuple):
    """One batch of one slot, as sent to a worker (``start=None``: a skip request, answered
    with ``SlotEnd(-1)``, which only keeps requests and workers in step)."""

    generation: int
    epoch: int
    rank: int
    world_size: int
    slot: int
    batch: int
    size: int
    start: Cursor | None  # the slot's cursor when this generation began
    origin: tuple[int, int] = (0, 0)  # "rollover": where the plan cuts the stream from


class PartRequest(NamedTuple):
    """One batch of a rank planned over canonical partitions, as sent to a worker: the
    ``segments`` ``(partition, first sample in its stream, count)`` it is made of."""

    generation: int
    epoch: int
    rank: int
    world_size: int
    slot: int
    batch: int
    partitions: int
    segments: tuple[tuple[int, int, int], ...]


class Delivered(NamedTuple):
    """A slot's batch, as a worker answers it."""

    slot: int
    batch: int
    data: Any
    cursor: Cursor | None  # after this batch (unknown lengths only)
    head: int | None = None  # a plain stream's first sample's digest, where the slot opened it


class SlotEnd(NamedTuple):
    """The slot has no batch left (``slot=-1``: the answer to a skip request)."""

    slot: int
    end: int | None = None  # a plain stream of unknown length: the position its copy ended at


SKIP = SlotRequest(-1, -1, -1, -1, -1, -1, 0, None)
