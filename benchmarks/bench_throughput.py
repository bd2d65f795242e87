"""Throughput against the machine's limit and every peer, with peak memory, in one run.

Three workloads, each read as whole epochs (batch order not shuffled, so that every loader's
order is defined and checked):

- ``numpy``: about 300 us of numpy per sample (workload 2's ``TransformDataset``), batch 32;
- ``jpeg``: Pillow decodes a 224 x 224 JPEG file and resizes it to 128 x 128, batch 32;
- ``dicts``: the 1M-dict dataset of workload 4 without ``pack()``, batch 256, where memory is
  the point (the records are copied into every forked worker as it reads them).

The limit of a workload is one core's serial time for the epoch (the main process calls
``__getitem__`` and ``default_collate`` itself, no loader) divided by the cores this process
may use: no loader can beat it. Every contender is a named factory in ``CONTENDERS``; ours
are listed in ``OURS``, and a configuration that ``ResumableLoader`` does not accept yet (such
as ``backend="thread"`` before that argument exists) is left out and named in the notes.

Memory is the peak over the epoch of the proportional set size (PSS) summed over the main
process and all its child processes: a page shared by ``k`` processes counts ``1/k`` in each,
so pages that forked workers share with the main process are not counted twice (a sum of RSS
would). A background thread samples it: for numpy and jpeg in an epoch of its own before the
timed ones (in the benchmark's process); for dicts, every epoch runs in a new process (forked
from a fork server that has imported torch and the loaders, whose PSS is counted too) so that
no other process holds the records, and is timed while the sampler runs.

Besides the table, ``run`` writes ``throughput.png``: a panel per workload, every row's
fraction of the limit.
"""

from __future__ import annotations

import importlib
import inspect
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from torch.utils.data import Dataset, default_collate

from benchmarks.bench_memory import RecordDataset, make_records
from benchmarks.bench_transform import TransformDataset
from benchmarks.common import (
    Report,
    Settings,
    close_loader,
    interleaved,
    median,
    standalone,
)
from benchmarks.images import write_jpegs

__all__ = ["CONTENDERS", "OURS", "Contender", "JpegResize", "PeakMemory", "Workload",
           "ours_contenders", "run"]

WORKERS = 2
SERIAL = "serial, 1 core"
LIMIT = "limit: serial / cores"
DATALOADER_FAMILY = "DataLoader"
SPDL_FAMILY = "SPDL"

# Our loader's configurations: (row name, ResumableLoader keyword arguments other than the
# dataset, batch_size and shuffle). backend="process" is what a ResumableLoader without a
# backend argument does, so it is dropped where the argument does not exist yet; a row with any
# other argument ResumableLoader does not accept is left out (and named in the notes).
OURS: list[tuple[str, dict[str, Any]]] = [
    ("ours, 0 workers", {"num_workers": 0}),
    ("ours, process, 2 workers", {"backend": "process", "num_workers": WORKERS}),
    ("ours, thread, 2 workers", {"backend": "thread", "num_workers": WORKERS}),
    ("ours, auto", {"backend": "auto", "num_workers": "auto"}),
]


# -- workloads -------------------------------------------------------------------------------


class JpegResize(Dataset[torch.Tensor]):
    """Decodes JPEG file ``i`` with Pillow and resizes it to ``side`` x ``side`` (bilinear):
    a CHW uint8 tensor."""

    def __init__(self, paths: Sequence[str], side: int = 128) -> None:
        self.paths = list(paths)
        self.side = side

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        from PIL import Image

        with Image.open(self.paths[index]) as image:
            small = image.convert("RGB").resize((self.side, self.side), Image.Resampling.BILINEAR)
        return torch.from_numpy(np.array(small)).permute(2, 0, 1)


@dataclass(frozen=True, kw_only=True)
class Workload:
    """A dataset read as whole epochs in batches of ``batch_size``.

    Attributes:
        name: the row label.
        dataset: a map-style dataset.
        batch_size: samples per batch (the last batch may be shorter).
        fingerprint: one number per sample of a collated batch, to check that every contender
            delivers the same samples.
    """

    name: str
    dataset: Dataset[Any]
    batch_size: int
    fingerprint: Callable[[Any], np.ndarray]


def _tensor_fingerprint(batch: torch.Tensor) -> np.ndarray:
    return batch.flatten(1).double().sum(1).numpy()


