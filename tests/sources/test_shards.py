import itertools
import pickle
import random
from collections import Counter
from collections.abc import Iterator, Mapping
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch

from lightning_loaders import ResumableLoader, StateMismatchError
from lightning_loaders.sources.shards import (
    GeneratorSource,
    LineFiles,
    RecordFiles,
    SequenceSource,
    ShardedSource,
    count_records,
    write_records,
)
from lightning_loaders.testing import check_resume_at_every_step, run_epochs


def _records(tmp_path: Path, lengths: list[int]) -> list[Path]:
    paths = []
    for shard, n in enumerate(lengths):
        path = tmp_path / f"part{shard}.rec"
        # Payloads of varying size, so byte offsets are not a multiple of the record count.
        write_records(path, [f"{shard}:{i}:{'x' * (i % 5)}".encode() for i in range(n)])
        paths.append(path)
    return paths


def _lines(tmp_path: Path, lengths: list[int], ending: str = "\n") -> list[Path]:
    paths = []
    for shard, n in enumerate(lengths):
        path = tmp_path / f"part{shard}.txt"
        text = ending.join(f"{shard}-{i}" for i in range(n))
        path.write_bytes((text + (ending if shard % 2 == 0 and n else "")).encode())
        paths.append(path)
    return paths


def _shard(source: ShardedSource, index: int, start: int = 0, state=None) -> list:
    return list(source.open_shard(index, start, state))


def test_records_round_trip_and_scan_lengths(tmp_path: Path) -> None:
    paths = _records(tmp_path, [5, 0, 12])
    source = RecordFiles(paths, lengths="scan", decode=bytes.decode)
    assert source.shard_lengths == [5, 0, 12] == [count_records(p) for p in paths]
    assert _shard(source, 2)[3] == "2:3:xxx"
    assert list(source) == [f"{s}:{i}:{'x' * (i % 5)}" for s, n in ((0, 5), (2, 12))
                            for i in range(n)]
    assert len(source) == 17
    raw = RecordFiles(paths)
    assert raw.shard_lengths is None and _shard(raw, 0)[0] == b"0:0:"
    with pytest.raises(TypeError, match="shard lengths"):
        len(raw)


@pytest.mark.parametrize("kind", ["records", "lines"])
def test_opening_at_a_position_or_from_a_saved_state_equals_skipping(tmp_path, kind) -> None:
    if kind == "records":
        source: ShardedSource = RecordFiles(_records(tmp_path, [9]), lengths="scan")
    else:
        source = LineFiles(_lines(tmp_path, [9]), lengths="scan")
    whole = _shard(source, 0)
    reader = source.open_shard(0)
    states = [reader.state_dict()]
    for _ in whole:
        next(reader)
        states.append(reader.state_dict())
    for start, state in enumerate(states):
        assert _shard(source, 0, start) == whole[start:]
        assert _shard(source, 0, start, state) == whole[start:]
        assert state["position"] == start
    # A state saved at another position is not trusted: the reader skips instead.
    assert _shard(source, 0, 2, states[5]) == whole[2:]


def test_lines_strip_endings_and_keep_a_last_line_without_one(tmp_path: Path) -> None:
    paths = _lines(tmp_path, [3, 4], ending="\r\n")
    source = LineFiles(paths, lengths="scan", decode=lambda line: line.split("-"))
    assert source.shard_lengths == [3, 4]
    assert _shard(source, 1) == [["1", str(i)] for i in range(4)]
    assert _shard(source, 0, 1) == [["0", "1"], ["0", "2"]]


@pytest.mark.parametrize("encoding", ["latin-1", "shift_jis"])
def test_lines_in_an_ascii_superset_encoding(tmp_path: Path, encoding: str) -> None:
    text = "caf\u00e9\nna\u00efve\n" if encoding == "latin-1" else "\u65e5\u672c\n\u8a9e\n"
    path = tmp_path / "text.txt"
    path.write_bytes(text.encode(encoding))
    source = LineFiles([path], lengths="scan", encoding=encoding)
    assert source.shard_lengths == [2] and _shard(source, 0) == text.splitlines()


