import os
import random
import warnings
from collections.abc import Iterator

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, Sampler

from lightning_loaders import ResumableLoader, make_resumable
from lightning_loaders.orders import drawn
from lightning_loaders.orders.drawn import DrawnBatchOrder, DrawnOrder
from lightning_loaders.testing import check_resume_at_every_step, run_epochs
from tests.buckets import GrowingCurriculum, curriculum_epochs
from tests.conftest import EpochSampler, IndexDataset

N = 21


def indices(batch) -> list[int]:
    return batch["index"].tolist()


class GlobalRngSampler(Sampler[int]):
    """Shuffles with torch's and numpy's global RNGs, as much user code does."""

    def __len__(self) -> int:
        return N

    def __iter__(self):
        perm = torch.randperm(N)
        return iter(perm[np.random.permutation(N)].tolist())


class GeneratorSampler(Sampler[int]):
    def __init__(self) -> None:
        self.generator = torch.Generator().manual_seed(123)  # advances every draw

    def __len__(self) -> int:
        return N

    def __iter__(self):
        return iter(torch.randperm(N, generator=self.generator).tolist())


class Curriculum(Sampler[int]):
    """Stateful: each draw shows more of the dataset; the state is how many draws were made."""

    def __init__(self) -> None:
        self.stage = 0
        self.rng = np.random.default_rng(0)

    def __len__(self) -> int:
        return N

    def __iter__(self):
        self.stage += 1
        visible = min(N, 5 + 4 * self.stage)
        order = np.resize(self.rng.permutation(visible), N).tolist()
        return iter(order)

    def state_dict(self) -> dict:
        return {"stage": self.stage, "rng": self.rng.bit_generator.state}

    def load_state_dict(self, state: dict) -> None:
        self.stage = state["stage"]
        self.rng.bit_generator.state = state["rng"]


class Unseeded(Sampler[int]):
    def __len__(self) -> int:
        return N

    def __iter__(self):
        return iter(np.random.default_rng(int.from_bytes(os.urandom(4))).permutation(N).tolist())


@pytest.mark.parametrize("sampler", [GlobalRngSampler, GeneratorSampler, Curriculum])
def test_drawn_samplers_resume_exactly_at_every_step(sampler) -> None:
    def make() -> ResumableLoader:
        return ResumableLoader(IndexDataset(N), sampler=sampler(), batch_size=4, seed=5)

    with warnings.catch_warnings():
        warnings.simplefilter("error")
        full = check_resume_at_every_step(make, epochs=3, key=indices)
    streams = [[i for b in e for i in b] for e in full]
    assert streams[0] != streams[1] != streams[2]
    if sampler is Curriculum:
        assert max(streams[0]) < max(streams[2]), "the sampler's own state must evolve"


def test_every_rank_draws_the_same_epoch_and_takes_its_share() -> None:
    def run(rank: int, world: int) -> list[list[int]]:
        loader = ResumableLoader(IndexDataset(N), sampler=GlobalRngSampler(), batch_size=2,
                                 seed=4, rank=rank, world_size=world)
        return run_epochs(loader, range(2), key=indices)[1]

    single = [i for b in run(0, 1) for i in b]
    ranks = [run(r, 3) for r in range(3)]
    assert [i for group in zip(*ranks, strict=True) for b in group for i in b] == single
    assert sorted(single) == list(range(N))


def test_drawing_leaves_global_rngs_and_the_samplers_generator_alone() -> None:
    sampler = GeneratorSampler()
    generator = sampler.generator
    states = random.getstate(), np.random.get_state()[1].copy(), torch.random.get_rng_state()
    order = DrawnOrder(sampler, seed=1)
    first = order.indices(0, np.arange(N))
    assert sampler.generator is generator
    assert random.getstate() == states[0]
    assert (np.random.get_state()[1] == states[1]).all()
    assert torch.equal(torch.random.get_rng_state(), states[2])
    for seed, same in ((1, True), (2, False)):
        again = DrawnOrder(GeneratorSampler(), seed=seed).indices(0, np.arange(N))
        assert (again.tolist() == first.tolist()) is same


class Rolled(EpochSampler):
    """Each epoch rolls the indices by the epoch."""

    def __iter__(self):
        return iter(np.roll(np.arange(N), self.epoch).tolist())


def test_set_epoch_is_called_before_each_draw() -> None:
    order = DrawnOrder(Rolled(N), seed=0)
    assert order.indices(3, np.arange(2)).tolist() == [18, 19]


