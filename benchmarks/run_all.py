"""Run the benchmark suite: ``python -m benchmarks.run_all [--quick] [--only NAME ...]``.

Every benchmark module ``benchmarks/bench_<name>.py`` exposes ``run(settings) -> Report``. The
DALI and FFCV adapter benchmarks (``bench_dali``, ``bench_ffcv``) follow the same interface and
run when present. Tables and plots go to ``benchmarks/results/<name>.md|png`` (quick runs:
``benchmarks/results/quick/``), and every table there, with the machine, to ``summary.md``.
"""

from __future__ import annotations

import argparse
import importlib
import os
import platform
import sys
import time
import traceback
from dataclasses import replace
from pathlib import Path

from benchmarks.common import RESULTS_DIR, Report, Settings, markdown, write_report

__all__ = ["BENCHMARKS", "machine", "main"]

BENCHMARKS = ("overhead", "tensor", "transform", "jpeg", "memory", "resume", "sampler",
              "epoch_start", "tables", "long_tail", "transport", "throughput", "dali", "ffcv")
OPTIONAL = ("dali", "ffcv")  # written separately; skipped when their module is absent


def machine() -> str:
    """One line describing where the numbers were measured."""
    import numpy
    import torch

    gpu = torch.cuda.get_device_name(0) if torch.cuda.is_available() else "no GPU"
    return (f"{_cpu_model()}, {os.cpu_count()} CPU cores, {gpu}; Python "
            f"{platform.python_version()}, torch {torch.__version__}, numpy {numpy.__version__}")


def _cpu_model() -> str:
    """The CPU's model name (Linux), else the machine type."""
    try:
        with open("/proc/cpuinfo") as cpuinfo:
            for line in cpuinfo:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _load(name: str) -> object | None:
    module = f"benchmarks.bench_{name}"
    try:
        return importlib.import_module(module)
    except ModuleNotFoundError as exc:
        if name in OPTIONAL and exc.name == module:
            return None
        raise


def _write_summary(settings: Settings) -> None:
    """``summary.md``: every benchmark's latest table in the results folder, in suite order."""
    mode = "quick" if settings.quick else "full"
    parts = [f"# Benchmark results ({mode} sizes)", "", f"Machine: {machine()}.", ""]
    for name in BENCHMARKS:
        table = settings.results_dir / f"{name}.md"
        if table.exists():
            parts.append(table.read_text())
    settings.results_dir.mkdir(parents=True, exist_ok=True)
    (settings.results_dir / "summary.md").write_text("\n".join(parts))


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small sizes (a few minutes)")
    parser.add_argument("--only", nargs="+", choices=BENCHMARKS, metavar="NAME",
                        help=f"run only these ({', '.join(BENCHMARKS)})")
    parser.add_argument("--repeats", type=int, help="repetitions (default 3 quick, 9 full)")
    parser.add_argument("--results", type=Path, help="output folder (default "
                        "benchmarks/results, or benchmarks/results/quick with --quick)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    args = parser.parse_args(argv)
    results = args.results or (RESULTS_DIR / "quick" if args.quick else RESULTS_DIR)
    settings = Settings(quick=args.quick, repeats=args.repeats or (3 if args.quick else 9),
                        results_dir=results, progress=not args.no_progress)
    failed: list[str] = []
    for name in args.only or BENCHMARKS:
        try:
            module = _load(name)
            if module is None:
                print(f"[{name}] skipped: benchmarks/bench_{name}.py is not there", flush=True)
                continue
            start, load = time.perf_counter(), os.getloadavg()[0]
            report: Report = module.run(settings)  # type: ignore[attr-defined]
            report = replace(report, notes=(*report.notes, (
                f"Load average (1 min) of the shared machine: {load:.1f} at the start, "
                f"{os.getloadavg()[0]:.1f} at the end, on {os.cpu_count()} cores.")))
            written = write_report(report, settings)
        except Exception:
            failed.append(name)
            print(f"[{name}] FAILED:\n{traceback.format_exc()}", file=sys.stderr, flush=True)
            continue
        print(f"[{name}] {time.perf_counter() - start:.0f} s -> "
              f"{', '.join(str(p) for p in written)}\n\n{markdown(report)}", flush=True)
    _write_summary(settings)
    if failed:
        print(f"failed: {', '.join(failed)}", file=sys.stderr)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
