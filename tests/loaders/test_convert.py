from typing import Any

import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
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


def test_the_seed_comes_from_the_sampler_then_the_loader_then_the_environment(monkeypatch):
    ds = IndexDataset(10)
    sampler = RandomSampler(ds, generator=torch.Generator().manual_seed(5))
    assert make_resumable(DataLoader(ds, sampler=sampler)).seed == 5
    assert make_resumable(DataLoader(ds, sampler=sampler, batch_size=None)).seed == 5  # unbatched
    assert make_resumable(DataLoader(ds, batch_sampler=BatchSampler(sampler, 2, False))).seed == 5
    assert make_resumable(DataLoader(ds, sampler=sampler), seed=9).seed == 9
    # torch orders by the sampler's generator; the loader's only seeds the workers then
    loader_generator = torch.Generator().manual_seed(7)
    assert make_resumable(DataLoader(ds, sampler=sampler, generator=loader_generator)).seed == 5
    assert make_resumable(DataLoader(ds, generator=loader_generator)).seed == 7
    monkeypatch.setenv("PL_GLOBAL_SEED", "31")
    assert make_resumable(DataLoader(ds, shuffle=True)).seed == 31
    generator = torch.Generator().manual_seed(2)
    assert make_resumable(DataLoader(ds, shuffle=True), generator=generator).seed == 2


def _distributed(ds: IndexDataset, seed: int = 0, **kwargs: Any) -> DistributedSampler:
    return DistributedSampler(ds, **{"num_replicas": 1, "rank": 0, "seed": seed, **kwargs})


def _stream(loader: Any) -> list[int]:
    return [i for batch in loader for i in indices(batch)]


def test_a_distributed_samplers_seed_keys_the_order(monkeypatch) -> None:
    """As in torch, where ``DistributedSampler(seed=s)`` orders by ``s`` whatever
    ``seed_everything`` or the loader's generator say (it read 0 for every seed: one order)."""
    ds = IndexDataset(12)
    monkeypatch.setenv("PL_GLOBAL_SEED", "31")
    generator = torch.Generator().manual_seed(7)
    streams = {}
    for seed in (0, 123, 456):
        for source in (DataLoader(ds, batch_size=4, sampler=_distributed(ds, seed)),
                       DataLoader(ds, batch_size=4, sampler=_distributed(ds, seed),
                                  generator=generator),
                       DataLoader(ds, batch_sampler=BatchSampler(_distributed(ds, seed), 4,
                                                                 False))):
            ours = make_resumable(source)
            assert ours.seed == seed
            assert streams.setdefault(seed, _stream(ours)) == _stream(make_resumable(source))
    assert len({tuple(stream) for stream in streams.values()}) == 3
    assert all(sorted(stream) == list(range(12)) for stream in streams.values())


def test_a_converted_distributed_sampler_keeps_shuffle_drop_last_and_set_epoch() -> None:
    """``shuffle=False`` reads in order, ``drop_last=True`` drops the tail past equal shares
    (every rank reads as many samples in batches of torch's sizes), and the epoch set on the
    user's sampler is the epoch read, as ``DataLoader`` reads it."""
    ds = IndexDataset(10)
    plain = DataLoader(ds, batch_size=4, sampler=_distributed(ds, 5, shuffle=False))
    assert [indices(b) for b in make_resumable(plain)] == [indices(b) for b in plain]
    ranks = [[indices(b) for b in make(DataLoader(ds, batch_size=2, sampler=_distributed(
        ds, 5, num_replicas=3, rank=rank, drop_last=True)))] for rank in range(3)
        for make in (make_resumable, lambda loader: loader)]
    assert [[len(b) for b in rank] for rank in ranks] == [[2, 1]] * 6
    ours = [i for rank in ranks[::2] for b in rank for i in b]
    assert len(ours) == len(set(ours)) == 9
    sampler = _distributed(ds, 5)
    loader = make_resumable(DataLoader(ds, batch_size=4, sampler=sampler))
    epochs = []
    for epoch in (3, 4):
        sampler.set_epoch(epoch)
        epochs.append(_stream(loader))
        assert loader.epoch == epoch
    sampler = _distributed(ds, 5)
    sampler.set_epoch(4)
    assert epochs[0] != epochs[1] == _stream(make_resumable(DataLoader(ds, batch_size=4,
                                                                       sampler=sampler)))


