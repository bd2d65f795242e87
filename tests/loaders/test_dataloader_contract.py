"""DataLoader's contract, row by row, each checked against a real ``torch.utils.data.DataLoader``
where the two can be compared: unbatched and bulk loading, any batch sampler, the original
exception type, an explicit ``DistributedSampler``, a growing dataset, the worker's dataset,
fixed attributes, the signature ``help()`` shows, ``ResumableLoader[T]`` and
``snapshot_every_n_steps``."""

import copy
import inspect
import multiprocessing
import pickle
import pydoc
from collections.abc import Callable
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    DistributedSampler,
    RandomSampler,
    SequentialSampler,
    Subset,
    SubsetRandomSampler,
    TensorDataset,
    WeightedRandomSampler,
    get_worker_info,
)

from lightning_loaders import ResumableIterableLoader, ResumableLoader, SampleFetchError
from lightning_loaders.loaders.map_style import MapStyleLoader
from lightning_loaders.sources.shards import SequenceSource
from lightning_loaders.testing import check_resume_at_every_step, to_plain
from tests.conftest import IndexDataset, RangeDataset, loader_processes


class _Bulk(torch.utils.data.Dataset[int]):
    """``dataset[i]`` is ``i``; ``dataset[[i, j, ...]]`` is a tensor of them (bulk reads)."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int | list[int]) -> int | torch.Tensor:
        if isinstance(index, list):
            return torch.tensor(index) * 10
        return index


def _plain(loader) -> list:
    return [to_plain(batch) for batch in loader]


def test_batch_size_none_loads_single_samples_like_dataloader() -> None:
    data = IndexDataset(7)
    ours = ResumableLoader(data, batch_size=None)
    assert ours.batch_size is None and len(ours) == 7
    assert _plain(ours) == _plain(DataLoader(data, batch_size=None))
    with pytest.raises(ValueError, match="drop_last"):
        ResumableLoader(data, batch_size=None, drop_last=True)


@pytest.mark.parametrize("drop_last", [False, True])
def test_batch_size_none_with_a_batch_yielding_sampler_is_bulk_loading(drop_last: bool) -> None:
    data = _Bulk(10)
    sampler = BatchSampler(SequentialSampler(data), 3, drop_last=drop_last)
    ours = ResumableLoader(data, batch_size=None, sampler=sampler)
    assert _plain(ours) == _plain(DataLoader(data, batch_size=None, sampler=sampler))
    assert len(ours) == len(sampler) == 4 - drop_last


def test_bulk_loading_reads_lists_of_different_sizes_each_in_one_read() -> None:
    data, sampler = _Bulk(7), [[4, 1], [0], [6, 2, 5, 3]]
    ours = ResumableLoader(data, batch_size=None, sampler=sampler)
    assert _plain(ours) == _plain(DataLoader(data, batch_size=None, sampler=sampler))
    check_resume_at_every_step(lambda: ResumableLoader(data, batch_size=None, sampler=sampler),
                               epochs=2)


@pytest.mark.parametrize("dataset", [np.arange(16).reshape(4, 4), {(0, 1): "a", (2, 3): "b"}],
                         ids=["2-D array", "dict keyed by tuples"])
def test_batch_size_none_passes_a_tuple_as_one_key_like_dataloader(dataset: Any) -> None:
    """A sampler's tuple is one key, ``dataset[(i, j)]``, not a list of indices."""
    sampler = [(0, 1), (2, 3)]
    ours = _plain(ResumableLoader(dataset, batch_size=None, sampler=sampler))
    assert ours == _plain(DataLoader(dataset, batch_size=None, sampler=sampler))
    check_resume_at_every_step(
        lambda: ResumableLoader(dataset, batch_size=None, sampler=sampler), epochs=2)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_unbatched_and_bulk_loading_resume_exactly(num_workers: int) -> None:
    check_resume_at_every_step(
        lambda: ResumableLoader(_Bulk(9), batch_size=None, shuffle=True, seed=3,
                                num_workers=num_workers), epochs=2)
    check_resume_at_every_step(
        lambda: ResumableLoader(_Bulk(10), batch_size=None, seed=3, num_workers=num_workers,
                                sampler=BatchSampler(RandomSampler(range(10)), 4, False)),
        epochs=2)


