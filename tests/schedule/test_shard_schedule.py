"""IterableSchedule's saved state: an edited or truncated one is refused at
``load_state_dict`` as corrupted, naming the field, before anything reads it."""

import copy
import re
from collections.abc import Callable, Iterator
from typing import Any

import pytest
import torch

from lightning_loaders import GeneratorSource, ResumableLoader
from lightning_loaders.errors import StateMismatchError


def _numbers(shard: int) -> Iterator[torch.Tensor]:
    return (torch.tensor([shard * 100 + i]) for i in range(5))


MAKERS: dict[str, Callable[[], ResumableLoader]] = {
    "partitions": lambda: ResumableLoader(GeneratorSource(_numbers, [0, 1, 2], lengths=[5] * 3),
                                          batch_size=2),
    "rollover": lambda: ResumableLoader(GeneratorSource(_numbers, [0, 1, 2], lengths=[5] * 3),
                                        batch_size=2, last_batch="rollover"),
    "unknown lengths": lambda: ResumableLoader(GeneratorSource(_numbers, [0, 1, 2]),
                                               batch_size=2),
}


def _saved(kind: str, batches: int = 2) -> dict[str, Any]:
    loader = MAKERS[kind]()
    delivered = iter(loader)
    for _ in range(batches):
        next(delivered)
    return copy.deepcopy(loader.state_dict())


def _slots(**changes: Any) -> Callable[[dict[str, Any]], None]:
    return lambda state: state["parts"]["slots"].update(changes)


def _batches(count: int) -> Callable[[dict[str, Any]], None]:
    return lambda state: state.update(batches=count)


POSITION = "[batches, samples, window start, piece, offset, reader state or None, exhausted]"
EDITS = [  # (loader, edit, the error's words): each raised a raw error or was accepted
    ("partitions", _slots(base="x"), "parts['slots']['base'] must be [first item, first "
                                     "batch] or [first item, first batch, skip], ints >= 0; "
                                     "got 'x'"),
    ("partitions", _slots(base=[0, -1]), "got [0, -1]"),
    ("partitions", _slots(base=[1, 3]), "parts['slots']['base']=[1, 3] begins its deal at "
                                        "batch 3, after the cursor's batches=2"),
    ("partitions", _slots(ended="no"), "parts['slots']['ended']='no' is not a bool"),
    ("partitions", _batches(10**6), "batches=1000000 is past the end of epoch 0, which has 8 "
                                    "batches on world size 1"),
    ("partitions", _batches(9), "batches=9 is past the end of epoch 0, which has 8 batches"),
    ("rollover", _batches(8), "batches=8 is past the end of epoch 0, which has 7 batches"),
    ("partitions", lambda state: state.update(world_size=1000), "batches=2 on world_size=1000 "
                                                                "cannot have been saved from "
                                                                "this data (last_batch='keep' "
                                                                "cannot give each of 1000 ranks"),
    ("unknown lengths", _slots(positions=[5]), f"rank 0's slot positions 5 are not 1 (its "
                                               f"slots per rank) {POSITION}, counts >= 0"),
    ("unknown lengths", _slots(positions=[[[-2, -4, -4, 0, -4, None, False]]]),
     "rank 0's slot positions [[-2, -4, -4, 0, -4, None, False]] are not 1"),
    ("unknown lengths", _slots(positions=[[[2, 4, 4, 0, 4, None, "no"]]]), "are not 1"),
    ("unknown lengths", _slots(positions=[[[2, 4, 4, 0, 4, 7, False]]]), "are not 1"),
    ("unknown lengths", _slots(positions=[[[2, 4, 4, 0, 4, None]]]), "are not 1"),
    ("unknown lengths", _slots(positions=[[[2, 4, 4, 0, 4, None, False]], None]),
     "parts['slots']['positions'] must hold a row per rank (1); got"),
    ("unknown lengths", _slots(ended=1), "parts['slots']['ended']=1 is not a bool"),
]


@pytest.mark.parametrize(("kind", "change", "words"), EDITS,
                         ids=[f"{kind}-{i}" for i, (kind, _, _) in enumerate(EDITS)])
def test_an_edited_state_is_refused_at_load_naming_the_field(kind: str, change, words) -> None:
    state = _saved(kind)
    change(state)
    loader = MAKERS[kind]()
    with pytest.raises(StateMismatchError, match=rf"^corrupted loader state: .*"
                                                 rf"{re.escape(words)}"):
        loader.load_state_dict(state)
    assert loader.state_dict()["batches"] == 0, "a refused state changes nothing"


@pytest.mark.parametrize("kind", sorted(MAKERS))
def test_a_state_at_its_epochs_end_still_loads(kind: str) -> None:
    """The bound is the epoch's batch count on the saved layout, reached by a state saved
    after its last batch."""
    whole = [batch.tolist() for batch in MAKERS[kind]()]
    state = _saved(kind, len(whole))
    state["parts"]["slots"]["ended"] = False  # as if the end was not seen yet
    loader = MAKERS[kind]()
    loader.load_state_dict(state)
    assert loader.state_dict()["batches"] == len(whole)
