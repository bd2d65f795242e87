"""Plain iterable datasets that split their own stream (by worker, by rank) read exactly once.

The three datasets users have (issue 13): torch's documented ``get_worker_info()`` pattern,
Hugging Face ``to_iterable_dataset(num_shards=4)`` and ``webdataset.WebDataset`` over 4 tars.
The builders are module-level (``ddp_*``) so that ``tests/scripts/real_data_fit.py`` imports
them in every DDP rank; each reads ``ids.txt`` or the tars a test wrote into ``data_dir``.
"""

from __future__ import annotations

import functools
import math
import os
import random
from collections import Counter
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import torch
from torch.utils.data import (
    BatchSampler,
    DataLoader,
    Dataset,
    IterableDataset,
    Sampler,
    get_worker_info,
)

datasets = pytest.importorskip("datasets", reason="the Hugging Face streams are read with datasets")
wds = pytest.importorskip("webdataset", reason="the tar streams are read with webdataset")

from datasets.distributed import split_dataset_by_node  # noqa: E402

from lightning_loaders import GeneratorSource, ResumableLoader  # noqa: E402
from lightning_loaders.errors import SampleFetchError  # noqa: E402
from lightning_loaders.sources.plain import sole_reader  # noqa: E402
from lightning_loaders.testing import check_resume_at_every_step, run_epochs  # noqa: E402
from tests.conftest import IndexDataset  # noqa: E402
from tests.ddp_harness import REPO, run_ddp  # noqa: E402
from tests.real_data_harness import check_real_data_ddp  # noqa: E402

TOTAL = 40
BATCH = 4
MODULE = "tests.loaders.test_self_sharding"


# -- the datasets (module level: DDP ranks import them) --------------------------------------


class WorkerSplitRange(IterableDataset[dict[str, int]]):
    """torch's documented pattern: each worker yields its contiguous part of the ids.

    ``get_worker_info`` is bound by name at import and called lazily (in the generator).
    """

    def __init__(self, ids: list[int], sized: bool = False) -> None:
        self.ids, self.sized = ids, sized

    def __iter__(self) -> Iterator[dict[str, int]]:
        info = get_worker_info()
        start, end = 0, len(self.ids)
        if info is not None:
            per_worker = math.ceil(len(self.ids) / info.num_workers)
            start = info.id * per_worker
            end = min(start + per_worker, end)
        for i in range(start, end):
            yield {"id": self.ids[i]}

    def __len__(self) -> int:
        if not self.sized:
            raise TypeError("unsized")
        return len(self.ids)


class SelfIterator(IterableDataset[dict[str, int]]):
    """Its own iterator (``__next__``), which ``__iter__`` rewinds to this worker's first id:
    every further ``iter()`` would start the stream again."""

    def __init__(self, ids: list[int]) -> None:
        self.ids, self.position, self.step = ids, 0, 1

    def __iter__(self) -> SelfIterator:
        info = get_worker_info()
        self.position, self.step = (0, 1) if info is None else (info.id, info.num_workers)
        return self

    def __next__(self) -> dict[str, int]:
        if self.position >= len(self.ids):
            raise StopIteration
        self.position += self.step
        return {"id": self.ids[self.position - self.step]}


class EnvRankSplit(IterableDataset[dict[str, int]]):
    """Splits its stream by the ``RANK``/``WORLD_SIZE`` environment (as WebDataset does)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __iter__(self) -> Iterator[dict[str, int]]:
        rank, world = int(os.environ.get("RANK", 0)), int(os.environ.get("WORLD_SIZE", 1))
        return ({"id": i} for i in self.ids[rank::world])

    def __len__(self) -> int:
        return len(self.ids)


class DistRankSplit(IterableDataset[dict[str, int]]):
    """Splits by ``torch.distributed`` and claims the full length: the loader cannot undo it."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __iter__(self) -> Iterator[dict[str, int]]:
        rank, world = 0, 1
        if torch.distributed.is_initialized():
            rank, world = torch.distributed.get_rank(), torch.distributed.get_world_size()
        return ({"id": i} for i in self.ids[rank::world])

    def __len__(self) -> int:
        return len(self.ids)


