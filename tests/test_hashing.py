from hypothesis import given
from hypothesis import strategies as st

from lightning_loaders.hashing import mix64, mix64_after, seed32

words = st.lists(st.integers(-(2**70), 2**70), max_size=5)


@given(words, words)
def test_mix64_after_continues_a_hashed_prefix(prefix: list[int], rest: list[int]) -> None:
    assert mix64_after(mix64(*prefix), *rest) == mix64(*prefix, *rest)


@given(words)
def test_hashes_fit_their_widths(values: list[int]) -> None:
    assert 0 <= mix64(*values) < 2**64
    assert 0 <= seed32(*values) < 2**32


def test_every_value_and_its_place_matter() -> None:
    hashes = {mix64(), mix64(0), mix64(1), mix64(0, 1), mix64(1, 0), mix64(0, 0)}
    assert len(hashes) == 6
