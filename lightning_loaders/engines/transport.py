"""Worker to main process transport through reusable shared-memory rings.

torch moves every tensor of a batch from a worker in a fresh shared-memory segment: allocated
and mapped in the worker, its file descriptor passed over a socket, mapped again in the main
process, first-touch page faults on both sides (dear in a virtual machine: about 400 per
1.5 MB batch), unmapped when the batch dies. Each worker process here instead keeps a ring of
reusable ``/dev/shm`` slots, mapped and faulted in once:

- ``ring_collate`` (``default_collate``'s values) stacks a batch's tensors straight into a free
  slot of the worker's ring; ``RingPacker`` (applied to each result) copies there only the
  tensors made elsewhere (by a user's ``collate_fn``), and returns a small ``Packed``
  descriptor: the result pickled with each tensor replaced by its place in the slot.
- ``RingReader`` (main process) rebuilds the result with its tensors as views of the slot, no
  copy. The slot stays the user's while any tensor of that batch lives, and returns to its
  worker when the last one dies: a delivered batch is never overwritten, and may be kept as
  long as one likes. A process forked meanwhile (``multiprocessing`` with fork, given the
  batch) shares the slot's memory and may read it for as long as it runs, so such a slot is
  retired instead: its worker never writes into it again, and makes a new one in its place.
  With ``pin_memory`` the tensors are copied into pinned memory instead (the copy pinning
  makes anyway) and the slot is free at once.

A slot is sized by the first result it carries and replaced by a larger one when a result does
not fit; a worker keeps at most ``slots`` of them, none over ``MAX_SLOT_BYTES``. A result that
meets no free slot (the user holds them all), a tensor the ring does not take (views with
gaps, tensors needing grad, other devices...), a result whose tensors share memory (a buffer
and views of it, which stay so only torch's way) and a result that does not pickle go
through torch's path unchanged.

Lifetime: slots are named ``ll_ring_<main pid>_<worker pid>_<slot>_<generation>``. The main
process unlinks a slot's name as soon as it has mapped it (mappings keep the memory until both
sides close them, and the batches viewing it are gone); ``RingReader.close`` unlinks what is
left of its workers' slots (one killed before its slot was read, results never received); a
worker unlinks its own at exit when the main process is gone (killed). Only the death of the
main process and a worker together can leave a named slot behind.
"""

from __future__ import annotations

import io
import math
import mmap
import os
import pickle
import time
import weakref
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing import util as mp_util
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate
from torch.utils.data._utils.collate import collate, collate_tensor_fn, default_collate_fn_map

__all__ = ["MAX_SLOT_BYTES", "SHM_DIR", "TRANSIT_BATCH_S", "TRANSIT_TENSOR_S", "Packed",
           "RingPacker", "RingReader", "ring_collate", "ring_files", "transit_s", "worker_collate"]

SHM_DIR = "/dev/shm"
MAX_SLOT_BYTES = 256 << 20
"""The largest slot a worker makes: a larger result goes torch's way (a ring of such slots
would hold gigabytes of shared memory between batches)."""
TRANSIT_BATCH_S = 150e-6
"""What a batch costs to cross from a worker process, whatever it holds: the request and the
result through the pipes, the wake-ups, the slot's lease (per-batch wall time of 2 worker
processes over a loader in the main process, on tiny batches of this 2-core VM)."""
TRANSIT_TENSOR_S = 13e-6
"""What each tensor of a batch adds to ``TRANSIT_BATCH_S`` (its place in the slot, its view)."""
_PREFIX = "ll_ring"
_HEADER = 64  # bytes before a slot's data: byte 0 says what the slot is (below)
_FREE, _LEASED, _RETIRED = 0, 1, 2  # its worker may fill it; it carries a result; never again
_ALIGN = 64
_GROWTH = 1.25  # a new slot leaves room for results a little larger than the one that made it
_ring: _Ring | None = None  # this worker process's ring, once its packer is installed
_forks = 0  # forks of this process so far: a lease older than the last one is retired


