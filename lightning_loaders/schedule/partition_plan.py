"""Canonical partitions: an epoch order of an iterable dataset that does not depend on the
layout (ranks x workers), so a mid-epoch resume under another layout continues exactly.

For a source with known shard lengths (``last_batch`` ``"keep"``, ``"drop"`` or ``"pad"``), an
epoch's samples are the shards laid end to end in the epoch's shard order, cut into
``partitions`` contiguous *canonical partitions* (a number chosen once per run and saved in
the state, as MosaicML streaming's canonical nodes). Each partition is read through its own
shuffle window keyed by ``(seed, epoch, partition)`` and cut into batches of ``batch_size``;
*item* ``g`` of the epoch is batch ``g // partitions`` of partition ``g % partitions``.

Partition lengths are whole batches (partition ``c`` has ``items // partitions + (c < items %
partitions)`` of them); the epoch's one short batch (``"keep"``/``"pad"``) is its last item.
So the sequence of items is a pure function of ``(seed, epoch, partitions, batch_size)`` and
the shards, whatever the layout. Rank ``r`` of ``world_size`` delivers items ``r, r +
world_size, ...`` in full rounds of ``world_size`` items; the last, incomplete round is split
evenly over the ranks (``"keep"``; with fewer samples than ranks, the last full round gives up
one sample per rank to it, as the map-style plan does), padded from the start of the
partitions (``"pad"``) or dropped (``"drop"``), so every rank has the same number of batches.

A resumed epoch deals the items left from the cursor's item (``first``) to the new layout, so
nothing is repeated or lost; only the split of that last round depends on the layout. A cursor
inside the rounds that ``"keep"`` cut anew (after a borrowing round) stands ``skip`` samples
into its item, whose rest is dealt as a short item.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass

from lightning_loaders.schedule.map_plan import keep_refusal
from lightning_loaders.schedule.shard_plan import Piece, PlanConfig, epoch_pieces, split

__all__ = ["Partitions", "Segment", "advanced", "deal", "partition_epoch", "uses_partitions"]

Segment = tuple[int, int, int]  # (partition, first sample in its windowed stream, count)


@dataclass(frozen=True)
class Partitions:
    """One epoch's canonical partitions and its items (partition batches)."""

    pieces: tuple[tuple[Piece, ...], ...]  # [partition]: its shard pieces, in order
    lengths: tuple[int, ...]  # samples per partition
    items: int  # partition batches in the epoch
    batch_size: int

    def item(self, g: int) -> Segment:
        """Item ``g``: batch ``g // partitions`` of partition ``g % partitions``."""
        count = len(self.lengths)
        partition, batch = g % count, g // count
        start = batch * self.batch_size
        return partition, start, min(self.batch_size, self.lengths[partition] - start)


def uses_partitions(config: PlanConfig) -> bool:
    """Whether ``config`` plans over canonical partitions (known lengths, shards, no
    rollover); other configurations keep one plan per (rank, worker) slot."""
    return (config.lengths is not None and not config.strided
            and config.last_batch != "rollover")


