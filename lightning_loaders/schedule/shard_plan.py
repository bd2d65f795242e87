"""The plan of an epoch of an iterable dataset: which pieces of which shards every
(rank, worker) slot reads, and (known lengths) the sizes of its batches.

A pure function of the shards, ``(seed, epoch, world_size, slots per rank)`` and the batch
policy (under ``"rollover"``, also the stream position global batches are cut from:
``rollover_span``'s ``origin``); ``ResumableIterableLoader``'s module docstring describes it
in words.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from lightning_loaders.hashing import mix64
from lightning_loaders.orders.permutation import KeyedPermutation
from lightning_loaders.schedule.map_plan import LastBatch, keep_fix, rollover_span

__all__ = [
    "Layout",
    "Piece",
    "PlanConfig",
    "delivered_counts",
    "epoch_pieces",
    "locate",
    "plan_epoch",
    "shard_order",
    "split",
]

_SHARD_ORDER_SALT = 0x5348_4152_4453  # keys shard orders apart from the core's sample orders


@dataclass(frozen=True)
class Piece:
    """Positions ``range(start, stop, step)`` of shard ``shard`` (``stop=None``: to its end)."""

    shard: int
    start: int
    stop: int | None = None
    step: int = 1

    def __len__(self) -> int:
        assert self.stop is not None
        return len(range(self.start, self.stop, self.step))


@dataclass(frozen=True)
class PlanConfig:
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
class Layout:
    """One epoch on every rank: each slot's pieces and (known lengths) batch sizes."""

    pieces: tuple[tuple[tuple[Piece, ...], ...], ...]  # [rank][slot]
    sizes: tuple[tuple[tuple[int, ...], ...], ...] | None  # [rank][slot][batch]
    num_batches: int | None  # per rank


@functools.lru_cache(maxsize=16)
def plan_epoch(config: PlanConfig, epoch: int, world_size: int, slots: int,
               origin: tuple[int, int] = (0, 0)) -> Layout:
    if config.lengths is None:
        return _unknown_layout(config, epoch, world_size, slots)
    if config.strided:
        return _strided_layout(config, world_size, slots)
    return _span_layout(config, epoch, world_size, slots, origin)


@functools.lru_cache(maxsize=4)
def shard_order(config: PlanConfig, epoch: int) -> np.ndarray:
    """The shard indices in the order epoch ``epoch`` reads them."""
    n = config.num_shards
    if not config.shuffle or n == 1:
        return np.arange(n, dtype=np.int64)
    return KeyedPermutation(n, mix64(config.seed, epoch, _SHARD_ORDER_SALT))[np.arange(n)]


