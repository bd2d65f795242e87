"""``HFSource``: a Hugging Face ``datasets.IterableDataset`` sharded by the loader, and the
map-style ``datasets.Dataset`` through ``ResumableLoader``. All data is made here."""

from __future__ import annotations

import os
import pickle
import subprocess
import sys
from collections import Counter
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets", reason="HFSource needs the optional datasets package")

from lightning_loaders import ResumableLoader  # noqa: E402
from lightning_loaders.sources.hf import HFSource  # noqa: E402
from lightning_loaders.testing import check_resume_at_every_step, run_epochs, to_plain  # noqa: E402
from tests.real_data_harness import check_real_data_ddp  # noqa: E402

N = 42
SHARDS = 4
SIZES = [11, 11, 10, 10]  # to_iterable_dataset(num_shards=4) of 42 rows: contiguous shards
KEPT = [i for i in range(N) if i % 5 != 0]  # what keep_most leaves


@pytest.fixture(autouse=True)
def _hf_cache(tmp_path, monkeypatch) -> None:
    """Builders (generator, Parquet) write their lock files under tmp_path, not in $HOME."""
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-cache")


def rows(n: int = N) -> datasets.Dataset:
    return datasets.Dataset.from_dict({"id": list(range(n)), "x": [i / 10 for i in range(n)]})


def double(example: dict[str, Any]) -> dict[str, Any]:
    return {"y": example["id"] * 2}


def double_batch(batch: dict[str, list[Any]]) -> dict[str, list[Any]]:
    return {"y": [i * 2 for i in batch["id"]]}


def keep_most(example: dict[str, Any]) -> bool:
    return example["id"] % 5 != 0


MAPPED: list[int] = []


def record_mapped(example: dict[str, Any]) -> dict[str, Any]:
    MAPPED.append(example["id"])
    return {}


def streamed(n: int = N) -> datasets.IterableDataset:
    return rows(n).to_iterable_dataset(num_shards=SHARDS)


PIPELINES = {
    "in memory": lambda: streamed(),
    "mapped": lambda: streamed().map(double),
    "filtered": lambda: streamed().filter(keep_most),
    "shuffled by datasets": lambda: streamed().shuffle(seed=5, buffer_size=4),
    "torch format": lambda: streamed().with_format("torch"),
}


def ids(batch: Any) -> list[int]:
    return [int(i) for i in batch["id"]]


def shard_of(i: int) -> int:
    bounds = [sum(SIZES[:k + 1]) for k in range(SHARDS)]
    return next(k for k, bound in enumerate(bounds) if i < bound)


def loader(source: Any, workers: int = 0, **options: Any) -> Any:
    return ResumableLoader(source, **{"batch_size": 4, "shuffle": True, "seed": 3,
                                      "num_workers": workers, **options})


def epochs_of(made: Any, epochs: int = 2) -> list[list[list[int]]]:
    out = run_epochs(made, range(epochs), key=ids)
    made.close()
    return out


# -- exactly once, shard order ------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2, 3])
@pytest.mark.parametrize("pipeline", ["in memory", "filtered", "shuffled by datasets"])
def test_every_sample_exactly_once_per_epoch(pipeline, workers) -> None:
    expected = KEPT if pipeline == "filtered" else list(range(N))
    runs = epochs_of(loader(HFSource(PIPELINES[pipeline]()), workers))
    for epoch in runs:
        assert sorted(i for batch in epoch for i in batch) == expected
    assert runs[0] != runs[1]


def test_the_shard_order_is_reshuffled_per_epoch_from_the_seed() -> None:
    def shard_order(epoch: list[list[int]]) -> list[int]:
        return list(dict.fromkeys(shard_of(i) for batch in epoch for i in batch))

    runs = epochs_of(loader(HFSource(streamed())), epochs=3)
    orders = [shard_order(epoch) for epoch in runs]
    assert all(sorted(order) == list(range(SHARDS)) for order in orders)
    assert len({tuple(order) for order in orders}) > 1
    assert runs == epochs_of(loader(HFSource(streamed())), epochs=3)
    assert runs != epochs_of(loader(HFSource(streamed()), seed=4), epochs=3)


