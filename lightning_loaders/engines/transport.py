"""Worker to main process transport through reusable shared-memory rings.

torch moves every tensor of a batch from a worker in a fresh shared-memory segment: allocated
and mapped in the worker, its file descriptor passed over a socket, mapped again in the main
process (first-touch page faults on both sides), unmapped when the batch dies. ``RingPacker``
(what each worker process applies to its results) instead copies the tensors of a result into
a free slot of that worker's ring of reusable ``/dev/shm`` slots and returns a small ``Packed``
descriptor (the result pickled with each tensor replaced by its place in the slot).
``RingReader`` (main process) copies the tensors out into fresh memory the user owns (pinned
when ``pin_memory`` is on, saving a separate pinning copy) and frees the slot at once: a
delivered batch never aliases ring memory, and may be kept as long as one likes.

A slot is sized by the first result it carries and replaced by a larger one when a result does
not fit; a worker keeps at most ``slots`` of them. A result with no CPU contiguous tensor, one
that meets no free slot, or one that does not pickle goes through torch's path unchanged, as do
the tensors the ring does not take: those over ``MAX_TENSOR_BYTES`` (there torch's fixed cost
per tensor is small next to the ring's extra copies), views with gaps, tensors needing grad,
other devices...

Lifetime: slots are named ``ll_ring_<main pid>_<worker pid>_<slot>_<generation>``. The main
process unlinks a slot's name as soon as it has mapped it (mappings keep the memory until both
sides close them); ``RingReader.close`` unlinks what is left of its workers' slots (one killed
before its slot was read, results never received); a worker unlinks its own at exit (when the
main process was killed). Only the death of the main process and a worker together can leave
a named slot behind.
"""

from __future__ import annotations

import io
import mmap
import os
import pickle
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from multiprocessing import util as mp_util
from multiprocessing.reduction import ForkingPickler
from typing import Any

import numpy as np
import torch
from torch.utils.data import default_collate, get_worker_info
from torch.utils.data._utils import worker as torch_worker

__all__ = ["MAX_TENSOR_BYTES", "SHM_DIR", "Packed", "RingPacker", "RingReader", "ring_collate",
           "ring_files", "worker_collate"]

SHM_DIR = "/dev/shm"
MAX_TENSOR_BYTES = 1 << 20
"""Larger tensors go torch's way: torch's fixed cost per tensor (a file descriptor passed over
a socket, a mapping) outweighs the ring's two copies up to about 1 MB; from 2 MB on the copies
cost more CPU in all (``benchmarks/bench_transport.py``)."""
_PREFIX = "ll_ring"
_HEADER = 64  # bytes before a slot's data: byte 0 is 1 while the slot carries a result
_ALIGN = 64
_GROWTH = 1.25  # a new slot leaves room for results a little larger than the one that made it


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
    """Applied to each result by a worker process: the result as a ``Packed`` in a
    slot of the worker's ring; in the main process, the result unchanged.

    ``slots`` bounds the slots of each worker (the results it may have in flight at once).
    """

    def __init__(self, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"slots must be >= 1, got {slots}")
        self.slots = slots
        self.owner = os.getpid()
        self._ring: _Ring | None = None

    def __getstate__(self) -> dict[str, Any]:
        return {"slots": self.slots, "owner": self.owner, "_ring": None}

    def __call__(self, result: Any) -> Any:
        if get_worker_info() is None:
            return result
        if self._ring is None:
            self._ring = _Ring(self.owner, self.slots)
        return self._ring.pack(result)


def ring_collate(samples: list[Any]) -> Any:
    """``default_collate`` in a worker whose results go through its ring.

    In a worker process, ``default_collate`` stacks each tensor into a fresh shared-memory
    segment, made, mapped, faulted in and unmapped per batch. When the ring takes every tensor
    of the batch (none over ``MAX_TENSOR_BYTES``), it copies them into its slot anyway: they are
    stacked into private memory instead. Larger batches keep torch's segments, which torch
    then sends without a copy. The values are ``default_collate``'s either way.
    """
    if (get_worker_info() is None or not samples
            or _largest_leaf(samples[0]) * len(samples) > MAX_TENSOR_BYTES):
        return default_collate(samples)
    saved = torch_worker._worker_info
    torch_worker._worker_info = None  # default_collate's test for "in a worker process"
    try:
        return default_collate(samples)
    finally:
        torch_worker._worker_info = saved


