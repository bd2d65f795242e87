"""Worker side of an iterable loader: one slot's reader cuts batches from its pieces, and
``SlotFetcher`` (what the workers index) answers one planned request with one batch.
"""

from __future__ import annotations

import copy
import itertools
import operator
from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager, contextmanager, nullcontext
from typing import Any

import numpy as np
from torch.utils.data import Dataset

from lightning_loaders.context import rng_turn, seeded_apart, seeded_fetch
from lightning_loaders.engines.transport import worker_collate
from lightning_loaders.errors import SampleFetchError, fetch_error
from lightning_loaders.hashing import mix64
from lightning_loaders.orders.permutation import KeyedPermutation
from lightning_loaders.schedule.partition_plan import partition_epoch
from lightning_loaders.schedule.requests import (
    Cursor,
    Delivered,
    PartRequest,
    SlotEnd,
    SlotRequest,
)
from lightning_loaders.schedule.shard_plan import Piece, PlanConfig, locate, plan_epoch
from lightning_loaders.sources.plain import PlainStream, sole_reader
from lightning_loaders.sources.shards import ShardedSource

__all__ = ["SlotFetcher", "SlotReader"]

_WINDOW_SALT = 0x5749_4E44_4F57
_PARTITION_SALT = 0x5041_5254_4954  # keys the shuffle windows of canonical partitions
_FIRST_SALT = 0x4649_5253_54  # keys the draws of a batch's first sample (seeking sources)
_FILL_SALT = 0x4649_4C4C  # keys the draws of a shuffle window's samples (seeking sources)
_SECOND = operator.itemgetter(1)


