from pathlib import Path

import lightning as L
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader

from lightning_loaders import ResumableLoader
from lightning_loaders.errors import StateMismatchError
from lightning_loaders.loaders.convert import make_resumable
from lightning_loaders.orders.dynamic_weighted import DynamicWeightedSampler
from lightning_loaders.testing import check_resume_at_every_step, checkpoint_roundtrip, run_epochs
from tests.conftest import IndexDataset
from tests.lightning_harness import (
    RecordingModule,
    checkpoint_at,
    every_step_checkpoints,
    fit_recording,
)

N = 24


def indices(batch) -> list[int]:
    return batch["index"].tolist()


def test_a_change_applies_from_the_next_batch_whatever_the_workers() -> None:
    """Workers prefetch batches planned with the old weights; those are re-planned."""
    runs = []
    for workers in (0, 2):
        sampler = DynamicWeightedSampler(np.ones(N))
        loader = ResumableLoader(IndexDataset(N), sampler=sampler, batch_size=4, seed=1,
                                 num_workers=workers)
        iterator = iter(loader)
        batches = [indices(next(iterator)) for _ in range(2)]
        sampler.set_weights(np.r_[np.zeros(N - 2), 1.0, 1.0])
        batches += [indices(b) for b in iterator]
        runs.append(batches)
        loader.close()
    assert runs[0] == runs[1]
    assert len(runs[0]) == N // 4
    assert {i for b in runs[0][2:] for i in b} <= {N - 2, N - 1}
    assert len({i for b in runs[0][:2] for i in b}) > 2


def test_out_of_order_a_change_applies_to_every_batch_not_delivered(tmp_path: Path) -> None:
    """With ``in_order=False``, batches delivered past a batch in flight keep the old weights
    and every batch not delivered (the one in flight too) is re-planned under the new ones,
    live and from the state saved then: it holds the weights, not a step, so unlike a ``Mix``
    change it cannot describe a step that was delivered already."""
    from tests.loaders.test_out_of_order import Gated

    gate = tmp_path / "gate"

    def make(gated: frozenset[int] = frozenset(), sampler: DynamicWeightedSampler | None = None,
             **kwargs) -> ResumableLoader:
        return ResumableLoader(Gated(N, str(gate), gated), batch_size=3, seed=4,
                               sampler=DynamicWeightedSampler(np.ones(N)) if sampler is None
                               else sampler, **kwargs)

    plain = [b.tolist() for b in make()]
    drawn = [i for b in plain for i in b]
    slow = next(i for i in plain[2] if drawn.count(i) == 1 and i < N - 4)  # drawn once
    weights = DynamicWeightedSampler(np.ones(N))
    made = make(frozenset({slow}), weights, num_workers=2, in_order=False)  # batch 2 waits
    numbers = made.delivery_order()
    assert numbers is not None
    batches = iter(made)
    got = [next(batches).tolist() for _ in range(5)]
    delivered = list(numbers)
    assert 2 not in delivered and max(delivered) > made.state_dict()["batches"], delivered
    weights.update_weights(range(N - 4), np.zeros(N - 4))  # only 20..23 from now on
    state = checkpoint_roundtrip(made.state_dict())
    gate.touch()
    rest = [b.tolist() for b in batches]
    assert got == [plain[n] for n in delivered] and len(got + rest) == len(plain)
    assert all(i >= N - 4 for b in rest for i in b) and plain[2] not in rest
    for resumed in (make(), make(num_workers=2, in_order=False)):
        resumed.load_state_dict(state)
        assert sorted(b.tolist() for b in resumed) == sorted(rest)


class Reweighting:
    """A loader wrapper that re-weights after every batch from what the batch held (a stand-in
    for an ``on_train_batch_end`` callback), before the caller can checkpoint."""

    def __init__(self, workers: int = 0) -> None:
        self.weights = DynamicWeightedSampler(np.ones(N))
        self.loader = make_resumable(DataLoader(IndexDataset(N), batch_size=3,
                                                sampler=self.weights), seed=4,
                                     num_workers=workers)
        self.sampler = self.loader.sampler

    def __iter__(self):
        for batch in self.loader:
            seen = batch["index"]
            self.weights.update_weights(seen, self.weights.weights[seen.numpy()] * 0.25)
            yield batch

    def state_dict(self) -> dict:
        return self.loader.state_dict()

    def load_state_dict(self, state: dict) -> None:
        self.loader.load_state_dict(state)


