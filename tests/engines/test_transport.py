"""Shared-memory rings between workers and the main process: the stream, state and resume are
those of torch's transport; batches are collated into the slots and delivered as views of them,
never overwritten while the user holds them; and no slot outlives its loader and its batches
(close, a killed worker, Ctrl-C in the loop, a killed main process)."""

from __future__ import annotations

import gc
import math
import multiprocessing
import os
import signal
import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from typing import Any, NamedTuple

import numpy as np
import pytest
import torch
from torch.utils.data import Dataset, IterableDataset, default_collate

from lightning_loaders import ResumableLoader
from lightning_loaders.engines import transport
from lightning_loaders.engines.transport import (
    TRANSIT_BATCH_S,
    TRANSIT_TENSOR_S,
    RingPacker,
    RingReader,
    ring_collate,
    ring_files,
    transit_s,
)
from lightning_loaders.engines.workers import HELD
from lightning_loaders.testing import check_resume_at_every_step, run_epochs
from tests.conftest import loader_processes
from tests.ddp_harness import REPO
from tests.lightning_harness import RecordingModule, fit_recording


class Pair(NamedTuple):
    left: torch.Tensor
    right: Any


def _sample(i: int) -> dict[str, Any]:
    """Every kind of leaf: tensors of several dtypes and sizes (one of variable length, so
    slots grow), a 0-dim tensor, an empty one, numpy, strings, numbers, a namedtuple."""
    return {
        "index": i,
        "name": f"sample-{i}",
        "pixels": torch.full((3, 4, 4), i % 251, dtype=torch.uint8),
        "ragged": torch.arange(i * 7, dtype=torch.float64),
        "flags": torch.tensor([i % 2 == 0, i % 3 == 0]),
        "half": torch.tensor([i / 7], dtype=torch.bfloat16),
        "complex": torch.tensor([complex(i, -i)]),
        "scalar": torch.tensor(float(i)),
        "empty": torch.zeros(0, 5),
        "numpy": np.full(3, i, dtype=np.int32),
        "pair": Pair(torch.full((2,), i, dtype=torch.int64), (i, [torch.tensor(i)])),
    }