class _PreBatched(torch.utils.data.IterableDataset):
    """Yields ready-made batches (split between workers by itself), as pipelines that batch
    inside the dataset do; read with ``batch_size=None``."""

    def __iter__(self):
        info = get_worker_info()
        worker, workers = (info.id, info.num_workers) if info else (0, 1)
        for b in range(worker, 6, workers):
            yield {"x": torch.arange(4 * b, 4 * b + 4), "id": b}


@pytest.mark.parametrize("num_workers", [0, 2])
def test_batch_size_none_delivers_an_iterable_datasets_items_as_they_are(num_workers) -> None:
    ours = ResumableLoader(_PreBatched(), batch_size=None, num_workers=num_workers)
    theirs = DataLoader(_PreBatched(), batch_size=None, num_workers=num_workers)
    assert ours.batch_size is None and ours.collate_fn is theirs.collate_fn
    assert sorted(map(str, _plain(ours))) == sorted(map(str, _plain(theirs)))
    assert [batch["x"].shape for batch in ours] == [torch.Size([4])] * 6
    check_resume_at_every_step(
        lambda: ResumableLoader(_PreBatched(), batch_size=None, num_workers=num_workers), 2)
    with pytest.raises(ValueError, match="drop_last"):
        ResumableLoader(_PreBatched(), batch_size=None, drop_last=True)


