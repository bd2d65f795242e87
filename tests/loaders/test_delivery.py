"""What both worker-backed loaders share: DataLoader's attributes, the iterator rule, and
stopping their workers on close(), ``with`` and Lightning's teardown."""

import multiprocessing
import os
import threading
from collections.abc import Callable

import pytest
import torch

from lightning_loaders import ResumableLoader, SequenceSource
from tests.conftest import IndexDataset, ctrl_c_after, loader_processes


def _map_style(**kwargs) -> ResumableLoader:
    return ResumableLoader(IndexDataset(24), batch_size=4, **kwargs)


def _iterable(**kwargs) -> ResumableLoader:
    return ResumableLoader(SequenceSource([list(range(12)), list(range(12, 24))]),
                           batch_size=4, **kwargs)


KINDS: dict[str, Callable[..., ResumableLoader]] = {"map-style": _map_style,
                                                    "iterable": _iterable}


@pytest.mark.parametrize("make", KINDS.values(), ids=KINDS.keys())
def test_dataloader_attributes_are_kept(make) -> None:
    generator = torch.Generator().manual_seed(11)
    loader = make(num_workers=2, prefetch_factor=3, timeout=5.0, generator=generator,
                  pin_memory_device="")
    assert (loader.batch_size, loader.num_workers, loader.prefetch_factor, loader.timeout,
            loader.generator, loader.seed) == (4, 2, 3, 5.0, generator, 11)
    assert loader.persistent_workers and not loader.drop_last and not loader.pin_memory
    assert make(drop_last=True).drop_last and make(last_batch="drop").drop_last
    assert not make(num_workers=0).persistent_workers


@pytest.mark.parametrize("make", KINDS.values(), ids=KINDS.keys())
def test_a_newer_iter_replaces_older_iterators(make) -> None:
    loader = make()
    old = iter(loader)
    next(old)
    new = iter(loader)
    with pytest.raises(RuntimeError, match="replaced by a newer iter"):
        next(old)
    assert next(new) is not None


@pytest.mark.parametrize("stop", ["close", "with", "lightning teardown"])
@pytest.mark.parametrize("make", KINDS.values(), ids=KINDS.keys())
def test_every_way_of_stopping_stops_the_workers_and_loses_nothing(make, stop: str) -> None:
    with make(num_workers=2, multiprocessing_context="fork") as uninterrupted:
        expected = list(uninterrupted)
    loader = make(num_workers=2, multiprocessing_context="fork")
    it = iter(loader)
    got = [next(it)]
    assert len(loader_processes()) == 2
    if stop == "close":
        loader.close()
    elif stop == "with":
        with loader:
            pass
    else:
        loader._iterator = None  # what Lightning's loop teardown does to a loader
    assert loader_processes() == []
    got += list(it)
    assert [str(b) for b in got] == [str(b) for b in expected]


class _Gate:
    """Process-shared events (forked workers inherit them): the fetch of sample ``sample``,
    once ``armed`` is set (at once unless ``armed=False``), sets ``entered`` and waits for
    ``release``."""

    def __init__(self, sample: int, armed: bool = True) -> None:
        fork = multiprocessing.get_context("fork")
        self.sample, self.entered, self.release = sample, fork.Event(), fork.Event()
        self.armed = fork.Event()
        if armed:
            self.armed.set()


class _Gated(torch.utils.data.Dataset[int]):
    """Samples ``start .. stop - 1``; fetching ``gate.sample`` waits at ``gate``."""

    def __init__(self, start: int, stop: int, gate: _Gate) -> None:
        self.start, self.stop, self.gate = start, stop, gate

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int) -> int:
        sample = self.start + index
        if sample == self.gate.sample and self.gate.armed.is_set():
            self.gate.entered.set()
            assert self.gate.release.wait(30), "the test never released the gated sample"
        return sample


def _gated(kind: str, gate: _Gate, **kwargs) -> ResumableLoader:
    """24 samples in batches of 4, shuffled, map-style or as two 12-sample shards."""
    data = (_Gated(0, 24, gate) if kind == "map-style"
            else SequenceSource([_Gated(0, 12, gate), _Gated(12, 24, gate)]))
    return ResumableLoader(data, batch_size=4, shuffle=True, **kwargs)


WORKERS = {"0 workers": {},
           "processes": {"num_workers": 2, "multiprocessing_context": "fork"},
           "processes, not persistent": {"num_workers": 2, "multiprocessing_context": "fork",
                                         "persistent_workers": False},
           "threads": {"num_workers": 2, "backend": "thread"},
           "threads, not persistent": {"num_workers": 2, "backend": "thread",
                                       "persistent_workers": False}}


