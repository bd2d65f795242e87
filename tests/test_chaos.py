"""Chaos: training processes killed with SIGKILL at random steps, resumed from their last
checkpoint, must train on exactly the uninterrupted stream; and the plan itself, checked by
hypothesis over random configurations, covers every sample exactly once and resumes exactly.

Each chaos run (one per configuration of ``tests/scripts/chaos_train.py``) trains uninterrupted
once, then again while being killed ``TRAINER_KILLS`` times (at random steps and at epoch ends)
and having ``WORKER_KILLS`` DataLoader workers killed under it; after every resume, what the
process trains on must be the uninterrupted stream from its checkpoint's step, and no process
or shared-memory segment may outlive it. The kill points are seeded (``CHAOS_SEED``).

Out-of-order delivery (``in_order=False``) has no one uninterrupted stream: there, what was
trained on up to each checkpoint, stitched over every kill and resume, must hold every planned
batch of every epoch exactly once (nothing lost, nothing repeated).
"""

from __future__ import annotations

import io
import os
import random
import signal
import statistics
import time
import warnings
from collections import Counter
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psutil
import pytest
import torch
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st

from lightning_loaders import ResumableLoader
from lightning_loaders.orders.base import ShuffledOrder
from lightning_loaders.schedule.map_plan import LAST_BATCH_POLICIES
from lightning_loaders.schedule.map_schedule import MapSchedule
from tests.conftest import IndexDataset
from tests.scripts.chaos_train import (
    CONFIGURATIONS,
    MAP_BATCH,
    MAP_SIZE,
    ORDERED,
    TrainingZygote,
    make_loader,
    read_log,
)

CHAOS_SEED = 20260522
EPOCHS = 3
TRAINER_KILLS = 12
WORKER_KILLS = 3
KILL_MARGIN = 10  # steps a kill target leaves before the end of the run
HOLD_AFTER = 4  # steps past its kill target a child may train before it waits to be killed
IN_FLIGHT = 4  # batches the loader requests ahead: 2 workers x prefetch_factor 2
RESTART = "restarting 2 workers from the cursor"  # logged when the loader replaces them


@pytest.fixture(scope="module")
def zygote() -> Iterator[TrainingZygote]:
    forks = TrainingZygote()
    yield forks
    forks.close()


def _checkpoint_step(path: Path) -> int:
    """Steps trained when ``path`` was saved (0 without a checkpoint: start from scratch)."""
    if not path.exists():
        return 0
    return int(torch.load(path, map_location="cpu", weights_only=False)["global_step"])


def _wait_for_step(log: Path, step: int, pid: int) -> bool:
    """Wait until the child logged ``step`` (True) or exited (False)."""
    while True:
        lines = read_log(log)
        if lines and lines[-1]["step"] >= step:
            return True
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return False
        except psutil.NoSuchProcess:
            return False
        time.sleep(0.005)


def _worker_kill_step(resume: int, steps_per_epoch: int) -> int:
    """The first step after ``resume`` at which the child may pause while one of its workers
    is killed. Past the paused step, Lightning holds one batch and ``IN_FLIGHT`` are requested;
    when two more follow in the epoch, each worker still owes one nobody asked for yet, so the
    loader must miss the dead worker (one done with its epoch is shut down with it, unnoticed:
    no restart is due)."""
    step = resume + 1
    while step % steps_per_epoch + 1 + IN_FLIGHT + 2 >= steps_per_epoch:
        step += 1
    return step


