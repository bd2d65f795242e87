"""WebDatasetSource: WebDataset tar shards as a sharded source (same samples as
``webdataset.WebDataset``, counted and skipped by hopping over tar headers, resumed by seeking)."""

import gzip
import os
import pickle
import random
import subprocess
import sys
import tarfile
import warnings
from collections import Counter
from io import BytesIO
from pathlib import Path

import numpy as np
import pytest

from lightning_loaders import ResumableLoader
from lightning_loaders.sources.webdataset import WebDatasetSource, count_tar_samples, decode_basic
from lightning_loaders.testing import check_resume_at_every_step, run_epochs, set_epoch
from tests.real_data_harness import check_real_data_ddp

wds = pytest.importorskip("webdataset", reason="the tests compare with webdataset and write "
                                               "shards with its TarWriter")

LENGTHS = [13, 4, 9, 14]  # uneven shards, 40 samples
TOTAL = sum(LENGTHS)
SHARD_OF = [shard for shard, n in enumerate(LENGTHS) for _ in range(n)]


def write_shards(root: Path, lengths: list[int] = LENGTHS, suffix: str = ".tar") -> list[str]:
    """Shards ``shard-000.tar``...; sample ``i`` has ``.cls`` and ``.json`` holding ``i`` and a
    small ``.npy`` of ``i % 5`` values."""
    root.mkdir(parents=True, exist_ok=True)
    paths, first = [], 0
    for shard, n in enumerate(lengths):
        paths.append(str(root / f"shard-{shard:03d}{suffix}"))
        with wds.TarWriter(paths[-1]) as writer:
            for i in range(first, first + n):
                writer.write({"__key__": f"sample{i:05d}", "cls": i, "json": {"id": i},
                              "npy": np.arange(i % 5, dtype=np.int64)})
        first += n
    return paths


def webdataset_samples(urls, **kwargs) -> list[dict]:
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")  # shardshuffle=False is what we want; it warns anyway
        return list(wds.WebDataset(urls, shardshuffle=False, **kwargs))


def decode_id(sample: dict) -> dict[str, int]:
    """What the loader tests train on: the id (checked against ``.json``) and the ``.npy`` sum."""
    decoded = decode_basic(sample)
    assert decoded["json"] == {"id": decoded["cls"]}
    return {"id": decoded["cls"], "npy": int(decoded["npy"].sum())}


def ddp_dataset(data_dir: str) -> WebDatasetSource:
    """The dataset of the 2-rank DDP test (``tests/scripts/real_data_fit.py`` builds it)."""
    return WebDatasetSource(sorted(str(path) for path in Path(data_dir).glob("*.tar")),
                            decode=decode_id)


class CountingDecoder:
    """Counts its calls (in this process); returns the sample as it is."""

    def __init__(self) -> None:
        self.calls = 0

    def __call__(self, sample: dict) -> dict:
        self.calls += 1
        return sample


def ids(batch: dict) -> list[int]:
    return batch["id"].tolist()


@pytest.fixture(scope="module")
def shards(tmp_path_factory) -> list[str]:
    return write_shards(tmp_path_factory.mktemp("wds"))


# -- the samples --------------------------------------------------------------------------------


def test_samples_equal_webdatasets_in_order_with_the_same_grouping(shards) -> None:
    source = WebDatasetSource(shards)
    ours = list(source)
    assert ours == webdataset_samples(shards)
    assert [s["__key__"] for s in ours] == [f"sample{i:05d}" for i in range(TOTAL)]
    assert all(set(s) == {"__key__", "__url__", "__local_path__", "cls", "json", "npy"}
               for s in ours)
    assert source.shard_lengths == LENGTHS and len(source) == TOTAL
    assert [count_tar_samples(path) for path in shards] == LENGTHS