class ShuffleBuffer(IterableDataset[dict[str, int]]):
    """A common hand-written pattern: a shuffle buffer drawing from the global RNGs while it
    iterates (``random``, numpy and torch in turn), not only when the stream opens."""

    def __init__(self, ids: list[int], size: int = 8) -> None:
        self.ids, self.size = ids, size

    def __iter__(self) -> Iterator[dict[str, int]]:
        buffer: list[int] = []
        for i in self.ids:
            buffer.append(i)
            if len(buffer) == self.size:
                yield {"id": buffer.pop(_draw(i, len(buffer)))}
        random.shuffle(buffer)
        yield from ({"id": i} for i in buffer)

    def __len__(self) -> int:
        return len(self.ids)


class Augmented(IterableDataset[dict[str, int]]):
    """Each sample with a draw of each global RNG (an augmentation drawn as it iterates)."""

    def __init__(self, ids: list[int]) -> None:
        self.ids = ids

    def __iter__(self) -> Iterator[dict[str, int]]:
        for i in self.ids:
            yield {"id": i, "random": random.getrandbits(30),
                   "numpy": int(np.random.randint(2**30)), "torch": int(torch.randint(2**30, ()))}


def _draw(i: int, n: int) -> int:
    """A number below ``n`` from the ``random``, numpy or torch global RNG (by ``i``)."""
    if i % 3 == 0:
        return random.randrange(n)
    if i % 3 == 1:
        return int(np.random.randint(n))
    return int(torch.randint(n, ()))


class Curriculum(Dataset[dict[str, int]]):
    """A map-style dataset with its own state (``Stateful``): a level set from outside."""

    def __init__(self, n: int) -> None:
        self.n, self.level = n, 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, index: int) -> dict[str, int]:
        return {"id": index, "level": self.level}

    def state_dict(self) -> dict[str, int]:
        return {"level": self.level}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.level = state["level"]


def read_ids(data_dir: str) -> list[int]:
    return [int(line) for line in Path(data_dir, "ids.txt").read_text().split()]


def ddp_torch_doc(data_dir: str) -> IterableDataset[Any]:
    return WorkerSplitRange(read_ids(data_dir))


def ddp_torch_doc_sized(data_dir: str) -> IterableDataset[Any]:
    return WorkerSplitRange(read_ids(data_dir), sized=True)


def ddp_shuffle_buffer(data_dir: str) -> IterableDataset[Any]:
    return ShuffleBuffer(read_ids(data_dir))


def self_iterator(data_dir: str) -> IterableDataset[Any]:
    return SelfIterator(read_ids(data_dir))


def ddp_hf(data_dir: str) -> IterableDataset[Any]:
    return datasets.Dataset.from_dict({"id": read_ids(data_dir)}).to_iterable_dataset(
        num_shards=4)


def _wds_sample(sample: dict[str, Any]) -> dict[str, int]:
    return {"id": int(sample["cls"])}


def ddp_webdataset(data_dir: str) -> IterableDataset[Any]:
    """``WebDataset(urls)`` with its defaults (nodesplitter ``single_node_only``), unshuffled."""
    urls = sorted(str(path) for path in Path(data_dir).glob("*.tar"))
    return wds.WebDataset(urls, shardshuffle=False).decode().map(_wds_sample)


def write_data(data_dir: Path, total: int = TOTAL) -> Path:
    """``ids.txt`` (shuffled ids) and 4 tars holding the same ids, in ``data_dir``."""
    data_dir.mkdir(parents=True, exist_ok=True)
    ids = torch.randperm(total, generator=torch.Generator().manual_seed(3)).tolist()
    (data_dir / "ids.txt").write_text("".join(f"{i}\n" for i in ids))
    for shard in range(4):
        with wds.TarWriter(str(data_dir / f"part{shard}.tar")) as sink:
            for i in ids[shard::4]:
                sink.write({"__key__": f"s{i:05d}", "cls": i})
    return data_dir


def webdataset_shuffled(data_dir: str, detshuffle: bool = False) -> IterableDataset[Any]:
    """WebDataset's usual training set-up: shards shuffled (``shardshuffle=n``) and samples
    mixed by a ``.shuffle(n)`` buffer, neither given a seed (WebDataset draws them)."""
    urls = sorted(str(path) for path in Path(data_dir).glob("*.tar"))
    return (wds.WebDataset(urls, shardshuffle=4, detshuffle=detshuffle).shuffle(8).decode()
            .map(_wds_sample))


def hf_shuffled(data_dir: str) -> IterableDataset[Any]:
    """A Hugging Face stream reordering its shards and mixing samples with a seeded buffer."""
    return ddp_hf(data_dir).shuffle(seed=3, buffer_size=8)