def _ring_segments() -> set[str]:
    """This process's shared-memory ring slots (``engines.transport``) in /dev/shm."""
    prefix = f"ll_ring_{os.getpid()}_"
    return {name for name in os.listdir("/dev/shm") if name.startswith(prefix)}


@pytest.mark.parametrize("workers", WORKERS.values(), ids=WORKERS.keys())
@pytest.mark.parametrize("kind", ["map-style", "iterable"])
def test_an_iter_from_another_thread_waits_for_the_next_in_flight_then_replaces_it(
        kind: str, workers: dict) -> None:
    """Thread A is inside ``next()`` (its batch is being fetched) when thread B calls
    ``iter()``: B's ``iter()`` waits for A's ``next()`` to return, A's next ``next()`` raises
    the documented error, and B delivers exactly the next epoch (a new ``iter()`` after a
    partly read epoch starts the next one); no hang, no internal error, no worker or
    shared-memory slot left."""
    released = _Gate(-1)
    released.release.set()
    with _gated(kind, released, **workers) as reference:
        expected = [[batch.tolist() for batch in reference] for _ in range(2)]
    segments_before = _ring_segments()
    gate = _Gate(expected[0][0][0])  # the first sample of epoch 0
    loader = _gated(kind, gate, **workers)
    got: dict[str, list] = {"A": [], "B": []}
    b_calls_iter, b_has_iterator = threading.Event(), threading.Event()

    def thread_a() -> None:
        iterator = iter(loader)
        try:
            got["A"].append(next(iterator).tolist())
            assert b_has_iterator.wait(30)
            got["A"].append(next(iterator).tolist())
        except Exception as exc:
            got["A"].append(f"{type(exc).__name__}: {exc}")

    def thread_b() -> None:
        b_calls_iter.set()
        iterator = iter(loader)
        b_has_iterator.set()
        try:
            got["B"] += [batch.tolist() for batch in iterator]
        except Exception as exc:
            got["B"].append(f"{type(exc).__name__}: {exc}")

    a = threading.Thread(target=thread_a, daemon=True)
    b = threading.Thread(target=thread_b, daemon=True)
    a.start()
    assert gate.entered.wait(30)  # A is inside next(), fetching its first batch
    b.start()
    assert b_calls_iter.wait(30)
    # a grace period, in which B's iter() must not get past A's next() in flight
    overtook = b_has_iterator.wait(0.5)
    gate.release.set()
    a.join(30)
    b.join(30)
    assert not a.is_alive() and not b.is_alive(), f"hung: {got}"
    loader.close()
    assert got["A"] == [expected[0][0], "RuntimeError: this iterator was replaced by a newer "
                                        "iter() on its loader"]
    assert got["B"] == expected[1]
    state = loader.state_dict()
    assert (state["epoch"], state["batches"]) == (1, len(expected[1]))
    assert not overtook
    assert loader_processes() == []
    assert _ring_segments() <= segments_before


def test_a_child_forked_while_a_thread_is_inside_next_reads_the_loader() -> None:
    """A process forked while another thread is inside ``next()`` (``ddp_fork`` after a
    notebook thread read the loader) inherits the loader's lock held by a thread it does not
    have: the child makes its own lock, and reads a whole epoch instead of hanging."""
    gate = _Gate(0)
    loader = _gated("map-style", gate)
    reader = threading.Thread(target=lambda: next(iter(loader)), daemon=True)
    reader.start()
    assert gate.entered.wait(30)  # the thread holds the lock, inside next()
    child = os.fork()
    if child == 0:  # pragma: no cover (the child's outcome is its exit status)
        gate.release.set()
        samples = sorted(i for batch in loader for i in batch.tolist())
        os._exit(0 if samples == list(range(24)) else 1)
    gate.release.set()
    reader.join(30)
    for _ in range(300):
        pid, status = os.waitpid(child, os.WNOHANG)
        if pid:
            break
        threading.Event().wait(0.1)
    else:
        os.kill(child, 9)
        os.waitpid(child, 0)
        pytest.fail("the forked child hung on the lock its parent's thread held")
    assert os.waitstatus_to_exitcode(status) == 0


def _epochs(kind: str, workers: dict) -> list[list[list[int]]]:
    """The batches of ``_gated`` loaders' first two epochs, read without a gate."""
    released = _Gate(-1)
    released.release.set()
    with _gated(kind, released, **workers) as reference:
        return [[batch.tolist() for batch in reference] for _ in range(2)]


