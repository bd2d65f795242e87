"""WebDataset tar shards as a ``ShardedSource``: one tar file per shard, read with seeks.

A WebDataset shard is a tar file whose members are grouped into samples by name: the key is a
member's path up to the first dot of its basename, the rest is the extension, and consecutive
members with the same key form one sample ``{"__key__": key, "__url__": url,
"__local_path__": path, ext: bytes, ...}``, exactly what ``webdataset.WebDataset(urls)`` yields
(directories, ``__meta__`` members and names without a dot are left out, extensions are
lower-cased, a repeated extension within a sample is an error).

``WebDatasetSource`` walks the tar headers itself and hops over payloads with ``seek``: counting
a shard's samples (at construction, once) and skipping to a sample never read a payload, and
the shard iterator's ``state_dict()`` is the byte offset of the next sample's first header, so a
resume seeks straight there. gzip-compressed shards (``.tar.gz``) are read too, but a seek in
them decompresses what it skips. ``webdataset`` is not needed to read shards; ``braceexpand``
(installed with it) is needed only for brace patterns such as ``"shard-{000..127}.tar"``.
"""

from __future__ import annotations

import gzip
import io
import json
import os
import re
import struct
from collections.abc import Callable, Iterator, Mapping, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import IO, Any, Literal, NamedTuple
from urllib.parse import urlparse

import numpy as np

from lightning_loaders.hashing import digest
from lightning_loaders.sources.shards import ShardedSource, checked_lengths

__all__ = ["WebDatasetSource", "count_tar_samples", "decode_basic"]

Decode = Callable[[dict[str, Any]], Any] | str | Sequence[Callable[..., Any] | str] | None

_BLOCK = 512
_ZERO_BLOCK = bytes(_BLOCK)
_SIGNED_CHECKSUM = struct.Struct("148b8x356b")
_USTAR_MAGIC = b"ustar\x0000"
_REGULAR = frozenset(b"07\0")  # regular file, contiguous file, old-style regular file
_NO_PREFIX = frozenset(b"LKS")  # GNU headers, whose prefix field holds other data
_META = re.compile(r"__[^/]*__($|/)")  # WebDataset's skip_meta
_KEY_EXT = re.compile(r"^((?:.*/|)[^.]+)[.]([^/]*)$")  # WebDataset's base_plus_ext
_COUNT_THREADS = 8
_LOCAL_SCHEMES = ("", "file")

_BASIC: dict[str, Callable[[bytes], Any]] = {
    **dict.fromkeys(("cls", "cls2", "class", "count", "index", "inx", "id"), int),
    **dict.fromkeys(("txt", "text", "transcript"), lambda data: data.decode("utf-8")),
    **dict.fromkeys(("json", "jsn"), json.loads),
    "npy": lambda data: np.load(io.BytesIO(data), allow_pickle=False),
}


class WebDatasetSource(ShardedSource[Any]):
    """WebDataset-format tar files, one shard each, with known lengths and seeking resume.

    Args:
        urls: the shards: a list of paths or ``file:`` URLs (taken as they are, as
            ``webdataset.WebDataset`` takes a list), or one string as WebDataset users write
            it: ``"data/shard-{000..127}.tar"`` (brace-expanded), several such patterns joined
            by ``"::"``, or a single file. Remote URLs (``http:``, ``s3:``, ``pipe:``, ...) are
            refused: seeking needs a local or mounted file.
        decode: what a sample becomes. ``None``: the raw dict of ``bytes`` (as
            ``WebDataset(urls)`` yields). A callable: called with each raw sample dict, its
            result is the sample (``decode_basic``, a ``webdataset.autodecode.Decoder``, your own
            function). A string or a list of strings and WebDataset handlers: the same as
            ``WebDataset(urls).decode(*handlers)`` (strings name image decodings such as
            ``"pil"`` or ``"torchrgb"``; ``.cls``/``.txt``/``.json``/``.npy``/... are decoded by
            WebDataset's default handlers; needs ``webdataset``). Decoding runs where the
            shard is read (a worker process).
        lengths: samples per shard. ``"scan"`` (default) counts them once, here, by walking the
            tar headers (no payload is read or decoded); a list of ints skips the scan (from
            ``count_tar_samples`` saved earlier); ``None`` leaves them unknown (no ``len()``,
            and the loader then saves each reader's byte offset in its state).
    """

    seeks = True  # to a saved byte offset, or past samples skipped undecoded

    def __init__(self, urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]], *,
                 decode: Decode = None,
                 lengths: Sequence[int] | Literal["scan"] | None = "scan") -> None:
        self.urls = _expand(urls)
        self.paths = [_local_path(url) for url in self.urls]
        missing = [url for url, path in zip(self.urls, self.paths, strict=True)
                   if not os.path.isfile(path)]
        if missing:
            raise FileNotFoundError(f"WebDatasetSource: no such tar file(s): {missing[:5]}")
        self.decode = _decoder(decode)
        self.rng_free = _rng_free(decode)
        if lengths == "scan":
            self._lengths: list[int] | None = _count_all(self.paths)
        else:
            self._lengths = checked_lengths(lengths, len(self.urls))

    @property
    def shards(self) -> list[str]:
        return self.urls

    @property
    def shard_lengths(self) -> list[int] | None:
        return self._lengths

    def open_shard(self, index: int, start: int = 0,
                   state: Mapping[str, Any] | None = None) -> Iterator[Any]:
        return _SampleReader(self.urls[index], self.paths[index], start, state, self.decode)

    @property
    def fingerprint(self) -> str:
        names = [os.path.basename(path) for path in self.paths]
        return f"{super().fingerprint}:files {digest(names)}"