def test_reweighting_mid_epoch_resumes_exactly_at_every_step() -> None:
    full = check_resume_at_every_step(Reweighting, epochs=2, key=indices)
    drawn = [i for e in full for b in e for i in b]
    assert len(set(drawn)) > len(drawn) / 3, "down-weighting seen samples spreads the draws"
    unweighted = ResumableLoader(IndexDataset(N), sampler=DynamicWeightedSampler(np.ones(N)),
                                 batch_size=3, seed=4)
    assert run_epochs(unweighted, range(2), key=indices) != full


def test_the_state_holds_weights_only_once_they_changed() -> None:
    sampler = DynamicWeightedSampler(np.ones(5))
    assert sampler.state_dict() == {"weights": None}
    sampler.update_weights([1, 3], [0.0, 2.0])
    state = sampler.state_dict()
    assert state["weights"].tolist() == [1.0, 0.0, 1.0, 2.0, 1.0]
    fresh = DynamicWeightedSampler(np.ones(5))
    fresh.load_state_dict(state)
    assert fresh.weights.tolist() == state["weights"].tolist()
    fresh.load_state_dict({"weights": None})
    assert fresh.weights.tolist() == [1.0] * 5
    with pytest.raises(ValueError):
        fresh.weights[0] = 3.0


@pytest.mark.parametrize(("weights", "match"), [
    ("x", r"\(a str\) are refused: could not convert string to float: 'x'"),
    ([1.0, 2.0], r"\(a list\) are refused: .*one entry per sample: got 2, expected 5"),
    (torch.tensor([1.0, -1.0, 1.0, 1.0, 1.0]), r"\(a Tensor\) are refused: .*weights\[1\]=-1.0"),
])
def test_corrupted_saved_weights_are_refused(weights, match: str) -> None:
    """'x' raised numpy's ValueError from inside check_weights, naming no state."""
    sampler = DynamicWeightedSampler(np.ones(5))
    with pytest.raises(StateMismatchError, match="corrupted DynamicWeightedSampler state: its "
                                                 f"saved 'weights' {match}"):
        sampler.load_state_dict({"weights": weights})


def test_bad_updates_are_refused_with_the_values() -> None:
    sampler = DynamicWeightedSampler(np.ones(5))
    with pytest.raises(ValueError, match="got 4, expected 5"):
        sampler.set_weights(np.ones(4))
    with pytest.raises(ValueError, match="same length, got 2 and 1"):
        sampler.update_weights([0, 1], [1.0])
    with pytest.raises(IndexError, match="\\[0, 5\\)"):
        sampler.update_weights([7], [1.0])
    with pytest.raises(ValueError, match="all be zero"):
        sampler.update_weights(range(5), np.zeros(5))


def test_it_works_as_a_plain_torch_sampler_too() -> None:
    sampler = DynamicWeightedSampler([0.0, 1.0, 0.0, 1.0], num_samples=8, seed=2)
    draws = list(DataLoader(range(4), batch_size=4, sampler=sampler))
    assert sum(len(b) for b in draws) == 8
    assert {int(i) for b in draws for i in b} <= {1, 3}


class _Reweigh(L.Callback):
    """Down-weights the samples of every trained batch (as a loss-based re-weighting would)."""

    def __init__(self, weights: DynamicWeightedSampler) -> None:
        self.weights = weights

    def on_train_batch_end(self, trainer, module, outputs, batch, batch_idx) -> None:
        seen = batch["index"]
        self.weights.update_weights(seen, self.weights.weights[seen.numpy()] * 0.25 + 0.01)


def test_trainer_resume_after_mid_epoch_reweighting_is_exact(tmp_path: Path) -> None:
    def run(callbacks_for, ckpt_path=None) -> list:
        weights = DynamicWeightedSampler(torch.ones(N))
        loader = DataLoader(IndexDataset(N), batch_size=4, sampler=weights)
        return fit_recording(lambda: make_resumable(loader, num_workers=1), tmp_path, 2,
                             callbacks=[_Reweigh(weights), *callbacks_for],
                             ckpt_path=ckpt_path, model=RecordingModule())

    directory = tmp_path / "checkpoints"
    full = run([every_step_checkpoints(directory)])
    assert len(full) == 2 * (N // 4)
    for step in (3, 6, 8):
        assert run([], checkpoint_at(directory, step)) == full[step:]