@pytest.mark.parametrize("encoding", ["utf-16", "utf-16-be", "utf-32"])
def test_an_encoding_that_is_no_ascii_superset_is_refused(tmp_path: Path, encoding: str) -> None:
    """Lines are split at the byte 0x0A before decoding: UTF-16 writes a line feed as two
    bytes, and 0x0A bytes inside other characters ("\u010a" in UTF-16-BE is 01 0A)."""
    with pytest.raises(ValueError, match=f"{encoding!r} is not an ASCII superset.*UTF-8"):
        LineFiles(_lines(tmp_path, [2]), encoding=encoding)
    with pytest.raises(LookupError):
        LineFiles(_lines(tmp_path, [2]), encoding="no-such-codec")


def test_a_truncated_record_file_says_what_is_wrong(tmp_path: Path) -> None:
    path = _records(tmp_path, [3])[0]
    path.write_bytes(path.read_bytes()[:-2])
    with pytest.raises(ValueError, match="record 2 claims"):
        list(RecordFiles([path]).open_shard(0))
    path.write_bytes(b"\x01\x00")
    with pytest.raises(ValueError, match="truncated record header"):
        list(RecordFiles([path]).open_shard(0))


def test_sequences_and_generators() -> None:
    source = SequenceSource([[1, 2, 3], [], [4]])
    assert source.shard_lengths == [3, 0, 1]
    assert _shard(source, 0, 1) == [2, 3] and list(source) == [1, 2, 3, 4]
    calls = []

    def numbers(shard: tuple[int, int], start: int = 0):
        calls.append(start)
        return range(shard[0] + start, shard[0] + shard[1])

    plain = GeneratorSource(numbers, [(0, 5), (100, 3)])
    seekable = GeneratorSource(numbers, [(0, 5), (100, 3)], lengths=[5, 3], seekable=True)
    assert _shard(plain, 1, 1) == _shard(seekable, 1, 1) == [101, 102]
    assert calls == [0, 1], "a seekable generator is asked to start at the position"
    assert plain.shard_lengths is None and seekable.shard_lengths == [5, 3]


@pytest.mark.parametrize(
    ("make", "match"),
    [
        (lambda: GeneratorSource(range, [1, 2], lengths=[1]), "2 shards"),
        (lambda: GeneratorSource(range, [1], lengths=[-1]), ">= 0"),
        (lambda: GeneratorSource(range, []), "at least one shard"),
        (lambda: SequenceSource([]), "at least one"),
        (lambda: RecordFiles([], lengths=None), "at least one file"),
        (lambda: RecordFiles(["/nonexistent/x.rec"]), "no such file"),
        (lambda: RecordFiles("/nonexistent/x.rec"), r"no such file\(s\): \['/nonexistent"),
        (lambda: GeneratorSource(range, [1], lengths="scan"), "file sources also take 'scan'"),
        (lambda: GeneratorSource(5, [1]), "needs a callable fn"),
    ],
)
def test_bad_sources_fail_at_construction(make, match) -> None:
    with pytest.raises((ValueError, FileNotFoundError, TypeError), match=match):
        make()


def test_one_path_is_one_file(tmp_path: Path) -> None:
    """Not its characters: a str or a Path is one file, as ParquetSource takes it."""
    path = _records(tmp_path, [3])[0]
    assert RecordFiles(str(path)).paths == RecordFiles(path).paths == [str(path)]
    with pytest.raises(TypeError, match="decode must be callable"):
        RecordFiles(path, decode=5)


def test_fingerprints_change_with_files_and_lengths(tmp_path: Path) -> None:
    paths = _records(tmp_path, [4, 6])
    base = RecordFiles(paths, lengths="scan").fingerprint
    assert RecordFiles(paths, lengths="scan").fingerprint == base
    assert RecordFiles(paths[::-1], lengths=[6, 4]).fingerprint != base
    assert RecordFiles(paths, lengths=[4, 5]).fingerprint != base
    assert RecordFiles(paths).fingerprint != base
    assert LineFiles(paths, lengths=[4, 6]).fingerprint != RecordFiles(paths, [4, 6]).fingerprint