def _record_fingerprint(batch: dict[str, torch.Tensor]) -> np.ndarray:
    return (batch["label"].double() * 1000 + batch["weight"].double() * 10
            + batch["path_length"].double()).numpy()


def _batch_len(batch: Any) -> int:
    if isinstance(batch, dict):
        batch = next(iter(batch.values()))
    return len(batch)


# -- contenders ------------------------------------------------------------------------------


@dataclass(frozen=True, kw_only=True)
class Contender:
    """A way to read a workload.

    Attributes:
        name: the row label.
        family: ``"DataLoader"`` and ``"SPDL"`` rows are the peers whose best each row is
            compared with; others are ``"serial"``, ``"StatefulDataLoader"`` and ``"ours"``.
        build: a new loader over the workload (an iterable whose ``iter()`` is one epoch).
        ordered: delivers the samples in the order of the serial epoch (else only the same
            samples are checked, in any order).
    """

    name: str
    family: str
    build: Callable[[Workload], Iterable[Any]]
    ordered: bool = True


class _Serial:
    """One core, no loader: the main process fetches and collates every batch."""

    def __init__(self, workload: Workload) -> None:
        self.dataset = workload.dataset
        self.batch_size = workload.batch_size

    def __iter__(self) -> Iterator[Any]:
        n = len(self.dataset)  # type: ignore[arg-type]
        for start in range(0, n, self.batch_size):
            yield default_collate([self.dataset[i]
                                   for i in range(start, min(start + self.batch_size, n))])


class _SpdlThreads:
    """An SPDL pipeline on a thread pool of ``concurrency`` threads: per sample
    (``pipe(__getitem__).aggregate(batch).pipe(collate)``) or per batch (one task fetches and
    collates a whole batch). Results come in completion order (SPDL's default, its fastest)."""

    def __init__(self, workload: Workload, concurrency: int, per_batch: bool) -> None:
        self.dataset = workload.dataset
        self.batch_size = workload.batch_size
        self.concurrency = concurrency
        self.per_batch = per_batch

    def _fetch_batch(self, indices: range) -> Any:
        return default_collate([self.dataset[i] for i in indices])

    def __iter__(self) -> Iterator[Any]:
        from spdl.pipeline import PipelineBuilder

        n = len(self.dataset)  # type: ignore[arg-type]
        builder: Any = PipelineBuilder()
        if self.per_batch:
            builder.add_source([range(s, min(s + self.batch_size, n))
                                for s in range(0, n, self.batch_size)])
            builder.pipe(self._fetch_batch, concurrency=self.concurrency)
        else:
            builder.add_source(range(n))
            builder.pipe(self.dataset.__getitem__, concurrency=self.concurrency)
            builder.aggregate(self.batch_size)
            builder.pipe(default_collate)
        pipeline = builder.add_sink(2 * self.concurrency).build(num_threads=self.concurrency)
        with pipeline.auto_stop():
            yield from pipeline.get_iterator()


class _SpdlProcesses:
    """SPDL's process loader, ``spdl.dataloader.get_pytorch_dataloader`` (the dataset pickled
    into shared memory once, unpickled by every worker process)."""

    def __init__(self, workload: Workload) -> None:
        from spdl.dataloader import get_pytorch_dataloader

        self.loader: Any = get_pytorch_dataloader(workload.dataset,
                                                  batch_size=workload.batch_size,
                                                  num_workers=WORKERS)

    def __iter__(self) -> Iterator[Any]:
        try:
            yield from self.loader
        finally:
            # SPDL 0.8 never unlinks the shared memory holding the pickled dataset
            self.loader._shmem.unlink()


def _dataloader(workers: int) -> Callable[[Workload], Iterable[Any]]:
    def build(workload: Workload) -> Iterable[Any]:
        from torch.utils.data import DataLoader

        return DataLoader(workload.dataset, batch_size=workload.batch_size, shuffle=False,
                          num_workers=workers)
    return build


def _stateful(workload: Workload) -> Iterable[Any]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(workload.dataset, batch_size=workload.batch_size, shuffle=False,
                              num_workers=WORKERS)


def _ours(kwargs: dict[str, Any]) -> Callable[[Workload], Iterable[Any]]:
    def build(workload: Workload) -> Iterable[Any]:
        from lightning_loaders import ResumableLoader

        return ResumableLoader(workload.dataset, batch_size=workload.batch_size, shuffle=False,
                               **kwargs)
    return build