@pytest.mark.parametrize("call", ["state_dict", "close"])
@pytest.mark.parametrize("workers", WORKERS.values(), ids=WORKERS.keys())
@pytest.mark.parametrize("kind", ["map-style", "iterable"])
def test_a_state_dict_or_close_from_another_thread_waits_for_the_next_in_flight(
        kind: str, workers: dict, call: str) -> None:
    """Thread A is inside the first ``next()`` of epoch 1 (the epoch being begun, its first
    batch fetched) when thread B (a checkpoint or watchdog thread) calls ``state_dict()`` or
    ``close()``: B's call waits for that batch to be handed over. The state resumes a fresh
    loader exactly after it; after ``close()`` (its workers gone) A's iterator goes on from
    the cursor. No hang, no internal error, no worker or shared-memory slot left."""
    expected = _epochs(kind, workers)
    released = _Gate(-1)
    released.release.set()
    segments_before = _ring_segments()
    gate = _Gate(expected[1][0][0], armed=False)  # the first sample of epoch 1
    loader = _gated(kind, gate, **workers)
    got: list = []
    states: list[dict] = []
    b_returned, a_goes_on = threading.Event(), threading.Event()

    def thread_a() -> None:
        try:
            got.extend(batch.tolist() for batch in loader)
            gate.armed.set()
            iterator = iter(loader)
            got.append(next(iterator).tolist())
            assert a_goes_on.wait(30)
            got.extend(batch.tolist() for batch in iterator)
        except Exception as exc:
            got.append(f"{type(exc).__name__}: {exc}")

    def thread_b() -> None:
        try:
            result = getattr(loader, call)()
            states.append(result)
        except Exception as exc:
            states.append({"error": f"{type(exc).__name__}: {exc}"})
        b_returned.set()

    a = threading.Thread(target=thread_a, daemon=True)
    b = threading.Thread(target=thread_b, daemon=True)
    a.start()
    assert gate.entered.wait(30)  # A is inside next(), fetching the first batch of epoch 1
    b.start()
    # a grace period, in which B's call must not get past A's next() in flight
    overtook = b_returned.wait(0.5)
    gate.release.set()
    assert b_returned.wait(30), "B's call hung"
    workers_after_b = loader_processes()
    a_goes_on.set()
    a.join(30)
    assert not a.is_alive(), f"hung: {got}"
    loader.close()
    assert got == expected[0] + expected[1]
    assert not overtook
    if call == "state_dict":
        state = states[0]
        assert (state["epoch"], state["batches"]) == (1, 1)
        with _gated(kind, released, **workers) as resumed:
            resumed.load_state_dict(state)
            assert [batch.tolist() for batch in resumed] == expected[1][1:]
    else:
        assert states == [None]
        assert workers_after_b == []
    assert loader_processes() == []
    assert _ring_segments() <= segments_before


class _CallsItsLoader(torch.utils.data.Dataset[int]):
    """Samples ``start .. stop - 1``; fetching ``sample`` calls ``loader_call[0]()`` once."""

    def __init__(self, start: int, stop: int, sample: int, loader_call: list) -> None:
        self.start, self.stop, self.sample, self.loader_call = start, stop, sample, loader_call

    def __len__(self) -> int:
        return self.stop - self.start

    def __getitem__(self, index: int) -> int:
        sample = self.start + index
        if sample == self.sample and self.loader_call:
            self.loader_call.pop()()
        return sample


@pytest.mark.parametrize("call", ["close", "state_dict", "load_state_dict"])
@pytest.mark.parametrize("kind", ["map-style", "iterable"])
def test_close_or_state_from_inside_the_dataset_on_a_worker_thread_is_refused(
        kind: str, call: str) -> None:
    """The dataset calls its loader's ``close()``, ``state_dict()`` or ``load_state_dict()``
    on a worker thread (``backend="thread"``), which the thread iterating the loader may be
    waiting for: the fetch fails with an error naming what to do instead (not a hang, not an
    ``AssertionError``), and the loop goes on from the cursor, losing nothing."""
    workers = {"num_workers": 2, "backend": "thread"}
    expected = _epochs(kind, workers)[0]
    loader_call: list = []
    sample = expected[2][1]
    data = (_CallsItsLoader(0, 24, sample, loader_call) if kind == "map-style"
            else SequenceSource([_CallsItsLoader(0, 12, sample, loader_call),
                                 _CallsItsLoader(12, 24, sample, loader_call)]))
    loader = ResumableLoader(data, batch_size=4, shuffle=True, **workers)
    state = loader.state_dict()
    loader_call.append(lambda: getattr(loader, call)(*([state] if "load" in call else [])))
    got: list = []

    def iterate() -> None:
        iterator = iter(loader)
        while True:
            try:
                got.append(next(iterator).tolist())
            except StopIteration:
                return
            except Exception as exc:
                got.append(f"{type(exc).__name__}: {exc}")

    reader = threading.Thread(target=iterate, daemon=True)
    reader.start()
    reader.join(60)
    assert not reader.is_alive(), f"hung: {got}"
    loader.close()
    errors = [item for item in got if isinstance(item, str)]
    assert len(errors) == 1
    assert (f"{call}() was called from the loader's own worker thread 'lightning_loaders "
            "worker") in errors[0]
    assert "call it from the thread that iterates" in errors[0]
    assert [item for item in got if not isinstance(item, str)] == expected


