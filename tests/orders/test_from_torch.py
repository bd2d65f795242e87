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
    SubsetRandomSampler,
    WeightedRandomSampler,
)

from lightning_loaders import ResumableLoader
from lightning_loaders.orders.base import SequentialOrder, ShuffledOrder
from lightning_loaders.orders.drawn import DrawnBatchOrder, DrawnOrder
from lightning_loaders.orders.from_torch import (
    bulk_key,
    order_from_sampler,
    sampler_contents,
    sampler_seed,
    sampler_signature,
    unbatched_sampler,
)
from lightning_loaders.orders.random import (
    RepeatedShuffleOrder,
    ReplacementOrder,
    SubsetOrder,
    WeightedOrder,
)
from lightning_loaders.testing import check_resume_at_every_step, run_epochs
from tests.conftest import IndexDataset

N = 23
DS = IndexDataset(N)
WEIGHTS = [0.0, 0.0, 1.0] + [float(i % 4) for i in range(3, N)]


def samplers() -> dict[str, torch.utils.data.Sampler]:
    return {
        "sequential": SequentialSampler(DS),
        "random": RandomSampler(DS),
        "random_replacement": RandomSampler(DS, replacement=True, num_samples=30),
        "random_num_samples": RandomSampler(DS, num_samples=40),
        "subset": SubsetRandomSampler(list(range(2, 21, 2))),
        "weighted": WeightedRandomSampler(WEIGHTS, 26),
        "weighted_no_replacement": WeightedRandomSampler(WEIGHTS, 12, replacement=False),
    }


KINDS = sorted(samplers())


def indices(batch) -> list[int]:
    return batch["index"].tolist()


def test_torch_samplers_map_to_their_counter_based_equivalents() -> None:
    expected = {
        "sequential": SequentialOrder, "random": ShuffledOrder,
        "random_replacement": ReplacementOrder, "random_num_samples": RepeatedShuffleOrder,
        "subset": SubsetOrder, "weighted": WeightedOrder, "weighted_no_replacement": WeightedOrder,
    }
    for kind, sampler in samplers().items():
        order = order_from_sampler(sampler, N, seed=0)
        assert type(order) is expected[kind], kind
        assert len(order) == len(sampler), kind


def test_subclasses_and_other_samplers_are_drawn_not_assumed() -> None:
    class Reversed(SequentialSampler):
        def __iter__(self):
            return iter(range(len(self.data_source) - 1, -1, -1))

    order = order_from_sampler(Reversed(DS), N, seed=0)
    assert isinstance(order, DrawnOrder)
    assert order.indices(0, np.arange(3)).tolist() == [22, 21, 20]
    assert isinstance(order_from_sampler([4, 2, 0], N, seed=0), DrawnOrder)
    with pytest.raises(TypeError, match="not iterable"):
        order_from_sampler(42, N, seed=0)


def test_a_distributed_sampler_is_replaced_by_the_global_order_it_shards() -> None:
    for shuffle, kind in ((True, ShuffledOrder), (False, SequentialOrder)):
        sampler = DistributedSampler(DS, num_replicas=2, rank=1, shuffle=shuffle)
        order = order_from_sampler(sampler, N, seed=0)
        assert type(order) is kind and len(order) == N


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_distributed_samplers_drop_last_drops_the_tail_past_equal_shares(
        shuffle: bool) -> None:
    """As ``DataLoader`` with ``DistributedSampler(drop_last=True)``: every rank reads
    ``n // num_replicas`` samples, in batches of the same sizes, and the tail is dropped."""
    data = IndexDataset(10)

    def read(make: Any) -> list[list[list[int]]]:
        return [[indices(b) for b in make(data, batch_size=2, sampler=DistributedSampler(
                    data, num_replicas=3, rank=rank, shuffle=shuffle, drop_last=True))]
                for rank in range(3)]

    ours, torch_ranks = read(ResumableLoader), read(DataLoader)
    assert [[len(b) for b in rank] for rank in ours] == [[len(b) for b in rank]
                                                        for rank in torch_ranks] == [[2, 1]] * 3
    seen = [i for rank in ours for b in rank for i in b]
    assert len(seen) == len(set(seen)) == 9


def batching(sampler: DistributedSampler, via: str) -> dict[str, Any]:
    """``sampler`` in batches of 4, as ``sampler=`` or in a ``BatchSampler``."""
    if via == "batch_sampler":
        return {"batch_sampler": BatchSampler(sampler, 4, drop_last=False)}
    return {"sampler": sampler, "batch_size": 4}