def ours_contenders() -> tuple[list[Contender], list[str]]:
    """``OURS`` as contenders, and the names of the rows ``ResumableLoader`` cannot build yet
    (an argument its signature lacks)."""
    from lightning_loaders import ResumableLoader

    accepted = set(inspect.signature(ResumableLoader.__init__).parameters)
    built, skipped = [], []
    for name, kwargs in OURS:
        kwargs = dict(kwargs)
        if "backend" not in accepted and kwargs.get("backend") == "process":
            del kwargs["backend"]
        if set(kwargs) <= accepted:
            built.append(Contender(name=name, family="ours", build=_ours(kwargs)))
        else:
            skipped.append(name)
    return built, skipped


# name -> contender, for the peers; per workload, ``_contenders`` adds ours
CONTENDERS: dict[str, Contender] = {c.name: c for c in (
    Contender(name=SERIAL, family="serial", build=_Serial),
    Contender(name="DataLoader, 0 workers", family=DATALOADER_FAMILY, build=_dataloader(0)),
    Contender(name="DataLoader, 2 workers", family=DATALOADER_FAMILY,
              build=_dataloader(WORKERS)),
    Contender(name="StatefulDataLoader, 2 workers", family="StatefulDataLoader",
              build=_stateful),
    Contender(name="SPDL, 2 threads, per sample", family=SPDL_FAMILY, ordered=False,
              build=lambda w: _SpdlThreads(w, 2, per_batch=False)),
    Contender(name="SPDL, 4 threads, per sample", family=SPDL_FAMILY, ordered=False,
              build=lambda w: _SpdlThreads(w, 4, per_batch=False)),
    Contender(name="SPDL, 2 threads, per batch", family=SPDL_FAMILY, ordered=False,
              build=lambda w: _SpdlThreads(w, 2, per_batch=True)),
    Contender(name="SPDL, 4 threads, per batch", family=SPDL_FAMILY, ordered=False,
              build=lambda w: _SpdlThreads(w, 4, per_batch=True)),
    Contender(name="SPDL, 2 processes", family=SPDL_FAMILY, ordered=False,
              build=_SpdlProcesses),
)}
# variants whose code the others share: left out at quick sizes, to keep them quick
QUICK_SKIPS = ("SPDL, 4 threads, per sample", "SPDL, 4 threads, per batch")
# the dicts workload reads 1M samples: SPDL's per-sample pipelines (an event-loop task per
# sample) and its process loader (which pickles the dataset into every worker) are left out
DICT_PEERS = (SERIAL, "DataLoader, 0 workers", "DataLoader, 2 workers",
              "StatefulDataLoader, 2 workers", "SPDL, 2 threads, per batch",
              "SPDL, 4 threads, per batch")


# -- measuring -------------------------------------------------------------------------------


class PeakMemory:
    """Peak PSS and RSS, each summed over this process, its descendants and the ``also`` pids,
    sampled by a background thread (with a pause of at least three times what a sample costs,
    so that sampling takes at most a quarter of a core) and on ``sample()``."""

    def __init__(self, also: Sequence[int] = ()) -> None:
        import psutil

        self._psutil = psutil
        self._also = [psutil.Process(pid) for pid in also]
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._watch, daemon=True)
        self.peak_pss = 0
        self.peak_rss = 0

    def sample(self) -> None:
        me = self._psutil.Process()
        pss = rss = 0
        for process in [me, *me.children(recursive=True), *self._also]:
            try:
                info = process.memory_full_info()
            except (self._psutil.NoSuchProcess, self._psutil.AccessDenied):
                continue
            pss += info.pss
            rss += info.rss
        self.peak_pss = max(self.peak_pss, pss)
        self.peak_rss = max(self.peak_rss, rss)

    def _watch(self) -> None:
        while not self._stop.is_set():
            start = time.perf_counter()
            self.sample()
            self._stop.wait(max(0.02, 3 * (time.perf_counter() - start)))

    def __enter__(self) -> PeakMemory:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join()


@dataclass
class _Epoch:
    seconds: float = 0.0  # from building the loader to the last batch's arrival
    first_batch: float = 0.0  # from building the loader to the first batch's arrival
    samples: int = 0
    fingerprint: list[np.ndarray] = field(default_factory=list)


