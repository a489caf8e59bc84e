"""The prediction: :func:`predict` builds one step from the item costs (:mod:`.layer`), the pipeline ranks
(:mod:`.pipeline`), memory (:mod:`.memory`) and data-parallel / optimizer time (:mod:`.data_parallel`); for real
routing without an imbalance factor it first solves the factor (:func:`solve_real_imbalance`)."""

from __future__ import annotations

from dataclasses import asdict, dataclass, field
from typing import Any

import numpy as np

from moetrain.plan.constants import REAL_ROUTING_SLOWDOWN, efficiency_for
from moetrain.plan.counts import CodeCounts
from moetrain.plan.hardware import GPUSpec, get_gpu
from moetrain.plan.model.context import GIB, CostContext
from moetrain.plan.model.cost import ItemCost
from moetrain.plan.model.data_parallel import dp_sync_time, fsdp_gather_time, optimizer_step_time
from moetrain.plan.model.layer import item_cost
from moetrain.plan.model.memory import MemoryBreakdown, memory_per_rank
from moetrain.plan.model.pipeline import (
    RankTime,
    bubble_time,
    device_stages,
    item_time,
    p2p_stage_time,
    p2p_time,
    rank_params,
    rank_time,
    stage_items,
    unpaired_fraction,
)
from moetrain.plan.plan import Plan, validate
from moetrain.plan.shape import ModelShape, load_shape, with_mtp_depth

#: the pipeline items: embedding, dense layer, MoE layer, MTP module, output head + loss
ITEM_KINDS = ("E", "d", "t", "m", "L")


@dataclass
class StepBreakdown:
    """Step time split (seconds) on the slowest pipeline rank; the parts sum to ``step``."""

    compute: float
    exposed_a2a: float
    other_comm: float
    bubble: float
    optimizer: float
    compute_parts: dict[str, float] = field(default_factory=dict)

    @property
    def step(self) -> float:
        return self.compute + self.exposed_a2a + self.other_comm + self.bubble + self.optimizer

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d["step"] = self.step
        return d


@dataclass
class Prediction:
    """What the model predicts for one plan on one cluster.

    When ``fits`` is False the throughput fields are None and ``message`` says what does not fit.
    """

    model: str
    gpu: str
    n_gpus: int
    plan: Plan
    fits: bool
    memory: MemoryBreakdown
    memory_limit_gib: float
    flops_per_token: float
    step: StepBreakdown | None = None
    tokens_per_s_per_gpu: float | None = None
    tflops_per_gpu: float | None = None
    mfu: float | None = None
    mfu_bf16: float | None = None
    details: dict[str, Any] = field(default_factory=dict)
    message: str = ""

    @property
    def step_time(self) -> float | None:
        return self.step.step if self.step else None

    def time_to_train(self, tokens: float) -> float | None:
        """Seconds to train on ``tokens`` tokens at the predicted throughput (None if the plan does not fit)."""
        if not self.tokens_per_s_per_gpu:
            return None
        return tokens / (self.tokens_per_s_per_gpu * self.n_gpus)

    def to_dict(self) -> dict[str, Any]:
        return {
            "model": self.model, "gpu": self.gpu, "n_gpus": self.n_gpus, "plan": self.plan.to_dict(),
            "fits": self.fits, "message": self.message,
            "memory_gib": self.memory.to_dict(), "memory_limit_gib": self.memory_limit_gib,
            "flops_per_token": self.flops_per_token,
            "step_s": self.step.to_dict() if self.step else None,
            "tokens_per_s_per_gpu": self.tokens_per_s_per_gpu, "tflops_per_gpu": self.tflops_per_gpu,
            "mfu": self.mfu, "mfu_bf16": self.mfu_bf16, "details": self.details,
        }