def _tricky_tar(path: Path, tar_format: int) -> None:
    """Members WebDataset groups in unusual ways: long names (pax or GNU headers), directories,
    metadata, names without a dot, upper-case and multi-dot extensions, keys with directories,
    a key that comes back later, an empty payload."""
    long_dir = "d" * 120
    members = [("dir/", None), ("__meta__.json", b"{}"), ("a.cls", b"1"), ("a.JSON", b"{}"),
               ("README", b"no dot"), ("a.seg.png", b"png"), (f"{long_dir}/b.cls", b"2"),
               (f"{long_dir}/b.txt", b""), ("sub/c.cls", b"3"), ("__meta__/x.txt", b"skip"),
               ("a.txt", b"again"), ("e.f.g.h", b"4")]
    with tarfile.open(path, "w", format=tar_format) as tar:
        for name, data in members:
            info = tarfile.TarInfo(name)
            if data is None:
                info.type = tarfile.DIRTYPE
                tar.addfile(info)
            else:
                info.size = len(data)
                tar.addfile(info, BytesIO(data))


@pytest.mark.parametrize("tar_format", [tarfile.PAX_FORMAT, tarfile.GNU_FORMAT,
                                        tarfile.USTAR_FORMAT])
def test_unusual_members_are_grouped_as_webdataset_groups_them(tar_format, tmp_path) -> None:
    path = tmp_path / "tricky.tar"
    _tricky_tar(path, tar_format)
    ours = list(WebDatasetSource([str(path)]))
    assert ours == webdataset_samples([str(path)])
    assert [s["__key__"] for s in ours] == ["__meta__", "a", "d" * 120 + "/b", "sub/c", "a", "e"]
    assert ours[1]["json"] == b"{}" and ours[1]["seg.png"] == b"png" and ours[5]["f.g.h"] == b"4"
    assert count_tar_samples(path) == 6


def test_a_repeated_extension_in_one_sample_is_an_error_naming_it(tmp_path) -> None:
    path = tmp_path / "dup.tar"
    with tarfile.open(path, "w") as tar:
        for name in ("a.cls", "a.CLS"):
            info = tarfile.TarInfo(name)
            info.size = 1
            tar.addfile(info, BytesIO(b"1"))
    with pytest.raises(ValueError, match="duplicate extension 'cls' in sample 'a'"):
        WebDatasetSource([str(path)])


def test_corrupt_and_non_tar_files_fail_with_the_file_named(shards, tmp_path) -> None:
    text = tmp_path / "notes.tar"
    text.write_text("not a tar file, but long enough to fill one header block " * 20)
    with pytest.raises(ValueError, match=r"notes\.tar: invalid tar header at byte 0"):
        WebDatasetSource([str(text)])
    truncated = tmp_path / "truncated.tar"
    truncated.write_bytes(Path(shards[0]).read_bytes()[:5000])
    with pytest.raises(ValueError, match=r"truncated\.tar: the tar file is truncated"):
        WebDatasetSource([str(truncated)])
    truncated.write_bytes(Path(shards[0]).read_bytes()[:5700])  # inside a payload
    with pytest.raises(ValueError, match=r"truncated\.tar: sample00000\.npy is truncated"):
        WebDatasetSource([str(truncated)])


def test_gzip_shards_read_the_same_and_resume_by_seeking(tmp_path) -> None:
    paths = write_shards(tmp_path, [5, 7], suffix=".tar.gz")
    assert gzip.open(paths[0]).read(1)  # really compressed
    source = WebDatasetSource(paths)
    assert source.shard_lengths == [5, 7]
    assert list(source) == webdataset_samples(paths)
    reader = source.open_shard(1)
    first = [next(reader)["__key__"] for _ in range(3)]
    state = reader.state_dict()
    assert state["position"] == 3 and state["offset"] > 0
    rest = [s["__key__"] for s in source.open_shard(1, 3, state)]
    assert first + rest == [f"sample{i:05d}" for i in range(5, 12)]


# -- the shard list -----------------------------------------------------------------------------