def _wait_for_output(path: Path, text: str, pid: int, timeout: float = 60) -> None:
    """Wait until the child wrote ``text`` to its output, exited, or ``timeout`` passed."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if path.exists() and text in path.read_text():
            return
        try:
            if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
                return
        except psutil.NoSuchProcess:
            return
        time.sleep(0.005)


def _tree(pid: int) -> list[psutil.Process]:
    try:
        parent = psutil.Process(pid)
        return [parent, *parent.children(recursive=True)]
    except psutil.NoSuchProcess:
        return []


def _name(process: psutil.Process) -> str:
    try:
        return process.name()
    except psutil.NoSuchProcess:
        return ""


def _assert_gone(processes: list[psutil.Process], timeout: float = 30) -> None:
    """Every process has exited (orphaned DataLoader workers notice within seconds)."""
    deadline = time.monotonic() + timeout
    alive = processes
    while alive and time.monotonic() < deadline:
        alive = [p for p in alive if p.is_running() and p.status() != psutil.STATUS_ZOMBIE]
        time.sleep(0.2)
    assert not alive, f"processes outlived their training process: {alive}"
    pids = {p.pid for p in processes}
    left = [name for name in os.listdir("/dev/shm")
            if name.startswith("torch_") and int(name.split("_")[1]) in pids]
    assert not left, f"shared memory left behind: {left}"


def _planned_batches(kind: str) -> list[list[tuple[int, ...]]]:
    """Per epoch, the planned batches of ``kind`` in plan order (a loader without workers)."""
    loader = make_loader(kind, 0)
    plans = []
    for epoch in range(EPOCHS):
        loader.set_epoch(epoch)
        plans.append([tuple(batch.tolist()) for batch in loader])
    return plans


def _check_each_epoch_exactly_once(lines: list[dict[str, Any]],
                                   plans: list[list[tuple[int, ...]]], what: str) -> None:
    """``lines`` (steps, in any order within an epoch) hold every planned batch once."""
    for epoch, plan in enumerate(plans):
        trained = Counter(tuple(line["ids"]) for line in lines if line["epoch"] == epoch)
        lost, repeated = Counter(plan) - trained, trained - Counter(plan)
        assert not lost and not repeated, (
            f"{what}, epoch {epoch}: lost {sorted(lost)}, repeated or unplanned "
            f"{sorted(repeated)}")
    assert {line["epoch"] for line in lines} <= set(range(len(plans))), what


def _reordered(lines: list[dict[str, Any]], plans: list[list[tuple[int, ...]]]) -> int:
    """Steps of one process whose batch was planned before the previous step's batch."""
    position = [{batch: i for i, batch in enumerate(plan)} for plan in plans]
    planned = [(line["epoch"], position[line["epoch"]][tuple(line["ids"])]) for line in lines]
    return sum(later < earlier for earlier, later in zip(planned, planned[1:], strict=False))


