"""Predict a local ``moetrain train`` run (CPU processes over gloo) from ``moetrain bench`` measurements.

The same cost model as for GPU clusters (:func:`moetrain.plan.model.predict`) runs with:

* a "local" GPUSpec from the bench file: the measured fp32 matmul curve (the rate at each GEMM's size), the
  measured memory-copy bandwidth, the measured gloo all-to-all bandwidth and latency, the measured per-operator
  overhead;
* the CPU efficiency constants (:data:`moetrain.plan.constants.CPU`), documented there;
* what one forward + backward of moetrain's own model code launches, counted with a ``TorchDispatchMode``
  (:mod:`moetrain.plan.counts`: operators, non-GEMM bytes, softmax elements -- properties of the code, like the
  FLOPs of the config; nothing is timed);
* the trainer's layout: FSDP2 over all ranks (parameters all-gathered in every micro-batch's forward and backward,
  gradients reduce-scattered once per step), experts sliced over EP, fp32 on CPU, AdamW.

It also gives ``moetrain plan --gpu local`` its starting point, the plan of ``moetrain train``'s built-in job
(:func:`trainer_plan`): this module sits with train in the layer order (it reads the trainer's job config), so the
rest of ``moetrain.plan`` does not import upward.
"""

from __future__ import annotations

from dataclasses import dataclass, replace
from typing import Any

