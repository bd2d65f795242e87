"""Bad input is refused clearly: impossible settings at construction (with the fix in the
message), and saved states that do not belong to the loader (naming each field, both values)."""

from __future__ import annotations

import multiprocessing
import re
import warnings
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import BatchSampler, IterableDataset, SequentialSampler

from lightning_loaders import ResumableLoader
from lightning_loaders.errors import StateMismatchError
from lightning_loaders.loaders.options import start_method
from lightning_loaders.sources.shards import SequenceSource
from lightning_loaders.testing import checkpoint_roundtrip, run_epochs
from tests.conftest import IndexDataset


class HoldsALambda(IndexDataset):
    def __init__(self, n: int) -> None:
        super().__init__(n)
        self.transform = lambda x: x


class Empty(IndexDataset):
    def __len__(self) -> int:
        return 0


def _identity(batch: Any) -> Any:
    return batch


BAD_SETTINGS = [
    # (dataset, kwargs, exception, what the message must say: the problem and the fix)
    (10, {"batch_size": 0}, ValueError, r"batch_size must be an int >= 1, got 0.*or None"),
    (10, {"batch_size": 2.5}, ValueError, r"batch_size must be an int >= 1, got 2\.5"),
    (10, {"batch_size": True}, ValueError, r"batch_size must be an int >= 1, got True"),
    (10, {"batch_size": None, "drop_last": True}, ValueError,
     r"batch_size=None option disables auto-batching and is mutually exclusive with drop_last"),
    (10, {"num_workers": -1}, ValueError, r"num_workers must be an int >= 0, got -1: use 0"),
    (10, {"shuffle": True, "sampler": SequentialSampler(range(10))}, ValueError,
     r"shuffle=True cannot be combined with a sampler.*drop shuffle"),
    (10, {"batch_sampler": BatchSampler(SequentialSampler(range(10)), 2, False),
          "batch_size": 4}, ValueError, r"batch_sampler is mutually exclusive with batch_size"),
    (10, {"timeout": -1}, ValueError, r"timeout must be a number >= 0, got -1: use 0"),
    (10, {"timeout": 5}, ValueError, r"timeout=5 needs worker processes.*num_workers > 0"),
    (10, {"prefetch_factor": 2}, ValueError, r"prefetch_factor=2 needs num_workers > 0"),
    (10, {"num_workers": 1, "prefetch_factor": 0}, ValueError, r"prefetch_factor must be .*>= 1"),
    (10, {"persistent_workers": True}, ValueError, r"persistent_workers=True needs num_workers"),
    (10, {"collate_fn": 3}, TypeError, r"collate_fn must be callable, got a int"),
    (10, {"worker_init_fn": "init"}, TypeError, r"worker_init_fn must be callable"),
    (10, {"num_workers": 1, "multiprocessing_context": "spwan"}, ValueError,
     r"multiprocessing_context='spwan' is not a start method.*use one of"),
    (10, {"num_workers": 1, "multiprocessing_context": 5}, TypeError,
     r"multiprocessing_context must be a start method's name or a multiprocessing context"),
    (10, {"multiprocessing_context": "spawn"}, ValueError,
     r"multiprocessing_context='spawn' needs num_workers > 0"),
    (10, {"partitions": 0}, ValueError, r"partitions are for iterable datasets"),
    (10, {"last_batch": "wrap"}, ValueError, r"last_batch must be one of"),
    (10, {"drop_last": True, "last_batch": "pad"}, ValueError, r"drop_last=True contradicts"),
    (10, {"on_error": "ignore"}, ValueError, r"on_error must be one of \('raise', 'skip'\)"),
    (10, {"max_worker_restarts": -1}, ValueError, r"max_worker_restarts .* use 0"),
    (10, {"compare_ranks": "yes"}, ValueError, r"compare_ranks must be None, True or False, "
     r"got 'yes': None compares the ranks' epochs in Lightning's loops only, True in any loop"),
    (10, {"rank": 2, "world_size": 2}, ValueError, r"need 0 <= rank < world_size"),
    (10, {"rank": 1}, ValueError, r"give both rank and world_size"),
    # A dataset shorter than the world size (or than one global batch under drop/rollover).
    (3, {"drop_last": True, "rank": 0, "world_size": 4}, ValueError,
     r"leaves no batch: 3 samples .* 4 ranks x batch_size 1; use a smaller batch_size, "
     r"fewer ranks, or last_batch='pad'"),
    (3, {"rank": 0, "world_size": 4}, ValueError,
     r"cannot give each of 4 ranks a non-empty last batch from the epoch's 3 samples with "
     r"batch_size=1; use last_batch='pad', or a world size dividing the epoch's 3 \(1 or 3 "
     r"ranks\)$"),
    (13, {"rank": 0, "world_size": 2}, ValueError,
     r"non-empty last batch from the epoch's 13 samples \(6 full rounds of 2 batches leave 1\) "
     r"with batch_size=1; use last_batch='pad' or 'drop', a batch_size >= 2, evaluation=True, "
     r"or a world size dividing the epoch's 13 \(1 or 13 ranks\)$"),
    (5, {"last_batch": "rollover", "batch_size": 4, "rank": 0, "world_size": 2}, ValueError,
     r"rollover' needs at least one global batch per epoch.*batch_size <= 2"),
    ("empty", {}, ValueError, r"the dataset \(Empty\) is empty.*DataLoader would yield no "
     r"batch.*at least one sample"),
    (10, {"sampler": []}, ValueError, r"its sampler yields no index \(len\(\) is 0\)"),
    # Workers started by spawn receive the dataset and functions pickled.
    ("lambda", {"num_workers": 1, "multiprocessing_context": "spawn"}, ValueError,
     r"the dataset cannot be pickled .*'spawn'.*module level.*'fork'.*num_workers=0"),
    (10, {"num_workers": 1, "multiprocessing_context": "forkserver",
          "collate_fn": lambda b: b}, ValueError, r"the collate_fn cannot be pickled"),
]