def decode_basic(sample: Mapping[str, Any]) -> dict[str, Any]:
    """Decode the common extensions of a raw sample, leave everything else as it is.

    By the last part of the extension: ``cls``/``cls2``/``class``/``count``/``index``/``inx``/
    ``id`` -> ``int``, ``txt``/``text``/``transcript`` -> ``str``, ``json``/``jsn`` -> the
    JSON value, ``npy`` -> a numpy array (``allow_pickle=False``). Needs no ``webdataset``.
    """
    out = dict(sample)
    for name, value in sample.items():
        decode = _BASIC.get(name.rsplit(".", 1)[-1].lower())
        if decode is not None and isinstance(value, bytes) and not name.startswith("__"):
            out[name] = decode(value)
    return out


def count_tar_samples(url: str | os.PathLike[str]) -> int:
    """Samples in one WebDataset tar file, grouped as ``WebDataset`` groups them (walks the
    headers and seeks over payloads; nothing is decoded)."""
    reader = _SampleReader(os.fspath(url), _local_path(os.fspath(url)), 0, None, None)
    try:
        return reader.skip_all()
    finally:
        reader.close()


class _Member(NamedTuple):
    """One tar member: where its headers start, its payload, and where the next one starts."""

    offset: int
    name: str
    data: int
    size: int
    regular: bool

    @property
    def end(self) -> int:
        return self.data + _padded(self.size)


class _Entry(NamedTuple):
    """A member that belongs to a sample."""

    member: _Member
    key: str
    ext: str