from moetrain.layout import Layout
from moetrain.model.config import ModelConfig
from moetrain.plan.counts import count_code
from moetrain.plan.hardware import GPUSpec, gpu_from_bench
from moetrain.plan.model import Prediction, predict
from moetrain.plan.plan import Plan
from moetrain.plan.shape import load_shape


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
               ep: int = 2, activation_checkpointing: bool = False, precision: str = "fp32", pp: int = 1,
               vpp: int = 1, schedule: str = "1f1b", pp_layout: str | None = None, ep_overlap: bool = False) -> Plan:
    """The :class:`Plan` of a local ``moetrain train`` run: PP stages of DP = world / PP ranks each, EP carved out
    of a stage's ranks, FSDP2 (parameters resharded after each pass -- fsdp -- unless pipelining or EP overlap
    keep them gathered through the step, as the trainer does); ``schedule`` and ``vpp`` as ``parallel.schedule`` / ``parallel.vpp`` (older names
    accepted; ``grad_accum`` micro-batches per step); ``ep_overlap`` as ``parallel.ep_overlap`` (the planner's
    "paired-microbatch" schedule at PP = 1, the schedule's own F&B pairs under pipelining)."""
    return Plan(tp=1, pp=pp, vpp=vpp if pp > 1 else 1, ep=ep, cp=1, dp=world // pp, micro_batch=micro_batch,
                global_batch=micro_batch * grad_accum * (world // pp), seq_len=seq_len, precision=precision,
                recompute="full" if activation_checkpointing else "none", ep_overlap=ep_overlap,
                routing="balanced" if model_cfg.routing == "balanced" else "real", optimizer="fp32",
                fsdp=not (pp > 1 or ep_overlap),
                schedule=schedule if pp > 1 else None, pp_layout=pp_layout if pp > 1 else None,
                framework="moetrain", name="local moetrain train")


def trainer_plan(model_cfg: ModelConfig, layout: Layout, micro_batch: int, grad_accum: int, seq_len: int) -> Plan:
    """The planner's :class:`Plan` of a ``moetrain train`` run with ``layout`` (framework moetrain): ``grad_accum``
    micro-batches of ``micro_batch`` sequences per step and data-parallel rank."""
    dp = layout.dp or 1
    return Plan(**layout.layout_fields(), micro_batch=micro_batch,
                global_batch=micro_batch * grad_accum * dp, seq_len=seq_len,
                routing="balanced" if model_cfg.routing == "balanced" else "real", framework="moetrain",
                name="moetrain train")


def planned_split(model_cfg: ModelConfig, layout: Layout, micro_batch: int, grad_accum: int, seq_len: int,
                  gpu: str = "H100") -> str:
    """The planner's cost-balanced pipeline split of a ``moetrain train`` run (the stages
    :func:`moetrain.plan.model.predict` balances on ``gpu``), as a Megatron layout ("Ett|ttmL").

    Raises:
        PlanError / ValueError: the planner cannot model the run (its message says why).
    """
    plan = trainer_plan(model_cfg, layout, micro_batch, grad_accum, seq_len)
    world = layout.pp * (layout.dp or 1)
    stages = predict(model_cfg, gpu, world, plan, _ignore_memory=True).details["stages"]
    return "|".join(s.replace("d", "t") for s in stages)


def default_split(model_cfg: ModelConfig, pcfg: Any, micro_batch: int, grad_accum: int, seq_len: int,
                  world: int | None) -> tuple[str | None, str]:
    """The trainer's default pipeline split: the planner's cost-balanced one (:func:`planned_split`) of a run of
    ``pcfg`` (a ``ParallelConfig``) on ``world`` processes, checked against the trainer's stage rules. Returns
    ``(layout, "")``, or ``(None, why)`` where the planner cannot model the run or its split does not fit the
    trainer (the caller then splits evenly)."""
    from moetrain.parallel.pipeline import stage_specs

    dp = pcfg.dp or (world // pcfg.pp if world and world % pcfg.pp == 0 else pcfg.ep)
    layout = pcfg.replace(dp=dp, precision=pcfg.run_precision("cuda"), fsdp=not pcfg.keeps_params_gathered,
                          mtp_depth=None)
    try:
        split = planned_split(model_cfg, layout, micro_batch, grad_accum, seq_len)
        stage_specs(model_cfg, pcfg.replace(pp_layout=split))
    except (ValueError, KeyError) as e:  # PlanError and ConfigError are ValueErrors
        return None, str(e)
    return split, ""


def predict_measured(model: Any, gpu: GPUSpec, n_gpus: int, plan: Plan) -> Prediction:
    """:func:`moetrain.plan.model.predict` on a measured (``moetrain bench``) machine: for moetrain's own model, what
    its code launches is counted (:func:`moetrain.plan.counts.count_code`, on the plan's routing path and
    recompute) and charged; other models get the formulas. A plan that does not fit is returned as the formulas
    give it, before anything is counted (counting runs the model).

    Raises:
        ValueError: a sequence longer than the model's ``max_seq_len`` (``moetrain train`` refuses it too), or a
            model too large to count here; PlanError / HardwareError as :func:`predict`.
    """
    shape = load_shape(model)
    cfg = shape.config
    own_code = gpu.generation == "cpu" and shape.attention == "mla" and isinstance(cfg, ModelConfig)
    max_len = cfg.max_seq_len
    if gpu.generation == "cpu" and max_len is not None and plan.seq_len > max_len:
        raise ValueError(f"sequence length {plan.seq_len} exceeds the model's max_seq_len {max_len}; "
                         f"moetrain train refuses that run too -- use a shorter sequence (--seq)")
    pred = predict(shape, gpu, n_gpus, plan)
    if pred.fits and own_code:
        # forced balance skips the router's top-k selection: count the path the plan's routing takes
        cfg = replace(cfg, routing="balanced" if plan.routing == "balanced" else "learned")
        pred = predict(shape, gpu, n_gpus, plan, counts=count_code(cfg, plan.seq_len, plan.recompute == "full"))
    return pred


def predict_local_train(model_cfg: ModelConfig, seq_len: int, micro_batch: int, grad_accum: int, world: int = 2,
                        ep: int = 2, bench_json: Any = None, *, activation_checkpointing: bool = False,
                        precision: str = "fp32") -> LocalPrediction:
    """Predict the tokens/s of ``moetrain train`` on this machine with ``world`` local processes.

    Args:
        model_cfg: the model (e.g. ``get_preset("tiny")``).
        seq_len, micro_batch, grad_accum: the trainer's data.seq_len, train.micro_batch_size, train.grad_accum.
        world, ep: processes and expert-parallel size.
        bench_json: a ``moetrain bench`` result (dict or path; default .cache/moetrain/bench.json).
        activation_checkpointing: ``parallel.recompute`` "full".
        precision: "fp32" (the trainer's CPU default).

    Raises:
        HardwareError: no bench results (run ``moetrain bench``).
        ValueError: the run does not fit in this machine's memory, or see :func:`predict_measured`.
    """
    gpu = gpu_from_bench(bench_json)
    plan = local_plan(model_cfg, seq_len, micro_batch, grad_accum, world, ep, activation_checkpointing, precision)
    pred = predict_measured(model_cfg, gpu, world, plan)
    if not pred.fits:
        raise ValueError(f"the local run does not fit in memory: {pred.message}")
    tok = pred.tokens_per_s_per_gpu * world
    return LocalPrediction(tokens_per_s=tok, tokens_per_s_per_proc=pred.tokens_per_s_per_gpu,
                           step_s=pred.step.step, prediction=pred)
