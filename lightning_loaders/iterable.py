"""``ResumableIterableLoader``: iterable datasets, sharded over ranks and workers, with equal
batch counts on every rank and an exact resume. ``ResumableLoader(iterable_dataset, ...)``
returns one.

Slots and shards
    Every (rank, worker) pair is a *slot*; a rank has ``max(1, num_workers)`` slots. In every
    epoch each slot reads a fixed list of *pieces* (a shard, or a part of one) and cuts its own
    batches from them. The main process interleaves the slots' batches round-robin (slot 0's
    first batch, slot 1's first, ..., slot 0's second, ...; a finished slot drops out), so the
    stream of a rank is a pure function of ``(seed, epoch, world_size, num_workers)`` and the
    shards. Shards come from a ``ShardedSource`` (see ``lightning_loaders.shards``).

The plan of an epoch
    The shard order is reshuffled per epoch (``shuffle=True``), keyed by ``(seed, epoch)``.

    *Known lengths* (the source declares ``shard_lengths``): the epoch's samples are the shards
    laid end to end in that order; rank ``r`` reads a contiguous ``1/world_size`` of them and
    each of its slots a contiguous part of that, so shards may be split between slots (opened
    mid-shard with ``open_shard(index, start)``). Batch counts are fixed before the epoch
    starts and equal on every rank: ``"keep"`` reads every sample once (the last batches of a
    rank may be smaller, never empty), ``"drop"`` reads only full batches (the tail of the
    epoch's order is dropped), ``"pad"`` fills every batch by wrapping around to the start of
    the epoch's order, ``"rollover"`` carries the tail over to open the next epoch. ``len()``
    is exact and the saved state is O(1).

    *Unknown lengths*: whole shards are dealt out, rank first, in the epoch's order. Each slot
    reads its shards to the end (``"keep"`` delivers its short last batch, ``"drop"`` does
    not). In one process every sample is read. Under DDP, ranks cannot know in advance who
    runs out first, so every ``sync_interval`` batches they agree (one ``all_reduce`` of an
    int, on the main thread, inside ``next()``) on how many batches all of them still have:
    the epoch ends on every rank when the first rank runs out, and the other ranks' remaining
    samples are not read that epoch (a warning says so once). No rank ever waits for a batch
    another rank does not have, so there is no hang (this needs an initialised process group,
    as under Lightning's DDP; without one, several ranks of unknown length are refused).
    ``len()`` raises ``TypeError``; Lightning then prefetches one batch, which the saved state
    does not count. ``"pad"`` and ``"rollover"`` need known lengths.

    *Plain* ``IterableDataset`` *(no shards)*: the strided fallback. Every slot iterates the
    whole dataset and keeps every ``k``-th sample (``k`` = world size x slots per rank), so it
    reads ``k`` times the data, and a resume re-reads the skipped part of the stream: slower,
    but sharded and resumable. A dataset
    with ``__len__`` counts as known length (equal batch counts as above, per slot), else
    unknown. The dataset must yield the same stream in every process (do not shard it by hand
    with ``get_worker_info()``); its ``set_epoch(epoch)``, if any, is called before each epoch.

    ``shuffle_buffer=n`` additionally mixes samples within a slot: its stream is cut into
    windows of ``n`` samples, each emitted in a permutation keyed by ``(seed, epoch, rank,
    slot, window)``.

Exact resume
    The cursor is the number of batches delivered to the caller (never counting prefetched
    ones, nor the batch Lightning's fetcher holds ahead of the training step). With known
    lengths every slot's position follows from it. With unknown lengths every slot reports its
    position (piece, offset in the shard, and the shard iterator's own ``state_dict()`` if it
    has one) with every batch; ``state_dict()`` gathers all ranks' positions with
    ``all_gather_object`` (every rank calls it when Lightning checkpoints), so the state rank 0
    saves restores every rank. Resuming mid-epoch with another ``num_workers`` or world size is
    refused with an error saying why (the slots' streams would differ); at an epoch boundary
    any configuration resumes. A worker process that dies is replaced the same way: all
    workers restart from the position of the last batch received, so the stream goes on as if
    nothing happened (at most ``max_worker_restarts`` times per epoch).
"""

from __future__ import annotations

import functools
import itertools
import logging
import os
import traceback
import warnings
from collections import deque
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any, NamedTuple

import numpy as np
import torch
import torch.distributed as dist
from torch.utils.data import Dataset, IterableDataset, Sampler, default_collate
from torch.utils.data import get_worker_info as torch_worker_info

from lightning_loaders._faults import OnError
from lightning_loaders._hashing import mix64
from lightning_loaders._lightning import batches_held
from lightning_loaders._loader_base import WorkerLoader, check_current
from lightning_loaders._workers import WorkerLost, WorkerStalled
from lightning_loaders.context import _seeded_fetch
from lightning_loaders.distributed import resolve_rank_world
from lightning_loaders.errors import (
    SampleFetchError,
)
from lightning_loaders.permutation import KeyedPermutation
from lightning_loaders.plan import LastBatch, rollover_span
from lightning_loaders.schedule import (
    following_epoch,
    resolve_last_batch,
    trainer_moved_on,
)
from lightning_loaders.shards import ShardedSource, _PlainStream
from lightning_loaders.state import LoaderState

__all__ = ["ResumableIterableLoader"]

_log = logging.getLogger(__name__)

_SHARD_ORDER_SALT = 0x5348_4152_4453  # keys shard orders apart from the core's sample orders
_WINDOW_SALT = 0x5749_4E44_4F57
_EXTRA_WORKERS, _EXTRA_ENDED, _EXTRA_SLOTS = "num_workers", "ended", "slots"


# -- the plan of an epoch ----------------------------------------------------------------------


@dataclass(frozen=True)
class _Piece:
    """Positions ``range(start, stop, step)`` of shard ``shard`` (``stop=None``: to its end)."""

    shard: int
    start: int
    stop: int | None = None
    step: int = 1

    def __len__(self) -> int:
        assert self.stop is not None
        return len(range(self.start, self.stop, self.step))


@dataclass(frozen=True)
class _PlanConfig:
    """What an epoch's plan depends on besides ``(epoch, world_size, slots per rank)``."""

    lengths: tuple[int, ...] | None
    num_shards: int
    strided: bool
    batch_size: int
    last_batch: LastBatch
    shuffle: bool
    seed: int
    merge_short_tail: bool = False


@dataclass(frozen=True)
class _Layout:
    """One epoch on every rank: each slot's pieces and (known lengths) batch sizes."""

    pieces: tuple[tuple[tuple[_Piece, ...], ...], ...]  # [rank][slot]
    sizes: tuple[tuple[tuple[int, ...], ...], ...] | None  # [rank][slot][batch]
    num_batches: int | None  # per rank