def test_brace_patterns_plain_strings_paths_and_file_urls_name_the_same_shards(shards) -> None:
    root = Path(shards[0]).parent
    assert WebDatasetSource(str(root / "shard-{000..003}.tar")).shards == shards
    assert WebDatasetSource(f"{root}/shard-{{000..001}}.tar::{root}/shard-003.tar").shards == [
        shards[0], shards[1], shards[3]]
    assert WebDatasetSource(shards[2]).shards == [shards[2]]
    assert WebDatasetSource(Path(shards[2])).shard_lengths == [LENGTHS[2]]
    urls = [f"file:{path}" for path in shards[:2]]
    ours = list(WebDatasetSource(urls))
    assert ours == webdataset_samples(urls) and ours[0]["__url__"] == urls[0]


@pytest.mark.parametrize("url", ["http://example.invalid/shard-000.tar",
                                 "s3://bucket/shard-000.tar", "pipe:cat shard-000.tar"])
def test_remote_urls_are_refused_with_what_to_do(url) -> None:
    with pytest.raises(ValueError, match="reads local tar files.*mount"):
        WebDatasetSource([url])


def test_missing_files_and_bad_lengths_fail_at_construction(shards, tmp_path) -> None:
    with pytest.raises(FileNotFoundError, match="nope-0.tar"):
        WebDatasetSource(str(tmp_path / "nope-{0..1}.tar"))
    with pytest.raises(ValueError, match="at least one"):
        WebDatasetSource([])
    with pytest.raises(ValueError, match="3 entries for 4 shards"):
        WebDatasetSource(shards, lengths=[1, 2, 3])
    with pytest.raises(ValueError, match="file sources also take 'scan'"):
        WebDatasetSource(shards, lengths="count")  # type: ignore[arg-type]


def test_importing_the_package_or_the_module_imports_neither_webdataset_nor_braceexpand() -> None:
    code = ("import sys, lightning_loaders, lightning_loaders.sources.webdataset\n"
            "print([m for m in ('webdataset', 'braceexpand') if m in sys.modules])")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


# -- counting, skipping and seeking ------------------------------------------------------------


def test_counting_decodes_nothing_and_given_or_unknown_lengths_count_nothing(shards) -> None:
    decoder = CountingDecoder()
    source = WebDatasetSource(shards, decode=decoder)
    assert source.shard_lengths == LENGTHS and decoder.calls == 0
    assert [len(list(source.open_shard(i))) for i in range(4)] == LENGTHS
    assert decoder.calls == TOTAL
    assert WebDatasetSource(shards, lengths=[1, 2, 3, 4]).shard_lengths == [1, 2, 3, 4]
    unknown = WebDatasetSource(shards, lengths=None)
    assert unknown.shard_lengths is None
    with pytest.raises(TypeError, match="shard lengths"):
        len(unknown)


def _bytes_read() -> int:
    """Bytes this process has read through ``read`` system calls (Linux)."""
    for line in Path("/proc/self/io").read_text().splitlines():
        if line.startswith("rchar:"):
            return int(line.split()[1])
    raise AssertionError("no rchar in /proc/self/io")


@pytest.mark.skipif(not os.path.exists("/proc/self/io"), reason="counts bytes read via /proc")
def test_counting_and_skipping_hop_over_payloads(tmp_path) -> None:
    path = str(tmp_path / "big.tar")
    payload = 1 << 20
    with wds.TarWriter(path) as writer:
        for i in range(8):
            writer.write({"__key__": f"k{i}", "cls": i, "bin": bytes([i]) * payload})
    before = _bytes_read()
    source = WebDatasetSource([path], decode=decode_basic)
    skipped = source.open_shard(0, 7)
    state = skipped.state_dict()
    assert source.shard_lengths == [8] and state["position"] == 7
    assert _bytes_read() - before < payload // 4, "counting or skipping read payloads"
    last = next(skipped)
    assert last["cls"] == 7 and last["bin"] == bytes([7]) * payload


