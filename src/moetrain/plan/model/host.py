"""Host launch costs: what the GPU waits for when the host launches kernels more slowly than they run (eager
execution, partial CUDA graphs), and the per-operator overhead measured on CPU machines."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.plan.constants import HOST_S_PER_KERNEL, HOST_S_PER_OP, KERNELS_FWD, KERNELS_PER_EXPERT
from moetrain.plan.model.context import CostContext
from moetrain.plan.model.cost import ItemCost


def ops_overhead(c: CostContext, kind: str) -> float:
    """Per-operator dispatch overhead (only for measured local machines; GPUs hide launches behind long kernels
    or CUDA graphs). Operator counts of one forward; the backward launches about twice as many."""
    if not c.op_over:
        return 0.0
    if c.counts is not None:
        return c.counts.ops.get(kind, 0.0) * c.op_over
    per_fwd = {"d": 45, "t": 70 + 4 * c.e_loc, "m": 80 + 4 * c.e_loc, "L": 10, "E": 3}[kind]
    return 3 * per_fwd * c.op_over


@dataclass(frozen=True)
class HostLaunch:
    """Host time to launch one item's kernels for one micro-batch, seconds, split where a MoE layer's forward has to
    wait: ``after_sync`` is what the host launches between the dispatch's device-to-host sync (a dropless dispatch
    needs its token counts on the host) and the combine -- permute, dispatch, the expert MLP, unpermute;
    ``before_sync`` the rest of the forward (attention block, shared expert, router, preprocess); ``backward`` the
    whole backward, which needs no sync (the counts are known by then)."""

    before_sync: float = 0.0
    after_sync: float = 0.0
    backward: float = 0.0

    @property
    def total(self) -> float:
        return self.before_sync + self.after_sync + self.backward


def host_launch(c: CostContext, kind: str) -> HostLaunch:
    """Host launch time of one item for one micro-batch (:class:`HostLaunch`), by CUDA-graph coverage: none with
    whole-iteration graphs, the graphable parts (attention, router, preprocess) as one launch each with partial
    graphs, every kernel eagerly without (constants.KERNELS_FWD at HOST_S_PER_OP of the GPU's host CPU; the
    backward launches twice the forward's kernels). The eager grouped expert MLP (partial graphs leave it eager)
    adds its per-expert GEMMs and quantisations (KERNELS_PER_EXPERT x local experts; forward one GEMM per linear,
    plus its quantisation under FP8, the rest in the backward), launched from C++ at HOST_S_PER_KERNEL scaled to
    the host CPU. Zero on measured CPU machines, whose per-operator overhead is measured instead."""
    g = c.plan.resolved_cuda_graphs
    if g == "full" or c.gpu.generation == "cpu":
        return HostLaunch()
    cpu = c.gpu.host_cpu or "x86"
    per_op = HOST_S_PER_OP[cpu]
    per_launch = HOST_S_PER_KERNEL * per_op / HOST_S_PER_OP["x86"]
    k = KERNELS_FWD
    fp8_casts = 1.5 if c.fp8 else 1.0  # an FP8 GEMM adds a quantisation kernel next to about every second kernel
    attn = 1 if g == "partial" else k["attention"] * fp8_casts
    moe_static = 1 if g == "partial" else k["moe_static"]
    before = {"E": k["embedding"], "L": k["head"], "d": attn + k["ffn"] * fp8_casts,
              "t": attn + moe_static + (k["ffn"] if c.shape.shared_ffn else 0)}
    before["m"] = before["t"] + k["head"] + 4
    after = k["moe_dynamic"] * fp8_casts if kind in ("t", "m") else 0.0
    fwd_kernels = before[kind] + after
    bwd_kernels = 2 * fwd_kernels
    if c.plan.recompute == "full" and kind in ("d", "t", "m"):
        bwd_kernels += fwd_kernels  # the backward runs the forward again first
    exp_fwd = exp_bwd = 0.0
    if kind in ("t", "m") and c.e_loc > 1 and not c.plan.fused_mlp:
        total = KERNELS_PER_EXPERT["fp8" if c.fp8 else "bf16"]
        fwd = 2 * (2 if c.fp8 else 1)  # fc1 and fc2 GEMMs, each after its quantisation under FP8
        exp_fwd, exp_bwd = fwd * c.e_loc * per_launch, (total - fwd) * c.e_loc * per_launch
    return HostLaunch(before_sync=before[kind] * per_op, after_sync=after * per_op + exp_fwd,
                      backward=bwd_kernels * per_op + exp_bwd)


def exposed_host_s(cost: ItemCost, hl: HostLaunch, overlap: bool, resync: bool = False) -> float:
    """GPU time an item waits for the host to launch its kernels, for one micro-batch.

    The host runs ahead of the GPU only as far as the next device-to-host sync. A MoE layer's forward syncs once,
    before its dispatch, so the GPU's queue is empty there: the kernels launched after the sync (the expert MLP
    and its permutes) run no earlier than they are launched, and the rest of the layer (combine, then the next
    attention block and router) only after them. With blocks launched in that order and queued as they come,
    the forward takes max over j of (host time to launch blocks 1..j + GPU time of blocks after j), and never
    less than its GPU time (the standard bound for a launch queue). ``resync``: the backward runs the MoE block's
    forward again (full or ``moe`` recompute), sync included, and waits the same again. Otherwise the backward
    has no sync: its host time is exposed only beyond its GPU time, as is every item without a dispatch. Forward
    is a third of the compute other than recompute (which runs in the backward), as everywhere in this model.
    Only GPU work on the compute stream hides launches: under an overlapped schedule the all-to-all runs on its own
    stream and hides none, so an overlapped eager layer can be slower than a plain one (Megatron-Bridge turned
    Qwen3-235B's EP overlap off on B200 "due to CPU overhead": 20.1 s -> 16.9 s a step, its PR #1760).
    """
    rec = cost.recompute_s
    comp = cost.compute_s - cost.host_s - rec + cost.tp_s + cost.cp_s
    if overlap:
        df = cf = a2a_bwd = 0.0
    elif len(cost.a2a_passes) == 4:
        df, cf, cb, db = cost.a2a_passes
        a2a_bwd = cb + db + cost.a2a_extra_s
    else:
        df = cf = 0.0
        a2a_bwd = cost.a2a_s / 2
    g_bwd = 2 * comp / 3 + rec + a2a_bwd
    if hl.after_sync <= 0.0:
        a2a_fwd = 0.0 if overlap else cost.a2a_s - a2a_bwd
        return max(0.0, hl.before_sync - (comp / 3 + a2a_fwd)) + max(0.0, hl.backward - g_bwd)
    g_moe = (1 - cost.attn_share) * comp / 3 + df      # the expert MLP's forward, after the dispatch
    g_rest = cf + cost.attn_share * comp / 3           # combine, then attention, norms, router
    t_fwd = max(g_moe + g_rest, hl.after_sync + g_rest, hl.after_sync + hl.before_sync)
    fwd = max(0.0, t_fwd - g_moe - g_rest)
    return fwd + max(0.0, hl.backward - g_bwd) + (fwd if resync else 0.0)
