"""What every benchmark shares: settings, the interleaved timing loop, the loaders under test,
and the Markdown table and PNG plot each one writes under ``benchmarks/results/``.

Every benchmark module ``bench_<name>.py`` exposes ``run(settings) -> Report``; the runner
(``run_all``) writes the reports. Ratios are always "how many times better ours is": for a
throughput ``ours / peer``, for a time or a memory size ``peer / ours``; above 1.0 ours wins.
"""

from __future__ import annotations

import argparse
import gc
import math
import random
import resource
import statistics
import sys
import time
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

__all__ = [
    "DATALOADER",
    "OURS",
    "STATEFUL",
    "RESULTS_DIR",
    "Plot",
    "Report",
    "Settings",
    "arrival_times",
    "close_loader",
    "compare_throughput",
    "cpu_seconds",
    "epoch_case",
    "interleaved",
    "loader_names",
    "make_loaders",
    "markdown",
    "median",
    "paired_ratio",
    "ratio",
    "round_robin",
    "seconds_per_batch",
    "standalone",
    "throughput_columns",
    "throughput_note",
    "throughput_series",
    "write_report",
]

RESULTS_DIR = Path(__file__).resolve().parent / "results"
OURS = "ours"
DATALOADER = "DataLoader"
STATEFUL = "StatefulDataLoader"


@dataclass(frozen=True)
class Settings:
    """How big and how often.

    Attributes:
        quick: small sizes (seconds per benchmark) instead of the full ones.
        repeats: repetitions of every measurement (medians are reported).
        results_dir: where tables and plots go.
        progress: show tqdm progress bars (on stderr).
    """

    quick: bool = False
    repeats: int = 5
    results_dir: Path = RESULTS_DIR
    progress: bool = True

    def pick(self, quick: Any, full: Any) -> Any:
        """``quick`` in quick mode, else ``full``."""
        return quick if self.quick else full


@dataclass(frozen=True)
class Plot:
    """A grouped bar chart: one group per row (labelled by column ``group``), one bar per
    column in ``series``."""

    group: str
    series: tuple[str, ...]
    ylabel: str
    log: bool = False


@dataclass(frozen=True)
class Report:
    """One benchmark's result: a table (``columns`` of ``rows``), notes and a plot."""

    name: str
    title: str
    columns: tuple[str, ...]
    rows: list[dict[str, Any]]
    notes: tuple[str, ...] = ()
    plot: Plot | None = None
    seconds: float = field(default=0.0, compare=False)


# -- measuring -----------------------------------------------------------------------------


def interleaved(cases: Mapping[str, Callable[[], float]], repeats: int, desc: str,
                settings: Settings) -> dict[str, list[float]]:
    """Run every case once per repetition, in an order shuffled at each repetition (seeded):
    neither a slow drift of a shared machine nor what the case before left behind (a process
    still exiting, the page cache) favours one case. The values each case returned."""
    names = list(cases)
    values: dict[str, list[float]] = {name: [] for name in names}
    order = random.Random(len(names))
    with tqdm(total=repeats * len(names), desc=desc, file=sys.stderr, leave=False,
              disable=not settings.progress) as bar:
        for _ in range(repeats):
            for name in order.sample(names, len(names)):
                gc.collect()
                values[name].append(cases[name]())
                bar.update()
    return values


def seconds_per_batch(loader: Iterable[Any], batches: int, warmup: int = 4) -> float:
    """Steady-state seconds per batch: a new ``iter()`` (starting workers), ``warmup`` batches
    untimed, then ``batches`` timed. Then the workers are stopped, so that batches they had
    prefetched are not computed while the next case is being timed."""
    iterator: Iterator[Any] = iter(loader)
    try:
        for _ in range(warmup):
            next(iterator)
        start = time.perf_counter()
        for _ in range(batches):
            next(iterator)
        return (time.perf_counter() - start) / batches
    finally:
        del iterator
        close_loader(loader)


