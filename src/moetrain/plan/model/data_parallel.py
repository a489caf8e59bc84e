"""What data parallelism adds to a step: the gradient reduce-scatter and parameter all-gather (hierarchical: a ring
inside each NVLink domain, then across domains over the NIC) and how much of them the last / first micro-batch
hides, FSDP's per-micro-batch parameter gathers, and the memory-bound optimizer step on the local shard."""

from __future__ import annotations

from moetrain.plan.model.context import TP_COLLECTIVE_LATENCY_S, CostContext
from moetrain.plan.model.cost import ItemCost
from moetrain.plan.model.pipeline import rank_params
from moetrain.plan.plan import Plan


def members_per_domain(group: int, stride: int, domain: int) -> int:
    """Members of a collective group (``group`` ranks ``stride`` apart) that share an NVLink domain."""
    if stride >= domain:
        return 1
    fit = max(1, domain // stride)
    return max(d for d in range(1, min(group, fit) + 1) if group % d == 0)


def dp_time(c: CostContext, params: float, group: int, stride: int, bytes_per: float) -> float:
    """Reduce-scatter (or all-gather) of ``params`` parameters of ``bytes_per`` bytes over a data-parallel group of
    ``group`` members ``stride`` ranks apart, seconds: a ring inside each NVLink domain, then across domains over
    the NIC."""
    if group <= 1 or params <= 0:
        return 0.0
    local = members_per_domain(group, stride, c.domain)
    inter = group // local
    t = 0.0
    if local > 1:
        t += params * bytes_per * (local - 1) / local / c.nvl
    if inter > 1:
        t += params * bytes_per / local * (inter - 1) / inter / c.nic
    return t


def measured_fsdp(c: CostContext) -> bool:
    """Whether ``moetrain bench`` measured FSDP2's per-unit cost on this machine."""
    return c.gpu.fsdp_unit_latency_us is not None and c.gpu.fsdp_unit_gbps is not None


def fsdp_gather_time(c: CostContext, plan: Plan, costs: dict[str, ItemCost], stages: list[list[str]],
                     sts: list[int]) -> float:
    """Exposed FSDP time per micro-batch of the pipeline rank holding stages ``sts``, seconds (0 without FSDP)."""
    spec = c.gpu
    g_dense, g_exp = plan.dp * plan.cp, plan.edp
    if plan.fsdp and measured_fsdp(c):
        # FSDP2 as measured by `moetrain bench` on this machine: each unit (a block, its experts when they are
        # sharded over an expert-data-parallel group, the root with embedding and head) costs a measured
        # latency plus its parameter bytes at a measured rate per micro-batch: the forward and backward
        # all-gathers, the gradient reduce-scatter, hooks and copies, in lock-step on shared cores
        units = [costs[k].params_dense for s_idx in sts for k in stages[s_idx] if k in ("d", "t", "m")]
        if plan.edp > 1:
            units += [costs[k].params_expert for s_idx in sts for k in stages[s_idx] if k in ("t", "m")]
        root = sum(costs[k].params_dense for s_idx in sts for k in stages[s_idx] if k in ("E", "L"))
        units += [root] if root > 0 else []
        return (sum(spec.fsdp_unit_latency_us * 1e-6 + u * c.param_bytes / (spec.fsdp_unit_gbps * 1e9)
                    for u in units) if g_dense > 1 else 0.0)
    if plan.fsdp:
        # FSDP: every micro-batch all-gathers the rank's parameters in its forward and again in its backward;
        # exposed on CPUs (gloo shares the cores), else hidden behind compute except the first layer's
        pdd, ped = rank_params(costs, stages, sts)
        n_it = sum(len(stages[s_idx]) for s_idx in sts)
        lat = c.a2a_lat if spec.generation == "cpu" else TP_COLLECTIVE_LATENCY_S
        units = n_it + sum(1 for s_idx in sts for k in stages[s_idx] if k in ("t", "m") and plan.edp > 1)
        t_ag = 2 * (dp_time(c, pdd, g_dense, plan.tp, c.param_bytes)
                    + dp_time(c, ped, g_exp, plan.ep, c.param_bytes)
                    + (units * lat if g_dense > 1 else 0.0))
        dev_c = sum(costs[k].compute_s for s_idx in sts for k in stages[s_idx])
        t_ag = t_ag if spec.generation == "cpu" else max(t_ag / max(1, n_it), t_ag - dev_c)
        return t_ag
    return 0.0


def dp_sync_time(c: CostContext, plan: Plan, pd_slow: float, pe_slow: float, t_max: float,
                 bubble: float) -> tuple[float, float, float]:
    """(gradient reduce-scatter, parameter all-gather, exposed part of both) of one step, seconds, for the slowest
    pipeline rank's ``pd_slow`` dense and ``pe_slow`` expert parameters, its time ``t_max`` per micro-batch and the
    step's ``bubble``. With ``dp_overlap`` the reduce-scatter hides behind the backward of the last micro-batch and
    the all-gather behind the forward of the first, each never below a share of itself."""
    g_dense, g_exp = plan.dp * plan.cp, plan.edp
    sched = plan.resolved_schedule
    # (the measured FSDP2 unit cost includes its reduce-scatter)
    rs = 0.0 if plan.fsdp and measured_fsdp(c) else (dp_time(c, pd_slow, g_dense, plan.tp, c.grad_bytes)
                                                    + dp_time(c, pe_slow, g_exp, plan.ep, c.grad_bytes))
    ag = 0.0 if plan.fsdp else (dp_time(c, pd_slow, g_dense, plan.tp, c.param_bytes)
                                + dp_time(c, pe_slow, g_exp, plan.ep, c.param_bytes))
    if c.gpu.generation == "cpu":
        dp_exposed = rs + ag  # gloo collectives run on the same cores as the compute
    elif plan.dp_overlap:
        last = 1.0 / (4 * (plan.vpp if sched == "interleaved" else 1))
        dp_exposed = (max(rs - (2 / 3) * t_max - bubble / 2, rs * last)
                      + max(ag - (1 / 3) * t_max - bubble / 2, ag * last))
    else:
        dp_exposed = rs + ag
    return rs, ag, dp_exposed


def optimizer_step_time(c: CostContext, plan: Plan, pd_slow: float, pe_slow: float) -> float:
    """Optimizer step of the slowest pipeline rank, seconds: a memory-bound update of its shard of the optimizer
    states, and the FP8 re-cast of all its local weights."""
    opt_bytes = {"fp32": 30.0, "bf16-moments": 22.0, "bf16": 18.0}[plan.optimizer]
    shard = pd_slow / (plan.dp * plan.cp) + pe_slow / plan.edp
    local = pd_slow + pe_slow
    return (shard * opt_bytes + local * (c.grad_bytes + (4.0 if c.fp8 else 0.0))) / c.hbm
