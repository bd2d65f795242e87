"""Workload 3: JPEG decoding from files (generated 256 x 256 RGB images), batch 32, 2 workers."""

from __future__ import annotations

import tempfile
from pathlib import Path

import numpy as np
import torch
from torch.utils.data import Dataset

from benchmarks.common import (
    Plot,
    Report,
    Settings,
    compare_throughput,
    standalone,
    throughput_columns,
    throughput_note,
    throughput_series,
)
from benchmarks.images import write_jpegs

__all__ = ["JpegFiles", "run"]

BATCH_SIZE = 32
SIDE = 256


class JpegFiles(Dataset[torch.Tensor]):
    """Decodes file ``i`` with Pillow into a CHW uint8 tensor."""

    def __init__(self, paths: list[str]) -> None:
        self.paths = paths

    def __len__(self) -> int:
        return len(self.paths)

    def __getitem__(self, index: int) -> torch.Tensor:
        from PIL import Image

        with Image.open(self.paths[index]) as image:
            pixels = np.array(image.convert("RGB"))
        return torch.from_numpy(pixels).permute(2, 0, 1)


def run(settings: Settings) -> Report:
    count = settings.pick(384, 1024)  # at least warm-up + timed batches in one epoch
    batches = settings.pick(5, 12)
    with tempfile.TemporaryDirectory(prefix="ll-bench-jpeg-") as directory:
        dataset = JpegFiles(write_jpegs(Path(directory), count, SIDE))
        configs = {"num_workers=2": {"batch_size": BATCH_SIZE, "shuffle": True,
                                     "num_workers": 2}}
        rows = compare_throughput(dataset, configs, batches, settings, "jpeg")
    return Report(
        name="jpeg",
        title=f"3. JPEG decoding from {count:,} files ({SIDE}x{SIDE} RGB, Pillow), batch "
              f"{BATCH_SIZE}: samples/s",
        columns=throughput_columns(),
        rows=rows,
        notes=(throughput_note(batches, settings),),
        plot=Plot("config", throughput_series(), "samples/s"),
    )


if __name__ == "__main__":
    raise SystemExit(standalone(run, __doc__.splitlines()[0], {}))
