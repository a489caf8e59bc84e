"""AdamW with the DeepSeek-V3 recipe and learning-rate schedules (warm-up + cosine, warm-up-stable-decay)."""

from __future__ import annotations

import math
from typing import Literal

import torch
from torch import nn

from moetrain.layout import OptimizerStates
from moetrain.train.adamw import PrecisionAwareAdamW

#: The one table of optimizer-state precisions: ``OptimizerStates -> (dtype of the parameters the model holds, which
#: are the FSDP shards and, but for bf16, the master weights; dtype of the Adam moments, None = torch's fused AdamW
#: with moments of the parameters' dtype)``. bf16 parameters keep their exact fp32 master as a 16-bit remainder in
#: the optimizer (:mod:`moetrain.train.adamw`).
STATE_DTYPES: dict[OptimizerStates, tuple[torch.dtype, torch.dtype | None]] = {
    OptimizerStates.FP32: (torch.float32, None),
    OptimizerStates.BF16_MOMENTS: (torch.float32, torch.bfloat16),
    OptimizerStates.BF16: (torch.bfloat16, torch.bfloat16),
}


def held_param_dtype(states: OptimizerStates) -> torch.dtype:
    """The dtype the model's (sharded) parameters are held in under optimizer ``states``."""
    return STATE_DTYPES[OptimizerStates(states)][0]


def build_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1, betas: tuple[float, float] = (0.9, 0.95),
                    eps: float = 1e-8, states: OptimizerStates = OptimizerStates.FP32) -> torch.optim.Optimizer:
    """AdamW (DeepSeek-V3 report sec. 4.2: beta 0.9/0.95, weight decay 0.1). Vectors (norm weights) get no weight
    decay, as in Megatron-Core.

    ``states`` (:data:`STATE_DTYPES`): fp32 uses PyTorch's fused kernel (one multi-tensor kernel per group on CPU and
    CUDA; the for-loop implementation cost 1.3x more optimizer time in the benchmark's training step); bf16-moments
    and bf16 use :class:`~moetrain.train.adamw.PrecisionAwareAdamW`, whose parameters must already be held in the
    table's dtype (``moetrain.train.trainer.build_model_parts`` casts them before sharding). Routed-expert weights get
    their own groups because under expert parallelism they live on the (dp) device mesh and everything else on the
    world mesh, and one fused call cannot mix DTensors of two meshes.

    Raises:
        ValueError: a parameter not held in the dtype ``states`` needs.
    """
    from moetrain.model.experts import GroupedExperts

    expert_ids = {id(p) for m in model.modules() if isinstance(m, GroupedExperts) for p in m.parameters()}
    buckets: dict[tuple[bool, bool], list[nn.Parameter]] = {}
    for p in model.parameters():
        if p.requires_grad:
            buckets.setdefault((p.ndim >= 2, id(p) in expert_ids), []).append(p)
    groups = [{"params": ps, "weight_decay": weight_decay if decay else 0.0}
              for (decay, _expert), ps in sorted(buckets.items(), key=lambda kv: (not kv[0][0], kv[0][1]))]
    param_dtype, moment_dtype = STATE_DTYPES[OptimizerStates(states)]
    wrong = sorted({str(p.dtype) for g in groups for p in g["params"] if p.dtype != param_dtype})
    if wrong:
        raise ValueError(f"optimizer states {states} need {param_dtype} parameters, found {', '.join(wrong)}")
    if moment_dtype is not None:
        return PrecisionAwareAdamW(groups, lr=lr, betas=betas, eps=eps, moment_dtype=moment_dtype)
    fused = all(p.device.type in ("cpu", "cuda") for g in groups for p in g["params"])
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=fused or None,
                             foreach=None if fused else False)


def lr_at(step: int, *, lr: float, min_lr: float, warmup_steps: int, total_steps: int,
          schedule: Literal["cosine", "wsd", "constant"] = "cosine", decay_fraction: float = 0.2) -> float:
    """Learning rate for optimizer step ``step`` (0-based).

    Linear warm-up from lr/warmup to ``lr`` over ``warmup_steps``; then
    "cosine": cosine decay to ``min_lr`` at ``total_steps``; "wsd": constant, then linear decay to ``min_lr`` over the
    last ``decay_fraction`` of the steps (warm-up-stable-decay); "constant": stays at ``lr``.
    """
    if warmup_steps > 0 and step < warmup_steps:
        return lr * (step + 1) / warmup_steps
    if schedule == "constant" or total_steps <= warmup_steps:
        return lr
    progress = min(1.0, (step - warmup_steps) / max(1, total_steps - warmup_steps))
    if schedule == "cosine":
        return min_lr + 0.5 * (lr - min_lr) * (1 + math.cos(math.pi * progress))
    if schedule == "wsd":
        decay_start = 1.0 - decay_fraction
        if progress <= decay_start:
            return lr
        return lr + (min_lr - lr) * (progress - decay_start) / max(decay_fraction, 1e-9)
    raise ValueError(f"schedule={schedule!r}; allowed: 'cosine', 'wsd', 'constant'")


def set_lr(optimizer: torch.optim.Optimizer, lr: float) -> None:
    for g in optimizer.param_groups:
        g["lr"] = lr


class OptimizerGroup:
    """One optimizer per model part (pipeline stage), stepped together: the optimizer state dict of each is built
    against its own part (``torch.distributed.checkpoint.state_dict`` maps parameters to names per module), as
    TorchTitan's optimizer container does. ``param_groups`` lists every part's groups (learning-rate updates)."""

    def __init__(self, optimizers: list[torch.optim.Optimizer]):
        self.optimizers = optimizers

    @property
    def param_groups(self) -> list[dict]:
        return [g for o in self.optimizers for g in o.param_groups]

    @property
    def state(self) -> dict:
        return {k: v for o in self.optimizers for k, v in o.state.items()}

    def step(self) -> None:
        for o in self.optimizers:
            o.step()

    def zero_grad(self, set_to_none: bool = True) -> None:
        for o in self.optimizers:
            o.zero_grad(set_to_none=set_to_none)


def build_optimizers(parts: list[nn.Module], lr: float, weight_decay: float = 0.1,
                     betas: tuple[float, float] = (0.9, 0.95), eps: float = 1e-8,
                     states: OptimizerStates = OptimizerStates.FP32) -> OptimizerGroup:
    """:func:`build_optimizer` for each part."""
    return OptimizerGroup([build_optimizer(p, lr, weight_decay, betas, eps, states) for p in parts])
