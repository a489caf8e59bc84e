"""Routed experts: the grouped GEMM (``torch._grouped_mm`` where the build and the shapes allow it, a padded batched
matmul or a per-expert loop otherwise) and :class:`GroupedExperts`, the stacked SwiGLU experts of one MoE layer.

Single-device code; the MoE layer (:mod:`moetrain.model.moe`) calls it with the rows a dispatcher delivered.

Shape legend (suffixes on tensor names): S dispatched rows, D model dim, E experts (those held here), F expert FFN
dim, K / N a GEMM's inner / output dim, C rows per expert of a padded batch.
"""

from __future__ import annotations

from typing import Any, Callable, Protocol

import torch
import torch.nn.functional as F
from torch import nn

from moetrain import devices
from moetrain.layout import RecomputeModule
from moetrain.model.phases import current_tape, weight_grad
from moetrain.model.recompute import DroppedOutputs, Recomputable, checkpointed
from moetrain.precision.grouped import fp8_expert_swiglu

# ----------------------------------------------------------------------------------------------------------------
# Experts: grouped GEMM
# ----------------------------------------------------------------------------------------------------------------

def _grouped_mm_supported(x: torch.Tensor, *row_lens: int) -> bool:
    """Whether ``torch._grouped_mm`` can run on ``x``: present in this build, a supported device/dtype, and every
    row length (in elements) a multiple of 16 bytes, which the kernel requires for its operands' strides."""
    if not hasattr(torch, "_grouped_mm"):
        return False
    if any((n * x.element_size()) % 16 for n in row_lens):
        return False
    if x.device.type == "cpu":
        return True
    if x.device.type == "cuda":
        # The CUDA kernel is bf16-only and needs sm90+ (Hopper) or newer.
        return x.dtype == torch.bfloat16 and devices.cuda_capability(x.device)[0] >= 9
    return False


class _GroupedMM(torch.autograd.Function):
    """y_SN = x_SK @ w_ENK[e(s)]^T for rows grouped by expert; ``offs_E`` are the int32 cumulative row counts.

    Takes the weight in its stored (E, N, K) layout (``nn.Linear``'s out x in, per expert) and wraps
    ``torch._grouped_mm`` with an explicit backward, for two reasons: the built-in backward needs a contiguous
    gradient (an expanded one from ``sum()`` is not), and computing grad_w[e] = grad_y_e^T @ x_e directly in (E, N, K)
    hands autograd a contiguous gradient in the parameter's own layout. The x^T @ grad_y form gives (E, K, N), whose
    transpose AccumulateGrad copies into a new contiguous tensor: three strided copies of every expert weight per
    step, measured at 17% of the experts' forward+backward time on CPU (BENCHMARKS.md, "What changed").
    """

    @staticmethod
    def forward(ctx: Any, x_SK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor,
                may_pad: bool = True) -> torch.Tensor:
        ctx.save_for_backward(x_SK, w_ENK, offs_E)
        ctx.may_pad = may_pad
        y_SN = torch._grouped_mm(x_SK, w_ENK.transpose(-2, -1), offs=offs_E)
        return _zero_rows_from(y_SN, offs_E.select(0, -1)) if may_pad else y_SN

    @staticmethod
    def backward(ctx: Any, grad_SN: torch.Tensor):  # type: ignore[override]
        x_SK, w_ENK, offs_E = ctx.saved_tensors
        # autograd runs backward outside autocast: the incoming gradient may be in another dtype than the operands
        grad_SN = devices.contiguous(grad_SN.to(x_SK.dtype))
        grad_x = None
        if ctx.needs_input_grad[0]:
            grad_x = torch._grouped_mm(grad_SN, w_ENK, offs=offs_E)
            if ctx.may_pad:
                grad_x = _zero_rows_from(grad_x, offs_E.select(0, -1))
        # Rows past offs[-1] and experts with no rows contribute nothing to grad_w; the kernel leaves empty groups'
        # gradient at zero.
        grad_w = (weight_grad(w_ENK, lambda: torch._grouped_mm(grad_SN.t(), x_SK, offs=offs_E))
                  if ctx.needs_input_grad[1] else None)
        return grad_x, grad_w, None, None