def _chaos_run(zygote: TrainingZygote, kind: str, root: Path, steps_per_epoch: int
               ) -> dict[str, Any]:
    """Train ``kind`` uninterrupted, then again under SIGKILLs; compare every resumed stream
    (in order), or what was trained on in each epoch (out of order)."""
    ordered = kind in ORDERED
    plans = None if ordered else _planned_batches(kind)
    total = EPOCHS * steps_per_epoch
    reference_log = root / "reference.jsonl"
    pid = zygote.start(kind=kind, out=str(root / "reference"), log=str(reference_log),
                       epochs=EPOCHS, max_steps=total)
    assert zygote.wait(pid) == 0, (root / "reference").joinpath(f"output-{pid}.txt").read_text()
    reference = read_log(reference_log)
    assert [line["step"] for line in reference] == list(range(total))
    step_s = statistics.median(later["t"] - line["t"]
                               for line, later in zip(reference, reference[1:], strict=False))
    reference_ids = [line["ids"] for line in reference]
    reordered = 0
    if plans is not None:
        _check_each_epoch_exactly_once(reference, plans, "the uninterrupted run")
        reordered += _reordered(reference, plans)

    rng = random.Random(f"{CHAOS_SEED}-{kind}")
    out = root / "chaos"
    # Kill at random steps, and at the last step of every epoch but the final one (the known
    # trap: a checkpoint at an epoch's last batch must resume at the next epoch's first).
    boundaries = [steps_per_epoch * e - 1 for e in range(1, EPOCHS)]
    gap = total // (TRAINER_KILLS + 1)
    stitched: list[dict[str, Any]] = []
    resume, kills, worker_kills, attempts, held = 0, 0, 0, 0, 0
    processes: list[psutil.Process] = []
    while True:
        log = out / f"attempt-{attempts}.jsonl"
        target = None
        if kills < TRAINER_KILLS:
            # far enough from the end that a fast run cannot finish before the kill lands
            target = min(resume + rng.randint(0, 2 * gap), total - KILL_MARGIN)
            target = next((b for b in boundaries if resume <= b <= target), target)
        # In the first attempts, kill a DataLoader worker too, early enough that the loader must
        # notice and recover before the training process is killed itself: a random kill
        # target too close for that moves later (an epoch's last step stays a target).
        pause = _worker_kill_step(resume, steps_per_epoch) if worker_kills < WORKER_KILLS else None
        if pause is not None and target is not None and target < pause + 5:
            if target in boundaries or pause + 5 > total - KILL_MARGIN:
                pause = None
            else:
                target = pause + 5
        pid = zygote.start(kind=kind, out=str(out), log=str(log), epochs=EPOCHS,
                           max_steps=total,
                           hold_at=None if target is None else target + HOLD_AFTER,
                           pause_at=pause)
        if pause is not None and _wait_for_step(log, pause, pid):
            # the workers only (named as torch's are): the shared-memory manager or Python's
            # resource tracker may be children too, and killing one is not a worker crash
            workers = [p for p in _tree(pid)[1:] if _name(p) == "pt_data_worker"]
            if workers:
                rng.choice(workers).send_signal(signal.SIGKILL)
                worker_kills += 1
            Path(f"{log}.go").touch()
            # batches the worker made before it died may carry training past ``target``
            # before the loader misses it: kill the training process after the restart
            _wait_for_output(out / f"output-{pid}.txt", RESTART, pid)
        if target is not None and _wait_for_step(log, target, pid):
            # land anywhere in the next step or so: its fetch, training step or save
            logged = next(line["t"] for line in read_log(log) if line["step"] >= target)
            time.sleep(max(0.0, logged + rng.uniform(0.0, 1.5) * step_s - time.monotonic()))
            processes += _tree(pid)
            os.kill(pid, signal.SIGKILL)
        status = zygote.wait(pid)
        attempts += 1
        lines = read_log(log)
        assert [line["step"] for line in lines] == list(range(resume, resume + len(lines)))
        if ordered:
            assert [line["ids"] for line in lines] == reference_ids[resume:resume + len(lines)], (
                f"attempt {attempts} resumed at step {resume} diverged from the uninterrupted "
                "run")
        else:
            reordered += _reordered(lines, plans)
        if status == 0:
            stitched += lines
            break
        assert status == -signal.SIGKILL, (out / f"output-{pid}.txt").read_text()
        kills += 1
        held += bool(lines) and lines[-1]["step"] >= target + HOLD_AFTER
        saved = _checkpoint_step(out / "last.ckpt")
        assert resume <= saved <= resume + len(lines)
        stitched += lines[:saved - resume]
        resume = saved
    if plans is None:
        assert [line["ids"] for line in stitched] == reference_ids
    else:
        assert [line["step"] for line in stitched] == list(range(total))
        _check_each_epoch_exactly_once(stitched, plans,
                                       f"{attempts} attempts stitched at their checkpoints")
    _assert_gone(processes)
    restarts = sum(path.read_text().count(RESTART)
                   for path in out.glob("output-*.txt"))
    return {"trainer_kills": kills, "worker_kills": worker_kills, "worker_restarts": restarts,
            "attempts": attempts, "steps": total, "reordered_steps": reordered,
            "killed_while_held": held}


@pytest.mark.parametrize("kind", CONFIGURATIONS)
def test_sigkill_at_random_steps_then_resume_trains_on_the_uninterrupted_stream(
        zygote: TrainingZygote, tmp_path: Path, kind: str) -> None:
    """A loader with 2 workers under a real Trainer with a checkpoint after every step (out of
    order: each epoch's planned batches trained on exactly once over all kills).

    The run is bounded by ``max_steps``: with ``max_epochs`` alone, Lightning's own epoch count
    goes wrong after a resume at an epoch's last batch (see the xfail test below).
    """
    result = _chaos_run(zygote, kind, tmp_path, steps_per_epoch=len(make_loader(kind, 2)))
    print(f"chaos ({kind}, 2 workers): {result}")
    # every attempt above was checked against the uninterrupted stream
    assert result["trainer_kills"] == TRAINER_KILLS
    assert result["worker_restarts"] == result["worker_kills"] == WORKER_KILLS
    if kind not in ORDERED:  # a batch with a slow sample is overtaken, again and again
        assert result["reordered_steps"] > 0