@pytest.mark.parametrize(("dataset", "kwargs", "error", "match"), BAD_SETTINGS)
def test_impossible_settings_fail_at_construction_with_the_fix(dataset, kwargs, error, match):
    data = {"empty": Empty(0), "lambda": HoldsALambda(10)}.get(dataset) if isinstance(
        dataset, str) else IndexDataset(dataset)
    with pytest.raises(error, match=match):
        ResumableLoader(data, **kwargs)


class CountsInSharedMemory(IndexDataset):
    """Counts its fetches in a ``multiprocessing.Value`` under a ``Lock``: objects that pickle
    only while a process is started, as torch's ``DataLoader`` starts its workers."""

    def __init__(self, n: int, method: str) -> None:
        super().__init__(n)
        context = multiprocessing.get_context(method)
        self.count = context.Value("i", 0)
        self.lock = context.Lock()

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        with self.lock:
            self.count.value += 1
        return super().__getitem__(index)


def test_objects_that_pickle_only_as_a_worker_starts_reach_spawned_workers() -> None:
    dataset = CountsInSharedMemory(12, "spawn")
    loader = ResumableLoader(dataset, batch_size=4, shuffle=True, seed=2, num_workers=2,
                             multiprocessing_context="spawn")
    batches = [batch["index"].tolist() for batch in loader]
    loader.close()
    alone = ResumableLoader(IndexDataset(12), batch_size=4, shuffle=True, seed=2)
    assert batches == [batch["index"].tolist() for batch in alone]
    assert dataset.count.value == 12  # the workers' fetches, counted in this process


class _Stream(IterableDataset[int]):
    """A plain iterable dataset without shards (and a lambda that spawn cannot pickle)."""

    def __init__(self) -> None:
        self.transform = lambda x: x

    def __iter__(self) -> Iterator[int]:
        return iter(range(10))


ITERABLE_BAD_SETTINGS = [  # the same checks reach ResumableLoader over an iterable dataset
    (lambda: SequenceSource([[], []]), {}, r"is empty: its shard lengths add up to 0"),
    (lambda: SequenceSource([[1, 2, 3]]), {"shuffle": True},
     r"shuffle=True reorders the shards, and this SequenceSource has one.*shuffle_buffer > 0"),
    (lambda: SequenceSource([[1, 2], [3]]), {"num_workers": -1}, r"num_workers must be .* 0"),
    (lambda: SequenceSource([[1, 2], [3]]), {"batch_size": 0}, r"batch_size must be an int >= 1"),
    (lambda: SequenceSource([[1, 2], [3]]), {"on_error": "ignore"}, r"on_error must be one of"),
    (lambda: SequenceSource([[1, 2], [3]]), {"partitions": 10**8},
     r"partitions=100000000 is more than the 3 samples"),
    (_Stream, {"last_batch": "rollover"}, r"rollover' needs a ShardedSource with known shard"),
    (_Stream, {"num_workers": 1, "multiprocessing_context": "spawn", "shuffle_buffer": 4},
     r"the dataset cannot be pickled"),
]


@pytest.mark.parametrize(("dataset", "kwargs", "match"), ITERABLE_BAD_SETTINGS)
def test_impossible_settings_fail_at_construction_for_iterable_datasets_too(dataset, kwargs,
                                                                            match) -> None:
    with pytest.raises(ValueError, match=match):
        ResumableLoader(dataset(), **kwargs)


