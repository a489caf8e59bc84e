"""Basic layers: RMSNorm, rotary position embedding with YaRN, a linear with delayable weight gradient, SwiGLU FFN.

Shape legend: B batch, L sequence length, H heads, R rotary dim (``cfg.rope_dim``), D model dim, F FFN dim.
"""

from __future__ import annotations

import math
from typing import Any, ClassVar

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.model.config_base import ModelConfig
from moetrain.model.recompute import Recomputable
from moetrain.model.phases import tape_recording, weight_grad


class RMSNorm(nn.Module):
    """Root-mean-square norm (Zhang & Sennrich 2019), computed in fp32 and cast back, as in the released model.

    Shapes: x (..., D) -> (..., D).
    """

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.eps = eps
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        x32 = x.float()
        y = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)
        return self.weight * y.to(x.dtype)

    def reset_parameters(self) -> None:
        nn.init.ones_(self.weight)


def rope_inv_freq(cfg: ModelConfig) -> torch.Tensor:
    """Inverse frequencies (R/2,) of the rotary embedding over ``cfg.rope_dim``, with YaRN interpolation when the
    config has YaRN scaling (``cfg.yarn``).

    YaRN (Peng et al. 2023, arXiv 2309.00071): dimensions whose wavelength is short relative to the original context
    keep their frequency (extrapolation), long ones are divided by ``factor`` (interpolation), with a linear ramp
    between the correction bounds given by beta_fast / beta_slow rotations. Bounds are floored/ceiled as in the
    DeepSeek-V3 reference and HF ``_compute_yarn_parameters`` (truncate=True).
    """
    dim, base, yarn = cfg.rope_dim, cfg.rope_theta, cfg.yarn
    freqs = 1.0 / (base ** (torch.arange(0, dim, 2, dtype=torch.float32) / dim))
    if yarn is None:
        return freqs

    def correction_dim(n_rot: float) -> float:
        return dim * math.log(yarn.original_seq_len / (n_rot * 2 * math.pi)) / (2 * math.log(base))

    low = max(math.floor(correction_dim(yarn.beta_fast)), 0)
    high = min(math.ceil(correction_dim(yarn.beta_slow)), dim - 1)
    if low == high:
        high += 0.001  # avoid a zero-width ramp
    ramp = ((torch.arange(dim // 2, dtype=torch.float32) - low) / (high - low)).clamp(0, 1)
    extrapolation_weight = 1.0 - ramp
    return freqs / yarn.factor * (1 - extrapolation_weight) + freqs * extrapolation_weight


def rope_cos_sin(cfg: ModelConfig, seq_len: int, device: torch.device | None = None) -> tuple[torch.Tensor, torch.Tensor]:
    """cos and sin tables of shape (L, R/2), fp32, for positions 0..L-1.

    Under YaRN, the attention-temperature factor mscale(factor, mscale)/mscale(factor, mscale_all_dim) multiplies
    both tables (it is 1.0 for DeepSeek-V3, whose softmax scale absorbs the correction instead; see
    ``DeepSeekV3Config.softmax_scale``).
    """
    inv = rope_inv_freq(cfg).to(device)
    t = torch.arange(seq_len, dtype=torch.float32, device=device)
    angles_LR = torch.outer(t, inv)
    scale = 1.0
    yarn = cfg.yarn
    if yarn is not None:
        def m(s: float) -> float:
            return 0.1 * s * math.log(yarn.factor) + 1.0
        # Without both mscale values YaRN's default temperature 0.1 ln(factor) + 1 applies (as in HF).
        scale = m(yarn.mscale) / m(yarn.mscale_all_dim) if yarn.mscale and yarn.mscale_all_dim else m(1.0)
    return angles_LR.cos() * scale, angles_LR.sin() * scale


def apply_rope(x: torch.Tensor, cos_LR: torch.Tensor, sin_LR: torch.Tensor, interleave: bool) -> torch.Tensor:
    """Rotate the last dim of ``x`` (B, L, H, R) by position.

    interleave=True rotates pairs (x0, x1), (x2, x3), ... -- the layout of the released DeepSeek weights -- and
    returns them in the same interleaved layout. interleave=False rotates (x_i, x_{i+R/2}) pairs (rotate-half).
    Computed in fp32, returned in x's dtype.
    """
    cos = cos_LR[None, :, None, :]
    sin = sin_LR[None, :, None, :]
    xf = x.float()
    if interleave:
        x1, x2 = xf[..., 0::2], xf[..., 1::2]
        out = torch.stack((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1).flatten(-2)
    else:
        half = xf.shape[-1] // 2
        x1, x2 = xf[..., :half], xf[..., half:]
        out = torch.cat((x1 * cos - x2 * sin, x2 * cos + x1 * sin), dim=-1)
    return out.to(x.dtype)


class Attention(Recomputable, nn.Module):
    """Base of every family's attention module: forward(x_BLD, cos_LR, sin_LR) -> (B, L, D), causal.

    Class attribute ``projections``: the names of its projection linears, which FP8 training runs in FP8
    (``moetrain.precision.apply``); the attention core between them stays in high precision. ``recompute_modules``
    (:mod:`moetrain.model.recompute`): each family recomputes its kernel under ``core_attn`` and, for MLA, its
    up-projections under ``mla_up_proj``."""

    projections: ClassVar[tuple[str, ...]]


class _LinearDeferredWgrad(torch.autograd.Function):
    """y = x @ w^T with the weight gradient grad_y^T @ x deferrable (:func:`moetrain.model.phases.weight_grad`).
    x (..., K), w (N, K) -> (..., N); operands already in the compute dtype (autocast off inside)."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
        ctx.save_for_backward(x, w)
        with torch.autocast(x.device.type, enabled=False):
            return F.linear(x, w)

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        x, w = ctx.saved_tensors
        grad = grad.to(x.dtype)
        grad_x = grad @ w if ctx.needs_input_grad[0] else None
        grad_w = (weight_grad(w, lambda: grad.reshape(-1, grad.shape[-1]).t() @ x.reshape(-1, x.shape[-1]))
                  if ctx.needs_input_grad[1] else None)
        return grad_x, grad_w


class Linear(nn.Linear):
    """``nn.Linear`` without bias whose weight gradient can be delayed: while a phase tape records (EP overlap across
    micro-batches, :mod:`moetrain.model.phases`), its backward computes the input gradient at once and queues the
    weight gradient to run after the step's reverse all-to-all is issued (Megatron-Core's ``--delay-wgrad-compute``
    for the attention and shared-expert projections). Otherwise it is ``F.linear``. Same parameter, name and
    state-dict key as ``nn.Linear``."""

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if not tape_recording() or self.bias is not None:
            return F.linear(x, self.weight, self.bias)
        w = self.weight
        if torch.is_autocast_enabled(x.device.type):
            dt = torch.get_autocast_dtype(x.device.type)
            x, w = x.to(dt), w.to(dt)
        return _LinearDeferredWgrad.apply(x, w)


class SwiGLU(nn.Module):
    """SwiGLU FFN (Shazeer 2020): w2(silu(w1 x) * w3 x). Shapes: x (..., D) -> (..., D); hidden F.

    Weight names follow TorchTitan (w1 gate, w3 up, w2 down); HF names are gate_proj, up_proj, down_proj.
    """

    def __init__(self, dim: int, hidden_dim: int):
        super().__init__()
        self.w1 = Linear(dim, hidden_dim, bias=False)
        self.w2 = Linear(hidden_dim, dim, bias=False)
        self.w3 = Linear(dim, hidden_dim, bias=False)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.w2(F.silu(self.w1(x)) * self.w3(x))