def worker_collate(collate_fn: Callable[[list[Any]], Any] | None, ring: bool
                   ) -> Callable[[list[Any]], Any]:
    """The collate a fetcher runs: the user's, else ``default_collate`` (``ring_collate``
    when worker processes send through rings)."""
    if collate_fn is not None and collate_fn is not default_collate:
        return collate_fn
    return ring_collate if ring else default_collate


def _largest_leaf(sample: Any) -> int:
    """Bytes of the largest tensor or array in ``sample`` (8 for a number)."""
    if isinstance(sample, torch.Tensor | np.ndarray):
        return int(sample.nbytes)
    if isinstance(sample, Mapping):
        return max((_largest_leaf(value) for value in sample.values()), default=0)
    if isinstance(sample, tuple | list):
        return max((_largest_leaf(value) for value in sample), default=0)
    return 8


class RingReader:
    """Main process side: rebuilds ``Packed`` results and frees their slots."""

    def __init__(self) -> None:
        self.owner = os.getpid()
        self._maps: dict[tuple[int, int], tuple[int, mmap.mmap]] = {}

    def unpack(self, packed: Packed, pin: bool = False) -> Any:
        """The worker's result, its tensors copied out of the slot (into pinned memory with
        ``pin``); the slot is free again when this returns."""
        refs = packed.refs
        if packed.slot is not None:
            view = self._map(packed)
            try:
                buffer = np.frombuffer(view, dtype=np.uint8)
                refs = [_copy_out(buffer, ref, pin) if isinstance(ref, tuple) else ref
                        for ref in refs]
                del buffer
            finally:
                view[0] = 0  # the slot is free
        if pin:
            refs = [ref.pin_memory() if isinstance(ref, torch.Tensor) else ref for ref in refs]
        return _Unpickler(io.BytesIO(packed.payload), refs).load()

    def close(self, worker_pids: list[int | None] | None = None) -> None:
        """Unmap every slot and unlink what is left of the slots of ``worker_pids`` (of every
        worker of this process when ``None``); call it once those workers have stopped."""
        maps, self._maps = self._maps, {}
        for _, view in maps.values():
            view.close()
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
            known[1].close()
        name = _name(self.owner, packed.worker_pid, packed.slot, packed.generation)
        fd = os.open(os.path.join(SHM_DIR, name), os.O_RDWR)
        try:
            view = mmap.mmap(fd, packed.size)
        finally:
            os.close(fd)
        _unlink(name)  # both sides have it mapped: the name is no longer needed
        self._maps[key] = (packed.generation, view)
        return view


# -- worker side -----------------------------------------------------------------------------


@dataclass
class _Slot:
    generation: int
    size: int
    view: mmap.mmap
    name: str