def test_a_reader_given_its_state_seeks_past_earlier_members(shards, tmp_path) -> None:
    """Everything before the saved offset is overwritten with garbage: a reader opened with the
    state still reads the rest; one that has to skip from the start fails."""
    decoder = CountingDecoder()
    source = WebDatasetSource(shards, decode=decoder)
    reader = source.open_shard(3)
    head = [next(reader)["__key__"] for _ in range(6)]
    state = reader.state_dict()
    assert state["position"] == 6 and state["offset"] > 0
    expected = [s["__key__"] for s in source.open_shard(3, 6)]
    assert head + expected == [f"sample{i:05d}" for i in range(26, 40)]
    assert decoder.calls == 6 + len(expected)  # the 6 skipped samples were not decoded

    damaged = tmp_path / "shard-003.tar"
    data = bytearray(Path(shards[3]).read_bytes())
    data[:state["offset"]] = b"\xff" * state["offset"]
    damaged.write_bytes(data)
    seeking = WebDatasetSource([str(damaged)], lengths=[LENGTHS[3]])
    assert [s["__key__"] for s in seeking.open_shard(0, 6, state)] == expected
    with pytest.raises(ValueError, match="invalid tar header at byte 0"):
        list(seeking.open_shard(0, 6))
    stale = {**state, "position": 5}  # a state for another position is not used
    with pytest.raises(ValueError, match="invalid tar header at byte 0"):
        list(seeking.open_shard(0, 6, stale))


def test_the_state_at_the_end_of_a_shard_reopens_empty(shards) -> None:
    source = WebDatasetSource(shards)
    reader = source.open_shard(1)
    assert len(list(reader)) == LENGTHS[1]
    state = reader.state_dict()
    assert state == {"position": LENGTHS[1], "offset": state["offset"]}
    assert list(source.open_shard(1, LENGTHS[1], state)) == []
    assert list(source.open_shard(1, LENGTHS[1] + 3)) == []


# -- decoders -----------------------------------------------------------------------------------


def test_decode_basic_decodes_the_common_extensions(shards) -> None:
    sample = next(WebDatasetSource(shards[2:3], decode=decode_basic).open_shard(0, 2))
    assert sample["cls"] == 19 and sample["json"] == {"id": 19}
    assert sample["npy"].tolist() == [0, 1, 2, 3] and sample["__key__"] == "sample00019"


def test_webdataset_handlers_and_decoders_decode_as_webdataset_does(tmp_path) -> None:
    pytest.importorskip("PIL", reason="image decoding")
    path = str(tmp_path / "images.tar")
    with wds.TarWriter(path) as writer:
        for i in range(3):
            image = np.full((4, 5, 3), 40 * i, dtype=np.uint8)
            writer.write({"__key__": f"img{i}", "png": image, "cls": i, "txt": f"image {i}"})
    tenfold = wds.handle_extension("cls", lambda data: int(data) * 10)
    for decode, args in [("rgb8", ("rgb8",)), (["l8", tenfold], ("l8", tenfold)),
                         (wds.autodecode.Decoder([tenfold]), (tenfold,))]:
        ours = list(WebDatasetSource([path], decode=decode))
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            theirs = list(wds.WebDataset([path], shardshuffle=False).decode(*args))
        assert [s.keys() for s in ours] == [s.keys() for s in theirs]
        for mine, other in zip(ours, theirs, strict=True):
            assert {k: v for k, v in mine.items() if k != "png"} == {
                k: v for k, v in other.items() if k != "png"}
            assert np.array_equal(mine["png"], other["png"])
    assert list(WebDatasetSource([path], decode="rgb8"))[2]["png"][0, 0].tolist() == [80] * 3


