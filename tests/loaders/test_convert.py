import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    IterableDataset,
    RandomSampler,
    SequentialSampler,
    TensorDataset,
)

from lightning_loaders import ResumableLoader
from lightning_loaders.loaders.convert import make_resumable
from lightning_loaders.orders.base import ShuffledOrder
from lightning_loaders.orders.drawn import DrawnBatchOrder
from lightning_loaders.testing import check_resume_at_every_step, run_epochs, to_plain
from tests.conftest import IndexDataset


def indices(batch) -> list[int]:
    return batch["index"].tolist()


def _pairs(samples: list[dict]) -> tuple[list[int], int]:
    return [int(s["index"]) for s in samples], len(samples)


def _init(worker) -> None:
    torch.manual_seed(int(worker))


def test_every_loader_setting_is_carried_over() -> None:
    generator = torch.Generator().manual_seed(17)
    source = DataLoader(IndexDataset(30), batch_size=4, shuffle=True, num_workers=2,
                        collate_fn=_pairs, pin_memory=False, drop_last=True, timeout=30,
                        worker_init_fn=_init, generator=generator, prefetch_factor=3,
                        persistent_workers=True, multiprocessing_context="fork")
    ours = make_resumable(source)
    assert isinstance(ours, ResumableLoader)
    assert ours.dataset is source.dataset
    assert (ours.batch_size, ours.num_workers, ours.drop_last, ours.last_batch) == (4, 2, True,
                                                                                   "drop")
    assert ours.collate_fn is _pairs and ours.worker_init_fn is _init
    assert (ours.timeout, ours.prefetch_factor, ours.persistent_workers) == (30, 3, True)
    assert ours.multiprocessing_context is source.multiprocessing_context
    assert ours.pin_memory is False
    assert ours.seed == 17 and isinstance(ours.schedule.order, ShuffledOrder)
    batch = next(iter(ours))
    assert batch[1] == 4
    ours.close()


def test_plain_loaders_give_the_same_batches_as_torch() -> None:
    dataset = TensorDataset(torch.randn(21, 3), torch.arange(21))
    for kwargs in ({"batch_size": 4}, {"batch_size": 4, "drop_last": True},
                   {"batch_size": 5, "collate_fn": lambda rows: torch.stack([r[1] for r in rows])},
                   {"batch_sampler": BatchSampler(SequentialSampler(range(21)), 6, False)}):
        source = DataLoader(dataset, **kwargs)
        assert [to_plain(b) for b in make_resumable(source)] == [to_plain(b) for b in source]


def test_a_subclass_with_extra_required_arguments_converts() -> None:
    class Tagged(DataLoader):
        def __init__(self, tag: str, dataset, **kwargs) -> None:
            super().__init__(dataset, **kwargs)
            self.tag = tag

    source = Tagged("val", IndexDataset(9), batch_size=4)
    assert [indices(b) for b in make_resumable(source)] == [[0, 1, 2, 3], [4, 5, 6, 7], [8]]


def test_the_seed_comes_from_the_loader_then_the_sampler_then_the_environment(monkeypatch):
    ds = IndexDataset(10)
    sampler = RandomSampler(ds, generator=torch.Generator().manual_seed(5))
    assert make_resumable(DataLoader(ds, sampler=sampler)).seed == 5
    assert make_resumable(DataLoader(ds, sampler=sampler), seed=9).seed == 9
    monkeypatch.setenv("PL_GLOBAL_SEED", "31")
    assert make_resumable(DataLoader(ds, shuffle=True)).seed == 31
    generator = torch.Generator().manual_seed(2)
    assert make_resumable(DataLoader(ds, shuffle=True), generator=generator).seed == 2


def test_overrides_replace_what_they_contradict() -> None:
    source = DataLoader(IndexDataset(10), batch_size=3, drop_last=True)
    assert make_resumable(source, last_batch="pad").last_batch == "pad"
    shuffled = make_resumable(source, shuffle=True, seed=1)
    assert isinstance(shuffled.schedule.order, ShuffledOrder) and shuffled.drop_last
    assert make_resumable(source, batch_size=5).batch_size == 5


def test_converted_loaders_resume_exactly() -> None:
    def make() -> ResumableLoader:
        return make_resumable(DataLoader(IndexDataset(17), batch_size=3, shuffle=True,
                                         num_workers=1, persistent_workers=True), seed=8)

    full = check_resume_at_every_step(make, epochs=2, key=indices)
    assert all(sorted(i for b in e for i in b) == list(range(17)) for e in full)


def test_a_custom_batch_sampler_converts_with_its_batch_size() -> None:
    class Pairs(torch.utils.data.Sampler[list[int]]):
        def __iter__(self):
            perm = torch.randperm(10).tolist()
            return iter([perm[i:i + 2] for i in range(0, 10, 2)])

        def __len__(self) -> int:
            return 5

    ours = make_resumable(DataLoader(IndexDataset(10), batch_sampler=Pairs()), seed=3)
    assert isinstance(ours.schedule.order, DrawnBatchOrder) and ours.batch_size == 2
    batches = run_epochs(ours, [0], key=indices)[0]
    assert [len(b) for b in batches] == [2] * 5
    assert sorted(i for b in batches for i in b) == list(range(10))


def test_an_existing_resumable_loader_passes_through() -> None:
    loader = ResumableLoader(IndexDataset(5))
    assert make_resumable(loader) is loader
    with pytest.raises(TypeError, match="already a ResumableLoader"):
        make_resumable(loader, seed=1)


class _Stream(IterableDataset):
    def __iter__(self):
        return iter(range(3))


@pytest.mark.parametrize(
    ("source", "error", "match"),
    [
        (DataLoader(_Stream(), batch_size=2), TypeError, "map-style dataset"),
        (DataLoader(IndexDataset(4), batch_size=None), ValueError, "unbatched"),
        ([1, 2, 3], TypeError, "got list"),
    ],
)
def test_what_cannot_convert_says_why(source, error, match) -> None:
    with pytest.raises(error, match=match):
        make_resumable(source)


def test_evaluation_loaders_read_every_sample_once_even_with_batch_size_one() -> None:
    source = DataLoader(IndexDataset(7), batch_size=1)
    with pytest.raises(ValueError, match="batch_size >= 2"):
        len(make_resumable(source, rank=0, world_size=2))
    ranks = [run_epochs(make_resumable(source, evaluation=True, rank=r, world_size=2), [0],
                        key=indices)[0] for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 3
    assert sorted(i for r in ranks for b in r for i in b) == list(range(7))
    assert ranks[0][-1] == [4, 5] and ranks[1][-1] == [6]
