"""Predict a local ``moetrain train`` run (CPU processes over gloo) from ``moetrain bench`` measurements.

The same cost model as for GPU clusters (:func:`moetrain.plan.model.predict`) runs with:

* a "local" GPUSpec from the bench file: the measured fp32 matmul curve (the rate at each GEMM's size), the
  measured memory-copy bandwidth, the measured gloo all-to-all bandwidth and latency, the measured per-operator
  overhead;
* the CPU efficiency constants (:data:`moetrain.plan.constants.CPU`), documented there;
* the operator count of one forward + backward of each block, counted from moetrain's own model code with a
  ``TorchDispatchMode`` on a tiny batch (a property of the code, like FLOPs of the config -- nothing is timed);
* the trainer's layout: FSDP2 over all ranks (parameters all-gathered in every micro-batch's forward and backward,
  gradients reduce-scattered once per step), experts sliced over EP, fp32 on CPU, AdamW.
"""

from __future__ import annotations

from dataclasses import dataclass
from functools import lru_cache
from typing import Any

from moetrain.model.config import ModelConfig
from moetrain.plan.hardware import gpu_from_bench
from moetrain.plan.model import Prediction, predict
from moetrain.plan.plan import Plan


@lru_cache(maxsize=16)
def _count_ops_cached(cfg_items: tuple, seq_len: int) -> dict[str, float]:
    import torch
    from torch.utils._python_dispatch import TorchDispatchMode

    from moetrain.model.config import ModelConfig as MC
    from moetrain.model.transformer import Block, build_model

    cfg = MC.from_dict(dict(cfg_items))

    class Counter(TorchDispatchMode):
        def __init__(self) -> None:
            super().__init__()
            self.n = 0

        def __torch_dispatch__(self, func, types, args=(), kwargs=None):  # noqa: ANN001
            self.n += 1
            return func(*args, **(kwargs or {}))

    torch.manual_seed(0)
    L = min(seq_len, 16, cfg.max_seq_len)
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # counting only; one thread avoids OpenMP spinning on a busy machine
    try:
        return _count(cfg, L, Counter, Block, build_model)
    finally:
        torch.set_num_threads(threads)


def _count(cfg: ModelConfig, L: int, Counter: type, Block: type, build_model: Any) -> dict[str, float]:
    import torch

    def count(fn) -> int:
        c = Counter()
        with c:
            fn()
        return c.n

    model = build_model(cfg, device="cpu", seed=0)
    cos, sin = model._rope(L, torch.device("cpu"))
    out: dict[str, float] = {}
    for kind, idx in (("d", 0 if cfg.n_dense_layers else None), ("t", cfg.n_dense_layers
                                                                 if cfg.n_moe_layers else None)):
        if idx is None:
            out[kind] = 0.0
            continue
        blk: Block = model.layers[idx]
        x = torch.randn(1, L, cfg.dim, requires_grad=True)

        def fb(blk=blk, x=x) -> None:
            y, _ = blk(x, cos, sin)
            y.float().sum().backward()

        out[kind] = float(count(fb))
    tokens = torch.randint(0, cfg.vocab_size, (1, L))

    def whole() -> None:
        o = model(tokens, tokens)
        loss = o.lm_loss_sum + sum(o.mtp_loss_sums) + o.balance_loss_sum
        loss.backward()

    total = float(count(whole))
    rest = total - cfg.n_dense_layers * out["d"] - (cfg.n_moe_layers + cfg.mtp_depth) * out["t"]
    out["m"] = out["t"]
    out["L"] = max(0.0, rest)
    out["E"] = 0.0
    return out


def count_ops(cfg: ModelConfig, seq_len: int = 16) -> dict[str, float]:
    """Aten operators launched by one forward + backward, per pipeline item kind ("d" dense block, "t" MoE block,
    "m" MTP block, "L" everything else: embedding, head, losses), counted on moetrain's model code."""
    return dict(_count_ops_cached(tuple(sorted(cfg.to_dict().items())), seq_len))


