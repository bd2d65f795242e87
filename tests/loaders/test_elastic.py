"""Canonical partitions: an iterable dataset of known lengths resumes mid-epoch under another
layout (ranks x workers) with nothing repeated and nothing lost."""

import json
from collections import Counter
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest

from lightning_loaders import ResumableLoader
from lightning_loaders.schedule.partition_plan import deal, partition_epoch
from lightning_loaders.schedule.shard_plan import PlanConfig
from lightning_loaders.sources.parquet import ParquetSource
from lightning_loaders.sources.shards import RecordFiles, write_records
from lightning_loaders.testing import run_epochs, set_epoch

LENGTHS = [9, 23, 4, 0, 15, 11, 6]  # uneven, one empty shard
TOTAL = sum(LENGTHS)


def _decode(payload: bytes) -> int:
    return int(json.loads(payload)["id"])


def _ids(batch) -> list[int]:
    return [int(i) for i in (batch["id"] if isinstance(batch, dict) else batch)]


@pytest.fixture(scope="module", params=["records", "parquet"])
def source_factory(request, tmp_path_factory):
    root = tmp_path_factory.mktemp(request.param)
    paths, first = [], 0
    for shard, n in enumerate(LENGTHS):
        ids = list(range(first, first + n))
        first += n
        if request.param == "records":
            paths.append(root / f"part{shard}.rec")
            write_records(paths[-1], [json.dumps({"id": i}).encode() for i in ids])
        else:
            paths.append(root / f"part{shard}.parquet")
            pq.write_table(pa.table({"id": pa.array(ids, pa.int64())}), paths[-1],
                           row_group_size=4)
    if request.param == "records":
        return lambda: RecordFiles(paths, lengths="scan", decode=_decode)
    return lambda: ParquetSource(paths)


def _make(source_factory, rank: int, world: int, workers: int, **options):
    return ResumableLoader(source_factory(), batch_size=3, shuffle=True, seed=5,
                           num_workers=workers, rank=rank, world_size=world, **options)


def _states_after(source_factory, world: int, workers: int, epoch: int, steps: int,
                  **options):
    """Every rank's state and delivered ids after ``steps`` batches of ``epoch``."""
    states, seen = [], []
    for rank in range(world):
        loader = _make(source_factory, rank, world, workers, **options)
        set_epoch(loader, epoch)
        iterator = iter(loader)
        seen += [i for _ in range(steps) for i in _ids(next(iterator))]
        states.append(loader.state_dict())
        loader.close()
    return states, seen


def _rest(source_factory, state, world: int, workers: int, epochs: int, **options):
    """Each epoch's ids delivered by ``world`` ranks resumed from ``state``."""
    out: list[list[int]] = [[] for _ in range(epochs)]
    lengths = set()
    for rank in range(world):
        loader = _make(source_factory, rank, world, workers, **options)
        loader.load_state_dict(state)
        for e in range(epochs):
            batches = [_ids(b) for b in loader]
            lengths.add(len(batches))
            out[e] += [i for b in batches for i in b]
        loader.close()
    assert len(lengths) <= epochs  # every rank has the same number of batches per epoch
    return out


@pytest.mark.parametrize("steps", [1, 4, 7])
def test_two_by_two_checkpoints_resume_exactly_once_on_other_layouts(source_factory,
                                                                     steps) -> None:
    """Saved on 2 ranks x 2 workers mid-epoch 1; resumed on 1 rank x 3 workers and on 2 ranks
    x 0 workers: the epoch is exactly once, and so is the next one."""
    states, seen = _states_after(source_factory, 2, 2, epoch=1, steps=steps)
    assert states[0] == states[1]
    for world, workers in ((1, 3), (2, 0)):
        rest, following = _rest(source_factory, states[0], world, workers, epochs=2)
        assert sorted(seen + rest) == list(range(TOTAL)), (world, workers)
        assert sorted(following) == list(range(TOTAL)), (world, workers)


