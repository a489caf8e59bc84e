"""Reading DCP checkpoints without running code from them.

torch's ``FileSystemReader.read_metadata`` unpickles ``.metadata`` with plain ``pickle.load``, and its default
planner loads the non-tensor ("bytes") items with ``torch.load(weights_only=False)`` (torch 2.11 and 2.13): a
crafted run directory -- one downloaded, or copied from a shared folder -- would run its code when moetrain
resumes, evaluates or exports it, before any checksum could refuse the file (a checksum file can be crafted as
easily). Here both go through restricted loaders instead:

* ``.metadata``: an unpickler that builds only what DCP's metadata is made of -- the dataclasses of
  ``torch.distributed.checkpoint.metadata``, the file system reader's ``_StorageInfo``, ``torch.Size``, torch dtypes
  and layouts, and ``pathlib`` paths -- and refuses any other global (:class:`UnsafeCheckpointError`).
* bytes items: ``torch.load(weights_only=True)`` (tensors and plain Python values only).

The tensor shards themselves DCP already reads with ``torch.load(weights_only=True)``. Every moetrain read of a run
directory's DCP files goes through :class:`SafeFileSystemReader` and :class:`SafeLoadPlanner`
(``moetrain.train.checkpoint``, ``moetrain.train.evaluate``, ``moetrain.interop.dcp_read``).
"""

from __future__ import annotations

import io
import os
import pathlib
import pickle
from typing import Any

import torch
from torch.distributed.checkpoint import FileSystemReader
from torch.distributed.checkpoint.default_planner import DefaultLoadPlanner
from torch.distributed.checkpoint.metadata import Metadata, StorageMeta
from torch.distributed.checkpoint.planner import ReadItem

#: (module, name) pairs a DCP ``.metadata`` pickle may name, besides torch dtypes (``torch.<dtype name>``) and every
#: class of ``torch.distributed.checkpoint.metadata``: what torch 2.11 and 2.13 write.
_ALLOWED = {
    ("torch.distributed.checkpoint.filesystem", "_StorageInfo"),
    ("torch", "Size"),
    ("torch.serialization", "_get_layout"),
    ("pathlib", "Path"), ("pathlib", "PosixPath"), ("pathlib", "WindowsPath"), ("pathlib", "PurePosixPath"),
    ("pathlib", "PureWindowsPath"),
    ("collections", "OrderedDict"),
}
_METADATA_MODULE = "torch.distributed.checkpoint.metadata"


class UnsafeCheckpointError(pickle.UnpicklingError):
    """A checkpoint file names a Python object that DCP's metadata is not made of (it would run code if loaded)."""


class _MetadataUnpickler(pickle.Unpickler):
    def find_class(self, module: str, name: str) -> Any:
        if module == _METADATA_MODULE or (module, name) in _ALLOWED:
            return super().find_class(module, name)
        if module == "torch" and isinstance(getattr(torch, name, None), torch.dtype):
            return getattr(torch, name)
        raise UnsafeCheckpointError(f"it names {module}.{name}, which a DCP checkpoint's metadata never holds; "
                                    f"moetrain does not load it (loading would run code from the file)")


def read_dcp_metadata(path: str | os.PathLike) -> Metadata:
    """The ``Metadata`` of the DCP checkpoint directory ``path`` through the restricted unpickler.

    Raises:
        UnsafeCheckpointError: the file names an object outside DCP's metadata classes.
        OSError, pickle.UnpicklingError, EOFError: an unreadable or truncated file.
    """
    with open(pathlib.Path(path) / ".metadata", "rb") as f:
        metadata = _MetadataUnpickler(f).load()
    if not isinstance(metadata, Metadata):
        raise UnsafeCheckpointError(f"its .metadata holds a {type(metadata).__name__}, not DCP Metadata")
    return metadata


class SafeFileSystemReader(FileSystemReader):
    """torch's ``FileSystemReader`` whose metadata comes through :func:`read_dcp_metadata` (the rest is torch's)."""

    def read_metadata(self, *args: Any, **kwargs: Any) -> Metadata:
        if kwargs.get("rank") is not None:
            raise UnsafeCheckpointError("per-rank DCP metadata files are not read by moetrain")
        metadata = read_dcp_metadata(self.path)
        if getattr(metadata, "storage_meta", None) is None:
            metadata.storage_meta = StorageMeta()
        metadata.storage_meta.load_id = self.load_id
        return metadata


class SafeLoadPlanner(DefaultLoadPlanner):
    """torch's default load planner for moetrain's flat state dicts (keys as saved: no nested dicts to flatten),
    with the bytes items loaded ``weights_only`` (plain values, never objects)."""

    def __init__(self) -> None:
        super().__init__(flatten_state_dict=False)

    def load_bytes(self, read_item: ReadItem, value: io.BytesIO) -> None:
        self.state_dict[read_item.dest_index.fqn] = torch.load(value, weights_only=True)


def safe_load(state_dict: dict[str, Any], path: str | os.PathLike, **kwargs: Any) -> None:
    """``dcp.load(state_dict, checkpoint_id=path)`` through :class:`SafeFileSystemReader` and
    :class:`SafeLoadPlanner`; ``kwargs`` go to ``dcp.load``."""
    import torch.distributed.checkpoint as dcp

    dcp.load(state_dict, storage_reader=SafeFileSystemReader(str(path)), planner=SafeLoadPlanner(), **kwargs)