def _forked() -> None:
    global _forks
    _forks += 1


os.register_at_fork(after_in_parent=_forked)


def ring_files(owner: int | None = None) -> list[str]:
    """Names of the ring slots in ``/dev/shm`` (of main process ``owner``, or of any)."""
    if not os.path.isdir(SHM_DIR):
        return []
    start = f"{_PREFIX}_{owner}_" if owner is not None else f"{_PREFIX}_"
    return sorted(name for name in os.listdir(SHM_DIR) if name.startswith(start))


@dataclass(frozen=True, kw_only=True)
class Packed:
    """A worker's result in transit: ``payload`` is the result pickled with tensor ``k``
    replaced by ``refs[k]``: ``(offset, dtype, shape)`` in the slot, or the tensor itself
    (sent by torch). ``slot`` is ``None`` when every tensor went torch's way."""

    payload: bytes
    refs: list[Any]
    worker_pid: int
    slot: int | None = None
    generation: int = 0
    size: int = 0


class RingPacker:
    """This worker process's ring, once ``install``ed; applied to each result, the result as a
    ``Packed`` in a slot of that ring.

    ``slots`` bounds the slots of each worker: the results it may have in flight at once, and
    the batches the user holds.
    """

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.owner = os.getpid()

    def install(self) -> None:
        """In a worker process: make its ring, where ``ring_collate`` then stacks batches."""
        global _ring
        _ring = _Ring(self.owner, self.slots)

    def __call__(self, result: Any) -> Any:
        assert _ring is not None, "install() the ring in the worker process first"
        return _ring.pack(result)


def ring_collate(samples: list[Any]) -> Any:
    """``default_collate``, stacking each tensor straight into a free slot of this worker
    process's ring (where ``RingPacker`` sends it from without a copy).

    Outside a worker with a ring, or when no slot is free, it is ``default_collate`` itself (in
    a worker process: torch's fresh shared-memory segments). The values are
    ``default_collate``'s either way.
    """
    arena = _ring.arena(_collated_bytes(samples)) if _ring is not None and samples else None
    if arena is None:
        return _default_collate(samples)
    return collate(samples, collate_fn_map={**default_collate_fn_map,
                                            torch.Tensor: arena.stack})


def worker_collate(collate_fn: Callable[[list[Any]], Any] | None, ring: bool
                   ) -> Callable[[list[Any]], Any]:
    """The collate a fetcher runs: the user's, else ``default_collate``'s values, as the main
    process gets them (``ring_collate`` when worker processes send through rings)."""
    if collate_fn is not None and collate_fn is not default_collate:
        return collate_fn
    return ring_collate if ring else _default_collate


def _stacked_dtype(batch: list[torch.Tensor]) -> torch.dtype:
    """The dtype ``torch.stack(batch)`` gives: the tensors' dtypes promoted together."""
    dtype = batch[0].dtype
    for tensor in batch:
        if tensor.dtype != dtype:
            dtype = torch.promote_types(dtype, tensor.dtype)
    return dtype


def _stack(batch: list[torch.Tensor], *,
           collate_fn_map: dict[Any, Any] | None = None) -> torch.Tensor:
    """``default_collate`` of tensors as the main process makes it, in any process. In a worker
    process torch's stacks into a shared tensor of the first one's dtype, which casts the
    others (a float after an int loses its fraction) where the main process promotes; tensors
    of one dtype go torch's way (into shared memory: no copy to send them)."""
    if _stacked_dtype(batch) != batch[0].dtype:
        return torch.stack(batch)
    return collate_tensor_fn(batch, collate_fn_map=collate_fn_map)


_COLLATE_FN_MAP = {**default_collate_fn_map, torch.Tensor: _stack}


def _default_collate(samples: list[Any]) -> Any:
    """``default_collate`` with ``_stack`` for tensors: the same values in every process."""
    return collate(samples, collate_fn_map=_COLLATE_FN_MAP)