def _generate(shard: int) -> range:
    return range(shard)


def _numbers_in(path: Any) -> Iterator[int]:
    with open(path) as file:
        yield from (int(line) for line in file)


def test_a_generator_state_over_other_shards_is_refused(tmp_path: Path) -> None:
    """The shards are in the fingerprint: a state saved over train_a/b.txt loaded into a
    loader over eval_a/b.txt (same count, same lengths) and resumed on the eval files; the
    same names in another directory still resume."""
    for folder, names in (("run", ("train_a", "train_b", "eval_a", "eval_b")),
                          ("moved", ("train_a", "train_b"))):
        (tmp_path / folder).mkdir()
        for base, name in enumerate(names):
            (tmp_path / folder / f"{name}.txt").write_text(
                "\n".join(str(100 * base + i) for i in range(8)))

    def make(folder: str, *names: str) -> ResumableLoader:
        paths = [tmp_path / folder / f"{name}.txt" for name in names]
        return ResumableLoader(GeneratorSource(_numbers_in, paths, lengths=[8, 8]),
                               batch_size=4, shuffle=True, seed=0)

    train = make("run", "train_a", "train_b")
    batches = iter(train)
    next(batches)
    state = train.state_dict()
    rest = [batch.tolist() for batch in batches]
    with pytest.raises(StateMismatchError, match=r"source: saved '_numbers_in:GeneratorSource:"
                       r"2 shards:\w+:shards (\w+)', this loader '.*:shards (?!\1)\w+'"):
        make("run", "eval_a", "eval_b").load_state_dict(state)
    moved = make("moved", "train_a", "train_b")
    moved.load_state_dict(state)
    assert [batch.tolist() for batch in moved] == rest


@pytest.mark.parametrize(
    ("shards", "other", "same"),
    [
        ([0, 1], [2, 3], False),  # seeds
        ([np.int64(0), 1], [0, np.int64(1)], True),
        ([range(0, 4), range(4, 8)], [range(8, 12), range(12, 16)], False),
        ([("a.bin", 0), ("a.bin", 4)], [("a.bin", 4), ("a.bin", 0)], False),
        ([b"k0", b"k1"], [b"k0", b"k2"], False),
        (["/data/x/a.txt", "/data/x/b.txt"], ["/mnt/a.txt", Path("/mnt/b.txt")], True),
        ([{"path": "a"}, {"path": "b"}], [{"path": "c"}, {"path": "d"}], True),  # type alone
    ],
)
def test_generator_shards_in_the_fingerprint(shards: list, other: list, same: bool) -> None:
    def fingerprint(descriptors: list) -> str:
        return GeneratorSource(_generate, descriptors, lengths=[4, 4]).fingerprint

    assert (fingerprint(shards) == fingerprint(other)) == same


def test_sources_travel_to_worker_processes(tmp_path: Path) -> None:
    for source in (RecordFiles(_records(tmp_path, [3]), lengths="scan"),
                   LineFiles(_lines(tmp_path, [2])), SequenceSource([[1, 2]]),
                   GeneratorSource(_generate, [3, 4])):
        copy = pickle.loads(pickle.dumps(source))
        assert list(copy) == list(source) and copy.fingerprint == source.fingerprint


def test_file_readers_close_their_files(tmp_path: Path) -> None:
    psutil = pytest.importorskip("psutil")
    source = RecordFiles(_records(tmp_path, [50]), lengths="scan")
    process = psutil.Process()
    before = len(process.open_files())
    readers = [source.open_shard(0) for _ in range(5)]
    for reader in readers:
        list(itertools.islice(reader, 3))
    assert len(process.open_files()) == before + 5
    for reader in readers:
        reader.close()
    assert len(list(source)) == 50
    assert len(process.open_files()) == before