def _zero_rows_from(t_SN: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    """``t_SN`` with rows ``end..S`` zeroed: ``torch._grouped_mm`` leaves the rows past the last offset (capacity
    padding) unwritten, in its output and in the data gradient alike. ``end`` stays on the device (no sync)."""
    rows = torch.arange(t_SN.shape[0], device=t_SN.device)
    return torch.where((rows < end).unsqueeze(-1), t_SN, 0)


class _BatchedMM(torch.autograd.Function):
    """y_ECN = x_ECK @ w_ENK^T: one batched GEMM over experts whose rows sit in equal slots of C rows.

    Backward as :class:`_GroupedMM`: the weight gradient grad_y^T @ x comes out in the stored (E, N, K) layout.
    """

    @staticmethod
    def forward(ctx: Any, x_ECK: torch.Tensor, w_ENK: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x_ECK, w_ENK)
        return torch.bmm(x_ECK, w_ENK.transpose(1, 2))

    @staticmethod
    def backward(ctx: Any, grad_ECN: torch.Tensor):  # type: ignore[override]
        x_ECK, w_ENK = ctx.saved_tensors
        grad_ECN = grad_ECN.to(x_ECK.dtype).contiguous()  # see _GroupedMM.backward
        grad_x = torch.bmm(grad_ECN, w_ENK) if ctx.needs_input_grad[0] else None
        grad_w = (weight_grad(w_ENK, lambda: torch.bmm(grad_ECN.transpose(1, 2), x_ECK))
                  if ctx.needs_input_grad[1] else None)
        return grad_x, grad_w


def grouped_mm(x_SK: torch.Tensor, w_ENK: torch.Tensor, tokens_per_expert_E: torch.Tensor,
               counts: list[int] | None = None, use_grouped_mm: bool = True) -> torch.Tensor:
    """Grouped GEMM: rows of ``x_SK`` are grouped by expert (``tokens_per_expert_E`` rows each, in expert order) and
    each group is multiplied by its expert's weight, given in the stored (E, N, K) layout: y_s = x_s @ w_ENK[e]^T.
    Returns (S, N); rows past sum(tokens_per_expert_E) (capacity padding) are zero.

    Uses ``torch._grouped_mm`` where the build and device support it; otherwise an exact per-expert loop, which needs
    the counts on the host (``counts``; computed with one device-to-host copy if not given).
    """
    n_rows = x_SK.shape[0]
    if use_grouped_mm and _grouped_mm_supported(x_SK, x_SK.shape[-1], w_ENK.shape[-2]):
        offs_E = tokens_per_expert_E.cumsum(0).to(torch.int32)
        # padding rows (that the kernel leaves unwritten) are ruled out only when the counts are on the host
        may_pad = counts is None or sum(counts) != n_rows
        return _GroupedMM.apply(x_SK, w_ENK.to(x_SK.dtype), offs_E, may_pad)
    if counts is None:
        counts = tokens_per_expert_E.tolist()  # host sync: the loop needs python ints
    n_used = sum(counts)
    # unbind, not w_ENK[e]: one backward node that stacks the E gradients, instead of E nodes that each write a
    # full-size zero gradient (O(E^2) memory traffic; 10x slower at E = 32).
    w_list = w_ENK.to(x_SK.dtype).unbind(0)
    outs = [xe @ w_list[e].t() for e, xe in enumerate(torch.split(x_SK[:n_used], counts, dim=0))]
    rest = n_rows - n_used
    if rest:
        outs.append(x_SK.new_zeros(rest, w_ENK.shape[-2]))
    return torch.cat(outs, dim=0)


#: Largest share of padding rows the CPU batched path accepts (E * max count <= (1 + share) * rows); beyond it the
#: wasted FLOPs cost more than the batched GEMM gains over ``torch._grouped_mm``'s per-expert loop (BENCHMARKS.md).
PADDED_BMM_MAX_PAD = 0.25


def padded_slots(counts: list[int], n_rows: int, max_pad: float = PADDED_BMM_MAX_PAD
                 ) -> tuple[int, torch.Tensor | None] | None:
    """Where each grouped row goes in an (E, C) slot layout with C = max count, for a batched GEMM over experts.

    Returns (C, slot_S) where slot_S[s] = e(s) * C + (rank of s within its expert), or slot_S None when every expert
    has exactly C rows (the layout is then a free view); None when the layout does not apply: trailing padding rows
    (sum(counts) != n_rows), no rows, or more than ``max_pad`` padding.
    """
    n = sum(counts)
    C = max(counts) if counts else 0
    if n != n_rows or n == 0 or len(counts) * C > (1 + max_pad) * n:
        return None
    if min(counts) == C:
        return C, None
    counts_E = torch.tensor(counts)
    starts_E = counts_E.cumsum(0) - counts_E
    expert_S = torch.repeat_interleave(torch.arange(len(counts)), counts_E, output_size=n)
    return C, expert_S * C + (torch.arange(n) - starts_E[expert_S])


class ExpertReplicas(Protocol):
    """Copies of other ranks' experts that this rank computes beside its own (redundant experts; implemented in
    ``moetrain.parallel.redundant``). ``slots``: R, the copies per rank; ``route(topk_idx_TK)``: the slot every
    assignment goes to, (T, K) int64 in [0, EP x (El + R)); ``slot_weights(w13_El2FD, w2_ElDF)``: the weights of all
    El + R slots of this rank, this rank's own first (differentiable in both)."""

    slots: int

    def route(self, topk_idx_TK: torch.Tensor) -> torch.Tensor: ...

    def slot_weights(self, w13_E2FD: torch.Tensor, w2_EDF: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]: ...


class GroupedExperts(Recomputable, nn.Module):
    """Routed experts with stacked SwiGLU weights, computed as grouped GEMMs over rows sorted by expert.

    Parameters: ``w13_E2FD`` -- gate (w1) and up (w3) projections of each expert stacked along the output dim,
    rows [0, F) gate and [F, 2F) up, as Megatron-Core's grouped ``fc1`` and transformers-v5's ``gate_up_proj`` -- and
    ``w2_EDF`` (down), in ``nn.Linear``'s (out, in) layout per expert. ``w1_EFD`` / ``w3_EFD`` are views into
    ``w13_E2FD`` (writes through them land in the parameter). One GEMM of width 2F instead of two of width F halves
    the per-expert calls of the gate/up projection, forward and backward: 10-20% of a CPU training step of the
    ``small`` preset, where skewed early routing leaves many small per-expert GEMMs (BENCHMARKS.md).
    Under expert parallelism ``parallelize`` makes both parameters DTensors of global shape (E, ...) sharded on the
    expert dim over the EP mesh; this rank stores (and computes with) its El = E/EP experts.

    Kernels: ``torch._grouped_mm`` (CUDA sm90+, CPU). On CPU, when the groups are within ``PADDED_BMM_MAX_PAD``
    of equal size, the rows are placed once in equal (E, C) slots and the SwiGLU runs as batched GEMMs
    (``torch.bmm``): the CPU ``_grouped_mm`` kernel is a loop of separately threaded small GEMMs, and one batched
    call per GEMM measured 8% faster at the benchmark's expert shapes despite 13.5% padding rows (break-even near
    25%, hence the threshold). With ``use_grouped_mm = False``, an exact per-expert loop (the reference the tests
    compare with).

    FP8 (``fp8_recipe`` set by ``moetrain.precision.apply.apply_fp8``): all six GEMMs quantised per the recipe, on rows
    whose expert groups are padded to the recipe's alignment (``moetrain.precision.grouped``).

    forward(x_SD, tokens_per_expert_E) -> (S, D). Rows past sum(tokens_per_expert) (capacity padding) give zeros.
    """

    def __init__(self, n_experts: int, dim: int, hidden_dim: int):
        super().__init__()
        self.n_experts = n_experts
        self.hidden_dim = hidden_dim
        self.w13_E2FD = nn.Parameter(torch.empty(n_experts, 2 * hidden_dim, dim))
        self.w2_EDF = nn.Parameter(torch.empty(n_experts, dim, hidden_dim))
        self.use_grouped_mm = True
        # Redundant experts (``moetrain.parallel.redundant``, set by ``parallelize``): this rank computes El + R
        # slots, its own experts and R copies of others'; None: its own El.
        self.replicas: ExpertReplicas | None = None
        # An FP8 recipe (moetrain.precision.Fp8Recipe) set by ``moetrain.precision.apply.apply_fp8``; None: high precision.
        self.fp8_recipe: Any = None

    @property
    def w1_EFD(self) -> torch.Tensor:
        """Gate projection, a view of ``w13_E2FD[:, :F]``."""
        return self.w13_E2FD[:, :self.hidden_dim]

    @property
    def w3_EFD(self) -> torch.Tensor:
        """Up projection, a view of ``w13_E2FD[:, F:]``."""
        return self.w13_E2FD[:, self.hidden_dim:]

    def forward(self, x_SD: torch.Tensor, tokens_per_expert_E: torch.Tensor) -> torch.Tensor:
        dtype = _compute_dtype(x_SD)
        x_SD = x_SD.to(dtype)
        S, D = x_SD.shape
        w13_E2FD, w2_EDF = _local(self.w13_E2FD), _local(self.w2_EDF)
        if self.replicas is not None:
            w13_E2FD, w2_EDF = self.replicas.slot_weights(w13_E2FD, w2_EDF)
        cpu = x_SD.device.type == "cpu"
        recompute_act = RecomputeModule.MOE_ACT in self.recompute_modules
        if self.fp8_recipe is not None:
            # the down GEMM keeps its own FP8 copy of the SwiGLU output (DeepSeek-V3's FP8 activation cache):
            # ``moe_act`` recomputes only the SwiGLU's internals from its kept input
            act = (lambda h: checkpointed(_swiglu, h)) if recompute_act else _swiglu
            return fp8_expert_swiglu(x_SD, w13_E2FD, w2_EDF, tokens_per_expert_E, self.fp8_recipe, dtype,
                                     tokens_per_expert_E.tolist() if cpu else None, act=act)
        fast = self.use_grouped_mm and _grouped_mm_supported(x_SD, 2 * self.hidden_dim, D, self.hidden_dim)
        # Counts on the host: free on CPU; on CUDA only the loop path pays the sync.
        counts = tokens_per_expert_E.tolist() if cpu or not fast else None
        if self.use_grouped_mm and cpu:
            slots = padded_slots(counts, S)
            if slots is not None:
                return self._forward_padded(x_SD, w13_E2FD, w2_EDF, *slots, dtype, recompute_act)
        h13_S2F = grouped_mm(x_SD, w13_E2FD, tokens_per_expert_E, counts, self.use_grouped_mm)
        return _act_then(h13_S2F, lambda a: grouped_mm(a, w2_EDF, tokens_per_expert_E, counts, self.use_grouped_mm),
                         recompute_act)

    @staticmethod
    def _forward_padded(x_SD: torch.Tensor, w13_E2FD: torch.Tensor, w2_EDF: torch.Tensor, C: int,
                        slot_S: torch.Tensor | None, dtype: torch.dtype, recompute_act: bool) -> torch.Tensor:
        E, D = w13_E2FD.shape[0], x_SD.shape[1]
        if slot_S is None:
            x_ECD = x_SD.view(E, C, D)
        else:
            # Padding slots stay zero; their outputs are never read back.
            x_ECD = x_SD.new_zeros(E * C, D).index_copy(0, slot_S, x_SD).view(E, C, D)
        h13_EC2F = _BatchedMM.apply(x_ECD, w13_E2FD.to(dtype))
        y_SD = _act_then(h13_EC2F, lambda a: _BatchedMM.apply(a, w2_EDF.to(dtype)), recompute_act).reshape(E * C, D)
        return y_SD if slot_S is None else y_SD.index_select(0, slot_S)


def _act_then(h13: torch.Tensor, down: Callable[[torch.Tensor], torch.Tensor], recompute: bool) -> torch.Tensor:
    """``down(swiglu(h13))``; with ``moe_act`` recompute only ``h13`` is kept: the SwiGLU's output, which the down
    GEMM would keep, and its internals are recomputed in the backward (Megatron-Core ``moe_act``)."""
    if not recompute:
        return down(_swiglu(h13))
    with DroppedOutputs(lambda: (_swiglu(h13),)) as drop:
        return down(drop.add(checkpointed(_swiglu, h13)))


def _local(w: torch.Tensor) -> torch.Tensor:
    """This process's experts of a weight: under expert parallelism the parameter is a DTensor sharded on the expert
    dim over the EP mesh (its local part is the El experts the dispatcher feeds), else a plain tensor. Duck-typed so
    that model code needs no torch.distributed import."""
    return w.to_local() if hasattr(w, "to_local") else w


def _swiglu(h13_X2F: torch.Tensor) -> torch.Tensor:
    """silu(gate) * up for the stacked [gate | up] output of ``w13``."""
    h1, h3 = h13_X2F.chunk(2, dim=-1)
    return F.silu(h1) * h3


def _compute_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype the expert GEMMs run in: the autocast dtype of ``x``'s device when autocast is on there (CPU bf16
    autocast included), else ``x``'s own. Operands are cast to it explicitly, so forward and backward GEMMs see the
    same dtypes whether or not autocast is active when they run."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype
