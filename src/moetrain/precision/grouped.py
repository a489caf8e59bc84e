"""FP8 grouped GEMM for routed experts, on rows padded so that every expert's group is aligned.

Rows arrive grouped by expert (``tokens_per_expert_E`` rows each, in expert order, possibly followed by capacity
padding rows). :func:`aligned_layout` places each group at a multiple of ``recipe.group_align`` rows, computed on the
device without a host sync: 16 for the row-wise experts of the blockwise recipe (each group starts 16 bytes into
the FP8 rows the weight-gradient GEMM contracts over, as torch's grouped kernels need), a multiple of the tile for
tiled recipes (a token-dim tile of the wgrad never holds rows of two experts; DeepGEMM's and torchao's grouped
layouts, docs/reference.md section 13). Padding rows are zeros: they never raise a scale's amax, give zero outputs
(0 @ W = 0, silu(0) * 0 = 0), carry zero gradients, and are dropped on the way out.

Two tilings (``recipe.expert_scaling``, table in ``recipe.py``):

* "rowwise" (:class:`RowwiseFp8GroupedMM`): one scale per token row and per weight row (fprop), per token row and
  per weight column (dgrad), per (expert, column) over the expert's tokens (wgrad). On CUDA Hopper and Blackwell
  (:func:`grouped_kernel`) the three GEMMs run ``torch._scaled_grouped_mm`` on FP8 data (fprop and dgrad 2d x 3d,
  wgrad 2d x 2d, bf16 output: the only one torch allows), with quantisers compiled by ``precision.fused``; elsewhere
  (CPU) they multiply the same quantised values in fp32 (``torch._grouped_mm``), the definition.
* "tiles" (:class:`Fp8GroupedMMFunction`, the mxfp8 recipe): the linear's tiles, reference GEMMs on every device
  (fp32 on CPU; on CUDA bf16 ``_grouped_mm`` of the dequantised values, exact for E8M0 scales), with a one-time
  warning on CUDA. torch has an MX grouped GEMM (``F.scaled_grouped_mm`` with ``BlockWise1x32``) but no meta kernel
  for it (torch 2.11 and 2.13: "no fake impl or Meta kernel registered" for ``aten::_scaled_grouped_mm_v2``), so
  its operands cannot be checked on a CPU-only build; it is not used until they can be.

Timing and checking the row-wise path on a GPU: :func:`fp8_grouped_mm` (forward; ``.backward`` for dgrad and wgrad)
against :func:`grouped_reference` within ``gemm.fast_path_rtol(torch.bfloat16)`` (benchmarks/fp8_gpu_verify.py).

Shape legend: S rows in, P padded rows, E experts (local), D model dim, F expert FFN dim, K / N a GEMM's in / out.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

import torch
import torch.nn.functional as F

from moetrain import devices
from moetrain.precision import fused
from moetrain.precision.cpu_bf16 import runs_no_bf16_gemm
from moetrain.precision.gemm import matmul_fp32_precision, warn_emulated
from moetrain.precision.primary_weights import weight_operand, weight_source
from moetrain.precision.quant import fake_quantise, fake_quantise_groups
from moetrain.precision.recipe import Fp8Recipe


@dataclass
class AlignedLayout:
    """Where each row of a grouped tensor goes in the aligned layout.

    Attributes:
        dest_S: int64 destination row of each input row (rows past the groups go after the last aligned group).
        valid_S: bool, rows that belong to a group (False for capacity padding past sum(tokens_per_expert)).
        offs_E: int32 cumulative ends of the aligned groups (each a multiple of ``align``), the ``offs`` of a
            grouped GEMM.
        n_rows: P, rows of the aligned tensor, a multiple of ``align``.
    """

    dest_S: torch.Tensor
    valid_S: torch.Tensor
    offs_E: torch.Tensor
    n_rows: int


def aligned_layout(tokens_per_expert_E: torch.Tensor, n_rows: int, align: int,
                   counts: list[int] | None = None) -> AlignedLayout:
    """The aligned layout of ``n_rows`` rows grouped by expert, each group padded to a multiple of ``align``.

    Without ``counts`` (host copies of the per-expert counts) nothing leaves the device: P is the static bound
    ``n_rows + E * (align - 1)``; with them, the sum of the aligned groups plus any rows past the groups. Either is
    rounded up to ``align``: the wgrad's FP8 operands are laid out (K, P) row-major, and torch's grouped kernels
    need rows of a multiple of 16 bytes. Raises ValueError for ``align < 1``.
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
    tail_start = aligned_ends.select(0, -1) if E else torch.zeros((), dtype=torch.int64, device=dev)
    total = ends.select(0, -1) if E else torch.zeros((), dtype=torch.int64, device=dev)
    dest_S = torch.where(valid_S, (aligned_starts - starts).index_select(0, e) + rows, tail_start + rows - total)
    if counts is not None:
        P = sum(-(-n // align) * align for n in counts) + (n_rows - sum(counts))
    else:
        P = n_rows + E * (align - 1)
    return AlignedLayout(dest_S, valid_S, aligned_ends.to(torch.int32), -(-P // align) * align)


def to_aligned(x_SD: torch.Tensor, layout: AlignedLayout) -> torch.Tensor:
    """Rows of ``x_SD`` scattered into a zero (P, D) tensor at ``layout.dest_S``; rows past the groups are zeroed."""
    x = torch.where(layout.valid_S.unsqueeze(-1), x_SD, 0)
    return x.new_zeros(layout.n_rows, x.shape[-1]).index_copy(0, layout.dest_S, x)


def from_aligned(y_PD: torch.Tensor, layout: AlignedLayout) -> torch.Tensor:
    """The (S, D) rows back from the aligned layout; rows past the groups are zero."""
    return torch.where(layout.valid_S.unsqueeze(-1), y_PD.index_select(0, layout.dest_S), 0)


def group_index(offs_E: torch.Tensor, n_rows: int) -> torch.Tensor:
    """The group of each of ``n_rows`` rows grouped by ``offs_E`` (cumulative ends): int64 (P,), E for rows past
    offs[-1]. On the device, no sync."""
    rows = torch.arange(n_rows, device=offs_E.device)
    return torch.searchsorted(offs_E.to(torch.int64), rows, right=True)


def _zero_tail(t: torch.Tensor, end: torch.Tensor) -> torch.Tensor:
    rows = torch.arange(t.shape[0], device=t.device)
    return torch.where((rows < end).unsqueeze(-1), t, 0)


def _pad8(t: torch.Tensor, dims: tuple[int, ...]) -> torch.Tensor:
    """``t`` zero-padded at the end of each of ``dims`` to a multiple of 8 (bf16 rows of 16-byte multiples, which
    CUDA's ``_grouped_mm`` needs); itself when already aligned."""
    pad = [0] * (2 * t.dim())
    for d in dims:
        pad[2 * (t.dim() - 1 - d % t.dim()) + 1] = -t.shape[d] % 8
    return F.pad(t, pad) if any(pad) else t


def _gmm(a_PK: torch.Tensor, b_ENK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """fp32 y_p = a_p @ b[e(p)]^T for rows grouped by ``offs_E``; rows past offs[-1] are zero. (P, K) -> (P, N).

    CPU: ``torch._grouped_mm`` in fp32. CUDA: its kernel is bf16-only (fp32 accumulation, bf16 output); the MXFP8
    operands are exact in bf16 (E4M3 values times powers of two), fp32-scaled ones are rounded to bf16 (2**-9
    relative per element), and the output is rounded to bf16 once. K and N are zero-padded to multiples of 8 there
    (zeros add nothing to a sum; the extra columns are cut off).
    """
    N = b_ENK.shape[1]
    if a_PK.device.type == "cuda":
        a, b = _pad8(a_PK.bfloat16(), (-1,)), _pad8(b_ENK.bfloat16(), (-2, -1))
        y = torch._grouped_mm(a, b.transpose(-2, -1), offs=offs_E).float().narrow(-1, 0, N)
    else:
        y = torch._grouped_mm(a_PK, b_ENK.transpose(-2, -1), offs=offs_E)
    return _zero_tail(y, offs_E.select(0, -1))


def _gmm_wgrad(dy_PN: torch.Tensor, x_PK: torch.Tensor, offs_E: torch.Tensor) -> torch.Tensor:
    """fp32 per-group dy_e^T @ x_e: (P, N), (P, K) -> (E, N, K); empty groups give zeros. On CUDA in bf16 as
    :func:`_gmm`, N and K zero-padded to multiples of 8."""
    if dy_PN.device.type == "cuda":
        N, K = dy_PN.shape[1], x_PK.shape[1]
        dy, x = _pad8(dy_PN.bfloat16(), (-1,)), _pad8(x_PK.bfloat16(), (-1,))
        return torch._grouped_mm(dy.t(), x, offs=offs_E).float().narrow(-2, 0, N).narrow(-1, 0, K)
    return torch._grouped_mm(dy_PN.t(), x_PK, offs=offs_E)


def grouped_kernel(device: torch.device) -> bool:
    """Whether ``device`` runs torch's row-wise FP8 grouped GEMM (``torch._scaled_grouped_mm``): CUDA sm90 (Hopper)
    or sm100 (Blackwell), the architectures its kernels are built for."""
    return (device.type == "cuda" and hasattr(torch, "_scaled_grouped_mm")
            and devices.cuda_capability(device)[0] in (9, 10))


def _chunk(recipe: Fp8Recipe, n_rows: int) -> int:
    """Rows per chunk for the per-group maxima (``quant.group_amax``): the groups start at multiples of
    ``recipe.group_align`` and P is one (:func:`aligned_layout`), so chunks of that many rows lie in one group;
    1 for a P that is not (a layout made otherwise)."""
    return recipe.group_align if n_rows % recipe.group_align == 0 else 1


class RowwiseFp8GroupedMM(torch.autograd.Function):
    """y_PN = x_PK @ w_ENK[e(p)]^T with the "rowwise" expert tiling (``recipe.py``), fprop / dgrad / wgrad in FP8.

    x rows are grouped by ``offs_E`` (int32 cumulative ends, each a multiple of ``recipe.group_align``); rows past
    offs[-1] give zero output and zero gradient. forward(x_PK, w_ENK, offs_E, recipe, out_dtype) -> (P, N) in
    ``out_dtype``; backward gives dx in x's dtype, dW in W's. Saved for the backward: the wgrad's x, quantised per
    (expert, column) (FP8 data, (K, P) row-major, and (E, K) scales on the kernel path; its fp32 values on the
    reference path), the weight parameter itself, offs and the row groups. Kernel path (:func:`grouped_kernel`):
    the outputs of all three GEMMs are bf16 (torch's only output dtype for them), then cast to the dtypes above.
    """

    @staticmethod
    @runs_no_bf16_gemm
    def forward(ctx: Any, x_PK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor, recipe: Fp8Recipe,
                out_dtype: torch.dtype) -> torch.Tensor:
        r = recipe
        P, E = x_PK.shape[0], w_ENK.shape[0]
        N, K = w_ENK.shape[1:]
        kernel = grouped_kernel(x_PK.device)
        if not kernel and x_PK.device.type == "cuda":
            warn_emulated("routed-expert GEMMs", r.fmt, x_PK.device,
                          "torch's FP8 grouped GEMM (_scaled_grouped_mm) runs on sm90 and sm100 only")
        elif kernel and (P % 16 or N % 16 or K % 16):
            # the kernel reads and writes rows of 16-byte multiples: FP8 rows of K (fprop), N (dgrad's W^T) and P
            # (wgrad's (K, P) operand) elements
            kernel = False
            warn_emulated("routed-expert GEMMs (unaligned dims)", r.fmt, x_PK.device,
                          f"torch's FP8 grouped GEMM needs the rows P={P}, model dim and expert width (here "
                          f"{K} and {N}) to be multiples of 16")
        group_P = group_index(offs_E, P)
        chunk = _chunk(r, P)
        with torch.autocast(x_PK.device.type, enabled=False):
            if kernel:
                xq = fused.quantise(x_PK, r.expert_row_tile, r.fmt)
                wq = weight_operand(w_ENK, r.expert_row_tile, r.fmt, kernel=True)
                y = torch._scaled_grouped_mm(xq.data, wq.data.transpose(-2, -1), xq.scale.squeeze(-1),
                                             wq.scale.squeeze(-1), offs=offs_E, out_dtype=torch.bfloat16)
                xg, sxg = fused.quantise_by_group(x_PK, group_P, E, r.fmt, chunk, column_major=True)
                ctx.save_for_backward(xg, sxg, w_ENK, offs_E, group_P)
            else:
                y = _gmm(fake_quantise(x_PK, r.expert_row_tile, r.fmt),
                         weight_operand(w_ENK, r.expert_row_tile, r.fmt, kernel=False), offs_E)
                xg = fake_quantise_groups(x_PK, group_P, E, r.fmt, chunk)
                ctx.save_for_backward(xg, w_ENK, offs_E, group_P)
        ctx.recipe, ctx.kernel, ctx.chunk = r, kernel, chunk
        ctx.x_dtype = x_PK.dtype
        return _zero_tail(y, offs_E.select(0, -1)).to(out_dtype)

    @staticmethod
    @runs_no_bf16_gemm
    def backward(ctx: Any, dy_PN: torch.Tensor):  # type: ignore[override]
        r: Fp8Recipe = ctx.recipe
        if ctx.kernel:
            xg, sxg, w_ENK, offs_E, group_P = ctx.saved_tensors
        else:
            xg, w_ENK, offs_E, group_P = ctx.saved_tensors
        E = w_ENK.shape[0]
        dx = dw = None
        with torch.autocast(dy_PN.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                if ctx.kernel:
                    dyq = fused.quantise(dy_PN, r.expert_row_tile, r.fmt)
                    # W per input column over N: the rows of W^T (E, K, N), laid out as the kernel's (E, N, K)
                    wq = fused.quantise(weight_source(w_ENK).transpose(-2, -1), r.expert_row_tile, r.fmt)
                    dx = torch._scaled_grouped_mm(dyq.data, wq.data.transpose(-2, -1), dyq.scale.squeeze(-1),
                                                  wq.scale.squeeze(-1), offs=offs_E, out_dtype=torch.bfloat16)
                else:
                    dx = _gmm(fake_quantise(dy_PN, r.expert_row_tile, r.fmt),
                              weight_operand(w_ENK, r.expert_col_tile, r.fmt, kernel=False).transpose(-2, -1),
                              offs_E)
                dx = _zero_tail(dx, offs_E.select(0, -1)).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                if ctx.kernel:
                    dyg, sdyg = fused.quantise_by_group(dy_PN, group_P, E, r.fmt, ctx.chunk, column_major=True)
                    dw = torch._scaled_grouped_mm(dyg.t(), xg, sdyg.reshape(-1), sxg.reshape(-1), offs=offs_E,
                                                  out_dtype=torch.bfloat16)
                    # an expert without rows has no K-group to write: its gradient is zero by definition
                    counts_E = torch.diff(offs_E, prepend=offs_E.new_zeros(1))
                    dw = torch.where((counts_E > 0).view(E, 1, 1), dw, 0)
                else:
                    dw = _gmm_wgrad(fake_quantise_groups(dy_PN, group_P, E, r.fmt, ctx.chunk), xg, offs_E)
                dw = dw.to(w_ENK.dtype)
        return dx, dw, None, None, None


class Fp8GroupedMMFunction(torch.autograd.Function):
    """y_PN = x_PK @ w_ENK[e(p)]^T on an aligned layout, fprop / dgrad / wgrad in FP8 with the recipe's tiles
    ("tiles" expert scaling), reference GEMMs (see the module docstring).

    x rows are grouped by ``offs_E`` (int32 cumulative ends, each a multiple of ``recipe.group_align``); rows past
    offs[-1] give zero output and zero gradient. Expert weights are quantised per expert (tiles never cross
    experts). forward(x_PK, w_ENK, offs_E, recipe, out_dtype) -> (P, N) in ``out_dtype``.
    """

    @staticmethod
    @runs_no_bf16_gemm
    def forward(ctx: Any, x_PK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor, recipe: Fp8Recipe,
                out_dtype: torch.dtype) -> torch.Tensor:
        if x_PK.device.type == "cuda":
            warn_emulated("routed-expert GEMMs", recipe.fmt, x_PK.device,
                          f"moetrain has no FP8 grouped kernel for {recipe.name}'s tiles (grouped.py)")
        xq = fake_quantise(x_PK, recipe.row_tile, recipe.fmt)
        wq = weight_operand(w_ENK, recipe.weight_fprop_tile, recipe.fmt, kernel=False)
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
                    w_dgrad = weight_operand(w_ENK, r.weight_dgrad_tile, r.fmt, kernel=False)
                dyq = fake_quantise(dy_PN, r.row_tile, r.fmt)
                dx = _gmm(dyq, w_dgrad.transpose(-2, -1), offs_E).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                dyq_t = fake_quantise(dy_PN, r.col_tile, r.fmt)
                xq_t = fake_quantise(x_src, r.col_tile, r.fmt)
                dw = _gmm_wgrad(dyq_t, xq_t, offs_E).to(ctx.w_dtype)
        return dx, dw, None, None, None


def fp8_grouped_mm(x_PK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor, recipe: Fp8Recipe,
                   out_dtype: torch.dtype | None = None) -> torch.Tensor:
    """The routed experts' FP8 grouped GEMM on an aligned layout: y_p = x_p @ w_ENK[e(p)]^T, (P, K), (E, N, K)
    stored layout -> (P, N) in ``out_dtype`` (default x's), autograd through dgrad and wgrad in FP8.

    ``offs_E``: int32 cumulative group ends, each a multiple of ``recipe.group_align`` (:func:`aligned_layout`);
    rows past offs[-1] give zeros. Tiling per ``recipe.expert_scaling``: :class:`RowwiseFp8GroupedMM` or
    :class:`Fp8GroupedMMFunction`. Works on fake CUDA tensors (no host sync).
    """
    fn = RowwiseFp8GroupedMM if recipe.expert_scaling == "rowwise" else Fp8GroupedMMFunction
    return fn.apply(x_PK, w_ENK, offs_E, recipe, out_dtype or x_PK.dtype)


def grouped_reference(x_PK: torch.Tensor, w_ENK: torch.Tensor, offs_E: torch.Tensor, dy_PN: torch.Tensor,
                      recipe: Fp8Recipe) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """The definition of :func:`fp8_grouped_mm`'s three GEMMs, written out per expert in fp32 (TF32 off):
    returns (y (P, N), dx (P, K), dW (E, N, K)) for the output gradient ``dy_PN``, all fp32, rows past offs[-1]
    zero. Reads ``offs_E`` on the host (one sync): for checks, not for training. "rowwise" experts only.

    Raises:
        ValueError: a recipe whose experts are not "rowwise".
    """
    if recipe.expert_scaling != "rowwise":
        raise ValueError(f"grouped_reference covers the 'rowwise' expert tiling, not {recipe.name!r}'s "
                         f"{recipe.expert_scaling!r}")
    r, E, P = recipe, w_ENK.shape[0], x_PK.shape[0]
    group_P = group_index(offs_E, P)
    xv = fake_quantise(x_PK, r.expert_row_tile, r.fmt)
    dyv = fake_quantise(dy_PN, r.expert_row_tile, r.fmt)
    w_f, w_d = fake_quantise(w_ENK, r.expert_row_tile, r.fmt), fake_quantise(w_ENK, r.expert_col_tile, r.fmt)
    xg = fake_quantise_groups(x_PK, group_P, E, r.fmt)
    dyg = fake_quantise_groups(dy_PN, group_P, E, r.fmt)
    y = x_PK.new_zeros(P, w_ENK.shape[1], dtype=torch.float32)
    dx = x_PK.new_zeros(P, w_ENK.shape[2], dtype=torch.float32)
    dw = torch.zeros(w_ENK.shape, dtype=torch.float32, device=w_ENK.device)
    ends = offs_E.tolist()
    with matmul_fp32_precision("ieee"):
        for e, (a, b) in enumerate(zip([0] + ends[:-1], ends)):
            y[a:b] = xv[a:b] @ w_f[e].t()
            dx[a:b] = dyv[a:b] @ w_d[e]
            dw[e] = dyg[a:b].t() @ xg[a:b]
    return y, dx, dw


@runs_no_bf16_gemm
def fp8_expert_swiglu(x_SD: torch.Tensor, w13_E2FD: torch.Tensor, w2_EDF: torch.Tensor,
                      tokens_per_expert_E: torch.Tensor, recipe: Fp8Recipe, out_dtype: torch.dtype,
                      counts: list[int] | None = None,
                      act: Callable[[torch.Tensor], torch.Tensor] | None = None) -> torch.Tensor:
    """Routed experts' SwiGLU, w2(silu(w1 x) * w3 x) per expert, with all six GEMMs in FP8.

    x_SD rows grouped by expert (``tokens_per_expert_E``), w13_E2FD the stacked [gate | up] weights, w2_EDF the
    down weights. Returns (S, D) in ``out_dtype``; rows past the groups are zero. ``counts`` (host ints) only size
    the aligned tensor exactly; without them nothing syncs with the host. ``act``: the activation of the stacked
    [gate | up] output, (P, 2F) -> (P, F) (None: silu(gate) * up; the model passes a recomputed one).
    """
    layout = aligned_layout(tokens_per_expert_E, x_SD.shape[0], recipe.group_align, counts)
    x_PD = to_aligned(x_SD, layout)
    h13 = fp8_grouped_mm(x_PD, w13_E2FD, layout.offs_E, recipe, out_dtype)
    if act is None:
        h1, h3 = h13.chunk(2, dim=-1)
        a = F.silu(h1) * h3
    else:
        a = act(h13)
    y_PD = fp8_grouped_mm(a, w2_EDF, layout.offs_E, recipe, out_dtype)
    return from_aligned(y_PD, layout)
