"""Hugging Face checkpoints in and out of moetrain models: ``config.json`` <-> :class:`ModelConfig`, and safetensors
checkpoints <-> a :class:`~moetrain.model.Transformer` (or a pipeline stage of one), for every model family with a
state-dict adapter (:mod:`moetrain.interop.registry`; the DeepSeek-V3/V2 layout: :mod:`moetrain.model.deepseek.adapter`).

This module only orchestrates: the adapter names the tensors and translates the config, the file format lives in
:mod:`moetrain.interop.safetensors_io` and :mod:`moetrain.interop.fp8_blocks`.

Loading streams tensor by tensor (``safe_open``) and reads, of each tensor, only the box this process holds (its
FSDP2 shard; under expert parallelism only its own experts), from the placement of the parameter itself. Saving
writes one shard at a time into a temporary directory that is renamed onto the target only when complete, from a
whole model (:func:`save_hf_checkpoint`) or from any source of tensors (:func:`write_hf_checkpoint`, which
``moetrain export`` feeds from a DCP checkpoint).
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Iterator

import torch
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.errors import CheckpointError, ConfigError
from moetrain.interop.adapter import Box, TensorEntry
from moetrain.interop.fp8_blocks import (  # noqa: F401 - FP8_QUANTIZATION_CONFIG: a public name of this module
    FP8_QUANTIZATION_CONFIG,
    FP8_ST_DTYPES,
    SCALE_SUFFIX,
    check_scale_shape,
    dequantize_fp8_blockwise,
)
from moetrain.model.hf_config import read_config_json
from moetrain.interop.registry import adapter_for_config, adapter_for_hf_config
from moetrain.interop.safetensors_io import (
    CONFIG_NAME,
    HFSpec,
    ShardFetch,
    checkpoint_files,
    fmt_shape,
    open_safetensors,
    write_sharded,
)
from moetrain.model.config import ModelConfig
from moetrain.model.init import ShardBox
from moetrain.model.transformer import build_model

# ----------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """Build a :class:`ModelConfig` from a Hugging Face ``config.json`` dict, through the adapter of its
    ``model_type`` (:func:`moetrain.interop.registry.adapter_for_hf_config`; DeepSeek-V3/V2:
    :func:`moetrain.model.deepseek.adapter.config_from_hf`).

    Raises:
        ConfigError: an unsupported ``model_type`` (naming the supported ones), and whatever the adapter rejects.
    """
    return adapter_for_hf_config(d).config_from_hf(d)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF ``config.json`` dict of ``cfg``, from the adapter of its family
    (DeepSeek: :func:`moetrain.model.deepseek.adapter.config_to_hf`). ``config_from_hf(config_to_hf(cfg)) == cfg``.

    Raises:
        ConfigError: ``cfg`` has no HF architecture that computes like it.
    """
    return adapter_for_config(cfg).config_to_hf(cfg)


def load_hf_config(path: str | os.PathLike) -> ModelConfig:
    """Read ``config.json`` (a file, or a checkpoint directory holding one) into a :class:`ModelConfig`.

    Raises:
        FileNotFoundError: no such file. ConfigError: invalid JSON (line and column), and as
            :func:`config_from_hf` (a missing key, a value of the wrong type, ...), each naming the file.
    """
    p = Path(path)
    if p.is_dir():
        p = p / CONFIG_NAME
    d = read_config_json(p)
    try:
        return config_from_hf(d)
    except ConfigError as e:
        raise ConfigError(f"{p}: {e}") from None


def hf_tensor_names(model: nn.Module) -> list[str]:
    """The HF names :func:`save_hf_checkpoint` writes for ``model``, in order (a tied head is not written)."""
    return [e.hf_name for e in adapter_for_config(model.cfg).state_map(model).entries if e.saved]


# ----------------------------------------------------------------------------------------------------------------
# Load
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class LoadResult:
    """What :func:`load_hf_checkpoint` did.

    Attributes:
        loaded: tensors copied into the model (per-expert tensors count one each).
        skipped_nonlocal: experts present in the checkpoint but held by other expert-parallel ranks (not read).
        missing: HF names the model needs that the checkpoint lacks. unexpected: checkpoint names the model lacks.
        mtp_missing: the checkpoint has none of the MTP tensors (accepted with ``mtp_optional``).
        files: the safetensors files read.
    """

    loaded: int = 0
    skipped_nonlocal: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    mtp_missing: bool = False


def _shape_error(hf_name: str, ours: str, got, want) -> CheckpointError:
    return CheckpointError(f"tensor {hf_name!r} has shape {fmt_shape(got)} in the checkpoint but the model's {ours!r} "
                           f"expects {fmt_shape(want)}: is this a checkpoint from a different model/config?")


