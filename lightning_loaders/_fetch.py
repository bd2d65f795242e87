"""Worker side: turn one planned batch request into a collated batch.

The loader feeds torch's ``DataLoader`` machinery (processes, shared memory, pin-memory thread)
with ``BatchRequest`` objects instead of indices; ``BatchFetcher`` is the dataset those workers
index. It seeds the global RNGs per batch, exposes the per-sample context, takes the fastest
fetch path the dataset allows, and names the failing sample when user code raises.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any, NamedTuple

import numpy as np
import torch
from torch.utils.data import Dataset, TensorDataset, default_collate, get_worker_info

from lightning_loaders.context import SampleContext, _seed_global_rngs, _set_sample

__all__ = ["BatchFetcher", "BatchRequest", "SampleFetchError"]


class BatchRequest(NamedTuple):
    """One batch of the plan, as sent to a worker."""

    epoch: int
    batch: int
    rank: int
    sample_epochs: np.ndarray
    positions: np.ndarray
    indices: np.ndarray


class SampleFetchError(RuntimeError):
    """User code failed on a sample; the message names it and the cause keeps the traceback."""


class BatchFetcher(Dataset[Any]):
    """Fetches and collates whole planned batches (what the internal DataLoader's workers index)."""

    def __init__(self, dataset: Any, collate_fn: Callable[[list[Any]], Any] | None, seed: int):
        self.dataset = dataset
        self.collate_fn = collate_fn if collate_fn is not None else default_collate
        self.seed = seed
        self._gather_tensors = isinstance(dataset, TensorDataset) and collate_fn is None
        self._getitems = getattr(dataset, "__getitems__", None)

    def __getitem__(self, request: BatchRequest) -> Any:
        _seed_global_rngs(self.seed, request.epoch, request.batch, request.rank)
        if self._gather_tensors:
            index = torch.from_numpy(request.indices)
            return [tensor[index] for tensor in self.dataset.tensors]
        getitems = self._getitems
        if getitems is not None:
            samples = self._guarded(request, 0, lambda: getitems(request.indices.tolist()))
        else:
            samples = [self._fetch_one(request, k) for k in range(len(request.indices))]
        return self._guarded(request, None, lambda: self.collate_fn(samples))

    def _fetch_one(self, request: BatchRequest, k: int) -> Any:
        index = int(request.indices[k])
        _set_sample(SampleContext(self.seed, int(request.sample_epochs[k]),
                                  int(request.positions[k]), index, request.rank))
        try:
            return self._guarded(request, k, lambda: self.dataset[index])
        finally:
            _set_sample(None)

    def _guarded(self, request: BatchRequest, k: int | None, call: Callable[[], Any]) -> Any:
        try:
            return call()
        except Exception as exc:
            raise SampleFetchError(_describe_failure(request, k, exc)) from exc


def _describe_failure(request: BatchRequest, k: int | None, exc: BaseException) -> str:
    info = get_worker_info()
    where = f"worker {info.id}" if info is not None else "the main process"
    if k is None:
        what = f"collate_fn of batch {request.batch}"
    else:
        what = (f"sample index {int(request.indices[k])} (epoch position "
                f"{int(request.positions[k])}, batch {request.batch})")
    return (f"{type(exc).__name__} in {what} of epoch {request.epoch}, in {where} on rank "
            f"{request.rank}: {exc}")