def predict(model: Any, gpu: GPUSpec | str, n_gpus: int, plan: Plan, *, counts: CodeCounts | None = None,
            _ignore_memory: bool = False) -> Prediction:
    """Predict step time, throughput and memory of ``plan`` for ``model`` on ``n_gpus`` GPUs of type ``gpu``.

    Args:
        model: a preset name, HF config.json path, a model config (any family), or ModelShape.
        gpu: a GPUSpec or catalogue name.
        n_gpus: GPU count.
        plan: the plan (validated here; DP is derived when None). Real routing without an ``imbalance`` factor
            gets the factor that makes its step ``constants.REAL_ROUTING_SLOWDOWN`` times the forced-balanced
            step (:func:`solve_real_imbalance`); the returned prediction's plan carries it.
        counts: what moetrain's own code launches (:func:`moetrain.plan.counts.count_code`), for measured local
            machines: per-operator overhead per counted operator, the counted non-GEMM bytes and softmax elements
            instead of the byte formulas, and one all-to-all latency per dispatcher call. None = the formulas.

    Returns:
        :class:`Prediction`; ``fits`` is False (and no throughput is given) when the plan needs more memory
        than the GPU has.

    Raises:
        PlanError: invalid plan (sizes that do not multiply to the GPU count, EP not dividing the experts, ...).
        HardwareError: unknown GPU. ShapeError: unknown model.
    """
    shape = load_shape(model)
    spec = gpu if isinstance(gpu, GPUSpec) else get_gpu(gpu)
    plan = validate(plan, shape, spec, n_gpus)
    shape = with_mtp_depth(shape, plan.mtp_depth)
    if plan.routing == "real" and plan.imbalance is None:
        x, base = solve_real_imbalance(shape, spec, n_gpus, plan, counts)
        pred = _predict_at(shape, spec, n_gpus, plan.replace(imbalance=x), counts=counts,
                           _ignore_memory=_ignore_memory)
        pred.details["real_routing"] = {
            "target_slowdown": REAL_ROUTING_SLOWDOWN, "solved_imbalance": x, "balanced_step_s": base,
            "note": "max/mean load per EP rank at which this plan's step is REAL_ROUTING_SLOWDOWN x its "
                    "forced-balanced step (published: unforced routing 8-20% slower)"}
        return pred
    return _predict_at(shape, spec, n_gpus, plan, counts=counts, _ignore_memory=_ignore_memory)


def solve_real_imbalance(shape: ModelShape, spec: GPUSpec, n_gpus: int, plan: Plan,
                          counts: CodeCounts | None) -> tuple[float, float]:
    """The max/mean load per EP rank at which ``plan`` (real routing) is ``REAL_ROUTING_SLOWDOWN`` times slower
    than the same plan forced-balanced; also returns the balanced step time.

    The step grows monotonically (piecewise linearly) with the imbalance, so a bracketed regula falsi (Illinois)
    converges in a few evaluations of the model. If no factor up to 16 slows the step enough (a plan with almost
    no expert work) 16 is returned.
    """
    def step(x: float | None) -> float:
        p = plan.replace(routing="balanced") if x is None else plan.replace(imbalance=x)
        return _predict_at(shape, spec, n_gpus, p, counts=counts, _ignore_memory=True).step.step

    base = step(None)
    target = REAL_ROUTING_SLOWDOWN * base
    lo, f_lo = 1.0, step(1.0) - target
    if f_lo >= 0:
        return 1.0, base
    hi = 1.0 + 2 * (REAL_ROUTING_SLOWDOWN - 1)
    f_hi = step(hi) - target
    while f_hi < 0 and hi < 16.0:
        lo, f_lo = hi, f_hi
        hi = min(16.0, 2 * hi)
        f_hi = step(hi) - target
    if f_hi < 0:
        return hi, base
    side = 0
    x = hi
    for _ in range(60):
        x = (lo * f_hi - hi * f_lo) / (f_hi - f_lo)
        f = step(x) - target
        if abs(f) <= 1e-12 * target or hi - lo <= 1e-12:
            break
        if f < 0:
            lo, f_lo = x, f
            if side == -1:
                f_hi /= 2
            side = -1
        else:
            hi, f_hi = x, f
            if side == 1:
                f_lo /= 2
            side = 1
    return float(x), base


