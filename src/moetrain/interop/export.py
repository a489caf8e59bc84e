"""A DCP checkpoint -> the released HF layout, without materialising the model (``moetrain export``; the run
directory's side -- which step, the trainer's own checks -- is :func:`moetrain.train.export.export_run`).

The checkpoint holds every tensor under its global shape, saved as the ranks' boxes. The exporter builds the model on
the meta device only for its names and shapes (:func:`moetrain.interop.hf.hf_specs`), then writes the safetensors
shards one at a time (:func:`moetrain.interop.hf.write_hf_checkpoint`); a shard's whole tensors are read with one
:func:`moetrain.interop.dcp_read.read_boxes` call, the per-expert tensors of one stacked expert weight as one box
covering the shard's experts (so a saved chunk is deserialised once per shard, not once per expert), one stacked
weight at a time. Peak memory: one output shard plus one stacked box and one saved chunk (BENCHMARKS.md, "Any model
size").
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch

from moetrain.errors import CheckpointError
from moetrain.interop.dcp_read import BoxRequest, DCPReadError, checkpoint_tensors, read_boxes
from moetrain.interop.fp8_blocks import FP8_QUANTIZATION_CONFIG, fp8_fetch, fp8_specs
from moetrain.interop.hf import hf_specs, write_hf_checkpoint
from moetrain.interop.registry import adapter_for_config
from moetrain.interop.safetensors_io import HFSpec
from moetrain.model.config import ModelConfig
from moetrain.model.transformer import build_model

DTYPES = {"bf16": torch.bfloat16, "fp32": torch.float32}


def export_checkpoint(ckpt: Path, out_dir: str | os.PathLike, tokenizer: Path, dtype: torch.dtype | None = None,
                      max_shard_bytes: float = 5e9, overwrite: bool = False, fp8: bool = False) -> Path:
    """Write the HF checkpoint of the complete, verified DCP checkpoint directory ``ckpt`` (a ``step_*`` directory
    of a run) to ``out_dir``, with ``tokenizer`` copied in when it exists. The part of :func:`export_run` that needs
    nothing of the trainer; arguments and errors as there.

    Raises:
        CheckpointError: ``ckpt`` without the model config, or of an older layout, or unreadable.
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
    """
    state = json.loads((ckpt / "trainer_state.json").read_text())
    if "model_config" not in state:
        raise CheckpointError(f"{ckpt}/trainer_state.json has no model_config; it was not written by moetrain train")
    cfg = ModelConfig.from_dict(state["model_config"])
    model = build_model(cfg, device="meta")
    specs = hf_specs(model, dtype)
    stored = checkpoint_tensors(ckpt)
    missing = sorted({f"model.{s.name}" for s in specs} - set(stored))
    if missing:
        raise CheckpointError(f"{ckpt} lacks {len(missing)} model tensor(s) under their global names (e.g. "
                              f"{missing[:3]}): it was written by an older moetrain layout; resume it for one step "
                              f"with --resume and export the checkpoint that writes")

    def fetch(shard: list[HFSpec]) -> dict[str, torch.Tensor]:
        return _read_shard(ckpt, shard)

    extra = {"tokenizer.json": tokenizer} if tokenizer.is_file() else {}
    if not extra:
        print(f"[moetrain] note: {tokenizer} not found; the export has no tokenizer")
    if fp8:
        if dtype is None:
            specs = hf_specs(model, torch.bfloat16)
        specs, source = fp8_specs(specs, adapter_for_config(cfg).is_fp8_weight)
        source = {n: HFSpec(sp.hf_name, sp.shape, torch.float32, sp.name, sp.region) for n, sp in source.items()}
        return write_hf_checkpoint(cfg, specs, fp8_fetch(fetch, source), out_dir, max_shard_bytes,
                                   dtype or torch.bfloat16, overwrite, extra, FP8_QUANTIZATION_CONFIG)
    saved_dtype = dtype or torch.float32
    return write_hf_checkpoint(cfg, specs, fetch, out_dir, max_shard_bytes, saved_dtype, overwrite, extra)


def _read_shard(ckpt: Path, shard: list[HFSpec]) -> dict[str, torch.Tensor]:
    """The tensors of one output shard. Whole tensors are read as they are (one call); the per-expert tensors of
    each stacked expert weight through one box over the experts this shard holds, one stacked weight at a time, so
    the transient memory beyond the shard itself is one such box."""
    out: dict[str, torch.Tensor] = {}
    whole: list[BoxRequest] = []
    stacked: dict[str, list[HFSpec]] = {}
    for sp in shard:
        if len(sp.region) == len(sp.shape):  # a whole tensor
            dest = torch.empty(sp.shape, dtype=sp.dtype)
            whole.append(BoxRequest(f"model.{sp.name}", sp.region, dest))
            out[sp.hf_name] = dest
        else:
            stacked.setdefault(sp.name, []).append(sp)
    try:
        read_boxes(ckpt, whole)
        for name, sps in stacked.items():
            e0, e1 = min(s.region[0] for s in sps), max(s.region[0] for s in sps) + 1
            full = checkpoint_tensors(ckpt)[f"model.{name}"].shape
            box = torch.empty((e1 - e0, *full[1:]), dtype=sps[0].dtype)
            read_boxes(ckpt, [BoxRequest(f"model.{name}", (e0,) + (0,) * (len(full) - 1), box)])
            for sp in sps:  # own storage per tensor: safetensors refuses tensors that share memory
                e, r = sp.region[0], sp.region[1]
                out[sp.hf_name] = box[e - e0, r:r + sp.shape[0]].clone()
            del box
    except (DCPReadError, OSError) as e:
        raise CheckpointError(f"{ckpt} cannot be read ({type(e).__name__}: {e}); export an earlier checkpoint with "
                              f"--step") from None
    return {sp.hf_name: out[sp.hf_name] for sp in shard}
