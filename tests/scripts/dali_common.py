"""Shared by the DALI tests and their DDP rank script: JPEG files, pipelines, loaders.

The pipelines decode, crop at a random position, randomly mirror and normalise, so a batch's
pixel checksum changes if a resumed run restores the random operators' state wrongly.
"""

from __future__ import annotations

import functools
from pathlib import Path
from typing import Any

import numpy as np
from nvidia.dali import fn, pipeline_def
from nvidia.dali.types import DALIDataType as DType
from PIL import Image

from lightning_loaders.adapters.dali import DALILoader, FileSamples

SIDE = 32
CROP = 16


def write_jpegs(directory: Path, n: int) -> list[str]:
    """``n`` random-noise JPEG files of ``SIDE`` x ``SIDE`` pixels; file ``i`` has label ``i``."""
    directory.mkdir(parents=True, exist_ok=True)
    paths = []
    for i in range(n):
        pixels = np.random.default_rng(i).integers(0, 256, (SIDE, SIDE, 3), dtype=np.uint8)
        path = directory / f"{i:04d}.jpg"
        Image.fromarray(pixels).save(path, quality=90)
        paths.append(str(path))
    return paths


def augment(images: Any, device: str) -> Any:
    """Decode (on the GPU when there is one), random crop position, random mirror, normalise."""
    images = fn.decoders.image(images, device="mixed" if device == "gpu" else "cpu")
    return fn.crop_mirror_normalize(
        images, crop=(CROP, CROP), crop_pos_x=fn.random.uniform(range=(0.0, 1.0)),
        crop_pos_y=fn.random.uniform(range=(0.0, 1.0)), mirror=fn.random.coin_flip(),
        mean=[128.0] * 3, std=[64.0] * 3, dtype=DType.FLOAT)


def read_files(files: list[str], shard_id: int, num_shards: int, device: str,
               pad: bool = True) -> Any:
    """The graph of ``reader_pipeline``: a sharded, padded, shuffling file reader."""
    jpegs, labels = fn.readers.file(files=files, labels=list(range(len(files))),
                                    shard_id=shard_id, num_shards=num_shards,
                                    random_shuffle=True, initial_fill=len(files),
                                    pad_last_batch=pad, name="Reader")
    return augment(jpegs, device), labels


def read_source(source: Any, device: str) -> Any:
    """The graph of ``source_pipeline``: samples from the loader's per-sample source."""
    jpegs, labels = fn.external_source(source=source, num_outputs=2, batch=False, parallel=True,
                                       dtype=[DType.UINT8, DType.INT64])
    return augment(jpegs, device), labels


reader_pipeline = pipeline_def(read_files)
source_pipeline = pipeline_def(read_source)


def make_loader(mode: str, files: list[str], batch_size: int = 6, **kwargs: Any) -> DALILoader:
    """A loader over ``files`` in ``"reader"`` or ``"source"`` (external-source) mode."""
    kwargs = {"num_threads": 1, "seed": 7, **kwargs}
    if mode == "reader":
        return DALILoader(functools.partial(reader_pipeline, files=files), ["x", "y"],
                          batch_size=batch_size, reader_name="Reader", **kwargs)
    return DALILoader(source_pipeline, ["x", "y"], batch_size=batch_size,
                      dataset=FileSamples(files), shuffle=True, **kwargs)


def key(batch: Any) -> list[Any]:
    """What a batch holds: its labels and a pixel checksum (from a dict or a tuple batch)."""
    x, y = (batch["x"], batch["y"]) if isinstance(batch, dict) else batch
    return [y.flatten().tolist(), round(float(x.double().sum()), 3)]