class SlotReader:
    """Reads one slot's pieces in order, optionally through a shuffle window.

    Samples move in chunks (``itertools.islice`` over the shard iterators), so the per-sample
    cost is the source's own; each chunk is read inside the context ``open_reading()`` gave
    with its shard iterator (the shard's own global-RNG states, keyed by ``seed`` and
    ``epoch``). A plain dataset is read inside
    ``sole_reader()`` (entered once per chunk), so it yields its whole stream whatever it does
    with ``get_worker_info()``.
    A sample that raises is found without a cost per sample read: a chunk keeps the samples
    read before it, and a strided piece, whose slices skip other slots' samples, is read
    through a count (``zip`` with ``itertools.count``, in C).

    A source that seeks and may draw (``seeks``, not ``rng_free``) draws under each batch's
    seeding of the global RNGs, but some samples are read in an earlier batch's fetch than
    their own: a shuffle window's (read as a whole), and with unknown lengths each batch's
    first (``at_end`` reads it ahead). Those are read under a seeding keyed by their place in
    the slot's stream (``seeded_apart``): a window's samples under the window's seeding, a
    batch's first sample under its own, the rest of the batch under the batch's. A sample
    then draws the same whichever fetch reads it, so a resume anywhere is exact. After a
    window's read the RNGs are seeded again as the batch's fetch seeded them, so what the
    fetch draws itself (a ``collate_fn``) does not depend on whether it read a window (a
    reader opened to resume reads its first window in the batch's fetch).
    """

    def __init__(self, source: ShardedSource[Any], pieces: tuple[Piece, ...], start: Cursor,
                 window: int, key: int, generation: int, seed: int, epoch: int) -> None:
        self.generation, self.batch, self.exhausted = generation, start.batches, start.exhausted
        self._source, self._pieces, self._window, self._key = source, pieces, window, key
        self._seed, self._epoch = seed, epoch
        self._apart = source.seeks and not source.rng_free  # draws under each batch's seeding
        self._first_apart = self._apart and window <= 1 and source.shard_lengths is None
        self._view: Callable[[], AbstractContextManager[Any]] = (
            sole_reader if isinstance(source, PlainStream) else nullcontext)
        self._piece, self._offset, self._state = start.piece, start.offset, start.reader_state
        self._it: Iterator[Any] | None = None
        self._reads: AbstractContextManager[Any] = nullcontext()  # what ``_it`` is read in
        self._it_position = 0  # the shard position the open iterator yields next
        self._opened_at = 0  # the shard position it was opened at
        self._samples: Iterator[Any] = iter(())  # what is read: ``_it``, or ``_it`` counted
        self._counter: Iterator[int] | None = None  # the next shard position, when counted
        self._raised_at: tuple[int, int] | None = None  # (shard, position) of one that raised
        self.head: int | None = None  # a plain stream's ``opened_head``, once opened here
        self._peeked: list[tuple[Any, tuple[int, int, Any]]] = []  # (sample, its position)
        self._failure: Exception | None = None  # raised reading ahead: the next take()'s
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
        if self._failure is not None and n > 0:
            failure, self._failure = self._failure, None
            raise failure
        if self._window <= 1:
            out = self._read_batch(n) if self._first_apart else self._read(n)
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
        """Whether the slot's stream has no sample left (reads one ahead to know, a whole
        shuffle window with one; an error in that read belongs to the next batch, so the next
        ``take`` raises it)."""
        if ((self._window > 1 and self._taken < len(self._buffer)) or self._peeked
                or self._failure is not None):
            return False
        try:
            if self._window > 1:
                return not self._fill()
            position = self._position()
            sample = self._read_first(reseed=False) if self._first_apart else self._read(1)
        except Exception as exc:
            self._failure = exc
            return False
        if not sample:
            return True
        self._peeked.append((sample[0], position))
        return False

    def cursor(self) -> Cursor:
        """Where the slot stands now (the position of its current window's first sample)."""
        if self._window <= 1 or self._taken == len(self._buffer):
            piece, offset, state = self._position()
            return Cursor(self.batch, self._emitted, self._emitted, piece, offset, state,
                          self.exhausted)
        window_emitted, (piece, offset, state) = self._window_start
        return Cursor(self.batch, self._emitted, window_emitted, piece, offset, state,
                      self.exhausted)

    def where(self) -> str:
        """The shard and position being read, for error messages."""
        if self._piece >= len(self._pieces):
            return "after its last shard"
        shard = self._source.describe_shard(self._pieces[self._piece].shard)
        return f"{shard}, reading from sample {self._offset}"

    def raised(self, batch: str) -> tuple[str, int | None] | None:
        """The sample that raised reading ``batch`` (``"batch 2 of slot 0"``), for the error:
        its words (``"sample 3 of shard 1 (stream position 11, batch 2 of slot 0)"``) and its
        position in the source's stream (its shards in order; ``None`` past a shard of unknown
        length). ``None`` if none raised, or if the shard iterator had yielded nothing since
        it was opened mid-shard (the source may have raised skipping to its start)."""
        if self._raised_at is None:
            return None
        shard, sample = self._raised_at
        if isinstance(self._source, PlainStream):
            name = type(self._source.dataset).__name__
            return f"sample {sample} of the {name} stream ({batch})", sample
        before = self._source.shard_lengths if shard else ()
        position = None if before is None else sum(before[:shard]) + sample
        known = f"stream position {position}, " if position is not None else ""
        return f"sample {sample} of {self._source.describe_shard(shard)} ({known}{batch})", position

    @contextmanager
    def viewing(self) -> Iterator[None]:
        """The view the reads happen in (``sole_reader()`` for a plain dataset) and the open
        shard's reading context (``_reading()``), to enter once around a batch's read and its
        read-ahead: nested in them, theirs cost nothing."""
        with self._view(), self._reading():
            yield

    def close(self) -> None:
        iterator, self._it, self._samples = self._it, None, iter(())
        self._reads = nullcontext()
        close = getattr(iterator, "close", None)
        if callable(close):
            with self._view():
                close()

    def _fill(self) -> bool:
        """Read the next window and permute it; ``False`` at the end of the stream."""
        self._window_start = (self._emitted, self._position())
        index = self._emitted // self._window
        apart = seeded_apart(self._key, index, _FILL_SALT, reseed=True)
        with apart if self._apart else nullcontext():
            samples = self._read(self._window)
        self._taken = 0
        self._buffer = samples
        if not samples:
            return False
        order = KeyedPermutation(len(samples), mix64(self._key, index))
        self._buffer = [samples[i] for i in order[np.arange(len(samples))].tolist()]
        return True

    def _read_batch(self, n: int) -> list[Any]:
        """A batch's ``n`` next samples, its first read apart (``_read_first``)."""
        first = self._read_first(reseed=True) if n > 0 else []
        return first + self._read(n - 1) if first else first

    def _read_first(self, reseed: bool) -> list[Any]:
        """The next sample (none at the end), a batch's first, unless it was read ahead:
        read under the global RNGs seeded from its place in the slot's stream, so it draws the
        same in the batch's fetch as read ahead in the one before; ``reseed`` (in its own
        batch's fetch) then seeds them again as the fetch did, for the rest of the batch."""
        if self._peeked:
            return self._read(1)
        with seeded_apart(self._key, self._emitted, _FIRST_SALT, reseed=reseed):
            return self._read(1)

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
        """Move past the pieces read to their stop; an empty piece (a shard declared empty)
        is opened on the way, to check that it is."""
        while self._piece < len(self._pieces):
            piece = self._pieces[self._piece]
            if piece.stop is None or self._offset < piece.stop:
                return
            if piece.start == piece.stop:
                self._open(piece)
                self._check_ends_at(piece.shard, piece.stop)
            self._advance()

    def _advance(self) -> None:
        self.close()
        self._piece += 1
        self._state = None
        if self._piece < len(self._pieces):
            self._offset = self._pieces[self._piece].start

    def _read(self, n: int) -> list[Any]:
        """Up to ``n`` next samples of the pieces (raw: before the shuffle window)."""
        with self._view():
            return self._read_pieces(n)

    def _read_pieces(self, n: int) -> list[Any]:
        out = [self._peeked.pop()[0]] if self._peeked and n > 0 else []
        while len(out) < n:
            self._skip_finished_pieces()
            if self._piece >= len(self._pieces):
                break
            piece = self._pieces[self._piece]
            if self._it is None:
                self._open(piece)
            want = n - len(out)
            if piece.stop is not None:
                want = min(want, len(range(self._offset, piece.stop, piece.step)))
            skip = self._offset - self._it_position  # other slots' samples (strided pieces)
            chunk: list[Any] = []
            try:  # ``extend`` keeps the samples read before one raised
                with self._reading():
                    chunk.extend(itertools.islice(self._samples, skip,
                                                  skip + (want - 1) * piece.step + 1, piece.step))
            except Exception:
                self._note_raised(piece.shard, self._offset + len(chunk))
                raise
            if chunk:
                out += chunk
                self._it_position = self._offset + (len(chunk) - 1) * piece.step + 1
                self._offset += len(chunk) * piece.step
                if piece.stop is not None and self._offset >= piece.stop:
                    self._check_ends_at(piece.shard, piece.stop)
                    self._skip_finished_pieces()  # checks the empty pieces next (a slot's last too)
            if len(chunk) < want:  # the shard ended
                if piece.stop is not None:
                    raise ValueError(self._too_short(piece))
                self._advance()
        return out

    def _open(self, piece: Piece) -> None:
        """Open ``piece``'s shard at the current offset; a strided piece's iterator is read
        counted (its slices skip other slots' samples: any of them may raise)."""
        self._it, self._reads = self._source.open_reading(piece.shard, self._offset, self._state,
                                                          self._seed, self._epoch)
        self._it_position, self._opened_at, self._state = self._offset, self._offset, None
        self._samples, self._counter = self._it, None
        if piece.step > 1:
            self._counter = itertools.count(self._offset)
            self._samples = map(_SECOND, zip(self._counter, self._it, strict=False))
        if isinstance(self._source, PlainStream):
            self.head = self._source.opened_head

    def _reading(self) -> AbstractContextManager[Any]:
        """The context the open shard iterator is read in (``open_reading``; nothing if
        none)."""
        return self._reads

    def _note_raised(self, shard: int, position: int) -> None:
        """Note the sample of ``shard`` that raised: ``position`` (the one after those read)
        in a contiguous read, the counted one in a strided read; none if the iterator had
        yielded nothing since it was opened mid-shard."""
        if self._counter is not None:
            position = next(self._counter) - 1
        if position > self._opened_at or self._opened_at == 0:
            self._raised_at = (shard, position)

    def _check_ends_at(self, shard: int, stop: int) -> None:
        """Where ``stop`` is the shard's declared length, raise if the shard goes on past it:
        those samples would be lost every epoch, in silence."""
        lengths = self._source.shard_lengths
        if lengths is None or stop != lengths[shard] or self._it is None:
            return
        skip = stop - self._it_position  # other slots' samples (strided pieces)
        past: list[Any] = []
        try:
            with self._reading():
                past.extend(itertools.islice(self._samples, skip, skip + 1))
        except Exception:
            self._note_raised(shard, stop)
            raise
        self._it_position = stop + len(past)
        if past:
            raise ValueError(self._too_long(shard, stop))

    def _too_long(self, shard: int, declared: int) -> str:
        if isinstance(self._source, PlainStream):
            return (f"the {type(self._source.dataset).__name__} stream goes on past its len() "
                    f"({declared}): the samples after it would never be read. Fix __len__, or "
                    "drop it (a stream without len() is read to its end)")
        return (f"{self._source.describe_shard(shard)} goes on past its declared length "
                f"({declared}): the samples after it would never be read. Fix the source's "
                "shard_lengths (or leave them unknown), or rebuild a source over files that "
                "changed since it was built")

    def _too_short(self, piece: Piece) -> str:
        if isinstance(self._source, PlainStream):
            lengths = self._source.shard_lengths
            return self._source.shorter_than_declared(
                self._offset, lengths[0] if lengths else piece.stop or 0)
        return (f"{self._source.describe_shard(piece.shard)} ended at sample {self._offset}, but "
                f"its declared length says it has at least {piece.stop}: fix the source's "
                "shard_lengths, or rebuild a source over files that changed since it was built")


