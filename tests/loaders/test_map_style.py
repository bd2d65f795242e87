import pickle
import random
import time
import warnings

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, RandomSampler, SequentialSampler, TensorDataset

from lightning_loaders import ResumableLoader, WorkerInfo, sample_rng, worker_info
from lightning_loaders.testing import check_resume_at_every_step, run_epochs, set_epoch, to_plain
from tests.conftest import IndexDataset, RangeDataset, loader_processes

POLICIES = ["keep", "drop", "pad", "rollover"]


def indices(batch) -> list[int]:
    return batch["index"].tolist()


def test_same_batches_as_torch_dataloader_without_shuffle() -> None:
    ds = IndexDataset(23)
    for drop_last in (False, True):
        ours = [to_plain(b) for b in ResumableLoader(ds, batch_size=4, drop_last=drop_last)]
        theirs = [to_plain(b) for b in DataLoader(ds, batch_size=4, drop_last=drop_last)]
        assert ours == theirs


def test_tensor_dataset_fast_path_matches_torch_collation() -> None:
    ds = TensorDataset(torch.randn(50, 3), torch.arange(50))
    ours = [to_plain(b) for b in ResumableLoader(ds, batch_size=8)]
    theirs = [to_plain(b) for b in DataLoader(ds, batch_size=8)]
    assert ours == theirs
    assert isinstance(next(iter(ResumableLoader(ds, batch_size=8))), list)


@pytest.mark.parametrize("num_workers", [0, 2])
@pytest.mark.parametrize("last_batch", POLICIES)
def test_resume_at_every_step_is_exact(num_workers: int, last_batch: str) -> None:
    def make() -> ResumableLoader:
        return ResumableLoader(IndexDataset(23), batch_size=4, shuffle=True, seed=5,
                               num_workers=num_workers, last_batch=last_batch)

    full = check_resume_at_every_step(make, epochs=3, key=indices)
    epochs = [sorted(i for b in e for i in b) for e in full]
    assert epochs[0] != epochs[1] or last_batch == "keep"
    if last_batch == "keep":
        assert all(e == list(range(23)) for e in epochs)
    orders = [[i for b in e for i in b] for e in full]
    assert orders[0] != orders[1], "every epoch must have its own shuffle"


def test_stream_does_not_depend_on_workers_prefetch_or_pinning() -> None:
    runs = []
    for kwargs in ({"num_workers": 0}, {"num_workers": 1}, {"num_workers": 2, "prefetch_factor": 1},
                   {"num_workers": 2, "prefetch_factor": 4, "persistent_workers": False},
                   {"num_workers": 0, "pin_memory": True}):
        loader = ResumableLoader(IndexDataset(30), batch_size=4, shuffle=True, seed=1, **kwargs)
        warns = kwargs.get("pin_memory") and not torch.accelerator.is_available()
        with pytest.warns(UserWarning) if warns else _no_warning():
            runs.append(run_epochs(loader, range(2), key=indices))
    assert all(run == runs[0] for run in runs)


class _no_warning:
    def __enter__(self) -> None: ...
    def __exit__(self, *exc) -> None: ...


def _rank_batches(world: int, n: int, bs: int, policy: str) -> list[list[list[int]]]:
    ranks = []
    for rank in range(world):
        loader = ResumableLoader(IndexDataset(n), batch_size=bs, shuffle=True, seed=2,
                                 last_batch=policy, rank=rank, world_size=world)
        ranks.append(run_epochs(loader, [0], key=indices)[0])
    return ranks


@pytest.mark.parametrize("policy", ["keep", "drop", "pad"])
def test_ranks_get_equal_batch_counts_and_disjoint_shares(policy: str) -> None:
    ranks = _rank_batches(3, 31, 4, policy)
    assert len({len(r) for r in ranks}) == 1
    samples = [i for r in ranks for b in r for i in b]
    if policy == "keep":
        assert sorted(samples) == list(range(31))
    if policy == "drop":
        assert len(samples) == len(set(samples)) == 24
    if policy == "pad":
        assert set(samples) == set(range(31)) and len(samples) == 36
    loader = ResumableLoader(IndexDataset(31), batch_size=4, last_batch=policy, rank=1,
                             world_size=3)
    assert len(loader) == len(ranks[1])


