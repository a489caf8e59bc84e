"""Read boxes (sub-blocks in global coordinates) of tensors out of a ``torch.distributed.checkpoint`` (DCP)
checkpoint directory in one process, without a process group.

A DCP checkpoint stores every tensor as a list of saved *chunks* (one per rank that held a distinct shard, each with
``offsets`` and ``sizes`` in the tensor's global coordinates; a plain tensor is one chunk at offset 0) and a
``.metadata`` file that lists them. A requested box ``[offsets, offsets + sizes)`` is exactly what a DTensor's local
shard is to DCP: a ``ChunkStorageMetadata`` in global coordinates. So the reads are planned with DCP's own resharding
helper, :func:`torch.distributed.checkpoint.planner_helpers.create_read_items_for_chunk_list` (the function
:class:`~torch.distributed.checkpoint.DefaultLoadPlanner` uses for a DTensor's local chunk), which yields one
``ReadItem`` per (requested box, overlapping saved chunk); saved chunks that do not overlap any requested box are never
opened. The items are executed by one ``dcp.load(..., no_dist=True)`` call through a
:class:`~torch.distributed.checkpoint.FileSystemReader` whose ``read_data`` runs them one at a time, in file order.

Memory: DCP deserialises a whole saved chunk for every ``ReadItem`` (``torch.load`` of that chunk's byte range) and
copies the overlap into the destination, casting to the destination's dtype. Running the items one at a time frees
each chunk before the next is loaded, so the peak beyond the caller's destination tensors is one saved chunk (the
stock reader keeps the previous chunk alive while it loads the next one, i.e. two). The price is that a file is
opened once per ``ReadItem`` instead of once per call; only the chunk's own byte range is read each time.

A saved chunk that overlaps k requested boxes of one call is deserialised k times. When many small boxes come from
one chunk (e.g. one expert at a time out of an expert-parallel shard of a stacked ``(E, F, D)`` weight), request the
covering box once and slice it.

Keys are DCP's flattened names: ``dcp.save({"model": {"w": t}})`` stores ``"model.w"``.
"""

from __future__ import annotations

import difflib
import math
import os
import threading
import warnings
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Sequence

import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import (
    ChunkStorageMetadata,
    Metadata,
    TensorStorageMetadata,
)
from torch.distributed.checkpoint.planner import LoadPlan, LoadPlanner, ReadItem
from torch.distributed.checkpoint.planner_helpers import create_read_items_for_chunk_list
from torch.distributed.tensor import DTensor

from moetrain.interop.dcp_safe import SafeFileSystemReader, read_dcp_metadata

__all__ = ["BoxRequest", "DCPReadError", "DCPKeyError", "TensorSpec", "BoxLoadPlanner", "checkpoint_tensors",
           "read_boxes", "read_tensor"]

METADATA_NAME = ".metadata"  # the file dcp.save writes last; its presence marks a complete checkpoint
_N_CLOSE_KEYS = 5


class DCPReadError(ValueError):
    """A request does not fit the checkpoint (box outside the stored shape, wrong rank, non-tensor entry), or the
    checkpoint cannot be read."""


class DCPKeyError(DCPReadError, KeyError):
    """A requested key is not stored in the checkpoint. Both a ``KeyError`` and a ``ValueError``."""

    def __str__(self) -> str:  # KeyError's str() would repr() the message
        return str(self.args[0]) if self.args else ""


@dataclass(frozen=True)
class TensorSpec:
    """Global shape (elements per dim) and stored dtype of one tensor in a checkpoint."""

    shape: tuple[int, ...]
    dtype: torch.dtype


@dataclass(frozen=True)
class BoxRequest:
    """Fill ``dest`` with the stored values of ``key`` in the global box ``[offsets, offsets + dest.shape)``.

    ``offsets``: one start index (elements) per dim of the stored tensor, ``()`` for a 0-d tensor. ``dest``: a plain
    tensor of the box's shape, any dtype and device (values are cast on copy); it may be a view into a larger tensor.
    """

    key: str
    offsets: tuple[int, ...]
    dest: torch.Tensor


# ----------------------------------------------------------------------------------------------------------------
# Metadata
# ----------------------------------------------------------------------------------------------------------------

_metadata_cache: dict[str, tuple[tuple[int, int, int], Metadata]] = {}
_metadata_lock = threading.Lock()
_METADATA_CACHE_SIZE = 4