def _check_tied(f: Any, fpath: Path, weight_map: dict[str, Path], key: str, entry: TensorEntry, box: Box,
                path: Path) -> None:
    """A model that ties tensor ``key`` (its head) to ``entry.tied_to`` (the embedding) may load a checkpoint that
    stores both only if the two are equal (some exports write both); a distinct one would be silently dropped.
    Compares this rank's box."""
    hit = entry.overlap(box)
    if hit is None:
        return
    hf_sl, _ = hit
    head = f.get_slice(key)[hf_sl]
    other = weight_map.get(entry.tied_to, fpath)
    if other == fpath:
        emb = f.get_slice(entry.tied_to)[hf_sl]
    else:
        with open_safetensors(other) as g:
            emb = g.get_slice(entry.tied_to)[hf_sl]
    if not torch.equal(head, emb):
        raise CheckpointError(f"{path} has its own {key}, different from the embedding ({entry.tied_to}), but the "
                              f"model ties them (model.tie_embeddings=true): loading would drop the head; untie "
                              f"them (--set model.tie_embeddings=false)")


def _check_expert_boxes(entries: list[TensorEntry], boxes: dict[int, Box]) -> None:
    """A local expert slice must sit inside the config's experts (a layout bug, not a checkpoint problem)."""
    for e in entries:
        if e.expert != 0:
            continue
        g, off, local = boxes[id(e.tensor)]
        if off[0] < 0 or off[0] + local.shape[0] > g[0]:
            raise CheckpointError(f"{e.name} holds {local.shape[0]} experts from offset {off[0]}, outside the "
                                  f"{g[0]} experts of the config")