def test_a_world_size_known_only_later_is_checked_at_the_first_use(monkeypatch) -> None:
    loader = ResumableLoader(IndexDataset(5), batch_size=4, drop_last=True)  # 1 rank: fine
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.setenv("RANK", "0")
    with pytest.raises(ValueError, match=r"5 samples are fewer than one global batch of 2 "
                                         r"ranks x batch_size 4; use a smaller batch_size"):
        len(loader)
    with pytest.raises(ValueError, match="smaller batch_size"):
        ResumableLoader(IndexDataset(5), batch_size=4, drop_last=True)


def test_what_is_only_risky_elsewhere_is_accepted() -> None:
    # Not pickled by fork; pickled fine by spawn (nothing is started until the first batch).
    assert len(list(ResumableLoader(HoldsALambda(8), batch_size=4, num_workers=1,
                                    multiprocessing_context="fork"))) == 2
    ResumableLoader(IndexDataset(8), batch_size=4, num_workers=1, collate_fn=_identity,
                    multiprocessing_context="spawn")
    assert start_method(None) in ("fork", "spawn", "forkserver")


def test_any_integral_number_is_taken_for_num_workers_and_prefetch_factor() -> None:
    """As DataLoader takes them (``operator.index``): a numpy integer too, kept as an int; a
    bool is still refused."""
    loader = ResumableLoader(IndexDataset(6), batch_size=2, num_workers=np.int64(2),
                             prefetch_factor=np.int64(3))
    assert (loader.num_workers, loader.prefetch_factor) == (2, 3)
    assert type(loader.num_workers) is type(loader.prefetch_factor) is int
    assert len(list(loader)) == 3
    for kwargs in ({"num_workers": True}, {"num_workers": 1, "prefetch_factor": True}):
        with pytest.raises(ValueError, match="must be an int"):
            ResumableLoader(IndexDataset(6), **kwargs)

# -- saved states --------------------------------------------------------------------------


def _loader(**kwargs: Any) -> ResumableLoader:
    options: dict[str, Any] = {"batch_size": 4, "shuffle": True, "seed": 1}
    options.update(kwargs)
    return ResumableLoader(IndexDataset(options.pop("n", 20)), **options)


def _saved(**kwargs: Any) -> dict[str, Any]:
    loader = _loader(**kwargs)
    iterator = iter(loader)
    next(iterator)
    next(iterator)
    return checkpoint_roundtrip(loader.state_dict())


MISMATCHES = [
    ({"n": 21}, ["dataset_len: saved 20, this loader 21"]),
    ({"seed": 2}, ["seed: saved 1, this loader 2"]),
    ({"batch_size": 5}, ["batch_size: saved 4, this loader 5"]),
    ({"last_batch": "drop"}, ["last_batch: saved 'keep', this loader 'drop'"]),
    ({"shuffle": False}, ["order: saved 'shuffled', this loader 'sequential'"]),
    ({"n": 30, "seed": 9, "batch_size": 2},
     ["dataset_len: saved 20, this loader 30", "seed: saved 1, this loader 9",
      "batch_size: saved 4, this loader 2"]),
]


@pytest.mark.parametrize(("changed", "named"), MISMATCHES)
def test_a_state_of_another_dataset_or_configuration_is_refused_naming_both_values(changed,
                                                                                   named):
    with pytest.raises(ValueError) as info:
        _loader(**changed).load_state_dict(_saved())
    message = str(info.value)
    assert all(line in message for line in named), message
    assert message.count("saved") == len(named), "only the mismatched fields are named"


CORRUPTED = [  # (changes to a valid state: None deletes the key, or a whole non-state)
    ({"version": 99}, r"unsupported state version: saved 99, this loader reads version 2"),
    ({"kind": "iterable"}, r"saved by a loader of kind 'iterable'"),
    ({"version": None}, r"unsupported state version: saved None"),
    ([1, 2, 3], r"a loader state must be a dict, got list"),
    ("not a state", r"a loader state must be a dict, got str"),
    ({"batches": None}, r"missing keys \['batches'\]"),
    ({"surprise": 1}, r"unknown keys \['surprise'\]"),
    ({"epoch": -1}, r"epoch=-1 is not an int >= 0"),
    ({"batches": "2"}, r"batches='2' is not an int >= 0"),
    ({"batches": True}, r"batches=True is not an int >= 0"),
    ({"world_size": 0}, r"world_size must be >= 1"),
    ({"batches": 6}, r"batches=6 is past the end of epoch 0, which has 5 batches"),
    ({"offset_batches": 3}, r"offset_batches=3 exceeds batches=2"),
    ({"offset_position": 25}, r"epoch 0 from position 25 on world size 1 has no plan"),
    ({"fingerprint": [("seed", 1)]}, r"fingerprint=\[\('seed', 1\)\] is not a dict"),
    ({"fingerprint": None}, r"dataset_len: saved None, this loader 20"),
    ({"parts": 7}, r"parts=7 is not a dict"),
]