BUILDERS: dict[str, Callable[[str], IterableDataset[Any]]] = {
    "torch-doc": ddp_torch_doc, "self-iterator": self_iterator, "hf": ddp_hf,
    "hf-shuffled": hf_shuffled,
    "webdataset": ddp_webdataset, "webdataset-shuffled": webdataset_shuffled}


class ShuffledFiles(IterableDataset[dict[str, int]]):
    """A common pattern: ``random.shuffle`` of the file list at the start of each pass (not
    split by worker)."""

    def __init__(self, ids: list[int]) -> None:
        self.files = [ids[start:start + 6] for start in range(0, len(ids), 6)]

    def __iter__(self) -> Iterator[dict[str, int]]:
        files = list(self.files)
        random.shuffle(files)
        for file in files:
            for i in file:
                yield {"id": i}


@pytest.fixture(scope="module")
def data_dir(tmp_path_factory) -> Path:
    return write_data(tmp_path_factory.mktemp("self_sharding"))


def _epoch_ids(loader: Any, epochs: int) -> list[list[int]]:
    out = []
    for epoch in range(epochs):
        set_epoch = getattr(loader.sampler, "set_epoch", None)
        if callable(set_epoch):
            set_epoch(epoch)
        out.append([i for batch in loader for i in batch["id"].tolist()])
    return out


# -- exactly once ----------------------------------------------------------------------------


@pytest.mark.parametrize("backend", ["process", "thread"])
@pytest.mark.parametrize("name", BUILDERS)
@pytest.mark.parametrize("workers", [0, 2, 3])
def test_every_sample_arrives_exactly_once_per_epoch(name, workers, backend, data_dir) -> None:
    """Also under threads, where several slots read the dataset as its only reader at once."""
    build = BUILDERS[name]
    reference = DataLoader(build(str(data_dir)), batch_size=BATCH, num_workers=workers)
    expected = Counter(i for batch in reference for i in batch["id"].tolist())
    assert expected == Counter(range(TOTAL))
    loader = ResumableLoader(build(str(data_dir)), batch_size=BATCH, num_workers=workers,
                             seed=5, backend=backend)
    for epoch, ids in enumerate(_epoch_ids(loader, 2)):
        assert Counter(ids) == expected, f"epoch {epoch}: {len(ids)} of {TOTAL} ids"
    loader.close()


@pytest.mark.parametrize("backend", ["process", "thread"])
@pytest.mark.parametrize("workers", [0, 2, 3])
@pytest.mark.parametrize("shuffled", [ShuffledFiles, ShuffleBuffer])
def test_a_stream_shuffled_by_the_global_rngs_is_one_stream_in_every_slot(shuffled, workers,
                                                                          backend, data_dir
                                                                          ) -> None:
    """Every slot reads the stream under global RNGs of its own, seeded from the seed and the
    epoch alone when it opens (a batch's fetch seeds them per slot) and carried from batch to
    batch: each reads the same shuffle, drawn as the stream opens (``ShuffledFiles``) or as it
    goes (``ShuffleBuffer``, without and with ``len()``), and keeps its share of it; a resume
    reads it again the same; another epoch draws another shuffle."""
    ids = read_ids(str(data_dir))
    loader = ResumableLoader(shuffled(ids), batch_size=BATCH, num_workers=workers,
                             seed=5, backend=backend)
    epochs = _epoch_ids(loader, 2)
    loader.close()
    for epoch, got in enumerate(epochs):
        assert Counter(got) == Counter(ids), f"epoch {epoch}: {len(got)} of {TOTAL} ids"
    assert epochs[0] != epochs[1]
    if workers < 3 and backend == "process":
        check_resume_at_every_step(
            lambda: ResumableLoader(shuffled(ids), batch_size=BATCH, num_workers=workers,
                                    seed=5), epochs=2, key=lambda batch: batch["id"].tolist())


@pytest.mark.parametrize("backend", ["process", "thread"])
def test_what_a_stream_draws_depends_on_the_seed_epoch_and_position_alone(backend,
                                                                           data_dir) -> None:
    """A sample's draws from the global RNGs (an augmentation) come from the stream's own
    RNG states, so they are the same whatever ``num_workers`` (slots read the stream in other
    chunks, with other batches' fetches between); another epoch draws anew."""
    ids = read_ids(str(data_dir))
    draws = []
    for workers in (0, 2, 3):
        loader = ResumableLoader(Augmented(ids), batch_size=BATCH, num_workers=workers,
                                 seed=5, backend=backend)
        draws.append([{i: (r, n, t) for batch in loader
                       for i, r, n, t in zip(*(batch[key].tolist()
                                               for key in ("id", "random", "numpy", "torch")),
                                             strict=True)}
                      for _ in range(2)])
        loader.close()
    assert draws[0] == draws[1] == draws[2]
    assert len(draws[0][0]) == TOTAL and draws[0][0] != draws[0][1]