@torch.no_grad()
def load_hf_checkpoint(model: nn.Module, path: str | os.PathLike, strict: bool = True,
                       shard_box: ShardBox | None = None, check_only: bool = False,
                       mtp_optional: bool = False) -> LoadResult:
    """Copy a HF-layout safetensors checkpoint into ``model`` in place, streaming one tensor at a time and reading
    only the part of each tensor that this process holds.

    Args:
        model: a :class:`~moetrain.model.Transformer` on any (non-meta) device, whole or parallelized (FSDP2 shards,
            experts sharded over EP: each rank reads exactly its boxes, so no rank ever holds more than its shard
            plus one HF tensor's slice).
        path: a checkpoint directory (``model.safetensors`` or ``model.safetensors.index.json`` with its shards),
            or a single ``.safetensors`` file.
        strict: raise when the checkpoint lacks tensors the model needs or has tensors the model lacks.
        shard_box: where each model tensor's local part sits in its global tensor (default: DTensor placements;
            plain tensors are whole).
        check_only: check names and shapes (the model may be on meta) and copy nothing; reads only file headers.
        mtp_optional: a checkpoint with no MTP tensors at all (``transformers`` saves DeepseekV3 without them,
            although its config.json keeps ``num_nextn_predict_layers``) leaves the model's MTP modules as they are
            (``LoadResult.mtp_missing``); a checkpoint with only some of them is still an error.

    FP8 (float8_e4m3fn) weights with a ``<name>_scale_inv`` are dequantised per 128x128 block (the whole HF tensor is
    read for that). Shape mismatches always raise, before anything is copied from that tensor. Returns a
    :class:`LoadResult`.

    Raises:
        CheckpointError: missing/unexpected tensors (strict), a shape mismatch, an FP8 weight without its scale.
    """
    if shard_box is None:
        from moetrain.parallel.parallelize import shard_box
    path = Path(path)
    files, weight_map = checkpoint_files(path)
    adapter = adapter_for_config(model.cfg)
    smap = adapter.state_map(model)
    entries = smap.entries
    boxes = {id(e.tensor): shard_box(e.tensor) for e in entries}
    for e in entries:
        if not check_only and not e.copy and boxes[id(e.tensor)][2].is_meta:
            raise CheckpointError(f"{e.name} is on the meta device; materialise the model (to_empty) before loading")
    _check_expert_boxes(entries, boxes)
    by_name = {e.hf_name: e for e in entries}
    stacked_by_name = {p.hf_name: p for p in smap.stacked}
    seen: set[str] = set()
    res = LoadResult(files=[str(f) for f in files])

    def read_scale(f, fpath: Path, key: str, header: bool = False) -> Any:
        """The ``_scale_inv`` of FP8 tensor ``key`` (its shape only, with ``header``)."""
        scale_key = key + SCALE_SUFFIX
        if scale_key in file_keys:
            return tuple(f.get_slice(scale_key).get_shape()) if header else f.get_tensor(scale_key)
        other = weight_map.get(scale_key)
        if other is not None and other != fpath:
            with open_safetensors(other) as g:
                return tuple(g.get_slice(scale_key).get_shape()) if header else g.get_tensor(scale_key)
        raise CheckpointError(f"FP8 tensor {key!r} has no {scale_key!r} in the checkpoint")

    def load(f, fpath: Path, key: str, entry: TensorEntry) -> bool:
        """Copy this rank's part of HF tensor ``key`` into ``entry``'s tensor; False if it holds none of it."""
        hit = entry.overlap(boxes[id(entry.tensor)])
        if hit is not None and f.get_slice(key).get_dtype() in FP8_ST_DTYPES and check_only:
            check_scale_shape(key, tuple(f.get_slice(key).get_shape()), read_scale(f, fpath, key, header=True))
        if hit is None or check_only:
            return hit is not None
        hf_sl, dst = hit
        sl = f.get_slice(key)
        if sl.get_dtype() in FP8_ST_DTYPES:
            t = dequantize_fp8_blockwise(f.get_tensor(key), read_scale(f, fpath, key))[hf_sl]
        else:
            t = sl[hf_sl]
        dst.copy_(t)
        return True

    for fpath in files:
        with open_safetensors(fpath) as f:
            file_keys = set(f.keys())
            for key in f.keys():
                if key.endswith(SCALE_SUFFIX) or key.endswith(adapter.ignored_suffixes):
                    continue
                if weight_map and weight_map.get(key, fpath) != fpath:
                    continue  # the index assigns it to another shard; read it there
                entry = by_name.get(key)
                if entry is not None and entry.tied_to is not None and not check_only:
                    _check_tied(f, fpath, weight_map, key, entry, boxes[id(entry.tensor)], path)
                pk = stacked_by_name.get(key) if entry is None else None
                if pk is not None:
                    entry = pk.entry
                if entry is None:
                    res.unexpected.append(key)
                    continue
                shape = tuple(f.get_slice(key).get_shape())
                if shape != entry.shape:
                    raise _shape_error(key, entry.name, shape, entry.shape)
                if pk is not None:
                    if f.get_slice(key).get_dtype() in FP8_ST_DTYPES:
                        raise CheckpointError(f"FP8 stacked expert tensor {key!r} is not supported")
                    seen.update(pk.covers)
                    per_expert = len(pk.covers) // shape[0]
                    n_local = boxes[id(entry.tensor)][2].shape[0] if load(f, fpath, key, entry) else 0
                    res.loaded += per_expert * n_local
                    res.skipped_nonlocal += per_expert * (shape[0] - n_local)
                    continue
                seen.add(key)
                if entry.copy:
                    continue
                if load(f, fpath, key, entry):
                    res.loaded += 1
                else:
                    res.skipped_nonlocal += 1

    res.missing = [e.hf_name for e in entries if not e.copy and e.hf_name not in seen
                   and e.overlap(boxes[id(e.tensor)]) is not None]
    mtp_names = {e.hf_name for e in entries if e.mtp and not e.copy}
    if mtp_optional and mtp_names and not (mtp_names & seen):
        res.mtp_missing = True
        res.missing = [n for n in res.missing if n not in mtp_names]
    optional = {e.hf_name for e in entries if e.optional}
    if optional and not (optional & seen):
        res.missing = [n for n in res.missing if n not in optional]  # the layout has none: they keep their values
    if strict and (res.missing or res.unexpected):
        parts = []
        if res.missing:
            parts.append(f"{len(res.missing)} tensor(s) the model needs are missing from the checkpoint, e.g. "
                         f"{res.missing[:5]}")
        if res.unexpected:
            parts.append(f"{len(res.unexpected)} checkpoint tensor(s) have no place in the model, e.g. "
                         f"{res.unexpected[:5]}")
        raise CheckpointError(f"checkpoint {path} does not match the model ({'; '.join(parts)}); is it from a "
                              "different model or config?")
    return res


def check_hf_checkpoint(cfg: ModelConfig, path: str | os.PathLike, mtp_optional: bool = False) -> LoadResult:
    """Check, from the safetensors headers alone, that the checkpoint at ``path`` holds every tensor of a ``cfg``
    model with its shape (nothing is allocated: the model is built on meta).

    Raises:
        CheckpointError: a missing or unexpected tensor, or a shape mismatch (naming the tensor and both shapes).
    """
    return load_hf_checkpoint(build_model(cfg, device="meta"), path, check_only=True, mtp_optional=mtp_optional)


# ----------------------------------------------------------------------------------------------------------------
# Save
# ----------------------------------------------------------------------------------------------------------------

