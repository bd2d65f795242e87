"""Real multi-process DDP for tests: launch a script as N ranks on CPU (gloo), collect results.

Ranks are started the way ``torchrun`` starts them (``MASTER_ADDR``, ``MASTER_PORT``, ``RANK``,
``LOCAL_RANK``, ``WORLD_SIZE`` in the environment), so a ``Trainer(strategy="ddp",
accelerator="cpu", devices=N)`` inside the script joins them instead of launching its own.
Each rank reports through ``write_result``; a rank that fails or hangs fails the test with its
output (a hung one with every thread's stack).
"""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import warnings
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import torch.distributed as dist

REPO = Path(__file__).resolve().parent.parent
RESULT_DIR_ENV = "LL_TEST_RESULT_DIR"
TEARDOWN_ABORT = "terminate called without an active exception"


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def run_ddp(script: str | Path, args: list[str], result_dir: Path, world_size: int = 2,
            timeout: float = 300) -> list[Any]:
    """Run ``python script *args`` as ``world_size`` ranks; returns each rank's result.

    A run whose only failure is torch's own abort as a rank's interpreter exits, after the rank
    reported and closed its process group (``TEARDOWN_ABORT``, seen once in more than a
    thousand rank exits), is run again once, with a warning."""
    result_dir.mkdir(parents=True, exist_ok=True)
    for attempt in range(2):
        for stale in result_dir.glob("rank*.json"):
            stale.unlink()
        procs, outputs = _launch(script, args, result_dir, world_size, timeout)
        failed = {rank: f"rank {rank} exited with {proc.returncode}:\n{output[-6000:]}"
                  for rank, (proc, output) in enumerate(zip(procs, outputs, strict=True))
                  if proc.returncode != 0}
        torn_down = all(procs[rank].returncode == -signal.SIGABRT and TEARDOWN_ABORT in why
                        and (result_dir / f"rank{rank}.json").exists()
                        for rank, why in failed.items())
        if not failed or not torn_down or attempt:
            break
        warnings.warn(f"{script}: run again after torch aborted at a rank's exit, past its "
                      f"result:\n" + "\n\n".join(failed.values()), stacklevel=2)
    assert not failed, "\n\n".join(failed.values())
    return [json.loads((result_dir / f"rank{r}.json").read_text()) for r in range(world_size)]


def _launch(script: str | Path, args: list[str], result_dir: Path, world_size: int,
            timeout: float) -> tuple[list[subprocess.Popen[str]], list[str]]:
    """Start the ranks and wait for them (a hung one is aborted: ``_stacks_of_hung``)."""
    port = free_port()
    procs = []
    for rank in range(world_size):
        env = {**os.environ, "MASTER_ADDR": "127.0.0.1", "MASTER_PORT": str(port),
               "RANK": str(rank), "LOCAL_RANK": str(rank), "WORLD_SIZE": str(world_size),
               "NODE_RANK": "0", RESULT_DIR_ENV: str(result_dir),
               "PYTHONFAULTHANDLER": "1",
               "PYTHONPATH": os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")])}
        procs.append(subprocess.Popen([sys.executable, str(script), *args], env=env, cwd=REPO,
                                      stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True))
    deadline = time.monotonic() + timeout
    outputs = []
    try:
        for proc in procs:
            try:
                outputs.append(proc.communicate(timeout=max(deadline - time.monotonic(), 1))[0])
            except subprocess.TimeoutExpired:
                outputs.append(_stacks_of_hung(proc))
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    return procs, outputs


def _stacks_of_hung(proc: subprocess.Popen) -> str:
    """A rank past the deadline: abort it, so ``PYTHONFAULTHANDLER`` prints every thread's
    stack into its output, and return that output (the test then fails with it)."""
    proc.send_signal(signal.SIGABRT)
    try:
        output = proc.communicate(timeout=30)[0]
    except subprocess.TimeoutExpired:
        proc.kill()
        output = proc.communicate()[0]
    return f"{output}\n(hung: aborted after the deadline)"


def through_lightning(loader: Any) -> Iterator[Any]:
    """One epoch of ``loader``'s batches read as Lightning's loops read them: its data fetcher
    over a ``CombinedLoader``, on the calling thread (the loaders' ranks compare their plans
    only there, where every rank's loop runs alike)."""
    from lightning.pytorch.loops.fetchers import _PrefetchDataFetcher
    from lightning.pytorch.utilities import CombinedLoader

    fetcher = _PrefetchDataFetcher()
    fetcher.setup(CombinedLoader(loader))
    return (batch for batch, _, _ in fetcher)


def write_result(result: Any) -> None:
    """Called at the end of a rank: wait for the other ranks and close the process group (a
    rank that exits with gloo's threads still running can abort: ``TEARDOWN_ABORT``), then
    report ``result`` (JSON-serialisable) to the launching test."""
    rank = int(os.environ.get("RANK", 0))
    if dist.is_available() and dist.is_initialized():
        dist.barrier()
        dist.destroy_process_group()
    (Path(os.environ[RESULT_DIR_ENV]) / f"rank{rank}.json").write_text(json.dumps(result))
