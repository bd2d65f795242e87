"""Deterministic, distributed, exactly resumable data loading for PyTorch Lightning.

The top level holds what users construct and catch: the loaders, ``make_resumable``, the data
module and monitor, the per-sample context and RNG, the sources, and the errors. Internals
(orders, plans, schedules, engines) stay importable from their subpackages; see the README's
migration note for the names that moved. Names that need Lightning itself (the data module, the
monitor, the prediction-index hook) are imported on first use, so ``import lightning_loaders``
stays light.
"""

from importlib import import_module
from typing import TYPE_CHECKING, Any

from lightning_loaders.context import (
    SampleContext,
    WorkerInfo,
    sample_context,
    sample_rng,
    worker_info,
)
from lightning_loaders.engines.autotune import AutotuneConfig
from lightning_loaders.engines.faults import SkippedSample
from lightning_loaders.errors import (
    LoaderError,
    SampleFetchError,
    StateMismatchError,
    WorkerCrashedError,
    WorkerInitError,
    WorkerTimeoutError,
)
from lightning_loaders.loaders.convert import make_resumable
from lightning_loaders.loaders.iterable import ResumableIterableLoader
from lightning_loaders.loaders.resumable import ResumableLoader
from lightning_loaders.orders.base import SampleOrder
from lightning_loaders.orders.dynamic_weighted import DynamicWeightedSampler
from lightning_loaders.schedule.map_plan import LastBatch
from lightning_loaders.sources.hf import HFSource
from lightning_loaders.sources.mix import Mix
from lightning_loaders.sources.packed import pack
from lightning_loaders.sources.parquet import ArrowSource, ParquetSource
from lightning_loaders.sources.shards import (
    GeneratorSource,
    LineFiles,
    RecordFiles,
    SequenceSource,
    ShardedSource,
    count_records,
    write_records,
)
from lightning_loaders.sources.tables import TableDataset
from lightning_loaders.sources.webdataset import WebDatasetSource

if TYPE_CHECKING:
    from lightning_loaders.lightning.batch_indices import batch_indices, expose_batch_indices
    from lightning_loaders.lightning.datamodule import ResumableDataModule
    from lightning_loaders.lightning.exact_resume import ExactResume
    from lightning_loaders.lightning.monitor import DataStallMonitor, DataStallWarning

__version__ = "0.2.0"

_LAZY = {
    "DataStallMonitor": "lightning_loaders.lightning.monitor",
    "DataStallWarning": "lightning_loaders.lightning.monitor",
    "ExactResume": "lightning_loaders.lightning.exact_resume",
    "ResumableDataModule": "lightning_loaders.lightning.datamodule",
    "batch_indices": "lightning_loaders.lightning.batch_indices",
    "expose_batch_indices": "lightning_loaders.lightning.batch_indices",
}


if not TYPE_CHECKING:  # for mypy, the names are the imports above: a misspelled one is an error

    def __getattr__(name: str) -> Any:
        if name in _LAZY:
            return getattr(import_module(_LAZY[name]), name)
        raise AttributeError(f"module 'lightning_loaders' has no attribute {name!r}")


__all__ = [
    "ArrowSource",
    "AutotuneConfig",
    "DataStallMonitor",
    "DataStallWarning",
    "DynamicWeightedSampler",
    "ExactResume",
    "GeneratorSource",
    "HFSource",
    "LastBatch",
    "LineFiles",
    "LoaderError",
    "Mix",
    "ParquetSource",
    "RecordFiles",
    "ResumableDataModule",
    "ResumableIterableLoader",
    "ResumableLoader",
    "SampleContext",
    "SampleFetchError",
    "SampleOrder",
    "SequenceSource",
    "ShardedSource",
    "SkippedSample",
    "StateMismatchError",
    "TableDataset",
    "WebDatasetSource",
    "WorkerCrashedError",
    "WorkerInfo",
    "WorkerInitError",
    "WorkerTimeoutError",
    "batch_indices",
    "count_records",
    "expose_batch_indices",
    "make_resumable",
    "pack",
    "sample_context",
    "sample_rng",
    "worker_info",
    "write_records",
]