def test_pickled_sources_read_the_same_and_fingerprints_follow_names_and_lengths(
        shards, tmp_path) -> None:
    source = WebDatasetSource(shards, decode=decode_basic)
    copy = pickle.loads(pickle.dumps(source))
    assert copy.fingerprint == source.fingerprint == WebDatasetSource(shards).fingerprint
    assert [s["cls"] for s in copy] == list(range(TOTAL))
    moved = write_shards(tmp_path / "moved")
    assert WebDatasetSource(moved).fingerprint == source.fingerprint  # names and lengths, not dirs
    other = write_shards(tmp_path / "other", [13, 4, 9, 15])
    assert WebDatasetSource(other).fingerprint != source.fingerprint
    renamed = tmp_path / "renamed"
    renamed.mkdir()
    for i, path in enumerate(moved):
        os.rename(path, renamed / f"part-{i}.tar")
    assert WebDatasetSource(str(renamed / "part-{0..3}.tar")).fingerprint != source.fingerprint


# -- through the loader -------------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2, 3])
def test_every_sample_once_per_epoch_and_the_shard_order_changes(workers, shards) -> None:
    loader = ResumableLoader(WebDatasetSource(shards, decode=decode_id), batch_size=4,
                             shuffle=True, seed=3, num_workers=workers)
    epochs = run_epochs(loader, range(2), key=ids)
    loader.close()
    streams = [[i for batch in epoch for i in batch] for epoch in epochs]
    for epoch, stream in zip(epochs, streams, strict=True):
        assert sorted(stream) == list(range(TOTAL))
        assert len(epoch) == len(loader) == 10
    assert streams[0] != streams[1]
    if workers == 0:  # one reader: the stream is the shard order, shard by shard
        orders = [list(dict.fromkeys(SHARD_OF[i] for i in stream)) for stream in streams]
        assert sorted(orders[0]) == sorted(orders[1]) == [0, 1, 2, 3]
        assert orders[0] != orders[1]


def test_a_loader_epoch_holds_the_same_samples_as_webdataset(shards) -> None:
    loader = ResumableLoader(WebDatasetSource(shards), batch_size=5, shuffle=True, seed=1,
                             collate_fn=list)
    theirs = sorted(s["__key__"] for s in webdataset_samples(shards))
    for epoch in run_epochs(loader, range(2), key=lambda batch: batch):
        samples = [sample for batch in epoch for sample in batch]
        assert sorted(s["__key__"] for s in samples) == theirs
        assert all(set(s) == {"__key__", "__url__", "__local_path__", "cls", "json", "npy"}
                   for s in samples)


@pytest.mark.parametrize("policy", ["keep", "drop", "pad", "rollover"])
def test_two_ranks_get_equal_exact_batch_counts_under_every_policy(policy, shards) -> None:
    ranks = []
    for rank in range(2):
        loader = ResumableLoader(WebDatasetSource(shards, decode=decode_id), batch_size=3,
                                 shuffle=True, seed=5, last_batch=policy, rank=rank,
                                 world_size=2)
        ranks.append(run_epochs(loader, range(2), key=ids))
        if policy != "rollover":
            assert [len(epoch) for epoch in ranks[-1]] == [len(loader)] * 2
    for epoch in range(2):
        assert len(ranks[0][epoch]) == len(ranks[1][epoch])
        read = [i for rank in ranks for batch in rank[epoch] for i in batch]
        if policy == "keep":
            assert sorted(read) == list(range(TOTAL))
        if policy == "drop":
            assert len(read) == len(set(read)) == 36
        if policy == "pad":
            assert set(read) == set(range(TOTAL)) and len(read) == 42
    if policy == "rollover":  # 4 samples roll into epoch 1, 2 out of it: 78 in 13 batches
        counts = Counter(i for rank in ranks for epoch in rank for batch in epoch for i in batch)
        assert all(len(batch) == 3 for rank in ranks for epoch in rank for batch in epoch)
        assert set(counts) == set(range(TOTAL)) and set(counts.values()) <= {1, 2}
        assert sum(counts.values()) == 78


