"""A built DALI pipeline and its iterator (``Engine``), the placement it was built for, and
the DALI checkpoints a ``DALILoader`` saves (gathered from every rank) and restores."""

from __future__ import annotations

import functools
import gc
import inspect
import os
from collections.abc import Callable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from typing import Any, NamedTuple

import torch

__all__ = [
    "Engine",
    "EngineBox",
    "Entry",
    "INSTALL_HINT",
    "Placement",
    "Restore",
    "call_pipeline",
    "check_pipeline",
    "frozen_heap",
    "import_dali",
    "shutdown_pipeline",
]

INSTALL_HINT = ("DALILoader needs NVIDIA DALI: pip install 'lightning-loaders[dali]' (or the "
                "nvidia-dali-cudaXYZ wheel that matches your CUDA version)")


def import_dali() -> tuple[Any, Any]:
    """``(nvidia.dali.Pipeline, nvidia.dali.plugin.pytorch)``, or an ImportError with the hint."""
    try:
        from nvidia.dali import Pipeline
        from nvidia.dali.plugin import pytorch as dali_torch
    except ImportError as exc:
        raise ImportError(INSTALL_HINT) from exc
    return Pipeline, dali_torch


class Placement(NamedTuple):
    """Where a pipeline was built for: rank, world size and CUDA device (``None``: CPU)."""

    rank: int
    world_size: int
    device_id: int | None


class Entry:
    """One rank's saved pipeline: DALI checkpoint, the cursor it stands at, iteration, seed."""

    def __init__(self, raw: Mapping[str, Any]) -> None:
        self.checkpoint: str = raw["checkpoint"]
        self.at: tuple[int, int] = (int(raw["epoch"]), int(raw["batches"]))
        self.iteration = int(raw["iteration"])
        self.seed = int(raw["seed"])


class Restore:
    """What ``load_state_dict`` brought for the pipeline: the saved world size and entries."""

    def __init__(self, world_size: int, entries: Sequence[Mapping[str, Any] | None] | None):
        self.world_size = world_size
        self.entries = list(entries or [])

    def entry(self, placement: Placement) -> Entry | None:
        if placement.world_size != self.world_size or len(self.entries) != self.world_size:
            return None
        raw = self.entries[placement.rank]
        return None if raw is None else Entry(raw)


class Engine:
    """A built pipeline and its DALI iterator; ``at`` is the cursor of the next batch, and
    ``built_at`` the one it was built at."""

    def __init__(self, pipe: Any, iterator: Any, placement: Placement, at: tuple[int, int],
                 iteration: int, seed: int, reader: bool) -> None:
        self.pipe, self.iterator, self.placement = pipe, iterator, placement
        self.at, self.iteration, self.seed, self.reader = at, iteration, seed, reader
        self.built_at = at
        self.reader_meta: dict[str, Any] = {}
        self.order_version = 0
        self._pid = os.getpid()

    def next(self) -> dict[str, torch.Tensor]:
        batch: dict[str, torch.Tensor] = next(self.iterator)[0]
        self.iteration += 1
        return batch

    def advance(self, last: bool) -> None:
        """Move ``at`` past the batch just read; at an epoch's end, reset DALI's reader now, so
        a checkpoint taken on the last batch already stands at the next epoch's start."""
        epoch, batches = self.at
        if not last:
            self.at = (epoch, batches + 1)
            return
        self.at = (epoch + 1, 0)
        if self.reader:
            self.iterator.reset()

    def entry(self) -> dict[str, Any]:
        return {"checkpoint": self.iterator.checkpoints()[0], "epoch": self.at[0],
                "batches": self.at[1], "iteration": self.iteration, "seed": self.seed}

    def close(self) -> None:
        if os.getpid() != self._pid:
            return  # a forked process's copy: the pipeline belongs to the parent
        shutdown_pipeline(self.pipe)
        self.iterator = self.pipe = None


class EngineBox:
    """Holds the loader's engine so a finalizer can shut it down without holding the loader."""

    def __init__(self) -> None:
        self.engine: Engine | None = None

    def close(self) -> None:
        engine, self.engine = self.engine, None
        if engine is not None:
            engine.close()


def call_pipeline(pipeline: Callable[..., Any], kwargs: dict[str, Any],
                  context: dict[str, Any]) -> Any:
    """Call a ``@pipeline_def`` function (all ``Pipeline`` keywords, the context keywords it
    declares) or a factory (the keywords it declares)."""
    params = inspect.signature(pipeline).parameters
    takes_all = any(p.kind is inspect.Parameter.VAR_KEYWORD for p in params.values())
    target = pipeline.func if isinstance(pipeline, functools.partial) else pipeline
    declared = {k: v for k, v in context.items() if takes_all or k in params}
    if getattr(target, "_is_pipeline_def", False):
        return pipeline(**kwargs, **declared)
    return pipeline(**{k: v for k, v in kwargs.items() if takes_all or k in params}, **declared)


def check_pipeline(pipe: Any, batch_size: int) -> None:
    pipeline_type, _ = import_dali()
    if not isinstance(pipe, pipeline_type):
        raise TypeError(f"the pipeline function must return a DALI Pipeline, got "
                        f"{type(pipe).__name__}")
    if pipe.max_batch_size != batch_size:
        raise ValueError(f"the pipeline's batch_size is {pipe.max_batch_size}, the loader's "
                         f"{batch_size}: let the factory pass batch_size on to the Pipeline")
    if not getattr(pipe, "_enable_checkpointing", False):
        raise ValueError("the pipeline was built without checkpointing: let the factory pass "
                         "enable_checkpointing and checkpoint on to the Pipeline")


def shutdown_pipeline(pipe: Any) -> None:
    """Stop a pipeline's source worker processes and its executor now."""
    pool = getattr(pipe, "_py_pool", None)
    if pool is not None:
        pool.close()
    pipe._shutdown()


@contextmanager
def frozen_heap() -> Iterator[None]:
    """Keep every existing object out of garbage collection while worker processes fork.

    A forked worker inherits the parent's uncollected garbage, for example an old loader that a
    finished ``Trainer`` still holds in a reference cycle. Were the worker's collector to
    finalize a DALI pipeline in it, the worker would die or hang mid-batch. Frozen objects are
    never collected in the child; the parent unfreezes them at once.
    """
    if gc.get_freeze_count():  # someone else manages the frozen generation
        yield
        return
    gc.freeze()
    try:
        yield
    finally:
        gc.unfreeze()