class SlotFetcher(Dataset[Any]):
    """What the internal DataLoader indexes: answers one ``SlotRequest`` with one batch.

    It keeps each slot's reader between requests (in the worker that serves the slot), so a
    slot's shards are read sequentially; a request its reader cannot continue (a new epoch, a
    resume, a request routed elsewhere) reopens the reader from the request's start cursor.
    A ``PartRequest`` is read from canonical partitions the same way: a reader per partition
    is kept in the worker and continued when the next request starts where it stopped.

    A source that seeks and may draw from the global RNGs is read under each batch's seeding
    of them; on a worker thread each request is answered in an ``rng_turn`` (one thread at a
    time), so its draws are those of a worker process.
    """

    def __init__(self, source: ShardedSource[Any], config: PlanConfig, slots: int, window: int,
                 collate_fn: Callable[[list[Any]], Any] | None, ring: bool = False) -> None:
        self.dataset = source.dataset if isinstance(source, PlainStream) else source
        self.source, self.config, self.slots, self.window = source, config, slots, window
        self.collate_fn = worker_collate(collate_fn, ring)
        self._readers: dict[int, SlotReader] = {}
        self._partitions: dict[int, tuple[SlotReader, int]] = {}  # reader, next sample
        self._source_epoch: int | None = None
        self._shares_source = False
        self._turns = source.seeks and not source.rng_free  # draws under each batch's seeding

    def thread_copy(self) -> SlotFetcher:
        """A copy for one worker thread: its own open readers (as a worker process has), the
        source shared with the main process, which sets its epoch (``set_epoch``) for all.

        A plain ``IterableDataset`` is copied for each thread instead, as each worker process
        has its own: its iterator may keep state on the object (a Hugging Face
        ``IterableDataset`` does, and two threads iterating one object lost samples); each
        thread then forwards the epoch to its copy. One that cannot be copied is refused."""
        mine = copy.copy(self)
        mine._readers, mine._partitions, mine._shares_source = {}, {}, True
        if isinstance(self.source, PlainStream):
            try:
                stream = copy.deepcopy(self.source)
            except Exception as exc:
                raise TypeError(
                    f"backend='thread' reads a plain IterableDataset through a copy per thread "
                    f"(its iterator may keep state on the object), but this "
                    f"{type(self.dataset).__name__} cannot be copied ({type(exc).__name__}: "
                    f"{exc}): use backend='process', or wrap the data in a ShardedSource"
                ) from exc
            mine.source, mine.dataset, mine._shares_source = stream, stream.dataset, False
        return mine

    def __getitem__(self, request: SlotRequest | PartRequest) -> Delivered | SlotEnd:
        with rng_turn() if self._turns else nullcontext():
            return self._answer(request)

    def _answer(self, request: SlotRequest | PartRequest) -> Delivered | SlotEnd:
        if isinstance(request, PartRequest):
            return self._partition_batch(request)
        if request.start is None:
            return SlotEnd(-1)
        reader = None
        try:
            reader = self._reader(request)
            if reader.exhausted:
                return self._slot_end(request.slot, reader)
            known = self.config.lengths is not None
            with seeded_fetch(self.config.seed, request.epoch, request.batch, request.rank,
                               request.slot):
                with reader.viewing():
                    samples = reader.take(request.size)
                    if not known:
                        if not samples or (len(samples) < request.size
                                           and self.config.last_batch == "drop"):
                            reader.exhausted = True
                            return self._slot_end(request.slot, reader)
                        reader.exhausted = len(samples) < request.size or reader.at_end()
                if known and len(samples) < request.size:
                    raise ValueError(f"slot {request.slot} ran out of samples {reader.where()}: "
                                     "a shard is shorter than its declared length")
                reader.batch += 1
                cursor = None if known else reader.cursor()
                data = self.collate_fn(samples)
        except Exception as exc:
            raise _fetch_error(request, reader, exc) from exc
        head, reader.head = reader.head, None
        return Delivered(request.slot, request.batch, data, cursor, head)

    def _slot_end(self, slot: int, reader: SlotReader) -> SlotEnd:
        """The slot's end; for a plain stream of unknown length, with the stream position its
        copy ended at, for the schedule to compare with the other slots' (``SlotEnd.end``)."""
        plain_unknown = self.config.strided and self.config.lengths is None
        return SlotEnd(slot, reader.cursor().offset if plain_unknown else None)

    def set_epoch(self, epoch: int) -> None:
        """Forward the epoch to the source's ``set_epoch``, once per epoch in this process.

        The loader calls it in the main process before the epoch's requests go out, so a
        source that keeps its epoch in memory shared with the workers (Hugging Face's) is set
        once, before any worker reads; each worker process then forwards it to its own copy
        (worker threads share the main process's source, already set).
        """
        if epoch != self._source_epoch and not self._shares_source:
            set_epoch = getattr(self.source, "set_epoch", None)
            if callable(set_epoch):
                set_epoch(epoch)
            self._source_epoch = epoch

    def close(self) -> None:
        for reader in self._readers.values():
            reader.close()
        self._readers.clear()
        for reader, _ in self._partitions.values():
            reader.close()
        self._partitions.clear()

    def _partition_batch(self, request: PartRequest) -> Delivered:
        """One batch made of ``request.segments`` of canonical partitions."""
        for partition, (kept, _) in list(self._partitions.items()):
            if kept.generation != request.generation:
                kept.close()
                del self._partitions[partition]
        reader: SlotReader | None = None
        try:
            self.set_epoch(request.epoch)
            with seeded_fetch(self.config.seed, request.epoch, request.batch, request.rank,
                               request.slot):
                samples: list[Any] = []
                for partition, start, count in request.segments:
                    reader = self._partition_reader(request, partition, start)
                    taken = reader.take(count)
                    if len(taken) < count:
                        raise ValueError(f"partition {partition} ran out of samples "
                                         f"{reader.where()}: a shard is shorter than its "
                                         "declared length")
                    samples += taken
                    self._partitions[partition] = (reader, start + count)
                data = self.collate_fn(samples)
        except Exception as exc:
            raise _fetch_error(request, reader, exc) from exc
        return Delivered(request.slot, request.batch, data, None)

    def _partition_reader(self, request: PartRequest, partition: int, start: int) -> SlotReader:
        """The reader of ``partition`` positioned at its sample ``start`` (kept or reopened)."""
        kept = self._partitions.get(partition)
        if kept is not None and kept[1] == start:
            return kept[0]
        if kept is not None:
            kept[0].close()
        config = self.config
        pieces = partition_epoch(config, request.epoch, request.partitions).pieces[partition]
        window_start = start - start % self.window
        piece, offset = locate(pieces, window_start)
        cursor = Cursor(0, start, window_start, piece, offset, None, False)
        key = mix64(config.seed, request.epoch, partition, _PARTITION_SALT)
        return SlotReader(self.source, pieces, cursor, self.window, key, request.generation,
                          config.seed, request.epoch)

    def _reader(self, request: SlotRequest) -> SlotReader:
        """The slot's kept reader when it stands at the request's batch, or has ended before
        it (requests sent before the main process heard of the end); else a new one, read up
        to that batch."""
        reader = self._readers.get(request.slot)
        if (reader is not None and reader.generation == request.generation
                and (reader.batch == request.batch
                     or (reader.exhausted and reader.batch < request.batch))):
            return reader
        if reader is not None:
            reader.close()
        assert request.start is not None
        self.set_epoch(request.epoch)
        layout = plan_epoch(self.config, request.epoch, request.world_size, self.slots,
                            request.origin)
        key = mix64(self.config.seed, request.epoch, request.rank, request.slot, _WINDOW_SALT)
        reader = SlotReader(self.source, layout.pieces[request.rank][request.slot],
                            request.start, self.window, key, request.generation,
                            self.config.seed, request.epoch)
        while reader.batch < request.batch and not reader.exhausted:  # a request routed here
            sizes = layout.sizes[request.rank][request.slot] if layout.sizes else None
            size = sizes[reader.batch] if sizes else self.config.batch_size
            reader.exhausted = len(reader.take(size)) < size
            reader.batch += 1
        self._readers[request.slot] = reader
        return reader


def _fetch_error(request: SlotRequest | PartRequest, reader: SlotReader | None,
                 exc: Exception) -> SampleFetchError:
    """The error naming the batch and slot being read, and the sample that raised (with its
    position in the source's stream, where known) or else the shard being read."""
    batch = f"batch {request.batch} of slot {request.slot}"
    raised = reader.raised(batch) if reader is not None else None
    if raised is None:
        shard = f" ({reader.where()})" if reader is not None else ""
        raised = batch + shard, None
    what, position = raised
    return fetch_error(exc, what, epoch=request.epoch, batch=request.batch, rank=request.rank,
                       position=position)