# -- a Ctrl-C in next() after the batch was counted ----------------------------------------


WORKERS = {"0 workers": {}, "processes": {"num_workers": 2},
           "threads": {"num_workers": 2, "backend": "thread"}}


def _samples(batches) -> list[list[int]]:
    return [(b["index"] if isinstance(b, dict) else b).tolist() for b in batches]


@pytest.mark.parametrize("workers", WORKERS.values(), ids=WORKERS.keys())
@pytest.mark.parametrize("make", KINDS.values(), ids=KINDS.keys())
def test_a_ctrl_c_after_the_count_loses_no_batch(make, workers, monkeypatch) -> None:
    """The batch was counted before ``next()`` returned it: ``state_dict()`` said 3 batches
    where the loop had 2, and both a resume and the same iterator going on skipped the third.
    The ``next()`` that raises takes its count back: both go on with it."""
    with make(shuffle=True, seed=3, **workers) as uninterrupted:
        reference = _samples(uninterrupted)
    loader = make(shuffle=True, seed=3, **workers)
    iterator = iter(loader)
    got = _samples([next(iterator), next(iterator)])
    ctrl_c_after(monkeypatch, loader.schedule, "delivered")  # a Ctrl-C just after the count
    with pytest.raises(KeyboardInterrupt):
        next(iterator)
    state = loader.state_dict()
    assert state["batches"] == 2
    with make(shuffle=True, seed=3, **workers) as fresh:
        fresh.load_state_dict(state)
        assert got + _samples(fresh) == reference
    assert got + _samples(iterator) == reference
    loader.close()
    assert loader_processes() == []


class _NineFails(IndexDataset):
    """``IndexDataset(24)`` whose sample 9 (in the third batch, unshuffled) raises."""

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        if index == 9:
            raise ValueError("sample 9 is broken")
        return super().__getitem__(index)


@pytest.mark.parametrize("after", ["the count", "the batch's receipt"])
def test_a_ctrl_c_in_next_records_the_batch_s_skipped_samples_once(after: str,
                                                                     monkeypatch) -> None:
    """The skipped sample of the batch taken back is recorded again as it is fetched again:
    once in all, in ``skipped`` and in the saved skip count, also when the Ctrl-C lands after
    the batch's skipped samples were recorded and before it was counted."""
    def make() -> ResumableLoader:
        return ResumableLoader(_NineFails(24), batch_size=4, on_error="skip")

    loader = make()
    iterator = iter(loader)
    got = _samples([next(iterator), next(iterator)])
    if after == "the count":
        ctrl_c_after(monkeypatch, loader.schedule, "delivered")
    else:
        ctrl_c_after(monkeypatch, loader, "_receive")
    with pytest.raises(KeyboardInterrupt):
        next(iterator)
    assert loader.num_skipped == 0
    fresh = make()
    fresh.load_state_dict(loader.state_dict())
    assert got + _samples(fresh) == got + _samples(iterator)
    assert (loader.skipped_indices, loader.num_skipped, fresh.num_skipped) == ([9], 1, 1)


def test_a_ctrl_c_as_the_autotuner_times_a_batch_loses_no_batch(monkeypatch) -> None:
    """With ``num_workers="auto"`` the tuner times each batch after the loader's ``next()``
    returned it, inside the iterator's ``next()``: a Ctrl-C there lost the batch too."""
    with _map_style(shuffle=True, seed=3, num_workers="auto") as uninterrupted:
        reference = _samples(uninterrupted)
    loader = _map_style(shuffle=True, seed=3, num_workers="auto")
    iterator = iter(loader)
    got = _samples([next(iterator), next(iterator)])
    ctrl_c_after(monkeypatch, iterator, "_measure")  # a Ctrl-C as the timing returns
    with pytest.raises(KeyboardInterrupt):
        next(iterator)
    state = loader.state_dict()
    assert state["batches"] == 2
    with _map_style(shuffle=True, seed=3, num_workers="auto") as fresh:
        fresh.load_state_dict(state)
        assert got + _samples(fresh) == reference
    assert got + _samples(iterator) == reference
    loader.close()
