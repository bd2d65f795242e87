"""``ResumableDataModule``: a ``LightningDataModule`` whose loaders always reach the Trainer as
distributed, resumable ones, and whose own state carries the training loaders' cursors.

Subclasses write the usual hooks returning ordinary ``DataLoader``s (or ``webdataset.WebLoader``s,
``ResumableLoader``s, or lists, dicts and ``CombinedLoader``s of them); what the hooks return is
converted with ``make_resumable`` (evaluation loaders with ``evaluation=True``; prediction
loaders also report their batch indices to ``BasePredictionWriter``). Lightning's sampler
replacement leaves the results alone (they are not ``DataLoader``s), whatever
``use_distributed_sampler`` says. A loader that is neither converted nor has a state of its
own is named in a warning: it would reach the Trainer unsplit, and a resume would restart it.

Why the cursors also live here: Lightning restores a datamodule's state before it builds the
training loaders, but restores the loaders' own state only if it builds them after restoring
the loops, which reading ``trainer.estimated_stepping_batches`` in ``configure_optimizers``
prevents (Lightning #20550). The cursor restored here is applied to the training loaders as soon
as both exist, and is consumed by the first of them to deliver a batch, so it takes effect
exactly once whichever path runs (and loading the same cursor twice before that is harmless).
Loaders rebuilt for a later epoch than the cursor's (``reload_dataloaders_every_n_epochs``
after a restart at an epoch's end) get neither this cursor nor Lightning's copy of it: they
start afresh, as the uninterrupted run's do.
"""

from __future__ import annotations

import functools
import warnings
from collections.abc import Callable, Iterator, Mapping
from typing import Any

import lightning as L
import numpy as np
import torch
from lightning.pytorch.utilities import CombinedLoader
from torch.utils.data import DataLoader

from lightning_loaders.lightning.batch_indices import expose_batch_indices
from lightning_loaders.lightning.in_flight import state_before_step, step_loaders
from lightning_loaders.loaders.convert import is_webloader, make_resumable
from lightning_loaders.loaders.map_style import MapStyleLoader
from lightning_loaders.loaders.resumable import ResumableLoader
from lightning_loaders.state import is_stateful

__all__ = ["STATE_KEY", "ResumableDataModule", "convert_loader", "convert_passed_loaders",
           "user_shards"]

STATE_KEY = "resumable_loaders"
_STATE_VERSION = 1
_STAGES = {"train_dataloader": "train", "val_dataloader": "validate",
           "test_dataloader": "test", "predict_dataloader": "predict"}


class ResumableDataModule(L.LightningDataModule):
    """A ``LightningDataModule`` base: write ordinary loaders, get resumable distributed ones.

    Override ``convert(loader, stage)`` to pass ``make_resumable`` overrides (a seed, a
    last-batch policy, ...) per stage. Overriding ``state_dict``/``load_state_dict`` is fine:
    the cursors are added to and taken from the state around them.
    """

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        for name, stage in _STAGES.items():
            hook = cls.__dict__.get(name)
            if callable(hook) and not hasattr(hook, "_converted_stage"):
                setattr(cls, name, _converting(hook, stage))
        state_dict = cls.__dict__.get("state_dict")
        if callable(state_dict) and not hasattr(state_dict, "_carries_cursors"):
            cls.state_dict = _with_cursors(state_dict)  # type: ignore[method-assign]
        load_state_dict = cls.__dict__.get("load_state_dict")
        if callable(load_state_dict) and not hasattr(load_state_dict, "_carries_cursors"):
            cls.load_state_dict = _restoring_cursors(load_state_dict)  # type: ignore[method-assign]

    def convert(self, loader: Any, stage: str) -> Any:
        """Make one loader resumable (``stage``: train, validate, test or predict)."""
        return convert_loader(loader, stage)

    def state_dict(self) -> dict[str, Any]:
        """The training loaders' cursors (under ``STATE_KEY``), without the batch of a
        training step in progress (``in_flight``: a restart runs that step again)."""
        return {STATE_KEY: _cursors(self).state(step_loaders(self.trainer))}

    def load_state_dict(self, state_dict: dict[str, Any]) -> None:
        """Restore the training loaders' cursors (applied once, see the module docstring)."""
        cursors = state_dict.get(STATE_KEY)
        if cursors is not None:
            _cursors(self).load(cursors)


