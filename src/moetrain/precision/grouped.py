"""FP8 grouped GEMM for routed experts, on rows padded so that every expert's group is aligned.

Rows arrive grouped by expert (``tokens_per_expert_E`` rows each, in expert order, possibly followed by capacity
padding rows). The weight-gradient GEMM of an expert contracts over *its* tokens, quantised in token-dim tiles of
``recipe.block`` rows, so no tile may hold rows of two experts: :func:`aligned_layout` places each group at a
multiple of ``recipe.group_align`` rows (as DeepGEMM's and torchao's grouped FP8 kernels want their groups, see
docs/reference.md section 13), computed on the device without a host sync. Padding rows are zeros: they never raise
a tile's amax, give zero outputs (0 @ W = 0, silu(0) * 0 = 0), carry zero gradients, and are dropped on the way out.

Shape legend: S rows in, P padded rows, E experts (local), D model dim, F expert FFN dim, K / N a GEMM's in / out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.nn.functional as F

from moetrain.precision.cpu_bf16 import runs_no_bf16_gemm
from moetrain.precision.quant import fake_quantise
from moetrain.precision.recipe import Fp8Recipe


@dataclass
class AlignedLayout:
    """Where each row of a grouped tensor goes in the aligned layout.

    Attributes:
        dest_S: int64 destination row of each input row (rows past the groups go after the last aligned group).
        valid_S: bool, rows that belong to a group (False for capacity padding past sum(tokens_per_expert)).
        offs_E: int32 cumulative ends of the aligned groups (each a multiple of ``align``), the ``offs`` of a
            grouped GEMM.
        n_rows: P, rows of the aligned tensor.
    """

    dest_S: torch.Tensor
    valid_S: torch.Tensor
    offs_E: torch.Tensor
    n_rows: int


def aligned_layout(tokens_per_expert_E: torch.Tensor, n_rows: int, align: int,
                   counts: list[int] | None = None) -> AlignedLayout:
    """The aligned layout of ``n_rows`` rows grouped by expert, each group padded to a multiple of ``align``.

    Without ``counts`` (host copies of the per-expert counts) nothing leaves the device: P is the static bound
    ``n_rows + E * (align - 1)``, rounded up to ``align``. With them P is exact (the sum of the aligned groups, plus
    any rows past the groups). Raises ValueError for ``align < 1``.
    """
    if align < 1:
        raise ValueError(f"align={align} must be >= 1")
    dev = tokens_per_expert_E.device
    E = tokens_per_expert_E.shape[0]
    c = tokens_per_expert_E.to(torch.int64)
    ends = c.cumsum(0)
    starts = ends - c
    aligned = (c + align - 1) // align * align
    aligned_ends = aligned.cumsum(0)
    aligned_starts = aligned_ends - aligned
    rows = torch.arange(n_rows, device=dev)
    expert_S = torch.searchsorted(ends, rows, right=True)  # E for rows past the groups
    valid_S = expert_S < E
    e = expert_S.clamp(max=E - 1)
    tail_start = aligned_ends[-1] if E else torch.zeros((), dtype=torch.int64, device=dev)
    total = ends[-1] if E else torch.zeros((), dtype=torch.int64, device=dev)
    dest_S = torch.where(valid_S, aligned_starts[e] + rows - starts[e], tail_start + rows - total)
    if counts is not None:
        P = sum(-(-n // align) * align for n in counts) + (n_rows - sum(counts))
    else:
        P = -(-(n_rows + E * (align - 1)) // align) * align
    return AlignedLayout(dest_S, valid_S, aligned_ends.to(torch.int32), P)


def to_aligned(x_SD: torch.Tensor, layout: AlignedLayout) -> torch.Tensor:
    """Rows of ``x_SD`` scattered into a zero (P, D) tensor at ``layout.dest_S``; rows past the groups are zeroed."""
    x = torch.where(layout.valid_S.unsqueeze(-1), x_SD, 0)
    return x.new_zeros(layout.n_rows, x.shape[-1]).index_copy(0, layout.dest_S, x)


def from_aligned(y_PD: torch.Tensor, layout: AlignedLayout) -> torch.Tensor:
    """The (S, D) rows back from the aligned layout; rows past the groups are zero."""
    return torch.where(layout.valid_S.unsqueeze(-1), y_PD.index_select(0, layout.dest_S), 0)


def _zero_tail(t: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(t.shape[0], device=t.device)
    return torch.where((rows < end).unsqueeze(-1), t, 0)


def _gmm(a_PK: torch.Tensor, b_ENK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """fp32 y_p = a_p @ b[e(p)]^T for rows grouped by ``offs_E``; rows past offs[-1] are zero. (P, K) -> (P, N).

    CPU: ``torch._grouped_mm`` in fp32. CUDA: its kernel is bf16-only (fp32 accumulation, bf16 output); the MXFP8
    operands are exact in bf16 (E4M3 values times powers of two), the blockwise ones are rounded to bf16 (2**-9
    relative per element), and the output is rounded to bf16 once. Not run here (no GPU).
    """
    if a_PK.device.type == "cuda":
        y = torch._grouped_mm(a_PK.bfloat16(), b_ENK.bfloat16().transpose(-2, -1), offs=offs_E).float()
    else:
        y = torch._grouped_mm(a_PK, b_ENK.transpose(-2, -1), offs=offs_E)
    return _zero_tail(y, offs_E[-1])


def _gmm_wgrad(dy_PN: torch.Tensor, x_PK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """fp32 per-group dy_e^T @ x_e: (P, N), (P, K) -> (E, N, K); empty groups give zeros."""
    if dy_PN.device.type == "cuda":
        return torch._grouped_mm(dy_PN.bfloat16().t(), x_PK.bfloat16(), offs=offs_E).float()
    return torch._grouped_mm(dy_PN.t(), x_PK, offs=offs_E)


class Fp8GroupedMMFunction(torch.autograd.Function):
    """y_PN = x_PK @ w_ENK[e(p)]^T on an aligned layout, fprop / dgrad / wgrad in FP8 per ``recipe``.

    x rows are grouped by ``offs_E`` (int32 cumulative ends, each a multiple of ``recipe.group_align``); rows past
    offs[-1] give zero output and zero gradient. Expert weights are quantised per expert (tiles never cross
    experts). forward(x_PK, w_ENK, offs_E, recipe, out_dtype) -> (P, N) in ``out_dtype``.
    """

    @staticmethod
    @runs_no_bf16_gemm
    def forward(ctx: Any, x_PK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor, recipe: Fp8Recipe,
                out_dtype: torch.dtype) -> torch.Tensor:
        xq = fake_quantise(x_PK, recipe.row_tile, recipe.fmt)
        wq = fake_quantise(w_ENK, recipe.weight_fprop_tile, recipe.fmt)
        with torch.autocast(x_PK.device.type, enabled=False):
            y = _gmm(xq, wq, offs_E)
        ctx.recipe, ctx.x_dtype, ctx.w_dtype = recipe, x_PK.dtype, w_ENK.dtype
        if recipe.requantise_saved_input:
            ctx.save_for_backward(xq, wq, offs_E)
        else:
            ctx.save_for_backward(x_PK, w_ENK, offs_E)
        return y.to(out_dtype)

    @staticmethod
    @runs_no_bf16_gemm
    def backward(ctx: Any, dy_PN: torch.Tensor):  # type: ignore[override]
        r: Fp8Recipe = ctx.recipe
        if r.requantise_saved_input:
            x_src, w_dgrad, offs_E = ctx.saved_tensors
        else:
            x_src, w_ENK, offs_E = ctx.saved_tensors
            w_dgrad = None
        dx = dw = None
        with torch.autocast(dy_PN.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                if w_dgrad is None:
                    w_dgrad = fake_quantise(w_ENK, r.weight_dgrad_tile, r.fmt)
                dyq = fake_quantise(dy_PN, r.row_tile, r.fmt)
                dx = _gmm(dyq, w_dgrad.transpose(-2, -1), offs_E).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                dyq_t = fake_quantise(dy_PN, r.col_tile, r.fmt)
                xq_t = fake_quantise(x_src, r.col_tile, r.fmt)
                dw = _gmm_wgrad(dyq_t, xq_t, offs_E).to(ctx.w_dtype)
        return dx, dw, None, None, None


def fp8_grouped_mm(x_PK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor, recipe: Fp8Recipe,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """:class:`Fp8GroupedMMFunction` on an aligned layout: (P, K), (E, N, K) stored layout -> (P, N)."""
    return Fp8GroupedMMFunction.apply(x_PK, w_ENK, offs_E, recipe, out_dtype or x_PK.dtype)


@runs_no_bf16_gemm
def fp8_expert_swiglu(x_SD: torch.Tensor, w13_E2FD: torch.Tensor, w2_EDF: torch.Tensor,
                      tokens_per_expert_E: torch.Tensor, recipe: Fp8Recipe, out_dtype: torch.dtype,
                      counts: list[int] | None = None) -> torch.Tensor:
    """Routed experts' SwiGLU, w2(silu(w1 x) * w3 x) per expert, with all six GEMMs in FP8.

    x_SD rows grouped by expert (``tokens_per_expert_E``), w13_E2FD the stacked [gate | up] weights, w2_EDF the
    down weights. Returns (S, D) in ``out_dtype``; rows past the groups are zero. ``counts`` (host ints) only size
    the aligned tensor exactly; without them nothing syncs with the host.
    """
    layout = aligned_layout(tokens_per_expert_E, x_SD.shape[0], recipe.group_align, counts)
    x_PD = to_aligned(x_SD, layout)
    h13 = fp8_grouped_mm(x_PD, w13_E2FD, layout.offs_E, recipe, out_dtype)
    h1, h3 = h13.chunk(2, dim=-1)
    y_PD = fp8_grouped_mm(F.silu(h1) * h3, w2_EDF, layout.offs_E, recipe, out_dtype)
    return from_aligned(y_PD, layout)
