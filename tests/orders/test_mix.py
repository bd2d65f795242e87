"""``MixOrder``: the source of every position is a pure function of (seed, epoch, position,
weights at its step); each source's samples follow its own cursor; the exhaustion modes."""

from __future__ import annotations

import hashlib
from typing import Any

import numpy as np
import pytest

from lightning_loaders.errors import StateMismatchError
from lightning_loaders.orders.mix import MixOrder, WeightSchedule, source_at

# Upper 0.1% points of the chi-square distribution, by degrees of freedom (tables; scipy is not
# a dependency): a correct mixture fails the test once in a thousand seeds, and the seeds here
# are fixed.
CHI2_999 = {1: 10.828, 2: 13.816, 3: 16.266}


def chi_square(counts: np.ndarray, weights: np.ndarray) -> float:
    """Pearson's statistic of observed ``counts`` against the proportions ``weights``."""
    counts = np.asarray(counts, dtype=np.float64)
    expected = counts.sum() * np.asarray(weights, dtype=np.float64) / np.sum(weights)
    return float(((counts - expected) ** 2 / expected).sum())


def proportions_match(sources: np.ndarray, weights: list[float]) -> bool:
    counts = np.bincount(sources, minlength=len(weights))
    return chi_square(counts, np.asarray(weights)) < CHI2_999[len(weights) - 1]


SCHEDULE = [(0, [1, 1, 1]), (5, [0.2, 0.3, 0.5])]


def make(mode: str = "cycle", weights: Any = None, lengths=(7, 50, 300),
         samples_per_epoch: int | None = 2000, batch_size: int | None = 16,
         seed: int = 5) -> MixOrder:
    weights = SCHEDULE if weights is None else weights
    return MixOrder(list(lengths), WeightSchedule(weights, len(lengths)), mode,
                    samples_per_epoch, batch_size, seed)


def test_the_source_of_a_position_is_a_pure_function() -> None:
    positions = np.arange(5000)
    whole = source_at(3, 1, positions, [1, 2, 3])
    parts = np.concatenate([source_at(3, 1, positions[i::7], [1, 2, 3]) for i in range(7)])
    assert np.array_equal(np.sort(parts), np.sort(whole))
    assert np.array_equal(source_at(3, 1, positions[::-1], [1, 2, 3]), whole[::-1])
    assert not np.array_equal(source_at(3, 2, positions, [1, 2, 3]), whole), "epoch keys it"
    assert not np.array_equal(source_at(4, 1, positions, [1, 2, 3]), whole), "seed keys it"
    order = make(weights=[1, 2, 3], batch_size=None, samples_per_epoch=5000, seed=3)
    assert np.array_equal(order.sources(1, positions), whole)


@pytest.mark.parametrize("mode", ["cycle", "replacement"])
def test_realised_proportions_match_each_segment_of_the_schedule(mode: str) -> None:
    schedule = [(0, [0.6, 0.3, 0.1]), (400, [0.1, 0.1, 0.8]), (800, [1 / 3, 1 / 3, 1 / 3])]
    order = make(mode, schedule, samples_per_epoch=16 * 1200)
    positions = np.arange(len(order))
    sources = order.locate(0, positions)[0]
    steps = order.steps(0, positions)
    for (start, weights), end in zip(schedule, [400, 800, 1200], strict=True):
        segment = sources[(steps >= start) & (steps < end)]
        assert proportions_match(segment, weights), (start, np.bincount(segment))
        wrong = [weights[1], weights[0], weights[2]] if weights[0] != weights[1] else \
            [0.4, 0.3, 0.3]
        assert not proportions_match(segment, wrong), "the test must be able to fail"


def test_the_step_of_a_position_is_lightnings_global_step() -> None:
    order = make(samples_per_epoch=50, batch_size=16)  # 4 batches per epoch, the last short
    assert order.steps(0, np.array([0, 15, 16, 49])).tolist() == [0, 0, 1, 3]
    assert order.steps(2, np.array([0, 49])).tolist() == [8, 11]


def test_cycle_reads_each_source_in_its_own_reshuffled_passes() -> None:
    order = make("cycle", samples_per_epoch=3000)
    source, sample = order.locate(1, np.arange(3000))
    for k, n in enumerate(order.lengths.tolist()):
        stream = sample[source == k]
        passes = [stream[i:i + n] for i in range(0, len(stream) - n + 1, n)]
        assert passes and all(sorted(p) == list(range(n)) for p in passes), k
        if len(passes) > 1:
            assert not np.array_equal(passes[0], passes[1]), "each pass is a new permutation"
    # Any subset of positions, in any order, gets the same answer (the counts are a function).
    picked = np.random.default_rng(0).permutation(3000)[:400]
    again = make("cycle", samples_per_epoch=3000).locate(1, picked)
    assert np.array_equal(again[0], source[picked]) and np.array_equal(again[1], sample[picked])


