"""The benchmark suite runs end to end at its quick sizes and writes every table and plot.

Speed is never asserted here (benchmarks/README.md holds the measured figures); this keeps
``make bench`` from breaking unnoticed.
"""

from __future__ import annotations

import importlib.util
import re
import subprocess
import sys
from pathlib import Path

import pytest

from benchmarks.run_all import BENCHMARKS
from tests.ddp_harness import REPO

NEEDS = {"dali": "nvidia.dali", "ffcv": "ffcv"}  # optional extras, installed by CI


def test_every_benchmark_writes_its_table_and_plot(tmp_path: Path) -> None:
    names = [n for n in BENCHMARKS if n not in NEEDS or importlib.util.find_spec(NEEDS[n])]
    done = subprocess.run(
        [sys.executable, "-m", "benchmarks.run_all", "--quick", "--repeats", "1",
         "--results", str(tmp_path), "--no-progress", "--only", *names],
        cwd=REPO, capture_output=True, text=True, timeout=600)
    assert done.returncode == 0, (done.stdout + done.stderr)[-4000:]
    summary = (tmp_path / "summary.md").read_text()
    for name in names:
        table = (tmp_path / f"{name}.md").read_text()
        assert table.count("\n|") >= 3, f"{name}: no rows in\n{table}"
        assert table in summary
        assert (tmp_path / f"{name}.png").stat().st_size > 0


@pytest.mark.parametrize("name", BENCHMARKS)
def test_every_benchmark_runs_alone(name: str) -> None:
    """``python -m benchmarks.bench_<name>`` is each benchmark's own command line."""
    done = subprocess.run([sys.executable, "-m", f"benchmarks.bench_{name}", "--help"],
                          cwd=REPO, capture_output=True, text=True, timeout=120)
    assert done.returncode == 0 and "--full" in done.stdout, (done.stdout + done.stderr)[-2000:]


def test_long_tail_loaders_are_the_ones_their_columns_name() -> None:
    from benchmarks.bench_long_tail import IN_ORDER, OUT_OF_ORDER, TORCH, LongTail, _loader

    data = LongTail(8, slow_s=0.0)
    assert {kind: _loader(kind, data).in_order for kind in (IN_ORDER, OUT_OF_ORDER, TORCH)} == {
        IN_ORDER: True, OUT_OF_ORDER: False, TORCH: False}


def test_throughput_contenders_deliver_the_same_samples(tmp_path: Path) -> None:
    from benchmarks.bench_throughput import run
    from benchmarks.common import Settings

    report = run(Settings(quick=True, repeats=1, results_dir=tmp_path, progress=False),
                 numpy_samples=64, jpeg_samples=32, dict_samples=2_000)
    rows = [row for row in report.rows if "same samples as serial" in row]
    assert {row["workload"] for row in rows} == {"numpy", "jpeg", "dicts"}
    scaling = [re.search(r"^(\w+): .* ran at (\d+\.\d+) of", note) for note in report.notes]
    assert {(m[1], float(m[2]) > 0) for m in scaling if m} == {
        ("numpy", True), ("jpeg", True), ("dicts", True)}
    for row in rows:
        assert row["same samples as serial"].startswith("yes"), row
        assert row["peak PSS, all processes (MiB)"] > 0, row
        if row["loader"].startswith(("ours", "DataLoader")):
            assert row["same samples as serial"] == "yes, in order", row


def test_the_worker_timeline_accounts_for_every_batch_of_each_epoch(
        capsys: pytest.CaptureFixture[str]) -> None:
    from benchmarks.worker_timeline import main

    assert main(["--epochs", "2", "--samples", "192", "--workers", "2"]) == 0
    out = capsys.readouterr().out
    epochs = re.findall(r"^epoch (\d): .* of the limit", out, flags=re.M)
    assert epochs == ["0", "1"]
    per_worker = [int(n) for n in re.findall(r"^  worker .*: (\d+) batches", out, flags=re.M)]
    assert len(per_worker) == 4 and sum(per_worker) == 2 * 192 // 32
