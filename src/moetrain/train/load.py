"""A run directory's checkpoint, whatever layout wrote it (any EP, PP, DP), loaded into one process: the model of
``moetrain eval`` and ``moetrain sample`` and of the Python API's :func:`load_run`.

A checkpoint stores every tensor under its global name and shape (``model.<name>``, :mod:`moetrain.train.checkpoint`),
as the boxes the ranks held; :func:`moetrain.interop.dcp_read.read_boxes` reads each whole tensor back from them.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import torch

from moetrain.config import JobConfig, job_config_from_dict
from moetrain.data import Tokenizer, load_tokenizer
from moetrain.errors import CheckpointError
from moetrain.interop.dcp_read import BoxRequest, DCPReadError, checkpoint_tensors, read_boxes
from moetrain.model.transformer import Transformer, build_model
from moetrain.train.export import verified_checkpoint


@dataclass
class RunCheckpoint:
    """One verified checkpoint of a run directory and the job that wrote it.

    Attributes:
        run_dir: the run directory (``moetrain train --out``).
        path: the ``checkpoints/step_<N>`` directory.
        step: optimizer steps done when it was written.
        job: the job the run trained (its model, ``data.seq_len``, tokenizer settings, layout).
        data: what the checkpoint records of its prepared data (``data_key``: the cache folder, the tokenizer's
            sha256; :func:`moetrain.train.resume.data_fingerprint`); empty when it records none.
    """

    run_dir: Path
    path: Path
    step: int
    job: JobConfig
    data: dict[str, Any] = field(default_factory=dict)

    def tokenizer(self) -> Tokenizer:
        """The run's tokenizer (``run_dir/tokenizer.json``, written by the trainer), with the run's EOS token.

        Raises:
            DataError: the file is missing or not a tokenizer.
        """
        return load_tokenizer(self.run_dir / "tokenizer.json", self.job.data.eos_token)


def open_run(run_dir: str | os.PathLike, step: int | None = None) -> RunCheckpoint:
    """The newest complete checkpoint of ``run_dir`` (or the one at ``step``), checked as a resume checks it.

    Raises:
        CheckpointError: no such checkpoint (or ``run_dir`` is a checkpoint's directory or a file), a damaged one
            (naming the ``--step`` that verifies), or one without the job it was trained with.
    """
    path, state = verified_checkpoint(run_dir, step)
    if "job" not in state:
        raise CheckpointError(f"{path}/trainer_state.json has no job config (written by an older moetrain); resume "
                              f"the run for one step with --resume to write a checkpoint that has it")
    return RunCheckpoint(Path(run_dir), path, int(state["step"]), job_config_from_dict(state["job"]),
                         dict(state.get("data") or {}))


def load_model_state(model: Transformer, ckpt: str | os.PathLike) -> None:
    """Fill a single-process ``model`` (plain tensors, any device) from the checkpoint directory ``ckpt``, whatever
    layout saved it: every parameter and buffer in the state dict is read whole (an output head tied to the
    embedding is read once).

    Raises:
        CheckpointError: a tensor missing from the checkpoint, of another shape, or unreadable (naming it).
    """
    stored = checkpoint_tensors(ckpt)
    tied = model.lm_head.weight is model.embed_tokens.weight
    requests, staged = [], []
    for name, t in model.state_dict(keep_vars=True).items():
        key = f"model.{name}"
        if key not in stored:
            if tied and name == "lm_head.weight":
                continue
            raise CheckpointError(f"{ckpt} has no tensor {key!r}: it holds another model, or was written by an older "
                                  f"moetrain layout")
        if tuple(stored[key].shape) != tuple(t.shape):
            raise CheckpointError(f"{ckpt}: {key!r} is {tuple(stored[key].shape)} there, {tuple(t.shape)} in the model")
        # read on the CPU (DCP deserialises there), then copied to the model's device
        dest = torch.empty(t.shape, dtype=t.dtype) if t.device.type != "cpu" else t.detach()
        requests.append(BoxRequest(key, (0,) * t.dim(), dest))
        staged.append((t, dest))
    try:
        read_boxes(ckpt, requests)
    except (DCPReadError, OSError) as e:
        raise CheckpointError(f"{ckpt} cannot be read ({type(e).__name__}: {e})") from None
    with torch.no_grad():
        for t, dest in staged:
            if dest is not t:
                t.copy_(dest)


def load_run_model(run: RunCheckpoint, device: str | torch.device = "cpu") -> Transformer:
    """The whole model of ``run`` in this process on ``device``, in fp32 (the trained master weights), in eval mode.

    Raises:
        CheckpointError: as :func:`load_model_state`.
    """
    model = build_model(run.job.model, device=device, seed=None)
    load_model_state(model, run.path)
    return model.eval()
