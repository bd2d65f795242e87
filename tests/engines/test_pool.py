"""Both worker pools keep torch's worker contract: results in request order from round-robin
workers (a balanced pool's from the workers with the fewest in hand), at most
``num_workers * prefetch_factor`` requests in flight, out-of-order delivery that lets a fast
worker run on past a slow one, a worker's exception re-raised with its type, a failing
``worker_init_fn`` failing that worker's requests, and a late worker named."""

from __future__ import annotations

import os
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest
from torch.utils.data import get_worker_info

from lightning_loaders.engines.pool import InProcess, WorkerStalled
from lightning_loaders.engines.threads import ThreadPool, thread_worker
from lightning_loaders.engines.workers import ProcessPool


def worker_id() -> int:
    """The id of the worker running this, thread or process."""
    info = thread_worker() or get_worker_info()
    assert info is not None
    return info.id


class Recorder:
    """``fetcher[r]`` is ``(r, the worker's id)``, after ``delay`` seconds."""

    def __init__(self, delay: float = 0.0) -> None:
        self.delay = delay

    def __getitem__(self, request: int) -> tuple[int, int]:
        time.sleep(self.delay)
        return request, worker_id()


def make_pool(kind: str, fetcher: Any, sampler: Any, **kwargs: Any) -> ThreadPool | ProcessPool:
    if kind == "thread":
        return ThreadPool(fetcher, sampler, **kwargs)
    return ProcessPool(fetcher, sampler, seed=7, **kwargs)


KINDS = ["thread", "process"]


@pytest.mark.parametrize("kind", KINDS)
@pytest.mark.parametrize("workers", [1, 3])
def test_results_come_in_request_order_from_round_robin_workers(kind: str, workers: int) -> None:
    pool = make_pool(kind, Recorder(), range(20), num_workers=workers)
    for _ in range(2):  # a second iterator over the same (persistent) workers
        got = list(pool)
        assert [r for r, _ in got] == list(range(20))
        assert [w for _, w in got] == [r % workers for r in range(20)]  # torch's round-robin
    pool.close()


class Uneven:
    """``fetcher[r]`` is ``(r, the worker's id)``; worker 0 takes ``delay`` seconds a fetch,
    the others none."""

    def __init__(self, delay: float) -> None:
        self.delay = delay

    def __getitem__(self, request: int) -> tuple[int, int]:
        me = worker_id()
        if me == 0:
            time.sleep(self.delay)
        return request, me


@pytest.mark.parametrize("kind", KINDS)
def test_a_balanced_pool_gives_the_next_requests_to_the_workers_with_fewest_in_hand(
        kind: str) -> None:
    """In order, round-robin splits the requests evenly whatever the workers' speeds; a
    balanced pool (requests any worker can answer) gives the slow worker fewer, and delivers
    the same results in the same order."""
    served = {}
    for balanced in (False, True):
        pool = make_pool(kind, Uneven(0.02), range(40), num_workers=2, balanced=balanced)
        got = list(pool)
        pool.close()
        assert [r for r, _ in got] == list(range(40))
        served[balanced] = [w for _, w in got].count(0)
    assert served[False] == 20
    assert served[True] < served[False] - 2, served


class Taken:
    """A sampler that counts the requests taken from it."""

    def __init__(self, n: int) -> None:
        self.n = n
        self.taken = 0

    def __iter__(self) -> Iterator[int]:
        for r in range(self.n):
            self.taken += 1
            yield r


@pytest.mark.parametrize("kind", KINDS)
def test_requests_in_flight_stay_within_workers_times_prefetch_factor(kind: str) -> None:
    sampler = Taken(40)
    pool = make_pool(kind, Recorder(0.002), sampler, num_workers=3, prefetch_factor=2)
    delivered = 0
    for _ in pool:
        delivered += 1
        assert sampler.taken - delivered <= 3 * 2
    assert delivered == 40
    pool.close()