@functools.lru_cache(maxsize=16)
def _plan_epoch(config: _PlanConfig, epoch: int, world_size: int, slots: int) -> _Layout:
    if config.lengths is None:
        return _unknown_layout(config, epoch, world_size, slots)
    if config.strided:
        return _strided_layout(config, world_size, slots)
    return _span_layout(config, epoch, world_size, slots)


@functools.lru_cache(maxsize=4)
def _shard_order(config: _PlanConfig, epoch: int) -> np.ndarray:
    """The shard indices in the order epoch ``epoch`` reads them."""
    n = config.num_shards
    if not config.shuffle or n == 1:
        return np.arange(n, dtype=np.int64)
    return KeyedPermutation(n, mix64(config.seed, epoch, _SHARD_ORDER_SALT))[np.arange(n)]


def _span_layout(config: _PlanConfig, epoch: int, world_size: int, slots: int) -> _Layout:
    """Known lengths: contiguous spans of the epoch's samples per rank, then per slot."""
    assert config.lengths is not None
    total, size, policy = sum(config.lengths), config.batch_size, config.last_batch
    global_batch = world_size * size
    base = 0
    if policy == "rollover":
        base, stop = rollover_span(epoch, total, global_batch)
        per_rank = [(size,) * ((stop - base) // global_batch)] * world_size
    elif policy == "drop":
        if total < global_batch:
            raise ValueError(
                f"last_batch='drop' leaves no batch: {total} samples are fewer than one global "
                f"batch of {world_size} ranks x batch_size {size}; use a smaller batch_size or "
                "last_batch='keep'/'pad'")
        per_rank = [(size,) * (total // global_batch)] * world_size
    elif policy == "pad":
        per_rank = [(size,) * -(-total // global_batch)] * world_size
    else:
        batches = -(-total // global_batch)
        if total < world_size * batches:  # fewer leftovers than ranks, with batch_size 1
            if not config.merge_short_tail or total < world_size:
                raise ValueError(
                    f"last_batch='keep' cannot give each of {world_size} ranks {batches} "
                    f"non-empty batches from {total} samples with batch_size={size}; use "
                    "last_batch='pad' or 'drop', a batch_size >= 2, or evaluation=True")
            batches = total // world_size  # the leftovers join the first ranks' last batch
        per_rank = [_split(total // world_size + (r < total % world_size), batches, size)
                    for r in range(world_size)]
    pieces, sizes, position = [], [], base
    for rank_sizes in per_rank:
        rank_pieces, rank_slot_sizes = [], []
        for slot in range(slots):
            slot_sizes = rank_sizes[slot::slots]
            span = sum(slot_sizes)
            rank_pieces.append(_stream_pieces(config, epoch, position, position + span))
            rank_slot_sizes.append(slot_sizes)
            position += span
        pieces.append(tuple(rank_pieces))
        sizes.append(tuple(rank_slot_sizes))
    return _Layout(tuple(pieces), tuple(sizes), len(per_rank[0]))


def _stream_pieces(config: _PlanConfig, epoch: int, begin: int, end: int) -> tuple[_Piece, ...]:
    """The pieces holding positions ``[begin, end)`` of the epoch's stream of samples.

    Positions past the epoch's samples wrap around to its start (``"pad"``) or, under
    ``"rollover"``, continue into the next epochs' orders (positions count from epoch 0).
    """
    assert config.lengths is not None
    total = sum(config.lengths)
    pieces: list[_Piece] = []
    position = begin
    while position < end:
        cycle, offset = divmod(position, total)
        order_epoch = cycle if config.last_batch == "rollover" else epoch
        stop = min(end - cycle * total, total)
        pieces += _epoch_pieces(config, order_epoch, offset, stop)
        position = cycle * total + stop
    return tuple(pieces)


def _epoch_pieces(config: _PlanConfig, epoch: int, begin: int, end: int) -> list[_Piece]:
    assert config.lengths is not None
    order = _shard_order(config, epoch)
    lengths = np.asarray(config.lengths, dtype=np.int64)[order]
    ends = np.cumsum(lengths)
    index = int(np.searchsorted(ends, begin, side="right"))
    pieces = []
    while begin < end:
        first = int(ends[index] - lengths[index])
        stop = min(end, int(ends[index]))
        if stop > begin:
            pieces.append(_Piece(int(order[index]), begin - first, stop - first))
            begin = stop
        index += 1
    return pieces


def _strided_layout(config: _PlanConfig, world_size: int, slots: int) -> _Layout:
    """A plain dataset of known length: slot ``s`` reads positions ``s, s + k, ...``."""
    assert config.lengths is not None
    total, size, policy = config.lengths[0], config.batch_size, config.last_batch
    stride = world_size * slots
    lengths = [[len(range(r * slots + w, total, stride)) for w in range(slots)]
               for r in range(world_size)]
    if policy == "drop":
        full = [[n // size for n in row] for row in lengths]
        batches = min(sum(row) for row in full)
        if batches == 0:
            raise ValueError(
                f"last_batch='drop' leaves no batch on some rank: {total} samples strided over "
                f"{world_size} ranks x {slots} slots give a slot fewer than batch_size={size} "
                "samples; use a smaller batch_size, fewer workers or last_batch='keep'/'pad'")
        counts = [_delivered_counts(row, batches) for row in full]
        sizes = [[(size,) * c for c in row] for row in counts]
    elif policy == "pad":
        counts = [[-(-n // size) for n in row] for row in lengths]
        batches = max(sum(row) for row in counts)
        for rank, row in enumerate(counts):
            live = [w for w in range(slots) if lengths[rank][w] > 0]
            if not live:
                raise ValueError(f"last_batch='pad' has nothing to pad rank {rank} with: "
                                 f"{total} samples are fewer than {stride} slots")
            for extra in range(batches - sum(row)):
                row[live[extra % len(live)]] += 1
        sizes = [[(size,) * c for c in row] for row in counts]
    else:
        counts = [[-(-n // size) for n in row] for row in lengths]
        batches = max(sum(row) for row in counts)
        for rank, row in enumerate(counts):
            _add_batches(row, lengths[rank], batches, rank)
        sizes = [[_split(n, c, size) for n, c in zip(lengths[r], counts[r], strict=True)]
                 for r in range(world_size)]
    pieces = tuple(
        tuple(_strided_pieces(r * slots + w, stride, lengths[r][w], sum(sizes[r][w]))
              for w in range(slots))
        for r in range(world_size))
    return _Layout(pieces, tuple(tuple(row) for row in sizes), batches)


def _add_batches(counts: list[int], lengths: list[int], target: int, rank: int) -> None:
    """Split batches of one rank's slots until the rank has ``target`` (``"keep"``)."""
    while sum(counts) < target:
        candidates = [w for w in range(len(counts)) if counts[w] < lengths[w]]
        if not candidates:
            raise ValueError(
                f"last_batch='keep' cannot give rank {rank} {target} non-empty batches from its "
                f"{sum(lengths)} samples (as many as the longest rank has); use "
                "last_batch='pad' or 'drop', or fewer workers")
        slot = max(candidates, key=lambda w: lengths[w] / max(counts[w], 1))
        counts[slot] += 1


def _strided_pieces(slot: int, stride: int, length: int, span: int) -> tuple[_Piece, ...]:
    """``span`` samples of a strided slot of ``length`` samples, wrapping to its start."""
    if length == 0 or span == 0:
        return ()
    full, rest = divmod(span, length)
    pieces = [_Piece(0, slot, slot + stride * length, stride)] * full
    if rest:
        pieces.append(_Piece(0, slot, slot + stride * rest, stride))
    return tuple(pieces)


def _unknown_layout(config: _PlanConfig, epoch: int, world_size: int, slots: int) -> _Layout:
    """Unknown lengths: whole shards dealt out in the epoch's order, ranks first."""
    stride = world_size * slots
    if config.strided:
        pieces = tuple(tuple((_Piece(0, r * slots + w, None, stride),) for w in range(slots))
                       for r in range(world_size))
        return _Layout(pieces, None, None)
    if config.num_shards < world_size:
        raise ValueError(
            f"{config.num_shards} shards of unknown length cannot feed {world_size} ranks: every "
            "rank needs a shard. Declare the shard lengths (shards can then be split), use more "
            "shards, or fewer ranks")
    dealt: list[list[list[_Piece]]] = [[[] for _ in range(slots)] for _ in range(world_size)]
    for i, shard in enumerate(_shard_order(config, epoch)):
        dealt[i % world_size][(i // world_size) % slots].append(_Piece(int(shard), 0))
    return _Layout(tuple(tuple(tuple(s) for s in r) for r in dealt), None, None)


def _split(total: int, parts: int, size: int) -> tuple[int, ...]:
    """``total`` samples in ``parts`` batches of at most ``size``: full ones first, the rest
    as even as possible (never empty); samples beyond ``parts * size`` join the last batch."""
    if parts == 0:
        return ()
    if total > parts * size:
        sizes = _split(parts * size, parts, size)
        return sizes[:-1] + (sizes[-1] + total - parts * size,)
    full = parts if size == 1 else min(parts, (total - parts) // (size - 1))
    share, extra = divmod(total - full * size, parts - full) if parts > full else (0, 0)
    rest = parts - full
    return (size,) * full + (share + 1,) * extra + (share,) * (rest - extra)


def _delivered_counts(batches: Sequence[int], delivered: int) -> list[int]:
    """Batches of each slot among the first ``delivered`` of the round-robin order, where slot
    ``w`` has ``batches[w]`` in all."""
    if delivered > sum(batches):
        raise ValueError(f"{delivered} batches delivered, but the slots only have {sum(batches)}")
    low, high = 0, max(batches, default=0)
    while low < high:  # the last complete round
        middle = (low + high + 1) // 2
        if sum(min(n, middle) for n in batches) <= delivered:
            low = middle
        else:
            high = middle - 1
    counts = [min(n, low) for n in batches]
    extra = delivered - sum(counts)
    for slot, n in enumerate(batches):
        if extra and n > low:
            counts[slot] += 1
            extra -= 1
    return counts


def _locate(pieces: Sequence[_Piece], emitted: int) -> tuple[int, int]:
    """``(piece, offset in its shard)`` of a known-length slot's sample ``emitted``."""
    for index, piece in enumerate(pieces):
        n = len(piece)
        if emitted < n:
            return index, piece.start + emitted * piece.step
        emitted -= n
    return len(pieces), 0


# -- worker side: one slot's reader ------------------------------------------------------------


class _Cursor(NamedTuple):
    """Where a slot stands; saved as a plain list."""

    batches: int  # batches of the slot delivered
    emitted: int  # samples of the slot delivered
    window_emitted: int  # samples delivered before the current shuffle window
    piece: int  # the window's first sample: index into the slot's pieces ...
    offset: int  # ... and its position in that piece's shard
    reader_state: Any  # the shard iterator's state_dict() there, if it has one
    exhausted: bool  # the slot has delivered its last batch


class _SlotRequest(NamedTuple):
    """One batch of one slot, as sent to a worker (``start=None``: a skip request, answered
    with ``_SlotEnd(-1)``, which only keeps requests and workers in step)."""

    generation: int
    epoch: int
    rank: int
    world_size: int
    slot: int
    batch: int
    size: int
    start: _Cursor | None  # the slot's cursor when this generation began


class _Delivered(NamedTuple):
    """A slot's batch, as a worker answers it."""

    slot: int
    batch: int
    data: Any
    cursor: _Cursor | None  # after this batch (unknown lengths only)


class _SlotEnd(NamedTuple):
    """The slot has no batch left (``slot=-1``: the answer to a skip request)."""

    slot: int


_SKIP = _SlotRequest(-1, -1, -1, -1, -1, -1, 0, None)


class _SlotReader:
    """Reads one slot's pieces in order, optionally through a shuffle window.

    Samples move in chunks (``itertools.islice`` over the shard iterators), so the per-sample
    cost is the source's own.
    """

    def __init__(self, source: ShardedSource[Any], pieces: tuple[_Piece, ...], start: _Cursor,
                 window: int, key: int, generation: int) -> None:
        self.generation, self.batch, self.exhausted = generation, start.batches, start.exhausted
        self._source, self._pieces, self._window, self._key = source, pieces, window, key
        self._piece, self._offset, self._state = start.piece, start.offset, start.reader_state
        self._it: Iterator[Any] | None = None
        self._it_position = 0  # the shard position the open iterator yields next
        self._peeked: list[tuple[Any, tuple[int, int, Any]]] = []  # (sample, its position)
        self._emitted = start.window_emitted
        self._buffer: list[Any] = []
        self._taken = 0
        self._window_start = (self._emitted, (self._piece, self._offset, self._state))
        if not self.exhausted:
            if window > 1:
                self._fill()
            self.take(start.emitted - start.window_emitted)

    def take(self, n: int) -> list[Any]:
        """Up to ``n`` next samples (fewer at the end of the slot's stream)."""
        if self._window <= 1:
            out = self._read(n)
            self._emitted += len(out)
            return out
        out = []
        while len(out) < n:
            if self._taken == len(self._buffer) and not self._fill():
                break
            chunk = self._buffer[self._taken:self._taken + n - len(out)]
            self._taken += len(chunk)
            self._emitted += len(chunk)
            out += chunk
        return out

    def at_end(self) -> bool:
        """Whether the slot's stream has no sample left (reads one ahead to know)."""
        if (self._window > 1 and self._taken < len(self._buffer)) or self._peeked:
            return False
        position = self._position()
        sample = self._read(1)
        if not sample:
            return True
        self._peeked.append((sample[0], position))
        return False

    def cursor(self) -> _Cursor:
        """Where the slot stands now (the position of its current window's first sample)."""
        if self._window <= 1 or self._taken == len(self._buffer):
            piece, offset, state = self._position()
            return _Cursor(self.batch, self._emitted, self._emitted, piece, offset, state,
                           self.exhausted)
        window_emitted, (piece, offset, state) = self._window_start
        return _Cursor(self.batch, self._emitted, window_emitted, piece, offset, state,
                       self.exhausted)

    def where(self) -> str:
        """The shard and position being read, for error messages."""
        if self._piece >= len(self._pieces):
            return "after its last shard"
        return f"shard {self._pieces[self._piece].shard}, reading from sample {self._offset}"

    def close(self) -> None:
        iterator, self._it = self._it, None
        close = getattr(iterator, "close", None)
        if callable(close):
            close()

    def _fill(self) -> bool:
        """Read the next window and permute it; ``False`` at the end of the stream."""
        self._window_start = (self._emitted, self._position())
        samples = self._read(self._window)
        self._taken = 0
        self._buffer = samples
        if not samples:
            return False
        order = KeyedPermutation(len(samples), mix64(self._key, self._emitted // self._window))
        self._buffer = [samples[i] for i in order[np.arange(len(samples))].tolist()]
        return True

    def _position(self) -> tuple[int, int, Any]:
        """``(piece, offset, shard iterator state)`` of the next sample ``_read`` returns."""
        if self._peeked:
            return self._peeked[0][1]
        self._skip_finished_pieces()
        if self._it is None:
            return self._piece, self._offset, self._state
        state_dict = getattr(self._it, "state_dict", None)
        state = state_dict() if callable(state_dict) and self._it_position == self._offset else None
        return self._piece, self._offset, state

    def _skip_finished_pieces(self) -> None:
        while self._piece < len(self._pieces):
            stop = self._pieces[self._piece].stop
            if stop is None or self._offset < stop:
                return
            self._advance()

    def _advance(self) -> None:
        self.close()
        self._piece += 1
        self._state = None
        if self._piece < len(self._pieces):
            self._offset = self._pieces[self._piece].start

    def _read(self, n: int) -> list[Any]:
        """Up to ``n`` next samples of the pieces (raw: before the shuffle window)."""
        out = [self._peeked.pop()[0]] if self._peeked and n > 0 else []
        while len(out) < n:
            self._skip_finished_pieces()
            if self._piece >= len(self._pieces):
                break
            piece = self._pieces[self._piece]
            if self._it is None:
                self._it = iter(self._source.open_shard(piece.shard, self._offset, self._state))
                self._it_position, self._state = self._offset, None
            want = n - len(out)
            if piece.stop is not None:
                want = min(want, len(range(self._offset, piece.stop, piece.step)))
            skip = self._offset - self._it_position  # other slots' samples (strided pieces)
            chunk = list(itertools.islice(self._it, skip, skip + (want - 1) * piece.step + 1,
                                          piece.step))
            if chunk:
                out += chunk
                self._it_position = self._offset + (len(chunk) - 1) * piece.step + 1
                self._offset += len(chunk) * piece.step
            if len(chunk) < want:  # the shard ended
                if piece.stop is not None:
                    raise ValueError(
                        f"shard {piece.shard} ended at sample {self._offset}, but its declared "
                        f"length says it has at least {piece.stop}: fix the source's "
                        "shard_lengths")
                self._advance()
        return out


class _SlotFetcher(Dataset[Any]):
    """What the internal DataLoader indexes: answers one ``_SlotRequest`` with one batch.

    It keeps each slot's reader between requests (in the worker that serves the slot), so a
    slot's shards are read sequentially; a request its reader cannot continue (a new epoch, a
    resume, a request routed elsewhere) reopens the reader from the request's start cursor.
    """

    def __init__(self, source: ShardedSource[Any], config: _PlanConfig, slots: int, window: int,
                 collate_fn: Callable[[list[Any]], Any] | None) -> None:
        self.dataset = source.dataset if isinstance(source, _PlainStream) else source
        self.source, self.config, self.slots, self.window = source, config, slots, window
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self._readers: dict[int, _SlotReader] = {}
        self._source_epoch: int | None = None

    def __getitem__(self, request: _SlotRequest) -> _Delivered | _SlotEnd:
        if request.start is None:
            return _SlotEnd(-1)
        reader = None
        try:
            reader = self._reader(request)
            if reader.exhausted:
                return _SlotEnd(request.slot)
            with _seeded_fetch(self.config.seed, request.epoch, request.batch, request.rank,
                               request.slot):
                samples = reader.take(request.size)
                known = self.config.lengths is not None
                if not known:
                    if not samples or (len(samples) < request.size
                                       and self.config.last_batch == "drop"):
                        reader.exhausted = True
                        return _SlotEnd(request.slot)
                    reader.exhausted = len(samples) < request.size or reader.at_end()
                elif len(samples) < request.size:
                    raise ValueError(f"slot {request.slot} ran out of samples {reader.where()}: "
                                     "a shard is shorter than its declared length")
                reader.batch += 1
                cursor = None if known else reader.cursor()
                data = self.collate_fn(samples)
        except Exception as exc:
            raise _fetch_error(request, reader, exc) from exc
        return _Delivered(request.slot, request.batch, data, cursor)

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()

    def _reader(self, request: _SlotRequest) -> _SlotReader:
        reader = self._readers.get(request.slot)
        if (reader is not None and reader.generation == request.generation
                and reader.batch == request.batch):
            return reader
        if reader is not None:
            reader.close()
        assert request.start is not None
        if request.epoch != self._source_epoch:
            set_epoch = getattr(self.source, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(request.epoch)
            self._source_epoch = request.epoch
        layout = _plan_epoch(self.config, request.epoch, request.world_size, self.slots)
        key = mix64(self.config.seed, request.epoch, request.rank, request.slot, _WINDOW_SALT)
        reader = _SlotReader(self.source, layout.pieces[request.rank][request.slot],
                             request.start, self.window, key, request.generation)
        while reader.batch < request.batch and not reader.exhausted:  # a request routed here
            sizes = layout.sizes[request.rank][request.slot] if layout.sizes else None
            size = sizes[reader.batch] if sizes else self.config.batch_size
            reader.exhausted = len(reader.take(size)) < size
            reader.batch += 1
        self._readers[request.slot] = reader
        return reader


def _fetch_error(request: _SlotRequest, reader: _SlotReader | None,
                 exc: Exception) -> SampleFetchError:
    info = torch_worker_info()
    where = f"worker {info.id}" if info is not None else "the main process"
    shard = f" ({reader.where()})" if reader is not None else ""
    return SampleFetchError(
        f"{type(exc).__name__} while reading batch {request.batch} of slot {request.slot}"
        f"{shard} in epoch {request.epoch}, in {where} on rank {request.rank}: {exc}",
        epoch=request.epoch, batch=request.batch, rank=request.rank,
        worker=info.id if info is not None else None, pid=os.getpid(),
        cause_type=type(exc).__name__,
        worker_traceback=traceback.format_exc() if info is not None else None)


# -- main process: the schedule of epochs and the cursor ---------------------------------------


class _IterableSchedule:
    """The epoch being delivered on this rank, its cursor, and its saved form.

    Epoch ownership follows the core loader (``MapSchedule``): a restored cursor continues
    unless it is at its epoch's end or the trainer has moved past the epoch it began under;
    otherwise the following epoch starts.
    """

    def __init__(self, config: _PlanConfig, slots: int, window: int, fingerprint: str,
                 rank: int | None, world_size: int | None) -> None:
        self.config, self.slots, self.window = config, slots, window
        self._fingerprint = fingerprint
        self._explicit_placement = (rank, world_size)
        self._placement: tuple[int, int] | None = None
        self.epoch: int | None = None
        self.batches = 0
        self.ended = False
        self.layout: _Layout | None = None
        self.generation = 0
        self.starts: tuple[_Cursor, ...] = ()  # where the current generation began
        self.cursors: list[_Cursor] = []  # delivered (unknown lengths)
        self.exhausted: set[int] = set()  # slots known to have no batch left (as received)
        self.received_batches = 0  # batches received from the workers in this epoch
        self._received_cursors: list[_Cursor] = []  # (unknown lengths)
        self._start_batches = 0
        self._undo: deque[tuple[int, _Cursor]] = deque(maxlen=8)
        self._pending: LoaderState | None = None
        self._trainer_epoch: int | None = None
        self._owner: int | None = None

    @property
    def known(self) -> bool:
        return self.config.lengths is not None

    @property
    def placement(self) -> tuple[int, int]:
        """``(rank, world_size)``: fixed at the first epoch start, resolved afresh before it."""
        if self._placement is not None:
            return self._placement
        return resolve_rank_world(*self._explicit_placement)

    @property
    def synced(self) -> bool:
        """Whether ranks must agree on the epoch's end at run time (unknown lengths, DDP)."""
        return not self.known and self.placement[1] > 1

    def num_batches(self) -> int:
        """Batches per epoch on this rank (equal on every rank), when known in advance."""
        if not self.known:
            raise TypeError("len() is unknown: the dataset does not declare its shard lengths "
                            "(a ShardedSource's shard_lengths, or a plain dataset's __len__)")
        if self.config.last_batch == "rollover":
            raise TypeError("len() is undefined with last_batch='rollover': epochs differ in "
                            "length by one batch as leftovers roll over")
        layout = _plan_epoch(self.config, 0, self.placement[1], self.slots)
        assert layout.num_batches is not None
        return layout.num_batches

    # -- epochs -----------------------------------------------------------------------------

    def set_epoch(self, epoch: int) -> None:
        """Record the trainer's epoch; it takes effect at the next epoch start."""
        if epoch < 0:
            raise ValueError(f"epoch must be >= 0, got {epoch}")
        self._trainer_epoch = epoch

    def begin_epoch(self) -> None:
        """Fix placement and decide which epoch and batch come next."""
        rank, world_size = self._placement = self.placement
        pending, self._pending = self._pending, None
        trainer = self._trainer_epoch
        if pending is not None:
            try:
                self._resume(pending, rank, world_size)
            except BaseException:
                self._pending = pending  # nothing started: a corrected retry can still resume
                raise
            if not self.ended and not trainer_moved_on(trainer, self._owner):
                return
        epoch = following_epoch(self.epoch, trainer, self._owner)
        self._owner = trainer
        layout = self._layout(epoch)
        self._begin(epoch, 0, _first_cursors(layout, rank), layout)

    def restart(self) -> None:
        """Begin a new generation at the delivered cursor (after an error)."""
        assert self.epoch is not None and self.layout is not None
        self._begin(self.epoch, self.batches, self._delivered_cursors(), self.layout)

    def restart_after_received(self) -> None:
        """Begin a new generation just after the last batch received (new workers after a
        crash: batches received but not yet delivered stay valid)."""
        assert self.layout is not None
        if self.known:
            starts = self._derived_cursors(self.layout, self.placement[0], self.received_batches)
        else:
            starts = list(self._received_cursors)
        self.generation += 1
        self.starts = tuple(starts)

    def requests(self, with_skips: bool) -> Iterator[_SlotRequest]:
        """The current generation's batch requests, slot by slot round-robin."""
        assert self.epoch is not None and self.layout is not None
        rank, world_size = self.placement
        sizes = self.layout.sizes[rank] if self.layout.sizes is not None else None
        return _requests(self.generation, self.epoch, rank, world_size, self.starts, sizes,
                         self.config.batch_size, self.exhausted, with_skips)

    def received(self, item: _Delivered | _SlotEnd) -> None:
        """Note what a slot answered (before delivery, so that later requests and a restart
        of the workers know it)."""
        if isinstance(item, _SlotEnd):
            if item.slot >= 0:
                self.exhausted.add(item.slot)
            return
        self.received_batches += 1
        if item.cursor is not None:
            self._received_cursors[item.slot] = item.cursor
            if item.cursor.exhausted:
                self.exhausted.add(item.slot)

    def delivered(self, item: _Delivered, last: bool = False) -> None:
        """Count one batch handed to the caller (``last``: the ranks agreed it ends the epoch)."""
        self.batches += 1
        if self.known:
            assert self.layout is not None and self.layout.num_batches is not None
            self.ended = self.batches >= self.layout.num_batches
            return
        assert item.cursor is not None
        self._undo.append((item.slot, self.cursors[item.slot]))
        self.cursors[item.slot] = item.cursor
        self.ended = last or all(cursor.exhausted for cursor in self.cursors)

    def finish(self) -> None:
        """The epoch has no batch left on this rank."""
        self.ended = True

    def _layout(self, epoch: int) -> _Layout:
        layout = _plan_epoch(self.config, epoch, self.placement[1], self.slots)
        if self.synced and not (dist.is_available() and dist.is_initialized()):
            raise RuntimeError(
                f"a dataset of unknown length on {self.placement[1]} ranks needs an initialised "
                "torch.distributed process group: the ranks agree at run time on when the epoch "
                "ends. Initialise it (Lightning's DDP does), or declare the shard lengths")
        return layout

    def _begin(self, epoch: int, batches: int, cursors: list[_Cursor], layout: _Layout) -> None:
        self.epoch, self.batches, self.layout = epoch, batches, layout
        self.cursors, self.starts = list(cursors), tuple(cursors)
        self.exhausted = {w for w, cursor in enumerate(cursors) if cursor.exhausted}
        self.generation += 1
        self.received_batches = self._start_batches = batches
        self._received_cursors = list(cursors)
        self._undo.clear()
        self.ended = (layout.num_batches is not None and batches >= layout.num_batches) or (
            layout.num_batches is None and all(cursor.exhausted for cursor in cursors))

    def _resume(self, state: LoaderState, rank: int, world_size: int) -> None:
        extra = state.extra
        workers, ended = extra.get(_EXTRA_WORKERS), bool(extra.get(_EXTRA_ENDED, False))
        self._owner = state.trainer_epoch
        if ended:
            self.epoch, self.batches, self.ended = state.epoch, state.batches, True
            return
        if state.batches and (state.world_size, workers) != (world_size, self.slots):
            raise ValueError(
                f"cannot resume mid-epoch (epoch {state.epoch}, after batch {state.batches}) "
                f"with another world size or number of worker slots: saved world_size="
                f"{state.world_size}, slots per rank={workers}; now world_size={world_size}, "
                f"slots per rank={self.slots} (num_workers, or 1 for num_workers=0). Each "
                "(rank, worker) reads its own part of the shards, so the rest of the epoch would "
                "repeat or skip data. Resume with the saved configuration, or from a checkpoint "
                "taken at an epoch end")
        layout = self._layout(state.epoch)
        if not state.batches:
            cursors = _first_cursors(layout, rank)
        elif self.known:
            cursors = self._derived_cursors(layout, rank, state.batches)
        else:
            cursors = _saved_cursors(extra, rank, self.slots)
        self._begin(state.epoch, state.batches, cursors, layout)

    def _derived_cursors(self, layout: _Layout, rank: int, batches: int) -> list[_Cursor]:
        """Known lengths: every slot's position after ``batches`` delivered batches."""
        assert layout.sizes is not None and layout.num_batches is not None
        if batches > layout.num_batches:
            raise ValueError(f"corrupted loader state: batches={batches} but epochs have "
                             f"{layout.num_batches} batches")
        sizes = layout.sizes[rank]
        counts = _delivered_counts([len(s) for s in sizes], batches)
        cursors = []
        for w, (count, pieces) in enumerate(zip(counts, layout.pieces[rank], strict=True)):
            emitted = sum(sizes[w][:count])
            window_emitted = emitted - emitted % self.window
            piece, offset = _locate(pieces, window_emitted)
            cursors.append(_Cursor(count, emitted, window_emitted, piece, offset, None,
                                   count >= len(sizes[w])))
        return cursors

    def _delivered_cursors(self) -> list[_Cursor]:
        if self.known:
            assert self.layout is not None
            return self._derived_cursors(self.layout, self.placement[0], self.batches)
        return list(self.cursors)

    # -- state ------------------------------------------------------------------------------

    def fingerprint(self) -> dict[str, Any]:
        config = self.config
        return {"source": self._fingerprint, "strided": config.strided, "seed": config.seed,
                "batch_size": config.batch_size, "last_batch": config.last_batch,
                "shuffle": config.shuffle, "shuffle_buffer": self.window}

    def state_dict(self, held: int = 0) -> dict[str, Any]:
        """The cursor; ``held``: batches delivered but not yet used by the consumer.

        With unknown lengths it holds every rank's slot positions, gathered from all ranks
        (a collective: every rank must call it, as Lightning does when it checkpoints).
        """
        if self._pending is not None:
            return self._pending.to_dict()
        rank, world_size = self.placement
        extra: dict[str, Any] = {_EXTRA_WORKERS: self.slots, _EXTRA_ENDED: False}
        if self.epoch is None:
            return LoaderState(self._trainer_epoch or 0, 0, world_size,
                               trainer_epoch=self._trainer_epoch,
                               fingerprint=self.fingerprint(), extra=extra).to_dict()
        held = min(held, self.batches - self._start_batches if self.known else len(self._undo))
        extra[_EXTRA_ENDED] = self.ended and held == 0
        if not self.known:
            cursors = list(self.cursors)
            for slot, previous in list(self._undo)[len(self._undo) - held:][::-1]:
                cursors[slot] = previous
            extra[_EXTRA_SLOTS] = _gather([list(c) for c in cursors], rank, world_size)
        return LoaderState(self.epoch, self.batches - held, world_size,
                           trainer_epoch=self._owner, fingerprint=self.fingerprint(),
                           extra=extra).to_dict()

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a cursor; the next ``begin_epoch`` continues exactly after its last batch."""
        state = LoaderState.from_dict(state_dict, self.fingerprint())
        workers = state.extra.get(_EXTRA_WORKERS)
        if not isinstance(workers, int) or workers < 1:
            raise ValueError(f"corrupted loader state: extra[{_EXTRA_WORKERS!r}]={workers!r} is "
                             "not an int >= 1 (was it saved by a map-style loader?)")
        if not self.known and state.batches and _EXTRA_SLOTS not in state.extra:
            raise ValueError("corrupted loader state: a mid-epoch state of a dataset of unknown "
                             f"length needs extra[{_EXTRA_SLOTS!r}] (the slots' positions)")
        self._pending = state


def _first_cursors(layout: _Layout, rank: int) -> list[_Cursor]:
    """Every slot of ``rank`` at the start of its stream (exhausted when it has no batch)."""
    return [_Cursor(0, 0, 0, 0, pieces[0].start if pieces else 0, None,
                    not pieces or (layout.sizes is not None and not layout.sizes[rank][slot]))
            for slot, pieces in enumerate(layout.pieces[rank])]


def _requests(generation: int, epoch: int, rank: int, world_size: int,
              starts: tuple[_Cursor, ...], sizes: tuple[tuple[int, ...], ...] | None,
              batch_size: int, exhausted: set[int], with_skips: bool) -> Iterator[_SlotRequest]:
    """Requests round-robin over slots: slot ``w``'s ``k``-th batch comes in round ``k``.

    With workers, every round asks every slot (finished ones with a skip request), so request
    ``i`` of a generation goes to worker ``i % num_workers``, which keeps that slot's reader
    (torch deals requests to its workers in turn). ``exhausted`` is read live: slots that end
    stop being asked once the main process has heard so.
    """
    slots = len(starts)
    next_batch = [cursor.batches for cursor in starts]

    def done(w: int) -> bool:
        return next_batch[w] >= len(sizes[w]) if sizes is not None else w in exhausted

    while True:
        live = [w for w in range(slots) if not done(w)]
        if not live:
            return
        round_ = min(next_batch[w] for w in live)
        for w in range(slots):
            if next_batch[w] == round_ and not done(w):
                size = sizes[w][round_] if sizes is not None else batch_size
                yield _SlotRequest(generation, epoch, rank, world_size, w, round_, size,
                                   starts[w])
                next_batch[w] += 1
            elif with_skips:
                yield _SKIP


def _saved_cursors(extra: Any, rank: int, slots: int) -> list[_Cursor]:
    rows = extra.get(_EXTRA_SLOTS)
    if not isinstance(rows, list) or rank >= len(rows):
        raise ValueError(f"corrupted loader state: extra[{_EXTRA_SLOTS!r}] has no entry for "
                         f"rank {rank}")
    row = rows[rank]
    if row is None:
        raise ValueError(
            f"the loader state has no positions for rank {rank}: it was saved without an "
            "initialised process group, so it holds only the saving rank's. Save it with "
            "torch.distributed initialised (every rank calling state_dict()), or restore each "
            "rank from its own state")
    if not isinstance(row, list) or len(row) != slots:
        raise ValueError(f"corrupted loader state: rank {rank} has {len(row)} slot positions, "
                         f"this loader {slots}")
    try:
        return [_Cursor(*entry) for entry in row]
    except TypeError as exc:
        raise ValueError(f"corrupted loader state: bad slot position in {row!r}") from exc


def _gather(rows: list[list[Any]], rank: int, world_size: int) -> list[Any]:
    """Every rank's slot positions (only this rank's without a process group)."""
    if world_size > 1 and dist.is_available() and dist.is_initialized():
        gathered: list[Any] = [None] * world_size
        dist.all_gather_object(gathered, rows)
        return gathered
    out: list[Any] = [None] * world_size
    out[rank] = rows
    return out


def _agree_min(value: int) -> int:
    """The minimum of ``value`` over all ranks (one small ``all_reduce``)."""
    device = torch.device("cpu")
    if dist.get_backend() == "nccl":
        device = torch.device("cuda", torch.cuda.current_device())
    tensor = torch.tensor([value], dtype=torch.int64, device=device)
    dist.all_reduce(tensor, op=dist.ReduceOp.MIN)
    return int(tensor.item())


# -- the loader --------------------------------------------------------------------------------


class ResumableIterableLoader(WorkerLoader):
    """A deterministic, sharded, exactly resumable loader over an iterable dataset.

    ``ResumableLoader(dataset, ...)`` returns one when ``dataset`` is a
    ``torch.utils.data.IterableDataset`` (a ``ShardedSource`` or a plain one). It takes
    ``ResumableLoader``'s arguments (``sampler`` and ``batch_sampler`` must stay unset: the plan
    decides the order), plus:

    Args:
        shuffle: reshuffle the shard order every epoch, keyed by ``(seed, epoch)``.
        evaluation: with known shard lengths, ``last_batch="keep"`` and ``batch_size=1``,
            leftover samples (fewer than ranks) join the last batch of the first ranks instead
            of failing (as for ``ResumableLoader``).
        shuffle_buffer: mix samples within each (rank, worker) slot in windows of this many
            samples (0: off). Costs that many samples of memory per worker.
        sync_interval: with unknown lengths under DDP, batches between two agreements of the
            ranks on how many batches they all still have (each rank holds up to this many
            batches ahead to answer, and its workers prefetch at least as many).

    See the module docstring for the plan, the equal-count strategies and resume.
    """

    def __init__(
        self,
        dataset: IterableDataset[Any],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Any = None,
        batch_sampler: Any = None,
        num_workers: int = 0,
        collate_fn: Callable[[list[Any]], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: torch.Generator | None = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool | None = None,
        pin_memory_device: str = "",
        in_order: bool = True,
        seed: int | None = None,
        last_batch: LastBatch | None = None,
        rank: int | None = None,
        world_size: int | None = None,
        on_error: OnError = "raise",
        max_worker_restarts: int = 3,
        evaluation: bool = False,
        shuffle_buffer: int = 0,
        sync_interval: int = 8,
    ) -> None:
        if sampler is not None or batch_sampler is not None:
            raise ValueError("an iterable dataset takes no sampler or batch_sampler (as in "
                             "DataLoader): the plan decides the order; shuffle shards with "
                             "shuffle=True and mix samples with shuffle_buffer")
        self.last_batch: LastBatch = resolve_last_batch(last_batch, drop_last)
        self._take_options(
            dataset, batch_size=batch_size, num_workers=num_workers, collate_fn=collate_fn,
            pin_memory=pin_memory, drop_last=self.last_batch == "drop", timeout=timeout,
            worker_init_fn=worker_init_fn, multiprocessing_context=multiprocessing_context,
            generator=generator, prefetch_factor=prefetch_factor,
            persistent_workers=persistent_workers, pin_memory_device=pin_memory_device,
            in_order=in_order, seed=seed, on_error=on_error,
            max_worker_restarts=max_worker_restarts)
        if on_error != "raise":
            raise ValueError(f"on_error={on_error!r} is not supported for iterable datasets: a "
                             "shard iterator that raised cannot go on past the failing sample; "
                             "skip bad records inside open_shard instead")
        for name, value, low in (("shuffle_buffer", shuffle_buffer, 0),
                                 ("sync_interval", sync_interval, 1)):
            if not isinstance(value, int) or isinstance(value, bool) or value < low:
                raise ValueError(f"{name} must be an int >= {low}, got {value!r}")
        source = dataset if isinstance(dataset, ShardedSource) else _PlainStream(dataset)
        strided = isinstance(source, _PlainStream)
        lengths = source.shard_lengths
        if not source.shards:
            raise ValueError(f"{type(dataset).__name__} declares no shards")
        if lengths is not None and sum(lengths) == 0:
            raise ValueError(f"the dataset ({type(dataset).__name__}) is empty: its shard "
                             "lengths add up to 0")
        if self.last_batch == "rollover" and (lengths is None or strided):
            raise ValueError("last_batch='rollover' needs a ShardedSource with known shard "
                             "lengths; use 'keep' or 'drop'")
        if self.last_batch == "pad" and lengths is None:
            raise ValueError("last_batch='pad' needs known lengths (shard_lengths, or __len__ "
                             "on a plain dataset) to know what to pad; use 'keep' or 'drop'")
        if shuffle and strided and shuffle_buffer == 0:
            raise ValueError(f"shuffle=True on a plain {type(dataset).__name__} (no shards to "
                             "reorder) needs shuffle_buffer > 0 to mix samples")
        self.shuffle = bool(shuffle)
        self.shuffle_buffer = shuffle_buffer
        self.sync_interval = sync_interval
        config = _PlanConfig(None if lengths is None else tuple(lengths), len(source.shards),
                             strided, self.batch_size, self.last_batch, self.shuffle, self.seed,
                             merge_short_tail=evaluation and not strided)
        slots = max(1, num_workers)
        self.schedule = _IterableSchedule(config, slots, max(1, shuffle_buffer),
                                          source.fingerprint, rank, world_size)
        self.sampler = _EpochSampler(self.schedule)
        self._fetcher = _SlotFetcher(source, config, slots, max(1, shuffle_buffer), collate_fn)
        self._warned_surplus = False

    # -- the DataLoader surface -------------------------------------------------------------

    def __len__(self) -> int:
        """Batches per epoch on this rank (equal on every rank); ``TypeError`` when the
        lengths are unknown or under ``last_batch="rollover"``."""
        return self.schedule.num_batches()

    def __repr__(self) -> str:
        schedule = self.schedule
        rank, world_size = schedule.placement
        epoch = "not started" if schedule.epoch is None else schedule.epoch
        config = schedule.config
        lengths = "unknown" if config.lengths is None else sum(config.lengths)
        kind = "strided" if config.strided else f"{config.num_shards} shards"
        return (f"{type(self).__name__}(dataset={type(self.dataset).__name__}({kind}, "
                f"samples={lengths}), batch_size={self.batch_size}, shuffle={self.shuffle}, "
                f"shuffle_buffer={self.shuffle_buffer}, last_batch={self.last_batch!r}, "
                f"num_workers={self.num_workers}, rank={rank}/{world_size}, seed={self.seed}, "
                f"epoch={epoch}, batches={schedule.batches})")

    def state_dict(self) -> dict[str, Any]:
        """The cursor as a plain dict; with unknown lengths every rank's slot positions,
        gathered from all ranks (every rank must call it, as Lightning does)."""
        return self.schedule.state_dict(held=batches_held(self._prefetcher))

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore a cursor; the next ``iter()`` continues exactly after its last batch."""
        self.schedule.load_state_dict(state_dict)

    def close(self) -> None:
        """Shut the worker processes (and, without workers, the open shards) down now; they
        also stop when the loader is collected. Iterating again continues from the cursor."""
        super().close()
        self._fetcher.close()

    def _new_iterator(self, token: int) -> _IterableLoaderIterator:
        return _IterableLoaderIterator(self, token)

    def _position(self) -> int:
        return self.schedule.received_batches

    # -- delivery ---------------------------------------------------------------------------

    def _deliver(self) -> Iterator[Any]:
        """The rest of the current epoch, counted as each batch is handed over."""
        schedule = self.schedule
        received = self._received()
        items = (self._agreed(received) if schedule.synced
                 else ((item, False) for item in received))
        for item, last in items:
            schedule.delivered(item, last)
            yield item.data
        schedule.finish()

    def _received(self) -> Iterator[_Delivered]:
        """Batches in plan order as the workers answer, skipping the slots' end markers;
        dead workers are replaced and continue after the last batch received."""
        schedule = self.schedule
        if schedule.ended:
            return
        while True:
            try:
                for item in self._workers():
                    schedule.received(item)
                    if isinstance(item, _Delivered):
                        yield item
                return
            except WorkerLost as lost:
                self._recover(lost)
                schedule.restart_after_received()
            except WorkerStalled as stalled:
                raise self._stall_error(stalled) from None

    def _agreed(self, items: Iterator[_Delivered]) -> Iterator[tuple[_Delivered, bool]]:
        """Unknown lengths under DDP: deliver only batches every rank has.

        Every ``sync_interval`` batches each rank reads that many ahead and the ranks take the
        minimum of ``2 * count + (0 if the rank has nothing after them else 1)``: everyone then
        delivers ``count`` more batches, and the epoch ends after them when the rank with the
        fewest has nothing left.
        """
        schedule = self.schedule
        while True:
            ahead = list(itertools.islice(items, self.sync_interval))
            done_here = len(ahead) < self.sync_interval or len(schedule.exhausted) == schedule.slots
            agreed = _agree_min(2 * len(ahead) + (0 if done_here else 1))
            count, ends = agreed // 2, agreed % 2 == 0
            for i, item in enumerate(ahead[:count]):
                yield item, ends and i == count - 1
            if ends:
                if (len(ahead) > count or not done_here) and not self._warned_surplus:
                    self._warned_surplus = True
                    rank, world_size = schedule.placement
                    warnings.warn(
                        f"rank {rank} of {world_size} ended epoch {schedule.epoch} after "
                        f"{schedule.batches} batches because another rank ran out of data: with "
                        "unknown shard lengths every rank stops when the first one does, so the "
                        "rest of this rank's shards is not read this epoch. Declare the shard "
                        "lengths to balance the ranks exactly (warned once)", stacklevel=2)
                return

    def _workers(self) -> Iterator[_Delivered | _SlotEnd]:
        """torch's DataLoader over the current generation's requests (workers persistent)."""
        prefetch = self.prefetch_factor
        if self.num_workers > 0 and self.schedule.synced:  # ranks agree on batches in hand
            prefetch = max(prefetch or 2, -(-self.sync_interval // self.num_workers))
        sampler = _RequestSampler(self.schedule, self.num_workers > 0)
        return iter(self._worker_pool(self._fetcher, sampler, prefetch))


class _IterableLoaderIterator:
    """Counts a batch when it is handed to the caller, never when it is prefetched."""

    def __init__(self, loader: ResumableIterableLoader, token: int) -> None:
        self._loader = loader
        self._token = token
        self._batches: Iterator[Any] | None = None
        self._started = False

    def __iter__(self) -> _IterableLoaderIterator:
        return self

    def __next__(self) -> Any:
        loader = self._loader
        check_current(loader, self._token)
        if self._batches is None:
            if self._started:  # after an error: go on from the cursor
                loader.schedule.restart()
            else:
                loader.schedule.begin_epoch()
                loader._epoch_restarts = 0
                self._started = True
            self._batches = loader._deliver()
        try:
            return next(self._batches)
        except StopIteration:
            raise
        except BaseException:
            self._batches = None
            loader.close()
            raise


class _EpochSampler:
    """What Lightning sees as ``loader.sampler``: forwards ``set_epoch`` to the schedule."""

    def __init__(self, schedule: _IterableSchedule) -> None:
        self._schedule = schedule

    def set_epoch(self, epoch: int) -> None:
        self._schedule.set_epoch(epoch)


class _RequestSampler(Sampler[_SlotRequest]):
    """The internal DataLoader's sampler: the current generation's requests at every iter()."""

    def __init__(self, schedule: _IterableSchedule, with_skips: bool) -> None:
        self._schedule = schedule
        self._with_skips = with_skips

    def __iter__(self) -> Iterator[_SlotRequest]:
        return self._schedule.requests(self._with_skips)
