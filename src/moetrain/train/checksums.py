"""Content checksums of a checkpoint's files: computed while DCP writes them, kept in ``checksums.json`` beside the
shards, checked before a checkpoint is resumed or exported.

Why while writing: a second pass over a checkpoint of hundreds of GB per node costs as long as the write itself.
DCP lets the caller choose its storage writer and that writer's file system (``FileSystemWriter.fs``, a public
``torch.distributed.checkpoint.filesystem.FileSystem`` whose ``create_stream`` is its extension point), so
:class:`ChecksumWriter` hands DCP streams that hash every byte on its way to the file, in the writer's own threads
(hashlib releases the GIL on large buffers). DCP writes each file front to back; a stream that was seeked, or whose
final position differs from the bytes hashed, is not trusted and its file is hashed again right after the write,
while the page cache is hot (:func:`manifest_of`).

``checksums.json``::

    {"algorithm": "sha256", "files": {"__0_0.distcp": {"bytes": 1234, "sha256": "ab..."}, ".metadata": {...},
                                      "trainer_state.json": {...}}}

SHA-256: hashlib's fastest hash on CPUs with SHA extensions (x86 since 2017, ARMv8 servers), about twice blake2b
there. It runs in the writer's thread, so a save takes longer by about the checkpoint's bytes over one core's
SHA-256 rate; every rank hashes its own files.
"""

from __future__ import annotations

import hashlib
import io
import json
import os
import threading
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from torch.distributed.checkpoint.filesystem import FileSystem, FileSystemWriter

from moetrain.errors import CheckpointError

ALGORITHM = "sha256"
MANIFEST = "checksums.json"
_CHUNK = 8 * 2 ** 20

#: (bytes, hex digest) of one file.
FileSum = tuple[int, str]


class _HashingStream(io.RawIOBase):
    """A write stream that hashes what it forwards to ``raw``. ``digest()`` is None unless every byte of the file
    went through ``write`` in order (no seek, and the file position equals the bytes hashed)."""

    def __init__(self, raw: Any):
        super().__init__()
        self.raw, self.hash, self.n, self.seeked, self.end = raw, hashlib.new(ALGORITHM), 0, False, None

    def writable(self) -> bool:
        return True

    def write(self, b: Any) -> int:
        view = memoryview(b).cast("B")
        n = self.raw.write(view)
        n = len(view) if n is None else n
        self.hash.update(view[:n])
        self.n += n
        return n

    def seek(self, offset: int, whence: int = os.SEEK_SET) -> int:
        self.seeked = True
        return self.raw.seek(offset, whence)

    def seekable(self) -> bool:
        return self.raw.seekable()

    def tell(self) -> int:
        return self.raw.tell()

    def truncate(self, size: int | None = None) -> int:
        self.seeked = True
        return self.raw.truncate(size)

    def fileno(self) -> int:
        return self.raw.fileno()

    def flush(self) -> None:
        if not self.raw.closed:
            self.raw.flush()

    def close(self) -> None:
        if not self.raw.closed:
            self.end = self.raw.tell()
        super().close()  # flushes
        self.raw.close()

    def digest(self) -> FileSum | None:
        end = self.end if self.end is not None else (self.raw.tell() if not self.raw.closed else None)
        if self.seeked or end != self.n:
            return None
        return self.n, self.hash.hexdigest()


class _HashingFileSystem(FileSystem):
    """DCP's local file system, hashing every file it writes; ``sums`` maps a file name to its (bytes, digest),
    or to None where the stream could not vouch for the bytes (hashed again by :func:`manifest_of`)."""

    def __init__(self) -> None:
        super().__init__()
        self.sums: dict[str, FileSum | None] = {}
        self._lock = threading.Lock()  # DCP writes with thread_count threads

    @contextmanager
    def create_stream(self, path: str | os.PathLike, mode: str) -> Iterator[io.IOBase]:
        with super().create_stream(path, mode) as raw:
            if "w" not in mode:
                yield raw
                return
            stream = _HashingStream(raw)
            yield stream
            digest = stream.digest()
        with self._lock:
            self.sums[Path(path).name] = digest

    def rename(self, path: str | os.PathLike, new_path: str | os.PathLike) -> None:
        super().rename(path, new_path)
        with self._lock:  # DCP writes .metadata as .metadata.tmp and renames it
            if Path(path).name in self.sums:
                self.sums[Path(new_path).name] = self.sums.pop(Path(path).name)