@dataclass
class _Ring:
    """One worker's slots."""

    owner: int
    limit: int
    pid: int = field(default_factory=os.getpid)
    slots: list[_Slot | None] = field(default_factory=list)
    generation: int = 0

    def __post_init__(self) -> None:
        mp_util.Finalize(self, self.unlink_all, exitpriority=100)

    def pack(self, result: Any) -> Any:
        buffer = io.BytesIO()
        pickler = _Pickler(buffer)
        try:
            pickler.dump(result)
        except Exception:  # pickled whole, torch's way, it reports its own error
            return result
        tensors = pickler.tensors
        if not any(pickler.ring):
            return result
        offsets, end = [], _HEADER
        for tensor, in_ring in zip(tensors, pickler.ring, strict=True):
            offsets.append(end if in_ring else -1)
            if in_ring:
                end += -(-tensor.nbytes // _ALIGN) * _ALIGN
        index = self._free_slot(end)
        if index is None:
            return Packed(payload=buffer.getvalue(), refs=tensors, worker_pid=self.pid)
        slot = self.slots[index]
        assert slot is not None
        target = torch.frombuffer(slot.view, dtype=torch.uint8)
        refs: list[Any] = []
        for tensor, offset in zip(tensors, offsets, strict=True):
            if offset < 0:
                refs.append(tensor)
                continue
            nbytes = tensor.nbytes
            if nbytes:
                target[offset:offset + nbytes].view(tensor.dtype).view(tensor.shape).copy_(
                    tensor)
            refs.append((offset, tensor.dtype, tuple(tensor.shape)))
        del target
        slot.view[0] = 1
        return Packed(payload=buffer.getvalue(), refs=refs, worker_pid=self.pid, slot=index,
                      generation=slot.generation, size=slot.size)

    def _free_slot(self, need: int) -> int | None:
        """A free slot of at least ``need`` bytes: a free one that fits, else a new one (in
        place of the smallest free one when all ``limit`` exist); ``None`` when all are
        busy or no shared memory is left."""
        free = [i for i, slot in enumerate(self.slots) if slot is None or slot.view[0] == 0]
        fits = [i for i in free if (slot := self.slots[i]) is not None and slot.size >= need]
        if fits:
            return fits[0]
        if len(self.slots) < self.limit:
            self.slots.append(None)
            free.append(len(self.slots) - 1)
        if not free:
            return None
        index = min(free, key=lambda i: (s := self.slots[i]) is not None and s.size or 0)
        old = self.slots[index]
        if old is not None:
            self.slots[index] = None
            old.view.close()
            _unlink(old.name)
        self.slots[index] = self._create(index, int(need * _GROWTH))
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


class _Pickler(ForkingPickler):
    """Pickles a result with every tensor replaced by its index in ``tensors``; ``ring[k]``
    says whether tensor ``k`` can go through the ring (torch sends the others)."""

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
                self.ring.append(_ring_ready(obj))
            return index
        return None


class _Unpickler(pickle.Unpickler):
    def __init__(self, file: io.BytesIO, refs: list[Any]) -> None:
        super().__init__(file)
        self.refs = refs

    def persistent_load(self, pid: Any) -> Any:
        return self.refs[pid]


def _ring_ready(obj: Any) -> bool:
    """Whether the ring can carry ``obj`` exactly, and cheaper than torch: a plain, dense CPU
    tensor of at most ``MAX_TENSOR_BYTES``."""
    return (type(obj) is torch.Tensor and obj.nbytes <= MAX_TENSOR_BYTES
            and obj.device.type == "cpu"
            and obj.layout == torch.strided and not obj.requires_grad and not obj.is_quantized
            and not obj.is_nested and not obj.is_conj() and not obj.is_neg()
            and obj.is_contiguous())


def _copy_out(buffer: np.ndarray, ref: tuple[int, torch.dtype, tuple[int, ...]],
              pin: bool) -> torch.Tensor:
    """A new tensor holding the bytes at ``ref`` (a plain memcpy: ``Tensor.copy_`` would split
    it over the intra-op threads, which costs far more on cores busy with workers)."""
    offset, dtype, shape = ref
    out = torch.empty(shape, dtype=dtype, pin_memory=pin)
    nbytes = out.nbytes
    if nbytes:
        np.copyto(_bytes_of(out), buffer[offset:offset + nbytes])
    return out


def _bytes_of(tensor: torch.Tensor) -> np.ndarray:
    """A contiguous tensor's memory as a numpy byte array (any dtype)."""
    return tensor.reshape(-1).view(torch.uint8).numpy()


def _name(owner: int, worker_pid: int, slot: int, generation: int) -> str:
    return f"{_PREFIX}_{owner}_{worker_pid}_{slot}_{generation}"


def _unlink(name: str) -> None:
    try:
        os.unlink(os.path.join(SHM_DIR, name))
    except FileNotFoundError:
        pass