class _OpenedShards(torch.utils.data.Dataset[Any]):
    """Item ``(shard, epoch)``: that shard of ``source`` in that epoch, read where it is asked."""

    def __init__(self, source: HFSource) -> None:
        self.source = source

    def __len__(self) -> int:
        return SHARDS * 2

    def __getitem__(self, item: int) -> list[Any]:
        self.source.set_epoch(item // SHARDS)
        return to_plain(list(self.source.open_shard(item % SHARDS)))


@pytest.mark.parametrize("pipeline", ["in memory", "shuffled by datasets", "torch format"])
def test_a_shard_reads_the_same_in_a_worker_process(pipeline) -> None:
    """``datasets`` splits its shards by worker and reseeds its buffer from the worker id when
    iterated in a worker; a shard read by ``HFSource`` is the same wherever it is read."""
    source = HFSource(PIPELINES[pipeline]())
    opened = _OpenedShards(source)
    main = [opened[i] for i in range(len(opened))]
    in_workers = list(torch.utils.data.DataLoader(opened, batch_size=None, num_workers=2))
    assert in_workers == main
    assert [len(shard) for shard in main] == source.shard_lengths * 2
    if pipeline == "shuffled by datasets":
        assert main[:SHARDS] != main[SHARDS:]  # the buffer is reseeded per epoch


def test_a_shuffled_dataset_gives_the_same_stream_with_one_worker_or_none() -> None:
    zero = epochs_of(loader(HFSource(PIPELINES["shuffled by datasets"]()), 0))
    one = epochs_of(loader(HFSource(PIPELINES["shuffled by datasets"]()), 1))
    assert zero == one


# -- resume -------------------------------------------------------------------------------------

RESUME_CASES = {
    "known, no workers": ("in memory", 0, {}),
    "known, mapped, 2 workers, buffer": ("mapped", 2, {"batch_size": 6, "shuffle_buffer": 5}),
    "unknown, no workers": ("filtered", 0, {}),
    "unknown, 2 workers": ("filtered", 2, {"batch_size": 6}),
    "shuffled by datasets, unknown, 2 workers": ("shuffled by datasets", 2, {
        "batch_size": 6, "lengths": None}),
    "torch format, unknown, no workers": ("torch format", 0, {"lengths": None}),
}


@pytest.mark.parametrize("case", RESUME_CASES)
def test_resume_at_every_step_is_exact(case) -> None:
    pipeline, workers, options = RESUME_CASES[case]
    lengths = options.pop("lengths", "auto")

    def make() -> Any:
        return loader(HFSource(PIPELINES[pipeline](), lengths=lengths), workers, **options)

    full = check_resume_at_every_step(make, epochs=2, key=ids)
    expected = KEPT if pipeline == "filtered" else list(range(N))
    for epoch in full:
        assert sorted(i for batch in epoch for i in batch) == expected


@pytest.mark.parametrize("pipeline", ["in memory", "filtered", "shuffled by datasets"])
def test_open_shard_at_any_position_with_or_without_a_state(pipeline) -> None:
    source = HFSource(PIPELINES[pipeline]())
    for epoch in (0, 1):
        source.set_epoch(epoch)
        for shard in range(SHARDS):
            full = ids_of(source.open_shard(shard))
            for start in range(len(full) + 1):
                assert ids_of(source.open_shard(shard, start)) == full[start:]
            for start in (0, 3):  # read on a bit, then reopen from the reader's state
                reader = source.open_shard(shard, start)
                head = ids_of(next(reader) for _ in range(2))
                state = pickle.loads(pickle.dumps(reader.state_dict()))
                assert state["position"] == start + 2 and head == full[start:start + 2]
                assert ids_of(source.open_shard(shard, start + 2, state)) == full[start + 2:]


def ids_of(samples: Any) -> list[int]:
    return [int(sample["id"]) for sample in samples]


def test_a_saved_state_seeks_instead_of_mapping_the_skipped_rows_again() -> None:
    source = HFSource(streamed().map(record_mapped))
    reader = source.open_shard(1)
    for _ in range(7):
        next(reader)
    state = reader.state_dict()
    MAPPED.clear()
    assert ids_of(source.open_shard(1, 7, state)) == list(range(18, 22))
    assert MAPPED == list(range(18, 22))


def test_a_state_from_another_epoch_or_position_is_not_trusted() -> None:
    source = HFSource(streamed())
    reader = source.open_shard(2)
    next(reader)
    state = reader.state_dict()
    source.set_epoch(1)
    assert ids_of(source.open_shard(2, 1, state)) == list(range(23, 32))
    source.set_epoch(0)
    assert ids_of(source.open_shard(2, 4, state)) == list(range(26, 32))


def _partial_state(make: Any, batches: int) -> dict[str, Any]:
    made = make()
    iterator = iter(made)
    for _ in range(batches):
        next(iterator)
    state = made.state_dict()
    made.close()
    return state


@pytest.mark.parametrize("pipeline", ["in memory", "filtered"])
def test_resume_with_another_num_workers(pipeline) -> None:
    """Known lengths: mid-epoch and at an epoch boundary, the saved canonical partitions go
    on (the saving layout's stream). Unknown lengths: refused mid-epoch with the reason; at
    an epoch boundary the next epoch is the new worker count's."""

    def make(workers: int) -> Any:
        return loader(HFSource(PIPELINES[pipeline]()), workers)

    changed = make(2)
    known = changed.schedule.known
    changed.load_state_dict(_partial_state(lambda: make(0), 3))
    if known:
        assert run_epochs(changed, [0], key=ids) == [epochs_of(make(0))[0][3:]]
    else:
        with pytest.raises(ValueError, match="cannot resume mid-epoch.*repeat or skip"):
            next(iter(changed))
    changed.close()
    done = make(0)
    run_epochs(done, [0])
    resumed = make(2)
    resumed.load_state_dict(done.state_dict())
    assert run_epochs(resumed, [1], key=ids) == epochs_of(make(0 if known else 2))[1:]
    resumed.close()


# -- lengths ------------------------------------------------------------------------------------


def _write_parquet(root: Path) -> list[str]:
    paths = []
    for part in range(3):
        paths.append(str(root / f"part{part}.parquet"))
        rows().shard(num_shards=3, index=part, contiguous=True).to_parquet(paths[-1],
                                                                          batch_size=5)
    return paths


def _saved_dataset(root: Path) -> datasets.Dataset:
    rows().save_to_disk(str(root / "saved"))
    return datasets.load_from_disk(str(root / "saved"))


def _generated():
    yield from ({"id": i} for i in range(N))


KNOWN = {
    "in memory": lambda root: streamed(),
    "saved and reloaded": lambda root: _saved_dataset(root).to_iterable_dataset(SHARDS),
    "mapped, renamed, selected": lambda root: streamed().map(double).rename_column(
        "x", "z").select_columns(["id", "y"]),
    "torch format": lambda root: streamed().with_format("torch"),
    "shuffled by datasets": lambda root: streamed().shuffle(seed=1, buffer_size=8),
    "arrow file": lambda root: datasets.IterableDataset.from_file(
        _saved_dataset(root).cache_files[0]["filename"]),
    "parquet files": lambda root: datasets.IterableDataset.from_parquet(
        _write_parquet(root)),
    "parquet row groups": lambda root: datasets.IterableDataset.from_parquet(
        _write_parquet(root)).reshard(),
}
UNKNOWN = {
    "filtered": lambda: streamed().filter(keep_most),
    "batched map": lambda: streamed().map(double_batch, batched=True, batch_size=3),
    "skip, one shard": lambda: rows(N).to_iterable_dataset(num_shards=1).skip(3),
    "take, one shard": lambda: rows(N).to_iterable_dataset(num_shards=1).take(30),
    "generator": lambda: datasets.IterableDataset.from_generator(_generated),
}


@pytest.mark.parametrize("pipeline", KNOWN)
def test_lengths_known_from_metadata_are_exact(pipeline, tmp_path) -> None:
    source = HFSource(KNOWN[pipeline](tmp_path))
    lengths = source.shard_lengths
    assert lengths is not None and len(source) == N
    assert lengths == [sum(1 for _ in source.open_shard(i)) for i in range(len(lengths))]
    assert sorted(int(i) for i in ids_of(source)) == list(range(N))
    if pipeline == "parquet row groups":
        assert len(lengths) == 9  # 3 files x 3 row groups of 5, 5, 4 rows


@pytest.mark.parametrize("pipeline", UNKNOWN)
def test_lengths_are_unknown_when_the_pipeline_can_drop_or_add_rows(pipeline) -> None:
    source = HFSource(UNKNOWN[pipeline]())
    assert source.shard_lengths is None
    with pytest.raises(TypeError):
        len(loader(source, shuffle=source.num_shards > 1))
    scanned = HFSource(UNKNOWN[pipeline](), lengths="scan")
    assert scanned.shard_lengths == [sum(1 for _ in source.open_shard(i))
                                     for i in range(source.num_shards)]


@pytest.mark.parametrize(("step", "named"), [
    (lambda d: d.take(10), "take"), (lambda d: d.skip(5), "skip"),
    (lambda d: datasets.interleave_datasets([d, d.map(double)]), "first_exhausted"),
    (lambda d: datasets.interleave_datasets([d, d.take(3)], stopping_strategy="all_exhausted"),
     "all_exhausted"),
    (lambda d: d.batch(3), r"batch\(n\)"),
    (lambda d: d.add_column("label", list(range(100, 100 + N))), "map.*with_indices=True"),
    (lambda d: d.filter(lambda _, i: i % 2 == 0, with_indices=True),
     "filter.*with_indices=True")])
def test_steps_that_differ_per_shard_are_refused_and_read_whole_instead(step, named) -> None:
    """Read shard by shard, ``take(10)`` would keep 10 samples spread over the shards, not the
    stream's first 10, and an index given to ``map``/``filter`` restarts in every shard;
    passed to ``ResumableLoader`` directly, the stream is read whole."""
    dataset = step(streamed())
    with pytest.raises(ValueError, match=f"shard by shard.*{named}.*ResumableLoader directly"):
        HFSource(dataset)
    got = ResumableLoader(dataset, batch_size=None, num_workers=2)
    assert sorted(map(str, got)) == sorted(map(str, dataset))


@pytest.mark.parametrize("policy", ["keep", "drop", "pad", "rollover"])
def test_known_lengths_give_an_exact_len_and_every_last_batch_policy(policy) -> None:
    world, size = 2, 4
    ranks = []
    for rank in range(world):
        made = loader(HFSource(streamed()), last_batch=policy, rank=rank, world_size=world)
        ranks.append(run_epochs(made, range(2), key=ids))
        if policy != "rollover":
            assert len(made) == len(ranks[-1][0]) == len(ranks[-1][1])
    read = [[i for run in ranks for batch in run[epoch] for i in batch] for epoch in range(2)]
    for epoch in range(2):
        assert len(ranks[0][epoch]) == len(ranks[1][epoch])
        if policy == "keep":
            assert sorted(read[epoch]) == list(range(N))
        if policy == "drop":
            assert len(read[epoch]) == len(set(read[epoch])) == N // (world * size) * world * size
        if policy in ("drop", "pad", "rollover"):
            assert all(len(batch) == size for run in ranks for batch in run[epoch])
        if policy == "pad":
            assert set(read[epoch]) == set(range(N))
    if policy == "rollover":
        counts = Counter(read[0] + read[1])  # epoch 0's leftovers open epoch 1
        assert len(read[0]) == len(set(read[0])) and set(counts) == set(range(N))
        assert max(counts.values()) <= 2
        assert sum(counts.values()) == 2 * N // (world * size) * world * size


def test_known_lengths_with_workers_give_len_and_equal_counts() -> None:
    made = loader(HFSource(streamed()), 2, rank=1, world_size=2)
    runs = epochs_of(made)
    assert len(made) == len(runs[0]) == len(runs[1]) == 6  # 21 samples of rank 1, 4 a batch


def test_a_wrong_declared_length_is_an_error_not_a_silent_loss() -> None:
    short = loader(HFSource(streamed(), lengths=[10, 11, 10, 10]), shuffle=False)
    with pytest.raises(Exception, match="shard 0 has more samples than its declared length 10"):
        list(short)
    long = loader(HFSource(streamed(), lengths=[12, 11, 10, 10]), shuffle=False)
    with pytest.raises(Exception, match="shard 0 ended at sample 11.*declared length"):
        list(long)


# -- what is refused ----------------------------------------------------------------------------


def test_a_dataset_split_by_rank_is_refused_naming_the_fix() -> None:
    from datasets.distributed import split_dataset_by_node

    split = split_dataset_by_node(streamed(), rank=1, world_size=2)
    with pytest.raises(ValueError, match="split_dataset_by_node.*pass the unsplit dataset"):
        HFSource(split)


@pytest.mark.parametrize("generator", [None, "unseeded"])
def test_a_shuffle_with_a_seed_drawn_in_the_process_is_refused_naming_the_fix(generator) -> None:
    """Another rank, or the run a resume starts, would draw another order; a seeded one (the
    pipelines above) or a seeded generator is accepted."""
    drawn = None if generator is None else np.random.default_rng()
    with pytest.raises(ValueError, match=r"seed drawn in this process.*shuffle\(seed=\.\.\."):
        HFSource(streamed().shuffle(generator=drawn, buffer_size=4))
    HFSource(streamed().shuffle(generator=np.random.default_rng(7), buffer_size=4))


@pytest.mark.parametrize(
    ("dataset", "lengths", "error", "match"),
    [
        (rows(), "auto", TypeError, "give a map-style datasets.Dataset to ResumableLoader"),
        ([{"id": 0}], "auto", TypeError, "takes a datasets.IterableDataset, got list"),
        (streamed(), "guess", ValueError, "'auto', 'scan'"),
        (streamed(), [11, 11], ValueError, "2 entries for 4 shards"),
        (streamed(), [11, 11, 10, -1], ValueError, "ints >= 0"),
    ],
)
def test_bad_input_is_refused_with_a_clear_error(dataset, lengths, error, match) -> None:
    with pytest.raises(error, match=match):
        HFSource(dataset, lengths=lengths)


# -- identity, pickling, imports ----------------------------------------------------------------


def test_pickles_and_keeps_a_stable_fingerprint() -> None:
    source = HFSource(streamed().map(double))
    source.set_epoch(1)
    copy = pickle.loads(pickle.dumps(source))
    assert copy.fingerprint == source.fingerprint == HFSource(streamed().map(double)).fingerprint
    assert [ids_of(copy.open_shard(i)) for i in range(SHARDS)] == [
        ids_of(source.open_shard(i)) for i in range(SHARDS)]
    others = {HFSource(streamed()).fingerprint, HFSource(streamed().filter(keep_most)).fingerprint,
              HFSource(streamed(), lengths=None).fingerprint,
              HFSource(streamed().with_format("torch")).fingerprint,
              HFSource(rows(40).to_iterable_dataset(num_shards=SHARDS)).fingerprint,
              HFSource(streamed().map(record_mapped)).fingerprint}
    assert source.fingerprint not in others and len(others) == 6


def test_a_state_of_other_files_or_another_shuffle_seed_is_refused(tmp_path: Path) -> None:
    """The fingerprint names the files read (as the file sources do) and how each step was
    built (a ``shuffle`` seed and buffer, a ``map``'s batching): a state saved over other files
    or another seed would resume another stream."""
    for name in ("a0", "a1", "b0", "b1"):
        rows(10).to_parquet(str(tmp_path / f"{name}.parquet"))

    def parquet(prefix: str) -> Any:
        files = [str(tmp_path / f"{prefix}{i}.parquet") for i in range(2)]
        return datasets.load_dataset("parquet", data_files=files, streaming=True, split="train")

    def state_after_a_batch(dataset: Any) -> dict[str, Any]:
        loader = ResumableLoader(HFSource(dataset), batch_size=4)
        next(iter(loader))
        return loader.state_dict()

    pairs = [(parquet("a"), parquet("b")),
             (streamed().shuffle(seed=1, buffer_size=6), streamed().shuffle(seed=2, buffer_size=6)),
             (streamed().shuffle(seed=1, buffer_size=6), streamed().shuffle(seed=1, buffer_size=8)),
             (streamed().map(double_batch, batched=True, batch_size=4),
              streamed().map(double_batch, batched=True, batch_size=8))]
    for saved, other in pairs:
        state = state_after_a_batch(saved)
        with pytest.raises(ValueError, match="source: saved 'HFSource.*this loader 'HFSource"):
            ResumableLoader(HFSource(other), batch_size=4).load_state_dict(state)
        ResumableLoader(HFSource(saved), batch_size=4).load_state_dict(state)  # its own loads
    code = ("import datasets, sys; from lightning_loaders.sources.hf import HFSource; "
            "files = sys.argv[1:]; print(HFSource(datasets.load_dataset('parquet', "
            "data_files=files, streaming=True, split='train')).fingerprint)")
    files = [str(tmp_path / f"a{i}.parquet") for i in range(2)]
    child = subprocess.run([sys.executable, "-c", code, *files], capture_output=True, text=True,
                           check=True, timeout=120)
    assert child.stdout.strip() == HFSource(parquet("a")).fingerprint  # the same in any process


def test_importing_the_package_does_not_import_datasets() -> None:
    code = ("import sys, lightning_loaders, lightning_loaders.sources.hf; "
            "print('datasets' in sys.modules)")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         check=True)
    assert out.stdout.strip() == "False"