def test_a_saved_state_seeks_instead_of_reading_what_came_before(tmp_path: Path) -> None:
    path = _records(tmp_path, [6])[0]
    source = RecordFiles([path], lengths="scan")
    reader = source.open_shard(0, 4)
    state = reader.state_dict()
    expected = list(reader)
    data = bytearray(path.read_bytes())
    data[0:4] = b"\xff\xff\xff\x7f"  # record 0 now claims 2 GiB: hopping over it fails
    path.write_bytes(bytes(data))
    assert _shard(source, 0, 4, state) == expected
    with pytest.raises(ValueError, match="claims"):
        list(source.open_shard(0))


RNG_LENGTHS = [20, 17, 23]


def _shuffled_rows(shard: int) -> Iterator[dict[str, int]]:
    """A shard's rows shuffled with ``random`` as it opens, each drawing from the three global
    RNGs as it is read (an augmentation)."""
    rows = list(range(shard * 100, shard * 100 + RNG_LENGTHS[shard]))
    random.shuffle(rows)
    for row in rows:
        yield {"id": row, "random": random.getrandbits(30),
               "numpy": int(np.random.randint(2**30)), "torch": int(torch.randint(2**30, ()))}


class _EagerlyShuffled(ShardedSource[int]):
    """A source of the user's own that shuffles with torch in ``open_shard`` itself, before
    any sample is read."""

    @property
    def shards(self) -> list[int]:
        return [0, 1, 2]

    @property
    def shard_lengths(self) -> list[int]:
        return RNG_LENGTHS

    def open_shard(self, index: int, start: int = 0,
                   state: Mapping[str, Any] | None = None) -> Iterator[int]:
        rows = torch.randperm(RNG_LENGTHS[index]) + index * 100
        return iter(rows[start:].tolist())


RNG_SOURCES = {
    "generator": lambda: GeneratorSource(_shuffled_rows, [0, 1, 2], lengths=RNG_LENGTHS),
    "subclass": _EagerlyShuffled,
}


def _rng_loader(name: str, workers: int, backend: str = "process", shuffle_buffer: int = 0,
                partitions: int | None = None) -> ResumableLoader:
    return ResumableLoader(RNG_SOURCES[name](), batch_size=4, shuffle=True, seed=1,
                           num_workers=workers, backend=backend, shuffle_buffer=shuffle_buffer,
                           partitions=partitions, collate_fn=list)


def _id(sample: Any) -> int:
    return sample["id"] if isinstance(sample, dict) else sample


def _by_id(batches: list[list[Any]]) -> dict[int, Any]:
    """Each sample (its draws too) by its id."""
    return {_id(sample): sample for batch in batches for sample in batch}


@pytest.mark.parametrize("partitions", [None, 6])
@pytest.mark.parametrize("name", list(RNG_SOURCES))
def test_shards_drawing_from_the_global_rngs_read_the_same_in_every_slot(name,
                                                                         partitions) -> None:
    """A shard split between two slots is opened by each (``open_shard(index, start)``): each
    opened it under the global RNGs its batch's fetch had seeded, so the two parts came from
    two permutations (with 2 workers 6 of 60 samples lost and 6 repeated). Every shard now
    opens under RNGs seeded from (seed, epoch, shard) and reads under states of its own: every
    sample once, each with the same draws, for any worker count and backend (in the same
    batches, over canonical partitions)."""
    expected = sorted(row + shard * 100 for shard, n in enumerate(RNG_LENGTHS)
                      for row in range(n))
    runs = []
    for workers, backend in ((0, "process"), (2, "process"), (2, "thread")):
        loader = _rng_loader(name, workers, backend, partitions=partitions)
        epochs = run_epochs(loader, range(2), key=list)
        loader.close()
        for epoch, batches in enumerate(epochs):
            got = Counter(_id(sample) for batch in batches for sample in batch)
            assert sorted(got.elements()) == expected, (
                f"{workers} {backend} workers, epoch {epoch}: lost "
                f"{sorted(set(expected) - set(got))}, repeated {sorted(got - Counter(expected))}")
        runs.append(epochs)
    for epochs in runs[1:]:
        assert [_by_id(batches) for batches in epochs] == [_by_id(b) for b in runs[0]]
        assert partitions is None or epochs == runs[0]
    assert runs[0][0] != runs[0][1]  # another epoch draws another shuffle


