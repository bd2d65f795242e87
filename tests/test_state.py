import pytest

from lightning_loaders.errors import LoaderError, StateMismatchError
from lightning_loaders.state import STATE_VERSION, LoaderState

FP = {"dataset_len": 10, "seed": 1, "batch_size": 2, "last_batch": "keep", "order": "shuffled"}


def test_round_trip_is_a_plain_dict() -> None:
    state = LoaderState("map", 3, 4, 2, fingerprint=FP).to_dict()
    assert state["version"] == STATE_VERSION
    assert all(isinstance(v, int | str | dict | None) for v in state.values())
    assert LoaderState.from_dict(state, "map", FP) == LoaderState("map", 3, 4, 2, fingerprint=FP)


def test_mismatch_names_every_field_with_both_values() -> None:
    state = LoaderState("map", 0, 1, 1, fingerprint=FP).to_dict()
    other = {**FP, "dataset_len": 11, "seed": 2}
    with pytest.raises(StateMismatchError) as info:
        LoaderState.from_dict(state, "map", other)
    message = str(info.value)
    assert "dataset_len: saved 10, this loader 11" in message
    assert "seed: saved 1, this loader 2" in message
    assert "batch_size" not in message


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
