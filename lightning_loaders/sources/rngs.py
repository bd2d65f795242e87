"""Global-RNG states of its own for each shard a loader reads.

A source may draw from the global ``random``, numpy and torch RNGs as it opens a shard (a
shuffle of its rows) or as it reads one (a shuffle buffer, an augmentation). Each batch's
fetch seeds them per slot and batch, so such a shard would yield other samples in every slot
that opens it, every worker count and every resume. ``opened_under`` opens it with them
seeded from a key of the caller's (seed, epoch, shard) and returns ``ReadRngs``, the states
its reads then run under, carried from read to read: what it draws is a function of the key
and of how far it was read, wherever it is read.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import TypeVar

from lightning_loaders.context import (
    RngStates,
    global_rng_states,
    reseeder,
    rng_lock,
    seeded_global_rngs,
    set_global_rng_states,
)

__all__ = ["ReadRngs", "opened_under"]

T = TypeVar("T")


def opened_under(open_shard: Callable[[], T], *key: int) -> tuple[T, ReadRngs]:
    """``open_shard()`` run with the global RNGs seeded from ``key`` (the caller's are put back
    afterwards), and the RNG states it left, for its reads."""
    with rng_lock(), seeded_global_rngs(*key):
        opened = open_shard()
        rngs = ReadRngs(global_rng_states())
    return opened, rngs


class ReadRngs:
    """The global RNGs' states (``random``, numpy, torch) one opened shard reads under,
    carried from read to read, so a source drawing from them while it reads yields the same
    samples in every slot, rank and resume, whatever each batch's fetch seeded them with.

    Entered around each batch's read (saving numpy's state costs tens of microseconds, too
    much per sample; entered again inside, it costs nothing), it puts the shard's states in
    place and the caller's back afterwards, so what the fetch draws itself (a ``collate_fn``)
    does not move with the shard's draws either: inside a fetch, which seeded them and drew
    nothing before the read, by seeding them again (``reseeder``), else as they were. Worker
    threads share the global RNGs: the states stay in place under a process-wide lock, so
    threads read such shards one at a time.
    """

    def __init__(self, states: RngStates) -> None:
        self._states = states
        self._saved: RngStates | None = None
        self._reseed: Callable[[], None] | None = None
        self._depth = 0  # entered inside itself (a batch's read, then a chunk of it)

    def __enter__(self) -> None:
        if self._depth == 0:
            rng_lock().acquire()
            try:
                self._reseed = reseeder()
                self._saved = global_rng_states() if self._reseed is None else None
                set_global_rng_states(self._states)
            except BaseException:
                rng_lock().release()
                raise
        self._depth += 1

    def __exit__(self, *exc_info: object) -> None:
        self._depth -= 1
        if self._depth:
            return
        try:
            self._states = global_rng_states()
            if self._reseed is not None:
                self._reseed()
            else:
                assert self._saved is not None
                set_global_rng_states(self._saved)
        finally:
            self._saved, self._reseed = None, None
            rng_lock().release()
