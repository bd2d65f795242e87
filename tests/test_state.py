from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from lightning_loaders import GeneratorSource, ResumableLoader
from lightning_loaders.errors import LoaderError, StateMismatchError
from lightning_loaders.state import STATE_VERSION, LoaderState, Stateful, abandoned, is_stateful
from tests.conftest import IndexDataset

FP = {"dataset_len": 10, "seed": 1, "batch_size": 2, "last_batch": "keep", "order": "shuffled"}


def test_round_trip_is_a_plain_dict() -> None:
    state = LoaderState("map", 3, 4, 2, fingerprint=FP).to_dict()
    assert state["version"] == STATE_VERSION
    assert all(isinstance(v, int | str | dict | None) for v in state.values())
    assert LoaderState.from_dict(state, "map", FP) == LoaderState("map", 3, 4, 2, fingerprint=FP)


def test_a_saved_state_shares_no_dict_with_the_live_one() -> None:
    """The nested dicts are copied (shallowly, not by ``asdict``'s deep copy per call)."""
    live = LoaderState("map", 1, 2, 1, fingerprint={"n": 3}, parts={"order": {"k": 1}})
    saved = live.to_dict()
    assert saved["fingerprint"] == {"n": 3} and saved["fingerprint"] is not live.fingerprint
    assert saved["parts"] == {"order": {"k": 1}} and saved["parts"] is not live.parts


class _Half:
    def state_dict(self) -> dict[str, Any]:
        return {}


class _Both(_Half):
    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        pass


class _NoneMember(_Both):
    load_state_dict = None  # type: ignore[assignment]


@pytest.mark.parametrize("obj", [_Half(), _Both(), _NoneMember(), object(), [], None])
def test_is_stateful_agrees_with_the_protocol(obj: Any) -> None:
    assert is_stateful(obj) == isinstance(obj, Stateful)


def test_mismatch_names_every_field_with_both_values() -> None:
    state = LoaderState("map", 0, 1, 1, fingerprint=FP).to_dict()
    other = {**FP, "dataset_len": 11, "seed": 2}
    with pytest.raises(StateMismatchError) as info:
        LoaderState.from_dict(state, "map", other)
    message = str(info.value)
    assert "dataset_len: saved 10, this loader 11" in message
    assert "seed: saved 1, this loader 2" in message
    assert "batch_size" not in message


def test_a_state_without_a_field_added_later_is_checked_without_it() -> None:
    """``content`` (the data's identity) came after version 2's first release: a state saved
    before it loads; a state that has it must match, and a loader without one refuses it."""
    with_content = {**FP, "content": "rows 1f"}
    old = LoaderState("map", 0, 1, 1, fingerprint=FP).to_dict()
    assert LoaderState.from_dict(old, "map", with_content).fingerprint == FP
    new = LoaderState("map", 0, 1, 1, fingerprint=with_content).to_dict()
    for expected, shown in (({**FP, "content": "rows 2e"}, "'rows 2e'"), (FP, "None")):
        with pytest.raises(StateMismatchError,
                           match=f"content: saved 'rows 1f', this loader {shown}"):
            LoaderState.from_dict(new, "map", expected)


@pytest.mark.parametrize(
    "bad",
    [
        {"version": 1, "epoch": 0, "batches": 0, "world_size": 1},
        {"version": STATE_VERSION, "kind": "map", "epoch": 0, "world_size": 1},
        {"version": STATE_VERSION, "kind": "map", "epoch": -1, "batches": 0, "world_size": 1},
        {"version": STATE_VERSION, "kind": "map", "epoch": 0, "batches": "2", "world_size": 1},
        {"version": STATE_VERSION, "kind": "map", "epoch": 0, "batches": 0, "world_size": 0},
        {"version": STATE_VERSION, "kind": "map", "epoch": 0, "batches": 0, "world_size": 1,
         "surprise": 1},
        {"version": STATE_VERSION, "kind": "map", "epoch": 0, "batches": 0, "world_size": 1,
         "abandoned": "yes"},
        {"version": STATE_VERSION, "kind": "map", "epoch": 0, "batches": 0, "world_size": 1,
         "fingerprint": {}},  # no parts
        [1, 2, 3],
    ],
)
def test_corrupted_states_are_refused(bad) -> None:
    with pytest.raises(StateMismatchError):
        LoaderState.from_dict(bad, "map", {})