@pytest.mark.parametrize("workers", [0, 2])
def test_a_streams_draws_leave_the_fetchs_own_seeding_alone(workers, data_dir) -> None:
    """The global RNGs a ``collate_fn`` draws from are seeded per batch as for any dataset:
    the stream's draws, made under its own states, do not move them."""
    ids = read_ids(str(data_dir))

    def draws(dataset: IterableDataset[Any]) -> list[list[int]]:
        loader = ResumableLoader(dataset, batch_size=BATCH, num_workers=workers, seed=5,
                                 collate_fn=_collate_draws)
        out = list(loader)
        loader.close()
        return out

    assert draws(ShuffleBuffer(ids)) == draws(EnvRankSplit(ids))


@pytest.mark.parametrize("resumed", [False, True])
def test_a_streams_draws_leave_the_training_loops_rngs_alone(resumed, data_dir) -> None:
    """With ``num_workers=0`` the global RNGs are the training loop's: the stream's draws, under
    states of its own, leave them where a stream that draws nothing leaves them, in a fetch
    (seeded for the batch, then continued) and where a resume reads its way back into its
    shuffle window (outside any fetch: put back as they were)."""
    ids = read_ids(str(data_dir))

    def after_a_batch(dataset: IterableDataset[Any]) -> list[int]:
        loader = ResumableLoader(dataset, batch_size=BATCH, shuffle_buffer=3, seed=5)
        if resumed:
            first = ResumableLoader(dataset, batch_size=BATCH, shuffle_buffer=3, seed=5)
            batches = iter(first)
            next(batches), next(batches)
            loader.load_state_dict(first.state_dict())
            first.close()
        random.seed(0), np.random.seed(0), torch.manual_seed(0)
        next(iter(loader))
        loader.close()
        return _collate_draws([])

    assert after_a_batch(ShuffleBuffer(ids)) == after_a_batch(EnvRankSplit(ids))


def _collate_draws(batch: list[Any]) -> list[int]:
    return [random.getrandbits(30), int(np.random.randint(2**30)), int(torch.randint(2**30, ()))]


@pytest.mark.parametrize("detshuffle", [False, True])
def test_a_webdatasets_own_shuffles_are_seeded_from_the_loader(detshuffle, data_dir) -> None:
    """WebDataset draws their seeds in each process: two datasets built apart (two ranks, or a
    run and its resume) read one stream, and each epoch and loader seed another order."""

    def epochs(seed: int) -> list[list[int]]:
        loader = ResumableLoader(webdataset_shuffled(str(data_dir), detshuffle),
                                 batch_size=BATCH, seed=seed)
        out = _epoch_ids(loader, 2)
        loader.close()
        return out

    first, again, other_seed = epochs(5), epochs(5), epochs(6)
    assert first == again
    assert first[0] != first[1] and first[0] != other_seed[0]
    for ids in first:
        assert Counter(ids) == Counter(read_ids(str(data_dir)))


@pytest.mark.parametrize("workers", [0, 2])
def test_a_resampled_webdataset_is_one_stream_and_resumes_exactly(workers, data_dir) -> None:
    """``resampled=True`` draws shards with a seed from the pid, the clock and urandom: the
    loader seeds the draws, so runs agree and a resume goes on with the same draws."""

    def make() -> ResumableLoader:
        urls = sorted(str(path) for path in Path(data_dir).glob("*.tar"))
        dataset = (wds.WebDataset(urls, resampled=True, shardshuffle=False).decode()
                   .map(_wds_sample).with_epoch(TOTAL).with_length(TOTAL))
        return ResumableLoader(dataset, batch_size=BATCH, num_workers=workers, seed=5)

    full = check_resume_at_every_step(make, epochs=2, key=lambda batch: batch["id"].tolist())
    again = run_epochs(make(), range(2), key=lambda batch: batch["id"].tolist())
    assert full == again and full[0] != full[1]