def test_a_resumed_resume_under_a_third_layout_is_exact(source_factory) -> None:
    states, seen = _states_after(source_factory, 2, 2, epoch=0, steps=2)
    middle = []
    second = []
    for rank in range(1):
        loader = _make(source_factory, rank, 1, 3)
        loader.load_state_dict(states[0])
        iterator = iter(loader)
        middle += [i for _ in range(3) for i in _ids(next(iterator))]
        second.append(loader.state_dict())
        loader.close()
    (rest,) = _rest(source_factory, second[0], 2, 1, epochs=1)
    assert sorted(seen + middle + rest) == list(range(TOTAL))


@pytest.mark.parametrize("buffer", [0, 5])
def test_one_process_stream_is_the_same_for_any_num_workers(source_factory, buffer) -> None:
    """Given the number of partitions, the stream (shuffle window included) does not depend
    on num_workers; a resume with another num_workers continues it exactly."""
    streams = [run_epochs(_make(source_factory, 0, 1, w, partitions=6, shuffle_buffer=buffer),
                          range(2), key=_ids) for w in (0, 2, 3)]
    assert streams[0] == streams[1] == streams[2]
    assert sorted(i for b in streams[0][0] for i in b) == list(range(TOTAL))
    for steps in (1, 5, 9):
        (state,), _ = _states_after(source_factory, 1, 2, 0, steps, partitions=6,
                                    shuffle_buffer=buffer)
        for workers in (0, 3):
            loader = _make(source_factory, 0, 1, workers, shuffle_buffer=buffer)
            loader.load_state_dict(state)  # partitions taken from the state
            assert run_epochs(loader, [0, 1], key=_ids) == [streams[0][0][steps:],
                                                            streams[0][1]]
            loader.close()


def test_the_default_partitions_are_saved_and_a_conflicting_request_is_refused(
        source_factory) -> None:
    (state,), _ = _states_after(source_factory, 1, 2, 0, 2)
    assert state["parts"]["slots"]["partitions"] == 2
    loader = _make(source_factory, 0, 1, 0, partitions=4)
    loader.load_state_dict(state)
    with pytest.raises(ValueError, match="partitions=2"):
        next(iter(loader))
    loader.close()


def test_the_shuffle_window_is_per_partition_and_keeps_each_epoch_exactly_once(
        source_factory) -> None:
    plain = run_epochs(_make(source_factory, 0, 1, 0, partitions=3), range(1), key=_ids)
    mixed = run_epochs(_make(source_factory, 0, 1, 2, partitions=3, shuffle_buffer=4),
                       range(1), key=_ids)
    assert plain != mixed
    assert sorted(i for b in mixed[0] for i in b) == list(range(TOTAL))


@pytest.mark.parametrize("policy", ["keep", "drop", "pad"])
@pytest.mark.parametrize("world", [1, 2, 3, 4])
def test_the_deal_gives_equal_counts_and_the_policy_samples(policy, world) -> None:
    config = PlanConfig(tuple(LENGTHS), len(LENGTHS), False, 3, policy, True, 1)
    plan = partition_epoch(config, 0, 6)
    assert sum(plan.lengths) == (TOTAL // 3 * 3 if policy == "drop" else TOTAL)
    ranks = deal(config, 0, 6, world)
    assert len({len(r) for r in ranks}) == 1
    counts = Counter((p, s + k) for r in ranks for b in r for p, s, n in b for k in range(n))
    samples = sum(counts.values())
    if policy == "keep":
        assert samples == TOTAL and max(counts.values()) == 1
    if policy == "pad":
        assert samples == len(ranks[0]) * world * 3 and len(counts) == TOTAL
    if policy == "drop":
        assert max(counts.values()) == 1 and all(sum(n for _, _, n in b) == 3
                                                 for r in ranks for b in r)


def test_unknown_lengths_still_refuse_a_changed_layout_mid_epoch(tmp_path: Path) -> None:
    path = tmp_path / "a.rec"
    write_records(path, [json.dumps({"id": i}).encode() for i in range(20)])

    def make(workers: int):
        return ResumableLoader(RecordFiles([path], decode=_decode), batch_size=3,
                               num_workers=workers)

    loader = make(0)
    iterator = iter(loader)
    next(iterator)
    other = make(2)
    other.load_state_dict(loader.state_dict())
    with pytest.raises(ValueError, match="canonical partitions"):
        next(iter(other))
    other.close()
