"""``Mix`` under ``ResumableLoader``: three real sources (map-style, Parquet through
``ParquetSource``, a Hugging Face ``datasets.Dataset``), every exhaustion mode, resume from every
step with and without workers, weight changes mid-epoch, and elastic resume across world sizes."""

from __future__ import annotations

import copy
import pickle
import random
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, IterableDataset, TensorDataset

from lightning_loaders import (
    Mix,
    ResumableLoader,
    SampleFetchError,
    StateMismatchError,
    make_resumable,
    sample_rng,
)
from lightning_loaders.sources.shards import GeneratorSource, RecordFiles, write_records
from lightning_loaders.testing import (
    check_resume_at_every_step,
    checkpoint_roundtrip,
    run_epochs,
)
from tests.mix_sources import SIZES, gated_mix_loader, key, three_source_mix, write_sources
from tests.orders.test_mix import counting, proportions_match

pytest.importorskip("datasets")
pytest.importorskip("pyarrow")


def loader(root: Path, num_workers: int = 0, **kwargs) -> ResumableLoader:
    options = {"samples_per_epoch": 26, **kwargs}
    return ResumableLoader(three_source_mix(root, **options), batch_size=4, seed=3,
                           num_workers=num_workers)


def test_indices_reach_every_source_and_batches_keep_their_order(tmp_path: Path) -> None:
    mix = three_source_mix(tmp_path)
    assert len(mix) == sum(SIZES)
    assert mix[0]["index"] == 0 and mix[12]["index"] == 1000 and mix[42]["index"] == 2000
    assert mix.source_of(41) == (1, 29)
    picked = [45, 3, 13, 20, 44, 12]
    assert [s["index"] for s in mix.__getitems__(picked)] == [2003, 3, 1001, 1008, 2002, 1000]
    with pytest.raises(IndexError):
        mix.source_of(62)
    copy = pickle.loads(pickle.dumps(mix))
    assert copy[13] == mix[13] and copy.order.fingerprint == mix.order.fingerprint


@pytest.mark.parametrize("duplicate", [copy.deepcopy, lambda x: pickle.loads(pickle.dumps(x))],
                         ids=["deepcopy", "pickle"])
def test_a_copied_loader_changes_the_weights_of_its_own_stream(duplicate: Any) -> None:
    """A loader copied before its first ``iter()`` (a config tool, ``ddp_spawn``) keeps its
    ``Mix``'s order, shared with its plan: ``set_weights`` on the copy's dataset steers it."""
    def make() -> ResumableLoader:
        mix = Mix([list(range(5)), list(range(100, 107))], [1, 1], batch_size=4,
                  samples_per_epoch=24)
        return ResumableLoader(mix, batch_size=4)

    original, copied = make(), duplicate(make())
    copied.dataset.set_weights([0, 1], 2)
    assert copied.dataset.order is copied.schedule.order
    batches = [batch.tolist() for batch in copied]
    assert all(i >= 100 for batch in batches[2:] for i in batch)
    assert batches[:2] == [batch.tolist() for batch in original][:2]


def test_a_state_over_other_member_files_is_refused(tmp_path: Path) -> None:
    """The mixture's fingerprint holds each member's own: a state saved over other files of
    the same lengths would read other samples."""
    for name in ("a", "b"):
        write_records(tmp_path / f"{name}.rec", [bytes([i]) for i in range(6)])

    def make(name: str) -> ResumableLoader:
        records = RecordFiles([tmp_path / f"{name}.rec"], lengths="scan",
                              decode=lambda payload: torch.tensor(payload[0]))
        return ResumableLoader(Mix([records, torch.arange(4)], [1, 1]), batch_size=2)

    saved = make("a")
    next(iter(saved))
    with pytest.raises(ValueError, match="order: saved 'mix"):
        make("b").load_state_dict(saved.state_dict())
    make("a").load_state_dict(saved.state_dict())