def transit_s(result: Any) -> float:
    """Estimated seconds ``result`` takes to cross from a worker process through its ring:
    ``TRANSIT_BATCH_S``, ``TRANSIT_TENSOR_S`` per tensor, and pickling and unpickling what is
    not a tensor (timed here, the faster of two dumps: a process's first dumps fill caches
    that no later batch pays for; unpickling as long as pickling). ``math.inf`` when it does
    not pickle: no process could send it."""
    best = math.inf
    for _ in range(2):
        start = time.perf_counter()
        pickler = _Pickler(io.BytesIO())
        try:
            pickler.dump(result)
        except Exception:
            return math.inf
        best = min(best, time.perf_counter() - start)
    return TRANSIT_BATCH_S + TRANSIT_TENSOR_S * len(pickler.tensors) + 2 * best


def _collated_bytes(samples: list[Any]) -> int:
    """Bytes of slot that ``default_collate(samples)`` fills, judged by the first sample."""
    count = len(samples)

    def leaf(sample: Any) -> int:
        if isinstance(sample, torch.Tensor | np.ndarray):
            return _aligned(int(sample.nbytes) * count)
        if isinstance(sample, str | bytes):
            return 0
        if isinstance(sample, Mapping):
            return sum(leaf(value) for value in sample.values())
        if isinstance(sample, tuple | list):
            return sum(leaf(value) for value in sample)
        if isinstance(sample, int | float | np.generic):  # bool too: one tensor of 8 bytes or less
            return _aligned(8 * count)
        return 0

    return leaf(samples[0])


class RingReader:
    """Main process side: rebuilds ``Packed`` results as views of their slots."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self._maps: dict[tuple[int, int], tuple[int, mmap.mmap]] = {}

    def unpack(self, packed: Packed, pin: bool = False) -> Any:
        """The worker's result, its tensors views of the slot (the slot is free again once
        they are all gone), or copies in pinned memory with ``pin`` (free at once)."""
        refs = packed.refs
        if packed.slot is not None:
            view = self._map(packed)
            lease = np.frombuffer(view, dtype=np.uint8)  # its views hold the slot
            if pin:
                try:
                    refs = [_copy_out(lease, ref) if isinstance(ref, tuple) else ref
                            for ref in refs]
                finally:
                    view[0] = _FREE
            else:
                weakref.finalize(lease, _free, view, self.owner, _forks).atexit = False
                refs = [_view(lease, ref) if isinstance(ref, tuple) else ref for ref in refs]
            del lease
        if pin:
            refs = [ref.pin_memory() if isinstance(ref, torch.Tensor) else ref for ref in refs]
        return _Unpickler(io.BytesIO(packed.payload), refs).load()

    def close(self, worker_pids: list[int | None] | None = None) -> None:
        """Unmap every slot no batch views and unlink what is left of the slots of
        ``worker_pids`` (of every worker of this process when ``None``); call it once those
        workers have stopped."""
        maps, self._maps = self._maps, {}
        for _, view in maps.values():
            _close(view)
        if worker_pids is None:
            names = ring_files(self.owner)
        else:
            starts = tuple(f"{_PREFIX}_{self.owner}_{pid}_" for pid in worker_pids
                           if pid is not None)
            names = [name for name in ring_files(self.owner) if name.startswith(starts)]
        for name in names:
            _unlink(name)

    def _map(self, packed: Packed) -> mmap.mmap:
        assert packed.slot is not None
        key = (packed.worker_pid, packed.slot)
        known = self._maps.get(key)
        if known is not None and known[0] == packed.generation:
            return known[1]
        if known is not None:
            _close(known[1])
        name = _name(self.owner, packed.worker_pid, packed.slot, packed.generation)
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            view = mmap.mmap(fd, packed.size)
        finally:
            os.close(fd)
        _unlink(name)  # both sides have it mapped: the name is no longer needed
        self._maps[key] = (packed.generation, view)
        return view


def _view(lease: np.ndarray, ref: tuple[int, torch.dtype, tuple[int, ...]]) -> torch.Tensor:
    """The tensor at ``ref`` in the slot's bytes ``lease``, sharing them. Its storage is its own
    bytes only, as a tensor from torch's path has (``torch.save`` of it saves no more)."""
    offset, dtype, shape = ref
    return torch.from_numpy(lease[offset:offset + _nbytes(dtype, shape)]).view(dtype).view(shape)