def test_cycle_counts_cross_chunks_and_follow_positions_of_a_long_epoch() -> None:
    order = make("cycle", samples_per_epoch=150_000, lengths=(3, 10, 40))
    tail = np.arange(140_000, 140_010)
    source, sample = make("cycle", samples_per_epoch=150_000, lengths=(3, 10, 40)).locate(
        0, np.arange(150_000))
    counts = np.array([np.count_nonzero(source[:p] == source[p]) for p in tail])
    expected = order.locate(0, tail)
    assert np.array_equal(expected[0], source[tail])
    passes, offsets = np.divmod(counts, order.lengths[source[tail]])
    assert np.array_equal(expected[1], sample[tail]) and (offsets >= 0).all() and passes.min() > 0


def test_replacement_draws_random_samples_of_each_source() -> None:
    order = make("replacement", weights=[1, 1, 1], lengths=(5, 5, 5), samples_per_epoch=3000,
                 batch_size=None)
    source, sample = order.locate(0, np.arange(3000))
    assert len(order) == 3000 and sample.min() >= 0 and sample.max() < 5
    for k in range(3):
        assert sorted(set(sample[source == k].tolist())) == list(range(5))
    assert not np.array_equal(sample[:5], order.locate(1, np.arange(5))[1])


def test_stop_ends_the_epoch_when_the_first_source_runs_out() -> None:
    order = make("stop", weights=[1, 2, 3], lengths=(10, 100, 20), samples_per_epoch=None,
                 batch_size=None)
    # source 2 runs out first: 20 samples at 3/6 of the epoch -> 40 positions, 20 : 6.67 : 13.33
    assert len(order) == 40
    source, sample = order.locate(0, np.arange(40))
    counts = np.bincount(source, minlength=3)
    assert counts.tolist() == [7, 13, 20]
    for k in range(3):
        assert len(set(sample[source == k].tolist())) == counts[k], "no sample twice"
    assert sorted(sample[source == 2].tolist()) == list(range(20)), "the first exhausted is read"
    other = order.locate(1, np.arange(40))
    assert np.bincount(other[0], minlength=3).tolist() == [7, 13, 20]
    assert not np.array_equal(other[0], source), "each epoch is a new shuffle"


def test_set_weights_applies_from_its_step_and_is_saved() -> None:
    order, reference = make(), make()
    positions = np.arange(2000)
    before = order.indices(0, positions)
    version = order.version
    order.set_weights([0, 0, 1], step=60)
    assert order.version > version
    after = order.indices(0, positions)
    first = 60 * 16
    assert np.array_equal(after[:first], before[:first]), "earlier positions never change"
    assert (order.locate(0, positions[first:])[0] == 2).all()
    assert order.weights_at(59).tolist() == [0.2, 0.3, 0.5]
    assert order.weights_at(60).tolist() == [0, 0, 1]
    reference.load_state_dict(order.state_dict())
    assert np.array_equal(reference.indices(0, positions), after)
    order.set_weights([1, 0, 0], step=70)
    assert order.state_dict()["changes"] == [[60, [0.0, 0.0, 1.0]], [70, [1.0, 0.0, 0.0]]]


def test_a_callable_schedule_is_evaluated_per_step() -> None:
    order = MixOrder([4, 4], WeightSchedule(lambda step: [1, 0] if step % 2 else [0, 1], 2),
                     "cycle", 64, 8, 0)
    sources = order.locate(0, np.arange(64))[0].reshape(8, 8)
    assert (sources[1::2] == 0).all() and (sources[::2] == 1).all()
    assert order.fingerprint != make().fingerprint


def _halves(step: int) -> list[float]:
    return [1, 0] if step < 1000 else [0, 1]


def _halves_edited(step: int) -> list[float]:
    return [1, 0] if step < 1024 else [0, 1]


def test_a_callable_schedules_fingerprint_is_what_it_gives_not_its_name() -> None:
    """A schedule function edited between a save and a resume must be refused: its weights at
    a few steps are its fingerprint. One that raises past the run's steps is fingerprinted by
    the error's type there."""
    def fingerprint(fn: Any) -> str:
        return WeightSchedule(fn, 2).fingerprint

    assert fingerprint(_halves) == fingerprint(_halves)
    assert fingerprint(_halves) != fingerprint(_halves_edited)
    table = [[1, 1]] * 100
    assert fingerprint(table.__getitem__) == fingerprint(table.__getitem__)  # raises past 99