def _epoch(contender: Contender, workload: Workload, memory: PeakMemory | None = None) -> _Epoch:
    """One epoch of a new loader (workers started and stopped within it); with ``memory``, the
    samples' fingerprints too, and a memory sample at the last batch (a DataLoader stops its
    workers before its iterator ends)."""
    result = _Epoch()
    start = time.perf_counter()
    loader = contender.build(workload)
    iterator = iter(loader)
    try:
        for batch in iterator:
            arrival = time.perf_counter()
            if not result.samples:
                result.first_batch = arrival - start
            result.seconds = arrival - start
            result.samples += _batch_len(batch)
            if memory is not None:
                result.fingerprint.append(workload.fingerprint(batch))
                if result.samples == len(workload.dataset):  # type: ignore[arg-type]
                    memory.sample()  # the last batch: before the workers stop
    finally:
        if hasattr(iterator, "close"):
            iterator.close()
        del iterator
        if not isinstance(loader, _Serial | _SpdlThreads | _SpdlProcesses):
            close_loader(loader)
    return result


def _same_samples(serial: np.ndarray, other: np.ndarray, ordered: bool) -> str:
    """``"yes, in order"``, ``"yes"`` (the same samples in another order) or what differs."""
    if len(other) != len(serial):
        return f"NO: {len(other)} samples, serial {len(serial)}"
    if ordered and np.allclose(other, serial):
        return "yes, in order"
    if np.allclose(np.sort(other), np.sort(serial)):
        return "yes" if not ordered else "NO: another order"
    return "NO: other samples"


@dataclass
class _Measured:
    seconds: list[float] = field(default_factory=list)
    first_batch: list[float] = field(default_factory=list)
    samples: set[int] = field(default_factory=set)
    peak_pss: int = 0
    peak_rss: int = 0
    check: str = ""


def _measure(workload: Workload, contenders: Sequence[Contender], settings: Settings,
             ) -> dict[str, _Measured]:
    """One epoch of every contender with the memory sampler on and the samples checked against
    the serial epoch (which also warms the file cache and imports), then interleaved timed
    epochs of every contender."""
    measured = {c.name: _Measured() for c in contenders}
    reference: np.ndarray | None = None
    for contender in contenders:  # SERIAL comes first
        with PeakMemory() as memory:
            epoch = _epoch(contender, workload, memory)
        prints = np.concatenate(epoch.fingerprint)
        reference = prints if reference is None else reference
        mine = measured[contender.name]
        mine.peak_pss, mine.peak_rss = memory.peak_pss, memory.peak_rss
        mine.samples.add(epoch.samples)
        mine.check = _same_samples(reference, prints, contender.ordered)

    def case(contender: Contender) -> Callable[[], float]:
        def timed() -> float:
            epoch = _epoch(contender, workload)
            mine = measured[contender.name]
            mine.seconds.append(epoch.seconds)
            mine.first_batch.append(epoch.first_batch)
            mine.samples.add(epoch.samples)
            return epoch.seconds
        return timed

    interleaved({c.name: case(c) for c in contenders}, settings.repeats,
                f"throughput {workload.name}", settings)
    return measured


# -- the dicts workload, one process per contender ----------------------------------------


def _dict_case(name: str, n: int, batch_size: int, connection: Any) -> None:
    """In a process of its own (a child of the fork server, which has imported torch and the
    loaders but holds no data): build the records, read one epoch with the memory sampler on
    (the fork server's PSS counted too, for the imported pages it shares), send the result."""
    multiprocessing.set_start_method("fork", force=True)  # the workers fork, as in the main
    contenders = {c.name: c for c in _contenders(DICT_PEERS)}
    workload = _dicts_workload(n, batch_size)
    with PeakMemory(also=[os.getppid()]) as memory:
        epoch = _epoch(contenders[name], workload, memory)
    connection.send({"seconds": epoch.seconds, "first_batch": epoch.first_batch,
                     "samples": epoch.samples, "peak_pss": memory.peak_pss,
                     "peak_rss": memory.peak_rss,
                     "fingerprint": np.concatenate(epoch.fingerprint)})
    connection.close()