# -- the map-style datasets.Dataset -------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_a_map_style_dataset_is_read_exactly_once_per_epoch_and_resumes(workers) -> None:
    def make() -> Any:
        return ResumableLoader(rows(), batch_size=4 if workers == 0 else 8, shuffle=True,
                               seed=2, num_workers=workers)

    full = check_resume_at_every_step(make, epochs=2, key=ids)
    for epoch in full:
        assert sorted(i for batch in epoch for i in batch) == list(range(N))
    assert full[0] != full[1]


def _jsonl(root: Path, name: str, first: int, n: int = N) -> str:
    """A JSON Lines file of ``n`` rows with ids from ``first`` on."""
    path = root / f"{name}.jsonl"
    path.write_text("".join(f'{{"id": {first + i}}}\n' for i in range(n)))
    return str(path)


def unhashable_map(dataset: datasets.Dataset) -> datasets.Dataset:
    """A ``map`` whose function ``datasets`` cannot hash (it holds a generator): it gets a
    random ``_fingerprint``, new in every process and every call, as many user functions do."""
    factor = (k for k in (2,))

    def twice(example: dict[str, Any]) -> dict[str, Any]:
        assert factor is not None
        return {"y": example["id"] * 2}

    return dataset.map(twice)


def from_json(path: str) -> datasets.Dataset:
    """The dataset the fresh-process test rebuilds: the file, a ``map`` with a random
    fingerprint, and a transform (user code the identity must not run)."""
    dataset = unhashable_map(datasets.load_dataset("json", data_files=[path], split="train"))
    dataset.set_transform(lambda batch: {"id": [i + 1000 for i in batch["id"]]})
    return dataset