class _SampleReader(Iterator[Any]):
    """One shard from sample ``start`` on; ``state_dict()`` is the next sample's byte offset."""

    def __init__(self, url: str, path: str, start: int, state: Mapping[str, Any] | None,
                 decode: Callable[[dict[str, Any]], Any] | None) -> None:
        self.url, self.path, self.decode = url, path, decode
        self.position = 0
        self._file: IO[bytes] | None = _open(path)
        self._size = os.fstat(self._file.fileno()).st_size if _is_plain(self._file) else None
        self._eof = 0  # where the archive ended, once it has
        offset = 0
        if state is not None and state.get("position") == start and "offset" in state:
            offset, self.position = int(state["offset"]), start
        self._next = self._entry(offset)
        while self.position < start and self._sample(read=False) is not None:
            self.position += 1

    def state_dict(self) -> dict[str, int]:
        offset = self._next.member.offset if self._next is not None else self._eof
        return {"position": self.position, "offset": offset}

    def __next__(self) -> Any:
        sample = self._sample(read=True) if self._file is not None else None
        if sample is None:
            self.close()
            raise StopIteration
        self.position += 1
        return self.decode(sample) if self.decode is not None else sample

    def skip_all(self) -> int:
        """Pass over the rest of the shard without reading payloads; returns samples passed."""
        count = 0
        while self._sample(read=False) is not None:
            count += 1
        return count

    def close(self) -> None:
        file, self._file = getattr(self, "_file", None), None
        if file is not None:
            file.close()

    def __del__(self) -> None:
        self.close()

    def _sample(self, read: bool) -> dict[str, Any] | None:
        """The next sample (payloads read only with ``read``), ``None`` at the end."""
        entry = self._next
        if entry is None:
            return None
        key = entry.key
        sample: dict[str, Any] = {"__key__": key, "__url__": self.url, "__local_path__": self.path}
        seen: set[str] = set()
        while entry is not None and entry.key == key:
            if entry.ext in seen:
                raise ValueError(f"{self.url}: {entry.member.name}: duplicate extension "
                                 f"{entry.ext!r} in sample {key!r}")
            seen.add(entry.ext)
            if read:
                sample[entry.ext] = self._payload(entry.member)
            entry = self._entry(entry.member.end)
        self._next = entry
        return sample

    def _payload(self, member: _Member) -> bytes:
        assert self._file is not None
        self._file.seek(member.data)
        data = self._file.read(member.size)
        if len(data) < member.size:
            raise ValueError(f"{self.url}: {member.name} is truncated ({len(data)} of "
                             f"{member.size} bytes)")
        return data

    def _entry(self, offset: int) -> _Entry | None:
        """The first member at or after ``offset`` that belongs to a sample, as WebDataset
        selects them."""
        while (member := self._member(offset)) is not None:
            offset = member.end
            if not member.regular or _META.match(member.name):
                continue
            match = _KEY_EXT.match(member.name)
            if match is not None:
                return _Entry(member, match.group(1), match.group(2).lower())
        return None

    def _member(self, offset: int) -> _Member | None:
        """The member whose headers start at ``offset``; ``None`` at the end of the archive."""
        start, name, pax = offset, None, {}
        while True:
            block = self._block(offset)
            if block is None:
                self._eof = offset
                return None
            kind = block[156]
            size = _number(block[124:136])
            data = offset + _BLOCK
            if kind in b"LxXg":  # GNU long name, pax extended / global header
                payload = self._payload(_Member(offset, "(extended header)", data, size, False))
                if kind == ord("L"):
                    name = _text(payload.split(b"\0", 1)[0])
                elif kind != ord("g"):
                    pax.update(_pax_records(payload, self.url, offset))
                offset = data + _padded(size)
                continue
            if kind == ord("K"):  # GNU long link name: irrelevant here
                offset = data + _padded(size)
                continue
            if kind == ord("S") or (pax and any(k.startswith("GNU.sparse.") for k in pax)):
                raise ValueError(f"{self.url}: sparse tar member at byte {offset} is not "
                                 "supported (write shards with webdataset.TarWriter or plain tar)")
            if "path" in pax:
                name = pax["path"]
            elif name is None:
                name = _text(block[:100].split(b"\0", 1)[0])
                if kind not in _NO_PREFIX and block[257:265] == _USTAR_MAGIC:
                    prefix = _text(block[345:500].split(b"\0", 1)[0])
                    name = f"{prefix}/{name}" if prefix else name
            if "size" in pax:
                size = int(pax["size"])
            regular = kind in _REGULAR and not (kind == 0 and name.endswith("/"))
            member = _Member(start, name, data, size, regular)
            if self._size is not None and regular and member.data + size > self._size:
                raise ValueError(f"{self.url}: {name} is truncated (the file ends at byte "
                                 f"{self._size}, the member at {member.data + size})")
            return member

    def _block(self, offset: int) -> bytes | None:
        """The header block at ``offset``; ``None`` at the end of the archive."""
        assert self._file is not None
        self._file.seek(offset)
        block = self._file.read(_BLOCK)
        if 0 < len(block) < _BLOCK or (offset == 0 and not block) or (
                self._size is not None and offset > self._size):
            raise ValueError(f"{self.url}: the tar file is truncated (it ends at byte "
                             f"{offset + len(block) if self._size is None else self._size}, "
                             f"in or before the header block at byte {offset})")
        if not block or block == _ZERO_BLOCK:
            return None
        try:
            checksum = _number(block[148:156])
        except ValueError:
            checksum = -1
        unsigned = 256 + sum(block) - sum(block[148:156])
        if checksum != unsigned and checksum != 256 + sum(_SIGNED_CHECKSUM.unpack(block)):
            raise ValueError(f"{self.url}: invalid tar header at byte {offset} (bad checksum): "
                             "not a tar file, or a corrupt one")
        return block


