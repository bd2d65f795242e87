"""Training processes for the chaos and shutdown tests, forked from a warm zygote.

``python tests/scripts/chaos_train.py`` imports torch and Lightning once, then serves JSON
requests read from stdin: each forks a child process that runs one training (``run``) in its
own process group, and is answered with ``{"pid": ...}`` when the child starts and
``{"pid": ..., "status": ...}`` (``-N`` when killed by signal ``N``) when it ends. Tests kill
children at will (the zygote reaps them); a fork costs milliseconds where a fresh interpreter
would import Lightning again for seconds.

A child appends one JSON line per training step to ``request["log"]`` (flushed at once, so it
survives a SIGKILL): ``{"step", "epoch", "batch_idx", "ids", "t"}`` with ``ids`` the batch's
sample ids and ``t`` the ``time.monotonic()`` of the step (the same clock in every process).
With ``"trainer": true`` (the default) it runs ``Trainer.fit`` (``max_epochs=epochs``,
optionally ``max_steps``) with a checkpoint after every step and resumes from
``<out>/last.ckpt`` when there is one; otherwise it runs a plain loop over the loader. With
``"hold_at": s`` it stops at step ``s`` (once logged) until it is killed: a test that means to
kill it near a step cannot be outrun by a fast child or a busy machine. With ``"pause_at": s``
it stops at step ``s`` (once logged) until the file ``<log>.go`` exists: a test can act while
the loader's batches in flight are a known few (a worker killed then still owes batches).
``CONFIGURATIONS`` lists what it can train on (``"kind"``).

``TrainingZygote`` is the tests' side (importing this module does not import Lightning).
"""

from __future__ import annotations

import json
import os
import queue
import subprocess
import sys
import threading
import time
import traceback
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parents[2]
MAP_SIZE, MAP_BATCH = 96, 4
SHARD_SIZE = 16
SLOW_EVERY, SLOW_SECONDS = 8, 0.04  # ``out_of_order``: every 8th sample costs 40 ms


# -- the tests' side ----------------------------------------------------------------------


class TrainingZygote:
    """A zygote process; ``start(**request)`` forks a training child and returns its pid."""

    def __init__(self) -> None:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            [str(REPO), os.environ.get("PYTHONPATH", "")])}
        self._proc = subprocess.Popen([sys.executable, __file__], cwd=REPO, env=env,
                                      stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True,
                                      bufsize=1)
        self._replies: queue.Queue[dict[str, Any]] = queue.Queue()
        self._exits: dict[int, int] = {}
        threading.Thread(target=self._read, daemon=True).start()
        self._expect("ready", timeout=240)

    def start(self, **request: Any) -> int:
        """Fork a child running ``run(request)``; its pid."""
        assert self._proc.stdin is not None
        self._proc.stdin.write(json.dumps(request) + "\n")
        self._proc.stdin.flush()
        return int(self._expect("pid", timeout=60)["pid"])

    def wait(self, pid: int, timeout: float = 300) -> int:
        """The child's exit status (``-N`` when killed by signal ``N``)."""
        deadline = time.monotonic() + timeout
        while pid not in self._exits:
            self._expect("status", timeout=max(0.0, deadline - time.monotonic()))
        return self._exits.pop(pid)

    def close(self) -> None:
        if self._proc.stdin is not None:
            self._proc.stdin.close()
        try:
            self._proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()

    def _read(self) -> None:
        assert self._proc.stdout is not None
        for line in self._proc.stdout:
            self._replies.put(json.loads(line))
        self._replies.put({"eof": True})

    def _expect(self, key: str, timeout: float) -> dict[str, Any]:
        while True:
            try:
                reply = self._replies.get(timeout=timeout)
            except queue.Empty:
                raise TimeoutError(f"the training zygote sent no {key!r} in {timeout} s") from None
            if "eof" in reply:
                raise RuntimeError(f"the training zygote exited ({self._proc.poll()})")
            if "status" in reply:
                self._exits[int(reply["pid"])] = int(reply["status"])
            if key in reply:
                return reply


def read_log(path: Path) -> list[dict[str, Any]]:
    """The complete lines of a child's step log (a line cut by SIGKILL is not a step)."""
    if not path.exists():
        return []
    return [json.loads(line) for line in path.read_text().splitlines(keepends=True)
            if line.endswith("\n")]


# -- the zygote and its children -----------------------------------------------------------


def serve() -> None:
    import lightning  # noqa: F401  (imported once here, inherited by every child)

    import lightning_loaders  # noqa: F401

    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        request = json.loads(line)
        pid = os.fork()
        if pid == 0:
            os._exit(_child(request))
        print(json.dumps({"pid": pid}), flush=True)
        _, status = os.waitpid(pid, 0)
        print(json.dumps({"pid": pid, "status": os.waitstatus_to_exitcode(status)}), flush=True)


def _child(request: dict[str, Any]) -> int:
    os.setpgid(0, 0)  # a process group of its own: a Ctrl-C (SIGINT to the group) hits only it
    out = Path(request["out"])
    out.mkdir(parents=True, exist_ok=True)
    with open(out / f"output-{os.getpid()}.txt", "w") as sink:
        os.dup2(sink.fileno(), 1)
        os.dup2(sink.fileno(), 2)
    sys.stdin.close()
    try:
        run(request)
    except SystemExit as exc:  # Lightning exits with 1 after a KeyboardInterrupt
        return exc.code if isinstance(exc.code, int) else 1
    except BaseException:
        traceback.print_exc()
        return 1
    finally:
        sys.stdout.flush()
        sys.stderr.flush()
    return 0


