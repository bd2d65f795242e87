"""``sole_reader()`` shared by threads: one view while any thread is inside, undone by the
last to leave, so concurrent readers never leave the environment changed."""

from __future__ import annotations

import os
import threading

import pytest
from torch.utils.data import get_worker_info

from lightning_loaders.sources.plain import sole_reader


def test_threads_inside_at_once_share_one_view_and_the_last_restores(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("RANK", "3")
    monkeypatch.setenv("WORLD_SIZE", "4")
    monkeypatch.delenv("WORKER", raising=False)
    seen: list[tuple[str | None, str | None, bool]] = []
    lock = threading.Lock()
    start = threading.Barrier(8)

    def read() -> None:
        start.wait()
        for _ in range(300):
            with sole_reader():
                with lock:
                    seen.append((os.environ.get("RANK"), os.environ.get("WORLD_SIZE"),
                                 get_worker_info() is None))

    readers = [threading.Thread(target=read) for _ in range(8)]
    for reader in readers:
        reader.start()
    for reader in readers:
        reader.join()
    assert set(seen) == {("0", "1", True)}
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("3", "4")
    assert "WORKER" not in os.environ


def test_a_nested_view_restores_only_when_the_outer_one_ends(
        monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("RANK", raising=False)
    with sole_reader():
        with sole_reader():
            assert os.environ["RANK"] == "0"
        assert os.environ["RANK"] == "0"
    assert "RANK" not in os.environ