def _padded(size: int) -> int:
    """Bytes a payload of ``size`` bytes occupies (whole blocks)."""
    return -(-size // _BLOCK) * _BLOCK


def _number(field: bytes) -> int:
    """A numeric header field: octal text, or base-256 (GNU) for large values."""
    if field[0] in (0o200, 0o377):
        value = int.from_bytes(field[1:], "big")
        return value - 256 ** (len(field) - 1) if field[0] == 0o377 else value
    text = field.split(b"\0", 1)[0].strip()
    return int(text, 8) if text else 0


def _text(raw: bytes) -> str:
    return raw.decode("utf-8", "surrogateescape")


def _pax_records(payload: bytes, url: str, offset: int) -> dict[str, str]:
    """The ``"LENGTH key=value\\n"`` records of a pax extended header."""
    records, pos = {}, 0
    while pos < len(payload) and payload[pos] != 0:
        space = payload.find(b" ", pos)
        length = int(payload[pos:space]) if space > pos and payload[pos:space].isdigit() else 0
        if length <= 0:
            raise ValueError(f"{url}: invalid pax header at byte {offset}")
        key, _, value = payload[space + 1:pos + length - 1].partition(b"=")
        records[_text(key)] = _text(value)
        pos += length
    return records


def _open(path: str) -> IO[bytes]:
    file = open(path, "rb")  # noqa: SIM115 (closed by the reader)
    if file.read(2) == b"\x1f\x8b":
        file.close()
        return gzip.open(path, "rb")  # type: ignore[return-value]
    file.seek(0)
    return file


def _is_plain(file: IO[bytes]) -> bool:
    return not isinstance(file, gzip.GzipFile)


def _expand(urls: str | os.PathLike[str] | Sequence[str | os.PathLike[str]]) -> list[str]:
    """The shard list: a string is split on ``::`` and brace-expanded, a list is taken as is."""
    if isinstance(urls, str):
        expanded: list[str] = []
        for pattern in urls.split("::"):
            expanded += _braceexpand(pattern) if "{" in pattern else [pattern]
    elif isinstance(urls, os.PathLike):
        expanded = [os.fspath(urls)]
    elif isinstance(urls, Sequence):
        expanded = [os.fspath(url) for url in urls]
    else:
        raise TypeError(f"WebDatasetSource: urls must be a path, a brace pattern or a list of "
                        f"paths, got {type(urls).__name__}")
    if not expanded:
        raise ValueError("WebDatasetSource needs at least one tar file")
    return expanded


def _braceexpand(pattern: str) -> list[str]:
    try:
        from braceexpand import braceexpand
    except ImportError as error:
        raise ImportError(f"expanding {pattern!r} needs the braceexpand package (installed with "
                          "webdataset); install it, or pass the list of files") from error
    return list(braceexpand(pattern))


def _local_path(url: str) -> str:
    """The file a URL names; remote URLs are refused (seeking needs a local file)."""
    if os.path.exists(url):
        return url
    parsed = urlparse(url)
    if parsed.scheme not in _LOCAL_SCHEMES:
        raise ValueError(
            f"WebDatasetSource reads local tar files (it seeks inside them to count samples and "
            f"to resume), got the remote URL {url!r}: download the shards or mount their "
            "storage as a file system, and pass the local paths")
    return parsed.path if parsed.scheme else url


def _rng_free(decode: Decode) -> bool:
    """Whether ``decode`` runs no code of the user's, which may draw from the global RNGs
    (WebDataset's handlers named by strings, ``decode_basic``, nothing)."""
    if decode is None or decode is decode_basic or isinstance(decode, str):
        return True
    return not callable(decode) and all(isinstance(handler, str) for handler in decode)


def _decoder(decode: Decode) -> Callable[[dict[str, Any]], Any] | None:
    if decode is None or callable(decode):
        return decode
    handlers = [decode] if isinstance(decode, str) else list(decode)
    try:
        from webdataset import autodecode
    except ImportError as error:
        raise ImportError("decode= with WebDataset handlers needs the webdataset package; "
                          "pass a callable (such as decode_basic) instead") from error
    return autodecode.Decoder([autodecode.ImageHandler(h) if isinstance(h, str) else h
                               for h in handlers])


def _count_all(paths: list[str]) -> list[int]:
    """Samples per file; files are walked in parallel threads (headers only)."""
    if len(paths) == 1:
        return [count_tar_samples(paths[0])]
    with ThreadPoolExecutor(min(_COUNT_THREADS, len(paths))) as pool:
        return list(pool.map(count_tar_samples, paths))