def test_a_record_file_source_is_read_by_random_access(tmp_path: Path) -> None:
    path = tmp_path / "a.rec"
    write_records(path, [bytes([i]) for i in range(9)])
    mix = Mix([RecordFiles([path], lengths="scan"), torch.arange(5)], [1, 1])
    assert [mix[i] for i in (0, 4, 8)] == [b"\x00", b"\x04", b"\x08"] and int(mix[9]) == 0


def test_sources_without_random_access_are_refused(tmp_path: Path) -> None:
    unknown = GeneratorSource(lambda shard: iter(range(3)), shards=[0, 1])
    with pytest.raises(TypeError, match="does not know its shard lengths"):
        Mix([unknown, torch.arange(3)], [1, 1])

    class Stream(IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(TypeError, match="not indexable"):
        Mix([Stream(), torch.arange(3)], [1, 1])
    with pytest.raises(ValueError, match="source 1 .* is empty"):
        Mix([torch.arange(3), []], [1, 1])


def test_a_mix_of_mixes_is_refused_with_the_flat_weights_to_give() -> None:
    """Read as a member, an inner Mix is an index range drawn uniformly: a member it weighs 0
    came up as often as the others."""
    inner = Mix([torch.arange(3), torch.arange(3)], [1, 0])
    with pytest.raises(TypeError, match="source 0 is itself a Mix.*product of its weight"):
        Mix([inner, torch.arange(3)], [1, 1])


def _three(shard: int):
    return iter(range(3))


def test_a_source_shorter_than_its_declared_length_says_so() -> None:
    """It used to surface as a ``StopIteration`` with an empty message."""
    short = GeneratorSource(_three, [0], lengths=[5])
    loader = ResumableLoader(Mix([list(range(5)), short], [1, 1]), batch_size=2)
    with pytest.raises(SampleFetchError, match=r"shard 0 of the GeneratorSource ended before "
                                               r"sample [34].*fix the source's shard_lengths"):
        list(loader)


class _FailsAt7(torch.utils.data.Dataset):
    def __len__(self) -> int:
        return 10

    def __getitem__(self, index: int) -> int:
        if index == 7:
            raise KeyError(index)
        return index


@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_source_s_error_names_the_source_and_its_own_index(num_workers: int) -> None:
    """The mixture's index alone (17) sent the user to a sample the failing source does not
    have; the error names the source and the index it was asked for (7)."""
    loader = ResumableLoader(Mix([list(range(10)), _FailsAt7()], [1, 1]), batch_size=2,
                             num_workers=num_workers)
    with pytest.raises(SampleFetchError, match=r"sample index 17 \(sample 7 of source 1; "
                                               r"epoch position \d+") as error:
        list(loader)
    assert error.value.index == 17 and isinstance(error.value, KeyError)


@pytest.mark.parametrize(("mode", "expected_len"), [("cycle", 7), ("replacement", 7), ("stop", 9)])
def test_each_mode_defines_the_epoch_length(tmp_path: Path, mode: str, expected_len: int) -> None:
    kwargs = {"samples_per_epoch": 26} if mode != "stop" else {
        "weights": [1, 1, 1], "batch_size": None, "samples_per_epoch": None}
    made = loader(tmp_path, mode=mode, **kwargs)
    assert len(made) == expected_len
    epochs = run_epochs(made, range(2), key=key)
    assert [len(e) for e in epochs] == [expected_len] * 2
    ids = [i for batch in epochs[0] for i in batch]
    if mode == "stop":  # 12 of each source (the map-style one runs out), none twice
        assert len(ids) == 36 and len(set(ids)) == 36
        assert sorted(i for i in ids if i < 1000) == list(range(12))
    else:
        assert len(ids) == 26


@pytest.mark.parametrize("num_workers", [0, 2])
def test_resume_from_every_step_is_exact(tmp_path: Path, num_workers: int) -> None:
    check_resume_at_every_step(lambda: loader(tmp_path, num_workers), epochs=2, key=key)


def test_a_sampler_or_shuffle_is_refused_but_make_resumable_works(tmp_path: Path) -> None:
    mix = three_source_mix(tmp_path, samples_per_epoch=26)
    with pytest.raises(ValueError, match="decides its own order"):
        ResumableLoader(mix, batch_size=4, shuffle=True)
    with pytest.raises(ValueError, match="decides its own order"):
        ResumableLoader(mix, batch_size=4, sampler=torch.utils.data.RandomSampler(mix))
    converted = make_resumable(DataLoader(mix, batch_size=4), seed=3)
    assert run_epochs(converted, [0], key=key) == run_epochs(loader(tmp_path), [0], key=key)


def _lists_mix(rank: int = 0, world_size: int = 1, last_batch: str = "keep") -> ResumableLoader:
    """Three list sources mixed in steps of 8 samples, read in batches of ``8 // world_size``
    per rank before an elastic resume, 4 after."""
    sources = [list(range(1000 * k, 1000 * k + n)) for k, n in enumerate((40, 40, 40))]
    mix = Mix(sources, [1, 1, 1], samples_per_epoch=96, batch_size=8)
    return ResumableLoader(mix, batch_size=4, seed=0, rank=rank, world_size=world_size,
                           last_batch=last_batch)


@pytest.mark.parametrize("last_batch", ["keep", "rollover"])
def test_a_weight_change_at_a_delivered_step_is_refused(last_batch: str) -> None:
    """A change from a step whose samples were delivered would not be what was trained on,
    nor what a resume reads; by default a change starts at the first step not delivered (under
    ``"rollover"`` too, whose plans count stream positions: it went back to step 0)."""
    made = _lists_mix(last_batch=last_batch)
    batches = iter(made)
    first = [next(batches).tolist() for _ in range(4)]  # steps 0 and 1 (8 samples a step)
    mix = made.dataset
    assert mix.next_step() == 2
    with pytest.raises(ValueError, match="samples of step 1 were delivered already.*step >= 2"):
        mix.set_weights([0, 1, 1], 1)
    mix.set_weights([0, 0, 1])
    rest = [batch.tolist() for batch in batches]
    assert mix.weights_at(1).tolist() == [1, 1, 1] and mix.weights_at(2).tolist() == [0, 0, 1]
    assert all(i >= 2000 for batch in rest for i in batch) and len(first + rest) == 24


def test_after_an_elastic_resume_the_next_step_counts_the_mixtures_steps() -> None:
    """Resumed from 2 ranks on 4 (batch 4 each, 16 samples a trainer step), the mixture's steps
    (8 samples) run twice as fast as the trainer's: ``trainer.global_step`` is a past step."""
    made = _lists_mix(0, 2)
    batches = iter(made)
    for _ in range(3):  # 3 steps of 8 samples
        next(batches)
    state = made.state_dict()
    resumed = _lists_mix(0, 4)
    resumed.load_state_dict(state)
    assert resumed.dataset.next_step() == 3
    with pytest.warns(UserWarning, match="elastic resume from world size 2 to 4"):
        next(iter(resumed))  # positions 24..39: steps 3 and 4
    assert resumed.dataset.next_step() == 5
    with pytest.raises(ValueError, match="trainer.global_step counts other steps"):
        resumed.dataset.set_weights([0, 1, 1], 4)


def test_out_of_order_a_change_starts_after_the_batches_delivered_ahead(tmp_path: Path
                                                                       ) -> None:
    """With ``in_order=False`` a batch held in flight lets later ones be delivered first; a
    change from the frontier rewrote steps already trained on (reviewed: steps 3, 5 and 6 with
    the frontier at 2, whose 9 source-2 samples of the new plan never came). ``next_step()`` is
    the step after the last batch delivered, a change before it is refused, and the stream is
    the plan the saved state describes, which it resumes exactly."""
    gate = tmp_path / "gate"
    plain = [batch.tolist() for batch in gated_mix_loader(gate)]
    slow = frozenset(i for i in plain[2] if i < 1000)  # batch 2 waits for the gate
    assert slow
    made = gated_mix_loader(gate, slow, num_workers=2, in_order=False)
    numbers = made.delivery_order()
    assert numbers is not None
    batches = iter(made)
    got = [next(batches).tolist() for _ in range(5)]
    delivered = list(numbers)
    frontier, last = made.state_dict()["batches"], max(delivered)
    assert frontier <= 2 < last and 2 not in delivered, delivered  # past the frontier
    mix = made.dataset
    assert mix.next_step() == last + 1  # one step per batch on one rank
    with pytest.raises(ValueError, match=f"samples of step {last} were delivered already.*"
                                         f"step >= {last + 1}"):
        mix.set_weights([0, 0, 1], frontier)
    mix.set_weights([0, 0, 1])
    state = checkpoint_roundtrip(made.state_dict())
    assert state["parts"]["order"]["changes"] == [[last + 1, [0.0, 0.0, 1.0]]]
    gate.touch()
    rest = [batch.tolist() for batch in batches]
    changed = gated_mix_loader(gate)
    changed.dataset.set_weights([0, 0, 1], last + 1)
    plan = [batch.tolist() for batch in changed]
    assert plan[:last + 1] == plain[:last + 1] and plan[last + 1:] != plain[last + 1:]
    assert sorted(got + rest) == sorted(plan), "each batch of the saved plan once"
    for resumed in (gated_mix_loader(gate), gated_mix_loader(gate, num_workers=2,
                                                             in_order=False)):
        resumed.load_state_dict(state)
        assert sorted(got + [batch.tolist() for batch in resumed]) == sorted(plan)


def test_ddp_out_of_order_ranks_agree_on_the_step_of_a_change(tmp_path: Path) -> None:
    """Out of order, 2 gloo ranks have delivered different steps (rank 0 past its batch 2 in
    flight): each rank's default step was its own ``next_step()``, so the ranks changed the
    weights at different steps and a state (rank 0's) described rank 1's stream wrongly, and a
    step one rank had delivered was refused there alone while the other went on into the
    weights' comparison (whose collectives then paired with the wrong calls). Now the ranks
    compare their steps with their weights: a change starts after every rank's last batch
    delivered, or is refused on every rank; each rank's stream is the plan the state
    describes, and the state resumes each rank exactly."""
    from tests.ddp_harness import REPO, run_ddp

    gate = tmp_path / "gate"
    ranks = run_ddp(REPO / "tests" / "scripts" / "mix_out_of_order_ddp.py", [str(gate)],
                    tmp_path / "results", timeout=180)
    steps = [r["next_step"] for r in ranks]
    assert steps[0] > steps[1] == 5, steps  # rank 0 delivered past its batch 2 in flight
    for r in ranks:
        assert (f"samples of step {steps[0] - 1} were delivered already (batch_size=6 samples "
                f"per step, next_step() by rank: {steps}") in r["explicit"]
        assert "different steps on different ranks (by rank: [20, 21])" in r["differing"]
        assert r["state"]["parts"]["order"]["changes"] == [[steps[0], [0.0, 0.0, 1.0]]]
    state = ranks[0]["state"]  # the one a checkpoint keeps
    for rank, r in enumerate(ranks):
        changed = gated_mix_loader(gate, step_size=6, rank=rank, world_size=2)
        changed.dataset.set_weights([0, 0, 1], steps[0])
        plan = [batch.tolist() for batch in changed]
        assert sorted(r["got"] + r["rest"]) == sorted(plan), rank
        resumed = gated_mix_loader(gate, step_size=6, rank=rank, world_size=2)
        resumed.load_state_dict(state)
        assert sorted(r["got"] + [batch.tolist() for batch in resumed]) == sorted(plan), rank


def test_set_weights_mid_epoch_applies_from_the_next_batch_and_resumes(tmp_path: Path) -> None:
    def run(change_at: int | None, snapshot_at: int | None = None, state=None):
        made = loader(tmp_path, num_workers=2, samples_per_epoch=80)
        if state is not None:
            made.load_state_dict(state)
        mix = made.dataset
        out, saved = [], None
        for batch in made:
            out.append(key(batch))
            step = len(out) + (0 if state is None else state["batches"])
            if step == change_at:
                mix.set_weights([0, 0, 1], step=step)
            if step == snapshot_at:
                saved = made.state_dict()
        return out, saved

    plain, _ = run(None)
    changed, saved = run(6, snapshot_at=8)
    assert changed[:6] == plain[:6], "batches before the change are unchanged"
    assert changed[6:] != plain[6:]
    assert all(i >= 2000 for batch in changed[6:] for i in batch), "prefetched batches re-planned"
    resumed, _ = run(None, state=saved)
    assert resumed == changed[8:]


def test_a_two_rank_state_resumes_on_one_rank_exactly(tmp_path: Path) -> None:
    def made(rank: int, world_size: int, batch_size: int) -> ResumableLoader:
        mix = three_source_mix(tmp_path, samples_per_epoch=48, batch_size=8)
        return ResumableLoader(mix, batch_size=batch_size, seed=3, rank=rank,
                               world_size=world_size)

    single = [i for batch in run_epochs(made(0, 1, 8), [0], key=key)[0] for i in batch]
    ranks = [made(r, 2, 4) for r in range(2)]
    iterators = [iter(r) for r in ranks]
    taken = []
    for _ in range(2):  # two global batches on two ranks
        for it in iterators:
            taken += key(next(it))
    assert taken == single[:16], "the ranks read the single-process stream, slice by slice"
    resumed = made(0, 1, 4)
    resumed.load_state_dict(ranks[0].state_dict())
    rest = [i for batch in resumed for i in key(batch)]
    assert rest == single[16:]


def test_realised_proportions_follow_the_schedule(tmp_path: Path) -> None:
    schedule = [(0, [0.6, 0.3, 0.1]), (40, [0.1, 0.3, 0.6])]
    made = ResumableLoader(Mix(write_sources(tmp_path), schedule, batch_size=16,
                               samples_per_epoch=16 * 80), batch_size=16, seed=11)
    batches = run_epochs(made, [0], key=lambda b: b["source"].tolist())[0]
    sources = np.array(batches)
    assert proportions_match(sources[:40].ravel(), schedule[0][1])
    assert proportions_match(sources[40:].ravel(), schedule[1][1])
    assert not proportions_match(sources[40:].ravel(), schedule[0][1])


def late_mix_loader() -> ResumableLoader:
    """A cycle mixture of 32 chunks of draw counts (2**16 positions each)."""
    mix = Mix([TensorDataset(torch.arange(n)) for n in (3, 10, 4000)], [0.2, 0.3, 0.5],
              samples_per_epoch=32 << 16, seed=1)
    return ResumableLoader(mix, batch_size=512)


def state_saved_at(batches: int) -> tuple[dict, list[int]]:
    """A state saved by a loader after ``batches`` batches, and the batch it delivers next."""
    first = late_mix_loader()
    next(iter(first))
    edited = {**first.state_dict(), "batches": batches - 1}
    del edited["parts"]["audit"]  # an edited cursor: no audit, no draw counts near it
    assert "counts" not in edited["parts"]["order"], "only chunk 0 was planned"
    saver = late_mix_loader()
    saver.load_state_dict(edited)
    batches_out = iter(saver)
    next(batches_out)
    state = saver.state_dict()
    return state, next(batches_out)[0].tolist()


def test_a_resume_late_in_a_long_epoch_jumps_to_the_saved_draw_counts() -> None:
    drawn_per_resume = []
    for batches in (1000, 4000):  # in chunk 7, and in chunk 31 of 32
        state, expected = state_saved_at(batches)
        assert state["batches"] == batches and state["parts"]["order"]["counts"]
        resumed = late_mix_loader()
        drawn = counting(resumed.dataset.order)
        resumed.load_state_dict(checkpoint_roundtrip(state))
        assert next(iter(resumed))[0].tolist() == expected
        drawn_per_resume.append(sum(drawn))
    # one chunk ranked and the batches planned, wherever the cursor stands (a recount would
    # draw every chunk before it)
    assert drawn_per_resume[0] == drawn_per_resume[1] <= 2 << 16


def test_wrong_saved_draw_counts_fail_the_audit() -> None:
    state, _ = state_saved_at(1000)
    epoch, chunk, counts = state["parts"]["order"]["counts"][0]
    state["parts"]["order"]["counts"] = [[epoch, chunk, [counts[1], counts[0], counts[2]]]]
    with pytest.raises(StateMismatchError):
        late_mix_loader().load_state_dict(state)


class Augmented(torch.utils.data.Dataset[torch.Tensor]):
    """Sample ``i``: ``i`` and a draw of ``sample_rng()``, as an augmentation makes it."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> torch.Tensor:
        return torch.tensor([index, int(sample_rng().integers(1 << 30))])


@pytest.mark.parametrize(("backend", "num_workers"), [("process", 2), ("thread", 2)])
def test_members_that_draw_from_sample_rng_get_their_sample_context(backend: str,
                                                                    num_workers: int) -> None:
    """``Mix`` forwards ``__getitems__`` to members that have none: their samples are fetched
    one at a time, each in its own context, as they are outside a mixture."""
    def batches(**options: Any) -> list[list[list[int]]]:
        loader = ResumableLoader(Mix([Augmented(6), Augmented(4)], [0.5, 0.5], seed=3),
                                 batch_size=2, **options)
        try:
            return [batch.tolist() for batch in loader]
        finally:
            loader.close()

    alone = batches(num_workers=0)
    assert len({draw for batch in alone for _, draw in batch}) == 10
    assert batches(backend=backend, num_workers=num_workers) == alone


def _shuffled_shard(shard: int) -> Any:
    """A shard's 10 rows, shuffled with the global ``random`` as it opens, each with a draw of
    numpy's (an augmentation)."""
    rows = list(range(shard * 10, shard * 10 + 10))
    random.shuffle(rows)
    return ((row, int(np.random.randint(2**30))) for row in rows)


def _mixed_with_a_shuffling_generator(num_workers: int, seed: int = 0, **kwargs: Any
                                      ) -> ResumableLoader:
    source = GeneratorSource(_shuffled_shard, [0, 1, 2], lengths=[10] * 3)
    mix = Mix([source, [(1000 + i, 0) for i in range(30)]], weights=[1, 1], mode="stop")
    return ResumableLoader(mix, batch_size=5, seed=seed, num_workers=num_workers,
                           collate_fn=list, **kwargs)


def test_a_generator_drawing_its_shards_order_is_read_by_random_access_once_per_sample() -> None:
    """A ``Mix`` reads sample ``i`` of a source by opening its shard at its offset: a shard
    shuffled with the global RNGs was another permutation at every read (5 of 27 samples
    repeated in an epoch). Each read opens it under the RNGs seeded from the seed, the epoch
    and the shard: every sample once, with the same draws at every resume and under another
    ``num_workers``, and other draws in another epoch or under another seed."""
    workers = iter([0, 2, 2])
    full = check_resume_at_every_step(lambda: _mixed_with_a_shuffling_generator(
        next(workers, 2)), epochs=2, key=list)
    for epoch in full:
        assert sorted(row for batch in epoch for row, _ in batch if row < 1000) == list(range(30))

    def draws(epochs: list) -> list[dict[int, int]]:
        return [{row: draw for batch in epoch for row, draw in batch if row < 1000}
                for epoch in epochs]

    assert draws(full)[0] != draws(full)[1]
    other_seed = run_epochs(_mixed_with_a_shuffling_generator(0, seed=1), range(1), key=list)
    assert draws(other_seed)[0] != draws(full)[0]


def test_auto_takes_processes_and_threads_warn_for_a_mix_of_a_source_with_own_rngs() -> None:
    """A ``Mix`` member read under global-RNG states of its own makes worker threads take
    turns, and lose the training loop's draws meanwhile, as the iterable path does."""
    with _mixed_with_a_shuffling_generator(2, backend="auto") as auto:
        assert auto.backend_in_use == "process"
    with pytest.warns(UserWarning, match="worker threads: a Mix source .*backend='process'"):
        _mixed_with_a_shuffling_generator(2, backend="thread").close()