def _dicts_workload(n: int, batch_size: int) -> Workload:
    return Workload(name="dicts", dataset=RecordDataset(make_records(n)), batch_size=batch_size,
                    fingerprint=_record_fingerprint)


def _measure_dicts(n: int, batch_size: int, names: Sequence[str], ordered: dict[str, bool],
                   repeats: int, settings: Settings) -> dict[str, _Measured]:
    """Each contender's epochs, each in a new process forked from a fork server (so that no
    process but the one measured holds the records); interleaved repetitions."""
    context = multiprocessing.get_context("forkserver")
    context.set_forkserver_preload(["torch", "lightning_loaders", "benchmarks.bench_throughput"])
    # by its importable name, also when this module runs as __main__
    target = importlib.import_module("benchmarks.bench_throughput")._dict_case
    measured = {name: _Measured() for name in names}
    prints: dict[str, np.ndarray] = {}

    def case(name: str) -> Callable[[], float]:
        def run_case() -> float:
            receive, send = context.Pipe(duplex=False)
            process = context.Process(target=target, args=(name, n, batch_size, send))
            process.start()
            send.close()
            result = receive.recv()
            process.join()
            mine = measured[name]
            mine.seconds.append(result["seconds"])
            mine.first_batch.append(result["first_batch"])
            mine.samples.add(result["samples"])
            mine.peak_pss = max(mine.peak_pss, result["peak_pss"])
            mine.peak_rss = max(mine.peak_rss, result["peak_rss"])
            prints[name] = result["fingerprint"]
            return float(result["seconds"])
        return run_case

    interleaved({name: case(name) for name in names}, repeats, "throughput dicts", settings)
    for name in names:
        measured[name].check = _same_samples(prints[SERIAL], prints[name], ordered[name])
    return measured


# -- the report ------------------------------------------------------------------------------


def _contenders(peers: Sequence[str]) -> list[Contender]:
    ours, _ = ours_contenders()
    return [CONTENDERS[name] for name in peers] + ours


def _rows(workload: str, measured: dict[str, _Measured], families: dict[str, str],
          samples: int, cores: int) -> list[dict[str, Any]]:
    """One row per contender (and one for the limit): median samples/s, and per repetition
    the ratios to the limit and to the best DataLoader and SPDL rows of that repetition."""
    repeats = range(len(measured[SERIAL].seconds))

    def best(family: str, rep: int) -> float:
        times = [m.seconds[rep] for name, m in measured.items() if families[name] == family]
        return min(times) if times else float("nan")

    limit = [measured[SERIAL].seconds[r] / cores for r in repeats]
    rows = [{"workload": workload, "loader": LIMIT, "samples/s": samples / median(limit),
             "of limit": 1.0}]
    for name, mine in measured.items():
        rows.append({
            "workload": workload,
            "loader": name,
            "samples/s": samples / median(mine.seconds),
            "of limit": median([limit[r] / mine.seconds[r] for r in repeats]),
            "x DataLoader (best)": median([best(DATALOADER_FAMILY, r) / mine.seconds[r]
                                           for r in repeats]),
            "x SPDL (best)": median([best(SPDL_FAMILY, r) / mine.seconds[r] for r in repeats]),
            "first batch (ms)": 1000 * median(mine.first_batch),
            "peak PSS, all processes (MiB)": mine.peak_pss / 2**20,
            "peak RSS sum (MiB)": mine.peak_rss / 2**20,
            "samples": ", ".join(str(s) for s in sorted(mine.samples)),
            "same samples as serial": mine.check,
        })
    return rows