@pytest.mark.parametrize(("old_world", "new_world"), [(2, 1), (2, 3), (3, 2)])
@pytest.mark.parametrize("steps", [0, 1, 2, 3])
def test_elastic_resume_delivers_the_rest_of_the_epoch_exactly_once(old_world, new_world, steps):
    n, bs = 37, 3
    consumed, state = [], None
    for rank in range(old_world):
        loader = ResumableLoader(IndexDataset(n), batch_size=bs, shuffle=True, seed=9,
                                 rank=rank, world_size=old_world)
        iterator = iter(loader)
        for _ in range(steps):
            consumed += indices(next(iterator))
        state = loader.state_dict()
    rest = []
    for rank in range(new_world):
        loader = ResumableLoader(IndexDataset(n), batch_size=bs, shuffle=True, seed=9,
                                 rank=rank, world_size=new_world)
        loader.load_state_dict(state)
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            batches = [indices(b) for b in loader]
        past_len = steps + len(batches) > len(loader)
        assert past_len == any("elastic" in str(w.message) for w in caught)
        rest.append(batches)
    assert len({len(r) for r in rest}) == 1
    remaining = [i for r in rest for b in r for i in b]
    assert sorted(consumed + remaining) == list(range(n))


def test_an_elastic_resume_at_the_epochs_end_warns_of_nothing() -> None:
    """Nothing is left to deliver, so nothing goes past the new layout's len()."""
    loader = ResumableLoader(IndexDataset(23), batch_size=4, rank=0, world_size=2)
    set_epoch(loader, 0)  # as Lightning does
    assert len(list(loader)) == 3
    state = loader.state_dict()
    resumed = ResumableLoader(IndexDataset(23), batch_size=4, rank=0, world_size=3)
    resumed.load_state_dict(state)
    set_epoch(resumed, 0)
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert list(resumed) == []


def test_iter_alone_starts_nothing_and_advances_nothing() -> None:
    loader = ResumableLoader(IndexDataset(10), batch_size=5, shuffle=True, num_workers=2)
    for _ in range(3):
        iter(loader)
    assert loader_processes() == []
    assert loader.epoch is None
    first = indices(next(iter(loader)))
    assert loader.epoch == 0
    fresh = ResumableLoader(IndexDataset(10), batch_size=5, shuffle=True, num_workers=0)
    assert indices(next(iter(fresh))) == first
    loader.close()


def test_a_fresh_iter_abandons_a_stale_tail_and_starts_the_next_epoch() -> None:
    loader = ResumableLoader(IndexDataset(20), batch_size=5, shuffle=True, seed=3)
    reference = ResumableLoader(IndexDataset(20), batch_size=5, shuffle=True, seed=3)
    expected = run_epochs(reference, range(2), key=indices)
    partial = iter(loader)
    assert indices(next(partial)) == expected[0][0]
    assert [indices(b) for b in loader] == expected[1]
    assert loader.epoch == 1
    with pytest.raises(RuntimeError, match="newer iter"):
        next(partial)


def test_restored_cursor_wins_over_a_stale_set_epoch_and_yields_to_a_later_one() -> None:
    def make() -> ResumableLoader:
        return ResumableLoader(IndexDataset(20), batch_size=5, shuffle=True, seed=4)

    expected = run_epochs(make(), range(4), key=indices)
    source = make()
    set_epoch(source, 2)
    iterator = iter(source)
    next(iterator)
    state = source.state_dict()
    stale = make()
    stale.load_state_dict(state)
    set_epoch(stale, 0)  # Lightning #21938: a restarted trainer may say epoch 0
    assert [indices(b) for b in stale] == expected[2][1:]
    moved_on = make()
    moved_on.load_state_dict(state)
    set_epoch(moved_on, 3)  # limit_train_batches: the trainer has moved on to epoch 3
    assert [indices(b) for b in moved_on] == expected[3]