def test_a_dict_of_breakpoints_is_a_schedule() -> None:
    as_dict = WeightSchedule({5: [0.2, 0.3, 0.5], 0: [1, 1, 1]}, 3)
    assert as_dict.fingerprint == WeightSchedule(SCHEDULE, 3).fingerprint
    with pytest.raises(ValueError, match="increasing ints from 0"):
        WeightSchedule({1: [1, 1, 1]}, 3)


@pytest.mark.parametrize(("kwargs", "message"), [
    ({"weights": [(1, [1, 1, 1])]}, "increasing ints from 0"),
    ({"weights": [1, 1]}, "one weight per source"),
    ({"weights": [1, -1, 1]}, "finite and >= 0"),
    ({"batch_size": None}, "need batch_size"),
    ({"batch_size": True}, "batch_size must be an int >= 1"),
    ({"mode": "stop"}, "constant weights"),
    ({"mode": "stop", "weights": [1, 1, 1], "batch_size": None}, "drop samples_per_epoch"),
    ({"mode": "first"}, "mode must be one of"),
    ({"lengths": (3, 0, 1)}, "at least one sample"),
    ({"samples_per_epoch": 0}, "samples_per_epoch must be"),
])
def test_impossible_configurations_are_refused(kwargs, message: str) -> None:
    with pytest.raises(ValueError, match=message):
        make(**kwargs)


def test_impossible_weight_changes_are_refused() -> None:
    order = make()
    order.set_weights([1, 1, 1], step=10)
    with pytest.raises(ValueError, match="earlier than the last change"):
        order.set_weights([1, 1, 1], step=9)
    with pytest.raises(ValueError, match="step must be an int"):
        order.set_weights([1, 1, 1], step=-1)
    with pytest.raises(ValueError, match="needs the mixture's batch_size"):
        make(weights=[1, 1, 1], batch_size=None).set_weights([1, 2, 3], step=3)
    with pytest.raises(ValueError, match="mode='stop'"):
        make("stop", weights=[1, 1, 1], samples_per_epoch=None).set_weights([1, 2, 3], step=3)


def test_a_large_source_is_cycled_through_keyed_permutations() -> None:
    order = MixOrder([5000, 3], WeightSchedule([1, 1], 2), "cycle", 12_000, None, 1)
    source, sample = order.locate(0, np.arange(12_000))
    stream = sample[source == 0]
    assert sorted(stream[:5000]) == list(range(5000))
    assert len(set(stream[5000:].tolist())) == len(stream) - 5000, "the next pass repeats none"


CHUNK = 1 << 16  # positions per chunk of draw counts (``lightning_loaders.orders.mix``)


def counting(order: MixOrder) -> list[int]:
    """Record how many positions' sources ``order`` draws (hashes) from now on."""
    drawn: list[int] = []
    sources = order.sources

    def counted(epoch: int, positions: np.ndarray) -> np.ndarray:
        drawn.append(np.asarray(positions).size)
        return sources(epoch, positions)

    order.sources = counted  # type: ignore[method-assign]
    return drawn


def test_checkpointing_keeps_the_stream_of_a_fixed_config_byte_identical() -> None:
    # the digest of three epochs computed by the order before draw counts were checkpointed
    # in the state and counted backwards
    order = MixOrder([7, 300, 5000], WeightSchedule(SCHEDULE[:1] + [(100, [0.2, 0.3, 0.5])], 3),
                     "cycle", 300_000, 512, 11)
    order.set_weights([0.5, 0.1, 0.4], step=900)  # in epoch 1 (586 steps per epoch)
    epochs = [order.indices(epoch, np.arange(300_000)) for epoch in range(3)]
    assert hashlib.sha256(b"".join(e.tobytes() for e in epochs)).hexdigest() == \
        "7cf489a3157042c6ad9b30688eb58d381d5310668c4a8b113bcccec6a3f1e6f6"
    resumed = make(lengths=(7, 300, 5000), samples_per_epoch=300_000, batch_size=512, seed=11,
                   weights=SCHEDULE[:1] + [(100, [0.2, 0.3, 0.5])])
    resumed.load_state_dict(order.state_dict())
    backwards = np.arange(300_000)[::-1][::997]  # chunk by chunk from the epoch's end
    for epoch in (1, 0, 2):
        assert np.array_equal(resumed.indices(epoch, backwards), epochs[epoch][backwards])