def _load_metadata(ckpt_dir: str | os.PathLike) -> tuple[Path, Metadata]:
    """The checkpoint's ``Metadata``, cached per directory while ``.metadata`` is unchanged (inode, size, mtime): a
    large checkpoint's metadata lists every saved chunk and is slow to unpickle for each call of an export loop.

    Raises FileNotFoundError naming the path when it is not a directory with a ``.metadata`` file, and DCPReadError
    when that file cannot be unpickled as DCP ``Metadata``.
    """
    path = Path(ckpt_dir)
    md_path = path / METADATA_NAME
    if not path.is_dir():
        raise FileNotFoundError(f"DCP checkpoint directory {str(path)!r} does not exist or is not a directory")
    try:
        st = md_path.stat()
    except FileNotFoundError:
        raise FileNotFoundError(
            f"{str(path)!r} is not a torch.distributed.checkpoint directory: no {METADATA_NAME} file in it "
            "(dcp.save writes it last, so the save may also be incomplete)") from None
    stamp = (st.st_ino, st.st_size, st.st_mtime_ns)
    cache_key = str(path.resolve())
    with _metadata_lock:
        hit = _metadata_cache.get(cache_key)
        if hit is not None and hit[0] == stamp:
            return path, hit[1]
    try:
        metadata = read_dcp_metadata(path)
    except Exception as e:  # pickle errors of a truncated/foreign file come in many types
        raise DCPReadError(f"cannot read DCP metadata {str(md_path)!r}: {type(e).__name__}: {e}") from e
    if not isinstance(metadata, Metadata) or not isinstance(metadata.state_dict_metadata, dict):
        raise DCPReadError(f"{str(md_path)!r} does not hold torch.distributed.checkpoint Metadata "
                           f"(got {type(metadata).__name__})")
    with _metadata_lock:
        _metadata_cache[cache_key] = (stamp, metadata)
        while len(_metadata_cache) > _METADATA_CACHE_SIZE:
            _metadata_cache.pop(next(iter(_metadata_cache)))
    return path, metadata


def checkpoint_tensors(ckpt_dir: str | os.PathLike) -> dict[str, TensorSpec]:
    """Every tensor stored in the DCP checkpoint at ``ckpt_dir``: flattened key -> :class:`TensorSpec` (global shape
    and stored dtype), sorted by key. Non-tensor entries (DCP ``BytesStorageMetadata``: ints, lists, objects) are left
    out. Reads only the ``.metadata`` file.

    Raises FileNotFoundError (path named) if ``ckpt_dir`` is not a directory holding a ``.metadata`` file, and
    DCPReadError if that file is not DCP metadata.
    """
    _, metadata = _load_metadata(ckpt_dir)
    return {k: TensorSpec(shape=tuple(int(s) for s in md.size), dtype=md.properties.dtype)
            for k, md in sorted(metadata.state_dict_metadata.items()) if isinstance(md, TensorStorageMetadata)}


# ----------------------------------------------------------------------------------------------------------------
# Planning
# ----------------------------------------------------------------------------------------------------------------

def _tensor_md(metadata: Metadata, key: str) -> TensorStorageMetadata:
    sd_md = metadata.state_dict_metadata
    md = sd_md.get(key)
    if md is None:
        tensor_keys = [k for k, v in sd_md.items() if isinstance(v, TensorStorageMetadata)]
        close = difflib.get_close_matches(key, tensor_keys, n=_N_CLOSE_KEYS, cutoff=0.5)
        hint = f"; close keys: {close}" if close else ""
        raise DCPKeyError(f"key {key!r} is not in the checkpoint ({len(tensor_keys)} tensors stored{hint})")
    if not isinstance(md, TensorStorageMetadata):
        raise DCPReadError(f"key {key!r} is a non-tensor entry ({type(md).__name__}), not a tensor")
    return md


def _check_box(key: str, md: TensorStorageMetadata, offsets: Sequence[int], sizes: Sequence[int]) -> None:
    shape = tuple(int(s) for s in md.size)
    box = f"offsets {tuple(offsets)} sizes {tuple(sizes)}"
    if len(offsets) != len(shape) or len(sizes) != len(shape):
        raise DCPReadError(f"box {box} for key {key!r} has {len(offsets)} offsets and {len(sizes)} sizes, but the "
                           f"stored tensor has shape {shape} ({len(shape)} dims)")
    for d, (o, s, n) in enumerate(zip(offsets, sizes, shape)):
        if o < 0 or s < 0 or o + s > n:
            raise DCPReadError(f"box {box} for key {key!r} lies outside the stored shape {shape} (dim {d}: "
                               f"[{o}, {o + s}) not within [0, {n}))")


