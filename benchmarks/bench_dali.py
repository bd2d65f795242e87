"""DALI adapter overhead: ``DALILoader`` against the raw DALI iterator on the same pipeline.

Both run the same DALI pipeline (decode, resize, crop-mirror-normalize) over the same generated
JPEG files, with the same batch size and threads, on the CPU, in both adapter modes:

* reader: ``fn.readers.file`` (sharded, padded, shuffled); raw: ``DALIGenericIterator`` with
  ``reader_name`` and ``auto_reset``;
* external source: a per-sample parallel ``fn.external_source``; raw: DALI's own callback
  reading sample ``idx_in_epoch`` (no plan), ours: the global plan's shuffled order.

Each repetition runs one epoch per loader, interleaved. Reported: the median wall time between
batches (steady state), the median CPU time of an epoch (all threads), and their ratios.

    python -m benchmarks.bench_dali [--images 1024] [--side 64] [--repeats 15] [--full]
"""

from __future__ import annotations

import functools
import sys
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from benchmarks.common import (
    Plot,
    Report,
    Settings,
    arrival_times,
    epoch_case,
    interleaved,
    median,
    paired_ratio,
    standalone,
)
from benchmarks.images import write_jpegs

__all__ = ["main", "run"]

BATCH_SIZE = 64
NUM_THREADS = 2
PY_WORKERS = 2
RAW = "raw DALI iterator"
OURS = "DALILoader"
LOADERS = (RAW, OURS)


