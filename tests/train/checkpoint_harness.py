"""The checkpoint tests' one-process set-up: the tiny model, its optimizer and parallel context, and the trainer
state a checkpoint of it carries."""

from __future__ import annotations

from typing import Any

from moetrain.config import JobConfig
from moetrain.model import build_model, get_preset
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.mesh import init_parallel
from moetrain.train.optim import build_optimizer


def tiny_checkpointable() -> tuple[Any, Any, Any, dict[str, Any]]:
    """(model, optimizer, ctx, trainer state) of the tiny preset (vocabulary 256, seed 0) on one CPU process."""
    cfg = get_preset("tiny").replace(vocab_size=256)
    ctx = init_parallel(ParallelConfig(), cfg.n_routed_experts, device="cpu")
    model = build_model(cfg, seed=0)
    opt = build_optimizer(model, lr=1e-3)
    return model, opt, ctx, {"job": JobConfig().to_dict(), "model_config": cfg.to_dict()}