class BoxLoadPlanner(DefaultLoadPlanner):
    """A :class:`~torch.distributed.checkpoint.DefaultLoadPlanner` whose "state dict" is a list of
    :class:`BoxRequest`.

    Requests for one key are passed together as that key's local chunks to
    :func:`~torch.distributed.checkpoint.planner_helpers.create_read_items_for_chunk_list` (DCP's resharding
    sweep), exactly as the default planner does for a DTensor's or ShardedTensor's local chunks. Each ``ReadItem``'s
    ``dest_index`` is ``MetadataIndex(key, box offsets, i)`` with ``i`` the request's position among that key's
    requests, which :meth:`resolve_tensor` maps back to the request's ``dest``, narrowed to the overlap.

    :meth:`plan_reads` validates the requests and builds the items before any I/O; ``dcp.load`` then calls
    :meth:`create_local_plan`, which returns them. ``read_items`` holds the last plan (for inspection and tests).
    """

    def __init__(self, requests: Sequence[BoxRequest]) -> None:
        super().__init__(flatten_state_dict=False, flatten_sharded_tensors=False, allow_partial_load=True)
        self.requests = list(requests)
        self._dests: dict[tuple[str, int], torch.Tensor] = {}
        self.read_items: list[ReadItem] | None = None

    def plan_reads(self, metadata: Metadata) -> list[ReadItem]:
        """Validate the requests against ``metadata`` and return the ``ReadItem`` list, sorted by file and offset
        (where the storage data says so) so that each file is read front to back.

        Raises DCPKeyError for an unknown key (with up to 5 close keys), DCPReadError for a non-tensor key, a box
        of the wrong rank or outside the stored shape, a ``dest`` that is not a plain tensor, or saved chunks that
        do not cover a box.
        """
        by_key: dict[str, list[int]] = {}
        for n, r in enumerate(self.requests):
            if not isinstance(r.dest, torch.Tensor) or isinstance(r.dest, DTensor):
                raise DCPReadError(f"request {n} for key {r.key!r}: dest must be a plain torch.Tensor, "
                                   f"got {type(r.dest).__name__}")
            md = _tensor_md(metadata, r.key)
            _check_box(r.key, md, tuple(int(o) for o in r.offsets), tuple(r.dest.shape))
            by_key.setdefault(r.key, []).append(n)

        self._dests = {}
        items: list[ReadItem] = []
        for key, idxs in by_key.items():
            md = metadata.state_dict_metadata[key]
            chunks = [ChunkStorageMetadata(offsets=torch.Size([int(o) for o in self.requests[n].offsets]),
                                           sizes=torch.Size(self.requests[n].dest.shape)) for n in idxs]
            covered = [0] * len(idxs)
            for item in create_read_items_for_chunk_list(key, md, chunks):
                volume = math.prod(item.lengths)
                if volume == 0:  # an empty saved chunk (uneven sharding) touching the box: nothing to copy
                    continue
                covered[item.dest_index.index] += volume
                items.append(item)
            for local, n in enumerate(idxs):
                self._dests[(key, local)] = self.requests[n].dest
                want = math.prod(chunks[local].sizes)
                if covered[local] < want:
                    raise DCPReadError(
                        f"the saved chunks of key {key!r} cover only {covered[local]} of the {want} elements of box "
                        f"offsets {tuple(chunks[local].offsets)} sizes {tuple(chunks[local].sizes)}: the checkpoint "
                        "is incomplete")
        storage = metadata.storage_data if isinstance(metadata.storage_data, dict) else {}

        def file_order(item: ReadItem) -> tuple[str, int]:
            info = storage.get(item.storage_index)
            return (str(getattr(info, "relative_path", "")), int(getattr(info, "offset", 0)))

        items.sort(key=file_order)
        self.read_items = items
        return items

    # -- LoadPlanner protocol (called by dcp.load) ----------------------------------------------------------------

    def set_up_planner(self, state_dict: dict[str, Any], metadata: Metadata | None = None,
                       is_coordinator: bool = False) -> None:
        super().set_up_planner(state_dict, metadata, is_coordinator)
        if metadata is None:
            raise DCPReadError("dcp.load passed no checkpoint metadata to the planner")
        if self.read_items is None:
            self.plan_reads(metadata)

    def create_local_plan(self) -> LoadPlan:
        assert self.read_items is not None
        return LoadPlan(list(self.read_items))

    def resolve_tensor(self, read_item: ReadItem) -> torch.Tensor:
        dest = self._dests[(read_item.dest_index.fqn, read_item.dest_index.index)]
        for dim, (start, length) in enumerate(zip(read_item.dest_offsets, read_item.lengths)):
            dest = dest.narrow(dim, start, length)
        return dest

    def commit_tensor(self, read_item: ReadItem, tensor: torch.Tensor) -> None:
        pass

    def load_bytes(self, read_item: ReadItem, value: Any) -> None:
        raise DCPReadError(f"BoxLoadPlanner plans no byte reads, got one for {read_item.dest_index.fqn!r}")


