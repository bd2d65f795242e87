"""Every example runs end to end with tiny arguments and prints its key line."""

from __future__ import annotations

import importlib.util
import os
import subprocess
import sys
from pathlib import Path
from typing import NamedTuple

import pytest

EXAMPLES_DIR = Path(__file__).resolve().parents[1] / "examples"


class Example(NamedTuple):
    """One example run: ``python examples/<script> <args>`` must exit 0 and print ``expect``."""

    script: str
    args: tuple[str, ...]
    expect: tuple[str, ...]
    needs: tuple[str, ...] = ()  # importable modules the example needs beyond the core


EXAMPLES = [
    Example("quickstart.py",
            ("--samples", "40", "--batch-size", "8", "--epochs", "2", "--crash-at-step", "5",
             "--num-workers", "0"),
            ("identical to an uninterrupted run: yes",)),
    Example("cli_config.py",
            ("fit", "--config", str(EXAMPLES_DIR / "cli_config.yaml"), "--data.samples", "64",
             "--data.batch_size", "16", "--trainer.max_epochs", "1",
             "--trainer.enable_progress_bar", "false"),
            ("trained 4 steps", "batch_size=16", "seed=7"), needs=("jsonargparse",)),
    Example("ddp.py", ("--samples", "30", "--num-workers", "0"),
            ("every epoch covers every sample exactly once across ranks: yes",
             "same number of batches on every rank: yes",
             "identical to an uninterrupted run on every rank: yes")),
    Example("datamodule.py",
            ("--samples", "40", "--batch-size", "8", "--epochs", "2", "--crash-at-step", "7",
             "--num-workers", "0"),
            ("identical to an uninterrupted run: yes",)),
    Example("iterable_files.py",
            ("--files", "3", "--batch-size", "8", "--epochs", "2", "--crash-at-step", "5",
             "--num-workers", "0"),
            ("every record exactly once: yes", "identical to an uninterrupted run: yes")),
    Example("dali_pipeline.py", ("--images", "32", "--batch-size", "8", "--epochs", "1"),
            ("mode: reader", "epoch 0:"), needs=("nvidia.dali",)),
    Example("ffcv_pipeline.py", ("--samples", "90", "--batch-size", "16"),
            ("identical sample order",), needs=("ffcv",)),
]


@pytest.mark.parametrize("example", EXAMPLES, ids=[e.script for e in EXAMPLES])
def test_example_runs(example: Example, tmp_path: Path) -> None:
    script = EXAMPLES_DIR / example.script
    missing = [m for m in example.needs if importlib.util.find_spec(m) is None]
    if missing:
        pytest.skip(f"{example.script} needs {', '.join(missing)}")
    temp = tmp_path / "temp"  # the example's TMPDIR: what it makes there, it removes
    temp.mkdir()
    done = subprocess.run([sys.executable, str(script), *example.args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=300,
                          env={**os.environ, "TMPDIR": str(temp)})
    output = done.stdout + done.stderr
    assert done.returncode == 0, output[-4000:]
    for line in example.expect:
        assert line in done.stdout, output[-4000:]
    left = [p.name for p in temp.iterdir() if not p.name.startswith("torchinductor_")]
    assert not left, f"{example.script} left {left} in its TMPDIR"
