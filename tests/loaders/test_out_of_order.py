"""``in_order=False``: batches are delivered as workers finish them, and a resume from any step
delivers exactly the planned batches not delivered yet (nothing repeated, nothing lost).

Reordering is forced, not timed: a *gated* sample blocks its worker until the main process has
received other batches past it (it opens the gate), so the test never depends on wall-clock
speed. Two workers with ``prefetch_factor=2`` hold at most 4 batches in flight, so the gate
opens after 2 batches (the blocked worker holds the gated batch and at most one behind it)."""

import os
import re
import signal
import threading
import time
from collections import Counter
from itertools import pairwise
from pathlib import Path

import lightning as L
import pytest
import torch

from lightning_loaders import ResumableLoader, StateMismatchError, WorkerCrashedError
from lightning_loaders.sources.shards import GeneratorSource, SequenceSource, ShardedSource
from lightning_loaders.testing import checkpoint_roundtrip
from tests.conftest import loader_processes

BATCH = 2


class Gated(torch.utils.data.Dataset[int]):
    """Sample ``i`` is ``i``; the samples in ``gated`` wait until the file ``gate`` exists."""

    def __init__(self, n: int, gate: str, gated: frozenset[int]) -> None:
        self.n, self.gate, self.gated = n, gate, gated

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index in self.gated:
            waited = 0
            while not os.path.exists(self.gate) and waited < 6000:  # a bug must not hang
                time.sleep(0.005)
                waited += 1
        return index


def _make(gate: Path, n: int = 24, rank: int | None = None, world: int | None = None,
          gated: frozenset[int] = frozenset({0, 10}), **kwargs) -> ResumableLoader:
    data = Gated(n, str(gate), gated)
    options = {"in_order": False, **kwargs}
    return ResumableLoader(data, batch_size=BATCH, num_workers=2, seed=5, rank=rank,
                           world_size=world, **options)


def _run(loader: ResumableLoader, gate: Path, states: list | None = None,
         open_after: int = 2) -> list[tuple[int, ...]]:
    got: list[tuple[int, ...]] = []
    for batch in loader:
        got.append(tuple(batch.tolist()))
        if len(got) == open_after:
            gate.touch()
        if states is not None:
            states.append(checkpoint_roundtrip(loader.state_dict()))
    return got


def _ahead(state: dict) -> list[int]:
    """The batches rank 0 had delivered past its frontier, read from the state's runs."""
    return [b for start, stop in state["parts"]["window"]["ranks"][0][1]
            for b in range(start, stop)]


def _check_window(state: dict, in_flight: int) -> None:
    """A state's window: its frontier is the cursor, and the batches past it are sorted runs
    apart, no more than the batches in flight (the frontier and each gap between two runs are
    batches in flight)."""
    frontier, runs = state["parts"]["window"]["ranks"][0]
    assert state["batches"] == frontier and len(runs) <= in_flight, state
    bounds = [frontier, *(b for run in runs for b in run)]
    assert all(a < b for a, b in pairwise(bounds)), state


def _plan(n: int, rank: int = 0, world: int = 1) -> list[tuple[int, ...]]:
    return [tuple(b.tolist()) for b in ResumableLoader(range(n), batch_size=BATCH, seed=5,
                                                       rank=rank, world_size=world)]


def test_batches_arrive_out_of_order_and_each_once(tmp_path: Path) -> None:
    loader = _make(tmp_path / "gate")
    got = _run(loader, tmp_path / "gate")
    plan = _plan(24)
    assert sorted(got) == sorted(plan) and len(got) == len(plan) == len(loader)
    assert got != plan and got[0] != plan[0]  # the gated first batch came later
    # the next epoch is whole again (the gate is open now: any order)
    assert Counter(_run(loader, tmp_path / "gate")) == Counter(plan)