@pytest.mark.parametrize("name", list(RNG_SOURCES))
@pytest.mark.parametrize(("first", "then"), [(2, 0), (0, 2)])
def test_a_resume_under_another_num_workers_draws_what_the_shards_drew(name, first, then) -> None:
    """A resumed shard is opened at its position: a generator reads and drops the samples
    before it under the shard's own RNG states, so its draws (the shuffle as it opens, the
    samples' own) come out as in the uninterrupted run. Resumed through a shuffle window too,
    under another ``num_workers`` (threads: they start fast)."""
    workers = itertools.chain([first], itertools.repeat(then))
    backend = "thread" if then else "process"
    check_resume_at_every_step(lambda: _rng_loader(name, next(workers), backend, 5), epochs=2,
                               key=list)


def _augment(record: bytes | int) -> tuple[int, int, int, int]:
    """A sample and its draws from the three global RNGs (an augmentation)."""
    return (int(record), random.getrandbits(30), int(np.random.randint(2**30)),
            int(torch.randint(2**30, ())))


def _augmented(shard: int, start: int = 0) -> Iterator[tuple[int, int, int, int]]:
    """Seekable: a shard's rows in order from ``start``, augmented."""
    return map(_augment, range(shard * 100 + start, shard * 100 + RNG_LENGTHS[shard]))


SEEKING_SOURCES = {
    "seekable": lambda _: GeneratorSource(_augmented, [0, 1, 2], lengths=RNG_LENGTHS,
                                          seekable=True),
    "records": lambda paths: RecordFiles(paths, lengths="scan", decode=_augment),
}


@pytest.mark.parametrize("name", list(SEEKING_SOURCES))
@pytest.mark.parametrize(("first", "then"), [(2, 0), (0, 2)])
def test_a_seeking_source_draws_per_sample_under_each_batchs_seeding(tmp_path: Path, name,
                                                                     first, then) -> None:
    """A source that seeks to a resumed position skips the draws of the samples before it, so
    states of its own would come back otherwise after a resume (a decode's augmentation changed
    from the first resumed batch on): it reads under each batch's seeding, the same draws for
    every ``num_workers`` and resume."""
    paths = [tmp_path / f"{shard}.rec" for shard in range(3)]
    for shard, path in enumerate(paths):
        write_records(path, (str(shard * 100 + row).encode() for row in range(RNG_LENGTHS[shard])))
    workers = itertools.chain([first], itertools.repeat(then))

    def make() -> ResumableLoader:
        return ResumableLoader(SEEKING_SOURCES[name](paths), batch_size=4, shuffle=True, seed=1,
                               num_workers=next(workers), collate_fn=list)

    full = check_resume_at_every_step(make, epochs=2, key=list)
    assert len({draw for epoch in full for batch in epoch for sample in batch
                for draw in sample[1:]}) == 3 * sum(RNG_LENGTHS) * 2  # all drawn, none repeated


def test_sources_that_seek_or_never_draw_read_under_each_batchs_seeding(tmp_path: Path) -> None:
    """A source whose reads may draw and that reaches a position by reading (a generator, a
    subclass) reads under RNG states of its own; one that seeks (files, containers, a seekable
    generator) or never draws (``rng_free``) reads under each batch's seeding."""
    paths = _records(tmp_path, [3])
    seeking = [RecordFiles(paths, decode=bytes.decode), LineFiles(_lines(tmp_path, [2])),
               SequenceSource([_Squares()]), GeneratorSource(_generate, [3], seekable=True)]
    assert all(source.seeks for source in seeking)
    assert not any(source.rng_free for source in seeking[::2])  # a decode, a dataset: may draw
    assert RecordFiles(paths).rng_free and SequenceSource([[1, 2], np.arange(3)]).rng_free
    assert GeneratorSource(_generate, [3], rng_free=True).rng_free
    for source in (GeneratorSource(_generate, [3]), _EagerlyShuffled()):
        assert not (source.seeks or source.rng_free), type(source).__name__


class _Squares(torch.utils.data.Dataset[int]):
    def __getitem__(self, index: int) -> int:
        return index * index

    def __len__(self) -> int:
        return 3
