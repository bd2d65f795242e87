"""``make_resumable``: the loader a user already wrote, made distributed and resumable.

A ``torch.utils.data.DataLoader`` (any subclass, any sampler or batch sampler) becomes a
``ResumableLoader`` over the same dataset with the same batching, collation and worker settings,
and the distributed, resumable equivalent of its sampler. Unlike Lightning's sampler
replacement, nothing is re-instantiated from captured ``__init__`` arguments, so subclasses with
extra required arguments convert too; behaviour a subclass adds in ``__iter__`` is not kept.

A ``webdataset.WebLoader`` is no ``DataLoader`` but a pipeline whose first stage is one: it
converts as that ``DataLoader`` when it adds no stages after it, and is refused, naming them,
when it does (``.unbatched().shuffle(n).batched(b)``, ``.with_epoch(n)``): dropping them would
change what a batch holds.
"""

from __future__ import annotations

import sys
from typing import Any

from torch.utils.data import DataLoader, IterableDataset, default_collate

from lightning_loaders.loaders.resumable import ResumableLoader
from lightning_loaders.orders.from_torch import sampler_seed, unbatched_sampler
from lightning_loaders.schedule.map_schedule import resolve_seed

__all__ = ["is_webloader", "loader_arguments", "make_resumable"]

# Overrides that replace how the source loader batches, and the source arguments they replace.
_REPLACES = {
    "sampler": ("sampler",),
    "shuffle": ("sampler",),
    "batch_sampler": ("sampler", "batch_size", "drop_last"),
    "last_batch": ("drop_last",),
    "generator": ("seed",),
}
# DataLoader settings that only apply with worker processes (refused without them).
_WORKER_SETTINGS = ("timeout", "multiprocessing_context", "prefetch_factor", "persistent_workers")


def make_resumable(loader: DataLoader[Any] | ResumableLoader | IterableDataset[Any],
                   **overrides: Any) -> ResumableLoader:
    """A ``ResumableLoader`` equivalent to ``loader`` (a ``DataLoader``, or a
    ``webdataset.WebLoader`` with no stages after its ``DataLoader``); ``overrides`` are
    ``ResumableLoader`` keyword arguments that replace what the loader says (``seed``,
    ``last_batch``, ``num_workers``, ``evaluation``, ...).

    The sampler becomes an exact equivalent computed from ``(seed, epoch, position)`` for
    torch's samplers, or is drawn once per epoch for any other sampler. The seed is, in order:
    ``overrides["seed"]``, the seed that orders the sampler in torch (its ``generator``'s, a
    ``DistributedSampler``'s ``seed``), the loader's ``generator``'s, then
    ``$PL_GLOBAL_SEED`` (``seed_everything``), else 0, so it is the same on every rank.
    """
    if isinstance(loader, ResumableLoader):
        if overrides:
            raise TypeError(f"the loader is already a ResumableLoader; build it with "
                            f"{sorted(overrides)} instead of overriding them")
        return loader
    if is_webloader(loader):
        loader = _webloader_dataloader(loader)
    if not isinstance(loader, DataLoader):
        raise TypeError(f"make_resumable converts a torch.utils.data.DataLoader or a "
                        f"webdataset.WebLoader, got {type(loader).__name__}")
    arguments = loader_arguments(loader, overrides.get("seed"))
    for name in overrides:
        for replaced in _REPLACES.get(name, ()):
            arguments.pop(replaced, None)
    if overrides.get("num_workers") == 0:  # the source's worker settings no longer apply
        for name in _WORKER_SETTINGS:
            arguments.pop(name, None)
    arguments.update(overrides)
    return ResumableLoader(**arguments)


