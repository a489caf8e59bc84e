"""Cost of one pipeline item -- embedding ``E``, dense layer ``d``, MoE layer ``t``, MTP module ``m``, output head
``L`` -- for one micro-batch on one GPU: GEMM, attention and memory-bound compute, recomputation, saved
activations, and the communication inside the layer (expert all-to-all by dispatcher, TP collectives, CP ring).
"""

from __future__ import annotations

import math

from moetrain.model.config import Qwen3MoeConfig
from moetrain.plan.constants import ELEMENTWISE_BWD_TO_FWD, FP8_BYTES
from moetrain.plan.model.context import TP_COLLECTIVE_LATENCY_S, CostContext
from moetrain.plan.model.cost import ItemCost
from moetrain.plan.model.host import exposed_host_s, host_launch, ops_overhead
from moetrain.plan.model.routing import ranks_per_domain


def _attention_item(c: CostContext, cost: ItemCost) -> None:
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
    rate = c.curve_rate(p.seq_len, s.qk_head_dim, p.seq_len)
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
        if isinstance(s.config, Qwen3MoeConfig) and s.config.qk_norm:
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


def _ffn_item(c: CostContext, cost: ItemCost, width: int, params: float, flops_per_token: float,
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


def a2a_rows(c: CostContext) -> tuple[float, float]:
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
        r = ranks_per_domain(p.ep, c.domain)
        return float(p.ep - 1), float(p.ep - r) / r
    return st.same_domain_ranks + st.remote_domain_ranks, st.remote_domains


def a2a_pass_time(c: CostContext, bytes_per_elem: float) -> float:
    """Time of one all-to-all pass (a dispatch or a combine) of one micro-batch, seconds: the rows of
    :func:`a2a_rows` of ``bytes_per_elem``-byte elements over NVLink and the NIC (the slower of the two), at the
    busiest rank's load (the imbalance factor), plus one call's latency."""
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


def _moe_item(c: CostContext, cost: ItemCost) -> None:
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
        times = [a2a_pass_time(c, b) for b in passes]
        cost.a2a_s += sum(times) + c.a2a_lat * max(0.0, extra)
        # order: dispatch fwd, combine fwd, combine bwd (dispatch direction), dispatch bwd (combine direction)
        cost.a2a_passes = (times[0], times[1], times[2], times[3])
        cost.a2a_extra_s = sum(times[4:]) + c.a2a_lat * max(0.0, extra)


def _head_item(c: CostContext, cost: ItemCost, n_heads_out: int = 1) -> None:
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


def item_cost(c: CostContext, kind: str) -> ItemCost:
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
        cost.recompute_s = (cost.gemm_s + cost.grouped_s + cost.attn_s + cost.mem_s + ops_overhead(c, kind)) / 3
        cost.act_bytes = c.n * 2 * s.dim
        cost.tp_s *= 1.5
    cost.overhead_s += ops_overhead(c, kind)
    # eager launches: the GPU cannot run a kernel before the host has launched it (exposed_host_s)
    cost.host_s = exposed_host_s(cost, host_launch(c, kind), p.overlapped and p.ep > 1,
                                 resync=p.recompute == "full" or "moe" in p.recomputed)
    return cost