def _span_layout(config: PlanConfig, epoch: int, world_size: int, slots: int,
                 origin: tuple[int, int]) -> Layout:
    """Known lengths: contiguous spans of the epoch's samples per rank, then per slot."""
    assert config.lengths is not None
    total, size, policy = sum(config.lengths), config.batch_size, config.last_batch
    global_batch = world_size * size
    base = 0
    if policy == "rollover":
        base, stop = rollover_span(epoch, total, global_batch, origin)
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
                    f"last_batch='pad' or 'drop', {keep_fix(size)}or "
                    "evaluation=True")
            batches = total // world_size  # the leftovers join the first ranks' last batch
        per_rank = [split(total // world_size + (r < total % world_size), batches, size)
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
    return Layout(tuple(pieces), tuple(sizes), len(per_rank[0]))


def _stream_pieces(config: PlanConfig, epoch: int, begin: int, end: int) -> tuple[Piece, ...]:
    """The pieces holding positions ``[begin, end)`` of the epoch's stream of samples.

    Positions past the epoch's samples wrap around to its start (``"pad"``) or, under
    ``"rollover"``, continue into the next epochs' orders (positions count from epoch 0).
    """
    assert config.lengths is not None
    total = sum(config.lengths)
    pieces: list[Piece] = []
    position = begin
    while position < end:
        cycle, offset = divmod(position, total)
        order_epoch = cycle if config.last_batch == "rollover" else epoch
        stop = min(end - cycle * total, total)
        pieces += epoch_pieces(config, order_epoch, offset, stop, stop == total)
        position = cycle * total + stop
    return tuple(pieces)


def epoch_pieces(config: PlanConfig, epoch: int, begin: int, end: int,
                 trailing: bool = False) -> list[Piece]:
    """The pieces holding positions ``[begin, end)`` of epoch ``epoch``'s order of samples.

    A shard declared empty at a position in ``[begin, end)`` (``trailing``, for the range that
    ends what is read of the order: from ``begin`` on) is an empty piece, so that the reader
    opens it and checks it is: its samples, if it has any, would be lost in silence.
    """
    assert config.lengths is not None
    order = shard_order(config, epoch)
    lengths = np.asarray(config.lengths, dtype=np.int64)[order]
    ends = np.cumsum(lengths)
    pieces = []
    for index in range(int(np.searchsorted(ends, begin)), len(order)):
        shard, first = int(order[index]), int(ends[index] - lengths[index])
        if lengths[index] == 0:
            if first < end or trailing:
                pieces.append(Piece(shard, 0, 0))
        elif first < end:
            start, stop = max(begin, first), min(end, int(ends[index]))
            if stop > start:
                pieces.append(Piece(shard, start - first, stop - first))
        elif not trailing:
            break
    return pieces


def _strided_layout(config: PlanConfig, world_size: int, slots: int) -> Layout:
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
        counts = [delivered_counts(row, batches) for row in full]
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
        sizes = [[split(n, c, size) for n, c in zip(lengths[r], counts[r], strict=True)]
                 for r in range(world_size)]
    pieces = tuple(
        tuple(_strided_pieces(r * slots + w, stride, lengths[r][w], sum(sizes[r][w]))
              for w in range(slots))
        for r in range(world_size))
    return Layout(pieces, tuple(tuple(row) for row in sizes), batches)


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


def _strided_pieces(slot: int, stride: int, length: int, span: int) -> tuple[Piece, ...]:
    """``span`` samples of a strided slot of ``length`` samples, wrapping to its start."""
    if length == 0 or span == 0:
        return ()
    full, rest = divmod(span, length)
    pieces = [Piece(0, slot, slot + stride * length, stride)] * full
    if rest:
        pieces.append(Piece(0, slot, slot + stride * rest, stride))
    return tuple(pieces)


def _unknown_layout(config: PlanConfig, epoch: int, world_size: int, slots: int) -> Layout:
    """Unknown lengths: whole shards dealt out in the epoch's order, ranks first."""
    stride = world_size * slots
    if config.strided:
        pieces = tuple(tuple((Piece(0, r * slots + w, None, stride),) for w in range(slots))
                       for r in range(world_size))
        return Layout(pieces, None, None)
    if config.num_shards < world_size:
        raise ValueError(
            f"{config.num_shards} shards of unknown length cannot feed {world_size} ranks: every "
            "rank needs a shard. Declare the shard lengths (shards can then be split), use more "
            "shards, or fewer ranks")
    dealt: list[list[list[Piece]]] = [[[] for _ in range(slots)] for _ in range(world_size)]
    for i, shard in enumerate(shard_order(config, epoch)):
        dealt[i % world_size][(i // world_size) % slots].append(Piece(int(shard), 0))
    return Layout(tuple(tuple(tuple(s) for s in r) for r in dealt), None, None)


def split(total: int, parts: int, size: int) -> tuple[int, ...]:
    """``total`` samples in ``parts`` batches of at most ``size``: full ones first, the rest
    as even as possible (never empty); samples beyond ``parts * size`` join the last batch."""
    if parts == 0:
        return ()
    if total > parts * size:
        sizes = split(parts * size, parts, size)
        return sizes[:-1] + (sizes[-1] + total - parts * size,)
    full = parts if size == 1 else min(parts, (total - parts) // (size - 1))
    share, extra = divmod(total - full * size, parts - full) if parts > full else (0, 0)
    rest = parts - full
    return (size,) * full + (share + 1,) * extra + (share,) * (rest - extra)


def delivered_counts(batches: Sequence[int], delivered: int) -> list[int]:
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


def locate(pieces: Sequence[Piece], emitted: int) -> tuple[int, int]:
    """``(piece, offset in its shard)`` of a known-length slot's sample ``emitted``."""
    for index, piece in enumerate(pieces):
        n = len(piece)
        if emitted < n or emitted == 0:  # an empty piece at the start is still read (checked)
            return index, piece.start + emitted * piece.step
        emitted -= n
    return len(pieces), 0
