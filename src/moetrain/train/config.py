"""Settings of the training loop (optimizer, schedule, batch, logging, checkpoints)."""

from __future__ import annotations

import math

from dataclasses import dataclass
from typing import Literal

from moetrain.model.config import ConfigError


@dataclass
class TrainConfig:
    """Training-loop settings. Defaults are the built-in CPU demo (tiny preset, 2 workers, < 5 min on 2 cores).

    Attributes:
        steps: optimizer steps.
        micro_batch_size: sequences per micro-batch per rank.
        grad_accum: micro-batches per optimizer step (global batch = micro_batch_size * grad_accum * world).
        lr: AdamW peak learning rate, reached after the warm-up.
        min_lr: learning rate the decay ends at (cosine, wsd); the floor of the schedule.
        warmup_steps: steps of linear warm-up to lr (step 1 runs at lr / warmup_steps).
        schedule: decay after the warm-up: "cosine" (to min_lr at the last step), "wsd" (warmup-stable-decay:
            lr held, then a linear decay to min_lr over the last 20% of the steps) or "constant" (lr throughout).
        weight_decay: AdamW decoupled weight decay (DeepSeek-V3: 0.1).
        beta1: AdamW first-moment decay (DeepSeek-V3: 0.9).
        beta2: AdamW second-moment decay (DeepSeek-V3: 0.95).
        eps: AdamW denominator epsilon, added to the root of the second moment.
        max_grad_norm: global gradient clipping (DeepSeek-V3: 1.0; <= 0 disables).
        seed: model init seed (the data loader uses data.seed too).
        log_every: steps between metrics lines and records (the last step is always logged).
        eval_every: steps between validation losses (0 = never; also before the first step and after the last).
        eval_batches: micro-batches per rank each validation runs on (a mixture: shared among its sources by
            weight, at least one each, ``moetrain.train.validation``).
        ckpt_every: steps between checkpoints (0 = only at the end; a stop signal also writes one).
        keep_ckpts: how many complete checkpoints to keep (older ones are deleted).
        out_dir: run directory (metrics.jsonl, TensorBoard events, checkpoints/).
        resume: continue from the newest complete checkpoint in out_dir/checkpoints.
        nproc: worker processes that ``moetrain train`` launches on this machine (0 = one per GPU, else 2 on CPU).
        device: "auto" (cuda if available), "cuda" or "cpu". The step's precision is ``parallel.precision`` (the
            older train.dtype and train.fp8 are read as it).
        tensorboard: also write TensorBoard events.
        threads_per_proc: CPU threads per worker (0 = cores / workers).
        init_from: a HF checkpoint directory (released layout: safetensors + config.json) to start from; its
            config.json gives the model unless the model section names a preset or hf_config. Ignored when resuming
            from a checkpoint of the run.
        allow_schedule_change: let a resume change the learning-rate schedule (lr, min_lr, warmup_steps,
            schedule, or steps under a decaying schedule); refused otherwise, since it changes the LR mid-run.
        profile_steps: optimizer steps (1-based) to record with ``torch.profiler``; each writes a Chrome trace
            ``out_dir/profile/step<N>-rank<r>.json`` (open in Perfetto or chrome://tracing), where EP overlap's
            forward and backward segments of the paired micro-batches appear as named ranges.
        wandb: Weights & Biases project to log the run's metrics to ("" = no W&B); offline in out_dir/wandb
            unless WANDB_API_KEY or WANDB_MODE is set (needs pip install wandb).
    """

    steps: int = 400
    micro_batch_size: int = 32
    grad_accum: int = 1
    lr: float = 4e-3
    min_lr: float = 4e-4
    warmup_steps: int = 20
    schedule: Literal["cosine", "wsd", "constant"] = "cosine"
    weight_decay: float = 0.1
    beta1: float = 0.9
    beta2: float = 0.95
    eps: float = 1e-8
    max_grad_norm: float = 1.0
    seed: int = 0
    log_every: int = 10
    eval_every: int = 100
    eval_batches: int = 4
    ckpt_every: int = 100
    keep_ckpts: int = 2
    out_dir: str = "runs/default"
    resume: bool = False
    nproc: int = 0
    device: Literal["auto", "cuda", "cpu"] = "auto"
    tensorboard: bool = True
    threads_per_proc: int = 0
    init_from: str | None = None
    allow_schedule_change: bool = False
    profile_steps: tuple[int, ...] = ()
    wandb: str = ""

    def __post_init__(self) -> None:
        given = self.profile_steps
        steps = (given,) if isinstance(given, int) and not isinstance(given, bool) else given
        if (not isinstance(steps, (list, tuple))
                or any(not isinstance(v, int) or isinstance(v, bool) or v < 1 for v in steps)):
            raise ConfigError(f"train.profile_steps={given!r} must be a list of step numbers >= 1, "
                              f"e.g. --set 'train.profile_steps=[5,6]'")
        self.profile_steps = tuple(steps)
        for name in ("steps", "micro_batch_size", "grad_accum", "log_every", "keep_ckpts"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"train.{name}={v!r} must be an integer >= 1")
        for name in ("warmup_steps", "eval_every", "eval_batches", "ckpt_every", "nproc", "threads_per_proc"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ConfigError(f"train.{name}={v!r} must be an integer >= 0")
        if not (self.lr > 0 and math.isfinite(self.lr)) or not self.min_lr >= 0 or self.min_lr > self.lr:
            raise ConfigError(f"train.lr={self.lr} must be finite and > 0, and train.min_lr={self.min_lr} in "
                              f"[0, lr]")
        if self.schedule not in ("cosine", "wsd", "constant"):
            raise ConfigError(f"train.schedule={self.schedule!r}; allowed: 'cosine', 'wsd', 'constant'")
        if self.device not in ("auto", "cuda", "cpu"):
            raise ConfigError(f"train.device={self.device!r}; allowed: 'auto', 'cuda', 'cpu'")
        if not (0 <= self.beta1 < 1 and 0 <= self.beta2 < 1):
            raise ConfigError(f"train.beta1={self.beta1}, train.beta2={self.beta2} must be in [0, 1)")
