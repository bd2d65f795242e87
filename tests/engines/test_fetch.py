"""The fast fetch paths give exactly what torch's DataLoader and default_collate give."""

import pickle
import random
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Dataset, StackDataset, Subset, TensorDataset

from lightning_loaders import ResumableLoader, SampleFetchError, sample_context
from lightning_loaders.engines.fetch import BatchFetcher
from lightning_loaders.schedule.requests import BatchRequest

N = 37


def _request(indices: list[int], epoch: int = 0, batch: int = 0) -> BatchRequest:
    idx = np.asarray(indices, dtype=np.int64)
    return BatchRequest(epoch, batch, 0, np.full_like(idx, epoch), idx * 10, idx)


def assert_same(got, expected) -> None:
    """Same container types, keys, dtypes, shapes and values."""
    assert type(got) is type(expected), (type(got), type(expected))
    if isinstance(expected, torch.Tensor):
        assert got.dtype == expected.dtype and got.shape == expected.shape
        assert torch.equal(got, expected)
    elif isinstance(expected, dict):
        assert got.keys() == expected.keys()
        for key in expected:
            assert_same(got[key], expected[key])
    elif isinstance(expected, list | tuple):
        assert len(got) == len(expected)
        for g, e in zip(got, expected, strict=True):
            assert_same(g, e)
    else:
        assert got == expected


def _arrays() -> dict[str, object]:
    rng = np.random.default_rng(0)
    base = rng.standard_normal((N, 6)).astype(np.float32)
    readonly = base.copy()
    readonly.flags.writeable = False
    return {
        "float32 2-D": base,
        "int64 1-D": np.arange(N) * 3,
        "float32 1-D (numpy scalars)": base[:, 0].copy(),
        "bool": base[:, 1] > 0,
        "float16 3-D": rng.standard_normal((N, 2, 3)).astype(np.float16),
        "uint8": rng.integers(0, 255, (N, 4), dtype=np.uint8),
        "strided view": base[:, ::2],
        "read-only": readonly,
        "tensor": torch.from_numpy(base) * 2,
        "int tensor 1-D": torch.arange(N) * 7,
        "TensorDataset": TensorDataset(torch.from_numpy(base), torch.arange(N),
                                       torch.zeros(N, 2, 2, dtype=torch.bool)),
        "StackDataset dict": StackDataset(x=base, y=torch.arange(N),
                                          t=TensorDataset(torch.arange(N) * 2)),
        "StackDataset tuple": StackDataset(base, np.arange(N)),
        "Subset": Subset(TensorDataset(torch.from_numpy(base), torch.arange(N)),
                         [5, 3, 30, 0, 9, 12, 36, 1, 2, 4]),
        "Subset of Subset": Subset(Subset(base, list(range(N - 1, -1, -1))), list(range(20))),
    }


@pytest.mark.parametrize("name", list(_arrays()))
def test_gather_equals_default_collate(name: str) -> None:
    dataset = _arrays()[name]
    fetcher = BatchFetcher(dataset, None, seed=0)
    assert fetcher.in_memory, f"{name} should take the gather path"
    for indices in ([0], [3, 1, 4, 1, 5], list(range(len(dataset)))[::-1]):
        expected = torch.utils.data.default_collate([dataset[i] for i in indices])
        assert_same(fetcher[_request(indices)], expected)


def _no_op(worker_id: int) -> None:
    """A worker_init_fn: asks for real worker processes even for in-memory data."""