@pytest.mark.parametrize(("workers", "lengths", "options"), [
    (0, "scan", {"batch_size": 4}),
    (0, None, {"batch_size": 4, "shuffle_buffer": 5}),
    (2, "scan", {"batch_size": 7, "shuffle_buffer": 5}),
    (2, None, {"batch_size": 7}),
])
def test_resume_at_every_step_is_exact(workers, lengths, options, shards) -> None:
    def make():
        return ResumableLoader(WebDatasetSource(shards, decode=decode_id, lengths=lengths),
                               shuffle=True, seed=11, num_workers=workers, **options)

    full = check_resume_at_every_step(make, epochs=2, key=ids)
    assert all(sorted(i for batch in epoch for i in batch) == list(range(TOTAL))
               for epoch in full)


def decode_augmented(sample: dict) -> dict[str, float]:
    """``decode_id`` and a random augmentation drawn from the global RNGs."""
    return {**decode_id(sample), "noise": random.random() + float(np.random.random())}


@pytest.mark.parametrize("lengths", ["scan", None])
def test_a_decode_that_draws_reads_the_same_on_threads_as_in_processes(lengths, shards) -> None:
    """A decode drawing from the global RNGs drew, on worker threads, from the training
    process's (other values in every run; a resume after batch 1 diverged); it draws what it
    draws in worker processes, and every resume is exact."""
    def make(backend: str) -> ResumableLoader:
        return ResumableLoader(WebDatasetSource(shards, decode=decode_augmented,
                                                lengths=lengths),
                               batch_size=4, shuffle=True, seed=0, num_workers=2,
                               backend=backend)

    def key(batch: dict) -> list[tuple[int, float]]:
        return list(zip(ids(batch), batch["noise"].tolist(), strict=True))

    with pytest.warns(UserWarning, match="worker threads: WebDatasetSource"):
        threads = check_resume_at_every_step(lambda: make("thread"), 2, key=key)
    assert threads == run_epochs(make("process"), range(2), key=key)


def test_unknown_lengths_save_each_readers_byte_offset(shards) -> None:
    loader = ResumableLoader(WebDatasetSource(shards, decode=decode_id, lengths=None),
                             batch_size=4, num_workers=2)
    iterator = iter(loader)
    for _ in range(3):
        next(iterator)
    slot_states = [slot[5] for slot in loader.state_dict()["parts"]["slots"]["positions"][0]]
    loader.close()
    assert any(state is not None and state["offset"] > 0 for state in slot_states)


def _state_after(make, batches: int):
    loader = make()
    set_epoch(loader, 0)
    iterator = iter(loader)
    for _ in range(batches):
        next(iterator)
    state = loader.state_dict()
    loader.close()
    return state


def test_resume_with_another_worker_count_continues_the_saved_order(shards) -> None:
    """Known lengths plan over canonical partitions, saved with the state: mid-epoch and at
    its end, the resumed stream is the saving layout's."""
    def make(workers: int):
        return ResumableLoader(WebDatasetSource(shards, decode=decode_id), batch_size=4,
                               shuffle=True, seed=9, num_workers=workers)

    epochs = run_epochs(make(0), range(2), key=ids)
    other = make(2)
    other.load_state_dict(_state_after(lambda: make(0), 3))
    assert [ids(batch) for batch in other] == epochs[0][3:]
    other.close()
    expected = epochs[1]
    resumed = make(2)
    resumed.load_state_dict(_state_after(lambda: make(0), 10))  # the end of epoch 0
    assert [ids(batch) for batch in resumed] == expected
    resumed.close()


@pytest.mark.skipif(sys.platform != "linux", reason="gloo DDP on CPU")
def test_ddp_two_ranks_read_every_sample_once_and_resume(tmp_path) -> None:
    data = tmp_path / "data"
    write_shards(data)
    runs = check_real_data_ddp("tests.sources.test_webdataset:ddp_dataset", data, total=TOTAL,
                               result_dir=tmp_path / "ddp", workers=2, shuffle=True)
    assert runs[0]["len"] == 5  # 40 samples, 2 ranks, batches of 4
