"""What both worker-backed loaders share: DataLoader's attributes, the iterator rule, and
stopping their workers on close(), ``with`` and Lightning's teardown."""

from collections.abc import Callable

import pytest
import torch

from lightning_loaders import ResumableLoader, SequenceSource
from tests.conftest import IndexDataset, loader_processes


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