def _free(view: mmap.mmap, owner: int, forks: int) -> None:
    """The last view of a delivered batch is gone: its slot is free for its worker again, or
    retired when this process forked since the batch was delivered (``forks`` then): the
    child may still read it. Not in a process forked from the owner (its copies of the batch
    die there, not the owner's)."""
    if os.getpid() == owner and not view.closed:
        view[0] = _FREE if forks == _forks else _RETIRED


def _close(view: mmap.mmap) -> None:
    """Unmap ``view``, unless batches still view it (the mapping then goes with them)."""
    try:
        view.close()
    except BufferError:
        pass


# -- worker side -----------------------------------------------------------------------------


@dataclass
class _Slot:
    generation: int
    size: int
    view: mmap.mmap
    name: str


@dataclass
class _Arena:
    """The slot a batch is being collated into: tensors are laid out from ``end`` on;
    ``placed`` maps each tensor placed (by ``id``, with the tensor, so that the id stays its
    own) to its offset."""

    index: int
    view: mmap.mmap
    end: int = _HEADER
    placed: dict[int, tuple[int, torch.Tensor]] = field(default_factory=dict)

    def empty(self, dtype: torch.dtype, shape: tuple[int, ...]) -> torch.Tensor | None:
        """A new tensor in the slot (``_tensor_at``), or ``None`` when it has no room left."""
        nbytes = _nbytes(dtype, shape)
        if not nbytes or self.end + nbytes > len(self.view):
            return None
        tensor = _tensor_at(self.view, self.end, dtype, shape)
        self.placed[id(tensor)] = (self.end, tensor)
        self.end += _aligned(nbytes)
        return tensor

    def stack(self, batch: list[torch.Tensor], *,
              collate_fn_map: dict[Any, Any] | None = None) -> torch.Tensor:
        """``default_collate`` of tensors (``torch.stack``), into the slot when it has room."""
        elem = batch[0]
        shape = (len(batch), *elem.shape)
        out = self.empty(_stacked_dtype(batch), shape) if _plain(elem) else None
        if out is None:
            return _stack(batch, collate_fn_map=collate_fn_map)
        return torch.stack(batch, 0, out=out)