def loader_arguments(loader: DataLoader[Any], seed: int | None = None) -> dict[str, Any]:
    """``ResumableLoader`` keyword arguments that reproduce ``loader``."""
    dataset = loader.dataset
    iterable = isinstance(dataset, IterableDataset)
    if not iterable and not hasattr(dataset, "__len__"):
        raise TypeError(f"cannot convert a DataLoader over {type(dataset).__name__}: it has "
                        "no __len__ and is no IterableDataset")
    sampler = loader.sampler if loader.batch_sampler is None else loader.batch_sampler
    generator = loader.generator or _sampler_generator(sampler)
    if seed is None:  # the sampler's own seed orders it in torch, whatever the loader's is
        seed = sampler_seed(sampler)
    workers = loader.num_workers > 0  # DataLoader ignores the worker settings without workers
    arguments: dict[str, Any] = {
        "dataset": dataset,
        "num_workers": loader.num_workers,
        "collate_fn": None if loader.collate_fn is default_collate else loader.collate_fn,
        "pin_memory": loader.pin_memory,
        "worker_init_fn": loader.worker_init_fn,
        "generator": generator,
        "pin_memory_device": loader.pin_memory_device,
        "in_order": getattr(loader, "in_order", True),
        "seed": resolve_seed(seed, generator),
        **({name: getattr(loader, name) for name in _WORKER_SETTINGS} if workers else {}),
    }
    if iterable:  # the plan orders it (a DataLoader gives an iterable dataset no sampler)
        arguments.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
    elif loader.batch_size is not None:
        arguments.update(sampler=loader.sampler, batch_size=loader.batch_size,
                         drop_last=loader.drop_last)
    elif loader.batch_sampler is not None:
        sampler, batch_size, drop_last = unbatched_sampler(loader.batch_sampler,
                                                           arguments["seed"])
        arguments.update(sampler=sampler, batch_size=batch_size, drop_last=drop_last)
    else:  # unbatched: each sample as the sampler gives it, converted
        arguments.update(sampler=loader.sampler, batch_size=None)
    return arguments


def is_webloader(loader: Any) -> bool:
    """Whether ``loader`` is a WebDataset pipeline over a ``DataLoader`` (a
    ``webdataset.WebLoader``, or a ``DataPipeline`` whose first stage is a ``DataLoader``)."""
    stages = getattr(loader, "pipeline", None)
    from_webdataset = any(cls.__module__.startswith("webdataset")  # with_length(): a subclass
                          for cls in type(loader).__mro__)
    return (from_webdataset and isinstance(stages, list) and bool(stages)
            and isinstance(stages[0], DataLoader))


def _webloader_dataloader(loader: Any) -> DataLoader[Any]:
    """The ``DataLoader`` a WebLoader wraps; ``TypeError`` naming the stages it adds after it,
    which a ``ResumableLoader`` over that ``DataLoader`` would silently drop."""
    dataloader, *stages = loader.pipeline
    added = [_stage_name(stage) for stage in stages]
    if loader.nsamples > 0:  # with_epoch(n) or repeat(nbatches=n)
        added.append(f"an epoch of {loader.nsamples} (with_epoch/repeat)")
    elif loader.repetitions != 1:
        times = "endlessly" if loader.repetitions == sys.maxsize else f"{loader.repetitions} times"
        added.append(f"repeating {times} (repeat)")
    if added:
        raise TypeError(
            f"make_resumable cannot convert this {type(loader).__name__}: it adds "
            f"{', '.join(added)} after its DataLoader, which a ResumableLoader over that "
            "DataLoader would drop. Build one from the WebLoader's dataset (a "
            f"{type(dataloader.dataset).__name__}) instead: ResumableLoader(dataset, "
            "batch_size=..., shuffle_buffer=...) batches and shuffles its whole stream "
            "resumably; or give the WebLoader no stages after its DataLoader")
    return dataloader


def _stage_name(stage: Any) -> str:
    """A WebDataset pipeline stage as its fluid method is called (``shuffle(8)``)."""
    function = getattr(stage, "f", None)
    name = getattr(function, "__name__", type(stage).__name__).lstrip("_")
    values = [repr(value) if isinstance(value, int | float | str) else "..."
              for value in getattr(stage, "args", ())]
    return f"{name}({', '.join(values)})"


def _sampler_generator(sampler: Any) -> Any:
    """The torch generator of the sampler (or of the sampler a batch sampler wraps), if any."""
    for candidate in (sampler, getattr(sampler, "sampler", None)):
        generator = getattr(candidate, "generator", None)
        if generator is not None:
            return generator
    return None