def _predict_at(shape: ModelShape, spec: GPUSpec, n_gpus: int, plan: Plan, *,
                counts: CodeCounts | None = None, _ignore_memory: bool = False) -> Prediction:
    """:func:`predict` for a validated plan whose routing imbalance is known."""
    c = CostContext(shape, spec, plan, efficiency_for(spec.generation), counts)
    overlap = plan.overlapped and plan.ep > 1
    u = unpaired_fraction(plan) if overlap else 1.0
    costs = {k: item_cost(c, k) for k in ITEM_KINDS}
    item_times = {k: item_time(costs[k], plan, overlap, u, c.comm_share) for k in costs}
    stages = stage_items(shape, plan, {k: t for k, (t, _) in item_times.items()})
    dev_stages = device_stages(plan, len(stages))
    p2p_t = p2p_time(c, shape, plan)
    stage_p2p = [p2p_stage_time(plan, overlap, p2p_t, costs, items) for items in stages]
    ranks = [rank_time(plan, costs, item_times, stages, sts, stage_p2p, fsdp_gather_time(c, plan, costs, stages, sts))
             for sts in dev_stages]
    dev_time = [float(r.total) for r in ranks]
    slow = int(np.argmax(dev_time))
    t_max, t_mean = dev_time[slow], float(np.mean(dev_time))
    bubble = bubble_time(plan, t_mean)
    mems = memory_per_rank(c, plan, costs, stages, dev_stages)
    pd_slow, pe_slow = rank_params(costs, stages, dev_stages[slow])
    rs, ag, dp_exposed = dp_sync_time(c, plan, pd_slow, pe_slow, t_max, bubble)
    step = _step_breakdown(plan.n_microbatches, ranks[slow], t_max, bubble, dp_exposed,
                           optimizer_step_time(c, plan, pd_slow, pe_slow),
                           _compute_by_kernel_class(costs, stages, dev_stages[slow]))
    details = _details(c, plan, costs, stages, dev_stages, stage_p2p, dev_time, slow, mems,
                       u if overlap else None, rs, ag, p2p_t)
    return _prediction(c, n_gpus, plan, mems, step, details, _ignore_memory)


def _compute_by_kernel_class(costs: dict[str, ItemCost], stages: list[list[str]], sts: list[int]) -> dict[str, float]:
    """GPU time per micro-batch of the pipeline rank holding stages ``sts`` by kernel class, seconds (without the
    overlap slowdown, which :func:`_step_breakdown` spreads pro rata)."""
    sub = {"dense GEMM": 0.0, "expert GEMM": 0.0, "attention": 0.0, "memory-bound": 0.0, "recompute/overhead": 0.0,
           "host launch": 0.0}
    for s_idx in sts:
        for k in stages[s_idx]:
            ck = costs[k]
            sub["dense GEMM"] += ck.gemm_s + ck.head_s
            sub["expert GEMM"] += ck.grouped_s
            sub["attention"] += ck.attn_s
            sub["memory-bound"] += ck.mem_s
            sub["recompute/overhead"] += ck.recompute_s + ck.overhead_s
            sub["host launch"] += ck.host_s
    return sub


def _step_breakdown(m: int, rank: RankTime, t_max: float, bubble: float, dp_exposed: float, t_opt: float,
                    sub: dict[str, float]) -> StepBreakdown:
    """The step of ``m`` micro-batches paced by the slowest pipeline rank ``rank`` (time ``t_max`` per micro-batch),
    with the pipeline ``bubble``, the exposed data-parallel time and the optimizer step, seconds."""
    parts = rank.parts
    tot = sum(sub.values()) or 1.0
    compute = m * parts["compute"]
    # t_max is the slowest device's sum of the same parts: their difference is round-off when PP = 1
    idle = t_max - sum(parts.values())
    idle = 0.0 if abs(idle) <= 1e-12 * t_max else idle
    return StepBreakdown(compute=compute, exposed_a2a=m * parts["a2a"],
                         other_comm=m * parts["comm"] + dp_exposed, bubble=bubble + m * idle,
                         optimizer=t_opt, compute_parts={k: compute * v / tot for k, v in sub.items()})