class _Cursors:
    """The training loaders of the last ``train_dataloader()`` and a restored cursor for them."""

    def __init__(self) -> None:
        self.loaders: dict[str, Any] = {}
        self.pending: dict[str, Any] | None = None
        self.applied: list[tuple[Any, dict[str, Any]]] = []

    def track(self, loaders: Any, epoch: int | None) -> bool:
        """Follow the loaders ``train_dataloader()`` just built, in the trainer's ``epoch``
        (``None``: no trainer); the pending cursor goes to them unless a loader it was given
        has moved past it, or it belongs to an earlier epoch: loaders rebuilt for a later one
        (``reload_dataloaders_every_n_epochs``) start afresh, as the uninterrupted run's do.
        Returns whether the cursor was dropped for that."""
        outlived = self.pending is not None and self._outlived(epoch)
        if self.pending is not None and (outlived or self._consumed()):
            self.pending = None
        self.loaders = dict(_stateful_leaves(loaders))
        self._apply()
        return outlived

    def state(self, in_step: list[Any]) -> dict[str, Any]:
        """The loaders' states, those of ``in_step`` without the batch of the step in
        progress (``in_flight.step_loaders``)."""
        return {"version": _STATE_VERSION,
                "train": {key: state_before_step(loader)
                          if any(loader is other for other in in_step) else loader.state_dict()
                          for key, loader in self.loaders.items()}}

    def load(self, state: Mapping[str, Any]) -> None:
        if not isinstance(state, Mapping) or state.get("version") != _STATE_VERSION:
            version = state.get("version") if isinstance(state, Mapping) else state
            raise ValueError(f"unsupported {STATE_KEY} state: version {version!r}, this "
                             f"ResumableDataModule reads version {_STATE_VERSION}")
        self.pending = dict(state["train"])
        self.applied = []
        self._apply()

    def _apply(self) -> None:
        if self.pending is None or not self.loaders:
            return
        missing = sorted(set(self.pending) ^ set(self.loaders))
        if missing:
            warnings.warn(f"the restored training-loader cursors ({sorted(self.pending)}) and "
                          f"train_dataloader()'s loaders ({sorted(self.loaders)}) differ in "
                          f"{missing}: those start afresh", stacklevel=4)
        for key, loader in self.loaders.items():
            if key in self.pending:
                loader.load_state_dict(self.pending[key])
                self.applied.append((loader, self.pending[key]))

    def _outlived(self, epoch: int | None) -> bool:
        """Whether the trainer's ``epoch`` is past the ones the pending cursor's epochs began
        under (this package's states say it)."""
        assert self.pending is not None
        owners = [state.get("trainer_epoch") for state in self.pending.values()
                  if isinstance(state, Mapping)]
        began = [owner for owner in owners if isinstance(owner, int)]
        return epoch is not None and bool(began) and epoch > max(began)

    def _consumed(self) -> bool:
        """Whether a loader given the cursor has moved past it (it delivered a batch)."""
        return any(not _same(_progress(loader.state_dict()), _progress(state))
                   for loader, state in self.applied)


def _cursors(module: ResumableDataModule) -> _Cursors:
    cursors = module.__dict__.get("_resumable_cursors")
    if cursors is None:
        cursors = module.__dict__["_resumable_cursors"] = _Cursors()
    return cursors


def convert_loader(loader: Any, stage: str) -> Any:
    """A plain ``DataLoader`` or ``webdataset.WebLoader`` made resumable for ``stage`` (train,
    validate, test or predict: evaluation loaders read every sample once on every rank);
    anything else as it is."""
    if isinstance(loader, ResumableLoader) or not (isinstance(loader, DataLoader)
                                                   or is_webloader(loader)):
        return loader
    if stage == "train":
        return make_resumable(loader)
    return make_resumable(loader, evaluation=True)


def convert_passed_loaders(trainer: L.Trainer) -> None:
    """Make the plain ``DataLoader``s passed straight to ``trainer.fit`` resumable, as
    ``ResumableDataModule`` makes its hooks' loaders: Lightning would give them its
    ``DistributedSampler``, whose epoch restarts on resume. Loaders that come from hooks (a
    module's or a datamodule's) are left to them, and so are all under ``overfit_batches``,
    where Lightning rebuilds a shuffled ``DataLoader`` unshuffled (it cannot rebuild ours),
    and where the user shards them (``user_shards``)."""
    if getattr(trainer, "overfit_batches", 0) > 0 or user_shards(trainer):
        return  # overfit_batches: set by the Trainer, not declared
    fit_loop = trainer.fit_loop
    for source, stage in ((fit_loop._data_source, "train"),
                          (fit_loop.epoch_loop.val_loop._data_source, "validate")):
        if source.instance is not None and not source.is_module():
            source.instance = _convert_tree(source.instance,
                                            functools.partial(convert_loader, stage=stage))


def user_shards(trainer: L.Trainer) -> bool:
    """Whether ``Trainer(use_distributed_sampler=False)`` runs on several processes: each rank
    then reads its ``DataLoader`` as given (its sampler splits the data by rank itself, or
    every rank reads it all), and converting it would shard it once more."""
    connector = trainer._accelerator_connector
    return not connector.use_distributed_sampler and trainer.world_size > 1


def _converting(hook: Callable[..., Any], stage: str) -> Callable[..., Any]:
    @functools.wraps(hook)
    def converted(self: ResumableDataModule, *args: Any, **kwargs: Any) -> Any:
        loaders = _convert_tree(hook(self, *args, **kwargs),
                                functools.partial(self.convert, stage=stage))
        _warn_unconverted(loaders, hook.__name__, stage)
        if stage == "train":
            trainer = self.trainer
            outlived = _cursors(self).track(loaders, trainer.current_epoch if trainer else None)
            if outlived and trainer is not None:
                # Lightning's own copy of that cursor, which it would give these loaders when
                # they are its first after a restart (loops/fit_loop.py:552-556)
                trainer.fit_loop._combined_loader_states_to_load = []
        if stage == "predict":
            for _, leaf in _leaves(loaders):
                if isinstance(leaf, MapStyleLoader):
                    expose_batch_indices(leaf)
        return loaders

    converted._converted_stage = stage  # type: ignore[attr-defined]
    return converted