def json_loader(dataset: datasets.Dataset) -> Any:
    return ResumableLoader(dataset, batch_size=4, shuffle=True, seed=1)


_SAVE_IN_A_FRESH_PROCESS = """
import sys, torch
from tests.sources.test_hf import from_json, json_loader
dataset = from_json(sys.argv[1])
loader = json_loader(dataset)
iterator = iter(loader)
next(iterator), next(iterator)
torch.save({"state": loader.state_dict(), "fingerprint": dataset._fingerprint}, sys.argv[2])
"""


def test_a_map_style_state_resumes_over_the_same_rows_rebuilt_in_another_process(
        tmp_path) -> None:
    """The identity is a digest of a few rows read as Arrow: the same file rebuilt in a fresh
    process, through a ``map`` whose random ``_fingerprint`` differs there, resumes exactly."""
    path = _jsonl(tmp_path, "a", 0)
    saved = tmp_path / "state.pt"
    env = {**os.environ, "HF_DATASETS_CACHE": str(tmp_path / "child-cache"),
           "HF_DATASETS_OFFLINE": "1"}
    subprocess.run([sys.executable, "-c", _SAVE_IN_A_FRESH_PROCESS, path, str(saved)],
                   check=True, timeout=300, env=env, cwd=Path(__file__).parents[2])
    child = torch.load(saved, weights_only=False)
    dataset = from_json(path)
    assert child["fingerprint"] != dataset._fingerprint  # Hugging Face's would refuse it
    assert child["state"]["fingerprint"]["content"].startswith("datasets.Dataset rows ")
    whole = run_epochs(json_loader(from_json(path)), [0], key=ids)[0]
    resumed = json_loader(dataset)
    resumed.load_state_dict(child["state"])
    assert [ids(batch) for batch in resumed] == whole[2:]