def _materialise(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if isinstance(t, DTensor):  # FSDP/TP: gather the full value
        t = t.full_tensor()
    t = t.detach()
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.to("cpu").contiguous().clone()


def hf_specs(model: nn.Module, dtype: torch.dtype | None = None) -> list[HFSpec]:
    """The tensors a HF checkpoint of ``model`` holds, in checkpoint order (the model may be on meta: only names,
    global shapes and dtypes are used). ``dtype`` casts floating tensors; the router bias stays fp32."""
    specs = []
    for e in adapter_for_config(model.cfg).state_map(model).entries:
        if not e.saved:
            continue
        src = e.tensor.dtype
        t_dtype = torch.float32 if e.keep_fp32 else dtype
        out = t_dtype if (t_dtype is not None and src.is_floating_point) else src
        specs.append(HFSpec(e.hf_name, e.shape, out, e.name, e.region()))
    return specs


@torch.no_grad()
def save_hf_checkpoint(model: nn.Module, path: str | os.PathLike, max_shard_bytes: float = 5e9,
                       dtype: torch.dtype | None = None, overwrite: bool = False) -> Path:
    """Write ``model`` as a HF checkpoint directory of its family's layout: shards
    ``model-0000i-of-0000N.safetensors``, ``model.safetensors.index.json`` and ``config.json`` (from
    :func:`config_to_hf`), one tensor per expert.

    Args:
        model: a :class:`~moetrain.model.Transformer` holding all experts (gather expert-parallel slices first).
        path: target directory. It appears only when complete: everything is written into a temporary sibling
            directory that is renamed onto ``path`` at the end (removed again on any error).
        max_shard_bytes: a new shard starts before a tensor that would take the current one past this size.
        dtype: cast floating tensors (e.g. torch.bfloat16); None keeps each tensor's dtype. The router bias stays
            fp32 either way.
        overwrite: replace an existing ``path`` (swapped atomically by rename); otherwise an existing path raises.

    Returns: the target path.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False.
        CheckpointError: the model is sharded (use ``moetrain export``) or on meta.
    """
    entries = adapter_for_config(model.cfg).state_map(model).entries
    for e in entries:
        if isinstance(e.tensor, DTensor) or e.tensor.is_meta:
            raise CheckpointError(f"{e.name} is sharded or on meta; save_hf_checkpoint needs a whole model on one "
                                  "process (export a distributed run's checkpoint with `moetrain export`)")
    specs = hf_specs(model, dtype)
    by_name = {e.hf_name: e for e in entries}

    def fetch(shard: list[HFSpec]) -> dict[str, torch.Tensor]:
        return {s.hf_name: _materialise(by_name[s.hf_name].view(), s.dtype) for s in shard}

    saved_dtype = dtype or model.embed_tokens.weight.dtype
    return write_hf_checkpoint(model.cfg, specs, fetch, path, max_shard_bytes, saved_dtype, overwrite)


def write_hf_checkpoint(cfg: ModelConfig, specs: list[HFSpec], fetch: ShardFetch, path: str | os.PathLike,
                        max_shard_bytes: float = 5e9, saved_dtype: torch.dtype = torch.float32,
                        overwrite: bool = False, extra_files: dict[str, Path] | None = None,
                        quantization_config: dict[str, Any] | None = None) -> Path:
    """Write shards ``model-0000i-of-0000N.safetensors`` (each from one ``fetch(specs of that shard)`` call, so at
    most one shard's tensors are in memory), the index and ``config.json`` (:func:`config_to_hf` of ``cfg``, with
    ``dtype`` = ``saved_dtype``), into a temporary sibling directory that is renamed onto ``path`` only when
    complete (:func:`moetrain.interop.safetensors_io.write_sharded`). ``extra_files`` (name -> source path, e.g. the
    tokenizer) are copied in too. ``quantization_config`` goes into config.json as is (FP8 exports:
    :data:`FP8_QUANTIZATION_CONFIG`).

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False.
        ConfigError: ``cfg`` has no HF architecture (as :func:`config_to_hf`); raised before anything is written.
    """
    hf_cfg = config_to_hf(cfg)
    hf_cfg["dtype"] = str(saved_dtype).removeprefix("torch.")
    if quantization_config is not None:
        hf_cfg["quantization_config"] = quantization_config
    return write_sharded(specs, fetch, path, hf_cfg, max_shard_bytes, overwrite, extra_files)


def iter_hf_state(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor) pairs of a whole single-process ``model`` one at a time, in checkpoint order."""
    by_name = {e.hf_name: e for e in adapter_for_config(model.cfg).state_map(model).entries}
    for sp in hf_specs(model, dtype):
        yield sp.hf_name, _materialise(by_name[sp.hf_name].view(), sp.dtype)