def _graph(files: list[str], side: int, shard_id: int, num_shards: int, device: str,
           source: Any = None) -> Any:
    """The pipeline both loaders run: a reader, or a per-sample source when given one."""
    from nvidia.dali import fn
    from nvidia.dali.types import DALIDataType

    outputs: Any
    if source is None:
        outputs = fn.readers.file(files=files, labels=list(range(len(files))),
                                  shard_id=shard_id, num_shards=num_shards, random_shuffle=True,
                                  pad_last_batch=True, name="Reader")
    else:
        outputs = fn.external_source(source=source, num_outputs=2, batch=False, parallel=True,
                                     dtype=[DALIDataType.UINT8, DALIDataType.INT64])
    jpegs, labels = outputs
    images: Any = fn.decoders.image(jpegs, device="mixed" if device == "gpu" else "cpu")
    images = fn.resize(images, resize_shorter=side * 3 // 4)
    images = fn.crop_mirror_normalize(
        images, crop=(side // 2, side // 2), crop_pos_x=fn.random.uniform(range=(0.0, 1.0)),
        mirror=fn.random.coin_flip(), mean=[128.0] * 3, std=[64.0] * 3,
        dtype=DALIDataType.FLOAT)
    return images, labels


class _RawSource:
    """DALI's own way: sample ``idx_in_epoch`` of the file list, one stream, no plan."""

    def __init__(self, files: list[str]) -> None:
        from lightning_loaders.adapters.dali import FileSamples

        self.samples = FileSamples(files)

    def __call__(self, info: Any) -> Any:
        return self.samples[info.idx_in_epoch % len(self.samples)]


def _make_loaders(files: list[str], side: int, mode: str) -> dict[str, Callable[[], Any]]:
    """Per loader, a function running one epoch and returning the batch arrival times."""
    from nvidia.dali import pipeline_def
    from nvidia.dali.plugin.pytorch import DALIGenericIterator, LastBatchPolicy

    from lightning_loaders.adapters.dali import DALILoader, FileSamples

    definition = pipeline_def(_graph)
    pipeline = functools.partial(definition, files=files, side=side)
    common = {"batch_size": BATCH_SIZE, "num_threads": NUM_THREADS, "device_id": None,
              "seed": 0, "py_num_workers": PY_WORKERS, "enable_checkpointing": True}
    context = {"shard_id": 0, "num_shards": 1, "device": "cpu"}
    if mode == "reader":
        ours = DALILoader(pipeline, ["x", "y"], batch_size=BATCH_SIZE, reader_name="Reader",
                          num_threads=NUM_THREADS, seed=0, device="cpu")
        raw = DALIGenericIterator(pipeline(**common, **context), ["x", "y"],
                                  reader_name="Reader", auto_reset=True,
                                  last_batch_policy=LastBatchPolicy.PARTIAL)
        return {RAW: lambda: arrival_times(raw), OURS: lambda: arrival_times(ours)}
    ours = DALILoader(pipeline, ["x", "y"], batch_size=BATCH_SIZE, dataset=FileSamples(files),
                      shuffle=True, num_threads=NUM_THREADS, py_num_workers=PY_WORKERS, seed=0,
                      device="cpu")
    raw = DALIGenericIterator(pipeline(**common, **context, source=_RawSource(files)),
                              ["x", "y"])
    batches = len(ours)
    return {RAW: lambda: arrival_times(_take(raw, batches)), OURS: lambda: arrival_times(ours)}


def _take(iterator: Any, count: int) -> Iterator[Any]:
    for _ in range(count):
        yield next(iterator)


class _InsideDali:
    """Accumulates the time spent inside DALI's iterator (``__next__`` and ``reset``), so
    that what a loader does around it (the adapter's own work) can be told apart."""

    def __init__(self) -> None:
        self.seconds = 0.0

    @contextmanager
    def watching(self) -> Iterator[None]:
        from nvidia.dali.plugin.pytorch import DALIGenericIterator

        originals = {name: getattr(DALIGenericIterator, name) for name in ("__next__", "reset")}

        def timed(method: Callable[..., Any]) -> Callable[..., Any]:
            def call(*args: Any, **kwargs: Any) -> Any:
                start = time.perf_counter()
                try:
                    return method(*args, **kwargs)
                finally:
                    self.seconds += time.perf_counter() - start
            return call

        for name, method in originals.items():
            setattr(DALIGenericIterator, name, timed(method))
        try:
            yield
        finally:
            for name, method in originals.items():
                setattr(DALIGenericIterator, name, method)


def _own_work(epoch: Callable[[], list[float]], repeats: int) -> float:
    """Median seconds per batch a loader spends outside DALI's iterator (epoch start included,
    between the first and the last batch of an epoch excluded nothing)."""
    per_batch = []
    for _ in range(repeats):
        inside = _InsideDali()
        with inside.watching():
            start = time.perf_counter()
            times = epoch()
            total = times[-1] - start
        per_batch.append((total - inside.seconds) / len(times))
    return median(per_batch)


def measure(files: list[str], side: int, mode: str, repeats: int, settings: Settings
            ) -> dict[str, Any]:
    """One row: medians per loader and the ratios raw / ours."""
    loaders = _make_loaders(files, side, mode)
    for epoch in loaders.values():
        epoch()  # warm-up: allocations, the first prefetch
    gaps: dict[str, list[float]] = {name: [] for name in loaders}
    cpu: dict[str, list[float]] = {name: [] for name in loaders}
    per_epoch = interleaved({name: epoch_case(epoch, gaps[name], cpu[name], children=True)
                             for name, epoch in loaders.items()}, repeats, f"dali {mode}",
                            settings)
    own = {name: _own_work(epoch, repeats) for name, epoch in loaders.items()}
    row: dict[str, Any] = {"mode": mode}
    for name in LOADERS:
        row[f"{name} ms/batch"] = 1e3 * median(gaps[name])
    row["raw / ours (batch)"] = paired_ratio(per_epoch[OURS], per_epoch[RAW], False)
    row["adapter work us/batch"] = 1e6 * (own[OURS] - own[RAW])
    row["adapter work % of a batch"] = 100 * (own[OURS] - own[RAW]) / median(gaps[RAW])
    mean_cpu = {name: sum(values) / len(values) for name, values in cpu.items()}
    for name in LOADERS:
        row[f"{name} CPU ms/epoch"] = 1e3 * mean_cpu[name]
    row["CPU overhead %"] = 100 * (mean_cpu[OURS] / mean_cpu[RAW] - 1)
    return row


def run(settings: Settings, images: int | None = None, side: int | None = None) -> Report:
    """The benchmark suite entry point (``benchmarks.run_all``)."""
    images = images or settings.pick(1024, 4096)
    side = side or settings.pick(64, 128)
    with tempfile.TemporaryDirectory(prefix="ll-bench-dali-") as directory:
        files = write_jpegs(Path(directory), images, side)
        rows = [measure(files, side, mode, settings.repeats, settings)
                for mode in ("reader", "external source")]
    columns = ("mode", *(f"{n} ms/batch" for n in LOADERS), "raw / ours (batch)",
               "adapter work us/batch", "adapter work % of a batch",
               *(f"{n} CPU ms/epoch" for n in LOADERS), "CPU overhead %")
    return Report(
        name="dali",
        title=f"DALILoader vs raw DALI iterator ({images:,} JPEGs {side}x{side}, batch "
              f"{BATCH_SIZE}, CPU)",
        columns=columns,
        rows=rows,
        notes=(f"{settings.repeats} interleaved epochs per loader after one warm-up epoch each. "
               "ms/batch: median wall time between consecutive batches within an epoch. CPU "
               "ms/epoch: mean CPU time of the process (all threads) and of the external "
               "source's worker processes per epoch (steadier than wall time on a shared "
               "machine).",
               f"{NUM_THREADS} DALI threads, {PY_WORKERS} external-source workers. raw / ours: "
               "median of the per-epoch ratios (the two epochs of a repetition ran back to "
               "back). raw / ours above 0.97, or a CPU overhead under 3%, is within 3% of the raw "
               "iterator (the goal). The adapter's own work per batch is the cursor, the "
               "plan's request (external source: the trim of a short last batch) and the "
               "dict or tuple it hands over.",
               "adapter work: the time per batch a loader spends outside DALI's iterator "
               "(its __next__ and reset timed around every call), ours minus raw's, median of "
               "as many extra epochs; steadier than the difference of two noisy wall times.",
               "External source: the raw callback reads files in order; ours maps DALI's "
               "iteration to the global plan (shuffled, sharded) in the source workers."),
        plot=Plot("mode", tuple(f"{n} ms/batch" for n in LOADERS), "ms per batch (median)"),
    )


def main(argv: list[str] | None = None) -> int:
    return standalone(run, __doc__.splitlines()[0],
                      {"images": "JPEG files (default 1024, 4096 with --full)",
                       "side": "image side (default 64, 128 with --full)"}, argv)


if __name__ == "__main__":
    sys.exit(main())