def test_cursor_at_epoch_end_starts_the_next_epoch() -> None:
    def make() -> ResumableLoader:
        return ResumableLoader(IndexDataset(20), batch_size=5, shuffle=True, seed=4)

    expected = run_epochs(make(), range(2), key=indices)
    done = make()
    run_epochs(done, [0])
    state = done.state_dict()
    for declared in (None, 1):
        resumed = make()
        resumed.load_state_dict(state)
        if declared is not None:
            set_epoch(resumed, declared)
        assert [indices(b) for b in resumed] == expected[1]


def test_cursor_at_epoch_end_stays_exhausted_while_the_trainer_resumes_its_epoch() -> None:
    """A trainer that declares the finished epoch after the restore is still in it (a
    ``CombinedLoader(mode="max_size")`` draining longer members): nothing more comes until it
    moves on. Declared before the restore (a new validation pass), the next epoch starts."""
    def make() -> ResumableLoader:
        return ResumableLoader(IndexDataset(20), batch_size=5, shuffle=True, seed=4)

    expected = run_epochs(make(), range(2), key=indices)
    done = make()
    run_epochs(done, [0])
    resumed = make()
    resumed.load_state_dict(done.state_dict())
    set_epoch(resumed, 0)
    assert list(resumed) == []
    set_epoch(resumed, 1)
    assert [indices(b) for b in resumed] == expected[1]
    new_pass = make()
    set_epoch(new_pass, 0)
    new_pass.load_state_dict(done.state_dict())
    assert [indices(b) for b in new_pass] == expected[1]


def test_state_is_tiny_and_independent_of_size_and_workers() -> None:
    sizes = set()
    for n, workers in ((10, 0), (10**9, 0), (100, 2)):
        loader = ResumableLoader(RangeDataset(n), batch_size=4, shuffle=True, num_workers=workers)
        next(iter(loader))
        sizes.add(len(pickle.dumps(loader.state_dict())))
        loader.close()
    assert max(sizes) < 1024
    assert max(sizes) - min(sizes) < 16


def test_resume_at_the_end_of_a_billion_sample_epoch_is_a_jump() -> None:
    n, bs = 10**9, 1000
    loader = ResumableLoader(RangeDataset(n), batch_size=bs, shuffle=True, seed=1)
    last = len(loader) - 1
    state = {**loader.state_dict(), "batches": last}
    started = time.perf_counter()
    resumed = ResumableLoader(RangeDataset(n), batch_size=bs, shuffle=True, seed=1)
    resumed.load_state_dict(state)
    batch = next(iter(resumed))
    elapsed = time.perf_counter() - started
    assert len(batch) == bs and resumed.state_dict()["batches"] == last + 1
    print(f"load_state_dict + first batch at batch {last} of 10**9 samples: {elapsed * 1e3:.1f} ms")


def _check_worker_init(worker: int) -> None:
    assert isinstance(worker, WorkerInfo) and worker == worker.id
    assert (worker.num_workers, worker.rank, worker.world_size, worker.seed) == (2, 0, 1, 11)
    assert isinstance(worker.dataset, IndexDataset)
    assert worker_info() is worker


def test_in_memory_data_is_gathered_in_process_unless_workers_are_needed() -> None:
    """No user code runs per sample on in-memory data: worker processes would only add the
    cost of sending batches. A worker_init_fn asks for them; the stream is the same."""
    ds = TensorDataset(torch.randn(40, 3), torch.arange(40))

    def stream(**kwargs) -> list:
        loader = ResumableLoader(ds, batch_size=6, shuffle=True, seed=2, **kwargs)
        it = iter(loader)
        first = next(it)
        processes = len(loader_processes())
        return [processes, *[to_plain(b) for b in [first, *it]]]

    in_process = stream(num_workers=0)
    assert in_process[0] == 0
    assert stream(num_workers=2) == in_process
    with_workers = stream(num_workers=2, worker_init_fn=lambda worker_id: None,
                          multiprocessing_context="fork")
    assert with_workers[0] == 2 and with_workers[1:] == in_process[1:]


