"""Shared fixtures: small generated datasets."""

from __future__ import annotations

import pytest
import torch


class IndexDataset(torch.utils.data.Dataset[dict[str, torch.Tensor]]):
    """Sample ``i`` is ``{"index": i, "x": features}``: batches say which samples they hold."""

    def __init__(self, n: int, features: int = 4) -> None:
        self.n = n
        self.features = features

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, torch.Tensor]:
        x = torch.arange(self.features, dtype=torch.float32) + index
        return {"index": torch.tensor(index), "x": x}


@pytest.fixture
def index_dataset() -> IndexDataset:
    return IndexDataset(23)