@functools.lru_cache(maxsize=16)
def partition_epoch(config: PlanConfig, epoch: int, partitions: int) -> Partitions:
    """The canonical partitions of epoch ``epoch`` (a pure function of its arguments)."""
    assert config.lengths is not None and partitions >= 1
    total, size = sum(config.lengths), config.batch_size
    items = total // size if config.last_batch == "drop" else -(-total // size)
    lengths = [(items // partitions + (c < items % partitions)) * size
               for c in range(partitions)]
    used = min(total, items * size)
    if items:
        lengths[(items - 1) % partitions] -= items * size - used  # the short last item
    last = max((c for c, length in enumerate(lengths) if length), default=-1)
    pieces, begin = [], 0
    for c, length in enumerate(lengths):
        pieces.append(tuple(epoch_pieces(config, epoch, begin, begin + length, c == last)))
        begin += length
    return Partitions(tuple(pieces), tuple(lengths), items, size)


@functools.lru_cache(maxsize=16)
def deal(config: PlanConfig, epoch: int, partitions: int, world_size: int,
         first: int = 0, skip: int = 0) -> tuple[tuple[tuple[Segment, ...], ...], ...]:
    """Every rank's batches (``[rank][batch]``: the segments of a batch) of the items from
    item ``first`` on, less the first ``skip`` samples of that item (a cursor inside the
    last rounds of ``"keep"``, which cut items anew); equal batch counts on every rank."""
    plan = partition_epoch(config, epoch, partitions)

    def item(g: int) -> Segment:  # item ``first`` starts ``skip`` samples in
        segment = plan.item(g)
        return (segment[0], segment[1] + skip, segment[2] - skip) if g == first else segment

    size, policy = config.batch_size, config.last_batch
    if policy == "drop" and first == 0 and plan.items < world_size:
        raise ValueError(
            f"last_batch='drop' leaves no batch: {sum(plan.lengths)} samples in full batches "
            f"are fewer than one global batch of {world_size} ranks x batch_size {size}; use "
            "a smaller batch_size or last_batch='keep'/'pad'")
    left = max(0, plan.items - first)
    rounds, extra = divmod(left, world_size)
    last = item(plan.items - 1) if plan.items else (0, 0, size)
    if policy == "pad" and extra == 0 and rounds and last[2] < size:
        rounds, extra = rounds - 1, world_size  # pad the short last item's round
    ranks: list[list[tuple[Segment, ...]]] = [
        [(item(first + t * world_size + r),) for t in range(rounds)]
        for r in range(world_size)]
    if not extra or policy == "drop":
        return tuple(tuple(batches) for batches in ranks)
    tail = [item(g) for g in range(first + rounds * world_size, plan.items)]
    samples = sum(segment[2] for segment in tail)
    if policy == "pad":
        tail += _padding(plan, world_size * size - samples)
        sizes: tuple[int, ...] = (size,) * world_size
    elif samples >= world_size:
        sizes = split(samples, world_size, size)
    elif size >= 2 and rounds:  # the last full round gives up a sample per rank, as map plans
        tail = [ranks[r].pop()[0] for r in range(world_size)] + tail
        samples = sum(segment[2] for segment in tail)  # item ``first`` may be among them, short
        sizes = split(samples - world_size, world_size, size) + (1,) * world_size
    elif config.merge_short_tail and rounds:
        for r, segment in enumerate(_cut(tail, (1,) * samples)):
            ranks[r][-1] += segment
        return tuple(tuple(batches) for batches in ranks)
    else:
        total = sum(plan.lengths)  # every item before ``first`` is a full one
        raise ValueError(keep_refusal(world_size, size, total - first * size - skip, total,
                                      rounds, samples, merged=config.merge_short_tail,
                                      resumed=bool(first)))
    for r, batch in enumerate(_cut(tail, sizes)):
        ranks[r % world_size].append(batch)
    return tuple(tuple(batches) for batches in ranks)


def advanced(config: PlanConfig, epoch: int, partitions: int, first: int, skip: int,
             samples: int) -> tuple[int, int]:
    """``(first, skip)`` of the cursor ``samples`` further on in the item order (past the end:
    ``(items, 0)``)."""
    plan = partition_epoch(config, epoch, partitions)
    skip += samples
    while first < plan.items and skip >= plan.item(first)[2]:
        skip -= plan.item(first)[2]
        first += 1
    return first, skip if first < plan.items else 0


def _padding(plan: Partitions, count: int) -> list[Segment]:
    """``count`` samples from the start of the partitions (each read from its beginning)."""
    out: list[Segment] = []
    while count > 0:
        for partition, length in enumerate(plan.lengths):
            take = min(length, count)
            if take:
                out.append((partition, 0, take))
                count -= take
            if not count:
                break
    return out


def _cut(segments: list[Segment], sizes: tuple[int, ...]) -> list[tuple[Segment, ...]]:
    """``segments`` (in order) cut into consecutive batches of ``sizes`` samples."""
    batches, index, used = [], 0, 0
    for size in sizes:
        batch: list[Segment] = []
        while size:
            partition, start, count = segments[index]
            take = min(size, count - used)
            batch.append((partition, start + used, take))
            size -= take
            used += take
            if used == count:
                index, used = index + 1, 0
        batches.append(tuple(batch))
    return batches
