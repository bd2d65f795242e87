"""write_beton: real .beton files written by FFCV's writer processes, read back by FFCV."""

from __future__ import annotations

import multiprocessing
import os
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

pytest.importorskip("ffcv")

from ffcv.fields import RGBImageField  # noqa: E402
from ffcv.loader import Loader, OrderOption  # noqa: E402

from lightning_loaders.adapters.ffcv.beton import BetonWriteError, infer_fields, write_beton  # noqa: E402


class _Mixed:
    """Sample ``i``: an image, an int, a float and a small float32 array, all from ``i``."""

    def __init__(self, n: int, broken: int | None = None, short: int | None = None) -> None:
        self.n, self.broken, self.short = n, broken, short

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> tuple[Any, ...]:
        if index == self.broken:
            raise KeyError(f"no sample {index}")
        image = np.full((8, 8, 3), index, dtype=np.uint8)
        values = (image, torch.tensor(index), index / 2, np.arange(3, dtype=np.float32) + index)
        return values[:2] if index == self.short else values


def _shm() -> set[str]:
    return set(os.listdir("/dev/shm")) if os.path.isdir("/dev/shm") else set()


def test_inferred_fields_round_trip_through_ffcv(tmp_path: Path,
                                                 capsys: pytest.CaptureFixture[str]) -> None:
    path = write_beton(tmp_path / "mixed.beton", _Mixed(21),
                       ["image", "label", "weight", "vector"], num_workers=2, chunk_size=4)
    assert "writing mixed.beton" in capsys.readouterr().err, "a progress bar is shown"
    loader = Loader(str(path), batch_size=8, num_workers=1, order=OrderOption.SEQUENTIAL,
                    drop_last=False)
    rows = [[np.asarray(v) for v in batch] for batch in loader]
    images, labels, weights, vectors = (np.concatenate(col) for col in zip(*rows, strict=True))
    index = np.arange(21)
    assert np.array_equal(images[:, 0, 0, 0], index) and images.shape == (21, 8, 8, 3)
    assert np.array_equal(labels.ravel(), index)
    assert np.allclose(weights.ravel(), index / 2)
    assert np.allclose(vectors, np.arange(3)[None, :] + index[:, None])


def test_explicit_fields_and_a_single_value_dataset(tmp_path: Path) -> None:
    images = [np.full((8, 8, 3), i * 10, dtype=np.uint8) for i in range(5)]
    path = write_beton(tmp_path / "jpg.beton", images,
                       {"image": RGBImageField(write_mode="jpg", jpeg_quality=95)},
                       num_workers=1, progress=False)
    loader = Loader(str(path), batch_size=5, num_workers=1, order=OrderOption.SEQUENTIAL)
    (decoded,) = next(iter(loader))
    assert np.abs(np.asarray(decoded, dtype=int)[:, 4, 4, 0] - np.arange(5) * 10).max() <= 3


@pytest.mark.parametrize(("dataset", "message"), [
    (_Mixed(30, broken=17), r"sample 17: KeyError: .no sample 17"),
    (_Mixed(30, short=9), r"sample 9 is 2 values, but the fields are \['image', 'label'"),
])
def test_a_failing_sample_raises_and_leaves_nothing_behind(tmp_path: Path, dataset: _Mixed,
                                                           message: str) -> None:
    before = _shm()
    fields = infer_fields(_Mixed(1)[0], ["image", "label", "weight", "vector"])
    path = tmp_path / "broken.beton"
    with pytest.raises(BetonWriteError, match=message):
        write_beton(path, dataset, fields, num_workers=2, chunk_size=5, progress=False)
    assert not path.exists(), "the partial file is removed"
    assert multiprocessing.active_children() == []
    assert _shm() - before == set(), "no shared-memory segment outlives the writer"


def test_bad_input_is_refused_clearly(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="empty"):
        write_beton(tmp_path / "e.beton", [], ["x"])
    with pytest.raises(FileNotFoundError, match="no directory"):
        write_beton(tmp_path / "missing" / "x.beton", _Mixed(3), ["a", "b", "c", "d"])
    with pytest.raises(TypeError, match="'name'.*str"):
        infer_fields(("text",), ["name"])
    with pytest.raises(ValueError, match="2 field names"):
        infer_fields((1, 2, 3), ["a", "b"])