@pytest.mark.xfail(strict=True, reason=(
    "Lightning 2.6.6: after a resume from a checkpoint taken at an epoch's last batch, the "
    "checkpoints of the following epoch record it as not started; resuming from one of them "
    "under max_epochs restarts that epoch at batch_idx 0 without restoring a loader passed to "
    "fit() (a plain DataLoader repeats its batches too) and trains one epoch too many. Under "
    "max_steps Lightning restores the loader (the chaos runs above)."))
def test_resume_twice_through_an_epoch_end_with_the_loader_passed_to_fit(tmp_path: Path
                                                                         ) -> None:
    from tests.lightning_harness import checkpoint_at, every_step_checkpoints, fit_recording

    def make() -> ResumableLoader:
        return ResumableLoader(IndexDataset(MAP_SIZE), batch_size=MAP_BATCH, shuffle=True,
                               seed=7)

    steps = -(-MAP_SIZE // MAP_BATCH)
    full = fit_recording(make, tmp_path / "a", 2, [every_step_checkpoints(tmp_path / "a")])
    fit_recording(make, tmp_path / "b", 2, [every_step_checkpoints(tmp_path / "b")],
                  ckpt_path=checkpoint_at(tmp_path / "a", steps))
    mid = steps + steps // 2
    again = fit_recording(make, tmp_path / "c", 2, ckpt_path=checkpoint_at(tmp_path / "b", mid))
    assert [ids for _, _, ids in again] == [ids for _, _, ids in full[mid:]]


# -- the plan, by hypothesis ---------------------------------------------------------------


def _schedules(n: int, batch_size: int, world: int, policy: str, seed: int
               ) -> list[MapSchedule]:
    return [MapSchedule(ShuffledOrder(n, seed), batch_size, policy, seed, rank, world)
            for rank in range(world)]  # type: ignore[arg-type]


def _epoch(schedules: list[MapSchedule], epoch: int | None, stop: int | None = None
           ) -> list[list[tuple[int, int, int]]]:
    """Deliver (the rest of) an epoch on every rank: per rank, per batch, ``(sample epoch,
    position, index)`` triples flattened in order; stops after ``stop`` batches if given."""
    out = []
    for schedule in schedules:
        if epoch is not None:
            schedule.set_epoch(epoch)
        schedule.begin_epoch()
        batches = []
        for request in schedule.requests():
            if stop is not None and len(batches) == stop:
                break
            batches.append(list(zip(request.sample_epochs.tolist(), request.positions.tolist(),
                                    request.indices.tolist(), strict=True)))
            schedule.delivered()
        out.append(batches)
    return out


def _roundtrip(state: dict[str, Any]) -> dict[str, Any]:
    buffer = io.BytesIO()
    torch.save(state, buffer)
    buffer.seek(0)
    return torch.load(buffer, weights_only=True)


def _valid(n: int, batch_size: int, world: int, policy: str) -> bool:
    try:
        schedules = _schedules(n, batch_size, world, policy, 0)
        if policy == "rollover":
            return n >= batch_size * world
        schedules[0].num_batches()
    except ValueError:
        return False
    return True


configs = st.tuples(st.integers(1, 40), st.integers(1, 5), st.integers(1, 4),
                    st.sampled_from(LAST_BATCH_POLICIES))


@settings(max_examples=300, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, seed=st.integers(0, 2**32), epochs=st.integers(1, 3),
       save=st.integers(0, 60), new_world=st.integers(1, 4))
def test_plan_covers_every_sample_exactly_once_and_resumes_exactly(config, seed, epochs, save,
                                                                    new_world) -> None:
    n, batch_size, world, policy = config
    assume(_valid(n, batch_size, world, policy))
    global_batch = batch_size * world
    ranks = _schedules(n, batch_size, world, policy, seed)
    full = [_epoch(ranks, e) for e in range(epochs)]
    for per_rank in full:
        counts = {len(batches) for batches in per_rank}
        assert len(counts) == 1, "every rank must have the same number of batches"
        samples = [s for batches in per_rank for batch in batches for s in batch]
        assert all(batch for batches in per_rank for batch in batches), "no empty batch"
        indices = Counter(index for _, _, index in samples)
        if policy == "keep":
            assert sorted(indices.elements()) == list(range(n))
        elif policy == "drop":
            assert max(indices.values()) == 1 and len(samples) == n // global_batch * global_batch
        elif policy == "pad":
            assert set(indices) == set(range(n))
            assert len(samples) == -(-n // global_batch) * global_batch
    if policy == "rollover":  # the epochs are one stream: every stream position exactly once
        stream = sorted(e * n + p for per_rank in full for batches in per_rank
                        for batch in batches for e, p, _ in batch)
        assert stream == list(range(len(stream)))
        assert len(stream) == epochs * n // global_batch * global_batch

    # Resume at global step ``save`` (counted over all epochs) on the same world size.
    lengths = [len(per_rank[0]) for per_rank in full]
    save = min(save, sum(lengths))
    epoch = next((e for e in range(epochs) if save < sum(lengths[:e + 1])), epochs - 1)
    done = save - sum(lengths[:epoch])
    source = _schedules(n, batch_size, world, policy, seed)
    for e in range(epoch):
        _epoch(source, e)
    _epoch(source, epoch, stop=done)
    state = _roundtrip(source[0].state_dict())
    resumed = _schedules(n, batch_size, world, policy, seed)
    for schedule in resumed:
        schedule.load_state_dict(state)
    rest = [_epoch(resumed, None)] if done < lengths[epoch] else []
    rest += [_epoch(resumed, e) for e in range(epoch + 1, epochs)]
    expected = [[batches[done:] for batches in full[epoch]]] if rest and done < lengths[epoch] \
        else []
    expected += full[epoch + 1:]
    assert rest == expected

    # Elastic: the rest of the epoch on another world size completes it exactly once.
    if policy in ("keep", "drop") and done < lengths[epoch]:
        elastic = _schedules(n, batch_size, new_world, policy, seed)
        try:
            for schedule in elastic:
                schedule.load_state_dict(state)
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                tail = _epoch(elastic, None)
        except ValueError:
            return  # a world size this short tail cannot be split over: refused, clearly
        consumed = [s for batches in full[epoch] for batch in batches[:done] for s in batch]
        after = [s for batches in tail for batch in batches for s in batch
                 if s[0] == epoch]  # an empty remainder moves on to the next epoch
        positions = Counter(p for _, p, _ in consumed + after)
        assert max(positions.values()) == 1, "no sample twice in one epoch"
        if policy == "keep":
            assert sorted(positions) == list(range(n))
        assert len({len(batches) for batches in tail}) == 1


@settings(max_examples=12, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(config=configs, workers=st.integers(0, 2), save=st.integers(0, 30))
def test_loader_delivers_the_plan_whatever_the_workers_and_resumes_exactly(config, workers,
                                                                          save) -> None:
    n, batch_size, world, policy = config
    assume(_valid(n, batch_size, world, policy))
    before = set(psutil.Process().children())
    for rank in range(world):
        def make(rank: int = rank) -> ResumableLoader:
            return ResumableLoader(IndexDataset(n), batch_size=batch_size, shuffle=True, seed=5,
                                   last_batch=policy, rank=rank, world_size=world,
                                   num_workers=workers)

        plan = _epoch(_schedules(n, batch_size, world, policy, 5), 0)[rank]
        with make() as loader:
            got = [b["index"].tolist() for b in loader]
        assert got == [[index for _, _, index in batch] for batch in plan]
        step = min(save, len(got) - 1)
        with make() as loader:
            iterator = iter(loader)
            for _ in range(step):
                next(iterator)
            state = _roundtrip(loader.state_dict())
        with make() as resumed:
            resumed.load_state_dict(state)
            assert [b["index"].tolist() for b in resumed] == got[step:]
    assert set(psutil.Process().children()) <= before, "no worker outlives its loader"