def _plot(rows: Sequence[dict[str, Any]], title: str, path: Path) -> None:
    """One panel per workload: every row's fraction of the limit as a horizontal bar."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(row["workload"] for row in rows))
    tallest = max(sum(row["workload"] == w for row in rows) for w in workloads)
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 0.3 * tallest + 1.5))
    for ax, workload in zip(np.atleast_1d(axes), workloads, strict=True):
        mine = [row for row in rows if row["workload"] == workload]
        ax.barh(range(len(mine)), [row["of limit"] for row in mine])
        ax.set_yticks(range(len(mine)), [row["loader"] for row in mine], fontsize=8)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.invert_yaxis()
        ax.set_title(workload, fontsize=10)
        ax.set_xlabel("fraction of the limit")
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


COLUMNS = ("workload", "loader", "samples/s", "of limit", "x DataLoader (best)",
           "x SPDL (best)", "first batch (ms)", "peak PSS, all processes (MiB)",
           "peak RSS sum (MiB)", "samples", "same samples as serial")


def run(settings: Settings, numpy_samples: int | None = None, jpeg_samples: int | None = None,
        dict_samples: int | None = None) -> Report:
    cores = len(os.sched_getaffinity(0))
    contenders = _contenders([name for name in CONTENDERS
                              if not (settings.quick and name in QUICK_SKIPS)])
    families = {c.name: c.family for c in contenders}
    _, skipped = ours_contenders()
    rows: list[dict[str, Any]] = []
    notes: list[str] = []

    def section(workload: str, measured: dict[str, _Measured], samples: int) -> None:
        rows.extend(_rows(workload, measured, families, samples, cores))
        notes.append(f"{workload}: load average (1 min) {os.getloadavg()[0]:.1f} after its "
                     f"run, on {cores} cores.")

    n = numpy_samples or settings.pick(128, 4096)
    numpy_work = Workload(name="numpy", dataset=TransformDataset(n), batch_size=32,
                          fingerprint=_tensor_fingerprint)
    section(numpy_work.name, _measure(numpy_work, contenders, settings), n)

    n = jpeg_samples or settings.pick(64, 2048)
    with tempfile.TemporaryDirectory(prefix="ll-bench-throughput-") as directory:
        jpeg = Workload(name="jpeg", dataset=JpegResize(write_jpegs(Path(directory), n, 224)),
                        batch_size=32, fingerprint=_tensor_fingerprint)
        section(jpeg.name, _measure(jpeg, contenders, settings), n)

    n = dict_samples or settings.pick(20_000, 1_000_000)
    dict_contenders = _contenders([name for name in DICT_PEERS
                                   if not (settings.quick and name in QUICK_SKIPS)])
    dict_repeats = max(1, settings.repeats // 3)
    dicts = _measure_dicts(n, 256, [c.name for c in dict_contenders],
                           {c.name: c.ordered for c in dict_contenders}, dict_repeats, settings)
    section("dicts", dicts, n)

    notes[:0] = [
        f"Limit: one core's serial epoch (the main process calls __getitem__ and default_collate, "
        f"no loader) divided by the {cores} cores this process may use. 'of limit', "
        "'x DataLoader (best)' (the faster of 0 and 2 workers) and 'x SPDL (best)' (the fastest "
        "SPDL configuration): medians over repetitions of each repetition's ratio of epoch "
        "times; above 1.0 the row is faster.",
        f"An epoch: a new loader built, iterated to its last batch (worker start-up included, "
        f"shutdown not), not shuffled; numpy and jpeg: {settings.repeats} interleaved "
        f"repetitions, after one epoch per row with the memory sampler on and the samples "
        f"checked; dicts ({dict_repeats} repetitions): every epoch in a new process forked from a "
        "fork server, timed while the memory sampler runs.",
        "Memory: peak over the epoch of the PSS summed over the main process and its children "
        "(and, for dicts, the fork server, whose imported pages the case shares): pages shared "
        "after fork count once in total. 'peak RSS sum' counts them in every process.",
        "SPDL 0.8: spdl.io cannot decode images here (no FFmpeg libraries), so its pipelines run "
        "the same Pillow code on threads: per sample (pipe(__getitem__, concurrency=N)"
        ".aggregate(32).pipe(default_collate)) or per batch (one task fetches and collates a "
        "batch), with N threads; 'SPDL, 2 processes' is spdl.dataloader.get_pytorch_dataloader.",
    ]
    if skipped:
        notes.append("Not built (ResumableLoader does not accept their arguments yet): "
                     + ", ".join(skipped) + ".")
    title = ("Throughput against the limit (one core's serial epoch / cores) and every peer, "
             "with peak memory")
    # rows of three workloads make one bar chart unreadable: a panel per workload instead
    _plot(rows, title, settings.results_dir / "throughput.png")
    return Report(name="throughput", title=title, columns=COLUMNS, rows=rows, notes=tuple(notes))


if __name__ == "__main__":
    sys.exit(standalone(run, __doc__.splitlines()[0], {
        "numpy_samples": "samples of the numpy workload",
        "jpeg_samples": "JPEG files",
        "dict_samples": "records of the dicts workload"}))