def _collate(samples: list[dict[str, Any]]) -> dict[str, Any]:
    """Stacks what stacks; the ragged tensors are padded to the longest (batches grow); a
    tensor of over 1 MB (copied into the slot) and a strided view (not contiguous: torch's
    path) ride along."""
    longest = max(len(s["ragged"]) for s in samples)
    ragged = torch.zeros(len(samples), longest, dtype=torch.float64)
    for row, s in enumerate(samples):
        ragged[row, :len(s["ragged"])] = s["ragged"]
    first = samples[0]["index"]
    return {
        "index": torch.tensor([s["index"] for s in samples]),
        "names": [s["name"] for s in samples],
        "pixels": torch.stack([s["pixels"] for s in samples]),
        "ragged": ragged,
        "flags": torch.stack([s["flags"] for s in samples]),
        "half": torch.cat([s["half"] for s in samples]),
        "complex": torch.cat([s["complex"] for s in samples]),
        "scalar": samples[-1]["scalar"],
        "empty": samples[0]["empty"],
        "numpy": np.stack([s["numpy"] for s in samples]),
        "pairs": [s["pair"] for s in samples],
        "big": torch.full(((1 << 20) // 8 + 1,), first, dtype=torch.int64),
        "strided": torch.arange(20).reshape(4, 5)[:, ::2] + first,
    }


class Samples(Dataset[dict[str, Any]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, Any]:
        return _sample(index)


class StreamOfSamples(IterableDataset[dict[str, Any]]):
    def __init__(self, n: int) -> None:
        self.n = n

    def __iter__(self) -> Iterator[dict[str, Any]]:
        return (_sample(i) for i in range(self.n))


def _exact(value: Any) -> Any:
    """Every byte, dtype and shape of a batch, comparable with ``==``."""
    if isinstance(value, torch.Tensor):
        plain = value.contiguous().reshape(-1)
        return ("tensor", str(value.dtype), tuple(value.shape),
                plain.view(torch.uint8).numpy().tobytes() if plain.numel() else b"")
    if isinstance(value, np.ndarray):
        return ("array", str(value.dtype), value.shape, value.tobytes())
    if isinstance(value, dict):
        return {key: _exact(item) for key, item in value.items()}
    if isinstance(value, tuple | list):
        return (type(value).__name__, [_exact(item) for item in value])
    return value


def _loader(dataset: Any, ring: bool, **kwargs: Any) -> Any:
    loader = ResumableLoader(dataset, batch_size=3, num_workers=2, collate_fn=_collate,
                             seed=5, **kwargs)
    loader.shared_ring = ring
    return loader


def _ring_mappings() -> list[str]:
    """This process's memory mappings of ring slots (their names are unlinked once mapped)."""
    with open("/proc/self/maps") as maps:
        return [line for line in maps if "/ll_ring_" in line]


def _assert_no_ring_left() -> None:
    assert ring_files(os.getpid()) == []
    assert _ring_mappings() == []


needs_shm = pytest.mark.skipif(not os.path.isdir("/dev/shm"), reason="no /dev/shm")


@needs_shm
@pytest.mark.parametrize("kind", ["map-style", "iterable"])
def test_the_ring_delivers_the_same_bytes_and_resumes_at_every_step(kind: str) -> None:
    def make(ring: bool) -> Any:
        data = Samples(16) if kind == "map-style" else StreamOfSamples(16)
        return _loader(data, ring, shuffle=kind == "map-style")

    with_ring = check_resume_at_every_step(lambda: make(True), epochs=2, key=_exact)
    without = run_epochs(make(False), range(2), key=_exact)
    assert with_ring == without
    assert sum(map(len, with_ring)) == 12
    assert loader_processes() == []
    _assert_no_ring_left()


def _in_ring(tensor: torch.Tensor) -> bool:
    """Whether ``tensor``'s memory lies in a ring slot this process has mapped."""
    address = tensor.untyped_storage().data_ptr()
    for line in _ring_mappings():
        start, end = (int(part, 16) for part in line.split()[0].split("-"))
        if start <= address < end:
            return True
    return False


class Images(Dataset[dict[str, Any]]):
    """1.5 MB batches of 32 (3 x 128 x 128 uint8 images, as a decoding pipeline makes)."""

    def __len__(self) -> int:
        return 32 * 12

    def __getitem__(self, index: int) -> dict[str, Any]:
        return {"image": torch.full((3, 128, 128), index % 251, dtype=torch.uint8),
                "label": index, "path": f"{index}.jpg"}


@needs_shm
def test_default_collate_stacks_into_the_slots_and_batches_are_delivered_as_their_views(
        ) -> None:
    loader = ResumableLoader(Images(), batch_size=32, num_workers=2, seed=3, prefetch_factor=2)
    expected = run_epochs(ResumableLoader(Images(), batch_size=32, seed=3), range(2),
                          key=_exact)
    got = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        got.append([])
        for batch in loader:
            assert _in_ring(batch["image"]) and _in_ring(batch["label"])
            assert batch["label"].untyped_storage().nbytes() == 32 * 8, "its own bytes only"
            got[-1].append(_exact(batch))
            del batch  # its slots go back to the workers
    assert got == expected
    slots = 2 * (2 + HELD)
    assert 0 < len(_ring_mappings()) <= slots, "slots are reused"
    loader.close()
    _assert_no_ring_left()


@needs_shm
def test_in_a_trainer_fit_every_batch_comes_through_the_ring(tmp_path) -> None:
    """The slots a worker keeps beyond its in-flight batches (``HELD``) cover the batch in the
    training step and the one Lightning fetches ahead: none falls back to torch's way."""
    seen = fit_recording(
        lambda: ResumableLoader(Images(), batch_size=32, num_workers=2, prefetch_factor=1),
        tmp_path, max_epochs=2, model=RecordingModule(key=lambda b: _in_ring(b["image"])))
    assert len(seen) == 2 * 12
    assert all(in_ring for _, _, in_ring in seen)


@needs_shm
def test_kept_batches_are_never_overwritten_and_are_the_users_memory() -> None:
    loader = _loader(Samples(60), True)
    kept = list(loader)  # 20 batches kept: the slots they view stay theirs
    assert any(_in_ring(batch["pixels"]) for batch in kept), "the batches came through the rings"
    assert ring_files(os.getpid()) == [], "a mapped slot's name is unlinked"
    expected = run_epochs(_loader(Samples(60), False), range(1), key=_exact)[0]
    assert [_exact(batch) for batch in kept] == expected
    kept[0]["pixels"].add_(1)  # writable, and nobody else's
    assert [_exact(batch) for batch in kept[1:]] == expected[1:]
    loader.close()
    assert [_exact(batch) for batch in kept[1:]] == expected[1:], "and outlive the loader"
    del kept
    gc.collect()
    _assert_no_ring_left()


@needs_shm
def test_a_forked_child_dropping_its_copy_of_a_batch_does_not_free_the_slot() -> None:
    """A process forked while the user holds a batch (a restarted worker, a second loader's
    workers) inherits its views; their death there must not hand the slot back."""
    loader = ResumableLoader(Images(), batch_size=32, num_workers=2, prefetch_factor=1)
    iterator = iter(loader)
    held = next(iterator)
    snapshot = held["image"].clone()
    pid = os.fork()
    if pid == 0:  # the child drops the views it inherited
        held.clear()
        gc.collect()
        os._exit(0)
    os.waitpid(pid, 0)
    for _ in iterator:  # every slot the workers have is used again and again
        pass
    assert _in_ring(held["image"])
    assert torch.equal(held["image"], snapshot)
    loader.close()


@needs_shm
def test_a_forked_child_keeps_its_copy_of_a_batch_the_parent_dropped() -> None:
    """A process forked while the user holds a batch (``multiprocessing`` with fork, given the
    batch to save or log) shares the slot: when the parent drops its copy, the slot is
    retired, never filled again, and the child reads the batch it was given however long it
    runs. It was handed back to its worker and overwritten by the next batches."""
    loader = ResumableLoader(Images(), batch_size=32, num_workers=1, prefetch_factor=1)
    iterator = iter(loader)
    held = next(iterator)
    assert _in_ring(held["image"])
    expected = held["image"].numpy().copy()
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child waits until the parent has read every other batch; numpy, as
        os.close(write)  # torch's intra-op threads may not run in a forked child
        os.read(read, 1)
        os._exit(0 if np.array_equal(held["image"].numpy(), expected) else 1)
    os.close(read)
    del held
    gc.collect()
    batches = [int(batch["image"][0, 0, 0, 0]) for batch in iterator]  # slots used again
    assert batches == [32 * k % 251 for k in range(1, 12)]
    os.write(write, b"x")
    os.close(write)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0, "the child's batch was overwritten"
    loader.close()
    _assert_no_ring_left()


def _packed_with_views(samples: list[torch.Tensor]) -> dict[str, torch.Tensor]:
    """A collate that packs the samples into one flat buffer and hands out views of it (as
    sequence packing does), and the buffer's first row by another name."""
    flat = torch.cat(samples)
    return {"flat": flat, "rows": flat.view(len(samples), -1), "first": flat[:4]}


class Rows(Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.arange(4.0) + 10 * index


@needs_shm
def test_tensors_that_share_memory_arrive_sharing_it() -> None:
    """A result whose tensors are a buffer and views of it goes torch's way, which keeps them
    views of one memory (as ``DataLoader`` does): an in-place op through one shows in the
    others. The ring copied each on its own, so they parted."""
    loader = ResumableLoader(Rows(), batch_size=3, num_workers=2, collate_fn=_packed_with_views)
    batches = list(loader)
    assert len(batches) == 8
    for k, batch in enumerate(batches):
        assert torch.equal(batch["rows"], torch.stack([Rows()[i] for i in range(3 * k, 3 * k + 3)]))
        batch["rows"].sub_(1)
        assert torch.equal(batch["flat"], batch["rows"].reshape(-1))
        assert torch.equal(batch["first"], batch["rows"][0])
    loader.close()


@needs_shm
def test_a_killed_worker_is_recovered_exactly_and_leaves_no_slot() -> None:
    expected = run_epochs(_loader(Samples(30), False, shuffle=True), range(2), key=_exact)
    loader = _loader(Samples(30), True, shuffle=True)
    got: list[list[Any]] = []
    for epoch in range(2):
        loader.sampler.set_epoch(epoch)
        got.append([])
        for batch in loader:
            got[-1].append(_exact(batch))
            if epoch == 0 and len(got[-1]) == 3:
                os.kill(loader_processes()[0].pid, signal.SIGKILL)
    assert got == expected
    assert loader.worker_restarts == 1
    loader.close()
    del batch  # the last batch delivered views its slot until it dies
    _assert_no_ring_left()


def _packs_then_exits(packer: RingPacker) -> None:
    """A worker process: sends one batch in a slot of its ring, then leaves through
    ``SystemExit`` (as a dataset calling ``sys.exit`` makes it)."""
    packer.install()
    packer(_collate([_sample(i) for i in range(3)]))
    sys.exit(3)


@needs_shm
def test_a_worker_leaving_through_sys_exit_keeps_the_slots_it_sent() -> None:
    """Its exit ran the ring's clean-up, which unlinked the slot of a batch it had sent and
    the main process had not mapped yet (a raw ``FileNotFoundError`` then, not the crash's
    recovery): while the main process lives, the slots are its to unlink."""
    worker = multiprocessing.get_context("spawn").Process(target=_packs_then_exits,
                                                         args=(RingPacker(slots=2),))
    worker.start()
    worker.join(60)
    assert worker.exitcode == 3
    sent = [name for name in ring_files(os.getpid())
            if name.startswith(f"ll_ring_{os.getpid()}_{worker.pid}_")]
    for name in sent:
        os.unlink(os.path.join(transport.SHM_DIR, name))
    assert len(sent) == 1


@needs_shm
def test_ctrl_c_in_the_loop_leaves_no_worker_and_no_slot() -> None:
    loader = _loader(Samples(60), True)
    with pytest.raises(KeyboardInterrupt):
        for step, batch in enumerate(loader):
            if step == 2:
                del batch
                raise KeyboardInterrupt
    loader.close()
    assert loader_processes() == []
    _assert_no_ring_left()


_KILLS_ITSELF = textwrap.dedent("""
    import os, signal, time
    import psutil
    from lightning_loaders import ResumableLoader
    from tests.engines.test_transport import Samples, _collate

    loader = ResumableLoader(Samples(90), batch_size=3, num_workers=2, collate_fn=_collate,
                             prefetch_factor=4)
    iterator = iter(loader)
    next(iterator)
    deadline = time.monotonic() + 10  # a prefetched batch's slot, named and not yet mapped
    while time.monotonic() < deadline and not any(
            name.startswith(f"ll_ring_{os.getpid()}_") for name in os.listdir("/dev/shm")):
        time.sleep(0.01)
    workers = [child.pid for child in psutil.Process().children()]
    print(" ".join(str(p) for p in [os.getpid(), *workers]), flush=True)
    os.kill(os.getpid(), signal.SIGKILL)
""")


@needs_shm
def test_workers_unlink_their_slots_when_the_main_process_is_killed() -> None:
    done = subprocess.run([sys.executable, "-c", _KILLS_ITSELF], cwd=REPO, capture_output=True,
                          text=True, timeout=120)
    assert done.returncode == -signal.SIGKILL, done.stderr[-3000:]
    main, *workers = map(int, done.stdout.split())
    deadline = time.monotonic() + 30  # orphaned workers notice within seconds
    while time.monotonic() < deadline and any(_alive(pid) for pid in workers):
        time.sleep(0.2)
    assert not any(_alive(pid) for pid in workers)
    assert ring_files(main) == []


_EXITS_MID_EPOCH = textwrap.dedent("""
    import os
    import psutil
    from lightning_loaders import ResumableLoader
    from tests.engines.test_transport import Samples, _collate

    loader = ResumableLoader(Samples(90), batch_size=3, num_workers=2, collate_fn=_collate)
    iterator = iter(loader)
    next(iterator)
    workers = [child.pid for child in psutil.Process().children()]
    print(" ".join(str(p) for p in [os.getpid(), *workers]), flush=True)
""")


@needs_shm
def test_an_interpreter_that_exits_mid_epoch_stops_its_workers_cleanly() -> None:
    done = subprocess.run([sys.executable, "-c", _EXITS_MID_EPOCH], cwd=REPO,
                          capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr[-3000:]
    assert "Exception ignored" not in done.stderr, done.stderr[-3000:]
    main, *workers = map(int, done.stdout.split())
    assert len(workers) == 2
    assert not any(_alive(pid) for pid in workers)
    assert ring_files(main) == []


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    return True


@needs_shm
@pytest.mark.skipif(not torch.cuda.is_available(), reason="pinned memory needs a GPU")
def test_with_pin_memory_batches_are_copied_out_of_the_ring_into_pinned_memory() -> None:
    pinned = _loader(Samples(12), True, pin_memory=True)
    batches = list(pinned)
    tensors = [value for batch in batches for value in batch.values()
               if isinstance(value, torch.Tensor) and value.numel()]
    assert tensors and all(tensor.is_pinned() for tensor in tensors)
    expected = run_epochs(_loader(Samples(12), False), range(1), key=_exact)[0]
    assert [_exact(batch) for batch in batches] == expected
    pinned.close()
    _assert_no_ring_left()


# -- collating for the ring ----------------------------------------------------------------


@pytest.fixture
def a_worker_ring() -> Iterator[RingPacker]:
    """This process seen as a worker process with its ring installed."""
    packer = RingPacker(slots=2)
    packer.install()
    yield packer
    assert transport._ring is not None
    transport._ring.unlink_all()
    transport._ring = None


@needs_shm
def test_ring_collate_stacks_into_a_slot_that_is_sent_without_a_copy(a_worker_ring) -> None:
    """Every tensor or array ``default_collate`` stacks lies in the worker's slot; the packer
    copies the numbers' tensors there too and sends places only; the main process's views hold
    ``default_collate``'s values."""
    samples = [{"x": np.full((3, 128, 128), i, dtype=np.uint8), "n": i, "f": i / 2,
                "s": f"{i}", "t": (torch.arange(5) + i, i % 2 == 0)} for i in range(32)]
    expected = default_collate(samples)
    got = ring_collate(samples)
    slot = torch.frombuffer(transport._ring.slots[0].view,  # type: ignore[union-attr]
                            dtype=torch.uint8)
    start, end = slot.data_ptr(), slot.data_ptr() + slot.nbytes
    assert all(start <= t.data_ptr() < end and not t.is_shared() for t in (got["x"], got["t"][0]))
    packed = a_worker_ring(got)
    assert all(isinstance(ref, tuple) for ref in packed.refs), "all in the slot"
    delivered = RingReader().unpack(packed)
    assert _exact(delivered) == _exact(expected)


@needs_shm
def test_with_every_slot_held_batches_go_torchs_way_until_one_is_dropped(a_worker_ring) -> None:
    samples = [torch.arange(8) + i for i in range(4)]
    reader = RingReader()
    held = [reader.unpack(a_worker_ring(ring_collate(samples))) for _ in range(2)]
    assert all(_in_ring(batch) for batch in held)
    packed = a_worker_ring(ring_collate(samples))
    assert packed.slot is None, "both slots are held: torch's way"
    assert torch.equal(reader.unpack(packed), default_collate(samples))
    del held[0]
    packed = a_worker_ring(ring_collate(samples))
    assert packed.slot is not None, "a dropped batch's slot is free again"
    assert torch.equal(reader.unpack(packed), default_collate(samples))
    del held
    reader.close()


def test_ring_collate_outside_a_worker_is_default_collate() -> None:
    samples = [torch.arange(8) + i for i in range(4)]
    assert torch.equal(ring_collate(samples), default_collate(samples))
    assert not ring_collate(samples).is_shared()


def test_a_batchs_crossing_is_estimated_from_its_tensors_and_what_else_it_pickles() -> None:
    """``backend="auto"`` weighs this against the fetch time: a fixed cost per batch and per
    tensor, whatever their size, plus the pickling of everything else (timed)."""
    images = {"image": torch.zeros(32, 3, 128, 128, dtype=torch.uint8), "label": torch.ones(32)}
    assert transit_s(images) >= TRANSIT_BATCH_S + 2 * TRANSIT_TENSOR_S
    assert transit_s([torch.ones(1) for _ in range(10)]) >= TRANSIT_BATCH_S + 10 * TRANSIT_TENSOR_S
    paths = {"label": torch.ones(32), "path": [f"/data/{i:09d}/" * 8 for i in range(100_000)]}
    assert transit_s(paths) > 10 * transit_s(images)  # 10 MB to pickle, not to place
    assert transit_s([lambda: None]) == math.inf  # no process could send it