def test_a_converted_distributed_sampler_resumes_exactly() -> None:
    def make() -> ResumableLoader:
        return make_resumable(DataLoader(IndexDataset(11), batch_size=3,
                                         sampler=_distributed(IndexDataset(11), 123)))

    full = check_resume_at_every_step(make, epochs=2, key=indices)
    assert make().seed == 123 and full[0] != full[1]


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


def test_a_bucketing_batch_sampler_converts_with_its_batches_dealt_whole() -> None:
    class Buckets(torch.utils.data.Sampler[list[int]]):
        """Batches of 1 to 4 samples, sized by the sample's "length" (index % 4)."""

        def __iter__(self):
            perm = torch.randperm(17).tolist()
            batches, start = [], 0
            while start < 17:
                size = 1 + perm[start] % 4
                batches.append(perm[start:start + size])
                start += size
            return iter(batches)

    def make(rank: int = 0, world_size: int = 1):
        return make_resumable(DataLoader(IndexDataset(17), batch_sampler=Buckets()), seed=3,
                              rank=rank, world_size=world_size)

    single = check_resume_at_every_step(make, epochs=2, key=indices)
    assert len({len(b) for b in single[0]}) > 1
    ranks = [run_epochs(make(r, 2), range(2), key=indices) for r in range(2)]
    for epoch, batches in enumerate(single):
        assert len(ranks[0][epoch]) == len(ranks[1][epoch])
        whole = len(batches) // 2 * 2
        assert [ranks[g % 2][epoch][g // 2] for g in range(whole)] == batches[:whole]
        assert sorted(i for r in ranks for b in r[epoch] for i in b) == list(range(17))


def test_an_existing_resumable_loader_passes_through() -> None:
    loader = ResumableLoader(IndexDataset(5))
    assert make_resumable(loader) is loader
    with pytest.raises(TypeError, match="already a ResumableLoader"):
        make_resumable(loader, seed=1)


class _Stream(IterableDataset):
    """Splits itself over workers, as torch's documentation shows."""

    def __iter__(self):
        info = torch.utils.data.get_worker_info()
        ids = range(7)
        return iter(ids if info is None else ids[info.id::info.num_workers])


class _Unsized(torch.utils.data.Dataset):
    def __getitem__(self, index: int) -> int:
        return index


@pytest.mark.parametrize(
    ("source", "error", "match"),
    [
        (DataLoader(_Unsized(), batch_size=2, sampler=[0, 1]), TypeError, "no __len__"),
        ([1, 2, 3], TypeError, "got list"),
    ],
)
def test_what_cannot_convert_says_why(source, error, match) -> None:
    with pytest.raises(error, match=match):
        make_resumable(source)


@pytest.mark.parametrize("workers", [0, 2])
def test_an_iterable_dataset_and_unbatched_loading_convert(workers: int) -> None:
    """What ``ResumableLoader`` takes directly: batches of an iterable dataset (read whole by
    the plan, whatever its own split), and ``batch_size=None`` (each sample as it is)."""
    stream = make_resumable(DataLoader(_Stream(), batch_size=2, num_workers=workers))
    batches = [batch.tolist() for batch in stream]
    assert len(batches) == 4 and sorted(i for b in batches for i in b) == list(range(7))
    unbatched = make_resumable(DataLoader(TensorDataset(torch.arange(5)), batch_size=None,
                                          shuffle=True, num_workers=workers))
    samples = run_epochs(unbatched, range(2), key=lambda sample: int(sample[0]))
    assert [sorted(epoch) for epoch in samples] == [list(range(5))] * 2
    assert samples[0] != samples[1]
    stream.close()
    unbatched.close()


def test_a_loader_without_workers_leaves_its_worker_settings_behind() -> None:
    """``num_workers=0`` as an override: the source's prefetch, timeout and context no longer
    apply (DataLoader ignores them without workers; ResumableLoader refuses them)."""
    source = DataLoader(IndexDataset(6), batch_size=2, num_workers=2, timeout=5,
                        multiprocessing_context="spawn", persistent_workers=True)
    ours = make_resumable(source, num_workers=0)
    assert ours.num_workers == 0
    assert [indices(batch) for batch in ours] == [[0, 1], [2, 3], [4, 5]]


def test_evaluation_loaders_read_every_sample_once_even_with_batch_size_one() -> None:
    source = DataLoader(IndexDataset(7), batch_size=1)
    with pytest.raises(ValueError, match="batch_size >= 2"):
        len(make_resumable(source, rank=0, world_size=2))
    ranks = [run_epochs(make_resumable(source, evaluation=True, rank=r, world_size=2), [0],
                        key=indices)[0] for r in range(2)]
    assert len(ranks[0]) == len(ranks[1]) == 3
    assert sorted(i for r in ranks for b in r for i in b) == list(range(7))
    assert ranks[0][-1] == [4, 5] and ranks[1][-1] == [6]


def _webloader(urls: list[str], batched: bool, workers: int = 0,
               loader: Any = None) -> Any:
    """``webdataset.WebLoader`` (or ``loader``) as WebDataset's documentation builds it:
    batched by its DataLoader, or over a dataset that batches itself (``batch_size=None``)."""
    import webdataset as wds

    loader = loader or wds.WebLoader
    dataset = wds.WebDataset(urls, shardshuffle=False).decode().to_tuple("cls")
    if batched:
        return loader(dataset.batched(4), batch_size=None, num_workers=workers)
    return loader(dataset, batch_size=4, num_workers=workers)


@pytest.mark.parametrize("batched", [False, True], ids=["loader-batches", "dataset-batches"])
@pytest.mark.parametrize("workers", [0, 2])
def test_a_webloader_converts_as_the_dataloader_it_wraps(tmp_path, batched: bool,
                                                         workers: int) -> None:
    """A WebLoader is no DataLoader but a WebDataset pipeline over one (refused before with
    'converts a torch.utils.data.DataLoader, got WebLoader'): with no stages after it, it
    converts as that DataLoader, with its workers and batching, and resumes exactly."""
    pytest.importorskip("webdataset")
    from tests.sources.test_webdataset import write_shards

    urls = write_shards(tmp_path)  # 40 samples

    def make() -> ResumableLoader:
        return make_resumable(_webloader(urls, batched, workers))

    def key(batch: Any) -> list[int]:
        return batch[0].tolist()

    assert make().num_workers == workers
    with_length = _webloader(urls, batched, workers).with_length(10, silent=True)  # a subclass
    assert isinstance(make_resumable(with_length), ResumableLoader)
    full = check_resume_at_every_step(make, epochs=2, key=key)
    assert full == run_epochs(make_resumable(_webloader(urls, batched, workers, DataLoader)),
                              range(2), key)
    assert [sorted(i for b in epoch for i in b) for epoch in full] == [list(range(40))] * 2
    if workers == 0:
        assert full[0] == [list(range(i, i + 4)) for i in range(0, 40, 4)]


@pytest.mark.parametrize(("stages", "named"), [
    (lambda loader: loader.unbatched().shuffle(8).batched(4),
     r"adds unbatched\(\), shuffle\(8\), batched\(4\) after its DataLoader"),
    (lambda loader: loader.with_epoch(3), r"adds an epoch of 3 \(with_epoch/repeat\)"),
    (lambda loader: loader.repeat(2), r"adds repeating 2 times \(repeat\)"),
], ids=["reshuffled", "with_epoch", "repeat"])
def test_a_webloader_with_stages_after_its_dataloader_is_refused_naming_them(
        tmp_path, stages, named: str) -> None:
    """Converting the DataLoader alone would drop them (a cross-batch shuffle, an epoch's
    length): refused, with the loader that does that resumably."""
    pytest.importorskip("webdataset")
    from tests.sources.test_webdataset import write_shards

    loader = stages(_webloader(write_shards(tmp_path), batched=False))
    with pytest.raises(TypeError, match=named + r".*dataset \(a WebDataset\) instead: "
                                                r"ResumableLoader\(dataset, batch_size="):
        make_resumable(loader)
