"""Where user code running inside the loader learns where it is: worker, rank, epoch, sample.

``sample_rng()`` gives ``__getitem__`` and transforms a generator seeded by
``(seed, epoch, global position)``: augmentations then do not change with ``num_workers``,
``world_size`` or a resume. Global RNGs (``random``, ``numpy``, ``torch``) are also re-seeded
for every batch from ``(seed, epoch, batch, rank)``, so code using them is reproducible for a
fixed world size whatever ``num_workers`` is (a plain ``IterableDataset``'s stream reads under
states of its own, put in place around each batch's read: ``sources.plain``). In the main
process (``num_workers=0``) they are re-seeded after the batch from a value drawn from them
before it, so the training loop's own random streams stay functions of its seed
(``seed_everything``), not of the loader's. Worker
*threads* (``backend="thread"``) share the process's global RNGs with each other and with the
training loop, so they fetch map-style batches with them untouched: per-sample randomness
comes from ``sample_rng()``, identical under every backend. A fetch from an iterable source
that seeks and may draw holds them instead (``rng_turn``: one thread at a time), seeded as in
a worker process.

The current sample and worker are per thread: each worker thread sees its own.
"""

from __future__ import annotations

import functools
import os
import random
import threading
from collections.abc import Callable, Iterator, Sequence, Sized
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass
from typing import Any, Literal

import numpy as np
import torch

from lightning_loaders.hashing import mix64, mix64_after

__all__ = [
    "SampleContext",
    "WorkerInfo",
    "sample_context",
    "sample_rng",
    "set_samples",
    "worker_info",
]


@dataclass(frozen=True)
class SampleContext:
    """The sample being fetched right now.

    Attributes:
        seed: the loader's seed.
        epoch: the epoch whose permutation holds the sample.
        position: the sample's position in that epoch's order.
        index: the dataset index being fetched.
        rank: the rank fetching it.
    """

    seed: int
    epoch: int
    position: int
    index: int
    rank: int

    @property
    def sample_seed(self) -> int:
        """A 63-bit seed unique to ``(seed, epoch, position)``."""
        return mix64(self.seed, self.epoch, self.position) >> 1

    def rng(self) -> np.random.Generator:
        """A numpy generator seeded by ``(seed, epoch, position)``."""
        return np.random.default_rng(self.sample_seed)

    def torch_generator(self) -> torch.Generator:
        """A CPU torch generator seeded by ``(seed, epoch, position)``."""
        return torch.Generator().manual_seed(self.sample_seed)


class WorkerInfo(int):
    """The worker id (it *is* the int torch passes to ``worker_init_fn``) plus where it runs.

    A plain one-argument ``worker_init_fn(worker_id)`` keeps working; richer ones read the
    attributes ``id``, ``num_workers``, ``rank``, ``world_size``, ``epoch``, ``seed``,
    ``dataset`` (the user's dataset, not our wrapper) and ``backend`` (``"process"`` or
    ``"thread"``: what the worker is). ``epoch`` is the epoch the worker started in, as its
    ``worker_init_fn`` saw it: persistent workers keep it for later epochs, so a sample's own
    epoch is ``sample_context().epoch``.
    """

    id: int
    num_workers: int
    rank: int
    world_size: int
    epoch: int
    seed: int
    dataset: Any
    backend: str

    def __new__(
        cls,
        worker_id: int,
        *,
        num_workers: int,
        rank: int,
        world_size: int,
        epoch: int,
        seed: int,
        dataset: Any,
        backend: str = "process",
    ) -> WorkerInfo:
        info = super().__new__(cls, worker_id)
        info.id = worker_id
        info.num_workers = num_workers
        info.rank = rank
        info.world_size = world_size
        info.epoch = epoch
        info.seed = seed
        info.dataset = dataset
        info.backend = backend
        return info

    def __repr__(self) -> str:
        return (f"WorkerInfo(id={self.id}, num_workers={self.num_workers}, rank={self.rank}, "
                f"world_size={self.world_size}, epoch={self.epoch}, seed={self.seed}, "
                f"backend={self.backend!r})")

    def __str__(self) -> str:
        """The id, as torch's plain int prints (``f"shard-{worker_id}"``, ``"%s"``)."""
        return int.__repr__(self)