def round_robin(loaders: Mapping[str, Iterable[Any]], batches: int, repeats: int, desc: str,
                settings: Settings, warmup: int = 2, runs: int = 5,
                clock: Callable[[], float] = time.perf_counter) -> dict[str, list[float]]:
    """For loaders without worker processes: per repetition, a new ``iter()`` of each, then
    the loaders take turns (order rotated per repetition), ``runs`` turns of
    ``batches // runs`` consecutive batches each, so that short slow spells of a shared
    machine hit all alike; each repetition's mean ``clock`` seconds per batch."""
    names = list(loaders)
    values: dict[str, list[float]] = {name: [] for name in names}
    per_run = max(1, batches // runs)
    with tqdm(total=repeats, desc=desc, file=sys.stderr, leave=False,
              disable=not settings.progress) as bar:
        for rep in range(repeats):
            gc.collect()
            iterators = {name: iter(loaders[name]) for name in names}
            for iterator in iterators.values():
                for _ in range(warmup):
                    next(iterator)
            spent = dict.fromkeys(names, 0.0)
            shift = rep % len(names)
            order = names[shift:] + names[:shift]
            for _ in range(runs):
                for name in order:
                    iterator = iterators[name]
                    start = clock()
                    for _ in range(per_run):
                        next(iterator)
                    spent[name] += clock() - start
            for name in names:
                values[name].append(spent[name] / (per_run * runs))
            bar.update()
    return values


def median(values: Sequence[float]) -> float:
    return float(statistics.median(values))


def ratio(ours: float, peer: float, higher_is_better: bool) -> float:
    """How many times better ours is than the peer (``nan`` when either is missing)."""
    if not (ours > 0 and peer > 0):
        return math.nan
    return ours / peer if higher_is_better else peer / ours


# -- the loaders under test ----------------------------------------------------------------


def loader_names() -> tuple[str, ...]:
    """Ours, ``DataLoader`` and, when torchdata is installed, ``StatefulDataLoader``."""
    try:
        import torchdata.stateful_dataloader  # noqa: F401
    except ImportError:
        return (OURS, DATALOADER)
    return (OURS, DATALOADER, STATEFUL)


def make_loaders(dataset: Any, names: Sequence[str] | None = None,
                 **kwargs: Any) -> dict[str, Any]:
    """The loaders named, over the same dataset with the same ``DataLoader`` arguments.

    Workers are persistent for every loader (ours is persistent by default), so a repetition
    measures batches, not process start-up. ``names`` defaults to ``loader_names()``.
    """
    from torch.utils.data import DataLoader

    from lightning_loaders import ResumableLoader

    if kwargs.get("num_workers", 0) > 0:
        kwargs.setdefault("persistent_workers", True)
    loaders: dict[str, Any] = {}
    for name in loader_names() if names is None else names:
        if name == OURS:
            loaders[name] = ResumableLoader(dataset, **kwargs)
        elif name == DATALOADER:
            loaders[name] = DataLoader(dataset, **kwargs)
        elif name == STATEFUL:
            from torchdata.stateful_dataloader import StatefulDataLoader

            loaders[name] = StatefulDataLoader(dataset, **kwargs)
        else:
            raise ValueError(f"unknown loader {name!r}; known: {OURS}, {DATALOADER}, {STATEFUL}")
    return loaders


def close_loader(loader: Any) -> None:
    """Stop a loader's worker processes now (ours, DataLoader or StatefulDataLoader)."""
    close = getattr(loader, "close", None)
    if callable(close):
        close()
        return
    iterator = getattr(loader, "_iterator", None)
    if iterator is not None and hasattr(iterator, "_shutdown_workers"):
        iterator._shutdown_workers()
    loader._iterator = None


def compare_throughput(dataset: Any, configs: Mapping[str, Mapping[str, Any]], batches: int,
                       settings: Settings, desc: str) -> list[dict[str, Any]]:
    """Samples per second of every loader in every configuration (``DataLoader`` keyword
    arguments, ``batch_size`` included), interleaved; one row per configuration with the
    median throughputs and the paired ratios ``ours / peer`` (see ``paired_ratio``)."""
    rows = []
    for label, kwargs in configs.items():
        loaders = make_loaders(dataset, **kwargs)
        try:
            if kwargs.get("num_workers", 0) == 0:
                times = round_robin(loaders, batches, settings.repeats, f"{desc} {label}",
                                    settings)
            else:
                times = interleaved({name: _timer(loader, batches)
                                     for name, loader in loaders.items()},
                                    settings.repeats, f"{desc} {label}", settings)
        finally:
            for loader in loaders.values():
                close_loader(loader)
        batch_size = kwargs["batch_size"]
        row: dict[str, Any] = {"config": label}
        row.update({f"{name} samples/s": batch_size / median(values)
                    for name, values in times.items()})
        row.update({f"ours / {name}": paired_ratio(times[OURS], values, higher_is_better=False)
                    for name, values in times.items() if name != OURS})
        rows.append(row)
    return rows


def paired_ratio(ours: Sequence[float], peer: Sequence[float], higher_is_better: bool) -> float:
    """The median over repetitions of each repetition's ratio: the cases of one repetition ran
    back to back, so a slow spell of a shared machine cancels out of their ratio."""
    return median([ratio(o, p, higher_is_better) for o, p in zip(ours, peer, strict=True)])


def throughput_note(batches: int, settings: Settings) -> str:
    """How ``compare_throughput`` measured, for the report's notes."""
    return (f"Per repetition and loader, {batches} timed batches of a new iter(): with "
            "num_workers=0 the loaders take 5 turns each (2 warm-up batches first); with "
            "workers each loader in turn starts its workers, reads 4 warm-up batches, is timed, "
            f"and stops its workers. Median samples/s of {settings.repeats} repetitions; "
            "ratios: median of the per-repetition ratios.")


def throughput_columns() -> tuple[str, ...]:
    """The columns of ``compare_throughput`` rows."""
    names = loader_names()
    return ("config", *throughput_series(), *(f"ours / {n}" for n in names if n != OURS))


def throughput_series() -> tuple[str, ...]:
    """The samples/s columns of ``compare_throughput`` rows (what their plots show)."""
    return tuple(f"{n} samples/s" for n in loader_names())


def _timer(loader: Any, batches: int) -> Callable[[], float]:
    return lambda: seconds_per_batch(loader, batches)


# -- whole epochs (the adapters against their raw engines) -----------------------------------


def cpu_seconds(children: bool = False) -> float:
    """CPU time of this process (all threads) and, with ``children``, of its child processes:
    the live ones and those that exited and were waited for (a loader that starts workers each
    epoch ends some during it). The kernel counts children's time in clock ticks: only sums
    over many epochs are precise."""
    usage = resource.getrusage(resource.RUSAGE_SELF)
    total = usage.ru_utime + usage.ru_stime
    if children:
        import psutil

        ended = resource.getrusage(resource.RUSAGE_CHILDREN)
        total += ended.ru_utime + ended.ru_stime

        for child in psutil.Process().children(recursive=True):
            try:
                times = child.cpu_times()
            except psutil.NoSuchProcess:
                continue
            total += times.user + times.system
    return total


def arrival_times(epoch: Iterable[Any]) -> list[float]:
    """Run one epoch; the ``perf_counter`` time at which each batch arrived."""
    return [time.perf_counter() for _ in epoch]


def epoch_case(epoch: Callable[[], list[float]], gaps: list[float], cpu: list[float],
               children: bool = False) -> Callable[[], float]:
    """A case for ``interleaved``: runs ``epoch`` (which returns the arrival times), adds the
    gaps between batches to ``gaps`` and the epoch's CPU seconds to ``cpu``; returns the
    median gap. The first batch waits for the epoch start, so it makes no gap."""
    def run() -> float:
        start = cpu_seconds(children)
        times = epoch()
        cpu.append(cpu_seconds(children) - start)
        mine = [later - earlier for earlier, later in zip(times, times[1:], strict=False)]
        gaps.extend(mine)
        return statistics.median(mine) if mine else 0.0

    return run


def standalone(run: Callable[..., Report], description: str, sizes: Mapping[str, str],
               argv: list[str] | None = None) -> int:
    """``python -m benchmarks.bench_<name>``: one benchmark alone, quick sizes unless
    ``--full``; ``sizes`` maps each size option of ``run`` to its help text."""
    parser = argparse.ArgumentParser(description=description)
    for name, text in sizes.items():
        parser.add_argument(f"--{name}", type=int, help=text)
    parser.add_argument("--repeats", type=int, default=15, help="epochs per loader")
    parser.add_argument("--full", action="store_true", help="the full sizes")
    parser.add_argument("--results", type=Path, help="output folder (default benchmarks/results, "
                        "or benchmarks/results/quick without --full)")
    parser.add_argument("--no-progress", action="store_true")
    args = parser.parse_args(argv)
    results = args.results or (RESULTS_DIR if args.full else RESULTS_DIR / "quick")
    settings = Settings(quick=not args.full, repeats=args.repeats, results_dir=results,
                        progress=not args.no_progress)
    report = run(settings, *(getattr(args, name) for name in sizes))
    written = write_report(report, settings)
    print(markdown(report))
    print("written: " + ", ".join(str(path) for path in written))
    return 0


# -- reporting -----------------------------------------------------------------------------


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "n/a"
        if value == 0:
            return "0"
        magnitude = abs(value)
        if magnitude >= 1000:
            return f"{value:,.0f}"
        if magnitude >= 10:
            return f"{value:.1f}"
        if magnitude >= 0.01:
            return f"{value:.2f}"
        return f"{value:.2e}"
    if isinstance(value, int) and not isinstance(value, bool):
        return f"{value:,}"
    return str(value)


def markdown(report: Report) -> str:
    """The report as Markdown: a heading, the table, then the notes."""
    lines = [f"### {report.title}", ""]
    lines.append("| " + " | ".join(report.columns) + " |")
    lines.append("|" + "|".join("---" for _ in report.columns) + "|")
    for row in report.rows:
        lines.append("| " + " | ".join(_cell(row.get(c, "")) for c in report.columns) + " |")
    if report.notes:
        lines.append("")
        lines.extend(f"- {note}" for note in report.notes)
    return "\n".join(lines) + "\n"


def write_report(report: Report, settings: Settings) -> list[Path]:
    """Write ``<name>.md`` (and ``<name>.png`` when the report has a plot); the paths."""
    settings.results_dir.mkdir(parents=True, exist_ok=True)
    table = settings.results_dir / f"{report.name}.md"
    table.write_text(markdown(report))
    written = [table]
    if report.plot is not None and report.rows:
        image = settings.results_dir / f"{report.name}.png"
        _bar_plot(report, report.plot, image)
        written.append(image)
    return written


def _bar_plot(report: Report, plot: Plot, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    groups = [str(row[plot.group]) for row in report.rows]
    width = 0.8 / len(plot.series)
    fig, ax = plt.subplots(figsize=(max(6.0, 1.2 * len(groups) * len(plot.series)), 4.0))
    for k, series in enumerate(plot.series):
        heights = [_number(row.get(series)) for row in report.rows]
        xs = [g + (k - (len(plot.series) - 1) / 2) * width for g in range(len(groups))]
        ax.bar(xs, heights, width, label=series)
    ax.set_xticks(range(len(groups)), groups)
    ax.set_ylabel(plot.ylabel)
    if plot.log:
        ax.set_yscale("log")
    ax.set_title(report.title, fontsize=10)
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _number(value: Any) -> float:
    return float(value) if isinstance(value, int | float) and not isinstance(value, bool) \
        else math.nan