class GatedFirst(Recorder):
    """``Recorder`` whose request 0 waits until the file ``gate`` exists (bounded, so that a
    bug cannot hang the test)."""

    def __init__(self, gate: str) -> None:
        super().__init__()
        self.gate = gate

    def __getitem__(self, request: int) -> tuple[int, int]:
        waited = 0
        while request == 0 and not os.path.exists(self.gate) and waited < 3000:
            time.sleep(0.005)
            waited += 1
        return super().__getitem__(request)


@pytest.mark.parametrize("kind", KINDS)
def test_out_of_order_a_fast_worker_runs_on_past_a_slow_one(kind: str, tmp_path) -> None:
    """The worker holding request 0 stops nothing else: 20 results (ten times the 2 in
    flight per worker) come before the gate opens, and every result comes once."""
    gate = tmp_path / "gate"
    pool = make_pool(kind, GatedFirst(str(gate)), range(30), num_workers=2, prefetch_factor=2,
                     in_order=False)
    seen = []
    for r, _ in pool:
        seen.append(r)
        if len(seen) == 20:
            gate.touch()
    assert 0 not in seen[:20] and sorted(seen) == list(range(30))
    pool.close()


class Fails:
    def __getitem__(self, request: int) -> int:
        if request == 4:
            raise KeyError(f"no sample {request}")
        return request


@pytest.mark.parametrize(("kind", "where"), [("thread", "thread"), ("process", "process")])
def test_an_exception_reaches_the_caller_with_its_type_and_worker(kind: str, where: str) -> None:
    pool = make_pool(kind, Fails(), range(8), num_workers=2)
    it = iter(pool)
    assert [next(it) for _ in range(4)] == [0, 1, 2, 3]
    with pytest.raises(KeyError, match=f"Caught KeyError in DataLoader worker {where} 0"):
        next(it)
    pool.close()


def fail_in_worker_one(worker: int) -> None:
    if worker == 1:
        raise RuntimeError("no device")


@pytest.mark.parametrize("kind", KINDS)
def test_a_failing_worker_init_fn_fails_that_workers_requests(kind: str) -> None:
    pool = make_pool(kind, Recorder(), range(4), num_workers=2,
                     worker_init_fn=fail_in_worker_one)
    it = iter(pool)
    assert next(it) == (0, 0)
    with pytest.raises(RuntimeError, match="no device"):
        next(it)
    pool.close()


class HangsOnThree:
    def __getitem__(self, request: int) -> int:
        if request == 3:
            time.sleep(1)
        return request


@pytest.mark.parametrize("kind", KINDS)
def test_timeout_names_the_worker_whose_request_is_late(kind: str) -> None:
    pool = make_pool(kind, HangsOnThree(), range(6), num_workers=2, timeout=0.3)
    it = iter(pool)
    assert [next(it) for _ in range(3)] == [0, 1, 2]
    with pytest.raises(WorkerStalled) as caught:
        next(it)
    assert caught.value.worker == 1 and caught.value.timeout == 0.3
    if isinstance(pool, ProcessPool):
        assert caught.value.pid == pool.workers[1].process.pid
    pool.close()


def test_in_process_fetches_each_request_when_asked() -> None:
    fetched: list[int] = []

    class Logs:
        def __getitem__(self, request: int) -> int:
            fetched.append(request)
            return request * 2

    it = iter(InProcess(Logs(), range(5), pin=None))
    assert next(it) == 0 and fetched == [0]  # nothing fetched ahead
    assert list(it) == [2, 4, 6, 8]


def test_process_workers_start_no_thread_in_the_main_process() -> None:
    before = {t.ident for t in threading.enumerate()}
    pool = ProcessPool(Recorder(), range(6), num_workers=2, seed=7)
    assert [r for r, _ in pool] == list(range(6))
    assert {t.ident for t in threading.enumerate()} <= before  # no feeder or pin thread (one
    # of an earlier test's threads may have ended meanwhile)
    assert all(worker.process.pid != os.getpid() for worker in pool.workers)
    pool.close()