CONFIGURATIONS = ("map", "iterable", "out_of_order")
"""What a child can train on: ``map``, a shuffled map-style ``ResumableLoader``; ``iterable``, a
sharded iterable source (shuffled shards and a shuffle buffer); ``out_of_order``, a shuffled
map-style ``ResumableLoader(in_order=False)`` over ``UnevenCost`` samples, whose batches arrive
as the workers finish them; all with worker processes."""

ORDERED = ("map", "iterable")
"""The configurations whose batches arrive in plan order (the others: any order)."""


class UnevenCost:
    """A map-style dataset of ``n`` samples (sample ``i`` is ``i``) fetched one by one, every
    ``SLOW_EVERY``-th costing ``SLOW_SECONDS``: batches holding one finish after later ones."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> int:
        if index % SLOW_EVERY == 0:
            time.sleep(SLOW_SECONDS)
        return index


def make_loader(kind: str, num_workers: int) -> Any:
    """The training loader of a configuration."""
    from lightning_loaders import ResumableLoader
    from tests.conftest import IndexDataset

    if kind == "map":
        return ResumableLoader(IndexDataset(MAP_SIZE), batch_size=MAP_BATCH, shuffle=True,
                               seed=7, num_workers=num_workers)
    if kind == "iterable":
        from lightning_loaders.sources.shards import SequenceSource

        shards = [list(range(s, s + SHARD_SIZE)) for s in range(0, MAP_SIZE, SHARD_SIZE)]
        return ResumableLoader(SequenceSource(shards), batch_size=MAP_BATCH, shuffle=True,
                               seed=7, num_workers=num_workers, shuffle_buffer=8)
    if kind == "out_of_order":
        return ResumableLoader(UnevenCost(MAP_SIZE), batch_size=MAP_BATCH, shuffle=True, seed=7,
                               num_workers=num_workers, in_order=False)
    raise ValueError(f"unknown chaos configuration {kind!r}: use one of {CONFIGURATIONS}")


def batch_ids(batch: Any) -> list[int]:
    if isinstance(batch, dict):
        return [int(i) for i in batch["index"].tolist()]
    return [int(i) for i in batch.tolist()]


def run(request: dict[str, Any]) -> None:
    """One training process (see the module docstring)."""
    out, log_path = Path(request["out"]), Path(request["log"])
    kind, num_workers = request.get("kind", "map"), int(request.get("num_workers", 2))
    epochs, step_sleep = int(request["epochs"]), float(request.get("step_sleep", 0.0))
    max_steps = int(request.get("max_steps", -1))
    hold_at, pause_at = request.get("hold_at"), request.get("pause_at")
    go = Path(f"{log_path}.go")
    with open(log_path, "a") as log:

        def record(step: int, epoch: int, batch_idx: int, batch: Any) -> None:
            log.write(json.dumps({"step": step, "epoch": epoch, "batch_idx": batch_idx,
                                  "ids": batch_ids(batch), "t": time.monotonic()}) + "\n")
            log.flush()
            if step_sleep:
                time.sleep(step_sleep)
            if hold_at is not None and step >= hold_at:
                threading.Event().wait()
            while step == pause_at and not go.exists():
                time.sleep(0.005)

        if request.get("trainer", True):
            _fit(out, make_loader(kind, num_workers), epochs, max_steps, record)
            return
        loader = make_loader(kind, num_workers)
        step = 0
        for epoch in range(epochs):
            loader.sampler.set_epoch(epoch)
            for batch_idx, batch in enumerate(loader):
                record(step, epoch, batch_idx, batch)
                step += 1


def _fit(out: Path, loader: Any, epochs: int, max_steps: int, record: Any) -> None:
    import lightning as L
    import torch
    from lightning.pytorch.callbacks import ModelCheckpoint

    class Model(L.LightningModule):
        def __init__(self) -> None:
            super().__init__()
            self.weight = torch.nn.Parameter(torch.zeros(1))

        def training_step(self, batch: Any, batch_idx: int) -> torch.Tensor:
            record(self.global_step, self.current_epoch, batch_idx, batch)
            return (self.weight - 1.0).pow(2).sum()

        def configure_optimizers(self) -> torch.optim.Optimizer:
            return torch.optim.SGD(self.parameters(), lr=0.1)

    checkpoint = ModelCheckpoint(dirpath=out, every_n_train_steps=1, save_last=True,
                                 save_top_k=0)
    trainer = L.Trainer(max_epochs=epochs, max_steps=max_steps, accelerator="cpu", devices=1,
                        logger=False, enable_progress_bar=False, enable_model_summary=False,
                        num_sanity_val_steps=0, default_root_dir=out, callbacks=[checkpoint])
    last = out / "last.ckpt"
    trainer.fit(Model(), loader, ckpt_path=last if last.exists() else None)


if __name__ == "__main__":
    serve()
