"""FP8 linear layer: the three GEMMs of y = x W^T quantised as the recipe says (see ``recipe.py``).

Reference numerics: each GEMM multiplies the dequantised FP8 operands in fp32 (``quant.fake_quantise``), which is
what an FP8 tensor-core GEMM with fp32 accumulation computes up to the order of the additions. Where a kernel
exists (``gemm.fp8_mm``: ``torch.nn.functional.scaled_mm`` on CUDA) the same quantised operands go through it.

Shape legend: M rows (tokens), K in-features, N out-features.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import nn

from moetrain.precision.gemm import fp8_mm
from moetrain.precision.cpu_bf16 import runs_no_bf16_gemm
from moetrain.precision.quant import Quantized, quantise
from moetrain.precision.recipe import Fp8Recipe


def _out_dtype(x: torch.Tensor) -> torch.dtype:
    """The dtype a linear returns here: the autocast dtype when autocast is on for x's device, else x's."""
    if torch.is_autocast_enabled(x.device.type):
        return torch.get_autocast_dtype(x.device.type)
    return x.dtype


class Fp8LinearFunction(torch.autograd.Function):
    """y_MN = x_MK @ W_NK^T with fprop, dgrad and wgrad GEMMs in FP8 (both operands quantised per ``recipe``).

    forward(x_MK, w_NK, recipe) -> y_MN in the autocast dtype (else x's dtype). backward gives dx in x's dtype and
    dW in W's dtype (the fp32 master weight's gradient). Saves the FP8 copy of x (data + scales) and, for
    square-block recipes, the quantised W, as DeepSeek-V3 caches them.
    """

    @staticmethod
    @runs_no_bf16_gemm
    def forward(ctx: Any, x_MK: torch.Tensor, w_NK: torch.Tensor, recipe: Fp8Recipe) -> torch.Tensor:
        out_dtype = _out_dtype(x_MK)
        xq = quantise(x_MK, recipe.row_tile, recipe.fmt)
        wq = quantise(w_NK, recipe.weight_fprop_tile, recipe.fmt)
        with torch.autocast(x_MK.device.type, enabled=False):
            y = fp8_mm(xq, wq)
        ctx.recipe = recipe
        ctx.x_dtype, ctx.w_dtype = x_MK.dtype, w_NK.dtype
        if recipe.requantise_saved_input:
            ctx.save_for_backward(xq.data, xq.scale, wq.data, wq.scale)
        else:
            ctx.save_for_backward(x_MK, w_NK)
        return y.to(out_dtype)

    @staticmethod
    @runs_no_bf16_gemm
    def backward(ctx: Any, dy_MN: torch.Tensor):  # type: ignore[override]
        r: Fp8Recipe = ctx.recipe
        if r.requantise_saved_input:
            x_data, x_scale, w_data, w_scale = ctx.saved_tensors
            x_src = Quantized(x_data, x_scale, r.row_tile, r.fmt).dequantise()
            wq_dgrad = Quantized(w_data, w_scale, r.weight_fprop_tile, r.fmt)
        else:
            x_src, w_NK = ctx.saved_tensors
            wq_dgrad = None
        dx = dw = None
        with torch.autocast(dy_MN.device.type, enabled=False):
            if ctx.needs_input_grad[0]:
                dyq = quantise(dy_MN, r.row_tile, r.fmt)
                if wq_dgrad is None:
                    wq_dgrad = quantise(w_NK, r.weight_dgrad_tile, r.fmt)
                # dx = dy W: W^T (K, N) is the "(N', K')" operand of fp8_mm with contraction over N.
                dx = fp8_mm(dyq, _transpose(wq_dgrad)).to(ctx.x_dtype)
            if ctx.needs_input_grad[1]:
                dyq_t = quantise(dy_MN, r.col_tile, r.fmt)
                xq_t = quantise(x_src, r.col_tile, r.fmt)
                dw = fp8_mm(_transpose(dyq_t), _transpose(xq_t)).to(ctx.w_dtype)
        return dx, dw, None


def _transpose(q: Quantized) -> Quantized:
    """The same quantised values transposed (tiles and scales transposed with them); no requantisation."""
    return Quantized(q.data.transpose(-2, -1), q.scale.transpose(-2, -1), (q.tile[1], q.tile[0]), q.fmt)


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

