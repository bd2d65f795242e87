"""A slot's reader checks the shards against their declared lengths, the empty ones too."""

from collections.abc import Iterator

import pytest

from lightning_loaders import GeneratorSource, ResumableLoader
from lightning_loaders.errors import SampleFetchError
from lightning_loaders.testing import check_resume_at_every_step, run_epochs

SHARDS = [(0, 3), (3, 3), (3, 7), (7, 7)]  # 3, 0, 4 and 0 samples
TRUE = [3, 0, 4, 0]


def _ranges(shard: tuple[int, int]) -> Iterator[int]:
    yield from range(*shard)


def _loader(shards: list[tuple[int, int]], lengths: list[int] | None, workers: int,
            shuffle: bool, policy: str = "keep") -> ResumableLoader:
    return ResumableLoader(GeneratorSource(_ranges, shards, lengths=lengths), batch_size=2,
                           num_workers=workers, shuffle=shuffle, shuffle_buffer=3 * shuffle,
                           seed=2, last_batch=policy, collate_fn=list)


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("liar", [1, 3])
def test_a_shard_declared_empty_that_is_not_is_refused(workers, shuffle, liar) -> None:
    """Its samples were dropped in silence (no piece of the plan read it), wherever the
    shard stands in the order; really empty shards and unknown lengths still read all."""
    for lengths in (TRUE, None):
        loader = _loader(SHARDS, lengths, workers, shuffle)
        for batches in run_epochs(loader, range(2), key=tuple):
            assert sorted(i for batch in batches for i in batch) == list(range(7))
        loader.close()
    shards = list(SHARDS)
    shards[liar] = (10, 12)
    for policy in ("keep", "drop", "pad", "rollover"):
        loader = _loader(shards, TRUE, workers, shuffle, policy)
        # every epoch; under rollover, every pass over the shards (it may end in the next epoch)
        for epochs in ([0, 1],) if policy == "rollover" else ([0], [1]):
            with pytest.raises(SampleFetchError, match=rf"shard {liar} goes on past its "
                                                       r"declared length \(0\).*shard_lengths"):
                run_epochs(loader, epochs)
        loader.close()


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resumed_epoch_checks_the_shards_declared_empty_ahead(workers) -> None:
    check_resume_at_every_step(lambda: _loader(SHARDS, TRUE, workers, True), 2, key=tuple)
    shards = [(0, 4), (10, 12), (4, 8)]  # shard 1 is declared empty
    loader = _loader(shards, [4, 0, 4], workers, False)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    loader.close()
    resumed = _loader(shards, [4, 0, 4], workers, False)
    resumed.load_state_dict(state)
    with pytest.raises(SampleFetchError, match=r"shard 1 goes on past its declared length"):
        list(resumed)
    resumed.close()
