"""moetrain's Python API: what ``import moetrain`` exports (lazily: ``moetrain/__init__.py``), beside the commands.

Build a model from a preset, a HF config or a run directory; load a run's checkpoint, whatever layout wrote it, into
one process; train from a :class:`~moetrain.config.JobConfig`; evaluate and sample; read and write HF safetensors.
Everything here is single-process except :func:`pretrain` (which starts the job's worker processes, as ``moetrain
train`` does) and :func:`evaluate` with ``nproc``.
"""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Mapping

import torch

from moetrain.config import JobConfig, build_job_config
from moetrain.errors import CheckpointError, ConfigError
from moetrain.interop.hf import load_hf_config
from moetrain.model.config import PRESETS, ModelConfig, get_preset
from moetrain.model.transformer import Transformer
from moetrain.model.transformer import build_model as _build
from moetrain.train.evaluate import EvalReport, evaluate_run
from moetrain.train.load import load_model_state, load_run_model, open_run
from moetrain.train.sample import sample_run


def model_config(source: str | os.PathLike | ModelConfig) -> ModelConfig:
    """The :class:`ModelConfig` of ``source``: a preset name (``"tiny"``, ``"deepseek-v3-671b"`` ...), a HF
    checkpoint directory or its ``config.json``, or a run directory of ``moetrain train`` (its newest checkpoint's
    model); a ModelConfig is returned as it is.

    Raises:
        ConfigError: ``source`` is none of these. CheckpointError: a run directory without a complete checkpoint.
    """
    if isinstance(source, ModelConfig):
        return source
    if str(source) in PRESETS:
        return get_preset(str(source))
    p = Path(source)
    if (p / "checkpoints").is_dir():
        return open_run(p).job.model
    if p.name == "config.json" or (p / "config.json").is_file():
        return load_hf_config(p)
    raise ConfigError(f"{str(source)!r} is neither a preset ({sorted(PRESETS)}), a HF checkpoint directory or "
                      f"config.json, nor a run directory (with checkpoints/)")


def build_model(source: str | os.PathLike | ModelConfig, device: str | torch.device = "cpu",
                seed: int = 0) -> Transformer:
    """A freshly initialised single-process model of ``source`` (see :func:`model_config`) on ``device``, with the
    trainer's name-seeded init (the weights every layout of ``seed`` starts from). For trained weights use
    :func:`load_run` or :func:`load_hf_checkpoint`.

    Raises:
        As :func:`model_config`.
    """
    return _build(model_config(source), device=device, seed=seed)


def load_run(run_dir: str | os.PathLike, step: int | None = None, device: str | torch.device = "cpu") -> Transformer:
    """The trained model of a run directory in this process: its newest complete checkpoint (or ``step``), written
    at any EP / PP / DP, read whole (fp32, eval mode). ``model.cfg`` is its config.

    Raises:
        CheckpointError: no such checkpoint, a damaged one, or one of another model.
    """
    return load_run_model(open_run(run_dir, step), device)


def load_checkpoint(model: Transformer, checkpoint_dir: str | os.PathLike) -> Transformer:
    """Fill a single-process ``model`` in place from one checkpoint directory (``<run>/checkpoints/step_<N>``) of
    any layout, and return it.

    Raises:
        CheckpointError: a tensor missing or of another shape.
    """
    load_model_state(model, checkpoint_dir)
    return model


def job_config(settings: Mapping[str, Any] | None = None, config: str | os.PathLike | None = None) -> JobConfig:
    """A validated :class:`JobConfig`, as ``moetrain train`` builds one: the job file ``config`` (optional), then
    ``settings`` as ``{"section.field": value}`` (e.g. ``{"model.preset": "tiny", "train.steps": 20,
    "train.out_dir": "runs/api"}``; the fields ``moetrain train --help-config`` lists), with an unset EP fitted to
    the processes that will train.

    Raises:
        ConfigError: an unknown section or field, a value of the wrong type, a layout that does not fit.
    """
    from moetrain.config import read_config_file
    from moetrain.train.launch import default_nproc

    sections = read_config_file(config) if config else {}
    for key, value in (settings or {}).items():
        section, dot, name = key.partition(".")
        if not dot or not name:
            raise ConfigError(f"setting {key!r} is not 'section.field' (e.g. 'train.steps')")
        sections.setdefault(section, {})[name] = value
    return build_job_config(sections, world=default_nproc)


@dataclass
class TrainResult:
    """What :func:`pretrain` returns (rank 0's summary of the run).

    Attributes:
        out_dir: the run directory.
        checkpoint: the last checkpoint written (None: none).
        val: (step, validation loss) pairs.
        stopped: how a stopped run stopped (a signal), None when it ran to the end.
        summary: the whole summary the trainer returned.
    """

    out_dir: str
    checkpoint: str | None
    val: list[tuple[int, float]] = field(default_factory=list)
    stopped: dict[str, Any] | None = None
    summary: dict[str, Any] = field(default_factory=dict)


def pretrain(job: JobConfig) -> TrainResult:
    """Train ``job`` exactly as ``moetrain train`` does (named so because ``moetrain.train`` is the trainer's
    package): checks, data preparation, ``job.train.nproc`` worker
    processes (spawned: call it under ``if __name__ == "__main__":`` in a script), checkpoints and metrics in
    ``job.train.out_dir``.

    Raises:
        ConfigError, DataError, CheckpointError: bad input, before any worker starts. RuntimeError: a worker failed
        (one line; its traceback in ``out_dir/logs``).
    """
    from moetrain.train.launch import train_main

    summary = train_main(job) or {}
    return TrainResult(str(summary.get("out_dir", job.train.out_dir)), summary.get("checkpoint"),
                       [(int(s), float(v)) for s, v in summary.get("val", [])], summary.get("stopped"), summary)


def evaluate(run_dir: str | os.PathLike, data: list[str] | str | None = None, **kwargs: Any) -> EvalReport:
    """Loss and perplexity of a run's checkpoint per source of ``data`` (source specs as training's ``--source``
    takes them: files or globs, datasets folders, ``hub:NAME``; None: the run's own validation split) and over all: an
    :class:`~moetrain.train.evaluate.EvalReport` (``.sources``, ``.total``, ``.table()``, ``.to_dict()``). Keywords
    as :func:`moetrain.train.evaluate.evaluate_run` (``step``, ``device``, ``max_batches``, ``nproc``/``ep``/``pp``,
    ``text_field``).

    Raises:
        As :func:`moetrain.train.evaluate.evaluate_run`.
    """
    return evaluate_run(run_dir, [data] if isinstance(data, str) else None if data is None else list(data), **kwargs)


def sample(run_dir: str | os.PathLike, prompt: str, **kwargs: Any) -> str:
    """The text a run's checkpoint continues ``prompt`` with (greedy by default; ``temperature``, ``top_p``,
    ``seed``, ``max_new_tokens``, ``step``, ``device`` as :func:`moetrain.train.sample.sample_run`).

    Raises:
        As :func:`moetrain.train.sample.sample_run`.
    """
    return sample_run(run_dir, prompt, **kwargs)


__all__ = ["CheckpointError", "ConfigError", "TrainResult", "build_model", "evaluate", "job_config", "load_checkpoint",
           "load_run", "model_config", "pretrain", "sample"]