class _Batches:
    """A batch sampler that is no torch ``BatchSampler``: a generator-backed iterable."""

    def __init__(self, n: int, size: int) -> None:
        self.n, self.size = n, size

    def __iter__(self):
        for start in range(0, self.n, self.size):
            yield list(range(start, min(start + self.size, self.n)))

    def __len__(self) -> int:
        return -(-self.n // self.size)


@pytest.mark.parametrize("batch_sampler", [[[0, 1, 2], [3, 4, 5], [6]], _Batches(7, 3),
                                           [[4, 1], [0], [6, 2, 5, 3]]],
                         ids=["list", "generator", "sizes-differ"])
def test_any_iterable_of_index_lists_is_a_batch_sampler(batch_sampler) -> None:
    data = IndexDataset(7)
    ours = ResumableLoader(data, batch_sampler=batch_sampler)
    assert _plain(ours) == _plain(DataLoader(data, batch_sampler=batch_sampler))
    check_resume_at_every_step(lambda: ResumableLoader(data, batch_sampler=batch_sampler), 2)


class _Raises(torch.utils.data.Dataset[int]):
    def __init__(self, error: Exception) -> None:
        self.error = error

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        if index == 2:
            raise self.error
        return index


@pytest.mark.parametrize("num_workers", [0, 1])
@pytest.mark.parametrize("error", [NotImplementedError("not yet"), KeyError("missing"),
                                   FileNotFoundError(2, "gone"), ValueError("bad")],
                         ids=lambda e: type(e).__name__)
def test_the_original_exception_type_is_caught_like_with_dataloader(error, num_workers) -> None:
    for make in (DataLoader, ResumableLoader):  # the same except clause works for both
        with pytest.raises(type(error)):
            list(make(_Raises(error), num_workers=num_workers))
    with pytest.raises(SampleFetchError) as caught:
        list(ResumableLoader(_Raises(error), num_workers=num_workers))
    raised = caught.value
    assert isinstance(raised, type(error)) and raised.index == 2 and raised.epoch == 0
    assert raised.worker == (0 if num_workers else None) and raised.rank == 0
    assert "sample index 2" in str(raised) and type(error).__name__ in str(raised)
    again = pickle.loads(pickle.dumps(raised))
    assert type(again) is type(raised) and again.index == 2 and str(again) == str(raised)


class CodedError(Exception):
    """An error with a field of its own (importable: combined with ``SampleFetchError``)."""

    def __init__(self, message: str, code: int) -> None:
        super().__init__(message)
        self.code = code


@pytest.mark.parametrize("num_workers", [0, 1])
def test_the_original_exceptions_fields_are_kept_like_with_dataloader(num_workers) -> None:
    """``e.errno == ENOENT`` and ``e.code`` read as on the original, from a worker too."""
    for error, fields in ((FileNotFoundError(2, "gone", "/data/x.jpg"),
                           {"errno": 2, "strerror": "gone", "filename": "/data/x.jpg"}),
                          (CodedError("refused", 42), {"code": 42})):
        with pytest.raises(type(error)) as caught:
            list(ResumableLoader(_Raises(error), num_workers=num_workers))
        raised = caught.value
        assert isinstance(raised, SampleFetchError) and raised.index == 2
        assert {name: getattr(raised, name) for name in fields} == fields
        again = pickle.loads(pickle.dumps(raised))
        assert {name: getattr(again, name) for name in fields} == fields
        assert str(again) == str(raised) and again.index == 2


class Located(Exception):
    """A parser's error whose fields share names with ``SampleFetchError``'s (as
    ``xml.etree.ElementTree.ParseError.position``), one a read-only property."""

    def __init__(self, message: str, position: tuple[int, int], record: int) -> None:
        super().__init__(message)
        self.position = position
        self._record = record

    @property
    def index(self) -> int:
        return self._record


@pytest.mark.parametrize("num_workers", [0, 1])
def test_the_original_exceptions_fields_win_over_ours_of_the_same_name(num_workers) -> None:
    """``except ParseError as e: e.position`` reads the parser's; ours stay in the message and
    in ``loader_fields``."""
    with pytest.raises(Located) as caught:
        list(ResumableLoader(_Raises(Located("bad tag", (1, 8), 1234)), num_workers=num_workers))
    raised = caught.value
    assert isinstance(raised, SampleFetchError)
    assert raised.position == (1, 8) and raised.index == 1234 and raised.epoch == 0
    assert raised.loader_fields["index"] == 2 and raised.loader_fields["position"] == 2
    assert "sample index 2" in str(raised)


def test_a_type_defined_in_a_function_is_caught_as_itself_where_nothing_is_pickled() -> None:
    """A class made in a function (botocore's ``NoSuchKey``) cannot be rebuilt in another
    process, but in this one (no workers, or threads) the error is one of it; from a worker
    process it arrives as a ``SampleFetchError`` with the cause's type name."""
    class NoSuchKey(KeyError):
        pass

    for options in ({}, {"num_workers": 2, "backend": "thread"}):
        with pytest.raises(NoSuchKey):
            list(ResumableLoader(_Raises(NoSuchKey("x")), **options))
    with pytest.raises(SampleFetchError) as caught:
        list(ResumableLoader(_Raises(NoSuchKey("x")), num_workers=1))
    assert caught.value.cause_type == "NoSuchKey" and caught.value.index == 2


def test_types_that_cannot_be_combined_stay_sample_fetch_errors() -> None:
    class Stop(StopIteration):  # would end the loop instead of failing it
        pass

    with pytest.raises(SampleFetchError) as caught:
        list(ResumableLoader(_Raises(Stop())))
    assert not isinstance(caught.value, StopIteration)
    assert isinstance(caught.value.__cause__, Stop)


def _batched(sampler: Any, batch_size: int, via: str) -> dict[str, Any]:
    """The loader arguments that batch ``sampler``: ``sampler=`` with ``batch_size``, or a
    torch ``BatchSampler`` around it (``batch_sampler=``)."""
    if via == "batch_sampler":
        return {"batch_sampler": BatchSampler(sampler, batch_size, drop_last=False)}
    return {"sampler": sampler, "batch_size": batch_size}


@pytest.mark.parametrize("via", ["sampler", "batch_sampler"])
@pytest.mark.parametrize("shuffle", [False, True])
def test_an_explicit_distributed_sampler_places_the_loader(shuffle: bool, via: str) -> None:
    data = IndexDataset(12)
    seen = []
    for rank in range(3):
        sampler = DistributedSampler(data, num_replicas=3, rank=rank, shuffle=shuffle)
        loader = ResumableLoader(data, **_batched(sampler, 2, via))
        assert repr(loader).count(f"rank={rank}/3") == 1 and len(loader) == 2
        seen += [i for batch in loader for i in batch["index"].tolist()]
    assert sorted(seen) == list(range(12))  # DataLoader with the same samplers reads 12 too
    with pytest.raises(ValueError, match="num_replicas=3"):
        ResumableLoader(data, sampler=DistributedSampler(data, num_replicas=3, rank=1),
                        rank=0, world_size=3)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_dataset_that_grows_between_epochs_is_read_whole(num_workers: int) -> None:
    def epochs(make) -> list[list[int]]:
        data = RangeDataset(4)
        loader = make(data, batch_size=2, num_workers=num_workers)
        out = []
        for n in (4, 8, 6):
            data.n = n
            out.append(sorted(i for batch in loader for i in batch.tolist()))
            assert len(loader) == n // 2
        return out

    assert epochs(ResumableLoader) == epochs(DataLoader) == [
        list(range(4)), list(range(8)), list(range(6))]


def test_in_memory_data_replaced_between_epochs_is_read_as_it_is_now() -> None:
    """In-memory data is gathered by vectorised indexing; a ``Subset``'s ``indices`` or a
    ``TensorDataset``'s tensors replaced between epochs are read anew, as ``DataLoader``
    reads them (the lengths stay the same)."""
    def epochs(make: Any) -> list[list[int]]:
        subset = Subset(torch.arange(100), [0, 1, 2, 3])
        table = TensorDataset(torch.arange(10))
        loaders = [make(subset, batch_size=2), make(table, batch_size=5)]

        def read() -> list[list[int]]:
            return [sorted(i for batch in loaders[0] for i in batch.tolist()),
                    sorted(i for (column,) in loaders[1] for i in column.tolist())]

        first = read()
        subset.indices, table.tensors = [40, 50, 60, 70], (torch.arange(10) * 10,)
        return first + read()

    assert epochs(ResumableLoader) == epochs(DataLoader)


@pytest.mark.parametrize("num_workers", [0, 2])
def test_data_changed_after_a_restored_epoch_end_is_followed_too(num_workers: int) -> None:
    """Resumed from a state saved at an epoch's end, the next epoch reads the data as changed
    before it (a grown dataset, new ``indices``), as the uninterrupted run does."""
    def make() -> tuple[Any, Any, list[ResumableLoader]]:
        data, subset = RangeDataset(4), SubsetRandomSampler([0, 1, 2])
        return data, subset, [
            ResumableLoader(data, batch_size=2, num_workers=num_workers, seed=1),
            ResumableLoader(RangeDataset(10), batch_size=2, sampler=subset, seed=1)]

    def next_epoch(data: Any, subset: Any, loaders: list[ResumableLoader]) -> list[list[int]]:
        data.n, subset.indices = 8, [5, 6, 7, 8]
        return [sorted(i for batch in loader for i in batch.tolist()) for loader in loaders]

    data, subset, loaders = make()
    for loader in loaders:
        list(loader)  # epoch 0, then the checkpoint
    states = [loader.state_dict() for loader in loaders]
    uninterrupted = next_epoch(data, subset, loaders)
    data, subset, resumed = make()
    for loader, state in zip(resumed, states, strict=True):
        loader.load_state_dict(state)
    assert next_epoch(data, subset, resumed) == uninterrupted == [list(range(8)), [5, 6, 7, 8]]


class _Growing(torch.utils.data.Sampler[int]):
    """A curriculum: each epoch reads the first ``k`` samples, ``k`` set between epochs."""

    def __init__(self) -> None:
        self.k = 3

    def __len__(self) -> int:
        return self.k

    def __iter__(self):
        return iter(range(self.k))


@pytest.mark.parametrize("via", ["sampler", "batch_sampler"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_sampler_changed_between_epochs_is_followed(num_workers: int, via: str) -> None:
    """New ``indices``, weights edited in place, a longer curriculum: read at every epoch, as
    ``DataLoader`` reads its sampler (also inside a ``BatchSampler``)."""
    def epochs(make) -> list[set[int]]:
        subset = SubsetRandomSampler([0, 1, 2])
        weights = torch.tensor([1.0] * 5 + [0.0] * 5, dtype=torch.float64)
        weighted = WeightedRandomSampler(weights, 6)
        growing = _Growing()
        loaders = [make(RangeDataset(10), num_workers=num_workers, **_batched(sampler, 2, via))
                   for sampler in (subset, weighted, growing)]
        out = [{i for batch in loader for i in batch.tolist()} for loader in loaders]
        subset.indices = [5, 6, 7, 8]
        weights[:] = torch.tensor([0.0] * 5 + [1.0] * 5)
        growing.k = 6
        out += [{i for batch in loader for i in batch.tolist()} for loader in loaders]
        assert len(loaders[2]) == 3
        return out

    for make in (DataLoader, ResumableLoader):
        before_subset, before_weighted, before_growing, *after = epochs(make)
        assert before_subset == {0, 1, 2} and before_weighted <= set(range(5))
        assert before_growing == {0, 1, 2}
        assert after[0] == {5, 6, 7, 8} and after[1] <= set(range(5, 10))
        assert after[2] == set(range(6))


def _edited_in_place(kind: str) -> tuple[Any, Callable[[], None]]:
    """A sampler over ``range(10)`` that reads samples below 5, and the edit in place (the
    same length) after which it reads those from 5."""
    if kind == "weights array":  # WeightedRandomSampler's tensor shares the user's array
        weights = np.array([1.0] * 5 + [0.0] * 5)
        return WeightedRandomSampler(weights, 6), lambda: weights.__setitem__(
            slice(None), weights[::-1].copy())
    values = {"list": [0, 1, 2, 3], "int32 array": np.arange(4, dtype=np.int32),
              "int64 array": np.arange(4), "tensor": torch.arange(4),
              "list sampler": [0, 1, 2, 3]}[kind]
    sampler = values if kind == "list sampler" else SubsetRandomSampler(values)
    edited = torch.arange(5, 9) if kind == "tensor" else [5, 6, 7, 8]
    return sampler, lambda: values.__setitem__(slice(None), edited)


@pytest.mark.parametrize("via", ["sampler", "batch_sampler"])
@pytest.mark.parametrize("kind", ["list", "int32 array", "int64 array", "tensor", "weights array",
                                  "list sampler"])
def test_a_sampler_edited_in_place_between_epochs_is_followed(kind: str, via: str) -> None:
    """Indices or weights edited in place under the same length (a curriculum) are read at
    the next epoch, as ``DataLoader`` reads them (a list or an int32 array was not: epoch 1
    read the old indices)."""
    for make in (DataLoader, ResumableLoader):
        sampler, edit = _edited_in_place(kind)
        loader = make(RangeDataset(10), **_batched(sampler, 2, via))
        before = {i for batch in loader for i in batch.tolist()}
        edit()
        after = {i for batch in loader for i in batch.tolist()}
        assert before <= set(range(5)) and after <= set(range(5, 10)), (make, before, after)


@pytest.mark.parametrize("change", ["reassigned", "edited in place"])
def test_a_state_saved_before_an_edit_in_place_resumes_as_one_before_new_indices(
        change: str) -> None:
    """Restored mid-epoch, the epoch keeps its order and the next follows the edit; restored
    at its end, the next epoch follows it: as for ``indices`` reassigned."""
    def make() -> tuple[SubsetRandomSampler, ResumableLoader]:
        sampler = SubsetRandomSampler([0, 1, 2, 3, 4, 5])
        return sampler, ResumableLoader(RangeDataset(10), batch_size=2, sampler=sampler, seed=1)

    def edit(sampler: SubsetRandomSampler) -> None:
        if change == "reassigned":
            sampler.indices = [4, 5, 6, 7, 8, 9]
        else:
            sampler.indices[:] = [4, 5, 6, 7, 8, 9]

    sampler, loader = make()
    iterator = iter(loader)
    next(iterator)
    middle = loader.state_dict()
    rest = [batch.tolist() for batch in iterator]
    end = loader.state_dict()
    sampler, resumed = make()
    resumed.load_state_dict(middle)
    edit(sampler)
    assert [batch.tolist() for batch in resumed] == rest
    assert {i for batch in resumed for i in batch.tolist()} == set(range(4, 10))
    sampler, resumed = make()
    resumed.load_state_dict(end)
    edit(sampler)
    assert {i for batch in resumed for i in batch.tolist()} == set(range(4, 10))


def _level(epoch: int) -> list[int]:
    return [4 * epoch + i for i in range(6)]


class _Curriculum:
    """A training loop whose curriculum edits its sampler's indices in place at each epoch
    (where Lightning calls ``loader.sampler.set_epoch``); a restarted run sets the restored
    epoch's level before it builds its loader and loads the state."""

    def __init__(self, array: bool) -> None:
        self.indices: Any = np.array(_level(0), dtype=np.int32) if array else _level(0)
        self.sampler = self
        self._build()

    def _build(self) -> None:
        self.loader = ResumableLoader(RangeDataset(20), batch_size=4, seed=2,
                                      sampler=SubsetRandomSampler(self.indices))

    def set_epoch(self, epoch: int) -> None:
        self.indices[:] = _level(epoch)
        self.loader.sampler.set_epoch(epoch)

    def __iter__(self) -> Any:
        return iter(self.loader)

    def state_dict(self) -> dict[str, Any]:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.indices[:] = _level(state["epoch"])
        self._build()
        self.loader.load_state_dict(state)


@pytest.mark.parametrize("array", [False, True], ids=["list", "int32 array"])
def test_a_curriculum_edited_in_place_resumes_exactly_at_every_step(array: bool) -> None:
    full = check_resume_at_every_step(lambda: _Curriculum(array), epochs=3,
                                      key=lambda batch: batch.tolist())
    assert [sorted(i for batch in epoch for i in batch) for epoch in full] == [
        _level(epoch) for epoch in range(3)]


def test_a_sampler_that_did_not_change_keeps_its_workers() -> None:
    """``RandomSampler(num_samples=...)`` draws fewer than the dataset's length: that is no
    change between epochs, and the workers persist."""
    loader = ResumableLoader(RangeDataset(10), batch_size=2, num_workers=1,
                             sampler=RandomSampler(RangeDataset(10), num_samples=4))
    pids = []
    for _ in range(3):
        assert sum(len(batch) for batch in loader) == 4
        pids.append([p.pid for p in loader_processes()])
    assert pids[0] == pids[1] == pids[2] and len(pids[0]) == 1
    loader.close()


class _Configurable(torch.utils.data.Dataset[int]):
    """torch's documented pattern: ``worker_init_fn`` configures the worker's dataset copy."""

    offset = 0

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> int:
        return index + self.offset


def _configure_worker(worker_id: int) -> None:
    info = get_worker_info()
    info.dataset.offset = 100 * (worker_id + 1)
    try:
        info.dataset = None
    except Exception as exc:  # the same type as torch's own (a frozen WorkerInfo)
        info.dataset.offset += {"FrozenInstanceError": 1000, "RuntimeError": 2000}.get(
            type(exc).__name__, 3000)


def test_get_worker_info_dataset_is_the_users_dataset_in_worker_init_fn() -> None:
    def run(make) -> list[int]:
        loader = make(_Configurable(), batch_size=1, num_workers=2,
                      worker_init_fn=_configure_worker)
        return sorted(int(batch) for batch in loader)

    assert run(ResumableLoader) == run(DataLoader)
    assert all(value >= 100 for value in run(ResumableLoader))


@pytest.mark.parametrize("batch_size", [3, None])
def test_the_collate_fn_attribute_is_dataloaders(batch_size: int | None) -> None:
    """``default_collate`` (``default_convert`` unbatched) when none is given, callable as
    code that reads ``loader.collate_fn`` calls it."""
    ours = ResumableLoader(IndexDataset(6), batch_size=batch_size)
    theirs = DataLoader(IndexDataset(6), batch_size=batch_size)
    assert ours.collate_fn is theirs.collate_fn
    assert to_plain(ours.collate_fn([{"index": 1}])) == to_plain(theirs.collate_fn([{"index": 1}]))


@pytest.mark.parametrize("iterable", [False, True], ids=["map-style", "iterable"])
def test_every_loader_has_dataloaders_batch_sampler_attribute(iterable: bool) -> None:
    """Code that reads ``loader.batch_sampler`` (Lightning does) finds it: ``None``, as
    ``DataLoader``'s unbatched loaders have, since the plan makes the batches."""
    data = SequenceSource([list(range(6))]) if iterable else IndexDataset(6)
    assert ResumableLoader(data, batch_size=2).batch_sampler is None


class NotedLoader(ResumableLoader):
    """A subclass of the loader, as code subclasses ``DataLoader`` (module level: pickled)."""

    def __init__(self, dataset: Any, note: str, **kwargs: Any) -> None:
        super().__init__(dataset, **kwargs)
        self.note = note

    def __len__(self) -> int:
        return super().__len__()


@pytest.mark.parametrize("iterable", [False, True], ids=["map-style", "iterable"])
def test_a_subclass_of_the_loader_works_as_a_subclass_of_dataloader_does(iterable: bool
                                                                         ) -> None:
    """``class MyLoader(ResumableLoader)`` is built on the loader the dataset needs: its own
    methods first; it pickles, copies and runs workers."""
    data = SequenceSource([list(range(6))]) if iterable else RangeDataset(6)
    loader = NotedLoader(data, "mine", batch_size=2, num_workers=2)
    assert isinstance(loader, NotedLoader) and type(loader).__name__ == "NotedLoader"
    assert loader.note == "mine" and len(loader) == 3
    for copied in (pickle.loads(pickle.dumps(loader)), copy.deepcopy(loader)):
        assert type(copied) is type(loader) and copied.note == "mine"
        assert sorted(i for batch in copied for i in batch.tolist()) == list(range(6))
    assert sorted(i for batch in loader for i in batch.tolist()) == list(range(6))


class _Plain(ResumableLoader):
    """A subclass without its own ``__init__``."""


def test_help_and_ides_see_dataloaders_parameters_then_ours() -> None:
    """``inspect.signature`` (``help()``, IDEs) shows ``__init__``'s parameters, not
    ``__new__``'s ``(dataset=None, *args, **kwargs)``; a subclass's own where it has them."""
    theirs = inspect.signature(DataLoader).parameters
    for loader in (ResumableLoader, MapStyleLoader, ResumableIterableLoader, _Plain):
        ours = inspect.signature(loader).parameters
        assert [ours[name].kind for name in theirs] == [p.kind for p in theirs.values()]
        assert list(ours)[:len(theirs)] == list(theirs) and "last_batch" in ours
    for noted in (NotedLoader, type(NotedLoader(IndexDataset(2), "mine"))):  # and as built
        assert list(inspect.signature(noted).parameters) == ["dataset", "note", "kwargs"]
    assert "ResumableLoader(dataset: 'Any', batch_size:" in pydoc.render_doc(
        ResumableLoader, renderer=pydoc.plaintext)


class _Tagged(torch.utils.data.Dataset[str]):
    """``worker_init_fn`` names the worker's copy from its id, as text."""

    tag = ""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> str:
        return self.tag


def _tag_worker(worker_id: int) -> None:
    get_worker_info().dataset.tag = f"shard-{worker_id}|{worker_id:02d}|%s" % worker_id


def test_worker_init_fn_formats_its_worker_id_as_dataloader_does() -> None:
    def run(make) -> set[str]:
        loader = make(_Tagged(), batch_size=None, num_workers=2, worker_init_fn=_tag_worker)
        return set(loader)

    assert run(ResumableLoader) == run(DataLoader) == {"shard-0|00|0", "shard-1|01|1"}


@pytest.mark.parametrize("name", ["batch_size", "sampler", "batch_sampler", "drop_last",
                                  "dataset", "persistent_workers"])
def test_fixed_attributes_cannot_be_set_after_construction(name: str) -> None:
    data = IndexDataset(4)
    for loader in (DataLoader(data, batch_size=2), ResumableLoader(data, batch_size=2)):
        with pytest.raises(ValueError, match=f"{name} attribute should not be set"):
            setattr(loader, name, 8)
    loader = ResumableLoader(data, batch_size=2)
    loader.num_workers = 0  # DataLoader allows the others
    assert loader.batch_size == 2


class _Stream(torch.utils.data.IterableDataset):
    def __iter__(self):
        return iter(range(4))


def _tagged(batch: list[int]) -> tuple[str, list[int]]:
    return "tagged", list(batch)


@pytest.mark.parametrize("make, num_workers", [(lambda: list(range(4)), 0),
                                               (lambda: list(range(4)), 2), (_Stream, 0)],
                         ids=["map-style", "map-style in workers", "iterable"])
def test_a_collate_fn_assigned_between_epochs_collates_the_next_one(make, num_workers) -> None:
    """As in DataLoader; persistent workers, which hold the old one, are restarted."""
    def run(loader_class) -> list[Any]:
        loader = loader_class(make(), batch_size=2, num_workers=num_workers)
        first = _plain(loader)
        loader.collate_fn = _tagged
        return [first, list(loader), list(loader)]

    assert run(ResumableLoader) == run(DataLoader)


def test_prefetch_factor_and_multiprocessing_context_read_as_in_dataloader() -> None:
    """prefetch_factor is DataLoader's default 2 with workers; a start method's name is kept
    as its context, also when assigned later, and the workers start with it."""
    for num_workers, prefetch_factor in ((0, None), (2, 2)):
        for make in (ResumableLoader, DataLoader):
            assert make(IndexDataset(4), num_workers=num_workers).prefetch_factor == (
                prefetch_factor)
    ours, theirs = (make(IndexDataset(4), batch_size=2, num_workers=1,
                         multiprocessing_context="spawn") for make in (ResumableLoader, DataLoader))
    spawn = multiprocessing.get_context("spawn")
    assert ours.multiprocessing_context is theirs.multiprocessing_context is spawn
    assert _plain(ours) == _plain(theirs)
    ours.multiprocessing_context = "fork"
    assert ours.multiprocessing_context is multiprocessing.get_context("fork")


def test_generic_alias_and_snapshot_every_n_steps() -> None:
    alias = ResumableLoader[int]
    assert alias.__origin__ is ResumableLoader and alias.__args__ == (int,)
    loader = ResumableLoader(IndexDataset(6), batch_size=2, snapshot_every_n_steps=3)
    assert loader.snapshot_every_n_steps == 3 and len(_plain(loader)) == 3
    with pytest.raises(ValueError, match="snapshot_every_n_steps"):
        ResumableLoader(IndexDataset(6), snapshot_every_n_steps=0)


class _Leveled(torch.utils.data.Dataset[int]):
    """A curriculum changed in place between epochs: ``level`` is added to every sample."""

    def __init__(self) -> None:
        self.level = 0

    def __len__(self) -> int:
        return 12

    def __getitem__(self, index: int) -> int:
        return index * 100 + self.level


@pytest.mark.parametrize("options", [{"num_workers": 2}, {"num_workers": "auto"},
                                     {"num_workers": 2, "backend": "auto"}],
                         ids=["2", "auto", "backend-auto"])
def test_workers_that_do_not_persist_see_a_dataset_changed_between_epochs(options) -> None:
    """As ``DataLoader``'s: each epoch forks them again (persistent ones, the default, keep
    the copy they started with, as ``DataLoader(persistent_workers=True)``'s do)."""
    dataset = _Leveled()
    loader = ResumableLoader(dataset, batch_size=4, persistent_workers=False, **options)
    levels = []
    for epoch in range(3):
        dataset.level = epoch
        levels.append({int(x) % 100 for batch in loader for x in batch})
    assert levels == [{0}, {1}, {2}]
    loader.close()


@pytest.mark.parametrize("backend", ["process", "thread"])
def test_a_loader_whose_workers_stopped_pickles_and_one_holding_them_says_why(backend: str
                                                                            ) -> None:
    """After an epoch with ``persistent_workers=False`` no worker is held: it pickles and
    copies as ``DataLoader`` does (the stopped pool's queues and the spent iterator failed).
    One holding workers is refused naming the fix (a ``TypeError`` about an
    ``AuthenticationString`` or a queue said nothing)."""
    loader = ResumableLoader(RangeDataset(8), batch_size=2, shuffle=True, seed=3,
                             num_workers=2, persistent_workers=False, backend=backend)
    spent = iter(loader)
    for _ in spent:
        pass
    reference = ResumableLoader(RangeDataset(8), batch_size=2, shuffle=True, seed=3)
    epochs = [[batch.tolist() for batch in reference] for _ in range(2)]
    for copied in (pickle.loads(pickle.dumps(loader)), copy.deepcopy(loader)):
        assert [batch.tolist() for batch in copied] == epochs[1]
        copied.close()
    held = ResumableLoader(RangeDataset(8), batch_size=2, num_workers=2, backend=backend)
    next(iter(held))
    with pytest.raises(TypeError, match="while it holds 2 workers: close.. it first"):
        pickle.dumps(held)
    held.close()
    assert pickle.loads(pickle.dumps(held)).state_dict() == held.state_dict()
    loader.close()
