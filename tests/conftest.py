"""Shared fixtures: small generated datasets."""

from __future__ import annotations

import signal
from collections.abc import Iterator

import psutil
import pytest
import torch


class IndexDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Sample ``i`` is ``{"index": i, "x": features}``: batches say which samples they hold."""

    def __init__(self, n: int, features: int = 4) -> None:
        self.n = n
        self.features = features

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x = torch.arange(self.features, dtype=torch.float32) + index
        return {"index": torch.tensor(index), "x": x}


class RangeDataset(torch.utils.data.Dataset[int]):
    """Sample ``i`` is ``i``; ``n`` may be changed between epochs (a dataset that grows)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        return index


class EpochSampler(torch.utils.data.Sampler[int]):
    """A sampler of ``size`` indices that keeps its epoch, as ``DistributedSampler`` does;
    subclasses draw from ``self.epoch``."""

    def __init__(self, size: int) -> None:
        self.size = size
        self.epoch = 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.size


@pytest.fixture
def index_dataset() -> IndexDataset:
    return IndexDataset(23)


@pytest.fixture
def ctrl_c() -> Iterator[None]:
    """SIGINT raises ``KeyboardInterrupt`` in the main thread (Python's own handler), as
    Ctrl-C at a terminal does, whatever handler the test began with (put back after)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


def ctrl_c_after(monkeypatch: pytest.MonkeyPatch, owner: object, name: str) -> None:
    """``owner.name``'s next call runs, then raises the ``KeyboardInterrupt`` that a Ctrl-C
    landing just after it raises (the interpreter's eval-breaker check after the call)."""
    call = getattr(owner, name)

    def interrupted(*args: object, **kwargs: object) -> None:
        monkeypatch.undo()
        call(*args, **kwargs)
        raise KeyboardInterrupt

    monkeypatch.setattr(owner, name, interrupted)


_EARLIER: set[int] = set()  # child processes alive when the running test began


@pytest.fixture(autouse=True)
def _earlier_children() -> None:
    """Note the children alive as a test begins: workers of an earlier test's loader that
    only the garbage collector frees (a raised error's traceback holds it) are not this
    test's."""
    _EARLIER.clear()
    _EARLIER.update(child.pid for child in psutil.Process().children(recursive=True))


def loader_processes() -> list[psutil.Process]:
    """Live child processes that a loader of the running test could have started.

    Leaves out those alive when the test began (``_earlier_children``) and helpers that are
    not a loader's and live as long as the test process: torch's shared-memory manager,
    Python's multiprocessing resource tracker (started by the first shared-memory segment,
    e.g. FFCV's writer) and fork server (started by the first ``forkserver`` process), and
    zombies already gone.
    """
    found = []
    for child in psutil.Process().children(recursive=True):
        if child.pid in _EARLIER:
            continue
        try:
            if child.status() == psutil.STATUS_ZOMBIE or child.name() == "torch_shm_manager":
                continue
            if any("resource_tracker" in part or "forkserver" in part
                   for part in child.cmdline()):
                continue
        except psutil.NoSuchProcess:
            continue
        found.append(child)
    return found
