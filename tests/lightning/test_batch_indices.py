import time
from pathlib import Path

import pytest
from lightning.pytorch.overrides.distributed import _IndexBatchSamplerWrapper

from lightning_loaders import ResumableLoader, SequenceSource
from lightning_loaders.lightning.batch_indices import batch_indices, expose_batch_indices
from lightning_loaders.testing import run_epochs
from tests.conftest import IndexDataset
from tests.typing_harness import mypy_errors


def indices(batch) -> list[int]:
    return batch["index"].tolist()


def _loader(n: int, batch_size: int, rank: int, world: int, **kwargs) -> ResumableLoader:
    return ResumableLoader(IndexDataset(n), batch_size=batch_size, rank=rank, world_size=world,
                           evaluation=True, **kwargs)


@pytest.mark.parametrize("shuffle", [False, True])
def test_batch_indices_are_what_each_rank_reads(shuffle: bool) -> None:
    for rank in range(3):
        loader = _loader(20, 3, rank, 3, shuffle=shuffle, seed=2)
        delivered = run_epochs(loader, range(2), key=indices)
        for epoch in range(2):
            planned = [b.tolist() for b in batch_indices(loader, epoch=epoch)]
            assert planned == delivered[epoch]
        other = [b.tolist() for b in batch_indices(loader, epoch=1, rank=(rank + 1) % 3)]
        assert other == run_epochs(_loader(20, 3, (rank + 1) % 3, 3, shuffle=shuffle, seed=2),
                                   range(2), key=indices)[1]


@pytest.mark.parametrize("batch_size", [1, 2, 3])
def test_evaluation_reads_every_sample_once_with_equal_batch_counts(batch_size: int) -> None:
    for world in (2, 3, 4):
        for n in range(world, 3 * world * batch_size + 2):
            ranks = [batch_indices(_loader(n, batch_size, r, world)) for r in range(world)]
            assert len({len(r) for r in ranks}) == 1, (n, world)
            sizes = [len(b) for r in ranks for b in r]
            assert min(sizes) >= 1 and max(sizes) <= max(batch_size, 2), (n, world)
            seen = sorted(int(i) for r in ranks for b in r for i in b)
            assert seen == list(range(n)), (n, world)


def test_fewer_samples_than_ranks_is_refused_with_the_numbers() -> None:
    with pytest.raises(ValueError, match="from the epoch's 2 samples with batch_size=1; "
                                         "evaluate on at most 2 ranks$"):
        len(_loader(2, 1, 0, 3))


def test_lightning_prediction_writers_see_each_delivered_batch() -> None:
    loader = expose_batch_indices(_loader(11, 2, 1, 2, shuffle=True, seed=5))
    sampler = loader.batch_sampler
    assert isinstance(sampler, _IndexBatchSamplerWrapper)
    assert not sampler.seen_batch_indices
    iterator = iter(loader)
    delivered = [indices(next(iterator)) for _ in range(2)]
    assert list(sampler.seen_batch_indices) == delivered
    assert sampler.seen_batch_indices[-1] == delivered[-1]
    with pytest.raises(IndexError, match="not delivered yet"):
        sampler.seen_batch_indices[2]


class _SlowFirst(IndexDataset):
    """Sample 0 takes a while: with ``in_order=False`` its batch arrives after later ones."""

    def __getitem__(self, index: int):
        if index == 0:
            time.sleep(0.3)
        return super().__getitem__(index)


def test_out_of_order_prediction_writers_see_the_indices_of_the_batch_delivered() -> None:
    """The ``i``-th batch delivered is not planned batch ``i``: its indices were another
    batch's (and past the frontier, an ``IndexError``)."""
    loader = expose_batch_indices(ResumableLoader(_SlowFirst(8), batch_size=2, num_workers=2,
                                                  in_order=False))
    seen = loader.batch_sampler.seen_batch_indices
    delivered = []
    for batch in loader:
        delivered.append(indices(batch))
        assert seen[len(delivered) - 1] == delivered[-1]
    assert list(seen) == delivered and delivered[0] != [0, 1]
    assert sorted(i for batch in delivered for i in batch) == list(range(8))


def test_an_iterable_datasets_loader_is_refused_by_name() -> None:
    loader = ResumableLoader(SequenceSource([[1, 2, 3]]), batch_size=2)
    for describe in (batch_indices, expose_batch_indices):
        with pytest.raises(TypeError, match=f"{describe.__name__} needs a ResumableLoader over a "
                           "map-style dataset, got a ResumableIterableLoader"):
            describe(loader)


def test_documented_calls_type_check_on_a_resumable_loader(tmp_path: Path) -> None:
    """Users hold a ``ResumableLoader`` (a data module's attribute, a function's result)."""
    assert mypy_errors("""
        from typing import assert_type
        import numpy as np
        from lightning_loaders import ResumableLoader, batch_indices, expose_batch_indices

        def predict(loader: ResumableLoader) -> ResumableLoader:
            assert_type(batch_indices(loader, rank=1), list[np.ndarray])
            return expose_batch_indices(loader)
        """, tmp_path) == []