@dataclass
class _Ring:
    """One worker's slots."""

    owner: int
    limit: int
    pid: int = field(default_factory=os.getpid)
    slots: list[_Slot | None] = field(default_factory=list)
    generation: int = 0
    pending: _Arena | None = None  # the slot of the result being made, until it is packed

    def __post_init__(self) -> None:
        mp_util.Finalize(self, self._unlink_if_orphaned, exitpriority=100)

    def arena(self, need: int) -> _Arena | None:
        """The slot the result being made is collated into (at least ``need`` bytes of room
        when new), or ``None`` when no slot is free."""
        if self.pending is None:
            index = self._free_slot(_HEADER + need)
            if index is not None:
                slot = self.slots[index]
                assert slot is not None
                self.pending = _Arena(index, slot.view)
        return self.pending

    def pack(self, result: Any) -> Any:
        arena, self.pending = self.pending, None
        buffer = io.BytesIO()
        pickler = _Pickler(buffer)
        try:
            pickler.dump(result)
        except Exception:  # pickled whole, torch's way, it reports its own error
            return result
        if _aliased(pickler.tensors):  # only torch's way keeps them views of one memory
            return result
        placed = arena.placed if arena is not None else {}
        start = end = arena.end if arena is not None else _HEADER
        places: list[int | None] = []  # in the slot (collated there, or copied from ``start``)
        for tensor, in_ring in zip(pickler.tensors, pickler.ring, strict=True):
            known = placed.get(id(tensor))
            if known is not None and known[1] is tensor:
                places.append(known[0])
            elif in_ring:
                places.append(end)
                end += _aligned(tensor.nbytes)
            else:
                places.append(None)  # torch's way
        if all(place is None for place in places):
            return result
        index = arena.index if arena is not None else self._free_slot(end)
        slot = self.slots[index] if index is not None else None
        if slot is None:
            return Packed(payload=buffer.getvalue(), refs=pickler.tensors, worker_pid=self.pid)
        refs: list[Any] = []
        for tensor, place in zip(pickler.tensors, places, strict=True):
            if place is None or place + tensor.nbytes > slot.size:  # no room left: torch's way
                refs.append(tensor)
                continue
            if place >= start and tensor.nbytes:
                _tensor_at(slot.view, place, tensor.dtype, tuple(tensor.shape)).copy_(tensor)
            refs.append((place, tensor.dtype, tuple(tensor.shape)))
        slot.view[0] = _LEASED
        return Packed(payload=buffer.getvalue(), refs=refs, worker_pid=self.pid, slot=index,
                      generation=slot.generation, size=slot.size)

    def _free_slot(self, need: int) -> int | None:
        """A free slot of at least ``need`` bytes: a free one that fits, else a new one (in
        place of the smallest free one when all ``limit`` exist); ``None`` when all are
        busy, ``need`` is over ``MAX_SLOT_BYTES`` or no shared memory is left. Retired slots
        are dropped first: their places are free."""
        for i, slot in enumerate(self.slots):
            if slot is not None and slot.view[0] == _RETIRED:
                self.slots[i] = None
                _unlink(slot.name)
        free = [i for i, slot in enumerate(self.slots) if slot is None or slot.view[0] == _FREE]
        fits = [i for i in free if (slot := self.slots[i]) is not None and slot.size >= need]
        if fits:
            return fits[0]
        if need > MAX_SLOT_BYTES:
            return None
        if len(self.slots) < self.limit:
            self.slots.append(None)
            free.append(len(self.slots) - 1)
        if not free:
            return None
        index = min(free, key=lambda i: (s := self.slots[i]) is not None and s.size or 0)
        old = self.slots[index]
        if old is not None:  # unmapped as the last tensor viewing it dies
            self.slots[index] = None
            _unlink(old.name)
        self.slots[index] = self._create(index, min(int(need * _GROWTH), MAX_SLOT_BYTES))
        return index if self.slots[index] is not None else None

    def _create(self, index: int, size: int) -> _Slot | None:
        self.generation += 1
        name = _name(self.owner, self.pid, index, self.generation)
        path = os.path.join(SHM_DIR, name)
        try:
            fd = os.open(path, os.O_RDWR | os.O_CREAT | os.O_EXCL, 0o600)
        except OSError:
            return None
        try:
            os.posix_fallocate(fd, 0, size)  # no memory left: an error now, not a SIGBUS later
            view = mmap.mmap(fd, size)
        except OSError:
            _unlink(name)
            return None
        finally:
            os.close(fd)
        return _Slot(self.generation, size, view, name)

    def unlink_all(self) -> None:
        """Unlink this worker's slot names (those the main process has not yet)."""
        for slot in self.slots:
            if slot is not None:
                _unlink(slot.name)

    def _unlink_if_orphaned(self) -> None:
        """At the worker's exit, unlink its slots if the main process is gone. While it runs,
        it may still have to map a slot sent before the exit (a worker leaving through
        ``SystemExit`` from a dataset), and unlinks what is left itself when it closes."""
        if not _alive(self.owner):
            self.unlink_all()