def test_a_hf_shuffle_without_a_seed_is_refused_with_the_fix(data_dir) -> None:
    """Its seed is drawn in each process: no two ranks or runs would read one order."""
    with pytest.raises(ValueError, match=r"seed drawn in this process.*"
                                         r"dataset\.shuffle\(seed=\.\.\., buffer_size"):
        ResumableLoader(ddp_hf(str(data_dir)).shuffle(buffer_size=8), batch_size=BATCH)


@pytest.mark.parametrize("name", BUILDERS)
@pytest.mark.parametrize("workers", [0, 2])
def test_resume_at_every_step_equals_the_uninterrupted_run(name, workers, data_dir) -> None:
    build = BUILDERS[name]
    check_resume_at_every_step(
        lambda: ResumableLoader(build(str(data_dir)), batch_size=BATCH, num_workers=workers,
                                seed=5),
        epochs=2, key=lambda batch: batch["id"].tolist())


@pytest.mark.parametrize("name", [*BUILDERS, "torch-doc-sized"])
def test_resume_with_another_num_workers_is_refused_mid_epoch_and_exact_at_an_epoch_end(
        name, data_dir) -> None:
    """Each slot strides over the stream, so mid-epoch positions belong to one slot count."""
    build = BUILDERS.get(name, ddp_torch_doc_sized)

    def make(workers: int) -> Any:
        return ResumableLoader(build(str(data_dir)), batch_size=BATCH, num_workers=workers,
                               seed=5)

    full = make(2)
    epochs = _epoch_ids(full, 2)
    it = iter(full)
    next(it)
    mid = full.state_dict()
    full.close()
    other = make(3)
    other.load_state_dict(mid)
    with pytest.raises(ValueError, match="another world size or number of worker slots.*"
                                         "plain IterableDataset is read whole by every slot"):
        next(iter(other))
    other.close()

    at_end = make(2)
    ids = [i for batch in at_end for i in batch["id"].tolist()]
    assert Counter(ids) == Counter(epochs[0])
    state = at_end.state_dict()
    at_end.close()
    resumed = make(3)
    resumed.load_state_dict(state)
    assert Counter(i for batch in resumed for i in batch["id"].tolist()) == Counter(range(TOTAL))
    resumed.close()


# -- the sole-reader view --------------------------------------------------------------------


def _record_worker_info(directory: str, worker_id: int) -> None:
    info = get_worker_info()
    assert info is not None
    Path(directory, f"worker{worker_id}").write_text(f"{info.id} {info.num_workers}")


def test_worker_init_fn_still_sees_torchs_worker_info(data_dir, tmp_path) -> None:
    loader = ResumableLoader(ddp_torch_doc(str(data_dir)), batch_size=BATCH, num_workers=2,
                             worker_init_fn=functools.partial(_record_worker_info, str(tmp_path)))
    assert sorted(i for batch in loader for i in batch["id"].tolist()) == list(range(TOTAL))
    loader.close()
    assert sorted(p.read_text() for p in tmp_path.glob("worker*")) == ["0 2", "1 2"]


def test_the_view_is_restored_after_each_read(monkeypatch) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    monkeypatch.delenv("WORKER", raising=False)
    with sole_reader():
        assert get_worker_info() is None
        assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("0", "1")
        assert "WORKER" not in os.environ
    assert (os.environ["RANK"], os.environ["WORLD_SIZE"]) == ("1", "2")
    monkeypatch.delenv("RANK")
    with sole_reader():
        assert os.environ["RANK"] == "0"
    assert "RANK" not in os.environ


# -- rank splitting --------------------------------------------------------------------------


def _ranks_ids(make: Callable[[int], Any], world_size: int = 2) -> list[list[int]]:
    out = []
    for rank in range(world_size):
        loader = make(rank)
        out.append([i for batch in loader for i in batch["id"].tolist()])
        loader.close()
    return out


@pytest.mark.parametrize("workers", [0, 2])
def test_a_dataset_splitting_by_the_rank_environment_is_read_whole(workers, monkeypatch,
                                                                   data_dir) -> None:
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("WORLD_SIZE", "2")
    ranks = _ranks_ids(lambda rank: ResumableLoader(
        EnvRankSplit(read_ids(str(data_dir))), batch_size=BATCH, num_workers=workers,
        rank=rank, world_size=2))
    assert len(ranks[0]) == len(ranks[1])
    assert sorted(ranks[0] + ranks[1]) == list(range(TOTAL))


