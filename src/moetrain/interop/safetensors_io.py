"""Safetensors checkpoint directories as Hugging Face writes them, for any model: this module knows file names, the
shard index and atomic directory writes, and nothing about which tensors a model has (that is the state-dict
adapter's business, :mod:`moetrain.interop.adapter`).

A checkpoint is either one ``model.safetensors`` or shards ``model-0000i-of-0000N.safetensors`` with
``model.safetensors.index.json`` (``{"metadata": {"total_size": bytes}, "weight_map": {tensor name: shard file}}``),
beside ``config.json``. Reads go through ``safe_open`` (lazy: a tensor, or a slice of one, is read only when asked
for); writes build the whole directory in a temporary sibling that is renamed onto the target only when complete.
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import uuid
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Callable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file

from moetrain.errors import CheckpointError
from moetrain.fsutil import fsync_path

INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"


@dataclass
class HFSpec:
    """One tensor of a HF checkpoint to write: its name, shape and stored dtype, and where its values come from (the
    model tensor ``name`` at ``region`` offsets of its global tensor)."""

    hf_name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    name: str
    region: tuple[int, ...]


#: Reads the tensors of one output shard: ``fetch(specs of the shard) -> {hf_name: CPU tensor}``.
ShardFetch = Callable[[list[HFSpec]], dict[str, torch.Tensor]]


def fmt_shape(s) -> str:
    """``(a, b, ...)`` of a shape given as any sequence of ints."""
    return "(" + ", ".join(str(int(x)) for x in s) + ")"


def checkpoint_files(path: Path) -> tuple[list[Path], dict[str, Path]]:
    """The safetensors files of the checkpoint at ``path`` (a directory, its index file, or one ``.safetensors``
    file) and, for a sharded one, the file of every tensor name (empty for a single file).

    Raises:
        CheckpointError: the index names shards that do not exist, or the directory holds neither a
            ``model.safetensors`` nor an index.
    """
    if path.is_file():
        if path.name == INDEX_NAME:
            path = path.parent
        else:
            return [path], {}
    index = path / INDEX_NAME
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [fn for fn in files if not (path / fn).is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that do not exist: {missing[:5]}")
        return [path / fn for fn in files], {k: path / v for k, v in weight_map.items()}
    single = path / SINGLE_NAME
    if single.is_file():
        return [single], {}
    raise CheckpointError(f"no {SINGLE_NAME} or {INDEX_NAME} in {path}")


@contextmanager
def open_safetensors(path: str | os.PathLike) -> Iterator[Any]:
    """``safe_open`` (CPU, torch) whose failure on a damaged file (truncated, garbage, empty) names the file.

    Raises:
        CheckpointError: the file cannot be opened as safetensors.
    """
    try:
        cm = safe_open(str(path), framework="pt", device="cpu")
        f = cm.__enter__()
    except Exception as e:  # noqa: BLE001 - SafetensorError and friends
        raise CheckpointError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e}); re-download or "
                              f"re-export it") from None
    try:
        yield f
    finally:
        cm.__exit__(None, None, None)


def write_json(p: Path, obj: Any) -> None:
    """Write ``obj`` as indented JSON to ``p`` and fsync it."""
    with open(p, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def _plan_shards(specs: list[HFSpec], max_shard_bytes: float) -> tuple[list[list[HFSpec]], int]:
    """Specs split into shards in order (a new shard starts before a tensor that would take the current one past
    ``max_shard_bytes``; a single larger tensor gets a shard of its own) and the total size in bytes."""
    shards: list[list[HFSpec]] = [[]]
    size = 0
    total = 0
    for sp in specs:
        n = math.prod(sp.shape) * sp.dtype.itemsize
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(sp)
        size += n
        total += n
    return shards, total


def write_sharded(specs: list[HFSpec], fetch: ShardFetch, path: str | os.PathLike, config: dict[str, Any],
                  max_shard_bytes: float = 5e9, overwrite: bool = False,
                  extra_files: dict[str, Path] | None = None) -> Path:
    """Write shards ``model-0000i-of-0000N.safetensors`` (each from one ``fetch(specs of that shard)`` call, so at
    most one shard's tensors are in memory), the index, ``config.json`` (``config`` as given) and ``extra_files``
    (name -> source path, copied), into a temporary sibling directory that is renamed onto ``path`` only when
    complete. An existing ``path`` replaced with ``overwrite`` is swapped by rename, and kept intact when anything
    fails; temporary directories of an earlier killed write of the same target are removed first.

    Returns: the target path.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False.
    """
    target = Path(path)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists; choose another directory, or replace it (moetrain export "
                              f"--overwrite)")
    shards, total = _plan_shards(specs, max_shard_bytes)
    N = len(shards)
    names = [f"model-{i + 1:05d}-of-{N:05d}.safetensors" for i in range(N)]

    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{target.name}.tmp-*"):  # left by a killed earlier write of this target
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    old: Path | None = None
    try:
        os.chmod(tmp, 0o755)
        weight_map: dict[str, str] = {}
        for fname, shard in zip(names, shards):
            tensors = fetch(shard)
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            os.chmod(tmp / fname, 0o644)  # readable like the index and config beside it
            fsync_path(tmp / fname)
            weight_map.update({sp.hf_name: fname for sp in shard})
            del tensors
        write_json(tmp / INDEX_NAME, {"metadata": {"total_size": total}, "weight_map": weight_map})
        write_json(tmp / CONFIG_NAME, config)
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, tmp / name)
            fsync_path(tmp / name)
        if target.exists():
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            target.rename(old)
        try:
            tmp.rename(target)
        except BaseException:
            if old is not None:
                old.rename(target)
                old = None
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target