def test_a_state_mismatch_is_a_loader_error_and_a_value_error() -> None:
    """One base catches every loader error; ``ValueError`` keeps ``load_state_dict`` callers
    that catch a bad argument working."""
    assert issubclass(StateMismatchError, LoaderError)
    assert issubclass(StateMismatchError, ValueError)


def test_a_state_of_the_other_kind_is_refused_by_its_kind() -> None:
    state = LoaderState("iterable", 0, 1, 1, fingerprint=FP).to_dict()
    with pytest.raises(StateMismatchError, match="saved by a loader of kind 'iterable'.*"
                                                 "this loader is of kind 'map'"):
        LoaderState.from_dict(state, "map", FP)


def _shard(bounds: tuple[int, int]) -> Iterator[dict[str, torch.Tensor]]:
    return ({"index": torch.tensor(i)} for i in range(*bounds))


LOADERS: dict[str, Callable[[], Any]] = {
    "map": lambda: ResumableLoader(IndexDataset(10), batch_size=2, shuffle=True, seed=1),
    "iterable": lambda: ResumableLoader(GeneratorSource(_shard, [(0, 4), (4, 10)], [4, 6]),
                                        batch_size=2, shuffle=True, shuffle_buffer=3, seed=1),
}


def _ids(batches: Any) -> list[Any]:
    return [batch["index"].tolist() for batch in batches]


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_an_abandoned_state_begins_the_next_epoch_as_the_live_loader_does(kind: str) -> None:
    """A pass that stops early (``limit_val_batches``) leaves the live loader mid-epoch, and
    its next ``iter()`` begins the next epoch; the state marked ``abandoned`` restores that,
    where the state itself continues the epoch."""
    live = LOADERS[kind]()
    batches = iter(live)
    first = _ids(next(batches) for _ in range(2))
    state = live.state_dict()
    rest_of_epoch = _ids(batches)
    next_epoch = _ids(live)
    left = abandoned(state)
    assert left is not None and left["abandoned"] is True and "abandoned" not in state
    restored = LOADERS[kind]()
    restored.load_state_dict(left)
    assert restored.resume_batch() == len(live)  # nothing of that epoch is left
    assert _ids(restored) == next_epoch and restored.epoch == 1
    continued = LOADERS[kind]()
    continued.load_state_dict(state)
    assert _ids(continued) == rest_of_epoch and len(first + rest_of_epoch) == len(live)


@pytest.mark.parametrize("kind", sorted(LOADERS))
def test_a_state_without_parts_is_refused_naming_the_key(kind: str) -> None:
    """It raised KeyError('parts') from the loader's restore of its parts."""
    loader = LOADERS[kind]()
    batches = iter(loader)
    next(batches)
    state = loader.state_dict()
    del state["parts"]
    fresh = LOADERS[kind]()
    with pytest.raises(StateMismatchError, match=r"corrupted loader state: missing keys "
                                                 r"\['parts'\]"):
        fresh.load_state_dict(state)
    assert fresh.state_dict()["batches"] == 0, "a refused state changes nothing"


def test_only_this_packages_states_can_be_marked_abandoned() -> None:
    assert abandoned({"epoch": 1, "batches": 2}) is None
    assert abandoned(None) is None
    marked = abandoned(LoaderState("map", 0, 1, 1, fingerprint=FP).to_dict())
    assert marked is not None
    assert LoaderState.from_dict(marked, "map", FP).abandoned
