"""Deterministic, distributed, exactly resumable data loading for PyTorch Lightning."""

from lightning_loaders.context import (
    SampleContext,
    WorkerInfo,
    sample_context,
    sample_rng,
    worker_info,
)
from lightning_loaders.loader import ResumableLoader
from lightning_loaders.order import SampleOrder, SequentialOrder, ShuffledOrder
from lightning_loaders.permutation import KeyedPermutation
from lightning_loaders.plan import EpochPlan, LastBatch
from lightning_loaders.schedule import MapSchedule

__version__ = "0.1.0"

__all__ = [
    "EpochPlan",
    "KeyedPermutation",
    "LastBatch",
    "MapSchedule",
    "ResumableLoader",
    "SampleContext",
    "SampleOrder",
    "SequentialOrder",
    "ShuffledOrder",
    "WorkerInfo",
    "sample_context",
    "sample_rng",
    "worker_info",
]
