"""Real Lightning ``Fabric`` training loops that record what every step saw.

The loop is the one the README shows: the loader sits in the state that ``fabric.save``
writes, each epoch is declared with ``loader.set_epoch`` (the ``DistributedSampler`` idiom),
and batches are moved with ``fabric.to_device``. ``fabric_recording`` saves a checkpoint after
every step when asked, and resumes from one with ``fabric.load``.
"""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

import lightning as L
import torch

from tests.lightning_harness import default_key

Step = tuple[int, Any]


def fabric_recording(fabric: L.Fabric, make_loader: Callable[[], Any], epochs: int,
                     ckpt_dir: Path | None = None, resume: Path | None = None) -> list[Step]:
    """Train a one-parameter model for ``epochs`` over ``make_loader()``; returns
    ``(epoch, batch key)`` per step. With ``ckpt_dir``, ``step{n}.ckpt`` is written after
    step ``n`` (counted from 1 over the whole run); with ``resume``, the run starts from it."""
    model = torch.nn.Linear(4, 1)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.01)
    model, optimizer = fabric.setup(model, optimizer)
    loader = make_loader()
    state: dict[str, Any] = {"model": model, "optimizer": optimizer, "loader": loader,
                             "epoch": 0, "step": 0}
    if resume is not None:
        fabric.load(resume, state)
    seen: list[Step] = []
    for epoch in range(state["epoch"], epochs):
        state["epoch"] = epoch
        loader.set_epoch(epoch)
        for batch in loader:
            batch = fabric.to_device(batch)
            fabric.backward(model(batch["x"]).pow(2).mean())
            optimizer.step()
            optimizer.zero_grad()
            seen.append((epoch, default_key(batch)))
            state["step"] += 1
            if ckpt_dir is not None:
                fabric.save(ckpt_dir / f"step{state['step']}.ckpt", state)
    return seen