def test_fetching_in_process_does_not_hand_the_loaders_seed_to_the_training_loop() -> None:
    """At num_workers=0 the global RNGs are seeded per batch for the dataset, then re-seeded
    from their own earlier state: what the training loop draws next depends on its seed
    (seed_everything), not on the loader's."""
    def draws_after_an_epoch(global_seed: int, loader_seed: int) -> tuple[float, ...]:
        random.seed(global_seed)
        np.random.seed(global_seed)
        torch.manual_seed(global_seed)
        batches = list(ResumableLoader(_Augmented(), batch_size=3, seed=loader_seed))
        assert len({b[0, 2].item() for b in batches}) > 1, "the dataset drew from the RNGs"
        return random.random(), np.random.rand(), torch.rand(1).item()

    base = draws_after_an_epoch(1, loader_seed=8)
    assert draws_after_an_epoch(1, loader_seed=9) == base
    other = draws_after_an_epoch(2, loader_seed=8)
    assert all(a != b for a, b in zip(other, base, strict=True))


def test_worker_init_fn_gets_an_int_with_rich_info() -> None:
    # A failed assertion in worker_init_fn is re-raised here by the worker pool.
    loader = ResumableLoader(IndexDataset(8), batch_size=2, num_workers=2, seed=11,
                             worker_init_fn=_check_worker_init)
    assert sum(len(indices(b)) for b in loader) == 8
    loader.close()
    got = {tuple(b[0].tolist()) for b in ResumableLoader(_WorkerReport(), batch_size=1,
                                                          num_workers=2, seed=11)}
    assert got == {(0, 2, 0, 1, 11), (1, 2, 0, 1, 11)}


class _WorkerReport(torch.utils.data.Dataset[torch.Tensor]):
    def __len__(self) -> int:
        return 4

    def __getitem__(self, index: int) -> torch.Tensor:
        info = worker_info()
        assert info is not None
        return torch.tensor([int(info), info.num_workers, info.rank, info.world_size, info.seed])