@pytest.mark.parametrize("workers", [0, 2])
def test_webdataset_defaults_are_read_whole_on_each_of_two_ranks(workers, monkeypatch,
                                                                 data_dir) -> None:
    """``WebDataset(urls)``'s default nodesplitter (``single_node_only``) raises when it sees
    two ranks; inside the view it sees one, and the loader splits the stream itself (known
    length here: two ranks in one process; the DDP test below runs it with unknown length)."""
    monkeypatch.setenv("RANK", "0")
    monkeypatch.setenv("WORLD_SIZE", "2")
    with pytest.raises(ValueError, match="explicit nodesplitter"):
        next(iter(ddp_webdataset(str(data_dir))))
    ranks = _ranks_ids(lambda rank: ResumableLoader(
        ddp_webdataset(str(data_dir)).with_length(TOTAL), batch_size=BATCH,
        num_workers=workers, rank=rank, world_size=2))
    assert len(ranks[0]) == len(ranks[1])
    assert sorted(ranks[0] + ranks[1]) == list(range(TOTAL))


def test_hf_split_dataset_by_node_is_refused_with_the_fix(data_dir) -> None:
    split = split_dataset_by_node(ddp_hf(str(data_dir)), rank=1, world_size=2)
    with pytest.raises(ValueError, match=r"split_dataset_by_node \(rank 1 of 2\).*unsplit "
                                         r"dataset.*HFSource"):
        ResumableLoader(split, batch_size=BATCH)
    derived = split.map(lambda sample: sample)  # derived datasets carry the split
    with pytest.raises(ValueError, match="split_dataset_by_node"):
        ResumableLoader(derived, batch_size=BATCH)


@pytest.mark.parametrize("how", ["nodesplitter", "pipeline"])
def test_webdataset_split_by_node_is_refused_with_the_fix(how, data_dir) -> None:
    urls = sorted(str(path) for path in data_dir.glob("*.tar"))
    if how == "nodesplitter":
        dataset = wds.WebDataset(urls, shardshuffle=False, nodesplitter=wds.split_by_node)
    else:
        dataset = wds.DataPipeline(wds.SimpleShardList(urls), wds.split_by_node,
                                   wds.split_by_worker, wds.tarfile_to_samples())
    with pytest.raises(ValueError, match="split_by_node.*Drop the node splitter.*"
                                         "WebDatasetSource"):
        ResumableLoader(dataset, batch_size=BATCH)


def test_a_sized_stream_shorter_than_its_len_says_what_likely_happened(data_dir) -> None:
    """What a dataset splitting by ``torch.distributed`` looks like to one rank: its stream
    ends at half its ``len()``."""
    class HalfOfIt(DistRankSplit):
        def __iter__(self) -> Iterator[dict[str, int]]:
            return ({"id": i} for i in self.ids[::2])

    loader = ResumableLoader(HalfOfIt(read_ids(str(data_dir))), batch_size=BATCH)
    with pytest.raises(SampleFetchError, match="stream ended before sample 20, but its len\\(\\) "
                                               "is 40.*splits its stream itself by rank"):
        list(loader)


def _ranges(shard: tuple[int, int]) -> Iterator[int]:
    yield from range(*shard)


class LongerThanItsLen(IterableDataset[int]):
    """A stream of 23 samples whose ``__len__`` (an estimate) says 20."""

    def __len__(self) -> int:
        return 20

    def __iter__(self) -> Iterator[int]:
        return iter(range(23))


@pytest.mark.parametrize("workers", [0, 2])
@pytest.mark.parametrize("source", ["plain", "shards"])
def test_a_stream_longer_than_its_declared_length_is_refused(source: str, workers: int) -> None:
    """The samples past it would be lost every epoch, in silence (``DataLoader`` reads them)."""
    if source == "plain":
        dataset: Any = LongerThanItsLen()
        match = r"the LongerThanItsLen stream goes on past its len\(\) \(20\).*Fix __len__"
    else:
        dataset = GeneratorSource(_ranges, [(0, 10), (10, 23)], lengths=[10, 12])
        match = r"shard 1 goes on past its declared length \(12\).*shard_lengths"
    loader = ResumableLoader(dataset, batch_size=4, num_workers=workers)
    with pytest.raises(SampleFetchError, match=match):
        list(loader)
    loader.close()


# -- the Stateful protocol -------------------------------------------------------------------


