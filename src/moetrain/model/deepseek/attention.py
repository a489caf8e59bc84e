"""Multi-head Latent Attention (DeepSeek-V2, arXiv 2405.04434, section 2.1; used unchanged in DeepSeek-V3).

Queries go through a low-rank compression (q_lora_rank; 0 = plain projection), keys and values through a joint
latent of rank kv_lora_rank, and a decoupled rotary key of qk_rope_head_dim is shared by all heads. This is the
training ("naive") form: the latent is expanded to per-head keys and values, as in HF ``DeepseekV3Attention``.

Shape legend: B batch, L sequence, D model dim, H heads, Cq q_lora_rank, Ckv kv_lora_rank, Dn qk_nope_head_dim,
R qk_rope_head_dim, Dv v_head_dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.model.config_base import ModelConfig
from moetrain.model.layers import Attention, Linear, RMSNorm, apply_rope


# The latent norms use a fixed epsilon in DeepSeek's reference code and in HF, whatever rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


class MLA(Attention):
    """Multi-head Latent Attention with causal masking over the whole (packed) sequence.

    Args:
        cfg: a :class:`~moetrain.model.deepseek.config.DeepSeekV3Config` (n_heads, q_lora_rank, kv_lora_rank, head
            dims, rope_interleave, softmax_scale); typed by the common base, which that module imports this one.

    forward(x_BLD, cos_LR, sin_LR) -> (B, L, D). Weight names match the released checkpoint (``q_a_proj`` ...).
    """

    projections = ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa", "kv_b_proj", "o_proj")

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads = cfg.n_heads
        self.q_lora_rank = cfg.q_lora_rank
        self.kv_lora_rank = cfg.kv_lora_rank
        self.nope_dim, self.rope_dim, self.v_dim = cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim
        self.qk_dim = cfg.qk_head_dim
        self.interleave = cfg.rope_interleave
        self.softmax_scale = cfg.softmax_scale
        H = cfg.n_heads
        if cfg.q_lora_rank:
            self.q_a_proj = Linear(cfg.dim, cfg.q_lora_rank, bias=False)
            self.q_a_layernorm = RMSNorm(cfg.q_lora_rank, LATENT_NORM_EPS)
            self.q_b_proj = Linear(cfg.q_lora_rank, H * self.qk_dim, bias=False)
        else:
            self.q_proj = Linear(cfg.dim, H * self.qk_dim, bias=False)
        self.kv_a_proj_with_mqa = Linear(cfg.dim, cfg.kv_lora_rank + cfg.qk_rope_head_dim, bias=False)
        self.kv_a_layernorm = RMSNorm(cfg.kv_lora_rank, LATENT_NORM_EPS)
        self.kv_b_proj = Linear(cfg.kv_lora_rank, H * (self.nope_dim + self.v_dim), bias=False)
        self.o_proj = Linear(H * self.v_dim, cfg.dim, bias=False)

    def forward(self, x_BLD: torch.Tensor, cos_LR: torch.Tensor, sin_LR: torch.Tensor) -> torch.Tensor:
        B, L, _ = x_BLD.shape
        H = self.n_heads
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BLD)))
        else:
            q = self.q_proj(x_BLD)
        q_BLHK = q.view(B, L, H, self.qk_dim)
        q_nope, q_rope = q_BLHK.split([self.nope_dim, self.rope_dim], dim=-1)
        q_rope = apply_rope(q_rope, cos_LR, sin_LR, self.interleave)

        kv_lat, k_rope = self.kv_a_proj_with_mqa(x_BLD).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        k_rope_BL1R = apply_rope(k_rope.unsqueeze(2), cos_LR, sin_LR, self.interleave)
        kv = self.kv_b_proj(self.kv_a_layernorm(kv_lat)).view(B, L, H, self.nope_dim + self.v_dim)
        k_nope, v_BLHV = kv.split([self.nope_dim, self.v_dim], dim=-1)

        # SDPA's fused kernels (CPU flash; CUDA flash, memory-efficient, cuDNN) need one head dim for q, k and v,
        # CUDA's memory-efficient one a multiple of 8 in 16-bit; otherwise SDPA falls back to the math kernel and its
        # B x H x L x L scores. Zero padding leaves QK^T unchanged and only adds output columns (sliced off); the
        # explicit scale keeps the real qk dim's.
        P = -(-max(self.qk_dim, self.v_dim) // 8) * 8
        q_BLHP = _pad_to(torch.cat([q_nope, q_rope], dim=-1), P)
        k_BLHP = _pad_to(torch.cat([k_nope, k_rope_BL1R.expand(B, L, H, self.rope_dim)], dim=-1), P)
        out = F.scaled_dot_product_attention(
            q_BLHP.transpose(1, 2), k_BLHP.transpose(1, 2), _pad_to(v_BLHV, P).transpose(1, 2),
            is_causal=True, scale=self.softmax_scale,
        )[..., : self.v_dim]  # (B, H, L, Dv)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, H * self.v_dim))


def _pad_to(x: torch.Tensor, size: int) -> torch.Tensor:
    """Zero-pad the last dim of ``x`` to ``size`` (``x`` itself when it already has that size)."""
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))
