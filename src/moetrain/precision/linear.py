"""FP8 linear layer: the three GEMMs of y = x W^T quantised as the recipe says (see ``recipe.py``).

Reference numerics: each GEMM multiplies the dequantised FP8 operands in fp32 (``quant.fake_quantise``), which is
what an FP8 tensor-core GEMM with fp32 accumulation computes up to the order of the additions. Where a kernel
exists (``gemm.uses_fp8_kernel``: ``torch.nn.functional.scaled_mm`` on CUDA) the same quantised operands go
through it (``gemm.operand`` / ``gemm.operand_mm``).

Shape legend: M rows (tokens), K in-features, N out-features.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moetrain.precision.cpu_bf16 import runs_no_bf16_gemm
from moetrain.precision.fused import requantise_t
from moetrain.precision.gemm import operand, operand_mm, operand_t, uses_fp8_kernel
from moetrain.precision.primary_weights import held_quantised, weight_operand
from moetrain.precision.quant import Quantized, ScaleFormat
from moetrain.precision.recipe import Fp8Recipe


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear returns here: the autocast dtype when autocast is on for x's device, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class Fp8LinearFunction(torch.autograd.Function):
    """y_MN = x_MK @ W_NK^T with fprop, dgrad and wgrad GEMMs in FP8 (both operands quantised per ``recipe``).

    forward(x_MK, w_NK, recipe) -> y_MN in the autocast dtype (else x's dtype). backward gives dx in x's dtype and
    dW in W's dtype (the fp32 master weight's gradient). For square-block recipes the quantised x and W are
    saved, as DeepSeek-V3 caches them: as FP8 data and scales where a hardware GEMM runs
    (``gemm.uses_fp8_kernel``), as their dequantised fp32 values on the reference path, which multiplies those
    values (the same numbers; 4 bytes an element instead of 1). Each GEMM writes its result in the dtype it
    returns (a kernel rounds its fp32 accumulator once). The wgrad's operands, (128x1) / (32x1) tiles of dy and x
    (recipe table), are quantised for a kernel as the (1x128) / (1x32) tiles of dy^T and x^T: the same tiles, with
    the data laid out row-major along the tokens, as the kernel reads it.
    """

    @staticmethod
    @runs_no_bf16_gemm
    def forward(ctx: Any, x_MK: torch.Tensor, w_NK: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
        out_dtype = _out_dtype(x_MK)
        kernel = uses_fp8_kernel(x_MK.device)
        xq = operand(x_MK, recipe.row_tile, recipe.fmt, kernel)
        wq = weight_operand(w_NK, recipe.weight_fprop_tile, recipe.fmt, kernel)
        with torch.autocast(x_MK.device.type, enabled=False):
            y = operand_mm(xq, wq, out_dtype)
        ctx.recipe, ctx.kernel = recipe, kernel
        ctx.x_dtype, ctx.w_dtype = x_MK.dtype, w_NK.dtype
        # a weight held in FP8 is saved as itself: its FP8 copy is read again in the backward, not kept twice
        ctx.held = held_quantised(w_NK) is not None
        if recipe.requantise_saved_input:
            ctx.save_for_backward(*_unpack(xq), *((w_NK,) if ctx.held else _unpack(wq)))
        else:
            ctx.save_for_backward(x_MK, w_NK)
        return y

    @staticmethod
    @runs_no_bf16_gemm
    def backward(ctx: Any, dy_MN: torch.Tensor):  # type: ignore[override]
        r: Fp8Recipe = ctx.recipe
        kernel = ctx.kernel
        if r.requantise_saved_input:
            saved = ctx.saved_tensors
            n_x = 2 if kernel else 1
            xq = _pack(saved[:n_x], r.row_tile, r.fmt)
            wq_dgrad = (weight_operand(saved[n_x], r.weight_fprop_tile, r.fmt, kernel) if ctx.held
                        else _pack(saved[n_x:], r.weight_fprop_tile, r.fmt))
        else:
            x_MK, w_NK = ctx.saved_tensors
            wq_dgrad = None
        dx = dw = None
        with torch.autocast(dy_MN.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                dyq = operand(dy_MN, r.row_tile, r.fmt, kernel)
                if wq_dgrad is None:
                    wq_dgrad = weight_operand(w_NK, r.weight_dgrad_tile, r.fmt, kernel)
                # dx = dy W: W^T (K, N) is the "(N', K')" operand of the GEMM with contraction over N.
                dx = operand_mm(dyq, operand_t(wq_dgrad), ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                x_src = xq if r.requantise_saved_input else x_MK
                if kernel:  # the transposes quantised in row tiles: row-major along the tokens, as the kernel reads
                    dyq_t = operand(dy_MN.t(), r.row_tile, r.fmt, kernel)
                    xq_t = (requantise_t(x_src, r.row_tile) if isinstance(x_src, Quantized)
                            else operand(x_src.t(), r.row_tile, r.fmt, kernel))
                else:  # the same values from column tiles of the contiguous tensors (no transposing copies)
                    dyq_t = operand_t(operand(dy_MN, r.col_tile, r.fmt, kernel))
                    xq_t = operand_t(operand(x_src, r.col_tile, r.fmt, kernel))
                dw = operand_mm(dyq_t, xq_t, ctx.w_dtype)
        return dx, dw, None


def _unpack(q: Quantized | torch.Tensor) -> tuple[torch.Tensor, ...]:
    return (q.data, q.scale) if isinstance(q, Quantized) else (q,)


def _pack(saved: tuple[torch.Tensor, ...], tile: tuple[int, int], fmt: ScaleFormat) -> Quantized | torch.Tensor:
    return Quantized(saved[0], saved[1], tile, fmt) if len(saved) == 2 else saved[0]


def fp8_linear(x: torch.Tensor, weight: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
    """``F.linear(x, weight)`` (no bias) with its three GEMMs in FP8. x (..., K), weight (N, K) -> (..., N)."""
    lead = x.shape[:-1]
    y = Fp8LinearFunction.apply(x.reshape(-1, x.shape[-1]), weight, recipe)
    return y.view(*lead, weight.shape[0])


class Fp8Linear(nn.Linear):
    """``nn.Linear`` whose GEMMs run in FP8 per ``fp8_recipe`` (None: the plain high-precision linear).

    Same parameters, names and shapes as ``nn.Linear``: ``apply_fp8`` turns a linear into one by changing its
    class in place, so state dicts, checkpoints, HF loading and FSDP see the module they saw before.
    """

    fp8_recipe: Fp8Recipe | None = None

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if self.fp8_recipe is None:
            return super().forward(x)
        y = fp8_linear(x, self.weight, self.fp8_recipe)
        return y if self.bias is None else y + self.bias.to(y.dtype)

    def extra_repr(self) -> str:
        name = self.fp8_recipe.name if self.fp8_recipe is not None else "none"
        return f"{super().extra_repr()}, fp8={name}"