class SelfAdvancing(Sampler[int]):
    """No ``set_epoch``: each draw seeds from its own ``epoch`` and moves it on."""

    def __init__(self) -> None:
        self.epoch = 0

    def __len__(self) -> int:
        return N

    def __iter__(self):
        generator = torch.Generator().manual_seed(self.epoch)
        self.epoch += 1
        return iter(torch.randperm(N, generator=generator).tolist())


def test_a_sampler_advancing_its_own_epoch_keeps_what_its_draws_did() -> None:
    """Putting its ``epoch`` back after each draw gave every epoch the first one's order."""
    loader = ResumableLoader(IndexDataset(N), sampler=SelfAdvancing(), batch_size=N)
    with pytest.warns(UserWarning, match="not deterministic"):
        orders = {tuple(indices(next(iter(loader)))) for _ in range(3)}
    assert len(orders) == 3


def test_the_users_set_epoch_on_a_drawn_sampler_is_followed_and_the_draws_own_is_not() -> None:
    """The user's ``sampler.set_epoch(2)`` reads epoch 2, as ``DataLoader`` does; the draws'
    own ``set_epoch`` leaves the sampler's ``epoch`` as the user set it, so it is not taken
    for the user's (which would abandon a cursor restored afterwards)."""
    def restarted_at_2(make) -> list[list[int]]:
        sampler = Rolled(N)
        loader = make(IndexDataset(N), sampler=sampler, batch_size=4)
        out = []
        for epoch in (2, 3):
            sampler.set_epoch(epoch)
            out.append([i for b in loader for i in indices(b)])
        return out

    assert restarted_at_2(ResumableLoader) == restarted_at_2(DataLoader)
    sampler = Rolled(N)
    sampler.set_epoch(1)
    loader = ResumableLoader(IndexDataset(N), sampler=sampler, batch_size=4)
    iterator = iter(loader)
    next(iterator)
    state, rest = loader.state_dict(), [indices(b) for b in iterator]
    for _ in range(2):  # epochs 2 and 3, drawn
        list(loader)
    assert loader.epoch == 3 and sampler.epoch == 1
    loader.load_state_dict(state)
    assert [indices(b) for b in loader] == rest and loader.epoch == 1


@pytest.mark.parametrize("sampler", [iter(range(10)), (i for i in range(10))],
                         ids=["range_iterator", "generator"])
def test_an_iterator_as_sampler_is_refused_as_read_once(sampler) -> None:
    """Drawn twice to check it, it came out empty: "its sampler yields no index"."""
    loader = DataLoader(list(range(10)), batch_size=2, sampler=sampler)
    with pytest.raises(TypeError, match="is an iterator .* yields its indices once"):
        make_resumable(loader)


class _FailsInEpoch1(EpochSampler):
    """A sampler whose ``__iter__`` raises halfway through epoch 1."""

    def __iter__(self) -> Iterator[int]:
        for i in range(N):
            if self.epoch == 1 and i == N // 2:
                raise KeyError("the sampler's own error")
            yield i


class _Short(Sampler[int]):
    """A sampler that yields one index fewer than its ``len()``."""

    def __len__(self) -> int:
        return N

    def __iter__(self) -> Iterator[int]:
        return iter(range(N - 1))


def test_a_sampler_that_raises_is_named_with_the_epoch_and_keeps_its_error() -> None:
    """The loader iterates the sampler far from the user's code: the error came bare, with no
    epoch and no word of the draw. It keeps its type and traceback, and says both."""
    loader = ResumableLoader(IndexDataset(N), sampler=_FailsInEpoch1(N), batch_size=4)
    assert len(list(loader)) == len(loader)  # epoch 0
    with pytest.raises(KeyError, match="the sampler's own error") as caught:
        list(loader)
    assert caught.value.__notes__ == [
        "(raised while the loader drew the indices of epoch 1 from the sampler _FailsInEpoch1, "
        "seeded by (seed, epoch))"]
    assert caught.traceback[-1].name == "__iter__"
    short = ResumableLoader(IndexDataset(N), sampler=_Short(), batch_size=4)
    with pytest.raises(ValueError, match="yielded only") as refused:  # names the draw already
        list(short)
    assert not hasattr(refused.value, "__notes__")