_Column = Sequence[int] | np.ndarray[Any, Any]
_Samples = tuple[int, int, _Column, _Column, _Column]
"""The samples of one fetch: ``(seed, rank, epochs, positions, indices)``, one entry per
sample in each column."""


class _Current(threading.local):
    """Per thread: a worker (process or thread) serves exactly one loader, and in the main
    thread these are set only for the duration of one fetch, so loaders never see each other's
    values. The samples of a fetch are published once; the one being fetched is number
    ``skipped + len(fetched)``, where ``fetched`` is the list the engine appends the fetched
    samples to, so the engine's loop does nothing per sample for it. A ``SampleContext`` is
    built only when user code asks for it."""

    samples: _Samples | None = None
    fetched: Sized = ()
    skipped: int = 0
    worker: WorkerInfo | None = None
    seeding: int | None = None  # the key of the innermost ``seeded_global_rngs`` block running
    turn: bool = False  # a worker thread holding the global RNGs for a fetch (``rng_turn``)


_current = _Current()
_RNG_LOCK = threading.RLock()  # held while the global RNGs serve one reader (threads share them)


def _new_rng_lock() -> None:
    """In a forked child, where the thread that held the lock may not exist: a free one."""
    global _RNG_LOCK
    _RNG_LOCK = threading.RLock()


os.register_at_fork(after_in_child=_new_rng_lock)


def rng_lock() -> threading.RLock:
    """The process-wide lock held while the global RNGs are in the states of one reader (a
    shard's own, ``sources.rngs``, or a worker thread's fetch, ``rng_turn``)."""
    return _RNG_LOCK


def sample_context() -> SampleContext:
    """The sample being fetched; only valid inside ``__getitem__`` or a transform it calls."""
    current = _current
    if current.samples is None:
        raise RuntimeError("sample_context() is only available while a ResumableLoader fetches "
                           "a sample (inside the dataset's __getitem__ or its transforms)")
    seed, rank, epochs, positions, indices = current.samples
    k = current.skipped + len(current.fetched)
    return SampleContext(seed, int(epochs[k]), int(positions[k]), int(indices[k]), rank)


def sample_rng() -> np.random.Generator:
    """``sample_context().rng()``: the per-sample generator to use for augmentations."""
    return sample_context().rng()


def worker_info() -> WorkerInfo | None:
    """This worker's ``WorkerInfo`` (in a worker process or a worker thread), or ``None`` in
    the main process's own threads."""
    return _current.worker


def set_samples(samples: _Samples | None, fetched: Sized = ()) -> _Current:
    """Publish the samples of a fetch (``None`` once it is over), for engines that call the
    user's ``__getitem__``: ``fetched`` is the list the engine appends each fetched sample to;
    one it leaves out (``on_error="skip"``) it counts in the returned record's ``skipped``."""
    _current.samples = samples
    _current.fetched = fetched
    _current.skipped = 0
    return _current


def set_worker(info: WorkerInfo | None) -> None:
    """Publish the ``WorkerInfo`` of the worker running in this thread."""
    _current.worker = info


_Afterwards = Literal["restore", "continue", "leave"]
RngStates = tuple[Any, Any, torch.Tensor]
"""The exact states of the ``random``, ``numpy`` and ``torch`` (CPU) global RNGs."""


def global_rng_states() -> RngStates:
    """The global RNGs' exact states (numpy's costs ~40-120 us: once per batch at most)."""
    return random.getstate(), np.random.get_state(), torch.default_generator.get_state()


def set_global_rng_states(states: RngStates) -> None:
    """Put the global RNGs in ``states`` (from ``global_rng_states``)."""
    random.setstate(states[0])
    np.random.set_state(states[1])
    torch.default_generator.set_state(states[2])


