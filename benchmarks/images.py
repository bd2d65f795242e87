"""Synthetic photos for the image benchmarks: smooth colour gradients plus noise, which
compress and decode like real photographs (a flat or random image would not)."""

from __future__ import annotations

from pathlib import Path

import numpy as np

__all__ = ["synthetic_image", "write_jpegs"]


def synthetic_image(index: int, side: int) -> np.ndarray:
    """Image ``index`` (the same on every call): ``side`` x ``side`` x 3 uint8."""
    rng = np.random.default_rng(index)
    ramp = np.linspace(0, 255, side, dtype=np.float32)
    base = ramp[None, :, None] * rng.uniform(0.2, 1.0, 3) + ramp[:, None, None] * 0.3
    return np.clip(base + rng.normal(0, 12, (side, side, 3)), 0, 255).astype(np.uint8)


def write_jpegs(directory: Path, count: int, side: int) -> list[str]:
    """``count`` JPEG files (quality 90) of ``synthetic_image``; their paths, in order."""
    from PIL import Image

    paths = []
    for i in range(count):
        path = directory / f"{i:06d}.jpg"
        Image.fromarray(synthetic_image(i, side)).save(path, quality=90)
        paths.append(str(path))
    return paths