def ddp_loop(epochs: range, via: str = "sampler", state: dict[str, Any] | None = None,
             states: list[tuple[int, dict[str, Any]]] | None = None) -> list[list[int]]:
    """The plain-PyTorch DDP loop: each epoch is told to the user's own ``DistributedSampler``
    (``loader.sampler`` is another object). ``states`` collects, after every batch, the epoch a
    restart begins with (the next one after an epoch's last batch) and the loader's state."""
    sampler = DistributedSampler(DS, num_replicas=1, rank=0)
    loader = ResumableLoader(DS, seed=3, **batching(sampler, via))
    if state is not None:
        loader.load_state_dict(state)
    out = []
    for epoch in epochs:
        sampler.set_epoch(epoch)
        for batch in loader:
            out.append(indices(batch))
            if states is not None:
                states.append((epoch, loader.state_dict()))
        if states:
            states[-1] = (epoch + 1, states[-1][1])
    return out


@pytest.mark.parametrize("via", ["sampler", "batch_sampler"])
def test_set_epoch_on_the_users_own_distributed_sampler_chooses_the_epoch(via: str) -> None:
    """As with ``DataLoader``: a job restarted at epoch 3 reads epoch 3 (not epoch 0 again),
    and so does a loader built after the sampler's ``set_epoch``."""
    full = ddp_loop(range(4), via)
    epochs = [full[e * 6:(e + 1) * 6] for e in range(4)]
    assert len({str(epoch) for epoch in epochs}) == 4
    assert ddp_loop(range(3, 4), via) == epochs[3]
    rebuilt = []
    sampler = DistributedSampler(DS, num_replicas=1, rank=0)
    for epoch in range(4):
        sampler.set_epoch(epoch)
        rebuilt += [indices(b) for b in ResumableLoader(DS, seed=3, **batching(sampler, via))]
    assert rebuilt == full


def test_the_ddp_loop_resumes_exactly_from_every_step() -> None:
    """Restored, then told the saved epoch through the sampler: a mid-epoch state goes on (the
    restored cursor wins over the same epoch), one saved after its epoch starts the next; in a
    run started at epoch 0 and in one restarted at epoch 1, which reads the first's epochs."""
    full = ddp_loop(range(3))
    for start in (0, 1):
        states: list[tuple[int, dict[str, Any]]] = []
        run = ddp_loop(range(start, 3), states=states)
        assert run == full[start * 6:]
        for step, (epoch, state) in enumerate(states):
            assert ddp_loop(range(epoch, 3), state=state) == run[step + 1:], (start, step)


def test_a_users_sampler_left_alone_overrides_neither_lightning_nor_a_restored_cursor() -> None:
    """Lightning tells ``loader.sampler`` the epoch: the user's sampler, set once and then left
    alone, is not read again."""
    sampler = DistributedSampler(DS, num_replicas=1, rank=0)
    loader = ResumableLoader(DS, sampler=sampler, batch_size=4, seed=3)
    sampler.set_epoch(2)
    list(loader)
    assert loader.epoch == 2
    for epoch in (5, 6):
        loader.sampler.set_epoch(epoch)
        iterator = iter(loader)
        next(iterator)
        assert loader.epoch == epoch
    state = loader.state_dict()
    rest = [indices(b) for b in iterator]
    loader.load_state_dict(state)
    assert [indices(b) for b in loader] == rest and loader.epoch == 6


@pytest.mark.parametrize("kind", KINDS)
def test_every_kind_resumes_exactly_at_every_step(kind: str) -> None:
    def make() -> ResumableLoader:
        return ResumableLoader(DS, sampler=samplers()[kind], batch_size=4, seed=7)

    full = check_resume_at_every_step(make, epochs=2, key=indices)
    streams = [[i for b in e for i in b] for e in full]
    sampler = samplers()[kind]
    assert all(len(s) == len(sampler) for s in streams)
    if kind != "sequential":
        assert streams[0] != streams[1], "every epoch must draw anew"
    if kind in ("sequential", "random"):
        assert all(sorted(s) == list(range(N)) for s in streams)
    if kind == "subset":
        assert all(sorted(s) == sorted(sampler.indices) for s in streams)
    if kind == "random_num_samples":
        assert all(sorted(s[:N]) == list(range(N)) for s in streams)
    if kind.startswith("weighted"):
        assert not {0, 1} & {i for s in streams for i in s}, "zero weights are never drawn"
    if kind == "weighted_no_replacement":
        assert all(len(set(s)) == len(s) for s in streams)