def moetrain_counts(cfg: ModelConfig, seq_len: int = 16, activation_checkpointing: bool = False
                    ) -> dict[str, float]:
    """What moetrain's own code launches, for the cost model: :func:`count_ops` per item kind plus ``"a2a_calls"``,
    the all-to-all calls per MoE layer of its dispatcher (dropless with token dedup, the trainer's default;
    activation checkpointing repeats the forward ones)."""
    from moetrain.parallel.dispatch import AllToAllDispatcher

    counts = count_ops(cfg, seq_len)
    fwd, bwd = AllToAllDispatcher.CALLS_DEDUP
    counts["a2a_calls"] = fwd * (2 if activation_checkpointing else 1) + bwd
    return counts


@dataclass
class LocalPrediction:
    """Predicted throughput of a local training run.

    Attributes:
        tokens_per_s: all processes together. tokens_per_s_per_proc: per process (the trainer's "tok/s/gpu").
        step_s: predicted optimizer-step time. prediction: the full model prediction.
    """

    tokens_per_s: float
    tokens_per_s_per_proc: float
    step_s: float
    prediction: Prediction

    def to_dict(self) -> dict[str, Any]:
        return {"tokens_per_s": self.tokens_per_s, "tokens_per_s_per_proc": self.tokens_per_s_per_proc,
                "step_s": self.step_s, "prediction": self.prediction.to_dict()}


def local_plan(model_cfg: ModelConfig, seq_len: int, micro_batch: int, grad_accum: int, world: int = 2,
               ep: int = 2, activation_checkpointing: bool = False, precision: str = "fp32") -> Plan:
    """The :class:`Plan` of a local ``moetrain train`` run (DP = world, EP carved out of it, FSDP2)."""
    return Plan(tp=1, pp=1, vpp=1, ep=ep, cp=1, dp=world, micro_batch=micro_batch,
                global_batch=micro_batch * grad_accum * world, seq_len=seq_len, precision=precision,
                recompute="full" if activation_checkpointing else "none", ep_overlap=False,
                routing="balanced" if model_cfg.routing == "balanced" else "real", optimizer="fp32", fsdp=True,
                name="local moetrain train")


def predict_local_train(model_cfg: ModelConfig, seq_len: int, micro_batch: int, grad_accum: int, world: int = 2,
                        ep: int = 2, bench_json: Any = None, *, activation_checkpointing: bool = False,
                        precision: str = "fp32") -> LocalPrediction:
    """Predict the tokens/s of ``moetrain train`` on this machine with ``world`` local processes.

    Args:
        model_cfg: the model (e.g. ``get_preset("tiny")``).
        seq_len, micro_batch, grad_accum: the trainer's data.seq_len, train.micro_batch_size, train.grad_accum.
        world, ep: processes and expert-parallel size.
        bench_json: a ``moetrain bench`` result (dict or path; default .cache/moetrain/bench.json).
        activation_checkpointing: parallel.activation_checkpointing.
        precision: "fp32" (the trainer's CPU default).

    Raises:
        HardwareError: no bench results (run ``moetrain bench``).
    """
    gpu = gpu_from_bench(bench_json)
    plan = local_plan(model_cfg, seq_len, micro_batch, grad_accum, world, ep, activation_checkpointing, precision)
    pred = predict(model_cfg, gpu, world, plan,
                   op_counts=moetrain_counts(model_cfg, seq_len, activation_checkpointing))
    if not pred.fits:
        raise ValueError(f"the local run does not fit in memory: {pred.message}")
    tok = pred.tokens_per_s_per_gpu * world
    return LocalPrediction(tokens_per_s=tok, tokens_per_s_per_proc=pred.tokens_per_s_per_gpu,
                           step_s=pred.step.step, prediction=pred)