def test_a_state_saved_after_the_sampler_raised_loses_nothing(
        caplog: pytest.LogCaptureFixture) -> None:
    """``state_dict()`` (a checkpoint written as the error leaves the loop) raised the
    sampler's error again, from the audit digest, which draws the epoch's order: the state is
    saved unaudited, and a resume from it reads the whole of epoch 1 once the sampler works."""
    loader = ResumableLoader(IndexDataset(N), sampler=_FailsInEpoch1(N), batch_size=4)
    list(loader)
    with pytest.raises(KeyError):
        list(loader)
    state = loader.state_dict()
    assert (state["epoch"], state["batches"]) == (1, 0) and "audit" not in state["parts"]
    assert "saved without its audit digest" in caplog.text
    again = ResumableLoader(IndexDataset(N), sampler=_FailsInEpoch1(N), batch_size=4)
    again.load_state_dict(state)
    with pytest.raises(KeyError, match="the sampler's own error"):
        list(again)
    fixed = _FailsInEpoch1(N)
    fixed.set_epoch = lambda epoch: None  # stays at epoch 0: draws in full
    working = ResumableLoader(IndexDataset(N), sampler=fixed, batch_size=4)
    working.load_state_dict(state)
    assert sum(len(batch["index"]) for batch in working) == N


def test_a_non_deterministic_sampler_gets_a_clear_warning() -> None:
    """It names the resume it breaks, and no more: a generator of the sampler's own, seeded
    alike on every rank, draws one order on every rank (``tests/loaders/test_map_style.py``
    reads it under DDP)."""
    loader = ResumableLoader(IndexDataset(N), sampler=Unseeded(), batch_size=4)
    with pytest.warns(UserWarning, match="not deterministic given the seed") as caught:
        next(iter(loader))
    message = str(caught[0].message)
    assert "no resume can reproduce an interrupted epoch" in message
    assert "Ranks will draw different orders" not in message
    assert "only if that randomness is seeded alike on every rank" in message


def test_samplers_without_len_are_drawn_once_to_learn_it() -> None:
    class Odd:
        def __iter__(self):
            return iter(range(1, N, 2))

    loader = ResumableLoader(IndexDataset(N), sampler=Odd(), batch_size=4)
    assert len(loader) == 3
    assert [i for b in loader for i in indices(b)] == list(range(1, N, 2))


def test_a_sampler_without_len_whose_epochs_differ_in_length_is_refused() -> None:
    """Without ``len()`` the plan is fixed from the first epoch's draw; a later epoch of
    another length (a curriculum growing with ``set_epoch``) is refused, not cut to it."""
    class Growing:
        epoch = 0

        def set_epoch(self, epoch: int) -> None:
            self.epoch = epoch

        def __iter__(self):
            return iter(range(4 * (self.epoch + 1)))

    loader = ResumableLoader(IndexDataset(N), sampler=Growing(), batch_size=2)
    assert [i for b in loader for i in indices(b)] == [0, 1, 2, 3]
    with pytest.raises(ValueError, match="no len\\(\\) and yielded 8 indices in epoch 1, 4 in "
                                         "the first.*__len__"):
        list(loader)


def test_a_len_that_follows_set_epoch_gives_each_epoch_its_length_and_resumes_exactly() -> None:
    """Each epoch reads the sampler's ``len()`` after the draw's ``set_epoch(e)``, as
    ``DataLoader`` reads it after the user's; it read the length the loader was built with in
    every epoch (10/10/10 when the loader's epoch is set, as Lightning sets it)."""
    def make() -> ResumableLoader:
        return make_resumable(DataLoader(IndexDataset(N), batch_size=4,
                                         sampler=GrowingCurriculum()))

    full = check_resume_at_every_step(make, epochs=3, key=indices)
    assert [sorted(i for b in epoch for i in b) for epoch in full] == curriculum_epochs(3)
    assert [len(epoch) for epoch in full] == [3, 4, 5]


def test_every_rank_plans_a_growing_epoch_alike_and_reads_its_share() -> None:
    def run(rank: int) -> list[list[list[int]]]:
        loader = ResumableLoader(IndexDataset(N), sampler=GrowingCurriculum(), batch_size=2,
                                 seed=3, rank=rank, world_size=2)
        return run_epochs(loader, range(3), key=indices)

    ranks = [run(rank) for rank in range(2)]
    assert [len(epoch) for epoch in ranks[0]] == [len(epoch) for epoch in ranks[1]] == [3, 4, 5]
    read = [sorted(i for rank in ranks for b in rank[epoch] for i in b) for epoch in range(3)]
    assert read == curriculum_epochs(3)