@pytest.mark.parametrize("kind", KINDS)
def test_ranks_split_the_single_process_stream(kind: str) -> None:
    """Two ranks' shares of each global batch, side by side, are the single-process batches."""
    def stream(rank: int, world: int, batch_size: int) -> list[list[int]]:
        loader = ResumableLoader(DS, sampler=samplers()[kind], batch_size=batch_size, seed=3,
                                 rank=rank, world_size=world)
        return run_epochs(loader, range(2), key=indices)[1]

    single = [i for b in stream(0, 1, 3) for i in b]
    ranks = [stream(r, 2, 3) for r in range(2)]
    assert len(ranks[0]) == len(ranks[1])
    assert [i for pair in zip(*ranks, strict=True) for b in pair for i in b] == single


def test_batch_sampler_is_its_samplers_order_in_batches() -> None:
    batch_sampler = BatchSampler(RandomSampler(DS), batch_size=5, drop_last=True)
    sampler, batch_size, drop_last = unbatched_sampler(batch_sampler, seed=1)
    assert sampler is batch_sampler.sampler and (batch_size, drop_last) == (5, True)
    via_batches = ResumableLoader(DS, batch_sampler=batch_sampler, seed=1)
    via_sampler = ResumableLoader(DS, sampler=RandomSampler(DS), batch_size=5, drop_last=True,
                                  seed=1)
    assert run_epochs(via_batches, range(2), indices) == run_epochs(via_sampler, range(2), indices)


def test_other_batch_samplers_are_drawn_and_laid_end_to_end() -> None:
    class Pairs(torch.utils.data.Sampler[list[int]]):
        def __iter__(self):
            perm = torch.randperm(N).tolist()
            return iter([perm[i:i + 2] for i in range(0, N, 2)])

        def __len__(self) -> int:
            return (N + 1) // 2

    order, batch_size, drop_last = unbatched_sampler(Pairs(), seed=2)
    assert isinstance(order, DrawnBatchOrder)
    assert (batch_size, drop_last, len(order)) == (2, False, N)
    assert sorted(order.indices(0, np.arange(N)).tolist()) == list(range(N))


@pytest.mark.parametrize("sampler, key", [
    (SequentialSampler(DS), ""), ([3, 1], ""),
    (BatchSampler(SequentialSampler(DS), 2, False), "bulk"), ([[0, 1], [2, 3]], "bulk"),
    ([np.array([0, 1])], "bulk"), ([torch.tensor([0, 1])], "bulk"),
    ([(0, 1), (2, 3)], "tuple"),
], ids=["index sampler", "indices", "BatchSampler", "lists", "arrays", "tensors", "tuples"])
def test_bulk_key_tells_indices_lists_and_tuple_keys_apart(sampler: Any, key: str) -> None:
    """With batch_size=None, DataLoader passes each item to dataset[...]: a tuple as one key."""
    assert bulk_key(sampler) == key


def test_the_seed_of_a_sampler_is_what_orders_it_in_torch() -> None:
    generator = torch.Generator().manual_seed(5)
    assert sampler_seed(RandomSampler(DS, generator=generator)) == 5
    assert sampler_seed(DistributedSampler(DS, num_replicas=1, rank=0, seed=123)) == 123
    assert sampler_seed(BatchSampler(DistributedSampler(DS, num_replicas=1, rank=0, seed=7), 2,
                                     False)) == 7
    assert sampler_seed(RandomSampler(DS)) is None and sampler_seed([1, 2]) is None


@pytest.mark.parametrize("make", [list, lambda v: np.array(v, dtype=np.int32)],
                         ids=["list", "int32 array"])
def test_indices_edited_in_place_change_the_contents_not_the_signature(make) -> None:
    """The signature is read at every len(); the contents, O(n), at each epoch start."""
    indices = make([0, 1, 2, 3])
    sampler = SubsetRandomSampler(indices)
    signature, contents = sampler_signature(sampler), sampler_contents(sampler)
    indices[:] = [5, 6, 7, 8]
    assert sampler_signature(sampler) == signature and sampler_contents(sampler) != contents
    weights = np.ones(4)
    weighted = WeightedRandomSampler(weights, 2)
    contents = sampler_contents(weighted)
    weights[0] = 2.0  # the sampler's tensor shares the array
    assert sampler_contents(weighted) != contents
    assert sampler_contents(RandomSampler(DS)) is None


def test_indices_that_cannot_be_edited_are_not_read() -> None:
    """A ``range`` or a ``tuple`` cannot change in place: reading it at every epoch start only
    cost time (a ``range`` of 10^7: 1.5 s); a new one still changes the signature."""
    ranged = SubsetRandomSampler(range(10**7))
    assert sampler_contents(ranged) is None
    assert sampler_contents(SubsetRandomSampler((3, 1, 2))) is None
    signature = sampler_signature(ranged)
    ranged.indices = range(1, 10**7 + 1)
    assert sampler_signature(ranged) != signature
    assert sampler_contents(SubsetRandomSampler([3, 1, 2])) is not None