@pytest.mark.parametrize("chunk", [12, 30])
def test_a_resume_counts_from_the_saved_checkpoint_whatever_the_position(chunk: int) -> None:
    options: dict[str, Any] = {"lengths": (3, 10, 4000), "samples_per_epoch": 32 * CHUNK,
                               "batch_size": 256}
    planner = make(**options)
    planned = chunk * CHUNK + 500  # the main process planned (prefetched) up to here
    expected = planner.indices(0, np.arange(planned - 3000, planned))
    state = planner.state_dict()
    assert state["counts"][-1][:2] == [0, chunk] and len(state["counts"]) == 1
    resumed = make(**options)
    drawn = counting(resumed)
    resumed.load_state_dict(state)
    # the cursor lies behind the plan (a prefetch), in the previous chunk
    assert np.array_equal(resumed.indices(0, np.arange(planned - 3000, planned)), expected)
    # the positions asked for, then one chunk counted backwards and two ranked: not the epoch
    assert drawn == [3000, CHUNK, CHUNK, CHUNK]


def test_saved_counts_of_other_epochs_and_after_a_weight_change_stay_exact() -> None:
    options: dict[str, Any] = {"lengths": (3, 10, 4000), "samples_per_epoch": 5 * CHUNK,
                               "batch_size": 256}
    planner, reference = make(**options), make(**options)
    planner.indices(0, np.arange(4 * CHUNK, 4 * CHUNK + 10))
    planner.indices(1, np.arange(2 * CHUNK, 2 * CHUNK + 10))
    state = planner.state_dict()
    assert [entry[:2] for entry in state["counts"]] == [[0, 4], [1, 2]]
    resumed = make(**options)
    resumed.load_state_dict(state)
    everything = np.arange(5 * CHUNK)
    for epoch in (2, 1, 0):
        assert np.array_equal(resumed.indices(epoch, everything),
                              reference.indices(epoch, everything))
    # a change at step 768 (position 196608 = chunk 3) of epoch 1 drops the checkpoints past it
    for order in (resumed, reference):
        order.set_weights([0, 1, 0], step=1280 + 768)
    for epoch in (1, 0):
        assert np.array_equal(resumed.indices(epoch, everything),
                              reference.indices(epoch, everything))


@pytest.mark.parametrize("counts", [[[0, 2, [1, 2, 3]]], [[0, 2, [CHUNK, CHUNK]]],
                                    [[0, 9, [0, 0, 9 * CHUNK]]], [[-1, 1, [0, 0, CHUNK]]],
                                    [[0, 1, ["a", 0, 0]]], [[0, 1]]])
def test_corrupted_saved_counts_are_refused(counts: list[Any]) -> None:
    order = make(lengths=(3, 10, 4000), samples_per_epoch=5 * CHUNK)
    with pytest.raises(StateMismatchError, match="corrupted mixture state"):
        order.load_state_dict({"changes": [], "counts": counts})


@pytest.mark.parametrize(
    ("state", "match"),
    [
        ({"changes": None}, r"'changes'=None is not a list"),
        ({"changes": [], "counts": None}, r"'counts'=None is not a list"),
        ({"changes": [[1]]}, r"weight change \[1\] is not \[step, weights\].*not enough values"),
        ({"changes": [[-1, [1, 1, 1]]]}, r"change \[-1, \[1, 1, 1\]\] .* \(-1; -1: none\)"),
        ({"changes": [["5", [1, 1, 1]]]}, r"change \['5', \[1, 1, 1\]\] is not"),
        ({"changes": [[6, [1, 1, 1]], [6, [1, 2, 1]]]}, r"change \[6, \[1, 2, 1\]\] .*\(6; "),
        ({"changes": [[6, [1, 1]]]}, r"one weight >= 0 per source \(3\) \(change at step 6:"),
        ({"changes": [[6, "x"]]}, r"change \[6, 'x'\] is not"),
    ],
)
def test_corrupted_weight_changes_are_refused(state: dict[str, Any], match: str) -> None:
    """They raised AttributeError, TypeError or ValueError from the unpacking, or were taken
    out of step order (a change is looked up by its step, so the order must be increasing)."""
    order = make()
    with pytest.raises(StateMismatchError, match=f"corrupted mixture state: .*{match}"):
        order.load_state_dict(state)


def test_the_mixture_seed_is_part_of_the_fingerprint() -> None:
    """A state saved with another ``Mix(seed=...)`` is refused naming both seeds, before the
    resume audit could only say that a batch's digest differs."""
    assert "seed=4," in make(seed=4).fingerprint
    assert make(seed=4).fingerprint != make(seed=5).fingerprint