def _alive(pid: int) -> bool:
    """Whether process ``pid`` runs: a killed main process stays a zombie until its parent
    reaps it (which may wait for its workers' pipes to close), and is gone for us."""
    try:
        os.kill(pid, 0)
    except OSError:  # no such process, or its pid is another user's now
        return False
    try:
        with open(f"/proc/{pid}/stat", "rb") as stat:
            return stat.read().rpartition(b")")[2].split()[0] != b"Z"
    except OSError:  # no /proc here
        return True


class _Pickler(ForkingPickler):
    """Pickles a result with every tensor replaced by its index in ``tensors``; ``ring[k]``
    says whether tensor ``k`` can be copied into the ring (torch sends the others)."""

    def __init__(self, file: io.BytesIO) -> None:
        super().__init__(file, pickle.HIGHEST_PROTOCOL)
        self.tensors: list[Any] = []
        self.ring: list[bool] = []
        self._seen: dict[int, int] = {}

    def persistent_id(self, obj: Any) -> int | None:
        if isinstance(obj, torch.Tensor | torch.UntypedStorage | torch.TypedStorage):
            index = self._seen.get(id(obj))
            if index is None:  # a tensor met twice is sent once, and is one tensor again
                index = self._seen[id(obj)] = len(self.tensors)
                self.tensors.append(obj)
                self.ring.append(_plain(obj) and obj.is_contiguous())  # type: ignore[union-attr]
            return index
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, refs: list[Any]) -> None:
        super().__init__(file)
        self.refs = refs

    def persistent_load(self, pid: Any) -> Any:
        return self.refs[pid]


def _aliased(tensors: list[Any]) -> bool:
    """Whether two of a result's dense CPU tensors (or untyped storages) share memory, as a
    buffer and views of it do: the ring copies each tensor on its own, which would part them
    (it takes no other kind)."""
    seen: set[int] = set()
    for obj in tensors:
        if isinstance(obj, torch.Tensor) and obj.layout == torch.strided:
            storage = obj.untyped_storage()
        elif isinstance(obj, torch.UntypedStorage):
            storage = obj
        else:
            continue
        if storage.device.type == "cpu" and storage.nbytes():
            address = storage.data_ptr()
            if address in seen:
                return True
            seen.add(address)
    return False


def _plain(obj: Any) -> bool:
    """Whether the ring can hold ``obj`` exactly: a plain, dense CPU tensor."""
    return (type(obj) is torch.Tensor and obj.device.type == "cpu"
            and obj.layout == torch.strided and not obj.requires_grad and not obj.is_quantized
            and not obj.is_nested and not obj.is_conj() and not obj.is_neg())


def _copy_out(lease: np.ndarray, ref: tuple[int, torch.dtype, tuple[int, ...]]
              ) -> torch.Tensor:
    """A new pinned tensor holding the bytes at ``ref`` (a plain memcpy: ``Tensor.copy_`` would
    split it over the intra-op threads, which costs far more on cores busy with workers)."""
    offset, dtype, shape = ref
    out = torch.empty(shape, dtype=dtype, pin_memory=True)
    nbytes = out.nbytes
    if nbytes:
        np.copyto(out.reshape(-1).view(torch.uint8).numpy(), lease[offset:offset + nbytes])
    return out


def _tensor_at(view: mmap.mmap, offset: int, dtype: torch.dtype, shape: tuple[int, ...]
               ) -> torch.Tensor:
    """A tensor over the ``nbytes`` at ``offset`` in a worker's slot, with a storage of those
    bytes only: were it ever shared torch's way, torch would move that storage alone to a new
    segment, not the slot."""
    return torch.frombuffer(view, dtype=torch.uint8, count=_nbytes(dtype, shape),
                            offset=offset).view(dtype).view(shape)


def _nbytes(dtype: torch.dtype, shape: tuple[int, ...]) -> int:
    return math.prod(shape) * dtype.itemsize


def _aligned(nbytes: int) -> int:
    return -(-nbytes // _ALIGN) * _ALIGN


def _name(owner: int, worker_pid: int, slot: int, generation: int) -> str:
    return f"{_PREFIX}_{owner}_{worker_pid}_{slot}_{generation}"


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass
