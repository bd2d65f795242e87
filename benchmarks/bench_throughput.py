"""Throughput against the machine's limit and every peer, with peak memory, in one run.

Three workloads, each read as whole epochs (batch order not shuffled, so that every loader's
order is defined and checked):

- ``numpy``: about 300 us of numpy per sample (workload 2's ``TransformDataset`` with
  ``NUMPY_ROUNDS`` passes), batch 32;
- ``jpeg``: Pillow decodes a 224 x 224 JPEG file and resizes it to 128 x 128, batch 32;
- ``dicts``: the 1M-dict dataset of workload 4 without ``pack()``, batch 256, where memory is
  the point (the records are copied into every forked worker as it reads them).

The limit of a workload is one core's serial time for the epoch (the main process calls
``__getitem__`` and ``default_collate`` itself, no loader) divided by the cores this process
may use: no loader can beat it. Every contender is a named factory in ``CONTENDERS``; ours
are listed in ``OURS``.

Memory is the peak over the epoch of the proportional set size (PSS) summed over the main
process and all its child processes: a page shared by ``k`` processes counts ``1/k`` in each,
so pages that forked workers share with the main process are not counted twice (a sum of RSS
would). A background thread samples it, in an untimed epoch of each contender.

Every loader runs in a new process, forked from a fork server that has imported torch and the
loaders but holds no data (its PSS is counted too, for the imported pages it shares), so that
no loader inherits the memory or the threads of another. Each reads two epochs: the *first*
(timed from building the loader: worker start-up, and for ``num_workers="auto"`` its tuning,
included) and the *next* (the same loader iterated again: what the epochs of a training run
cost). Loaders with workers keep them between epochs (``persistent_workers=True`` for
``DataLoader`` and ``StatefulDataLoader``, as for ours by default).

The limit assumes that ``n`` cores do ``n`` times one core's work. Per workload, a note says how
far they do here with no loader at all (``core_scaling``): a serial epoch alone on one pinned
core against one per core at once.

Besides the table, ``run`` writes ``throughput.png``: a panel per workload, every row's
fraction of the limit.
"""

from __future__ import annotations

import importlib
import multiprocessing
import os
import sys
import tempfile
import threading
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple

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
           "core_scaling", "ours_contenders", "run"]

WORKERS = 2
EPOCHS = ("first", "next")  # the epochs each loader reads (see the module docstring)
NUMPY_ROUNDS = 48  # passes of TransformDataset's math: about 300 us per sample here (12: 80 us)
SERIAL = "serial, 1 core"
BARE = "bare: a forked process per core, no loader, no transfer"
LIMIT = "limit: serial / cores"
DATALOADER_FAMILY = "DataLoader"
SPDL_FAMILY = "SPDL"

