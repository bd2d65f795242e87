"""The batch of a training step in progress, which a checkpoint written inside that step must
leave out of the training loaders' states.

Lightning 2.6 restarts a training step that a checkpoint interrupted (one written in
``on_train_batch_start``, inside ``training_step`` or its optimizer hooks: SLURM's auto-requeue
saves from a signal handler wherever the main thread is,
``trainer/connectors/signal_connector.py``): the epoch loop's batch progress counts the step's
batch ``ready`` but not ``processed``, a restart resets ``ready`` to ``completed``
(``loops/progress.py`` ``reset_on_restart``, from ``loops/training_epoch_loop.py`` ``reset``)
and fetches a batch for the step again. A loader's state that counts the step's batch as
delivered then hands the restarted step the next one: the step's own batch is never trained
on. Its state is taken as for a prefetched batch instead (``state_dict(unused=1)``).
"""

from __future__ import annotations

from typing import Any

import lightning as L
from lightning.pytorch.loops.fetchers import _DataLoaderIterDataFetcher
from lightning.pytorch.trainer.states import TrainerFn

from lightning_loaders.loaders.resumable import ResumableLoader

__all__ = ["state_before_step", "step_loaders"]


def step_loaders(trainer: L.Trainer | None) -> list[Any]:
    """The training loaders (``CombinedLoader`` members) that handed a batch to the training
    step in progress; none outside a step, and none where the step fetches its own batches
    (``training_step(dataloader_iter)``).

    Every member hands one to each step, but under ``"max_size"`` one that has ended: it is
    asked for every batch (``utilities/combined_loader.py`` ``_MaxSize``), so the times it
    found its epoch over (``ends`` of this package's iterators) say when it ended, counting
    the batch a prefetching fetcher asked for after the step's (an unsized loader's,
    ``loops/fetchers.py`` ``_PrefetchDataFetcher.__next__``)."""
    if trainer is None or trainer.state.fn != TrainerFn.FITTING:
        return []
    fit_loop = trainer.fit_loop
    progress: Any = fit_loop.epoch_loop.batch_progress.current  # a _BatchProgress tracker
    combined, fetcher = fit_loop._combined_loader, fit_loop._data_fetcher
    if (progress.ready <= progress.processed or combined is None or combined._iterator is None
            or fetcher is None or isinstance(fetcher, _DataLoaderIterDataFetcher)):
        return []
    if combined._mode != "max_size":
        return list(combined.flattened)
    after = getattr(fetcher, "prefetch_batches", 0) if fetcher.length is None else 0
    return [loader for loader, iterator in zip(combined.flattened, combined._iterator.iterators,
                                               strict=True)
            if getattr(iterator, "ends", 0) <= after]


def state_before_step(loader: Any) -> dict[str, Any]:
    """The state of ``loader``, one of ``step_loaders``, without the batch it handed to the
    step in progress, so that the restarted step gets it again; another library's loader
    cannot leave it out, and its state counts it."""
    if isinstance(loader, ResumableLoader):
        return loader.state_dict(unused=1)
    return loader.state_dict()
