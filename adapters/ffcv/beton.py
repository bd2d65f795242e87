"""Writing FFCV ``.beton`` files from map-style datasets, with a progress bar.

FFCV's ``DatasetWriter`` waits for a sample counter to reach the dataset length, so a sample
that fails in a writer process hangs it forever, and a sample with the wrong number of values is
silently truncated. ``write_beton`` runs the same writer processes but watches them: a failure is
raised in the caller with its sample index, the partial file is removed, and no process or
shared-memory segment is left behind.
"""

from __future__ import annotations

import ctypes
import multiprocessing
import os
import queue
import traceback
from collections.abc import Mapping, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import torch

from lightning_loaders.adapters.ffcv.loader import require_ffcv

__all__ = ["BetonWriteError", "infer_fields", "write_beton"]

_POLL_S = 0.1


class BetonWriteError(RuntimeError):
    """A sample could not be written; the message names it and the cause."""


def _plain(value: Any) -> Any:
    """Torch tensors as numpy arrays (0-d ones as Python scalars), as FFCV fields expect."""
    if isinstance(value, torch.Tensor):
        value = value.detach().cpu().numpy()
    if isinstance(value, np.ndarray) and value.ndim == 0:
        return value.item()
    return value


class _CheckedSamples:
    """The dataset as FFCV's writer reads it: tuples of one value per field, checked."""

    def __init__(self, dataset: Any, names: Sequence[str]) -> None:
        self.dataset = dataset
        self.names = tuple(names)

    def __len__(self) -> int:
        return len(self.dataset)

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        try:
            sample = self.dataset[int(index)]
        except Exception as exc:
            raise BetonWriteError(f"sample {index}: {type(exc).__name__}: {exc}") from exc
        if len(self.names) == 1 and not isinstance(sample, tuple | list):
            sample = (sample,)
        if not isinstance(sample, tuple | list) or len(sample) != len(self.names):
            got = (f"{len(sample)} values" if isinstance(sample, tuple | list)
                   else f"a {type(sample).__name__}")
            raise ValueError(f"sample {index} is {got}, but the fields are {list(self.names)} "
                             f"({len(self.names)} values)")
        return tuple(_plain(value) for value in sample)


def infer_fields(sample: Sequence[Any], names: Sequence[str]) -> dict[str, Any]:
    """FFCV fields for one sample's values: RGB images (``HxWx3`` uint8 arrays or PIL images,
    stored raw), ints, floats, and other arrays as ``NDArrayField`` of their dtype and shape."""
    require_ffcv()
    from ffcv.fields import FloatField, IntField, NDArrayField, RGBImageField

    if len(sample) != len(names):
        raise ValueError(f"{len(names)} field names {list(names)} for a sample of "
                         f"{len(sample)} values")
    fields: dict[str, Any] = {}
    for name, value in zip(names, (_plain(v) for v in sample), strict=True):
        if type(value).__module__.startswith("PIL."):
            value = np.asarray(value)
        if isinstance(value, bool | int | np.integer):
            fields[name] = IntField()
        elif isinstance(value, float | np.floating):
            fields[name] = FloatField()
        elif isinstance(value, np.ndarray):
            if value.dtype == np.uint8 and value.ndim == 3 and value.shape[2] == 3:
                fields[name] = RGBImageField(write_mode="raw")
            else:
                fields[name] = NDArrayField(value.dtype, value.shape)
        else:
            raise TypeError(f"cannot infer an FFCV field for {name!r} from a "
                            f"{type(value).__name__}; pass fields as a dict of ffcv Fields")
    return fields


