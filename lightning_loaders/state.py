"""The loader's state: a small, versioned, plain dict (safe for ``torch.save`` and checkpoints).

Its size is O(1) in dataset length and in worker count. Restoring into a loader whose dataset or
configuration differs is refused with every mismatched field and both values named.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import asdict, dataclass, field, fields
from typing import Any

from lightning_loaders.errors import StateMismatchError

__all__ = ["STATE_VERSION", "LoaderState"]

STATE_VERSION = 1
VERSION = "version"
FINGERPRINT = "fingerprint"


@dataclass(frozen=True)
class LoaderState:
    """The cursor and what it is only valid for.

    Attributes:
        epoch: the epoch the cursor is in.
        batches: batches delivered to the caller in ``epoch`` (as the trainer counts them).
        world_size: the world size the cursor was counted under.
        offset_position: first epoch position of the current plan (non-zero after an elastic
            resume: the positions before it were consumed under another world size).
        offset_batches: batches delivered in ``epoch`` before that plan started.
        trainer_epoch: the trainer's epoch (its last ``set_epoch``) when ``epoch`` began; a
            later trainer epoch on restore means the trainer has moved on from this epoch.
        fingerprint: dataset length, seed, batch size, last-batch policy and order; must match.
        extra: component-specific state (for example a sampler's own ``state_dict``).
    """

    epoch: int
    batches: int
    world_size: int
    offset_position: int = 0
    offset_batches: int = 0
    trainer_epoch: int | None = None
    fingerprint: Mapping[str, Any] = field(default_factory=dict)
    extra: Mapping[str, Any] = field(default_factory=dict)

    def to_dict(self) -> dict[str, Any]:
        state = asdict(self)
        state[FINGERPRINT] = dict(self.fingerprint)
        state["extra"] = dict(self.extra)
        return {VERSION: STATE_VERSION, **state}

    @classmethod
    def from_dict(cls, state: Mapping[str, Any], expected: Mapping[str, Any]) -> LoaderState:
        """Parse ``state`` and check its fingerprint against ``expected`` (this loader's)."""
        if not isinstance(state, Mapping):
            raise StateMismatchError(f"a loader state must be a dict, got {type(state).__name__}")
        if state.get(VERSION) != STATE_VERSION:
            raise StateMismatchError(
                f"unsupported state version: saved {state.get(VERSION)!r}, this "
                f"loader reads version {STATE_VERSION}")
        names = [f.name for f in fields(cls)]
        missing = [n for n in names[:3] if n not in state]
        unknown = sorted(set(state) - set(names) - {VERSION})
        if missing or unknown:
            raise StateMismatchError(
                f"corrupted loader state: missing keys {missing}, unknown keys {unknown}")
        for name in ("epoch", "batches", "world_size", "offset_position", "offset_batches"):
            value = state.get(name, 0)
            if not isinstance(value, int) or isinstance(value, bool) or value < 0:
                raise StateMismatchError(
                    f"corrupted loader state: {name}={value!r} is not an int >= 0")
        trainer_epoch = state.get("trainer_epoch")
        if trainer_epoch is not None and (not isinstance(trainer_epoch, int) or trainer_epoch < 0):
            raise StateMismatchError(
                f"corrupted loader state: trainer_epoch={trainer_epoch!r} is not an "
                "int >= 0 or None")
        if state["world_size"] < 1:
            raise StateMismatchError("corrupted loader state: world_size must be >= 1")
        if state.get("offset_batches", 0) > state["batches"]:
            raise StateMismatchError(
                f"corrupted loader state: offset_batches={state['offset_batches']} "
                f"exceeds batches={state['batches']}")
        for name in (FINGERPRINT, "extra"):
            if not isinstance(state.get(name, {}), Mapping):
                raise StateMismatchError(
                    f"corrupted loader state: {name}={state[name]!r} is not a dict")
        saved = dict(state.get(FINGERPRINT, {}))
        mismatches = [
            f"{key}: saved {saved.get(key)!r}, this loader {expected.get(key)!r}"
            for key in sorted(set(saved) | set(expected))
            if saved.get(key) != expected.get(key)
        ]
        if mismatches:
            raise StateMismatchError("state_dict does not belong to this loader's dataset and "
                             "configuration:\n  " + "\n  ".join(mismatches))
        return cls(**{n: state[n] for n in names if n in state})