@pytest.mark.parametrize("workers", [0, 2])
def test_a_map_style_datasets_own_state_comes_back_on_resume(workers) -> None:
    dataset = Curriculum(12)
    loader = ResumableLoader(dataset, batch_size=BATCH, num_workers=workers, seed=1)
    it = iter(loader)
    next(it)
    dataset.level = 3
    state = loader.state_dict()
    loader.close()
    fresh = Curriculum(12)
    resumed = ResumableLoader(fresh, batch_size=BATCH, num_workers=workers, seed=1)
    resumed.load_state_dict(state)
    assert fresh.level == 3
    assert {level for batch in resumed for level in batch["level"].tolist()} == {3}
    resumed.close()


class Versioned(Curriculum):
    """Refuses a saved state of another version, as a dataset checking its own state does."""

    def load_state_dict(self, state: dict[str, int]) -> None:
        if state.get("version", 1) != 1:
            raise ValueError(f"dataset state version {state['version']}, expected 1")
        super().load_state_dict(state)


def test_a_state_the_dataset_refuses_changes_nothing() -> None:
    """The cursor, the dataset and the skip count stay those of the last accepted state."""
    loader = ResumableLoader(Versioned(12), batch_size=BATCH, seed=1, shuffle=True)
    it = iter(loader)
    next(it)
    first = loader.state_dict()
    next(it)
    later = loader.state_dict()
    rest = [batch["id"].tolist() for batch in it]
    loader.close()
    later["parts"]["dataset"] = {"level": 5, "version": 2}
    resumed = ResumableLoader(Versioned(12), batch_size=BATCH, seed=1, shuffle=True)
    resumed.load_state_dict(first)
    with pytest.raises(ValueError, match="version 2, expected 1"):
        resumed.load_state_dict(later)
    assert resumed.state_dict() == first
    got = [batch["id"].tolist() for batch in resumed]
    assert got[1:] == rest and len(got) == len(rest) + 1
    resumed.close()


class Growing(Sampler[int]):
    """A ``Stateful`` sampler: each draw shows more of the dataset."""

    def __init__(self) -> None:
        self.stage = 0

    def __len__(self) -> int:
        return 16

    def __iter__(self) -> Iterator[int]:
        self.stage += 1
        return iter([i % (4 * self.stage) for i in range(16)])

    def state_dict(self) -> dict[str, int]:
        return {"stage": self.stage}

    def load_state_dict(self, state: dict[str, int]) -> None:
        self.stage = state["stage"]


def test_a_batch_samplers_stateful_sampler_comes_back_on_resume() -> None:
    full = check_resume_at_every_step(
        lambda: ResumableLoader(IndexDataset(16), seed=2,
                                batch_sampler=BatchSampler(Growing(), 4, drop_last=False)),
        epochs=3, key=lambda batch: batch["index"].tolist())
    assert [max(i for b in epoch for i in b) for epoch in full] == [3, 7, 11]


def test_only_a_map_style_datasets_own_state_is_saved(data_dir) -> None:
    """A dataset without state adds nothing; an iterable dataset's own state (HF has one) is
    not used, since the loader keeps the stream's position (resume tests above: exact)."""
    for dataset in (IndexDataset(8), ddp_hf(str(data_dir))):
        loader = ResumableLoader(dataset, batch_size=2)
        next(iter(loader))
        assert "dataset" not in loader.state_dict()["parts"]
        loader.close()
    assert callable(ddp_hf(str(data_dir)).state_dict)


# -- real DDP ---------------------------------------------------------------------------------


def test_ddp_trainer_reads_each_self_splitting_dataset_exactly_once_and_resumes(
        data_dir, tmp_path) -> None:
    """One launch: torch's pattern (unknown and known length), HF ``num_shards=4`` and
    ``WebDataset(urls)`` with its default nodesplitter, which under 2 ranks would raise by
    itself: inside the sole-reader view it sees one node and every id arrives once. A shuffle
    buffer drawing from the global RNGs as it iterates is one stream on every rank and in
    every slot, and resumes exactly: it reads under the RNG states of its own stream."""
    names = ["ddp_torch_doc", "ddp_torch_doc_sized", "ddp_shuffle_buffer", "ddp_hf",
             "ddp_webdataset"]
    runs = check_real_data_ddp([f"{MODULE}:{name}" for name in names], data_dir, TOTAL,
                               tmp_path / "ddp", workers=2)
    assert runs[f"{MODULE}:ddp_torch_doc_sized"][0]["len"] == 6  # 2 slots x 3 batches a rank