def write_beton(
    path: str | Path,
    dataset: Any,
    fields: Mapping[str, Any] | Sequence[str],
    *,
    num_workers: int = -1,
    chunk_size: int = 100,
    page_size: int | None = None,
    progress: bool = True,
) -> Path:
    """Write ``dataset`` (``__len__`` and ``__getitem__`` returning one value per field) to
    ``path`` as a ``.beton`` file; returns the path.

    Args:
        fields: ``{name: ffcv Field}`` in sample order, or just the names, to infer the fields
            from the first sample (see ``infer_fields``).
        num_workers: writer processes (``-1``: one per CPU).
        chunk_size: samples per work item of a writer process.
        page_size: FFCV's page size (a power of two >= 2 MiB; default 8 MiB).
        progress: show a tqdm progress bar.
    """
    require_ffcv()
    from ffcv.memory_allocator import MemoryAllocator
    from ffcv.writer import MIN_PAGE_SIZE, DatasetWriter, worker_job_indexed_dataset
    from tqdm import tqdm

    path = Path(path)
    n = len(dataset)
    if n < 1:
        raise ValueError("the dataset is empty")
    if chunk_size < 1:
        raise ValueError(f"chunk_size must be >= 1, got {chunk_size}")
    if not path.parent.is_dir():
        raise FileNotFoundError(f"no directory {path.parent} to write {path.name} into")
    if not isinstance(fields, Mapping):
        names = list(fields)
        fields = infer_fields(_CheckedSamples(dataset, names)[0], names)
    samples = _CheckedSamples(dataset, list(fields))
    workers = num_workers if num_workers >= 1 else (os.cpu_count() or 1)
    writer = DatasetWriter(str(path), dict(fields), page_size=page_size or 4 * MIN_PAGE_SIZE,
                           num_workers=workers)
    writer.num_samples = n
    writer.prepare()
    ctx = multiprocessing.get_context()
    work: Any = ctx.Queue()
    for start in range(0, n, chunk_size):
        work.put([(i, i) for i in range(start, min(start + chunk_size, n))])
    for _ in range(workers):
        work.put(None)
    allocations: Any = ctx.Queue()
    errors: Any = ctx.Queue()
    done = ctx.Value(ctypes.c_uint64, 0)
    allocator = MemoryAllocator(str(path), writer.data_region_start, writer.page_size)
    args = (errors, work, writer.metadata_sm, writer.metadata_type, writer.fields, allocator,
            done, allocations, samples)
    procs = [ctx.Process(target=_write_worker, args=(worker_job_indexed_dataset, *args),
                         daemon=True) for _ in range(workers)]
    finished = False
    try:
        for proc in procs:
            proc.start()
        results: list[Any] = []
        with tqdm(total=n, desc=f"writing {path.name}", unit="sample",
                  disable=not progress) as bar:
            while len(results) < workers:
                try:
                    results.append(allocations.get(timeout=_POLL_S))
                except queue.Empty:
                    _raise_failure(path, procs, errors)
                if int(done.value) > bar.n:
                    bar.update(int(done.value) - bar.n)
        for proc in procs:
            proc.join()
        writer.finalize([allocation for result in results for allocation in result])
        finished = True
    finally:
        for proc in procs:
            if proc.is_alive():
                proc.terminate()
            proc.join()
        writer.metadata_sm.close()
        writer.metadata_sm.unlink()
        for channel in (work, allocations, errors):
            channel.cancel_join_thread()
            channel.close()
        if not finished:
            path.unlink(missing_ok=True)
    return path


def _write_worker(job: Any, errors: Any, *args: Any) -> None:
    """A writer process: FFCV's job, reporting a failure to the parent before exiting."""
    try:
        job(*args)
    except BaseException as exc:
        errors.put(f"{type(exc).__name__}: {exc}\n{traceback.format_exc()}")
        raise SystemExit(1) from exc


def _raise_failure(path: Path, procs: Sequence[Any], errors: Any) -> None:
    failed = [proc for proc in procs if proc.exitcode not in (None, 0)]
    if not failed:
        return
    try:
        detail = errors.get(timeout=1.0)
    except queue.Empty:
        detail = f"a writer process exited with code {failed[0].exitcode}"
    raise BetonWriteError(f"writing {path} failed: {detail}")
