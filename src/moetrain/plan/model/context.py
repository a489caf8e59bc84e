"""What every cost formula of one prediction needs: the plan's per-GPU token count, the GPU's rates after
efficiency (GEMM peaks by precision, HBM, NVLink, NIC), and the GEMM roofline (:meth:`CostContext.gemm_time`)."""

from __future__ import annotations

import math

import numpy as np

from moetrain.plan.constants import COMM_SMS, Efficiency
from moetrain.plan.counts import CodeCounts
from moetrain.plan.hardware import GPUSpec
from moetrain.plan.model.routing import ranks_per_domain, routing_stats
from moetrain.plan.plan import Plan
from moetrain.plan.shape import ModelShape

GIB = float(1 << 30)
TP_COLLECTIVE_LATENCY_S = 10e-6  # one NCCL all-gather / reduce-scatter call inside an NVLink domain
P2P_LATENCY_S = 10e-6


class CostContext:
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
        self.gemm_peak = self.peak(p.precision) * eff.gemm(p.precision) * sustain
        head_prec = "fp32" if p.precision == "fp32" else "bf16"
        self.bf16_peak = self.peak(head_prec) * eff.gemm(head_prec) * sustain
        self.attn_precision = "fp32" if p.precision == "fp32" else p.attn_precision
        self.attn_peak = self.peak(self.attn_precision) * eff.attention * sustain
        self.param_bytes = 4.0 if p.precision == "fp32" else 2.0
        self.fp32_peak = self.peak("fp32") * eff.gemm("fp32")
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
        r = ranks_per_domain(p.ep, self.domain)
        self.rstats = routing_stats(shape.n_experts, shape.top_k, p.ep, r, shape.n_expert_groups,
                                    shape.n_limited_groups, p.node_limit_m)

    def peak(self, precision: str) -> float:
        """Dense tensor-core peak of this GPU at ``precision``, FLOP/s (catalogue figures, no efficiency)."""
        pk = self.gpu.peak_tflops
        if precision == "bf16" and "bf16" not in pk and "fp32" in pk:
            return self.gpu.peak("fp32")
        if precision == "fp32" and "fp32" not in pk:
            return self.gpu.peak("bf16") / 16  # no FP32 figure: assume the usual 1/16 of the BF16 tensor rate
        return self.gpu.peak(precision)

    # ---- rates ---------------------------------------------------------------------------------------------
    def curve_rate(self, m: float, k: float, n: float) -> float | None:
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
        curve = self.curve_rate(m0, k0, n0)
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
        """Bytes/s of a collective's link: the NIC when its group spans NVLink domains, else NVLink."""
        return self.nic if group_span_domains else self.nvl
