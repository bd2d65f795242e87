"""The resume audit: a map-style state carries a digest of its last batch, checked on restore
against the batch the plan puts there."""

from __future__ import annotations

import pickle
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest
import torch

from lightning_loaders import ResumableLoader, StateMismatchError
from lightning_loaders.schedule.audit import saved_digest
from lightning_loaders.testing import check_resume_at_every_step, checkpoint_roundtrip, set_epoch
from tests.conftest import IndexDataset, RangeDataset


class OwnSeedSampler(torch.utils.data.Sampler[int]):
    """A sampler seeded by its own argument, which the loader's fingerprint cannot see."""

    def __init__(self, n: int, seed: int) -> None:
        self.n, self.seed, self.epoch = n, seed, 0

    def set_epoch(self, epoch: int) -> None:
        self.epoch = epoch

    def __len__(self) -> int:
        return self.n

    def __iter__(self) -> Iterator[int]:
        return iter(np.random.default_rng([self.seed, self.epoch]).permutation(self.n).tolist())


def indices(batch: dict[str, torch.Tensor]) -> list[int]:
    return batch["index"].tolist()


def state_after(loader: Any, batches: int, epoch: int = 0) -> dict[str, Any]:
    set_epoch(loader, epoch)
    iterator = iter(loader)
    for _ in range(batches):
        next(iterator)
    return checkpoint_roundtrip(loader.state_dict())


def shuffled(seed: int = 1, **kwargs: Any) -> ResumableLoader:
    return ResumableLoader(IndexDataset(40), batch_size=4, shuffle=True, seed=seed, **kwargs)


def sampled(sampler_seed: int) -> ResumableLoader:
    return ResumableLoader(IndexDataset(40), batch_size=4, sampler=OwnSeedSampler(40, sampler_seed))


def test_a_state_of_another_order_with_the_same_fingerprint_is_refused() -> None:
    """A sampler drawn with another seed of its own, and a seed edited in the fingerprint: the
    fingerprint passes, the batch the state stands after is not the plan's."""
    other_sampler = state_after(sampled(sampler_seed=1), 3)
    assert other_sampler["fingerprint"] == state_after(sampled(sampler_seed=2), 3)["fingerprint"]
    other_seed = state_after(shuffled(seed=1), 3)
    other_seed["fingerprint"]["seed"] = 2
    for state, loader in ((other_sampler, sampled(sampler_seed=2)), (other_seed, shuffled(2))):
        with pytest.raises(StateMismatchError, match="resume audit failed") as error:
            loader.load_state_dict(state)
        saved = saved_digest(state)
        predicted = saved_digest(state_after(loader, 3))
        assert saved is not None and predicted is not None and saved != predicted
        assert f"digest {saved}" in str(error.value)
        assert f"digest {predicted}" in str(error.value)


def test_an_edited_cursor_is_refused_and_changes_nothing() -> None:
    expected = [indices(b) for b in shuffled()]
    state = state_after(shuffled(), 5)
    loader = shuffled()
    for edit in ({"batches": 4}, {"batches": 6}, {"epoch": 1}):
        with pytest.raises(StateMismatchError, match="after batch|epoch 1") as error:
            loader.load_state_dict({**state, **edit})
        assert f"digest {saved_digest(state)}" in str(error.value)
    loader.load_state_dict(state)
    assert [indices(b) for b in loader] == expected[5:]


@pytest.mark.parametrize("last_batch", ["keep", "drop", "pad", "rollover"])
def test_digests_do_not_depend_on_workers_and_every_step_resumes(last_batch: str) -> None:
    def digests(num_workers: int) -> list[str | None]:
        loader = ResumableLoader(IndexDataset(23), batch_size=4, shuffle=True, seed=3,
                                 num_workers=num_workers, last_batch=last_batch)
        found = []
        for epoch in range(2):
            set_epoch(loader, epoch)
            for _ in loader:
                found.append(saved_digest(loader.state_dict()))
        loader.close()
        return found

    in_process = digests(0)
    assert None not in in_process and len(set(in_process)) == len(in_process)
    assert digests(2) == in_process
    check_resume_at_every_step(
        lambda: ResumableLoader(IndexDataset(23), batch_size=4, shuffle=True, seed=3,
                                last_batch=last_batch), epochs=2, key=indices)


def test_a_rank_restores_rank_0s_state_and_elastic_resume_is_audited_too() -> None:
    """Under DDP every rank loads rank 0's state: the digest is predicted for the rank and
    world size it names."""
    def ranked(rank: int, world_size: int) -> ResumableLoader:
        return shuffled(rank=rank, world_size=world_size)

    state = state_after(ranked(0, 2), 2)
    expected = [indices(b) for b in ranked(1, 2)][2:]
    rank_1 = ranked(1, 2)
    rank_1.load_state_dict(state)
    assert [indices(b) for b in rank_1] == expected
    elastic = ranked(0, 1)
    elastic.load_state_dict(state)
    assert len(list(elastic)) == 6  # the 24 positions the two ranks had not read
    edited = {**state, "parts": {**state["parts"], "audit": {**state["parts"]["audit"],
                                                              "rank": 1}}}
    with pytest.raises(StateMismatchError, match="rank 1 of 2"):
        ranked(1, 2).load_state_dict(edited)


def test_the_audit_part_is_a_few_bytes_and_absent_before_the_first_batch() -> None:
    loader = shuffled()
    assert "audit" not in loader.state_dict()["parts"]
    state = state_after(loader, 1)
    assert len(pickle.dumps(state["parts"]["audit"])) < 100


def test_an_audited_resume_at_the_end_of_a_billion_sample_epoch_is_a_jump() -> None:
    """Predicting the digest reads one batch of the plan: 10**9 indices would not fit here."""
    n, batch_size = 10**9, 1000
    loader = ResumableLoader(RangeDataset(n), batch_size=batch_size, shuffle=True, seed=1)
    loader.load_state_dict({**loader.state_dict(), "batches": len(loader) - 2})
    next(iter(loader))
    state = loader.state_dict()
    assert saved_digest(state) is not None
    resumed = ResumableLoader(RangeDataset(n), batch_size=batch_size, shuffle=True, seed=1)
    resumed.load_state_dict(state)
    assert len(list(resumed)) == 1
    with pytest.raises(StateMismatchError, match="resume audit failed"):
        resumed.load_state_dict({**state, "batches": len(loader) - 3})
