"""``moetrain export RUN_DIR OUT_DIR``: a run's checkpoint (the newest complete one, or ``--step``), checked as
the trainer checks it on resume, written in the released HF layout by
:func:`moetrain.interop.export.export_checkpoint`."""

from __future__ import annotations

import os
from pathlib import Path
from typing import Any

import torch

from moetrain.errors import CheckpointError
from moetrain.interop.export import export_checkpoint
from moetrain.train.checkpoint import (STEP_DIR, checkpoint_dir, complete_checkpoints, has_checksums,
                                       latest_checkpoint, resume_checkpoint, verify_checkpoint)


def find_checkpoint(run_dir: str | os.PathLike, step: int | None = None) -> Path:
    """The complete checkpoint of ``run_dir`` at ``step`` (default: the newest).

    Raises:
        CheckpointError: no complete checkpoint (at that step), naming the ones there are; ``run_dir`` is one
            checkpoint's directory or a file (naming the run directory and step to pass instead).
    """
    _refuse_inner_path(run_dir)
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


def _refuse_inner_path(run_dir: str | os.PathLike) -> None:
    """Refuse a checkpoint directory (``RUN/checkpoints/step_<N>``) or a file given where the run directory is
    expected, naming the run directory and ``--step`` to pass instead.

    Raises:
        CheckpointError: as above.
    """
    p = Path(run_dir)
    inner = p.parent if p.is_file() else p
    m = STEP_DIR.match(inner.name)
    if m and inner.parent.name == "checkpoints":
        what = "a file of a checkpoint" if p.is_file() else "a checkpoint directory"
        raise CheckpointError(f"{run_dir} is {what}, not a run directory; pass the run directory "
                              f"{inner.parent.parent} and --step {int(m.group(1))}")
    if p.is_file():
        hint = f" {p.parent}" if checkpoint_dir(p.parent).is_dir() else ""
        raise CheckpointError(f"{run_dir} is a file, not a run directory; pass the run directory{hint} (the folder "
                              f"`moetrain train --out` wrote, holding checkpoints/)")


def verified_checkpoint(run_dir: str | os.PathLike, step: int | None = None) -> tuple[Path, dict[str, Any]]:
    """:func:`find_checkpoint` checked as a resume checks it (:func:`verify_checkpoint`): (its path, its trainer
    state). A damaged one is refused naming the newest other checkpoint of the run that verifies (each read whole,
    newest first, until one does), so the message says which ``--step`` works.

    Raises:
        CheckpointError: as :func:`find_checkpoint`; a damaged checkpoint, with the ``--step`` to use instead or
            saying that no checkpoint of the run verifies.
    """
    path = find_checkpoint(run_dir, step)
    try:
        return path, verify_checkpoint(path)
    except CheckpointError as e:
        raise CheckpointError(f"{e}; {_other_step_hint(run_dir, path)}") from None


def _other_step_hint(run_dir: str | os.PathLike, damaged: Path) -> str:
    """"use --step N" for the newest complete checkpoint of ``run_dir`` other than ``damaged`` that verifies, or
    what to do when none does."""
    found, failed = resume_checkpoint(run_dir, exclude=damaged)
    if found is not None:
        return (f"use --step {int(STEP_DIR.match(found.name).group(1))} (the newest checkpoint of {run_dir} that "
                f"verifies)")
    if not failed:
        return f"{run_dir} has no other checkpoint; restore the file from a copy or retrain"
    return (f"none of the other {len(failed)} checkpoint(s) of {run_dir} verifies either; restore the files from a "
            f"copy or retrain")


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
    # the trainer's checks (marker, state, metadata, shard sizes, checksums), before writing anything
    ckpt, _ = verified_checkpoint(run_dir, step)
    if not has_checksums(ckpt):
        print(f"[moetrain] checkpoint {ckpt.name} has no checksums (written by an earlier moetrain): verified by file "
              f"sizes only")
    return export_checkpoint(ckpt, out_dir, Path(run_dir) / "tokenizer.json", dtype, max_shard_bytes, overwrite, fp8)
