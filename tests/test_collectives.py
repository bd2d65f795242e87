"""Collectives answer for this process alone without a process group (the DDP tests cover
them with one)."""

from lightning_loaders.collectives import all_gather, gather_by_rank, group_size


def test_without_a_process_group_each_collective_answers_for_this_process() -> None:
    assert group_size() == 1
    assert all_gather({"x": 1}) == [{"x": 1}]
    assert gather_by_rank("mine", rank=1, world_size=3) == [None, "mine", None]
