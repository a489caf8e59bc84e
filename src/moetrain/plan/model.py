"""The analytical performance model: step time, throughput and memory of a plan on a cluster.

How a step is built (docs/performance-model.md has the long version):

1. **Pipeline items.** The model is a sequence of items -- embedding ``E``, dense layers ``d``, MoE layers ``t``,
   MTP modules ``m``, the output head + loss ``L`` -- split into pipeline stages (a Megatron layout string, or a
   split that balances predicted time).
2. **One item, one micro-batch, one GPU (forward + backward).** Compute time from the FLOPs of
   :mod:`moetrain.accounting` (the ``moetrain count`` numbers) divided by peak x efficiency, per class of kernel:
   dense GEMMs, grouped expert GEMMs, attention (with its softmax bounded by the exponential units), the BF16
   output head; each GEMM is also bounded below by the time to stream its weights (roofline). Memory-bound
   kernels (norms, RoPE, SwiGLU, permutes, casts) move a number of bytes derived from the layer's tensor sizes.
   Recomputation adds forward work. The expert all-to-all (dispatch + combine, forward + backward) moves
   ``tokens x distinct destinations x hidden x bytes`` over NVLink inside a domain and over the NIC across
   domains (one copy per destination domain, forwarded over NVLink there), at the slowest rank's load, plus a
   fixed latency per call. TP collectives (sequence parallel) and CP ring exchanges add communication.
3. **Overlap.** With expert-parallel overlap (or DualPipe) the all-to-all of one micro-batch runs under the
   compute of another: an item takes ``max(a2a, compute + share * a2a)`` (the communication kernels hold
   ``share`` of the SMs) instead of ``compute + a2a``, except in pipeline warm-up/cool-down where no partner
   micro-batch exists.
4. **Pipeline.** ``step = m * t_slowest_device + bubble`` with the bubble of 1F1B ``(PP-1) t``, interleaved
   ``(PP-1)/VPP t`` or DualPipe ``(PP/2-1)(F&B + B - 3W)``; plus the pipeline P2P where the schedule exposes it
   (1F1B; Megatron's combined 1F1B = interleaved + EP overlap, minus the deferred attention weight gradient;
   hidden in plain interleaved 1F1B and DualPipe); plus the data-parallel gradient reduce-scatter and
   parameter all-gather not hidden behind the last/first micro-batch, plus the optimizer step (memory-bound).
   Real routing without an explicit imbalance factor: the max/mean load per EP rank is solved so that the step is
   ``constants.REAL_ROUTING_SLOWDOWN`` times the forced-balanced step (the published statement is per step).
5. **Memory** per GPU: weights, FP8 weight copies, gradients, sharded optimizer states, the activations of the
   micro-batches in flight on the busiest pipeline rank, and a fixed reserve. A plan that does not fit is
   reported as not fitting and gets no throughput.

All efficiency constants live in :mod:`moetrain.plan.constants`.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field
from functools import lru_cache
from typing import Any

import numpy as np

from moetrain.plan.constants import (
    COMM_SMS,
    ELEMENTWISE_BWD_TO_FWD,
    HOST_S_PER_KERNEL,
    HOST_S_PER_OP,
    KERNELS_FWD,
    KERNELS_PER_EXPERT,
    FP8_BYTES,
    REAL_ROUTING_SLOWDOWN,
    RESERVED_GIB,
    RESERVED_GIB_CPU,
    ROUTING_SAMPLES,
    Efficiency,
    efficiency_for,
)
from moetrain.plan.counts import CodeCounts
from moetrain.plan.hardware import GPUSpec, get_gpu
from moetrain.plan.plan import Plan, balanced_partition, default_items, layout_items, n_pipeline_stages, validate
from moetrain.plan.shape import ModelShape, load_shape, with_mtp_depth

GIB = float(1 << 30)
TP_COLLECTIVE_LATENCY_S = 10e-6  # one NCCL all-gather / reduce-scatter call inside an NVLink domain
P2P_LATENCY_S = 10e-6


# ----------------------------------------------------------------------------------------------------------------
# Routing statistics: how many ranks / domains a token's top-k experts live on
# ----------------------------------------------------------------------------------------------------------------

@dataclass(frozen=True)
class RoutingStats:
    """Expected copies of one token per dispatch, by where they go (balanced routing, Monte Carlo).

    Attributes:
        same_domain_ranks: distinct destination ranks in the sender's NVLink domain, the sender excluded.
        remote_domains: distinct destination domains other than the sender's (one NIC copy each).
        remote_domain_ranks: distinct destination ranks in those domains (NVLink forwarding there).
        ranks: all distinct destination ranks, the sender included.
        same_domain_pairs, remote_pairs: (token, expert) pairs whose expert is on another rank of the sender's
            domain / in another domain -- the rows an ``alltoall`` dispatcher sends (no deduplication).
    """

    same_domain_ranks: float
    remote_domains: float
    remote_domain_ranks: float
    ranks: float
    same_domain_pairs: float = 0.0
    remote_pairs: float = 0.0


@lru_cache(maxsize=4096)
def routing_stats(n_experts: int, top_k: int, ep: int, ranks_per_domain: int, n_groups: int = 1,
                  n_limited_groups: int = 1, node_limit: int | None = None,
                  samples: int = ROUTING_SAMPLES, seed: int = 0) -> RoutingStats:
    """Monte-Carlo estimate of the destinations of a token's k experts under balanced routing.

    Experts are placed in order, E/EP per rank; ranks fill NVLink domains of ``ranks_per_domain``. Each token
    draws k distinct experts uniformly among its candidates: all experts; or those of ``n_limited_groups`` random
    groups out of ``n_groups`` (group-limited routing; forced-balanced benchmarks keep it); or, with
    ``node_limit`` M, those of M random domains (DeepSeek-V3 node-limited routing). A dispatcher sends one copy
    per destination rank (tokens for several experts of one rank travel once), and across domains one copy per
    destination domain, forwarded over NVLink there (DeepEP / HybridEP).
    """
    if ep <= 1:
        return RoutingStats(0.0, 0.0, 0.0, 1.0, 0.0, 0.0)
    rng = np.random.default_rng(seed)
    per_rank = n_experts // ep
    r = max(1, min(ranks_per_domain, ep))
    n_dom = math.ceil(ep / r)
    src = rng.integers(0, ep, size=samples)
    if node_limit is not None and node_limit < n_dom:
        doms = np.argsort(rng.random((samples, n_dom)), axis=1)[:, :node_limit]
        per_dom = n_experts // n_dom
        cand = (doms[:, :, None] * per_dom + np.arange(per_dom)[None, None, :]).reshape(samples, -1)
    elif n_groups > 1 and n_limited_groups < n_groups:
        gsize = n_experts // n_groups
        groups = np.argsort(rng.random((samples, n_groups)), axis=1)[:, :n_limited_groups]
        cand = (groups[:, :, None] * gsize + np.arange(gsize)[None, None, :]).reshape(samples, -1)
    else:
        cand = np.broadcast_to(np.arange(n_experts), (samples, n_experts))
    pick = np.argsort(rng.random(cand.shape), axis=1)[:, :top_k]
    experts = np.take_along_axis(cand, pick, axis=1)
    ranks = experts // per_rank
    doms_of = ranks // r
    src_dom = (src // r)[:, None]
    # (token, expert) pairs by destination, without deduplication
    pair_dom = ranks // r
    same_pairs = float(np.mean(np.sum((pair_dom == src_dom) & (ranks != src[:, None]), axis=1)))
    remote_pairs = float(np.mean(np.sum(pair_dom != src_dom, axis=1)))
    same, rdoms, rranks, allr = 0.0, 0.0, 0.0, 0.0
    for i in range(samples):
        ur = np.unique(ranks[i])
        ud = ur // r
        allr += len(ur)
        same += np.count_nonzero((ud == src_dom[i, 0]) & (ur != src[i]))
        rem = ud != src_dom[i, 0]
        rranks += np.count_nonzero(rem)
        rdoms += len(np.unique(ud[rem]))
    del doms_of
    return RoutingStats(float(same / samples), float(rdoms / samples), float(rranks / samples),
                        float(allr / samples), same_pairs, remote_pairs)


def _ranks_per_domain(ep: int, domain: int) -> int:
    """EP ranks that share an NVLink domain: all of them if the group fits, else the largest divisor of EP that
    fits (schedulers place aligned blocks, e.g. 64 GPUs of a 72-GPU NVL72 rack)."""
    if ep <= domain:
        return ep
    return max(d for d in range(1, domain + 1) if ep % d == 0)


def _members_per_domain(group: int, stride: int, domain: int) -> int:
    """Members of a collective group (``group`` ranks ``stride`` apart) that share an NVLink domain."""
    if stride >= domain:
        return 1
    fit = max(1, domain // stride)
    return max(d for d in range(1, min(group, fit) + 1) if group % d == 0)


# ----------------------------------------------------------------------------------------------------------------
# Cost of one pipeline item for one micro-batch on one GPU
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class ItemCost:
    """Forward + backward of one pipeline item for one micro-batch on one GPU (seconds, bytes, FLOPs).

    ``flops`` is the model FLOPs (Megatron accounting) done on this GPU; recomputation is extra time, not FLOPs.
    """

    kind: str
    flops: float = 0.0
    gemm_s: float = 0.0
    grouped_s: float = 0.0
    attn_s: float = 0.0
    head_s: float = 0.0
    mem_s: float = 0.0
    recompute_s: float = 0.0
    overhead_s: float = 0.0
    a2a_s: float = 0.0
    tp_s: float = 0.0
    cp_s: float = 0.0
    host_s: float = 0.0  # host launch time the GPU waits for (eager launches slower than the kernels run)
    attn_share: float = 1.0  # share of the compute before the dispatch (attention, norms, router), for overlap
    #: the all-to-all passes of one micro-batch: dispatch fwd, combine fwd, combine bwd, dispatch bwd (seconds);
    #: extra passes (recompute) and metadata exchanges in a2a_extra_s
    a2a_passes: tuple[float, ...] = ()
    a2a_extra_s: float = 0.0
    attn_wgrad_s: float = 0.0  # weight-gradient GEMMs of the attention projections (a part of gemm_s)
    act_bytes: float = 0.0
    params_dense: float = 0.0
    params_expert: float = 0.0

    @property
    def compute_s(self) -> float:
        return (self.gemm_s + self.grouped_s + self.attn_s + self.head_s + self.mem_s + self.recompute_s
                + self.overhead_s + self.host_s)

    def time(self, overlap: bool, sm_share: float) -> tuple[float, float]:
        """(time of the item, exposed all-to-all part), communication outside the a2a included."""
        c, a = self.compute_s, self.a2a_s
        if overlap and a > 0 and len(self.a2a_passes) == 4:
            t = self.paired_time(sm_share)
        elif overlap and a > 0:
            # forward a2a (half of the volume) under the partner's backward compute (2/3 of the compute), backward
            # a2a under the partner's forward compute (1/3); compute runs on the SMs the a2a kernels leave free
            t = max(a / 2, 2 * c / 3 + sm_share * a / 2) + max(a / 2, c / 3 + sm_share * a / 2)
        else:
            t = c + a
        return t + self.tp_s + self.cp_s, t - c


def _paired_time(self: ItemCost, sm_share: float) -> float:
    """Steady-state time of this item for one forward (micro-batch i+1) paired with one backward (micro-batch i),
    the all-to-all of each hidden only behind the compute that runs beside it.

    The windows are those of Megatron-Core's combined 1F1B (docs/reference.md section 9): the communication stream
    runs ``combine_bwd | dispatch_fwd -> dispatch_bwd | combine_fwd`` while the compute stream runs
    ``pre_dispatch_fwd | mlp_bwd -> mlp_dW -> mlp_fwd | pre_dispatch_bwd``; with the data dependencies (the
    backward MLP needs the combine gradient, the forward MLP the dispatched tokens) this gives five slots:

        combine_bwd(B)  || attention fwd (F)
        dispatch_fwd(F) || MLP data gradient (B)
        dispatch_bwd(B) || MLP weight gradient (B)
                           MLP fwd (F), alone
        combine_fwd(F)  || attention bwd (B)

    Each slot takes max(comm, compute + share x comm) (the compute runs on the SMs the communication kernels leave
    free). Forward, data gradient and weight gradient are a third of each part's compute (the model's convention
    for GEMMs); DualPipe's F&B chunk pairs overlap the same four transfers with the same segments (DeepSeek-V3
    report sec. 3.2.1).
    """
    c = self.compute_s
    ca, cm = c * self.attn_share, c * (1 - self.attn_share)
    df, cf, cb, db = self.a2a_passes
    s = sm_share
    return (max(cb, ca / 3 + s * cb) + max(df, cm / 3 + s * df) + max(db, cm / 3 + s * db) + cm / 3
            + max(cf, 2 * ca / 3 + s * cf) + self.a2a_extra_s)


def _solo_time(self: ItemCost, sm_share: float) -> float:
    """Time of this item for a forward and backward with no partner micro-batch (the first forward and the last
    backward of a step under moetrain's paired schedule), with the weight gradients delayed until the reverse
    all-to-all is issued (``moetrain.model.phases.weight_grad``): the forward's transfers are exposed, the
    backward's combine hides behind the attention part's weight gradient and its dispatch behind the MLP's.
    Same thirds as :func:`_paired_time`."""
    c = self.compute_s
    ca, cm = c * self.attn_share, c * (1 - self.attn_share)
    df, cf, cb, db = self.a2a_passes
    s = sm_share
    return (ca / 3 + df + cm / 3 + cf + ca / 3 + max(cb, ca / 3 + s * cb) + cm / 3 + max(db, cm / 3 + s * db)
            + self.a2a_extra_s)


ItemCost.paired_time = _paired_time  # type: ignore[attr-defined]
ItemCost.solo_time = _solo_time  # type: ignore[attr-defined]


class _Ctx:
    """Everything the per-item formulas need, computed once per prediction."""

    def __init__(self, shape: ModelShape, gpu: GPUSpec, plan: Plan, eff: Efficiency,
                 counts: CodeCounts | None = None):
        self.shape, self.gpu, self.plan, self.eff = shape, gpu, plan, eff
        self.counts = counts
        p = plan
        self.tok_mb = p.micro_batch * p.seq_len                    # tokens of one micro-batch (one DP replica)
        self.n = self.tok_mb / (p.tp * p.cp)                       # tokens per GPU (sequence + context parallel)
        self.fb = shape.flops(p.seq_len)
        self.fp8 = p.precision in ("fp8", "mxfp8")
        # tensor-core work runs at what this SKU sustains of its generation's rate (power cap, hardware.CATALOGUE)
        sustain = gpu.tensor_sustain
        self.gemm_peak = self._peak(p.precision) * eff.gemm(p.precision) * sustain
        head_prec = "fp32" if p.precision == "fp32" else "bf16"
        self.bf16_peak = self._peak(head_prec) * eff.gemm(head_prec) * sustain
        self.attn_precision = "fp32" if p.precision == "fp32" else p.attn_precision
        self.attn_peak = self._peak(self.attn_precision) * eff.attention * sustain
        self.param_bytes = 4.0 if p.precision == "fp32" else 2.0
        self.fp32_peak = self._peak("fp32") * eff.gemm("fp32")
        self.hbm = gpu.hbm_tbps * 1e12 * eff.hbm
        # counted bytes (measured machines, moetrain's own code) are exact eager traffic: the measured copy rate
        self.mem_bw = gpu.hbm_tbps * 1e12
        self.nvl = gpu.nvlink_gbps * 1e9 * eff.nvlink
        self.nic = gpu.nic_gbps * 1e9 * eff.nic
        self.w_bytes = 1.0 if self.fp8 else self.param_bytes       # weight bytes a GEMM streams
        self.grad_bytes = 2.0 if p.optimizer == "bf16" else 4.0
        self.act_q = 1.0 if self.fp8 else self.param_bytes          # saved GEMM inputs (FP8 copies under FP8)
        self.attn_q = 1.0 if self.attn_precision == "fp8" else self.param_bytes
        self.imb = p.load_imbalance
        self.e_loc = shape.n_experts // p.ep
        self.domain = gpu.nvlink_domain
        self.a2a_lat = gpu.a2a_latency_us * 1e-6 if gpu.a2a_latency_us is not None else eff.a2a_latency_s
        self.op_over = (gpu.op_overhead_us or 0.0) * 1e-6
        # SMs the dispatch kernels take from an overlapped compute stream: the dispatcher's SM budget over the
        # GPU's SMs (constants.COMM_SMS); GPUs without an SM count use the generation's share
        d = p.resolved_dispatcher
        sms = COMM_SMS["flex-deepseek" if d == "flex" and p.framework == "deepseek" else d]
        self.comm_share = sms / gpu.sm_count if gpu.sm_count else eff.comm_sm_share
        r = _ranks_per_domain(p.ep, self.domain)
        self.rstats = routing_stats(shape.n_experts, shape.top_k, p.ep, r, shape.n_expert_groups,
                                    shape.n_limited_groups, p.node_limit_m)

    def _peak(self, precision: str) -> float:
        pk = self.gpu.peak_tflops
        if precision == "bf16" and "bf16" not in pk and "fp32" in pk:
            return self.gpu.peak("fp32")
        if precision == "fp32" and "fp32" not in pk:
            return self.gpu.peak("bf16") / 16  # no FP32 figure: assume the usual 1/16 of the BF16 tensor rate
        return self.gpu.peak(precision)

    # ---- rates ---------------------------------------------------------------------------------------------
    def _curve_rate(self, m: float, k: float, n: float) -> float | None:
        """Measured matmul rate (FLOP/s) at the size of an (m x k) @ (k x n) GEMM, from a bench curve."""
        curve = self.gpu.matmul_curve
        if not curve:
            return None
        size = max(1.0, (m * k * n) ** (1 / 3))
        xs = [math.log(c[0]) for c in curve]
        ys = [c[1] for c in curve]
        x = math.log(size)
        if x <= xs[0]:
            y = ys[0] * size / curve[0][0]  # below the smallest measured size: rate falls with size
        elif x >= xs[-1]:
            y = ys[-1]
        else:
            y = float(np.interp(x, xs, ys))
        return y * 1e12 * self.eff.gemm("fp32")

    def gemm_time(self, flops: float, shapes: list[tuple[float, float, float, float]], peak: float,
                  fp8: bool | None = None, grouped: bool = False, tensor: bool = True) -> tuple[float, float]:
        """Time of a set of GEMMs (forward, data-gradient and weight-gradient passes) and the memory-bound time
        of their FP8 gradient casts.

        ``flops`` is the accounting FLOPs of the set (the compute time uses it); ``shapes`` lists the forward GEMMs
        as (M, K, N, copies). ``peak`` is the rate of a large GEMM of this precision (``GEMM_REF_K``); each pass
        runs at it times :meth:`Efficiency.shape_factor` of the pass's own contraction length -- K forward, N for
        the data gradient, M (tokens, or rows per expert) for the weight gradient -- when it runs on tensor cores
        (``tensor``; not the FP32 router GEMM, nor a measured machine whose curve holds its size effects), an FP8
        weight gradient at ``wgrad_fp8`` of that. Each pass is a roofline as well: it cannot be faster than
        streaming its inputs, weights, outputs and the weight-gradient accumulation through HBM. Under FP8 every
        GEMM's output gradient is cast to FP8 (row- and column-wise) in the backward: read 2 + write 2 bytes per
        element.
        """
        if flops <= 0:
            return 0.0, 0.0
        fp8 = self.fp8 if fp8 is None else fp8
        qx = 1.0 if fp8 else self.param_bytes
        w = 1.0 if fp8 else self.param_bytes
        m0, k0, n0, _ = max(shapes, key=lambda t: t[0] * t[1] * t[2] * t[3])
        curve = self._curve_rate(m0, k0, n0)
        rate = curve or peak
        if grouped:
            rate *= self.eff.grouped_gemm
        shaped = tensor and curve is None and self.plan.precision != "fp32"  # FP32 plans run on CUDA cores
        shape_flops = sum(6 * m * k * n * c for m, k, n, c in shapes) or 1.0
        scale = flops / shape_flops
        t, cast = 0.0, 0.0
        for m, k, n, c in shapes:
            f_pass = 2 * m * k * n * scale
            passes = ((k, 1.0, m * k * qx + k * n * w + m * n * 2),            # forward: X, W -> Y
                      (n, 1.0, m * n * qx + k * n * w + m * k * 2),            # data gradient: dY, W -> dX
                      (m, self.eff.wgrad_fp8 if fp8 else 1.0,                   # weight gradient: X, dY -> dW (+=)
                       m * k * qx + m * n * qx + k * n * self.grad_bytes * 2))
            for contraction, wgrad, bytes_ in passes:
                r = rate * (self.eff.shape_factor(contraction, fp8) * wgrad if shaped else 1.0)
                t += c * max(f_pass / r, bytes_ / self.hbm)
            if fp8:
                cast += c * m * n * 4 / self.hbm
        return t, cast

    def link(self, group_span_domains: bool) -> float:
        return self.nic if group_span_domains else self.nvl


def _attention_item(c: _Ctx, cost: ItemCost) -> None:
    s, p, fb, n = c.shape, c.plan, c.fb, c.n
    h, tp = s.dim, p.tp
    rc = p.recomputed
    T = c.tok_mb / p.cp                                       # tokens of a TP-split GEMM (sequence gathered)
    flops_proj = fb.attn_proj * n
    flops_core = fb.attn_core * n
    cost.flops += flops_proj + flops_core
    cost.params_dense += s.attn_params / tp
    if s.attention == "mla":
        nope = s.qk_head_dim - s.qk_rope
        shapes = [(n, h, s.kv_lora + s.qk_rope, 1), (T, s.kv_lora, s.n_heads * (nope + s.v_head_dim) / tp, 1),
                  (T, s.o_width / tp, h, 1)]
        shapes += ([(n, h, s.q_lora, 1), (T, s.q_lora, s.q_width / tp, 1)] if s.q_lora
                   else [(T, h, s.q_width / tp, 1)])
    else:
        shapes = [(T, h, (s.q_width + 2 * s.n_kv_heads * s.qk_head_dim) / tp, 1), (T, s.o_width / tp, h, 1)]
    t, cast = c.gemm_time(flops_proj, shapes, c.gemm_peak)
    cost.gemm_s += t
    cost.attn_wgrad_s += t / 3  # forward, data gradient, weight gradient: about a third each
    cost.mem_s += cast
    # attention core: MMAs at the attention peak, softmax exponentials at the SFU rate (forward + recompute in bwd)
    n_exp = T * (s.n_heads / tp) * p.seq_len
    sfu = c.gpu.sfu_texp * 1e12 * c.eff.sfu
    rate = c._curve_rate(p.seq_len, s.qk_head_dim, p.seq_len)
    if rate and c.counts is not None:
        # counted code: the softmax, mask and scaling of eager attention are counted operators (item_cost), only
        # the batched GEMMs are left, at the GEMM fraction of the measured curve
        rate *= c.eff.gemm("fp32")
    else:
        rate = rate * c.eff.attention if rate else c.attn_peak
    cost.attn_s += max(flops_core / rate, n_exp / sfu)
    # memory-bound forward bytes per token (norm + cast, RoPE / layout of q and k, output cast, residual add)
    if s.attention == "mla":
        fwd = (4 * h + (4 * s.q_lora if s.q_lora else 0) + 4 * (s.kv_lora + s.qk_rope) + 4 * s.q_width
               + 2 * s.n_heads * (nope + s.v_head_dim) + 2 * (s.q_width + s.n_heads * s.v_head_dim)
               + 4 * s.o_width + 6 * h)
    else:
        kw = s.n_kv_heads * s.qk_head_dim
        fwd = 4 * h + 4 * (s.q_width + kw) + 4 * s.o_width + 6 * h
        if getattr(s.config, "qk_norm", False):
            # Qwen3's per-head RMSNorm of q and k: one more read and write of both before RoPE
            fwd += 4 * (s.q_width + kw)
    cost.mem_s += n * fwd * (1 + ELEMENTWISE_BWD_TO_FWD) / c.hbm
    # saved activations per token
    q, a = c.act_q, c.attn_q
    if s.attention == "mla":
        latents = (2 + q) * (s.q_lora + s.kv_lora) + 2 * s.qk_rope
        upproj = 2 * s.upproj_widths
        qkv = a * (s.q_width + s.kv_width)
    else:
        latents, upproj = 0.0, 0.0
        qkv = a * (s.q_width + 2 * s.n_kv_heads * s.qk_head_dim)
    normed = q * h
    if "layernorm" in rc:
        normed = 0.0
        cost.recompute_s += n * (2 * h + 2 * h) / c.hbm
    core_out = a * s.o_width + 4 * s.n_heads
    if "core_attn" in rc:
        # Megatron ``core_attn``: the attention kernel's output and softmax statistics are dropped and its forward
        # runs again in the backward (a third of the fused kernel's forward + backward time)
        core_out = 0.0
        cost.recompute_s += cost.attn_s / 3
    if "mla_up_proj" in rc and s.attention == "mla":
        upproj, qkv = 0.0, 0.0   # MLA up-projections (and the q/k/v built from them) recomputed
        up = [(T, s.kv_lora, s.n_heads * (nope + s.v_head_dim) / tp, 1)]
        up += [(T, s.q_lora, s.q_width / tp, 1)] if s.q_lora else []
        tu, _ = c.gemm_time(s.upproj_flops_per_token() * n * 3, up, c.gemm_peak)
        cost.recompute_s += tu / 3 + n * (4 * s.q_width + 2 * s.n_heads * (nope + s.v_head_dim)) / c.hbm
    # the attention output is saved once (the attention kernel and the output projection share it, as in
    # DeepSeek-V3's E5M6 cache and Megatron's "save the original input" FP8 recompute)
    cost.act_bytes += n * (2 * h + normed + latents + core_out + upproj + qkv)
    # tensor parallel (sequence parallel): all-gather before the projections, reduce-scatter after, fwd + bwd
    if tp > 1:
        by = (tp - 1) / tp * T * h * 2
        cost.tp_s += 4 * (by / c.link(tp > c.domain) + TP_COLLECTIVE_LATENCY_S)
    # context parallel: ring exchange of K and V (forward), K, V and their gradients (backward), under the compute
    if p.cp > 1:
        by = (p.cp - 1) * T * s.kv_width / tp * 2 * 3
        t_cp = by / c.link(tp * p.cp > c.domain)
        cost.cp_s += max(0.0, t_cp - cost.attn_s)


def _ffn_item(c: _Ctx, cost: ItemCost, width: int, params: float, flops_per_token: float,
              recompute: bool = False) -> None:
    """A TP-split SwiGLU FFN (dense FFN or the shared experts). ``recompute``: the FFN is recomputed from its input
    in the backward (Megatron ``mlp`` / ``shared_experts``): its forward runs twice, only the input is kept."""
    p, n, h = c.plan, c.n, c.shape.dim
    if width <= 0:
        return
    T = c.tok_mb / p.cp
    f = flops_per_token * n
    cost.flops += f
    cost.params_dense += params / p.tp
    t, cast = c.gemm_time(f, [(T, h, 2 * width / p.tp, 1), (T, width / p.tp, h, 1)], c.gemm_peak)
    cost.gemm_s += t
    mem = n * 6 * width * (1 + ELEMENTWISE_BWD_TO_FWD) / c.hbm
    cost.mem_s += cast + mem
    if recompute:
        cost.recompute_s += t / 3 + mem / (1 + ELEMENTWISE_BWD_TO_FWD)
        cost.act_bytes += n * c.act_q * h
    else:
        cost.act_bytes += n * (c.act_q * h + 2 * 2 * width + c.act_q * width)
    if p.tp > 1:
        by = (p.tp - 1) / p.tp * T * h * 2
        cost.tp_s += 4 * (by / c.link(p.tp > c.domain) + TP_COLLECTIVE_LATENCY_S)


def a2a_rows(c: _Ctx) -> tuple[float, float]:
    """(rows over NVLink, rows over the NIC) that one GPU sends per token in one dispatch (or receives in one
    combine), by dispatcher (docs/reference.md section 10), from the routing statistics:

    * ``flex`` (DeepEP, HybridEP, Megatron flex): one row per distinct destination rank; across NVLink domains one
      per destination domain, forwarded over NVLink to the ranks there.
    * ``alltoall`` (Megatron alltoall, TorchTitan): one row per (token, expert) pair whose expert is elsewhere,
      straight to its rank (over the NIC when that rank is in another domain).
    * ``allgather``: every token to every other rank of the EP group (the combine reduce-scatters the same
      volume); across domains each domain receives the others' tokens once over its r NICs, then NVLink.
    """
    st, p = c.rstats, c.plan
    d = p.resolved_dispatcher
    if d == "alltoall":
        return st.same_domain_pairs, st.remote_pairs
    if d == "allgather":
        r = _ranks_per_domain(p.ep, c.domain)
        return float(p.ep - 1), float(p.ep - r) / r
    return st.same_domain_ranks + st.remote_domain_ranks, st.remote_domains


def _a2a_pass_time(c: _Ctx, bytes_per_elem: float) -> float:
    h = c.shape.dim
    rows_nvl, rows_nic = a2a_rows(c)
    nvl = c.n * rows_nvl * h * bytes_per_elem
    nic = c.n * rows_nic * h * bytes_per_elem
    if c.plan.resolved_dispatcher == "flex":
        # DeepEP / HybridEP pay a fixed time per row on NVLink (constants.Efficiency.a2a_row_s); NCCL moves each
        # peer's rows as one buffer. RDMA passes keep their byte rate: a row's fixed time there is small against
        # its bytes at NIC speed (HybridEP's H100 table: 10-23 ns, 0.4-1.0 KB), and DeepEP's internode figures,
        # the source of ``nic``, do not separate one.
        nvl *= c.eff.row_factor(h * bytes_per_elem, c.nvl)
    t = max(nvl / c.nvl, nic / c.nic if nic else 0.0)
    return t * c.imb + c.a2a_lat


def _moe_item(c: _Ctx, cost: ItemCost) -> None:
    s, p, fb, n, h = c.shape, c.plan, c.fb, c.n, c.shape.dim
    k, F = s.top_k, s.expert_ffn
    rc = p.recomputed
    # router: an FP32 GEMM (Megatron moe_router_dtype=fp32, DeepSeek's FP32 gating), not in the model FLOPs
    cost.params_dense += s.n_experts * h / p.tp
    t_router, _ = c.gemm_time(6.0 * n * h * s.n_experts, [(n, h, s.n_experts, 1)], c.fp32_peak, fp8=False,
                              tensor=False)
    cost.gemm_s += t_router
    _ffn_item(c, cost, s.shared_ffn, 3 * h * s.shared_ffn, fb.shared,
              recompute="shared_experts" in rc and "moe" not in rc)
    # routed experts: n*k assignments per GPU on average, the busiest rank gets imbalance x that
    f = fb.routed * n
    cost.flops += f
    p_exp = c.e_loc * s.expert_params
    cost.params_expert += p_exp
    rows = n * k * c.imb / max(1, c.e_loc)
    t, cast = c.gemm_time(f * c.imb, [(rows, h, 2 * F, c.e_loc), (rows, F, h, c.e_loc)], c.gemm_peak, grouped=True)
    cost.grouped_s += t
    cost.mem_s += cast
    # memory-bound: norm + cast, router scores, permute (+cast), SwiGLU (+cast; inside the GEMMs' epilogues and
    # prologues of a fused grouped MLP), unpermute, shared add, residual
    swiglu = 0.0 if p.fused_mlp else 6 * k * F * c.imb
    # the alltoall dispatcher permutes twice: a global permute (k copies of each token, by destination rank) before
    # the all-to-all and a local sort of the received rows by expert after it, and the reverse pair in the combine;
    # flex dispatchers (DeepEP, HybridEP) fuse the global permute into the dispatch kernel and keep only the local
    # one (Megatron-LM's GB200 guide, sec. 2.1.1). The second pair reads and writes every row once more each way.
    sort = 8 * k * h * c.imb if p.resolved_dispatcher == "alltoall" else 0.0
    fwd = (4 * h + 16 * s.n_experts + (2 * h + 2 * k * h) * c.imb + swiglu
           + (2 * k * h) * c.imb + 2 * h + 6 * h + 6 * h + sort)
    cost.mem_s += n * fwd * (1 + ELEMENTWISE_BWD_TO_FWD) / c.hbm
    # saved activations: residual, router input and scores, expert inputs, fc1 outputs (SwiGLU input), fc2 inputs
    q = c.act_q
    normed = 2 * h
    if "layernorm" in rc:
        normed = 0.0
        cost.recompute_s += n * 4 * h / c.hbm
    swiglu_in, swiglu_out = 2 * 2 * F, q * F
    if "moe_act" in rc:
        swiglu_in, swiglu_out = q * 2 * F, 0.0
        cost.recompute_s += n * k * c.imb * 6 * F / c.hbm
    act = 2 * h + normed + 4 * s.n_experts + k * c.imb * (q * h + swiglu_in + swiglu_out + 8)
    if "moe" in rc:
        # Megatron ``moe``: the whole MoE block runs again from its input in the backward (router, dispatch,
        # experts, combine): a third of its GEMM time, its forward memory traffic, two more all-to-all passes
        act = 2 * h
        cost.recompute_s += ((cost.grouped_s + t_router) / 3
                             + n * fwd / c.hbm)
    cost.act_bytes += n * act
    # expert all-to-all: dispatch + combine forward, the same two directions in backward
    act_b = 4.0 if p.precision == "fp32" else 2.0
    d_b = FP8_BYTES if p.dispatch_precision == "fp8" else act_b
    passes = [d_b, act_b, d_b, act_b]
    if p.recompute == "full" or "moe" in rc:
        passes += [d_b, act_b]
    if p.ep > 1:
        # + one metadata exchange (tokens per expert) before each forward dispatch; a system whose dispatcher makes
        # a known number of calls per layer (moetrain's own, for local runs) pays one latency per call instead
        extra = c.counts.a2a_calls - len(passes) if c.counts is not None else (2 if len(passes) > 4 else 1)
        times = [_a2a_pass_time(c, b) for b in passes]
        cost.a2a_s += sum(times) + c.a2a_lat * max(0.0, extra)
        # order: dispatch fwd, combine fwd, combine bwd (dispatch direction), dispatch bwd (combine direction)
        cost.a2a_passes = (times[0], times[1], times[2], times[3])
        cost.a2a_extra_s = sum(times[4:]) + c.a2a_lat * max(0.0, extra)


def _head_item(c: _Ctx, cost: ItemCost, n_heads_out: int = 1) -> None:
    s, p, n, h = c.shape, c.plan, c.n, c.shape.dim
    T = c.tok_mb / p.cp
    f = c.fb.head * n * n_heads_out
    cost.flops += f
    cost.params_dense += s.head_params / p.tp + h
    # the output head stays BF16 (Megatron's output layer and DeepSeek-V3 keep it out of FP8)
    t, _ = c.gemm_time(f, [(T, h, s.vocab / p.tp, n_heads_out)], c.bf16_peak, fp8=False)
    cost.head_s += t
    # fused cross-entropy: read logits, write their gradient (once, in the forward); final norm. Where the machine's
    # log-softmax rate was measured (CPUs, whose exponentials are slower than their memory), that rate bounds it.
    xent = n * n_heads_out * 4 * s.vocab / c.hbm
    if c.gpu.softmax_gelem_s:
        xent = max(xent, n * n_heads_out * s.vocab / (c.gpu.softmax_gelem_s * 1e9))
    cost.mem_s += xent + n * 12 * h / c.hbm
    cost.act_bytes += n * n_heads_out * (2 * s.vocab + 2 * h)
    if p.tp > 1:
        by = (p.tp - 1) / p.tp * T * h * 2
        cost.tp_s += 2 * n_heads_out * (by / c.link(p.tp > c.domain) + TP_COLLECTIVE_LATENCY_S)


def _ops_overhead(c: _Ctx, kind: str) -> float:
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


def host_launch(c: _Ctx, kind: str) -> HostLaunch:
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


def item_cost(c: _Ctx, kind: str) -> ItemCost:
    """Cost of one pipeline item ("E", "d", "t", "m", "L") for one micro-batch on one GPU."""
    s, p = c.shape, c.plan
    cost = ItemCost(kind=kind)
    if kind == "E":
        cost.params_dense += s.embedding_params / p.tp
        cost.mem_s += c.n * 2 * s.dim * 3 / c.hbm
    elif kind == "d":
        _attention_item(c, cost)
        _ffn_item(c, cost, s.dense_ffn, s.dense_ffn_params, c.fb.dense_ffn, recompute="mlp" in p.recomputed)
    elif kind in ("t", "m"):
        _attention_item(c, cost)
        c_attn = cost.compute_s
        _moe_item(c, cost)
        cost.attn_share = c_attn / cost.compute_s if cost.compute_s > 0 else 0.5
        if kind == "m":
            f = c.fb.mtp_extra * c.n
            cost.flops += f
            cost.params_dense += s.mtp_extra_params / p.tp
            t, cast = c.gemm_time(f, [(c.tok_mb / p.cp, 2 * s.dim, s.dim / p.tp, 1)], c.gemm_peak)
            cost.gemm_s += t
            cost.mem_s += cast + c.n * 16 * s.dim * (1 + ELEMENTWISE_BWD_TO_FWD) / c.hbm
            _head_item(c, cost)  # the MTP module's logits through the shared head
            cost.params_dense -= s.head_params / p.tp + s.dim  # the head is shared, not held twice
            cost.act_bytes += c.n * 4 * s.dim
    elif kind == "L":
        _head_item(c, cost)
    else:  # pragma: no cover
        raise ValueError(kind)
    if c.counts is not None:
        # moetrain's own code on a measured machine: its memory-bound work is counted, not estimated
        # (moetrain.plan.counts): every non-GEMM operator's bytes at the measured bandwidth, and the softmax
        # elements at the measured cross-entropy rate (the exponentials bound it on CPUs)
        soft = c.gpu.softmax_gelem_s * 1e9 if c.gpu.softmax_gelem_s else math.inf
        cost.mem_s = (c.n * (c.counts.mem_bytes_per_token.get(kind, 0.0) / c.mem_bw
                             + c.counts.softmax_per_token.get(kind, 0.0) / soft)
                      + c.counts.mem_bytes_per_micro_batch.get(kind, 0.0) / c.mem_bw)
    if p.recompute == "full" and kind in ("d", "t", "m"):
        # forward again from the saved layer input; activations kept = the layer input only
        cost.recompute_s = (cost.gemm_s + cost.grouped_s + cost.attn_s + cost.mem_s + _ops_overhead(c, kind)) / 3
        cost.act_bytes = c.n * 2 * s.dim
        cost.tp_s *= 1.5
    cost.overhead_s += _ops_overhead(c, kind)
    # eager launches: the GPU cannot run a kernel before the host has launched it (exposed_host_s)
    cost.host_s = exposed_host_s(cost, host_launch(c, kind), p.overlapped and p.ep > 1,
                                 resync=p.recompute == "full" or "moe" in p.recomputed)
    return cost


# ----------------------------------------------------------------------------------------------------------------
# Prediction
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class MemoryBreakdown:
    """Per-GPU memory of the most loaded pipeline rank, GiB."""

    weights: float
    fp8_weights: float
    gradients: float
    optimizer: float
    activations: float
    reserved: float
    device: int

    @property
    def total(self) -> float:
        return self.weights + self.fp8_weights + self.gradients + self.optimizer + self.activations + self.reserved

    def to_dict(self) -> dict[str, float]:
        d = asdict(self)
        d["total"] = self.total
        return d


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


def _stage_items(shape: ModelShape, plan: Plan, item_times: dict[str, float]) -> list[list[str]]:
    n_stages = n_pipeline_stages(plan)
    if plan.pp_layout:
        return layout_items(plan.pp_layout, shape, n_stages)
    items = default_items(shape)
    parts = balanced_partition([item_times[i] for i in items], n_stages)
    return [items[a:b] for a, b in parts]


def _device_stages(plan: Plan, n_stages: int) -> list[list[int]]:
    """Stage indices held by each pipeline rank."""
    if plan.resolved_schedule == "dualpipe":
        return [[d, plan.pp - 1 - d] for d in range(plan.pp)]
    if plan.resolved_schedule in ("zbv", "dualpipev"):
        return [[d, 2 * plan.pp - 1 - d] for d in range(plan.pp)]
    return [[s for s in range(n_stages) if s % plan.pp == d] for d in range(plan.pp)]


def _in_flight(plan: Plan, device: int) -> list[float]:
    """Micro-batches whose activations a pipeline rank holds at its peak, per model chunk it holds."""
    m, pp, vpp = plan.n_microbatches, plan.pp, plan.vpp
    sched = plan.resolved_schedule
    if sched == "dualpipe":
        # rank d holds stage d of one direction and stage PP-1-d of the other; like 1F1B, a stage at pipeline
        # position s keeps PP-s micro-batches: (PP-d) + (d+1) = PP+1 in all (the DualPipe paper's figure)
        return [float(min(m, pp - device)), float(min(m, device + 1))]
    if sched == "1f1b":
        return [float(min(m, pp - device))]
    if sched == "dualpipev":
        # the V: chunk d sits at position d of a 2 PP-chunk pipeline, chunk 2PP-1-d at position 2PP-1-d; a chunk
        # at position s keeps (2PP - s) micro-batches in flight, as 1F1B would (DualPipe README: PP+1 activations)
        return [float(min(m, 2 * pp - device)), float(min(m, device + 1))]
    if sched == "zbv":
        # zero-bubble V: the peak activation memory of 1F1B (PP micro-batches of a whole rank's layers; Qi et al.,
        # "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, ZB-V), i.e. PP micro-batches of each of its chunks
        return [float(min(m, pp)), float(min(m, pp))]
    warm = min(m * vpp, (pp - device - 1) * 2 + (vpp - 1) * pp + 1)
    counts = [0.0] * vpp
    for f in range(warm):
        counts[(f // pp) % vpp] += 1
    return counts


def _unpaired_fraction(plan: Plan) -> float:
    """Share of a rank's micro-batch chunks in pipeline warm-up / cool-down, where EP overlap has no partner.

    Framework "moetrain": counted on the compute order its trainer runs (torch's schedule after moetrain's
    pairing, ``moetrain.parallel.overlap.paired_fraction``), for the rank that pairs least -- the pipeline waits
    for its slowest rank."""
    m, pp, vpp = plan.n_microbatches, plan.pp, plan.vpp
    sched = plan.resolved_schedule
    if plan.framework == "moetrain" and sched in ("1f1b", "interleaved", "dualpipev"):
        from moetrain.parallel.overlap import paired_fraction
        return 1.0 - min(paired_fraction(sched, pp, 2 if sched == "dualpipev" else vpp, m))
    if sched == "dualpipe":
        return min(1.0, (pp / 2) / m)
    if sched == "dualpipev":
        return min(1.0, pp / (2 * m))  # warm-up and cool-down: PP - 1 unpaired chunk passes of 2 m
    if sched == "interleaved":
        return min(1.0, ((pp - 1) * 2 + (vpp - 1) * pp + 1) / (m * vpp))
    if sched == "1f1b" and pp == 1:
        return min(1.0, 1.0 / m)  # micro-batch i+1's forward pairs with i's backward: the first and last are alone
    return 1.0


def predict(model: Any, gpu: GPUSpec | str, n_gpus: int, plan: Plan, *, counts: CodeCounts | None = None,
            _ignore_memory: bool = False) -> Prediction:
    """Predict step time, throughput and memory of ``plan`` for ``model`` on ``n_gpus`` GPUs of type ``gpu``.

    Args:
        model: a preset name, HF config.json path, ModelConfig / GQAMoEConfig, or ModelShape.
        gpu: a GPUSpec or catalogue name.
        n_gpus: GPU count.
        plan: the plan (validated here; DP is derived when None). Real routing without an ``imbalance`` factor
            gets the factor that makes its step ``constants.REAL_ROUTING_SLOWDOWN`` times the forced-balanced
            step (:func:`_solve_real_imbalance`); the returned prediction's plan carries it.
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
        x, base = _solve_real_imbalance(shape, spec, n_gpus, plan, counts)
        pred = _predict_at(shape, spec, n_gpus, plan.replace(imbalance=x), counts=counts,
                           _ignore_memory=_ignore_memory)
        pred.details["real_routing"] = {
            "target_slowdown": REAL_ROUTING_SLOWDOWN, "solved_imbalance": x, "balanced_step_s": base,
            "note": "max/mean load per EP rank at which this plan's step is REAL_ROUTING_SLOWDOWN x its "
                    "forced-balanced step (published: unforced routing 8-20% slower)"}
        return pred
    return _predict_at(shape, spec, n_gpus, plan, counts=counts, _ignore_memory=_ignore_memory)


def _solve_real_imbalance(shape: ModelShape, spec: GPUSpec, n_gpus: int, plan: Plan,
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
    eff = efficiency_for(spec.generation)
    c = _Ctx(shape, spec, plan, eff, counts)
    sched = plan.resolved_schedule
    overlap = plan.overlapped and plan.ep > 1
    u = _unpaired_fraction(plan) if overlap else 1.0
    share = c.comm_share

    costs = {k: item_cost(c, k) for k in ("E", "d", "t", "m", "L")}

    def item_time(k: str) -> tuple[float, float]:
        t_ov, a_ov = costs[k].time(True, share)
        t_no, a_no = costs[k].time(False, share)
        if not overlap:
            return t_no, a_no
        if plan.framework == "moetrain" and costs[k].a2a_s > 0 and len(costs[k].a2a_passes) == 4:
            # moetrain's unpaired passes still delay their weight gradients behind the backward all-to-alls
            t_solo = costs[k].solo_time(share) + costs[k].tp_s + costs[k].cp_s
            t_no, a_no = t_solo, t_solo - costs[k].compute_s - costs[k].tp_s - costs[k].cp_s
        return (1 - u) * t_ov + u * t_no, (1 - u) * a_ov + u * a_no

    times = {k: item_time(k)[0] for k in costs}
    stages = _stage_items(shape, plan, times)
    dev_stages = _device_stages(plan, len(stages))

    # pipeline P2P per stage boundary and micro-batch (activations forward, gradients backward)
    p2p_bytes = c.tok_mb / (plan.cp * plan.tp) * shape.dim * 2
    # stages are blocks of consecutive ranks (PP outermost): once the pipeline outgrows one NVLink domain some
    # boundary (and, interleaved, the wrap from the last rank to the first) crosses the NIC, and since every
    # rank waits on its neighbours each step, the slowest boundary paces all of them
    p2p_link = c.link(plan.stage_size * plan.pp > c.domain) if plan.pp > 1 else c.nvl
    p2p_t = 2 * (p2p_bytes / p2p_link + P2P_LATENCY_S) if plan.pp > 1 else 0.0
    # Which schedules hide the P2P transfers:
    # * 1F1B (Megatron, no interleaving): blocking send/recv between the steps -> exposed.
    # * interleaved 1F1B without EP overlap: with ``overlap_p2p_comm`` the forward send/recv is posted after a
    #   chunk's forward and waited before the next forward, so it runs under the backward of the same 1F1B step
    #   (and the backward's under the next forward) -> hidden.
    # * interleaved 1F1B with EP overlap = Megatron's combined 1F1B (``overlap_moe_expert_parallel_comm`` /
    #   Megatron-Bridge ``moe_a2a_overlap``): the forward of one chunk and the backward of another are merged into
    #   ONE step (``combined_1f1b.combined_forward_backward_step`` ->
    #   ``TransformerModelChunkSchedulePlan.run``), so the activation this rank's forward produces leaves only at
    #   the end of the merged step (``post_forward``), and the next merged step starts by waiting for the
    #   neighbours' (``pre_forward`` / ``pre_backward``). Between the two only the deferred weight gradient of
    #   the chunk's first attention runs ("Delay the last attn_dw in backward pass ... for overlapping with the
    #   p2p comm", megatron/core/models/common/model_chunk_schedule_plan.py): the transfer minus that dW is
    #   exposed, once per model chunk per micro-batch. Forward and backward sends leave on the same NIC at once
    #   (to the next and previous stage), hence the 2x of p2p_t.
    # * DualPipe: "both all-to-all and PP communication can be fully hidden" (DeepSeek-V3 report sec. 3.2.1).
    p2p_exposed = sched in ("1f1b", "zbv")
    p2p_combined = sched == "interleaved" and overlap and plan.pp > 1

    def p2p_stage(items: list[str]) -> float:
        """P2P time a stage adds per micro-batch on its rank."""
        if p2p_exposed:
            return p2p_t
        if p2p_combined:
            first = next((k for k in items if k in ("d", "t", "m")), None)
            hide = costs[first].attn_wgrad_s if first else 0.0
            return max(0.0, p2p_t - hide)
        return 0.0

    def dp_time(params: float, group: int, stride: int, bytes_per: float) -> float:
        """Reduce-scatter (or all-gather) of ``params`` over a data-parallel group whose members are ``stride``
        ranks apart: a ring inside each NVLink domain, then across domains over the NIC."""
        if group <= 1 or params <= 0:
            return 0.0
        local = _members_per_domain(group, stride, c.domain)
        inter = group // local
        t = 0.0
        if local > 1:
            t += params * bytes_per * (local - 1) / local / c.nvl
        if inter > 1:
            t += params * bytes_per / local * (inter - 1) / inter / c.nic
        return t

    g_dense, g_exp = plan.dp * plan.cp, plan.edp

    def dev_params(sts: list[int]) -> tuple[float, float]:
        return (sum(costs[k].params_dense for s_idx in sts for k in stages[s_idx]),
                sum(costs[k].params_expert for s_idx in sts for k in stages[s_idx]))

    measured_fsdp = spec.fsdp_unit_latency_us is not None and spec.fsdp_unit_gbps is not None
    dev_time, dev_parts = [], []
    for d, sts in enumerate(dev_stages):
        parts = {"compute": 0.0, "a2a": 0.0, "comm": 0.0}
        t_total = 0.0
        if plan.fsdp and measured_fsdp:
            # FSDP2 as measured by `moetrain bench` on this machine: each unit (a block, its experts when they are
            # sharded over an expert-data-parallel group, the root with embedding and head) costs a measured
            # latency plus its parameter bytes at a measured rate per micro-batch: the forward and backward
            # all-gathers, the gradient reduce-scatter, hooks and copies, in lock-step on shared cores
            units = [costs[k].params_dense for s_idx in sts for k in stages[s_idx] if k in ("d", "t", "m")]
            if plan.edp > 1:
                units += [costs[k].params_expert for s_idx in sts for k in stages[s_idx] if k in ("t", "m")]
            root = sum(costs[k].params_dense for s_idx in sts for k in stages[s_idx] if k in ("E", "L"))
            units += [root] if root > 0 else []
            t_fsdp = (sum(spec.fsdp_unit_latency_us * 1e-6 + u * c.param_bytes / (spec.fsdp_unit_gbps * 1e9)
                          for u in units) if g_dense > 1 else 0.0)
            parts["comm"] += t_fsdp
            t_total += t_fsdp
        elif plan.fsdp:
            # FSDP: every micro-batch all-gathers the rank's parameters in its forward and again in its backward;
            # exposed on CPUs (gloo shares the cores), else hidden behind compute except the first layer's
            pdd, ped = dev_params(sts)
            n_it = sum(len(stages[s_idx]) for s_idx in sts)
            lat = c.a2a_lat if spec.generation == "cpu" else TP_COLLECTIVE_LATENCY_S
            units = n_it + sum(1 for s_idx in sts for k in stages[s_idx] if k in ("t", "m") and plan.edp > 1)
            t_ag = 2 * (dp_time(pdd, g_dense, plan.tp, c.param_bytes) + dp_time(ped, g_exp, plan.ep, c.param_bytes)
                        + (units * lat if g_dense > 1 else 0.0))
            dev_c = sum(costs[k].compute_s for s_idx in sts for k in stages[s_idx])
            t_ag = t_ag if spec.generation == "cpu" else max(t_ag / max(1, n_it), t_ag - dev_c)
            parts["comm"] += t_ag
            t_total += t_ag
        for s_idx in sts:
            for k in stages[s_idx]:
                t, a = item_time(k)
                comm = costs[k].tp_s + costs[k].cp_s
                parts["a2a"] += a
                parts["comm"] += comm
                parts["compute"] += t - a - comm
                t_total += t
            t_p2p = p2p_stage(stages[s_idx])
            parts["comm"] += t_p2p
            t_total += t_p2p
        if sched == "dualpipe":  # each micro-batch visits one of the rank's two stages
            parts = {k: v / 2 for k, v in parts.items()}
            t_total /= 2
        dev_time.append(t_total)
        dev_parts.append(parts)
    m = plan.n_microbatches
    dev_time = [float(t) for t in dev_time]
    slow = int(np.argmax(dev_time))
    t_max, t_mean = dev_time[slow], float(np.mean(dev_time))
    if plan.pp == 1:
        bubble = 0.0
    elif sched == "interleaved":
        bubble = (plan.pp - 1) / plan.vpp * t_mean
    elif sched == "dualpipe":
        bubble = (plan.pp / 2 - 1) * (2 / 3) * t_mean
    elif sched == "dualpipev":
        # DualPipe's (PP'/2 - 1)(F&B + B - 3W) with PP' = 2 PP half-size chunks (docs/reference.md section 9:
        # DualPipeV is DualPipe on half the devices): (PP - 1) x (2/3) x t/2
        bubble = (plan.pp - 1) * t_mean / 3
    elif sched == "zbv":
        # ZB-1P's (PP-1)(F + B - 2W) with F = W = t/3, B = 2t/3, for the V's half-size chunks: (PP-1) t/6
        bubble = (plan.pp - 1) * t_mean / 6
    else:
        bubble = (plan.pp - 1) * t_mean

    # memory per pipeline rank
    opt_shard = {"fp32": 12.0, "bf16-moments": 8.0, "bf16": 6.0}[plan.optimizer]
    if plan.precision == "fp32" and plan.optimizer == "fp32":
        opt_shard -= 4.0  # fp32 weights are their own master copy: only the two moments remain
    # FP8 working copies of the weights: MXFP8 needs a row-wise and a column-wise (transposed) copy, each with its
    # own 1x32 scales; 128x128 block-scaled FP8 weights are transpose-symmetric, one copy serves both GEMMs
    fp8_copy = {"mxfp8": 2.0, "fp8": 1.0}.get(plan.precision, 0.0)
    mems: list[MemoryBreakdown] = []
    for d, sts in enumerate(dev_stages):
        pd = sum(costs[k].params_dense for s_idx in sts for k in stages[s_idx])
        pe = sum(costs[k].params_expert for s_idx in sts for k in stages[s_idx])
        flight = _in_flight(plan, d)
        act = sum(cnt * sum(costs[k].act_bytes for k in stages[s_idx]) for cnt, s_idx in zip(flight, sts))
        shard_w = 1.0
        if plan.fsdp:  # weights and gradients sharded too (+ one gathered block at a time, in the reserve)
            shard_w = (pd / (plan.dp * plan.cp) + pe / plan.edp) / max(pd + pe, 1.0)
        mems.append(MemoryBreakdown(
            weights=(pd + pe) * shard_w * (0.0 if plan.fp8_param else c.param_bytes) / GIB,
            fp8_weights=(pd + pe) * fp8_copy / GIB,
            gradients=(pd + pe) * shard_w * c.grad_bytes / GIB,
            optimizer=(pd / (plan.dp * plan.cp) + pe / plan.edp) * opt_shard / GIB,
            activations=act / GIB, reserved=RESERVED_GIB_CPU if spec.generation == "cpu" else RESERVED_GIB,
            device=d))
    mem = max(mems, key=lambda mb: mb.total)

    # data-parallel gradient reduce-scatter + parameter all-gather (hierarchical: NVLink inside, NIC across)
    pd_slow = sum(costs[k].params_dense for s_idx in dev_stages[slow] for k in stages[s_idx])
    pe_slow = sum(costs[k].params_expert for s_idx in dev_stages[slow] for k in stages[s_idx])

    # (the measured FSDP2 unit cost includes its reduce-scatter)
    rs = 0.0 if plan.fsdp and measured_fsdp else (dp_time(pd_slow, g_dense, plan.tp, c.grad_bytes)
                                                 + dp_time(pe_slow, g_exp, plan.ep, c.grad_bytes))
    ag = 0.0 if plan.fsdp else (dp_time(pd_slow, g_dense, plan.tp, c.param_bytes)
                                + dp_time(pe_slow, g_exp, plan.ep, c.param_bytes))
    if spec.generation == "cpu":
        dp_exposed = rs + ag  # gloo collectives run on the same cores as the compute
    elif plan.dp_overlap:
        last = 1.0 / (4 * (plan.vpp if sched == "interleaved" else 1))
        dp_exposed = (max(rs - (2 / 3) * t_max - bubble / 2, rs * last)
                      + max(ag - (1 / 3) * t_max - bubble / 2, ag * last))
    else:
        dp_exposed = rs + ag
    # optimizer step: memory-bound update of the local shard, FP8 re-cast of all local weights
    opt_bytes = {"fp32": 30.0, "bf16-moments": 22.0, "bf16": 18.0}[plan.optimizer]
    shard = pd_slow / (plan.dp * plan.cp) + pe_slow / plan.edp
    local = pd_slow + pe_slow
    t_opt = (shard * opt_bytes + local * (c.grad_bytes + (4.0 if c.fp8 else 0.0))) / c.hbm

    parts = dev_parts[slow]
    # split the compute of the slowest rank by kernel class (the overlap slowdown spread pro rata)
    sub = {"dense GEMM": 0.0, "expert GEMM": 0.0, "attention": 0.0, "memory-bound": 0.0, "recompute/overhead": 0.0,
           "host launch": 0.0}
    for s_idx in dev_stages[slow]:
        for k in stages[s_idx]:
            ck = costs[k]
            sub["dense GEMM"] += ck.gemm_s + ck.head_s
            sub["expert GEMM"] += ck.grouped_s
            sub["attention"] += ck.attn_s
            sub["memory-bound"] += ck.mem_s
            sub["recompute/overhead"] += ck.recompute_s + ck.overhead_s
            sub["host launch"] += ck.host_s
    tot = sum(sub.values()) or 1.0
    compute = m * parts["compute"]
    # t_max is the slowest device's sum of the same parts: their difference is round-off when PP = 1
    idle = t_max - sum(parts.values())
    idle = 0.0 if abs(idle) <= 1e-12 * t_max else idle
    step = StepBreakdown(compute=compute, exposed_a2a=m * parts["a2a"],
                         other_comm=m * parts["comm"] + dp_exposed, bubble=bubble + m * idle,
                         optimizer=t_opt, compute_parts={k: compute * v / tot for k, v in sub.items()})
    fpt = shape.flops_per_token(plan.seq_len)
    limit = spec.hbm_gb
    stage_desc = ["".join(st) for st in stages]
    details = {
        "stages": stage_desc,
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
        "ep_overlap_unpaired_fraction": u if overlap else None,
        "overlap_schedule": plan.overlap_schedule,
        "dispatcher": plan.resolved_dispatcher, "cuda_graphs": plan.resolved_cuda_graphs,
        "framework": plan.framework, "comm_sm_share": c.comm_share,
        "dp_reduce_scatter_s": rs, "dp_all_gather_s": ag,
        "pp_p2p_per_microbatch_s": p2p_t,
        "pp_p2p_exposed_per_microbatch_s": [
            sum(p2p_stage(stages[i]) for i in sts) / (2 if sched == "dualpipe" else 1) for sts in dev_stages],
        "memory_per_device_gib": [mb.total for mb in mems],
        "efficiency": eff.to_dict(),
    }
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
    pred.mfu = pred.tflops_per_gpu * 1e12 / c._peak(plan.precision)
    pred.mfu_bf16 = pred.tflops_per_gpu * 1e12 / c._peak("bf16")
    if mem.total > 0.95 * limit:
        pred.message = f"fits with little headroom ({mem.total:.1f} of {limit:g} GiB)"
    return pred