def test_hf_reorders_its_shards_per_epoch_and_every_worker_reads_that_order(data_dir) -> None:
    """HF keeps its epoch in memory shared with the workers: it is set once per epoch, so
    the two slots of each epoch read the same order (the dataset's own for that epoch)."""
    for _ in range(2):
        loader = ResumableLoader(ddp_hf(str(data_dir)), batch_size=BATCH, num_workers=2)
        for epoch, got in enumerate(_epoch_ids(loader, 3)):
            reference = ddp_hf(str(data_dir))
            reference.set_epoch(epoch)
            order = [sample["id"] for sample in reference]
            slots = [order[0::2], order[1::2]]
            expected = [i for b in range(5) for slot in slots for i in slot[b * 4:b * 4 + 4]]
            assert got == expected, f"epoch {epoch}"
        loader.close()


def test_ddp_datasets_splitting_by_torch_distributed_or_seeding_per_rank_are_refused(
        data_dir, tmp_path) -> None:
    """What the sole-reader view cannot undo is caught on real ranks, never quietly wrong:
    with or without a length, the ranks compare their len() and their streams' first samples
    at every epoch start of Lightning's loops (its data fetcher, which every rank runs alike),
    so a dataset that splits itself by rank (its len() the full one or its share) or shuffles
    with a seed of each process is refused on every rank, as is a len() that differs by rank,
    and in the epoch after one read before DDP started (placed at rank 0 of 1); a rank that
    refuses to begin the epoch (its len() changed there alone) is waited for (nothing hangs).
    A WebDataset seeding its shard shuffle per rank is read whole (the loader seeds its
    shuffles), and a shuffle buffer drawing from the global RNGs is one stream on every rank:
    every id arrives once. A loop of the user's compares nothing: on rank 0 alone it reads its
    share (it waited for rank 1 forever), and in a thread it leaves the main thread's
    all_reduce alone (gloo aborted: 'collective mismatch'). With compare_ranks=True a loop of
    the ranks' own, every rank alike (a Fabric loop), compares too: the rank split and the
    shuffle of each process are refused (before, 20 of 40 ids read, or ids repeated and lost)
    and one stream is read whole; compare_ranks=False compares nothing even in Lightning's
    loops (the rank split reads 20 of 40)."""
    runs = run_ddp(REPO / "tests" / "scripts" / "self_sharding_ddp.py", [str(data_dir)],
                   tmp_path / "ddp", timeout=120)
    for case in ("wds-seed-per-rank-w2", "shuffle-buffer-w0", "thread-beside-all-reduce",
                 "declared-own-loop-compared"):
        delivered = Counter(i for run in runs for i in run[case]["ids"])
        assert delivered == Counter(read_ids(str(data_dir))), case
    for rank, run in enumerate(runs):
        for case in ("dist-unsized-w0", "dist-unsized-w2", "dist-sized-w0", "dist-share-w0",
                     "seed-per-rank-w2", "own-shuffle-sized-w0", "own-shuffle-sized-w2",
                     "dist-unsized-own-loop-compared", "own-shuffle-sized-own-loop-compared"):
            assert run[case].get("error", "").startswith(
                "ValueError: the plain dataset's stream differs between ranks in epoch 0"), (
                rank, case, run[case])
        assert run["len-per-rank-w0"].get("error", "").startswith(
            "ValueError: the plain dataset's len() differs between ranks (from 39 to 40; "
            f"{40 - rank} here)"), (rank, run["len-per-rank-w0"])
        changed = ("RuntimeError: another rank failed to begin epoch 0 of the plain dataset",
                   "ValueError: the Declared's len() changed from 40 to 39")[rank]
        assert run["len-changed-on-one-w0"].get("error", "").startswith(changed), (
            rank, run["len-changed-on-one-w0"])
        before_ddp = run["read-before-ddp"]
        assert before_ddp["alone"] == sorted(read_ids(str(data_dir))), rank
        assert before_ddp.get("error", "").startswith(
            "ValueError: the plain dataset's stream differs between ranks in epoch 1"), (
            rank, before_ddp)
        assert run["no-batch-on-both-w0"].get("error", "").startswith(
            "ValueError: last_batch='drop' leaves no batch on some rank"), (
            rank, run["no-batch-on-both-w0"])
        assert run["thread-beside-all-reduce"]["grads"] == [3.0] * 5, rank
    never = [i for run in runs for i in run["dist-unsized-never-compared"]["ids"]]
    assert len(set(never)) == len(never) == 20, never
    alone = runs[0]["rank-0-alone"]["ids"]
    assert len(set(alone)) == len(alone) == 20 and set(alone) <= set(read_ids(str(data_dir)))
    assert "rank-0-alone" not in runs[1]