# ----------------------------------------------------------------------------------------------------------------
# Reading
# ----------------------------------------------------------------------------------------------------------------

class _OneChunkAtATimeReader(SafeFileSystemReader):
    """FileSystemReader that returns the already-read metadata and runs the plan's ReadItems one per
    ``FileSystemReader.read_data`` call, so each deserialised saved chunk is freed before the next is loaded."""

    def __init__(self, path: str | os.PathLike, metadata: Metadata) -> None:
        super().__init__(path)
        self._metadata = metadata

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        return self._metadata

    def read_data(self, plan: LoadPlan, planner: LoadPlanner):
        fut = None
        for item in plan.items:
            fut = super().read_data(LoadPlan([item], plan.storage_data, plan.planner_data), planner)
            fut.wait()
        if fut is None:
            fut = super().read_data(LoadPlan([], plan.storage_data, plan.planner_data), planner)
        return fut


def read_boxes(ckpt_dir: str | os.PathLike, requests: Sequence[BoxRequest]) -> None:
    """Fill each request's ``dest`` with the stored values of its box (see :class:`BoxRequest`), in one
    ``dcp.load`` call without a process group (works whether or not one is initialised).

    Only saved chunks overlapping a requested box are read, one at a time; each is copied into the overlapping
    part of every box it serves (cast to ``dest.dtype``). Several requests may name the same key. Peak memory
    beyond the destinations: one saved chunk. Requests are all validated before anything is read.

    Raises:
        FileNotFoundError: ``ckpt_dir`` is not a directory with a ``.metadata`` file (path named).
        DCPKeyError (a KeyError and ValueError): a key is not stored; names it and up to 5 close keys.
        DCPReadError (ValueError): a box outside the stored shape or of the wrong rank (key, box and stored shape
            named), a non-tensor key, a ``dest`` that is not a plain tensor, an incomplete or unreadable checkpoint.
    """
    if not requests:
        return
    path, metadata = _load_metadata(ckpt_dir)
    planner = BoxLoadPlanner(requests)
    planner.plan_reads(metadata)
    reader = _OneChunkAtATimeReader(path, metadata)
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled, unavailable or uninitialized")
        try:
            with torch.no_grad():
                dcp.load({}, storage_reader=reader, planner=planner, process_group=None, no_dist=True)
        except CheckpointException as e:  # DCP wraps each step's exception; re-raise the original one
            failures = list(e.failures.values())
            original = failures[0][0] if failures else None
            if isinstance(original, Exception):
                if isinstance(original, (OSError, DCPReadError)):
                    raise original from e
                raise DCPReadError(f"reading {str(path)!r} failed: {type(original).__name__}: {original}") from e
            raise


def read_tensor(ckpt_dir: str | os.PathLike, key: str, offsets: Sequence[int] | None = None,
                sizes: Sequence[int] | None = None, dtype: torch.dtype | None = None) -> torch.Tensor:
    """One box of ``key`` as a new CPU tensor of shape ``sizes``: ``offsets`` defaults to all zeros, ``sizes`` to the
    rest of the tensor from ``offsets`` (so no arguments read the whole tensor), ``dtype`` to the stored dtype.

    Raises as :func:`read_boxes` does.
    """
    _, metadata = _load_metadata(ckpt_dir)
    md = _tensor_md(metadata, key)
    shape = tuple(int(s) for s in md.size)
    offs = tuple(int(o) for o in offsets) if offsets is not None else (0,) * len(shape)
    if sizes is None:
        if len(offs) != len(shape):
            _check_box(key, md, offs, (0,) * len(offs))
        sizes = tuple(max(n - o, 0) for n, o in zip(shape, offs))
    sizes = tuple(int(s) for s in sizes)
    _check_box(key, md, offs, sizes)
    out = torch.empty(sizes, dtype=dtype if dtype is not None else md.properties.dtype)
    read_boxes(ckpt_dir, [BoxRequest(key, offs, out)])
    return out