def _warn_unconverted(loaders: Any, hook: str, stage: str) -> None:
    """Warn of loaders ``hook`` returned that are still neither converted nor stateful (an
    iterable of another library's, or a loader an overridden ``convert`` kept): they pass on
    as they are."""
    for key, leaf in _leaves(loaders):
        if leaf is None or is_stateful(leaf) or not hasattr(type(leaf), "__iter__"):
            continue
        where = f"loader {key!r} " if key else ""
        restarts = (", and a resume restarts its epoch, repeating the samples read before the "
                    "checkpoint and losing others" if stage == "train" else "")
        if isinstance(leaf, DataLoader) or is_webloader(leaf):  # convert() kept it
            warnings.warn(f"{hook}() returned {where}({type(leaf).__name__}) that convert() "
                          "left as it is, with no state_dict(): it reaches the Trainer as it "
                          f"is, not split across ranks by this package{restarts}",
                          stacklevel=3)
            continue
        warnings.warn(f"{hook}() returned {where}({type(leaf).__name__}) that ResumableDataModule "
                      "cannot make resumable (it converts torch DataLoaders and "
                      "webdataset.WebLoaders) and that has no state_dict(): it reaches the "
                      f"Trainer as it is, not split across ranks by this package{restarts}. "
                      f"Return a DataLoader or a ResumableLoader(dataset, batch_size=...) from "
                      f"{hook}()", stacklevel=3)


def _with_cursors(state_dict: Callable[..., dict[str, Any]]) -> Callable[..., dict[str, Any]]:
    @functools.wraps(state_dict)
    def carrying(self: ResumableDataModule) -> dict[str, Any]:
        return {**state_dict(self), STATE_KEY: _cursors(self).state(step_loaders(self.trainer))}

    carrying._carries_cursors = True  # type: ignore[attr-defined]
    return carrying


def _restoring_cursors(load_state_dict: Callable[..., None]) -> Callable[..., None]:
    @functools.wraps(load_state_dict)
    def restoring(self: ResumableDataModule, state_dict: dict[str, Any]) -> None:
        rest = dict(state_dict)
        cursors = rest.pop(STATE_KEY, None)
        if cursors is not None:
            _cursors(self).load(cursors)
        load_state_dict(self, rest)

    restoring._carries_cursors = True  # type: ignore[attr-defined]
    return restoring


def _convert_tree(tree: Any, convert: Callable[[Any], Any]) -> Any:
    """``tree`` with every loader converted (dicts, lists, tuples, ``CombinedLoader``s)."""
    if isinstance(tree, CombinedLoader):
        tree.flattened = [convert(loader) for loader in tree.flattened]
        return tree
    if isinstance(tree, Mapping):
        return type(tree)({key: _convert_tree(value, convert)  # type: ignore[call-arg]
                           for key, value in tree.items()})
    if isinstance(tree, list | tuple):
        return type(tree)(_convert_tree(value, convert) for value in tree)
    return convert(tree)


def _leaves(tree: Any, prefix: str = "") -> Iterator[tuple[str, Any]]:
    if isinstance(tree, CombinedLoader):
        for i, loader in enumerate(tree.flattened):
            yield f"{prefix}{i}", loader
    elif isinstance(tree, Mapping):
        for key, value in tree.items():
            yield from _leaves(value, f"{prefix}{key}/")
    elif isinstance(tree, list | tuple):
        for i, value in enumerate(tree):
            yield from _leaves(value, f"{prefix}{i}/")
    else:
        yield prefix.rstrip("/"), tree


def _stateful_leaves(tree: Any) -> Iterator[tuple[str, Any]]:
    for key, leaf in _leaves(tree):
        if callable(getattr(leaf, "state_dict", None)) and callable(
                getattr(leaf, "load_state_dict", None)):
            yield key, leaf


def _progress(state: Any) -> Any:
    """A cursor's position when it has one (ours: epoch and batches), else the whole state."""
    if isinstance(state, Mapping) and "epoch" in state and "batches" in state:
        return state["epoch"], state["batches"]
    return state


def _same(a: Any, b: Any) -> bool:
    """Deep equality of two states that may hold tensors or arrays."""
    if isinstance(a, Mapping) and isinstance(b, Mapping):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    if isinstance(a, torch.Tensor) and isinstance(b, torch.Tensor):
        return a.shape == b.shape and bool(torch.equal(a, b))
    if isinstance(a, np.ndarray) and isinstance(b, np.ndarray):
        return bool(np.array_equal(a, b))
    if isinstance(a, list | tuple) and isinstance(b, list | tuple):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b, strict=True))
    return bool(a == b)
