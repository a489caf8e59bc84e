"""moetrain: pre-training of DeepSeek-V3-architecture Mixture-of-Experts models.

The Python API (README, "Python API"), imported on first use so that ``import moetrain`` stays cheap::

    import moetrain

    model = moetrain.build_model("tiny")                  # a preset, a HF config (dir or config.json), a run dir
    job = moetrain.job_config({"train.steps": 20, "train.out_dir": "runs/api"})
    result = moetrain.pretrain(job)                       # as `moetrain train`; spawns the workers
    model = moetrain.load_run("runs/api")                 # the newest checkpoint, any layout, in one process
    print(moetrain.evaluate("runs/api", "held.jsonl").table())
    print(moetrain.sample("runs/api", "def "))
"""

from __future__ import annotations

from importlib import import_module
from typing import Any

#: Public name -> the module that defines it.
_EXPORTS = {
    # building, loading, training, evaluating, sampling (moetrain.api)
    "build_model": "moetrain.api",
    "model_config": "moetrain.api",
    "load_run": "moetrain.api",
    "load_checkpoint": "moetrain.api",
    "job_config": "moetrain.api",
    "pretrain": "moetrain.api",  # not "train": that name is the trainer's package, moetrain.train
    "TrainResult": "moetrain.api",
    "evaluate": "moetrain.api",
    "sample": "moetrain.api",
    # the types they take and return
    "JobConfig": "moetrain.config",
    "ModelConfig": "moetrain.model.config",
    "Transformer": "moetrain.model.transformer",
    "PRESETS": "moetrain.model.config",
    "EvalReport": "moetrain.train.evaluate",
    "generate": "moetrain.model.generate",
    "load_tokenizer": "moetrain.data.tokenizer",
    # HF safetensors in and out
    "load_hf_config": "moetrain.interop.hf",
    "load_hf_checkpoint": "moetrain.interop.hf",
    "save_hf_checkpoint": "moetrain.interop.hf",
    "export_run": "moetrain.train.export",
    # errors
    "ConfigError": "moetrain.errors",
    "CheckpointError": "moetrain.errors",
    "DataError": "moetrain.data.corpus",
}

__all__ = sorted(_EXPORTS)


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'moetrain' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted(set(globals()) | set(_EXPORTS))
