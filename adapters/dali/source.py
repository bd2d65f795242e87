"""External-source mode of ``DALILoader``: the per-sample callback through which DALI reads the
samples the global plan assigns to this rank, batch by batch."""

from __future__ import annotations

import copy
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np

from lightning_loaders.context import set_samples
from lightning_loaders.errors import fetch_error
from lightning_loaders.schedule.map_schedule import MapSchedule

__all__ = [
    "FileSamples",
    "PlannedSource",
    "batch_sizes",
]


class FileSamples:
    """Files as samples for external-source mode: ``(encoded bytes as uint8, label as int64)``.

    Feed the bytes to a DALI decoder (``fn.decoders.image``); labels default to the file index.
    """

    def __init__(self, paths: Sequence[str | Path], labels: Sequence[int] | None = None) -> None:
        if labels is not None and len(labels) != len(paths):
            raise ValueError(f"got {len(paths)} paths but {len(labels)} labels")
        self.paths = [str(p) for p in paths]
        self.labels = list(range(len(paths))) if labels is None else [int(x) for x in labels]

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> tuple[np.ndarray, np.ndarray]:
        data = np.fromfile(self.paths[index], dtype=np.uint8)
        return data, np.array(self.labels[index], dtype=np.int64)


class PlannedSource:
    """The per-sample ``external_source`` callback: DALI's iteration -> our plan's sample.

    Iteration ``first_iteration`` is the schedule's cursor when the pipeline was built; later
    iterations walk on through the rest of that epoch and then through whole epochs. A batch
    shorter than ``batch_size`` (the last, under ``keep``) is padded with its last sample and
    trimmed by the loader. It holds no mutable state the loader shares: it runs in worker
    processes, and it must give the same sample for the same iteration whenever it is asked.
    """

    def __init__(self, dataset: Any, schedule: MapSchedule, first_iteration: int) -> None:
        assert schedule.plan is not None and schedule.epoch is not None
        self.dataset = dataset
        self.schedule = copy.copy(schedule)
        self.rank, self.world_size = schedule.placement
        self.first_iteration = first_iteration
        self.epoch = schedule.epoch
        self.plan = schedule.plan
        self.first_batch = schedule.plan.num_batches - schedule.remaining
        self.batch_offset = schedule.batches - self.first_batch
        self.epoch_len = schedule.plan_for(schedule.epoch + 1, self.world_size).num_batches
        self.seed = schedule.seed
        self._last: tuple[int, int, int, list[int], list[int]] | None = None

    def __call__(self, info: Any) -> Any:
        try:
            slot = info.idx_in_batch
        except AttributeError:
            raise TypeError("DALILoader's source gives one sample per call: use "
                            "fn.external_source(source=source, batch=False, parallel=True)"
                            ) from None
        epoch, batch, positions, indices = self._request(info.iteration - self.first_iteration)
        k = min(slot, len(indices) - 1)
        index, position = indices[k], positions[k]
        set_samples((self.seed, self.rank, (epoch,), (position,), (index,)))
        try:
            return self.dataset[index]
        except Exception as exc:
            raise fetch_error(exc, f"sample index {index} (epoch position {position}, batch "
                                   f"{batch})", epoch=epoch, batch=batch, rank=self.rank,
                              index=index, position=position,
                              where="DALI's external source") from exc
        finally:
            set_samples(None)

    def _request(self, step: int) -> tuple[int, int, list[int], list[int]]:
        """``(epoch, batch, positions, indices)`` of the ``step``-th batch from the cursor."""
        last = self._last
        if last is not None and last[0] == step:
            return last[1], last[2], last[3], last[4]
        rest = self.plan.num_batches - self.first_batch
        if step < rest:
            epoch, plan, plan_batch = self.epoch, self.plan, self.first_batch + step
            batch = self.batch_offset + plan_batch
        else:
            ahead, plan_batch = divmod(step - rest, self.epoch_len)
            epoch = self.epoch + 1 + ahead
            plan, batch = self.schedule.plan_for(epoch, self.world_size), plan_batch
        positions = plan.positions(plan_batch, self.rank)
        indices = self.schedule.order.indices(epoch, positions).tolist()
        self._last = (step, epoch, batch, positions.tolist(), indices)
        return epoch, batch, self._last[3], indices


def batch_sizes(schedule: MapSchedule) -> Iterator[int]:
    """This rank's sizes of the current epoch's remaining batches (the plan's, no indices:
    only the trim of a short batch needs them)."""
    plan, rank = schedule.plan, schedule.placement[0]
    assert plan is not None
    for batch in range(plan.num_batches - schedule.remaining, plan.num_batches):
        yield len(plan.positions(batch, rank))