def _details(c: CostContext, plan: Plan, costs: dict[str, ItemCost], stages: list[list[str]],
             dev_stages: list[list[int]], stage_p2p: list[float], dev_time: list[float], slow: int,
             mems: list[MemoryBreakdown], unpaired: float | None, rs: float, ag: float,
             p2p_t: float) -> dict[str, Any]:
    """The prediction's ``details``: the intermediate quantities a report or a comparison reads."""
    m = plan.n_microbatches
    sched = plan.resolved_schedule
    return {
        "stages": ["".join(st) for st in stages],
        # per stage, the parameters it holds, and per device the bytes of its weights, gradients and optimizer
        # states (what the trainer's dry run compares with the stages it builds)
        "stage_params": [sum(costs[k].params_dense + costs[k].params_expert for k in st) for st in stages],
        "state_per_device_gib": [mb.weights + mb.fp8_weights + mb.gradients + mb.optimizer for mb in mems],
        "device_time_per_microbatch_s": dev_time,
        "slowest_device": slow,
        "microbatches": m,
        "tokens_per_gpu_per_microbatch": c.n,
        "item_cost_s": {k: {"compute": v.compute_s, "a2a": v.a2a_s, "tp": v.tp_s, "cp": v.cp_s,
                            "gemm": v.gemm_s, "grouped": v.grouped_s, "attention": v.attn_s, "head": v.head_s,
                            "memory_bound": v.mem_s, "recompute": v.recompute_s, "overhead": v.overhead_s,
                            "host_launch": v.host_s,
                            "activation_gib_per_mb": v.act_bytes / GIB}
                        for k, v in costs.items()},
        "routing": asdict(c.rstats),
        "ep_overlap_unpaired_fraction": unpaired,
        "overlap_schedule": plan.overlap_schedule,
        "dispatcher": plan.resolved_dispatcher, "cuda_graphs": plan.resolved_cuda_graphs,
        "framework": plan.framework, "comm_sm_share": c.comm_share,
        "dp_reduce_scatter_s": rs, "dp_all_gather_s": ag,
        "pp_p2p_per_microbatch_s": p2p_t,
        "pp_p2p_exposed_per_microbatch_s": [
            sum(stage_p2p[i] for i in sts) / (2 if sched == "dualpipe" else 1) for sts in dev_stages],
        "memory_per_device_gib": [mb.total for mb in mems],
        # the same per device, part by part (the dry run's verdict reads every pipeline rank's activations)
        "memory_breakdown_per_device_gib": [mb.to_dict() for mb in mems],
        "efficiency": c.eff.to_dict(),
    }


def _prediction(c: CostContext, n_gpus: int, plan: Plan, mems: list[MemoryBreakdown], step: StepBreakdown,
                details: dict[str, Any], _ignore_memory: bool) -> Prediction:
    """The :class:`Prediction`: memory of the most loaded pipeline rank against the GPU's, and, when it fits (or
    ``_ignore_memory``), the step and the throughput it gives."""
    shape, spec = c.shape, c.gpu
    mem = max(mems, key=lambda mb: mb.total)
    fpt = shape.flops_per_token(plan.seq_len)
    limit = spec.hbm_gb
    pred = Prediction(model=shape.name, gpu=spec.name, n_gpus=n_gpus, plan=plan, fits=mem.total <= limit,
                      memory=mem, memory_limit_gib=limit, flops_per_token=fpt, details=details)
    if not pred.fits and not _ignore_memory:
        pred.message = (f"does not fit: pipeline rank {mem.device} needs {mem.total:.1f} GiB > {limit:g} GiB of "
                        f"{spec.name} (weights {mem.weights + mem.fp8_weights:.1f}, gradients {mem.gradients:.1f}, "
                        f"optimizer {mem.optimizer:.1f}, activations {mem.activations:.1f}, reserved "
                        f"{mem.reserved:.1f}); try activation recompute, a smaller micro-batch, or more PP/EP")
        return pred
    pred.step = step
    tok_s = plan.tokens_per_step / (step.step * n_gpus)
    pred.tokens_per_s_per_gpu = tok_s
    pred.tflops_per_gpu = tok_s * fpt / 1e12
    pred.mfu = pred.tflops_per_gpu * 1e12 / c.peak(plan.precision)
    pred.mfu_bf16 = pred.tflops_per_gpu * 1e12 / c.peak("bf16")
    if mem.total > 0.95 * limit:
        pred.message = f"fits with little headroom ({mem.total:.1f} of {limit:g} GiB)"
    return pred