class _RandomSubset(Sampler[int]):
    """Each epoch a random half of the dataset, chosen with numpy's global RNG in
    ``set_epoch``."""

    def __init__(self) -> None:
        self.epoch, self.subset = 0, list(range(N // 2))

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch
        self.subset = np.random.choice(N, N // 2, replace=False).tolist()

    def __len__(self) -> int:
        return len(self.subset)

    def __iter__(self) -> Iterator[int]:
        return iter(self.subset)


def test_an_epochs_length_leaves_the_callers_rngs_as_they_were() -> None:
    """``len()`` calls the sampler's ``set_epoch`` to learn an epoch's length: under the
    draw's seeding, so a ``set_epoch`` drawing from the global RNGs moves nothing of the
    training loop's."""
    loader = ResumableLoader(IndexDataset(N), sampler=_RandomSubset(), batch_size=4, seed=0)
    np.random.seed(0)
    untouched = np.random.rand()
    np.random.seed(0)
    assert [len(loader) for _ in range(3)] == [3, 3, 3]
    assert np.random.rand() == untouched


def test_rollover_over_a_len_that_follows_set_epoch_is_refused() -> None:
    """Rollover lays epochs of one length end to end: a longer epoch would be cut silently."""
    loader = ResumableLoader(IndexDataset(N), sampler=GrowingCurriculum(), batch_size=4,
                             last_batch="rollover")
    assert [i for b in loader for i in indices(b)] != []
    with pytest.raises(ValueError, match="'rollover' needs epochs of one length.*len\\(\\) is "
                                         "14 in epoch 1 and was 10.*'keep', 'drop' or 'pad'"):
        list(loader)


class Progress(Sampler[int]):
    """A sampler whose state is how far its iteration got (torchdata's
    ``StatefulDistributedSampler`` style): loading it makes the next iteration skip that many,
    so its state at an epoch's end reads "all yielded"."""

    def __init__(self) -> None:
        self.epoch, self.yielded, self.next_yielded = 0, 0, None

    def __len__(self) -> int:
        return N

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        self.yielded, self.next_yielded = self.next_yielded or 0, None
        order = torch.randperm(N, generator=torch.Generator().manual_seed(self.epoch)).tolist()
        for index in order[self.yielded:]:
            self.yielded += 1
            yield index

    def state_dict(self) -> dict[str, int]:
        return {"yielded": self.yielded}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.next_yielded = state["yielded"]


def test_a_sampler_whose_state_is_its_progress_resumes_in_any_epoch() -> None:
    """Restored for an epoch after the first, its state from the previous epoch's end says
    that iteration was over; uninterrupted, it began a new one, and so it does on resume."""
    check_resume_at_every_step(
        lambda: ResumableLoader(IndexDataset(N), sampler=Progress(), batch_size=4), epochs=3)


def test_an_infinite_sampler_with_len_is_cut_at_len() -> None:
    class Forever(Sampler[int]):
        def __len__(self) -> int:
            return 6

        def __iter__(self):
            i = 0
            while True:
                yield i % N
                i += 1

    loader = ResumableLoader(IndexDataset(N), sampler=Forever(), batch_size=4)
    with pytest.warns(UserWarning, match="yields more indices than its len\\(\\) \\(6\\): each "
                      "epoch takes its first 6"):
        assert [indices(b) for b in loader] == [[0, 1, 2, 3], [4, 5]]
    with warnings.catch_warnings():
        warnings.simplefilter("error")  # said once, not every epoch
        assert [indices(b) for b in loader] == [[0, 1, 2, 3], [4, 5]]


@pytest.mark.parametrize("batched", [False, True])
def test_an_endless_sampler_without_len_is_refused(monkeypatch: pytest.MonkeyPatch,
                                                   batched: bool) -> None:
    """DataLoader reads it until the trainer stops; a plan needs epochs."""
    class Endless:
        def __iter__(self):
            i = 0
            while True:
                yield [i % N, (i + 1) % N] if batched else i % N
                i += 2

    monkeypatch.setattr(drawn, "MAX_DRAWN", 1000)
    kind = "batches" if batched else "indices"
    with pytest.raises(ValueError, match=f"Endless has no len\\(\\) and yielded more than 1,000 "
                                         f"{kind} in one epoch: an endless sampler cannot"):
        if batched:
            ResumableLoader(IndexDataset(N), batch_sampler=Endless())
        else:
            ResumableLoader(IndexDataset(N), sampler=Endless(), batch_size=4)


@pytest.mark.parametrize(
    ("items", "match"),
    [(["a", "b"], "yielded 'a' \\(str\\)"), ([0.5, 1.5], "integer dataset indices")],
)
def test_non_index_items_are_refused(items, match) -> None:
    with pytest.raises(TypeError, match=match):
        DrawnOrder(items, seed=0).indices(0, np.arange(2))


def test_a_length_that_lies_is_refused() -> None:
    class Liar(Sampler[int]):
        def __len__(self) -> int:
            return 5

        def __iter__(self):
            return iter(range(3))

    with pytest.raises(ValueError, match="only 3 indices in epoch 0, but len\\(\\) is 5"):
        DrawnOrder(Liar(), seed=0).indices(0, np.arange(2))


@pytest.mark.parametrize("names", [("num_replicas", "rank"),
                                   ("data_parallel_size", "data_parallel_rank")],
                         ids=["torch", "megatron"])
def test_a_rank_aware_sampler_is_warned_about(names) -> None:
    """torch's attribute names and Megatron's: either sampler shards by rank itself."""
    class Sharding(Sampler[int]):
        def __len__(self) -> int:
            return 3

        def __iter__(self):
            return iter(range(3))

    sampler = Sharding()
    for name, value in zip(names, (2, 0), strict=True):
        setattr(sampler, name, value)
    with pytest.warns(UserWarning, match=f"it has {names[0]} and {names[1]}.*sharded twice"):
        DrawnOrder(sampler, seed=0)


class Buckets(Sampler[list[int]]):
    def __init__(self, size: int = 3, ragged: bool = False) -> None:
        self.size, self.ragged = size, ragged

    def __iter__(self):
        perm = torch.randperm(N).tolist()
        sizes = [self.size + (i % 2 if self.ragged else 0) for i in range(N)]
        out, start = [], 0
        for size in sizes:
            if start >= N:
                break
            out.append(perm[start:start + size])
            start += size
        return iter(out)


def test_a_custom_batch_sampler_keeps_its_batches_and_resumes() -> None:
    def make() -> ResumableLoader:
        order = DrawnBatchOrder(Buckets(), seed=3)
        return ResumableLoader(IndexDataset(N), sampler=order, batch_size=order.batch_size)

    full = check_resume_at_every_step(make, epochs=2, key=indices)
    order = DrawnBatchOrder(Buckets(), seed=3)
    drawn = order.indices(0, np.arange(N)).tolist()
    assert full[0] == [drawn[i:i + 3] for i in range(0, N, 3)]


def test_epochs_of_one_batch_size_have_no_bounds_and_keep_their_fingerprint() -> None:
    order = DrawnBatchOrder(Buckets(), seed=3)
    assert order.batch_bounds(0) is None and order.batch_bounds(1) is None
    assert order.fingerprint == "drawn-batches(Buckets, len=21, batch_size=3)"


def test_batches_of_different_sizes_are_kept_with_their_bounds() -> None:
    order = DrawnBatchOrder(Buckets(ragged=True), seed=0)
    bounds = order.batch_bounds(0)
    assert bounds is not None and np.diff(bounds).tolist() == [3, 4, 3, 4, 3, 4]
    assert sorted(order.indices(0, np.arange(N)).tolist()) == list(range(N))
    assert (order.batch_size, len(order)) == (3, N)


class Budget(Sampler[list[int]]):
    """Token budgets: epoch ``e`` packs a new permutation of ``n`` lengths into batches of at
    most ``budget`` tokens, so the number of batches (and, with ``drop``, of indices) varies."""

    def __init__(self, n: int = N, budget: int = 9, drop: bool = False) -> None:
        self.n, self.budget, self.drop, self.epoch = n, budget, drop, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __iter__(self):
        order = torch.randperm(self.n).tolist()
        if self.drop:
            order = order[:self.n - self.epoch % 3]
        batches, batch, tokens = [], [], 0
        for i in order:
            length = 1 + i % 5
            if batch and tokens + length > self.budget:
                batches.append(batch)
                batch, tokens = [], 0
            batch.append(i)
            tokens += length
        return iter([*batches, batch])


def test_epochs_may_differ_in_batches_and_indices() -> None:
    order = DrawnBatchOrder(Budget(drop=True), seed=1)
    epochs = [order.batch_bounds(e) for e in range(4)]
    assert all(bounds is not None for bounds in epochs)
    assert len({len(bounds) for bounds in epochs}) > 1
    assert [int(bounds[-1]) for bounds in epochs] == [N, N - 1, N - 2, N]
    for epoch, bounds in enumerate(epochs):
        assert len(set(order.indices(epoch, np.arange(bounds[-1])).tolist())) == bounds[-1]


def test_an_empty_batch_is_refused() -> None:
    with pytest.raises(ValueError, match=r"an empty batch \(batch 1 of epoch 0\)"):
        DrawnBatchOrder([[0, 1], [], [2]], seed=0)