@contextmanager
def seeded_global_rngs(*key: int, afterwards: _Afterwards = "restore") -> Iterator[None]:
    """Run a block with the ``random``, ``numpy`` and ``torch`` global RNGs seeded from ``key``.

    The seeds are ``mix64(*key, i)`` for ``i`` in 0, 1, 2 (32 bits for ``random`` and numpy),
    with the shared key hashed once. ``afterwards`` says what the caller's RNGs become:

    - ``"restore"``: their exact previous states (saving numpy's costs ~120 us: fine once per
      epoch, too much per batch);
    - ``"continue"``: ``torch``'s state put back exactly (cheap), ``random`` and numpy
      re-seeded from one value drawn from each before the block: the caller's streams go on as
      functions of their own seeds (``seed_everything``), never of the loader's key, for a few
      microseconds (a fetch in the main process, every batch);
    - ``"leave"``: seeded from ``key`` (a worker process owns its RNGs).
    """
    saved: tuple[Any, ...] | None = None
    if afterwards == "restore":
        saved = global_rng_states()
    elif afterwards == "continue":
        saved = (random.getrandbits(32), int(np.random.random() * 2**32),
                 torch.default_generator.get_state())
    base = mix64(*key)
    _seed(base)
    outer, _current.seeding = _current.seeding, base
    try:
        yield
    finally:
        _current.seeding = outer
        if afterwards == "restore":
            assert saved is not None
            set_global_rng_states(saved)
        elif afterwards == "continue":
            assert saved is not None
            random.seed(saved[0])
            np.random.seed(saved[1])
            torch.default_generator.set_state(saved[2])


def reseeder() -> Callable[[], None] | None:
    """What seeds the global RNGs again as the innermost ``seeded_global_rngs`` block running in
    this thread seeded them (``None`` outside one): for code drawing from states of its own in
    a block that has drawn nothing yet, putting the block's back for ~10 us, where saving and
    restoring them costs ~100 (numpy's)."""
    base = _current.seeding
    return None if base is None else functools.partial(_seed, base)


@contextmanager
def seeded_apart(*key: int, reseed: bool = False) -> Iterator[None]:
    """Run a block of reads under the global RNGs seeded from ``key``, so that what it draws
    does not depend on which batch's fetch runs it (a read ahead of the next batch, a shuffle
    window's samples). Inside a fetch's seeding (``seeded_fetch``) they are left afterwards
    as the block left them or, with ``reseed``, seeded again as the fetch seeded them (for a
    fetch that drew nothing before the block); outside one the caller's are put back. Nothing
    happens in a worker thread outside an ``rng_turn``, whose RNGs ``seeded_fetch`` leaves
    alone too."""
    info = _current.worker
    if info is not None and info.backend == "thread" and not _current.turn:
        yield
        return
    again = reseeder()
    with seeded_global_rngs(*key, afterwards="restore" if again is None else "leave"):
        yield
    if reseed and again is not None:
        again()


def _seed(base: int) -> None:
    """Seed ``random``, numpy and ``torch`` from ``base``, a hashed key."""
    random.seed(mix64_after(base, 0) & 0xFFFFFFFF)
    np.random.seed(mix64_after(base, 1) & 0xFFFFFFFF)
    torch.default_generator.manual_seed(mix64_after(base, 2) >> 1)


def seeded_fetch(*key: int) -> AbstractContextManager[None]:
    """The global RNGs seeded for one batch fetch: left seeded in a worker process and in a
    worker thread's ``rng_turn`` (which puts the caller's back), continued (see
    ``seeded_global_rngs``) in the main process, whose RNGs are the training loop's;
    untouched in a worker thread otherwise, whose RNGs are shared with the other threads (see
    the module docstring)."""
    info = _current.worker
    if info is not None and info.backend == "thread" and not _current.turn:
        return nullcontext()
    in_worker = _current.turn or torch.utils.data.get_worker_info() is not None
    return seeded_global_rngs(*key, afterwards="leave" if in_worker else "continue")


@contextmanager
def rng_turn() -> Iterator[None]:
    """Run a fetch that may draw from the global RNGs on a worker thread as a worker process
    runs it: holding them (``rng_lock``: threads fetch one at a time), so ``seeded_fetch`` and
    ``seeded_apart`` seed them as they do there, and the caller's states put back afterwards.
    Anywhere else (a process, a turn already held) it does nothing."""
    info = _current.worker
    if info is None or info.backend != "thread" or _current.turn:
        yield
        return
    with _RNG_LOCK:
        saved = global_rng_states()
        _current.turn = True
        try:
            yield
        finally:
            _current.turn = False
            set_global_rng_states(saved)
