"""``moetrain export RUN_DIR OUT_DIR``: a run's checkpoint (the newest complete one, or ``--step``), checked as
the trainer checks it on resume, written in the released HF layout by
:func:`moetrain.interop.export.export_checkpoint`."""

from __future__ import annotations

import os
from pathlib import Path

import torch

from moetrain.errors import CheckpointError
from moetrain.interop.export import export_checkpoint
from moetrain.train.checkpoint import (STEP_DIR, checkpoint_dir, complete_checkpoints, has_checksums,
                                       latest_checkpoint, verify_checkpoint)


def find_checkpoint(run_dir: str | os.PathLike, step: int | None = None) -> Path:
    """The complete checkpoint of ``run_dir`` at ``step`` (default: the newest).

    Raises:
        CheckpointError: no complete checkpoint (at that step), naming the ones there are.
    """
    root = checkpoint_dir(run_dir)
    if step is None and root.is_dir() and latest_checkpoint(run_dir) is None and list(root.glob(".tmp-step_*")):
        raise CheckpointError(f"{run_dir} holds only an interrupted checkpoint save ({root}/.tmp-*), no complete "
                              f"checkpoint; resume the run (--resume) to write one")
    done = [int(STEP_DIR.match(p.name).group(1)) for p in complete_checkpoints(run_dir)]
    if step is None:
        ckpt = latest_checkpoint(run_dir)
        if ckpt is None:
            raise CheckpointError(f"{run_dir} has no complete checkpoint under {root}; is it a run directory of "
                                  f"`moetrain train --out`?")
        return ckpt
    if step not in done:
        raise CheckpointError(f"{run_dir} has no complete checkpoint at step {step}; complete steps: {done}")
    return root / f"step_{step:08d}"


def export_run(run_dir: str | os.PathLike, out_dir: str | os.PathLike, step: int | None = None,
               dtype: torch.dtype | None = None, max_shard_bytes: float = 5e9, overwrite: bool = False,
               fp8: bool = False) -> Path:
    """Write the HF checkpoint of ``run_dir``'s checkpoint (newest, or ``step``) to ``out_dir``: sharded safetensors,
    index, config.json (MTP layers under ``model.layers.{n_layers}``, as released) and the run's tokenizer.json.

    Args:
        dtype: cast floating tensors (the router bias stays fp32); None keeps the trained fp32 values exactly.
        fp8: write the released FP8 layout: attention and FFN linears as float8_e4m3fn with a fp32
            ``weight_scale_inv`` per 128x128 block, quantised from the trained fp32 weights, and config.json's
            ``quantization_config``; the other tensors in ``dtype`` (default bf16, as released).

    Raises:
        CheckpointError: no such checkpoint, a damaged one (naming the file: missing, truncated, or not matching
            its checksum), one without the model config, or one of an older layout.
        FileExistsError: ``out_dir`` exists and ``overwrite`` is False.
    """
    run, out = Path(run_dir).resolve(), Path(out_dir).resolve()
    if out == run or out in run.parents:
        raise CheckpointError(f"the export directory {out_dir} would contain (and, replaced, delete) the run "
                              f"{run_dir} itself; export to a new directory, e.g. {Path(run_dir) / 'hf'}")
    ckpt = find_checkpoint(run_dir, step)
    # the trainer's checks (marker, state, metadata, shard sizes, checksums), before writing anything
    verify_checkpoint(ckpt)
    if not has_checksums(ckpt):
        print(f"[moetrain] checkpoint {ckpt.name} has no checksums (written by an earlier moetrain): verified by file "
              f"sizes only")
    return export_checkpoint(ckpt, out_dir, Path(run_dir) / "tokenizer.json", dtype, max_shard_bytes, overwrite, fp8)