class ChecksumWriter(FileSystemWriter):
    """DCP's :class:`~torch.distributed.checkpoint.FileSystemWriter` (same files, same layout) that records the
    size and SHA-256 of every file this rank writes, in ``sums`` (file name -> (bytes, hex digest) or None)."""

    def __init__(self, path: str | os.PathLike):
        super().__init__(path)
        self.fs = _HashingFileSystem()

    @property
    def sums(self) -> dict[str, FileSum | None]:
        return self.fs.sums


def file_sum(path: Path) -> FileSum:
    """(bytes, SHA-256 hex digest) of ``path``, read in 8 MiB chunks."""
    h, n = hashlib.new(ALGORITHM), 0
    buf = bytearray(_CHUNK)
    view = memoryview(buf)
    with open(path, "rb", buffering=0) as f:
        while k := f.readinto(buf):
            h.update(view[:k])
            n += k
    return n, h.hexdigest()


def manifest_of(ckpt: Path, sums: dict[str, FileSum | None], extra: list[str]) -> dict[str, Any]:
    """The ``checksums.json`` content of checkpoint directory ``ckpt``: ``sums`` (every rank's, merged), the
    entries without a trusted digest and the ``extra`` files (written outside DCP) hashed from disk now."""
    files = {}
    for name in sorted({*sums, *extra}):
        got = sums.get(name) or file_sum(ckpt / name)
        files[name] = {"bytes": got[0], ALGORITHM: got[1]}
    return {"algorithm": ALGORITHM, "files": files}


def read_manifest(ckpt: Path) -> dict[str, FileSum] | None:
    """{file name: (bytes, digest)} of ``ckpt``'s ``checksums.json``; None when it has none (a checkpoint of an
    earlier moetrain).

    Raises:
        CheckpointError: the manifest is damaged (naming it).
    """
    p = ckpt / MANIFEST
    if not p.is_file():
        return None
    try:
        raw = json.loads(p.read_text())
        if raw["algorithm"] != ALGORITHM:
            raise ValueError(f"algorithm {raw['algorithm']!r}, this moetrain checks {ALGORITHM!r}")
        return {name: (int(e["bytes"]), str(e[ALGORITHM])) for name, e in raw["files"].items()}
    except (ValueError, KeyError, TypeError, AttributeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{p} is damaged ({type(e).__name__}: {e})") from None


def check_files(ckpt: Path, manifest: dict[str, FileSum], threads: int = 8) -> None:
    """Read every file of ``manifest`` and compare its size and SHA-256 with the recorded ones, the files in
    parallel (``threads`` readers: hashlib releases the GIL, so several files hash at disk speed).

    Raises:
        CheckpointError: naming the first (by name) file that is missing, has another size, or another digest.
    """
    names = sorted(manifest)

    def problem(name: str) -> str | None:
        f, (size, want) = ckpt / name, manifest[name]
        if not f.is_file():
            return f"{f} is missing"
        if f.stat().st_size != size:
            return f"{f} has {f.stat().st_size} bytes, {size} when written (truncated or overwritten)"
        got = file_sum(f)[1]
        if got != want:
            return (f"{f} does not match its checksum ({ALGORITHM} {got[:12]}..., written as {want[:12]}...): "
                    f"damaged on disk after the save, or {MANIFEST} itself was changed")
        return None

    with ThreadPoolExecutor(max_workers=max(1, min(threads, len(names)))) as pool:
        for msg in pool.map(problem, names):
            if msg is not None:
                raise CheckpointError(msg)