def test_a_map_style_state_over_other_rows_of_the_same_length_is_refused(tmp_path) -> None:
    """Other files, another shuffle of the rows or another selection, with as many rows: a
    state saved over one is refused by the other, both identities shown; each loads into a
    loader over its own rows, read again from its files."""
    a, b = _jsonl(tmp_path, "a", 0), _jsonl(tmp_path, "b", 5000)

    def load(path: str) -> datasets.Dataset:
        return datasets.load_dataset("json", data_files=[path], split="train")

    pairs = [(lambda: load(a), lambda: load(b)),
             (lambda: load(a).shuffle(seed=1), lambda: load(a).shuffle(seed=2)),
             (lambda: load(a).select(range(N - 1)), lambda: load(a).select(range(1, N)))]
    for saved, other in pairs:
        loader = json_loader(saved())
        next(iter(loader))
        state = loader.state_dict()
        with pytest.raises(ValueError, match=r"content: saved 'datasets.Dataset rows \w+', "
                                             r"this loader 'datasets.Dataset rows \w+'"):
            json_loader(other()).load_state_dict(state)
        json_loader(saved()).load_state_dict(state)


def test_a_map_style_state_saved_without_a_content_identity_still_loads(tmp_path) -> None:
    """A state of the release before the identity (a fingerprint without ``content``) is
    checked as it was then, and resumes."""
    dataset = datasets.load_dataset("json", data_files=[_jsonl(tmp_path, "a", 0)],
                                    split="train")
    whole = run_epochs(json_loader(dataset), [0], key=ids)[0]
    loader = json_loader(dataset)
    iterator = iter(loader)
    next(iterator), next(iterator), next(iterator)
    state = loader.state_dict()
    del state["fingerprint"]["content"]
    assert set(state["fingerprint"]) == {"dataset_len", "seed", "batch_size", "last_batch",
                                         "order"}
    resumed = json_loader(dataset)
    resumed.load_state_dict(state)
    assert [ids(batch) for batch in resumed] == whole[3:]


# -- DDP under a real Trainer -------------------------------------------------------------------


def ddp_dataset(data_dir: str) -> HFSource:
    """The DDP script's dataset: the rows saved by the test, streamed in 4 shards."""
    saved = datasets.load_from_disk(str(Path(data_dir) / "saved"))
    return HFSource(saved.to_iterable_dataset(num_shards=SHARDS).map(double))


def test_ddp_training_reads_every_sample_once_per_epoch_and_resumes(tmp_path) -> None:
    data_dir = tmp_path / "data"
    _saved_dataset(data_dir)
    runs = check_real_data_ddp("tests.sources.test_hf:ddp_dataset", data_dir, total=N,
                               result_dir=tmp_path / "ddp", workers=2, shuffle=True)
    assert runs[0]["len"] == 6  # 21 samples per rank, 4 a batch
