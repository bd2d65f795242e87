"""Requests cross to worker processes pickled; a ``BatchRequest`` pickles its arrays as raw
bytes, and comes back equal: the same fields, dtypes and shapes, its arrays writable."""

from __future__ import annotations

import copy
import pickle
from multiprocessing.reduction import ForkingPickler

import numpy as np
import pytest

from lightning_loaders.schedule.requests import BatchRequest


@pytest.mark.parametrize("dumps", [pickle.dumps, ForkingPickler.dumps, copy.deepcopy],
                         ids=["pickle", "ForkingPickler", "deepcopy"])
def test_a_batch_request_comes_back_equal_with_writable_arrays(dumps: object) -> None:
    indices = np.arange(40, dtype=np.int64)[::-3]  # a view with a stride
    request = BatchRequest(2, 7, 1, np.full(14, 2, dtype=np.int32), np.arange(14, dtype=np.uint16),
                           indices)
    made = dumps(request)  # type: ignore[operator]
    back = made if isinstance(made, BatchRequest) else pickle.loads(made)
    assert type(back) is BatchRequest
    assert back[:3] == (2, 7, 1)
    for got, sent in zip(back[3:], request[3:], strict=True):
        assert got.dtype == sent.dtype and got.shape == sent.shape
        assert np.array_equal(got, sent)
        assert got.flags.writeable
    back.indices[0] = -1  # its own copy
    assert request.indices[0] == 39