@pytest.mark.parametrize("worker_init_fn", [None, _no_op], ids=["in process", "in workers"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_loader_batches_equal_dataloader_batches(num_workers: int, worker_init_fn) -> None:
    """End to end: gathered in the main process (in blocks), and in workers (straight into
    shared memory)."""
    for name in ("TensorDataset", "StackDataset dict", "float32 1-D (numpy scalars)", "Subset"):
        dataset = _arrays()[name]
        ours = list(ResumableLoader(dataset, batch_size=4, num_workers=num_workers,
                                    worker_init_fn=worker_init_fn))
        theirs = list(DataLoader(dataset, batch_size=4, num_workers=num_workers))
        assert len(ours) == len(theirs)
        for got, expected in zip(ours, theirs, strict=True):
            assert_same(got, expected)


def _requests(sizes: list[int], seed: int = 0) -> list[BatchRequest]:
    order = np.random.default_rng(seed).permutation(sum(sizes))
    bounds = np.cumsum([0, *sizes])
    return [_request(order[a:b].tolist(), batch=k)
            for k, (a, b) in enumerate(zip(bounds[:-1], bounds[1:], strict=True))]


@pytest.mark.parametrize("name", ["TensorDataset", "StackDataset dict", "tensor"])
def test_gathered_blocks_equal_batch_by_batch_gathers(name: str) -> None:
    dataset = _arrays()[name]
    fetcher = BatchFetcher(dataset, None, seed=0)
    requests = _requests([5, 5, 5, 5, 5, 5, 4, 3])  # a short tail, as plans end
    got = list(fetcher.gathered(iter(requests)))
    assert len(got) == len(requests)
    for batch, request in zip(got, requests, strict=True):
        assert_same(batch, fetcher[request])
    assert list(fetcher.gathered(iter([]))) == []


def test_a_gathered_batch_keeps_at_most_its_block_alive(monkeypatch) -> None:
    """Blocks hold about _GATHER_BLOCK_BYTES of batches: a batch lies in one block."""
    rows = torch.arange(64 * 16, dtype=torch.float32).reshape(64, 16)  # 64 bytes a row
    monkeypatch.setattr("lightning_loaders.engines.fetch._GATHER_BLOCK_BYTES", 4 * 64 * 4)
    fetcher = BatchFetcher(rows, None, seed=0)
    batches = list(fetcher.gathered(iter(_requests([4] * 16))))
    starts = [b.data_ptr() for b in batches]
    following = [i for i in range(15) if starts[i + 1] == starts[i] + 256]
    assert following == [i for i in range(15) if i % 4 != 3], (
        "16 batches of 256 bytes, one after the other in blocks of 1 KiB")
    assert all(b.untyped_storage().nbytes() == 256 for b in batches), "each its own part"
    assert all(b.is_contiguous() for b in batches)


def test_gathered_batches_of_one_block_are_independent_tensors() -> None:
    """Each batch of a block is a tensor of its own, as torch's are: an in-place op on one
    leaves the others' autograd version counters alone, and one may take an operand that
    requires grad (``split``'s views of one block shared a counter, and refused that)."""
    fetcher = BatchFetcher(torch.arange(64.0).reshape(16, 4), None, seed=0)
    first, second, *_ = fetcher.gathered(iter(_requests([4] * 4)))
    assert second.data_ptr() == first.data_ptr() + first.nbytes, "one block, no copy"
    assert not first._is_view() and first._base is None
    version = first._version
    second.sub_(1.0)
    assert first._version == version
    weight = torch.tensor(2.0, requires_grad=True)
    second.mul_(weight)
    assert second.requires_grad and not first.requires_grad


def test_a_gathered_batch_cannot_grow_into_the_next_one() -> None:
    """``resize_`` of a batch over the whole block's storage fit in that storage, so the batch
    took over the next batch's rows, and writing it changed that batch in silence. A batch's
    storage is its own part of the block: it cannot be resized, as a worker's batch in shared
    memory cannot."""
    fetcher = BatchFetcher(torch.arange(16.0).reshape(8, 2), None, seed=0)
    first, second, *_ = fetcher.gathered(iter(_requests([2] * 4)))
    before = second.clone()
    with pytest.raises(RuntimeError, match="not resizable"):
        first.resize_(4, 2)
    assert torch.equal(second, before)


def test_in_place_normalising_with_gradient_accumulation_works_as_with_dataloader() -> None:
    """A user's loop: ``x.sub_(mean)`` on each batch, one backward every 4 batches. On
    batches that were views of one block, each ``sub_`` moved the version of the batches
    before it, and the backward failed (``modified by an inplace operation``)."""
    data = TensorDataset(torch.randn(256, 8))
    layer = torch.nn.Linear(8, 1)

    def train(loader: Any) -> torch.Tensor:
        layer.zero_grad()
        loss: Any = 0
        for i, (x,) in enumerate(loader):
            x.sub_(0.5)
            loss = loss + layer(x).sum()
            if i % 4 == 3:
                loss.backward()
                loss = 0
        assert layer.weight.grad is not None
        return layer.weight.grad.clone()

    expected = train(DataLoader(data, batch_size=16))
    assert torch.allclose(train(ResumableLoader(data, batch_size=16)), expected)


class _Scaled(TensorDataset):
    """A subclass with its own __getitem__ (a transform) must not be gathered."""

    def __getitem__(self, index: int):
        return tuple(t * 2 for t in super().__getitem__(index))


class _NotAnArray:
    def __init__(self) -> None:
        self.data = list(range(N))

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> int:
        return self.data[index]


@pytest.mark.parametrize("dataset, collate_fn", [
    (np.array([str(i) for i in range(N)]), None),
    (np.array([{"a": i} for i in range(N)], dtype=object), None),
    (torch.zeros(N, 3, requires_grad=True), None),
    (torch.nn.Parameter(torch.zeros(N, 3)), None),
    (_Scaled(torch.arange(N)), None),
    (_NotAnArray(), None),
    (StackDataset(torch.arange(N), _NotAnArray()), None),
    (TensorDataset(torch.arange(N)), lambda batch: batch),
], ids=["str array", "object array", "requires grad", "Parameter", "subclass", "plain object",
        "stack with a plain object", "custom collate_fn"])
def test_no_gather_where_it_could_differ(dataset, collate_fn) -> None:
    fetcher = BatchFetcher(dataset, collate_fn, seed=0)
    assert not fetcher.in_memory
    if collate_fn is None and not isinstance(dataset, torch.Tensor):
        batch = fetcher[_request([2, 0, 1])]
        assert_same(batch, torch.utils.data.default_collate([dataset[i] for i in (2, 0, 1)]))


@pytest.mark.parametrize("data", [torch.arange(10), TensorDataset(torch.arange(10))],
                         ids=["tensor", "TensorDataset"])
def test_a_samplers_index_outside_in_memory_data_is_fetched_as_dataloader_does(data) -> None:
    """The gather takes indices in ``[0, len)``; others go sample by sample: a negative one
    counts from the end (as ``DataLoader``'s ``dataset[i]`` does), a too large one is a
    ``SampleFetchError`` naming it (also an ``IndexError``), which ``on_error="skip"`` skips."""

    def first(batch):
        return (batch[0] if isinstance(batch, list) else batch).tolist()

    expected = [first(b) for b in DataLoader(data, batch_size=2, sampler=[-1, 2, 3, 4])]
    got = [first(b) for b in ResumableLoader(data, batch_size=2, sampler=[-1, 2, 3, 4])]
    assert got == expected == [[9, 2], [3, 4]]
    with pytest.raises(SampleFetchError, match="sample index 30") as caught:
        list(ResumableLoader(data, batch_size=2, sampler=[1, 30]))
    assert isinstance(caught.value, IndexError)
    skipping = ResumableLoader(data, batch_size=3, sampler=[1, 30, 2], on_error="skip")
    assert [first(b) for b in skipping] == [[1, 2]]
    assert [sample.index for sample in skipping.skipped] == [30]


def test_explicit_default_collate_still_gathers() -> None:
    dataset = TensorDataset(torch.arange(N))
    assert BatchFetcher(dataset, torch.utils.data.default_collate, seed=0).in_memory


def test_gathering_fetcher_pickles_for_spawned_workers() -> None:
    dataset = _arrays()["Subset"]
    fetcher = pickle.loads(pickle.dumps(BatchFetcher(dataset, None, seed=0)))
    assert fetcher.in_memory
    assert_same(fetcher[_request([1, 2])],
                torch.utils.data.default_collate([dataset[1], dataset[2]]))


def test_gather_leaves_the_callers_global_rngs_alone() -> None:
    """No user code runs on the gather path, so nothing is seeded (the main process's
    random state is untouched at num_workers=0)."""
    fetcher = BatchFetcher(TensorDataset(torch.arange(N)), None, seed=0)
    torch.manual_seed(123)
    random.seed(123)
    expected = (torch.rand(1), random.random())
    torch.manual_seed(123)
    random.seed(123)
    fetcher[_request([1, 2, 3])]
    assert (torch.rand(1), random.random()) == expected


class _Batched(Dataset[int]):
    """Has its own __getitems__: called once per batch."""

    def __init__(self) -> None:
        self.calls: list[list[int]] = []

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> int:
        raise AssertionError("__getitems__ should have been used")

    def __getitems__(self, indices: list[int]) -> list[int]:
        self.calls.append(indices)
        return [i * 2 for i in indices]


def test_getitems_fetches_a_batch_in_one_call() -> None:
    dataset = _Batched()
    fetcher = BatchFetcher(dataset, None, seed=0)
    assert not fetcher.in_memory
    assert_same(fetcher[_request([4, 2])], torch.tensor([8, 4]))
    assert dataset.calls == [[4, 2]]
    assert_same(BatchFetcher(Subset(dataset, [3, 5, 7]), None, seed=0)[_request([2, 0])],
                torch.tensor([14, 6]))
    assert dataset.calls[-1] == [7, 3]


class _ContextAware(Dataset[torch.Tensor]):
    """Uses the per-sample context, which only exists on the per-sample path."""

    def __len__(self) -> int:
        return N

    def __getitem__(self, index: int) -> torch.Tensor:
        ctx = sample_context()
        return torch.tensor([index, ctx.index, ctx.position, ctx.epoch])


def test_forwarding_getitems_keeps_the_per_sample_context() -> None:
    """torch's Subset and StackDataset forward __getitems__ to per-sample datasets: those go
    sample by sample, so sample_context() still works inside __getitem__."""
    subset = Subset(_ContextAware(), list(range(N - 1, -1, -1)))
    batch = BatchFetcher(subset, None, seed=0)[_request([0, 5], epoch=2)]
    # (underlying index, the loader's dataset index, epoch position, epoch)
    assert batch.tolist() == [[N - 1, 0, 0, 2], [N - 6, 5, 50, 2]]
    stacked = StackDataset(a=_ContextAware())
    batch = BatchFetcher(stacked, None, seed=0)[_request([3])]
    assert batch["a"].tolist() == [[3, 3, 30, 0]]


class _ContextAwareFailing(_ContextAware):
    """Fails on indices divisible by 3; every other sample reports its context."""

    def __getitem__(self, index: int) -> torch.Tensor:
        if index % 3 == 0:
            raise ValueError(f"bad {index}")
        return super().__getitem__(index)


def test_the_sample_context_names_every_sample_also_after_skipped_ones() -> None:
    """The context counts the samples fetched and skipped so far: after each left-out sample
    the next one still sees its own index and position."""
    fetcher = BatchFetcher(_ContextAwareFailing(), None, seed=0, on_error="skip")
    indices = [3, 4, 6, 9, 5, 0, 7, 12]
    result = fetcher[_request(indices, epoch=1)]
    kept = [i for i in indices if i % 3]
    assert result.batch.tolist() == [[i, i, 10 * i, 1] for i in kept]
    assert [s.index for s in result.skipped] == [3, 6, 9, 0, 12]
    assert [s.position for s in result.skipped] == [30, 60, 90, 0, 120]
    with pytest.raises(RuntimeError, match="only available while"):
        sample_context()  # nothing is published once the fetch is over


def test_loader_over_subset_matches_dataloader() -> None:
    subset = Subset(_ContextAware(), [4, 8, 15, 16, 23, 35])
    ours = [b[:, 0].tolist() for b in ResumableLoader(subset, batch_size=4)]
    theirs = [b.tolist() for b in DataLoader(Subset(list(range(N)), subset.indices),
                                             batch_size=4)]
    assert ours == theirs


class _TaggedSubset(Subset[int]):
    """Overrides ``__getitems__``: a batch-level read that ``DataLoader`` calls."""

    def __getitems__(self, indices: list[int]) -> list[Any]:
        return [("batched", self.dataset[self.indices[i]]) for i in indices]


class _TaggedStack(StackDataset):
    def __getitems__(self, indices: list[int]) -> list[Any]:
        return [("batched", *(d[i] for d in self.datasets)) for i in indices]


@pytest.mark.parametrize("dataset", [_TaggedSubset(list(range(10, 15)), [4, 3, 2, 1]),
                                     _TaggedStack(list(range(5)), list(range(10, 15)))],
                         ids=["Subset", "StackDataset"])
def test_a_subclass_getitems_is_called_as_dataloader_calls_it(dataset: Any) -> None:
    ours = list(ResumableLoader(dataset, batch_size=2, collate_fn=list))
    assert ours == list(DataLoader(dataset, batch_size=2, collate_fn=list))
    assert all(sample[0] == "batched" for batch in ours for sample in batch)


class _TaggedItems(StackDataset):
    """Overrides only ``__getitem__``: ``DataLoader``'s batched fetch goes through
    ``StackDataset.__getitems__`` to the parts and never calls it."""

    def __getitem__(self, index: int) -> Any:
        return ("item", *super().__getitem__(index))


@pytest.mark.parametrize("batch_size", [2, None])
def test_a_stack_subclass_getitem_is_used_where_dataloader_uses_it(batch_size: int | None
                                                                   ) -> None:
    stacked = _TaggedItems(list(range(5)), list(range(10, 15)))
    for dataset in (stacked, Subset(stacked, [4, 0, 2])):
        ours = list(ResumableLoader(dataset, batch_size=batch_size, collate_fn=list))
        assert ours == list(DataLoader(dataset, batch_size=batch_size, collate_fn=list))
    fetcher = pickle.loads(pickle.dumps(BatchFetcher(stacked, list, seed=0)))  # spawned workers
    assert fetcher[_request([3, 1])] == [(3, 13), (1, 11)]