# Our loader's configurations: (row name, ResumableLoader keyword arguments other than the
# dataset, batch_size and shuffle).
OURS: list[tuple[str, dict[str, Any]]] = [
    ("ours, 0 workers", {"num_workers": 0}),
    ("ours, process, 2 workers", {"backend": "process", "num_workers": WORKERS}),
    ("ours, thread, 2 workers", {"backend": "thread", "num_workers": WORKERS}),
    ("ours, auto backend, 2 workers", {"backend": "auto", "num_workers": WORKERS}),
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
    if isinstance(batch, _Fingerprints):
        return len(batch.values)
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
        self.fingerprint = workload.fingerprint

    def batch(self, start: int) -> Any:
        """The batch starting at sample ``start``, collated."""
        end = min(start + self.batch_size, len(self.dataset))  # type: ignore[arg-type]
        return default_collate([self.dataset[i] for i in range(start, end)])

    def __iter__(self) -> Iterator[Any]:
        for start in range(0, len(self.dataset), self.batch_size):  # type: ignore[arg-type]
            yield self.batch(start)


class _Fingerprints(NamedTuple):
    """What ``_Bare`` delivers for a batch: its samples' fingerprints, computed where the batch
    was made."""

    values: np.ndarray


def _fingerprints(workload: Workload, batch: Any) -> np.ndarray:
    return batch.values if isinstance(batch, _Fingerprints) else workload.fingerprint(batch)


class _Bare:
    """What the hardware allows: one forked process per core fetches and collates a contiguous
    share of the batches, as the serial row does, and sends back only each batch's
    fingerprints (no loader, no transfer of data). Its time against the limit shows how far
    the cores scale together on the workload (shared caches, memory bandwidth, the host)."""

    def __init__(self, workload: Workload) -> None:
        self.workload = workload

    def __iter__(self) -> Iterator[Any]:
        serial = _Serial(self.workload)
        starts = range(0, len(self.workload.dataset), serial.batch_size)  # type: ignore[arg-type]
        shares = np.array_split(np.asarray(starts), len(os.sched_getaffinity(0)))
        context = multiprocessing.get_context("fork")
        children = []
        for share in shares:
            receive, send = context.Pipe(duplex=False)
            child = context.Process(target=_bare_share, args=(serial, share.tolist(), send))
            child.start()
            send.close()
            children.append((child, receive))
        try:
            for _, receive in children:
                yield from map(_Fingerprints, receive.recv())
        finally:
            for child, _ in children:
                child.join()


def _bare_share(serial: _Serial, starts: list[int], send: Any) -> None:
    """In a forked child of ``_Bare``: the batches starting at ``starts``; their
    fingerprints, sent at the end. One intra-op thread, as in a DataLoader worker (more would
    spin on the cores the other children compute on)."""
    torch.set_num_threads(1)
    send.send([serial.fingerprint(serial.batch(start)) for start in starts])
    send.close()


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
        yield from self.loader

    def close(self) -> None:
        self.loader._shmem.unlink()  # SPDL 0.8 never unlinks the shared memory it pickled into


def _dataloader(workers: int) -> Callable[[Workload], Iterable[Any]]:
    def build(workload: Workload) -> Iterable[Any]:
        from torch.utils.data import DataLoader

        return DataLoader(workload.dataset, batch_size=workload.batch_size, shuffle=False,
                          num_workers=workers, persistent_workers=workers > 0)
    return build


def _stateful(workload: Workload) -> Iterable[Any]:
    from torchdata.stateful_dataloader import StatefulDataLoader

    return StatefulDataLoader(workload.dataset, batch_size=workload.batch_size, shuffle=False,
                              num_workers=WORKERS, persistent_workers=True)


def _ours(kwargs: dict[str, Any]) -> Callable[[Workload], Iterable[Any]]:
    def build(workload: Workload) -> Iterable[Any]:
        from lightning_loaders import ResumableLoader

        return ResumableLoader(workload.dataset, batch_size=workload.batch_size, shuffle=False,
                               **kwargs)
    return build


def ours_contenders() -> list[Contender]:
    """``OURS`` as contenders."""
    return [Contender(name=name, family="ours", build=_ours(kwargs)) for name, kwargs in OURS]


# name -> contender, for the peers; per workload, ``_contenders`` adds ours
CONTENDERS: dict[str, Contender] = {c.name: c for c in (
    Contender(name=SERIAL, family="serial", build=_Serial),
    Contender(name=BARE, family="bare", build=_Bare),
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
DICT_PEERS = (SERIAL, BARE, "DataLoader, 0 workers", "DataLoader, 2 workers",
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
class _Epochs:
    seconds: list[float] = field(default_factory=list)  # per epoch (see ``_epochs``)
    first_batch: float = 0.0  # from building the loader to the first batch's arrival
    samples: list[int] = field(default_factory=list)  # per epoch
    fingerprint: list[np.ndarray] = field(default_factory=list)  # the first epoch's


def _epochs(contender: Contender, workload: Workload, memory: PeakMemory | None = None,
            ) -> _Epochs:
    """``EPOCHS`` of a new loader: the first timed from building it, the next from its
    ``iter()``, each to its last batch's arrival; with ``memory``, the first epoch's
    fingerprints too, and a memory sample at each last batch (a DataLoader without persistent
    workers stops them before its iterator ends)."""
    result = _Epochs()
    start = time.perf_counter()
    loader = contender.build(workload)
    try:
        for epoch in range(len(EPOCHS)):
            start = start if epoch == 0 else time.perf_counter()
            samples, arrival = 0, start
            iterator = iter(loader)
            try:
                for batch in iterator:
                    arrival = time.perf_counter()
                    if not samples and epoch == 0:
                        result.first_batch = arrival - start
                    samples += _batch_len(batch)
                    if memory is not None:
                        if epoch == 0:
                            result.fingerprint.append(_fingerprints(workload, batch))
                        if samples == len(workload.dataset):  # type: ignore[arg-type]
                            memory.sample()
            finally:
                if hasattr(iterator, "close"):
                    iterator.close()
                del iterator
            result.seconds.append(arrival - start)
            result.samples.append(samples)
    finally:
        if not isinstance(loader, _Serial | _Bare | _SpdlThreads):
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
    seconds: dict[str, list[float]] = field(default_factory=lambda: {e: [] for e in EPOCHS})
    first_batch: list[float] = field(default_factory=list)
    samples: set[int] = field(default_factory=set)
    peak_pss: int = 0
    peak_rss: int = 0
    check: str = ""


@dataclass(frozen=True, kw_only=True)
class _Spec:
    """What a child process rebuilds its workload from: ``kind`` is ``"numpy"``, ``"jpeg"``
    (the JPEG files in ``directory``) or ``"dicts"``."""

    kind: str
    samples: int
    directory: str = ""


def _workload(spec: _Spec) -> Workload:
    if spec.kind == "numpy":
        return Workload(name="numpy", dataset=TransformDataset(spec.samples, rounds=NUMPY_ROUNDS),
                        batch_size=32, fingerprint=_tensor_fingerprint)
    if spec.kind == "jpeg":
        paths = sorted(str(path) for path in Path(spec.directory).glob("*.jpg"))
        return Workload(name="jpeg", dataset=JpegResize(paths), batch_size=32,
                        fingerprint=_tensor_fingerprint)
    return Workload(name="dicts", dataset=RecordDataset(make_records(spec.samples)),
                    batch_size=256, fingerprint=_record_fingerprint)


def _child_epoch(spec: _Spec, name: str, sample_memory: bool, connection: Any) -> None:
    """In a new process (a child of the fork server, which has imported torch and the loaders
    but holds no data): build the workload, read one epoch of contender ``name`` (with the
    memory sampler on, counting the fork server's PSS too for the imported pages it shares, and
    the samples' fingerprints), send the result."""
    multiprocessing.set_start_method("fork", force=True)  # workers fork, as from a main process
    contender = {c.name: c for c in _contenders(list(CONTENDERS))}[name]
    workload = _workload(spec)
    result: dict[str, Any] = {}
    if sample_memory:
        with PeakMemory(also=[os.getppid()]) as memory:
            epochs = _epochs(contender, workload, memory)
        result.update(peak_pss=memory.peak_pss, peak_rss=memory.peak_rss,
                      fingerprint=np.concatenate(epochs.fingerprint))
    else:
        epochs = _epochs(contender, workload)
    result.update(seconds=epochs.seconds, first_batch=epochs.first_batch,
                  samples=epochs.samples)
    connection.send(result)
    connection.close()


def _serial_epoch_on(spec: _Spec, core: int, results: Any) -> None:
    """In a forked child pinned to ``core``: the seconds of one serial epoch, put in
    ``results``."""
    os.sched_setaffinity(0, {core})
    torch.set_num_threads(1)
    serial = _Serial(_workload(spec))
    start = time.perf_counter()
    for _ in serial:
        pass
    results.put(time.perf_counter() - start)


def _serial_epochs_at_once(spec: _Spec, cores: Sequence[int]) -> float:
    """Seconds until each of one forked process per core of ``cores`` has read a serial
    epoch."""
    context = multiprocessing.get_context("fork")
    results = context.Queue()
    children = [context.Process(target=_serial_epoch_on, args=(spec, core, results))
                for core in cores]
    for child in children:
        child.start()
    seconds = [results.get() for _ in children]
    for child in children:
        child.join()
    return max(seconds)


def core_scaling(spec: _Spec, pairs: int) -> float:
    """How far the cores scale together on a workload, with no loader: a serial epoch alone on
    one pinned core, against one per core at once, each pinned to its own (the median over
    ``pairs`` pairs of alone / at once). The limit assumes 1.0; no loader can count on more
    of it than this."""
    cores = sorted(os.sched_getaffinity(0))
    _serial_epochs_at_once(spec, cores[:1])  # warms the file cache
    return float(np.median([_serial_epochs_at_once(spec, cores[:1])
                            / _serial_epochs_at_once(spec, cores) for _ in range(pairs)]))


def _in_child(spec: _Spec, name: str, sample_memory: bool) -> dict[str, Any]:
    """``_child_epoch`` in a new process forked from a fork server; its result."""
    context = multiprocessing.get_context("forkserver")
    preload = ["torch", "lightning_loaders"]
    if __name__ != "__main__":  # run as a script, each child runs this module as its main
        preload.append(__name__)
    context.set_forkserver_preload(preload)
    # by its importable name, also when this module runs as __main__
    target = importlib.import_module("benchmarks.bench_throughput")._child_epoch
    receive, send = context.Pipe(duplex=False)
    process = context.Process(target=target, args=(spec, name, sample_memory, send))
    process.start()
    send.close()
    try:
        return dict(receive.recv())
    except EOFError:
        raise RuntimeError(f"the epoch of {name!r} on {spec.kind} failed in its process "
                           f"(exit code {process.exitcode}); its error is above") from None
    finally:
        process.join()


def _measure(spec: _Spec, contenders: Sequence[Contender], repeats: int, settings: Settings,
             ) -> dict[str, _Measured]:
    """Every epoch in a new process: first one per contender with the memory sampler on and
    the samples checked against the serial epoch (which also warms the file cache), then
    ``repeats`` interleaved timed ones per contender."""
    measured = {c.name: _Measured() for c in contenders}
    reference: np.ndarray | None = None
    for contender in contenders:  # SERIAL comes first
        result = _in_child(spec, contender.name, sample_memory=True)
        reference = result["fingerprint"] if reference is None else reference
        mine = measured[contender.name]
        mine.peak_pss, mine.peak_rss = result["peak_pss"], result["peak_rss"]
        mine.samples.update(result["samples"])
        mine.check = _same_samples(reference, result["fingerprint"], contender.ordered)

    def case(contender: Contender) -> Callable[[], float]:
        def timed() -> float:
            result = _in_child(spec, contender.name, sample_memory=False)
            mine = measured[contender.name]
            for epoch, seconds in zip(EPOCHS, result["seconds"], strict=True):
                mine.seconds[epoch].append(seconds)
            mine.first_batch.append(result["first_batch"])
            mine.samples.update(result["samples"])
            return float(sum(result["seconds"]))
        return timed

    interleaved({c.name: case(c) for c in contenders}, repeats, f"throughput {spec.kind}",
                settings)
    return measured


# -- the report ------------------------------------------------------------------------------


def _contenders(peers: Sequence[str]) -> list[Contender]:
    return [CONTENDERS[name] for name in peers] + ours_contenders()


def _rows(workload: str, measured: dict[str, _Measured], families: dict[str, str],
          samples: int, cores: int) -> list[dict[str, Any]]:
    """One row per contender (and one for the limit): per epoch of ``EPOCHS``, median
    samples/s and, per repetition, the ratios to that epoch's limit (the serial row's same
    epoch / cores) and to the best DataLoader and SPDL rows of that repetition."""
    rows: list[dict[str, Any]] = [{"workload": workload, "loader": name}
                                  for name in (LIMIT, *measured)]
    for epoch in EPOCHS:
        times = {name: mine.seconds[epoch] for name, mine in measured.items()}
        repeats = range(len(times[SERIAL]))

        def best(family: str, rep: int) -> float:
            found = [t[rep] for name, t in times.items() if families[name] == family]  # noqa: B023
            return min(found) if found else float("nan")

        limit = [times[SERIAL][r] / cores for r in repeats]
        rows[0].update({f"{epoch}: samples/s": samples / median(limit), f"{epoch}: of limit": 1.0})
        for row, seconds in zip(rows[1:], times.values(), strict=True):
            row.update({
                f"{epoch}: samples/s": samples / median(seconds),
                f"{epoch}: of limit": median([limit[r] / seconds[r] for r in repeats]),
                f"{epoch}: x DataLoader": median([best(DATALOADER_FAMILY, r) / seconds[r]
                                                  for r in repeats]),
                f"{epoch}: x SPDL": median([best(SPDL_FAMILY, r) / seconds[r] for r in repeats]),
            })
    for row, mine in zip(rows[1:], measured.values(), strict=True):
        row.update({
            "first batch (ms)": 1000 * median(mine.first_batch),
            "peak PSS, all processes (MiB)": mine.peak_pss / 2**20,
            "peak RSS sum (MiB)": mine.peak_rss / 2**20,
            "samples": ", ".join(str(s) for s in sorted(mine.samples)),
            "same samples as serial": mine.check,
        })
    return rows


def _plot(rows: Sequence[dict[str, Any]], title: str, path: Path) -> None:
    """One panel per workload: every row's fraction of the limit, a horizontal bar per epoch."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    workloads = list(dict.fromkeys(row["workload"] for row in rows))
    tallest = max(sum(row["workload"] == w for row in rows) for w in workloads)
    fig, axes = plt.subplots(1, len(workloads), figsize=(6 * len(workloads), 0.3 * tallest + 1.5))
    height = 0.8 / len(EPOCHS)
    for ax, workload in zip(np.atleast_1d(axes), workloads, strict=True):
        mine = [row for row in rows if row["workload"] == workload]
        for k, epoch in enumerate(EPOCHS):
            ax.barh([i + k * height for i in range(len(mine))],
                    [row[f"{epoch}: of limit"] for row in mine], height=height,
                    label=f"{epoch} epoch")
        ax.set_yticks([i + height / 2 for i in range(len(mine))], [row["loader"] for row in mine],
                      fontsize=8)
        ax.axvline(1.0, color="black", linewidth=0.8)
        ax.invert_yaxis()
        ax.set_title(workload, fontsize=10)
        ax.set_xlabel("fraction of the limit")
        ax.legend(fontsize=8)
    fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


COLUMNS = ("workload", "loader",
           *(f"{epoch}: {column}" for epoch in EPOCHS
             for column in ("samples/s", "of limit", "x DataLoader", "x SPDL")),
           "first batch (ms)", "peak PSS, all processes (MiB)", "peak RSS sum (MiB)", "samples",
           "same samples as serial")


def run(settings: Settings, numpy_samples: int | None = None, jpeg_samples: int | None = None,
        dict_samples: int | None = None) -> Report:
    cores = len(os.sched_getaffinity(0))
    contenders = _contenders([name for name in CONTENDERS
                              if not (settings.quick and name in QUICK_SKIPS)])
    families = {c.name: c.family for c in contenders}
    rows: list[dict[str, Any]] = []
    notes: list[str] = []

    def section(spec: _Spec, contenders: Sequence[Contender], repeats: int) -> None:
        measured = _measure(spec, contenders, repeats, settings)
        load = os.getloadavg()[0]
        rows.extend(_rows(spec.kind, measured, families, spec.samples, cores))
        notes.append(f"{spec.kind}: load average (1 min) {load:.1f} after its run, on {cores} "
                     f"cores. With no loader, {cores} serial epochs at once, one per pinned core, "
                     f"ran at {core_scaling(spec, repeats):.2f} of {cores}x the speed of one "
                     f"alone (median of {repeats} pairs): the most of the limit the cores give.")

    def size(given: int | None, quick: int, full: int) -> int:
        return settings.pick(quick, full) if given is None else given  # 0: leave it out

    n = size(numpy_samples, 128, 4096)
    if n:
        section(_Spec(kind="numpy", samples=n), contenders, settings.repeats)

    n = size(jpeg_samples, 64, 2048)
    if n:
        with tempfile.TemporaryDirectory(prefix="ll-bench-throughput-") as directory:
            write_jpegs(Path(directory), n, 224)
            section(_Spec(kind="jpeg", samples=n, directory=directory), contenders,
                    settings.repeats)

    n = size(dict_samples, 20_000, 1_000_000)
    dict_repeats = max(1, settings.repeats // 3)
    if n:
        dict_contenders = _contenders([name for name in DICT_PEERS
                                       if not (settings.quick and name in QUICK_SKIPS)])
        section(_Spec(kind="dicts", samples=n), dict_contenders, dict_repeats)

    notes[:0] = [
        f"Limit: one core's serial epoch (the main process calls __getitem__ and default_collate, "
        f"no loader) divided by the {cores} cores this process may use, per epoch (first and "
        "next). 'of limit', 'x DataLoader' (the faster of 0 and 2 workers) and 'x SPDL' (the "
        "fastest SPDL configuration): medians over repetitions of each repetition's ratio of "
        "that epoch's times; above 1.0 the row is faster.",
        f"Each row: a new loader in a new process forked from a fork server that has imported "
        f"torch and the loaders (so that no loader inherits another's memory), reading two "
        f"epochs, not shuffled: the first timed from building the loader (worker start-up "
        f"included, shutdown not), the next from iter() on the same loader; workers persist "
        f"between them (persistent_workers=True for DataLoader and StatefulDataLoader). One "
        f"run per row with the memory sampler on and the first epoch's samples checked, then "
        f"interleaved timed ones, {settings.repeats} per row (dicts: {dict_repeats}).",
        "Memory: peak over the epoch of the PSS summed over the epoch's process, its children "
        "and the fork server (whose imported pages they share): pages shared after fork count "
        "once in total. 'peak RSS sum' counts them in every process.",
        f"'{BARE}': the serial row's work split into a contiguous share of the batches per "
        "core, each computed in a forked process that sends back only fingerprints: how far "
        "the cores scale together on the workload, with nothing of a loader.",
        "SPDL 0.8: spdl.io cannot decode images here (no FFmpeg libraries), so its pipelines run "
        "the same Pillow code on threads: per sample (pipe(__getitem__, concurrency=N)"
        ".aggregate(32).pipe(default_collate)) or per batch (one task fetches and collates a "
        "batch), with N threads; 'SPDL, 2 processes' is spdl.dataloader.get_pytorch_dataloader.",
    ]
    title = ("Throughput against the limit (one core's serial epoch / cores) and every peer, "
             "with peak memory")
    # rows of three workloads make one bar chart unreadable: a panel per workload instead
    _plot(rows, title, settings.results_dir / "throughput.png")
    return Report(name="throughput", title=title, columns=COLUMNS, rows=rows, notes=tuple(notes))


if __name__ == "__main__":
    sys.exit(standalone(run, __doc__.splitlines()[0], {
        "numpy_samples": "samples of the numpy workload (0 leaves it out)",
        "jpeg_samples": "JPEG files (0 leaves the workload out)",
        "dict_samples": "records of the dicts workload (0 leaves it out)"}))