class _Augmented(torch.utils.data.Dataset[torch.Tensor]):
    """Random per sample, through both the per-sample RNG and the global numpy RNG."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, sample_rng().integers(1 << 30), np.random.randint(1 << 30)])


def test_randomness_is_reproducible_whatever_the_workers() -> None:
    def run(workers: int, world: int = 1) -> list[list[int]]:
        rows = []
        for rank in range(world):
            loader = ResumableLoader(_Augmented(), batch_size=3, shuffle=True, seed=8,
                                     num_workers=workers, rank=rank, world_size=world)
            rows += [r for e in run_epochs(loader, range(2)) for b in e for r in b]
        return rows

    base = run(0)
    assert run(2) == base
    assert len({r[1] for r in base}) == len(base), "per-sample draws must differ"
    per_sample = {(r[0], r[1]) for r in base}
    assert {(r[0], r[1]) for r in run(0, world=2)} == per_sample


def test_two_loaders_interleaved_keep_their_own_context() -> None:
    a = iter(ResumableLoader(_Augmented(), batch_size=2, seed=1, num_workers=1))
    b = iter(ResumableLoader(_Augmented(), batch_size=2, seed=2, num_workers=1))
    mixed = [(next(a).tolist(), next(b).tolist()) for _ in range(3)]
    for side, seed in ((0, 1), (1, 2)):
        alone = [b.tolist() for b in ResumableLoader(_Augmented(), batch_size=2, seed=seed)]
        assert [m[side] for m in mixed] == alone[:3]


def test_samplers_convert_to_their_resumable_equivalents() -> None:
    ds = IndexDataset(12)
    sequential = ResumableLoader(ds, sampler=SequentialSampler(ds), batch_size=5)
    assert [indices(b) for b in sequential] == [[0, 1, 2, 3, 4], [5, 6, 7, 8, 9], [10, 11]]
    shuffled = ResumableLoader(ds, sampler=RandomSampler(ds), batch_size=5, seed=3)
    assert [indices(b) for b in shuffled] == [
        indices(b) for b in ResumableLoader(ds, shuffle=True, batch_size=5, seed=3)]
    from_generator = ResumableLoader(ds, shuffle=True, batch_size=5,
                                     generator=torch.Generator().manual_seed(3))
    assert from_generator.seed == 3


@pytest.mark.parametrize(
    ("kwargs", "match"),
    [
        ({"batch_size": 0}, "batch_size"),
        ({"num_workers": -1}, "num_workers"),
        ({"shuffle": True, "sampler": [0, 1]}, "shuffle"),
        ({"last_batch": "wrap"}, "last_batch"),
        ({"drop_last": True, "last_batch": "pad"}, "contradicts"),
        ({"prefetch_factor": 2}, "num_workers"),
        ({"timeout": -1}, "timeout"),
        ({"shuffle_buffer": 8}, "for iterable datasets"),
        ({"sync_interval": 2}, "for iterable datasets"),
    ],
)
def test_impossible_settings_fail_at_construction(kwargs, match) -> None:
    with pytest.raises(ValueError, match=match):
        ResumableLoader(IndexDataset(10), **kwargs)


def test_drop_with_fewer_samples_than_a_global_batch_says_how_to_fix_it() -> None:
    with pytest.raises(ValueError, match="smaller batch_size"):
        ResumableLoader(IndexDataset(5), batch_size=4, drop_last=True, rank=0, world_size=2)


def test_errors_in_user_code_name_the_sample_and_keep_the_cause() -> None:
    class Broken(IndexDataset):
        def __getitem__(self, index: int):
            if index == 7:
                raise KeyError("no such record")
            return super().__getitem__(index)

    for workers in (0, 2):
        loader = ResumableLoader(Broken(10), batch_size=4, num_workers=workers)
        with pytest.raises(Exception, match=r"sample index 7 .*batch 1.* epoch 0") as info:
            list(loader)
        assert "no such record" in str(info.value)
        loader.close()


def test_repr_says_where_the_loader_is() -> None:
    loader = ResumableLoader(IndexDataset(10), batch_size=4, shuffle=True, seed=2)
    next(iter(loader))
    text = repr(loader)
    for part in ("IndexDataset(len=10)", "batch_size=4", "rank=0/1", "epoch=0", "batches=1"):
        assert part in text


def test_a_passed_samplers_own_seed_keys_the_order_as_in_torch(monkeypatch) -> None:
    """``ResumableLoader(ds, sampler=...)`` takes the seed that orders the sampler in torch (a
    generator's, a ``DistributedSampler``'s), as ``make_resumable`` does: it read 0 (or
    ``$PL_GLOBAL_SEED``) for every sampler seed, so runs sweeping the sampler's seed all saw
    one order. ``seed=`` still wins."""
    from torch.utils.data import BatchSampler, DistributedSampler

    monkeypatch.setenv("PL_GLOBAL_SEED", "31")
    dataset = list(range(12))

    def loaders(seed: int) -> list[ResumableLoader]:
        def randoms() -> RandomSampler:
            return RandomSampler(dataset, generator=torch.Generator().manual_seed(seed))

        distributed = DistributedSampler(dataset, num_replicas=1, rank=0, seed=seed)
        return [ResumableLoader(dataset, batch_size=4, sampler=randoms()),
                ResumableLoader(dataset, batch_sampler=BatchSampler(randoms(), 4, False)),
                ResumableLoader(dataset, batch_size=4, sampler=distributed,
                                generator=torch.Generator().manual_seed(7))]

    streams = set()
    for seed in (5, 123):
        for loader in loaders(seed):
            assert loader.seed == seed
            stream = [int(i) for batch in loader for i in batch]
            assert sorted(stream) == dataset
            streams.add((seed, tuple(stream)))
    assert len({stream for _, stream in streams}) > 1
    sampler = RandomSampler(dataset, generator=torch.Generator().manual_seed(5))
    assert ResumableLoader(dataset, sampler=sampler, seed=9).seed == 9
    assert ResumableLoader(dataset, shuffle=True).seed == 31


def test_ddp_plans_that_differ_between_ranks_are_refused_on_every_rank(tmp_path) -> None:
    """Each rank shards its own plan, so ranks must agree on it: at every epoch start they
    compare the seed, the order's length, the batches and the order's first indices (one
    all_reduce), and refuse a difference on every rank, naming each rank's value. A sampler
    that splits by rank itself (Megatron's attributes, equal or uneven shares, a
    SubsetRandomSampler over the rank's indices), a generator seeded by the rank, an order
    that turns rank-dependent in epoch 1 and a batch size per rank are refused (before, each
    read its share of its own order: 6 of 12 samples per epoch, or repeats and losses); a
    failure on one rank waits for the comparison (nothing hangs). A sampler over the whole
    dataset, one with its own generator seeded alike on every rank, and a loader placed by
    hand at rank 0 of 1 (nothing to compare) are read as planned. The ranks compare in
    Lightning's loops (its data fetcher, which every rank runs alike); a loop of the user's on
    rank 0 alone compares nothing and reads its share (it waited for rank 1 forever), unless
    compare_ranks=True says every rank runs it alike: a plain loop on both ranks then refuses
    the split sampler (make_resumable's override; before, it read 6 of 12 per epoch) and reads
    a shuffle whole, while compare_ranks=False compares nothing even in Lightning's loops."""
    from tests.ddp_harness import REPO, run_ddp

    runs = run_ddp(REPO / "tests" / "scripts" / "map_ranks_ddp.py", [], tmp_path / "ddp")
    for case in ("whole-sampler", "own-rng-alike", "shuffle", "rank-share-placed-by-hand",
                 "shuffle-own-loop-compared"):
        for epoch in range(2):
            ids = sorted(i for run in runs for i in run[case]["epochs"][epoch])
            assert ids == list(range(12)), (case, epoch)
    for epoch in range(2):  # each rank its share of its own share: 6 of 12, uncompared
        never = [i for run in runs for i in run["rank-share-never-compared"]["epochs"][epoch]]
        assert len(set(never)) == len(never) == 6, (epoch, never)
    alone = runs[0]["rank-0-alone"]["epochs"][0]
    assert len(set(alone)) == len(alone) == 6 and "rank-0-alone" not in runs[1]
    order = "ValueError: the order differs between ranks in epoch"
    refused = {
        "rank-share": f"{order} 0 (its first indices: [0, 2, 4, 6] on rank 0, [1, 3, 5, 7] on "
                      "rank 1)",
        "rank-share-own-loop-compared": f"{order} 0 (its first indices: [0, 2, 4, 6] on rank "
                                        "0, [1, 3, 5, 7] on rank 1)",
        "subset-per-rank": f"{order} 0 (its first indices: ",
        "rank-order-from-epoch-1": f"{order} 1 (its first indices: [0, 1, 2, 3] on rank 0, "
                                   "[1, 2, 3, 4] on rank 1)",
        "rank-share-uneven": "ValueError: the order's length (the sampler's len(), else the "
                             "dataset's) differs between ranks (6 on rank 0, 5 on rank 1)",
        "generator-per-rank": "ValueError: the loader's seed differs between ranks (0 on rank "
                              "0, 1 on rank 1)",
        "batch-size-per-rank": "ValueError: the number of batches of epoch 0 differs between "
                               "ranks (3 on rank 0, 2 on rank 1)",
    }
    for rank, run in enumerate(runs):
        for case, start in refused.items():
            assert run[case].get("error", "").startswith(start), (rank, case, run[case])
        assert "data_parallel_rank" in run["rank-share"]["error"]
        assert "the same seed on every rank" in run["generator-per-rank"]["error"]
        assert len(run["rank-order-from-epoch-1"]["epochs"]) == 1  # epoch 0 was read
    assert runs[1]["short-on-rank-1"]["error"].startswith(
        "ValueError: ShortOnRankOne yielded only 11 indices in epoch 0")
    assert runs[0]["short-on-rank-1"]["error"].startswith(
        "RuntimeError: another rank failed to begin epoch 0")