@pytest.mark.parametrize(("changes", "match"), CORRUPTED)
def test_a_corrupted_or_unknown_state_is_refused(changes, match) -> None:
    state: Any = changes
    if isinstance(changes, dict):
        state = _saved()
        for key, value in changes.items():
            if value is None:
                del state[key]
            else:
                state[key] = value
    loader = _loader()
    with pytest.raises(ValueError, match=match):
        loader.load_state_dict(state)
    assert loader.state_dict()["batches"] == 0, "a refused state changes nothing"


def test_what_is_safe_to_change_is_accepted_and_resumes_exactly() -> None:
    expected = run_epochs(_loader(), range(2), key=lambda b: b["index"].tolist())
    for changed in ({"num_workers": 2, "prefetch_factor": 4}, {"num_workers": 1,
                    "persistent_workers": False, "timeout": 30}, {"pin_memory": True}):
        resumed = _loader(**changed)
        resumed.load_state_dict(_saved())
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")  # pin_memory without an accelerator
            rest = run_epochs(resumed, range(2), key=lambda b: b["index"].tolist())
        assert rest == [expected[0][2:], expected[1]]
        resumed.close()


def test_another_world_size_is_accepted_except_under_rollover() -> None:
    state = _saved(rank=0, world_size=2)
    consumed = [i for r in range(2) for b in run_epochs(_loader(rank=r, world_size=2), [0],
                                                        key=lambda b: b["index"].tolist())[0][:2]
                for i in b]
    elastic = _loader()
    elastic.load_state_dict(state)
    rest = [i for b in elastic for i in b["index"].tolist()]
    assert sorted(consumed + rest) == list(range(20))
    state = _saved(last_batch="rollover", rank=0, world_size=2)
    rollover = _loader(last_batch="rollover")
    rollover.load_state_dict(state)
    with pytest.raises(StateMismatchError,
                       match="rollover' with another world size: saved 2, now 1"):
        next(iter(rollover))


def test_too_few_leftovers_for_the_ranks_name_a_fix_that_changes_something() -> None:
    """7 samples on 3 ranks in batches of 1: 1 left after the full global batches, which
    batches of 1 cannot give up a sample to."""
    with pytest.raises(ValueError, match="last_batch='keep' cannot give each of 3 ranks"
                                         ".*batch_size=1; use last_batch='pad' or 'drop', "
                                         "a batch_size >= 2"):
        list(ResumableLoader(SequenceSource([list(range(7))]), batch_size=1, rank=0,
                             world_size=3))


def test_too_few_leftovers_take_a_sample_per_rank_from_the_last_full_round() -> None:
    """25 samples on 2 ranks in batches of 4: 1 left after three full global batches; as a
    map-style plan does, the third gives up a sample per rank, so each rank's last batch has
    one and every sample is read once."""
    ranks = [[batch.tolist() for batch in ResumableLoader(
        SequenceSource([list(range(25))]), batch_size=4, rank=rank, world_size=2)]
        for rank in range(2)]
    assert [[len(batch) for batch in batches] for batches in ranks] == [[4, 4, 4, 1],
                                                                       [4, 4, 3, 1]]
    assert sorted(i for batches in ranks for b in batches for i in b) == list(range(25))


@pytest.mark.parametrize(("size", "ranks"), [
    (1, "a world size dividing both the 2 samples left and the epoch's 6 (1 or 2 ranks)"),
    (4, "at most 2 ranks")])
def test_an_elastic_resume_with_too_few_leftovers_names_the_world_sizes_that_resume(
        size: int, ranks: str) -> None:
    """Map-style: 2 samples left after the saved global batches, resumed on 3 ranks: the
    refusal suggested a batch_size (which a resume cannot change, and which 2 samples on 3
    ranks refuse whatever it is); it names the world sizes that deal the rest and the next
    epoch."""
    total = 2 + 2 * size * 2  # two global batches on 2 ranks, then 2 samples
    saved = ResumableLoader(IndexDataset(total), batch_size=size, rank=0, world_size=2)
    iterator = iter(saved)
    for _ in range(2):
        next(iterator)
    resumed = ResumableLoader(IndexDataset(total), batch_size=size, rank=0, world_size=3)
    resumed.load_state_dict(saved.state_dict())
    with pytest.raises(ValueError, match=re.escape(
            "ranks a non-empty last batch from the 2 samples left with batch_size="
            f"{size}; resume on {ranks}, or from a checkpoint at an epoch's end") + "$"):
        next(iter(resumed))