def test_resume_from_every_step_delivers_exactly_the_rest(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    states: list = []
    first = _run(_make(gate), gate, states)
    for step, state in enumerate(states):
        _check_window(state, in_flight=2 * 2)  # num_workers * prefetch_factor
        resumed = _make(gate)
        resumed.load_state_dict(state)
        counted = resumed.resume_batch()  # what ExactResume tells Lightning
        rest = _run(resumed, gate) if step < len(states) - 1 else []
        assert Counter(first[:step + 1]) + Counter(rest) == Counter(_plan(24)), step
        assert counted == len(_plan(24)) - len(rest), step  # the batches ahead count as done
    assert any(state["parts"]["window"]["ranks"][0][1] for state in states)  # some were ahead


def test_batches_of_different_sizes_arrive_out_of_order_and_resume_exactly(tmp_path: Path
                                                                          ) -> None:
    gate = tmp_path / "gate"
    sizes = [3, 1, 4, 1, 5, 2, 6, 2]
    plan = [tuple(range(sum(sizes[:i]), sum(sizes[:i + 1]))) for i in range(len(sizes))]

    def make() -> ResumableLoader:
        return ResumableLoader(Gated(24, str(gate), frozenset({0})), num_workers=2, seed=5,
                               batch_sampler=[list(batch) for batch in plan], in_order=False)

    states: list = []
    first = _run(make(), gate, states)
    assert sorted(first) == sorted(plan) and first != plan
    for step, state in enumerate(states):
        resumed = make()
        resumed.load_state_dict(state)
        rest = _run(resumed, gate) if step < len(states) - 1 else []
        assert Counter(first[:step + 1]) + Counter(rest) == Counter(plan), step


def test_a_resumed_loader_can_be_saved_before_it_starts(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    states: list = []
    _run(_make(gate), gate, states)
    ahead_states = [s for s in states if s["parts"]["window"]["ranks"][0][1]]
    resumed = _make(gate)
    resumed.load_state_dict(ahead_states[0])
    again = resumed.state_dict()
    assert again["parts"]["window"] == ahead_states[0]["parts"]["window"]
    assert again["batches"] == ahead_states[0]["batches"]


def test_an_out_of_order_state_resumes_in_order_and_saves_its_window(tmp_path: Path) -> None:
    """An in-order loader resumed from a window keeps saving it until the epoch ends, so a
    state saved before its frontier passes the window's batches does not repeat them."""
    gate = tmp_path / "gate"
    states: list = []
    first = _run(_make(gate), gate, states)
    step, state = max(enumerate(states), key=lambda pair: max(
        _ahead(pair[1]) or [0]) - pair[1]["batches"])
    assert max(_ahead(state)) > state["batches"] + 2  # the next batch leaves one ahead
    resumed = _make(gate, in_order=True)
    resumed.load_state_dict(state)
    batches = iter(resumed)
    one = tuple(next(batches).tolist())
    mid = checkpoint_roundtrip(resumed.state_dict())
    assert mid["parts"]["window"]["ranks"][0][1]
    again = _make(gate, in_order=True)
    again.load_state_dict(mid)
    rest = _run(again, gate)
    assert Counter(first[:step + 1]) + Counter([one]) + Counter(rest) == Counter(_plan(24))
    assert again.state_dict()["parts"]["window"] == {"ranks": [[len(_plan(24)), []]]}
    next(iter(again))
    assert "window" not in again.state_dict()["parts"]  # the next epoch saves a plain cursor


def test_ranks_placed_by_hand_resume_from_their_own_states(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    for rank in range(2):
        states: list = []
        first = _run(_make(gate, rank=rank, world=2), gate, states)
        state = states[2]
        assert state["parts"]["window"]["ranks"][1 - rank] is None  # no process group
        resumed = _make(gate, rank=rank, world=2)
        resumed.load_state_dict(state)
        assert Counter(first[:3]) + Counter(_run(resumed, gate)) == Counter(
            _plan(24, rank, 2))
        other = _make(gate, rank=1 - rank, world=2)
        with pytest.raises(StateMismatchError, match=f"no entry for rank {1 - rank}"):
            other.load_state_dict(state)
        with pytest.raises(StateMismatchError, match="without a process group holds only some "
                                                     "ranks' entries, so it cannot resume on 1"):
            _make(gate).load_state_dict(state)


def test_a_window_with_batches_ahead_refuses_another_world_size(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    states: list = []
    _run(_make(gate), gate, states)
    ahead = next(s for s in states if s["parts"]["window"]["ranks"][0][1])
    with pytest.raises(StateMismatchError, match="cannot resume on 2"):
        _make(gate, rank=0, world=2).load_state_dict(ahead)
    f = ahead["batches"]
    for runs in ([99], [[99, 100]], [[f + 3, f + 2]], [[f + 1, f + 4], [f + 3, f + 5]],
                 [[f, f + 2]], [[f + 1, "2"]], [True], [[True, f + 3]], [[f + 1.0, f + 3]]):
        corrupted = {**ahead, "parts": {**ahead["parts"], "window": {"ranks": [[f, runs]]}}}
        with pytest.raises(StateMismatchError, match=r"corrupted.*\[start, stop\) runs"):
            _make(gate).load_state_dict(corrupted)
    moved = next(s for s in states if s["batches"] > 0)  # a frontier edited apart from the cursor
    for entry in ([0, []], [moved["batches"] - 1, _ahead(moved)]):
        edited = {**moved, "parts": {**moved["parts"], "window": {"ranks": [entry]}}}
        with pytest.raises(StateMismatchError, match=f"batches={moved['batches']}, but no "
                                                     "rank's entry"):
            _make(gate).load_state_dict(edited)


def test_a_refused_world_size_names_the_batches_delivered_ahead_or_each_ranks_window(
        tmp_path: Path) -> None:
    """Saved on 1 rank with batches ahead of the frontier, resumed on 2 or 3: the refusal
    said 'its ranks had delivered different batches; resume on 1 ranks'. It names the
    batches ahead and the frontier; 'different batches' is kept for ranks whose windows
    differ (each shown), and ranks alike are said to be ahead on every rank."""
    gate = tmp_path / "gate"
    states: list = []
    _run(_make(gate), gate, states)
    ahead = next(s for s in states if s["parts"]["window"]["ranks"][0][1])
    listed = ", ".join(str(start) if stop == start + 1 else f"{start}-{stop - 1}"
                       for start, stop in ahead["parts"]["window"]["ranks"][0][1])
    for world in (2, 3):
        with pytest.raises(StateMismatchError) as refused:
            _make(gate, rank=0, world=world).load_state_dict(ahead)
        message = str(refused.value)
        assert message.startswith(
            f"an out-of-order state saved on 1 rank cannot resume on {world}: "
            f"batch{'es' * (len(_ahead(ahead)) > 1)} {listed} had been delivered ahead of the "
            f"frontier, batch {ahead['batches']} (out of order); another world size deals the "
            "rest of the epoch anew from the frontier"), message
        assert message.endswith("Resume on 1 rank, or from a state with no batch delivered "
                                "ahead of its frontier (as at an epoch end)"), message
        assert "different" not in message and "1 ranks" not in message
    # a DDP checkpoint holds every rank's window: alike, or one rank ahead and one not
    entry = ahead["parts"]["window"]["ranks"][0]
    for ranks, why in (([entry, entry], f"on every rank, batch{'es' * (len(_ahead(ahead)) > 1)} "
                        f"{listed} had been delivered ahead of the frontier, batch "
                        f"{ahead['batches']} (out of order)"),
                       ([entry, [ahead["batches"], []]], "its ranks had delivered different "
                        f"batches (rank 0: frontier {ahead['batches']}, ahead batch"),
                       ([entry, [ahead["batches"] + 1, []]], "its ranks had delivered "
                        f"different batches (rank 0: frontier {ahead['batches']}, ahead batch")):
        gathered = {**ahead, "parts": {**ahead["parts"], "window": {"ranks": ranks}}}
        with pytest.raises(StateMismatchError, match=re.escape(
                f"saved on 2 ranks cannot resume on 1: {why}")) as refused:
            _make(gate).load_state_dict(gathered)
        if ranks[1] != entry:
            assert f"rank 1: frontier {ranks[1][0]}, ahead none)" in str(refused.value)
    corrupted = {**ahead, "parts": {**ahead["parts"], "window": {"ranks": [[ahead["batches"],
                                                                            [[5, 3]]]]}}}
    with pytest.raises(StateMismatchError, match=r"corrupted.*entry .* of rank 0 is not"):
        _make(gate, rank=0, world=2).load_state_dict(corrupted)


def test_a_malformed_entry_of_a_gathered_window_is_named_as_corrupted(tmp_path: Path) -> None:
    """A 2-rank window with rank 1's entry 7, [b], 'x' or [b, None], loaded on 1 rank, raised
    TypeError, IndexError or was accepted ([b, None] beside an entry with nothing ahead): each
    entry's shape is checked before it is read, on another world size as on the same."""
    gate = tmp_path / "gate"
    states: list = []
    _run(_make(gate), gate, states)
    ahead = next(s for s in states if s["parts"]["window"]["ranks"][0][1])
    b = ahead["batches"]
    for bad in (7, [b], "x", [b, None], [b, 5], [-1, []]):
        for first in (ahead["parts"]["window"]["ranks"][0], [b, []]):
            gathered = {**ahead, "parts": {**ahead["parts"], "window": {"ranks": [first, bad]}}}
            for rank, world in ((0, 1), (1, 2)):
                with pytest.raises(StateMismatchError, match=re.escape(
                        f"corrupted loader state: parts['window'] entry {bad!r} of rank 1 is "
                        "not [frontier, [[start, stop) runs of batches past it")):
                    _make(gate, rank=rank, world=world).load_state_dict(gathered)


def test_a_window_from_another_dataset_or_configuration_names_each_mismatch(tmp_path: Path
                                                                            ) -> None:
    """As for an in-order state, and before the window is read: against this loader's
    shorter plan, the batches past the frontier would read as a corrupted window."""
    gate = tmp_path / "gate"
    states: list = []
    _run(_make(gate), gate, states)
    ahead = max(states, key=lambda state: max(_ahead(state) or [0]))
    assert max(_ahead(ahead)) >= 4  # past the 4 batches of the loaders below
    for loader, mismatch in (
            (_make(gate, n=8), "dataset_len: saved 24, this loader 8"),
            (_make(gate, n=8, rank=0, world=2), "dataset_len: saved 24, this loader 8"),
            (ResumableLoader(Gated(24, str(gate), frozenset()), batch_size=6, seed=5,
                             in_order=False), "batch_size: saved 2, this loader 6")):
        before = loader.state_dict()
        with pytest.raises(StateMismatchError, match=mismatch):
            loader.load_state_dict(ahead)
        assert loader.state_dict() == before  # a refused state changes nothing


def test_a_fast_worker_runs_on_past_the_batches_in_flight(tmp_path: Path) -> None:
    """As in ``DataLoader(in_order=False)``, a batch that holds the frontier does not stop the
    other worker: it delivered 12 batches past it (3 times the 4 in flight) before the gate
    opened, where a window of the batches in flight stopped it after 1. The state stays a few
    runs however far it ran, and resumes exactly from every step."""
    gate, only_first = tmp_path / "gate", frozenset({0})
    states: list = []
    first = _run(_make(gate, n=40, gated=only_first), gate, states, open_after=12)
    plan = _plan(40)
    assert plan[0] not in first[:12] and Counter(first) == Counter(plan)
    runs = states[11]["parts"]["window"]["ranks"][0][1]
    assert len(_ahead(states[11])) == 12 and len(runs) <= 2, runs
    for step, state in enumerate(states[:-1]):  # the last one resumes at the next epoch
        _check_window(state, in_flight=2 * 2)
        resumed = _make(gate, n=40, gated=only_first)
        resumed.load_state_dict(state)
        assert Counter(first[:step + 1]) + Counter(_run(resumed, gate)) == Counter(plan), step


def test_a_state_that_lists_its_batches_ahead_one_by_one_still_resumes(tmp_path: Path) -> None:
    """States saved before the runs listed each batch past the frontier as a number."""
    gate = tmp_path / "gate"
    states: list = []
    first = _run(_make(gate), gate, states)
    step, state = next((i, s) for i, s in enumerate(states) if len(_ahead(s)) > 1)
    listed = {**state, "parts": {**state["parts"], "window": {
        "ranks": [[state["batches"], _ahead(state)]]}}}
    resumed = _make(gate)
    resumed.load_state_dict(listed)
    assert resumed.state_dict()["parts"]["window"] == state["parts"]["window"]
    assert Counter(first[:step + 1]) + Counter(_run(resumed, gate)) == Counter(_plan(24))


class _Fixed(torch.utils.data.Sampler[int]):
    """A user sampler with an order of its own, which the fingerprint does not describe."""

    def __init__(self, order: list[int]) -> None:
        self.order = order

    def __iter__(self):
        return iter(self.order)

    def __len__(self) -> int:
        return len(self.order)


def test_an_out_of_order_state_is_audited_at_its_frontier(tmp_path: Path) -> None:
    """A state from another order is refused as in order (it used to be restored unaudited:
    6 of 24 samples twice, 6 never); the audit names the frontier, so it also holds when
    batches were past it, and its own order's state resumes."""
    gate = tmp_path / "gate"
    states: list = []
    _run(_make(gate, sampler=_Fixed(list(range(24)))), gate, states)
    ahead = next(s for s in states if s["parts"]["window"]["ranks"][0][1])
    assert ahead["parts"]["audit"]["batches"] == ahead["batches"]
    own = _make(gate, sampler=_Fixed(list(range(24))))
    own.load_state_dict(ahead)
    other = _make(gate, sampler=_Fixed(list(reversed(range(24)))))
    with pytest.raises(StateMismatchError, match=f"resume audit failed at epoch 0, after batch "
                                                 f"{ahead['batches']}"):
        other.load_state_dict(ahead)


def test_in_order_false_without_workers_is_the_plan(tmp_path: Path) -> None:
    (tmp_path / "gate").touch()
    data = Gated(10, str(tmp_path / "gate"), frozenset())
    loader = ResumableLoader(data, batch_size=BATCH, in_order=False, seed=5)
    assert [tuple(b.tolist()) for b in loader] == _plan(10)
    assert "in_order=False" in repr(loader)


def test_a_trainer_resumed_from_any_checkpoint_trains_on_each_batch_once(tmp_path: Path
                                                                         ) -> None:
    gate = tmp_path / "gate"

    def make() -> ResumableLoader:
        gated = Gated(24, str(gate), frozenset({0, 10}))
        return ResumableLoader(gated, batch_size=BATCH, num_workers=2, in_order=False, seed=5,
                               shuffle=True)

    plans = [_plan_shuffled(24, epoch) for epoch in range(2)]
    _check_trainer_resumes(make, gate, plans, tmp_path, every=3)


def _check_trainer_resumes(make, gate: Path, plans: list, tmp_path: Path, every: int) -> None:
    """A ``Trainer`` run checkpointing every step is out of order in epoch 0 and trains on
    each planned batch once per epoch; so does every run resumed from every ``every``-th
    checkpoint, together with the steps before it."""
    from tests.lightning_harness import checkpoint_at, every_step_checkpoints, fit_recording

    directory = tmp_path / "checkpoints"
    gate_opener = _OpenGate(gate, after=2)
    full = fit_recording(make, tmp_path, 2, [every_step_checkpoints(directory), gate_opener])
    for epoch in range(2):
        assert Counter(tuple(k) for e, _, k in full if e == epoch) == Counter(plans[epoch])
    assert [tuple(k) for e, _, k in full if e == 0] != plans[0]  # out of order
    for step in range(1, len(full) + 1, every):
        resumed = fit_recording(make, tmp_path, 2, ckpt_path=checkpoint_at(directory, step))
        epochs = [e for e, _, _ in full[:step]]
        for epoch in range(2):
            before = Counter(tuple(k) for e, _, k in full[:step] if e == epoch)
            after = Counter(tuple(k) for e, _, k in resumed if e == epoch)
            assert before + after == Counter(plans[epoch]), (step, epoch, epochs)


def _plan_shuffled(n: int, epoch: int) -> list[tuple[int, ...]]:
    loader = ResumableLoader(range(n), batch_size=BATCH, seed=5, shuffle=True)
    loader.set_epoch(epoch)
    return [tuple(b.tolist()) for b in loader]


class _OpenGate(L.Callback):
    """A callback that opens the gate after ``after`` training steps."""

    def __init__(self, gate: Path, after: int) -> None:
        self.gate, self.after = gate, after

    def on_train_batch_end(self, trainer, *args) -> None:
        if trainer.global_step >= self.after:
            self.gate.touch()


def _windows(value) -> list:
    """Every out-of-order window part found in a (checkpoint) structure."""
    if isinstance(value, dict):
        found = [value["window"]] if "window" in value and "ranks" in value["window"] else []
        return found + [w for v in value.values() for w in _windows(v)]
    if isinstance(value, list | tuple):
        return [w for v in value for w in _windows(v)]
    return []


@pytest.mark.parametrize("kind", [[], ["--iterable"]], ids=["map_style", "iterable"])
def test_ddp_checkpoints_hold_every_ranks_window_and_resume_each_rank(tmp_path: Path,
                                                                      kind: list[str]) -> None:
    from tests.ddp_harness import REPO, run_ddp
    from tests.lightning_harness import checkpoint_at

    script = REPO / "tests" / "scripts" / "loader_ddp_fit.py"
    common = ["--workers", "2", "--out-of-order", "--samples", "24", *kind]
    ckpt = tmp_path / "ckpt"
    full = run_ddp(script, [*common, "--ckpt-dir", str(ckpt)], tmp_path / "full")
    step = 3
    saved = torch.load(checkpoint_at(ckpt, step), weights_only=False)
    windows = _windows(saved)
    assert windows and all(len(w["ranks"]) == 2 and None not in w["ranks"] for w in windows)
    resumed = run_ddp(script, [*common, "--resume", str(checkpoint_at(ckpt, step))],
                      tmp_path / "resumed")
    for before, after in zip(full, resumed, strict=True):
        for epoch in range(2):
            whole = Counter(tuple(b) for e, _, b in before["seen"] if e == epoch)
            done = Counter(tuple(b) for e, _, b in before["seen"][:step] if e == epoch)
            rest = Counter(tuple(b) for e, _, b in after["seen"] if e == epoch)
            assert whole == Counter(tuple(b) for b in before["plans"][epoch])
            assert done + rest == whole, (before["rank"], epoch)


# -- iterable datasets planned over canonical partitions -------------------------------------


class GatedShards(ShardedSource[int]):
    """``shards`` shards of ``size`` samples (sample ``i`` is ``i``); the samples in ``gated``
    wait until the file ``gate`` exists (the shards open mid-shard at ``start``). It draws
    nothing: worker threads read it at once, not one at a time."""

    rng_free = True

    def __init__(self, gate: str, gated: frozenset[int], shards: int = 4, size: int = 6) -> None:
        self.gate, self.gated, self.size = gate, gated, size
        self._shards = list(range(shards))

    @property
    def shards(self) -> list[int]:
        return self._shards

    @property
    def shard_lengths(self) -> list[int]:
        return [self.size] * len(self._shards)

    def open_shard(self, index: int, start: int = 0, state=None):
        for i in range(index * self.size + start, (index + 1) * self.size):
            if i in self.gated:
                Gated(0, self.gate, frozenset({i}))[i]
            yield i


def _iterable_plan(epoch: int, rank: int = 0, world: int = 1, shards: int = 4
                   ) -> list[tuple[int, ...]]:
    loader = ResumableLoader(GatedShards("", frozenset(), shards), batch_size=BATCH, seed=5,
                             shuffle=True, shuffle_buffer=3, rank=rank, world_size=world,
                             partitions=2 * world)
    loader.set_epoch(epoch)
    return [tuple(b.tolist()) for b in loader]


def _make_iterable(gate: Path, in_order: bool = False, backend: str = "process", **kwargs
                   ) -> ResumableLoader:
    """Two workers over 4 shards of 6 (shuffled, mixed in windows of 3 samples, so a resumed
    or re-routed partition opens mid-shard and mid-window)."""
    first = _iterable_plan(0)[0][0]  # the first batch of epoch 0 waits for the gate
    source = GatedShards(str(gate), frozenset({first}))
    return ResumableLoader(source, batch_size=BATCH, num_workers=2, in_order=in_order, seed=5,
                           shuffle=True, shuffle_buffer=3, backend=backend, **kwargs)


def _epochs(loader: ResumableLoader, gate: Path, epochs: range, states: list | None = None
            ) -> list[list[tuple[int, ...]]]:
    """The batches of each epoch in ``epochs``; the gate opens after 2 batches; ``states``
    gets ``(epoch, batches so far, state)`` after every batch."""
    out = []
    for epoch in epochs:
        loader.set_epoch(epoch)
        got: list[tuple[int, ...]] = []
        for batch in loader:
            got.append(tuple(batch.tolist()))
            if len(got) == 2:
                gate.touch()
            if states is not None:
                states.append((epoch, len(got), checkpoint_roundtrip(loader.state_dict())))
        out.append(got)
    return out


@pytest.mark.parametrize("backend", ["process", "thread"])
def test_iterable_batches_arrive_out_of_order_and_each_once(tmp_path: Path, backend: str
                                                            ) -> None:
    gate = tmp_path / "gate"
    loader = _make_iterable(gate, backend=backend)
    assert "in_order=False" in repr(loader)
    got = _epochs(loader, gate, range(2))
    plans = [_iterable_plan(epoch) for epoch in range(2)]
    for epoch in range(2):
        assert Counter(got[epoch]) == Counter(plans[epoch]) and len(got[epoch]) == len(loader)
    assert got[0] != plans[0] and got[0][0] != plans[0][0]  # the gated first batch came later
    # in order, the gated first batch comes first whatever the workers do: the gate opens half
    # a second in, when the other batches have long been ready
    gate.unlink()
    opener = threading.Timer(0.5, gate.touch)
    opener.start()
    assert _epochs(_make_iterable(gate, in_order=True), gate, range(1)) == plans[:1]
    opener.join()


def _check_resumes(make, gate: Path, states: list, full: list, plans: list) -> None:
    """Resume from every state: per epoch, the batches before and after are the plan."""
    for epoch, count, state in states:
        resumed = make()
        resumed.load_state_dict(state)
        counted = resumed.resume_batch()  # what ExactResume tells Lightning
        start = epoch + 1 if count == len(full[epoch]) else epoch
        rest = range(start, len(plans))
        after = dict(zip(rest, _epochs(resumed, gate, rest), strict=True))
        if start == epoch:  # the batches delivered ahead of the frontier count as done
            assert counted == len(plans[epoch]) - len(after[epoch]), (epoch, count)
        for e, plan in enumerate(plans):
            before = full[e] if e < epoch else full[e][:count] if e == epoch else []
            assert Counter(before) + Counter(after.get(e, [])) == Counter(plan), (epoch, count)


@pytest.mark.parametrize("backend", ["process", "thread"])
def test_iterable_resume_from_every_step_delivers_exactly_the_rest(tmp_path: Path, backend: str
                                                                   ) -> None:
    gate = tmp_path / "gate"
    states: list = []
    full = _epochs(_make_iterable(gate, backend=backend), gate, range(2), states)
    for _, _, state in states:
        _check_window(state, in_flight=2 * 2)  # num_workers * prefetch_factor
    assert any(state["parts"]["window"]["ranks"][0][1] for _, _, state in states)
    _check_resumes(lambda: _make_iterable(gate, backend=backend), gate, states, full,
                   [_iterable_plan(epoch) for epoch in range(2)])


def test_an_iterable_state_saved_before_any_batch_resumes_from_the_start(tmp_path: Path
                                                                          ) -> None:
    """A checkpoint written before training starts: an empty window, no partition count yet
    (the epoch has not been dealt)."""
    gate = tmp_path / "gate"
    gate.touch()
    saved = _make_iterable(gate).state_dict()
    assert saved["parts"]["window"]
    for in_order in (False, True):
        resumed = _make_iterable(gate, in_order=in_order)
        resumed.load_state_dict(saved)
        assert sorted(tuple(b.tolist()) for b in resumed) == sorted(_iterable_plan(0))
        resumed.close()


def test_iterable_states_cross_between_in_order_and_out_of_order(tmp_path: Path) -> None:
    """An out-of-order state resumes in order (the batches past its frontier are skipped), and
    an in-order state resumes out of order (none past its cursor was delivered)."""
    gate = tmp_path / "gate"
    plans = [_iterable_plan(epoch) for epoch in range(2)]
    states: list = []
    full = _epochs(_make_iterable(gate), gate, range(2), states)
    ahead = [s for s in states if s[2]["parts"]["window"]["ranks"][0][1]]
    _check_resumes(lambda: _make_iterable(gate, in_order=True), gate, ahead, full, plans)
    # an in-order loader that resumed a window saves it until that epoch ends
    resumed = _make_iterable(gate, in_order=True)
    resumed.load_state_dict(ahead[0][2])
    assert resumed.state_dict()["parts"]["window"] == ahead[0][2]["parts"]["window"]
    ordered: list = []
    full = _epochs(_make_iterable(gate, in_order=True), gate, range(2), ordered)
    assert full == plans and all("window" not in s["parts"] for _, _, s in ordered)
    _check_resumes(lambda: _make_iterable(gate), gate, ordered[::3], full, plans)


def test_iterable_window_refuses_another_world_size_and_corruption(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    states: list = []
    _epochs(_make_iterable(gate), gate, range(1), states)
    ahead = next(s for _, _, s in states if s["parts"]["window"]["ranks"][0][1])
    with pytest.raises(StateMismatchError, match="cannot resume on 2"):
        _make_iterable(gate, rank=0, world_size=2).load_state_dict(ahead)
    corrupted = {**ahead, "parts": {**ahead["parts"], "window": {"ranks": [[0, [99]]]}}}
    with pytest.raises(StateMismatchError, match="corrupted"):
        _make_iterable(gate).load_state_dict(corrupted)
    for placement in ({}, {"rank": 0, "world_size": 2}):
        other = ResumableLoader(GatedShards(str(gate), frozenset()), batch_size=3,
                                in_order=False, **placement)
        with pytest.raises(StateMismatchError, match="batch_size"):  # named before the window
            other.load_state_dict(ahead)
    # at a frontier with nothing ahead, another world size deals the rest of the epoch anew
    plain = next(s for _, _, s in states if not s["parts"]["window"]["ranks"][0][1])
    _make_iterable(gate, rank=0, world_size=2).load_state_dict(plain)


class _Plain(torch.utils.data.IterableDataset[int]):
    def __iter__(self):
        return iter(range(6))


@pytest.mark.parametrize(("source", "last_batch", "why"), [
    (SequenceSource([[1, 2], [3]]), "rollover", "last_batch='rollover'"),
    (GeneratorSource(range, [3, 2]), "keep", "a ShardedSource without shard_lengths"),
    (_Plain(), "keep", "a plain IterableDataset"),
])
def test_iterables_without_canonical_partitions_warn_and_stay_in_order(source, last_batch,
                                                                       why) -> None:
    with pytest.warns(UserWarning, match=f"in_order=False is ignored for {why}"):
        loader = ResumableLoader(source, in_order=False, last_batch=last_batch)
    assert loader.in_order and "in_order" not in repr(loader)
    assert len(list(loader)) >= 1


def test_iterable_trainer_resumed_from_every_checkpoint_trains_on_each_batch_once(
        tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    plans = [_iterable_plan(epoch) for epoch in range(2)]
    _check_trainer_resumes(lambda: _make_iterable(gate), gate, plans, tmp_path, every=1)


def test_a_worker_lost_out_of_order_names_the_first_batch_not_delivered(tmp_path: Path
                                                                        ) -> None:
    """The batch due next is the frontier (the gated first one), not the count received."""
    gate = tmp_path / "gate"
    loader = _make_iterable(gate, max_worker_restarts=0)
    batches = iter(loader)
    got = [next(batches) for _ in range(2)]  # past the gated first batch
    assert tuple(got[0].tolist()) != _iterable_plan(0)[0] and loader.state_dict()["batches"] == 0
    for worker in loader_processes():
        os.kill(worker.pid, signal.SIGKILL)
    with pytest.raises(WorkerCrashedError, match="with batch 0 of epoch 0 due next") as crashed:
        for _ in batches:  # results sent before the kill still arrive
            pass
    assert crashed.value.batch == 0
    gate.touch()


def test_iterable_close_mid_epoch_goes_on_with_exactly_the_rest(tmp_path: Path) -> None:
    gate = tmp_path / "gate"
    loader = _make_iterable(gate)
    got: list[tuple[int, ...]] = []
    batches = iter(loader)
    for batch in batches:
        got.append(tuple(batch.tolist()))
        if len(got) == 2:
            ahead = loader.state_dict()["parts"]["window"]["ranks"][0][1]
            gate.touch()
            loader.close()  # workers stop with batches past the frontier delivered
    assert ahead and Counter(got) == Counter(_iterable_plan(0))


# -- a Ctrl-C in next() just after the window counted the batch ----------------------------


def _ctrl_c_after_the_window_counts(loader: ResumableLoader, at_frontier: bool, monkeypatch
                                    ) -> None:
    """The window's next count of a batch at the frontier with batches ahead to fold in
    (``at_frontier``), or past the frontier with one ahead already, counts it, then raises the
    ``KeyboardInterrupt`` that a Ctrl-C landing just after it raises, inside ``next()``."""
    window, schedule = loader._window, loader.schedule
    count = window.count

    def interrupted(frontier, batch: int) -> None:
        if (batch == schedule.batches) != at_frontier or not window.ahead:
            return count(frontier, batch)
        monkeypatch.undo()
        count(frontier, batch)
        raise KeyboardInterrupt

    monkeypatch.setattr(window, "count", interrupted)


MAKERS = {"map-style": (_make, lambda: _plan(24)),
          "iterable": (_make_iterable, lambda: _iterable_plan(0))}


@pytest.mark.parametrize("at_frontier", [True, False], ids=["at the frontier", "past it"])
@pytest.mark.parametrize("kind", MAKERS.values(), ids=MAKERS.keys())
def test_a_ctrl_c_after_the_window_counted_loses_and_repeats_no_batch(
        tmp_path: Path, kind, at_frontier: bool, monkeypatch) -> None:
    """A batch past the frontier counted in the window alone: nothing was taken back, and it
    was lost. One at the frontier moved it over the batches ahead: the schedule's count came
    back, but they had left the window, and came again. The window's count is taken back too:
    a resume and the same iterator going on deliver exactly the rest."""
    make, plan = kind
    gate = tmp_path / "gate"
    loader = make(gate)
    _ctrl_c_after_the_window_counts(loader, at_frontier, monkeypatch)
    got: list[tuple[int, ...]] = []
    iterator = iter(loader)
    with pytest.raises(KeyboardInterrupt):
        for batch in iterator:
            got.append(tuple(batch.tolist()))
            if len(got) == 2:
                gate.touch()
    gate.touch()
    state = checkpoint_roundtrip(loader.state_dict())
    assert _ahead(state) or at_frontier, state  # a batch was ahead before the one taken back
    resumed = make(gate)
    resumed.load_state_dict(state)
    assert Counter(got) + Counter(tuple(b.tolist()) for b in resumed) == Counter(plan())
    assert Counter(got) + Counter(tuple(b.tolist()) for b in iterator) == Counter(plan())
    loader.close()
    resumed.close()
