"""Grouped-query attention of Qwen3 (transformers ``Qwen3MoeAttention``): q, k, v, o projections without bias, an
explicit head dim, a per-head RMSNorm of q and of k *before* rotate-half RoPE, softmax scale head_dim^-0.5, causal.

Shape legend: B batch, L sequence, D model dim, H query heads, G key/value heads, d head dim.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from moetrain.model.config_base import ModelConfig
from moetrain.model.layers import Attention, Linear, RMSNorm, apply_rope


class GQA(Attention):
    """Qwen3 grouped-query attention; weight names match the released checkpoint (``q_proj``, ``q_norm`` ...).

    Args:
        cfg: a :class:`~moetrain.model.qwen3.config.Qwen3MoeConfig` (n_heads, n_kv_heads, head_dim, norm_eps); typed
            by the common base, which that module imports this one.

    forward(x_BLD, cos_Ld2, sin_Ld2) -> (B, L, D); the RoPE tables are rotate-half tables of the head dim.
    """

    #: The projections FP8 training runs in FP8 (``moetrain.precision.apply``); the core stays high precision.
    projections = ("q_proj", "k_proj", "v_proj", "o_proj")

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
        H, G, d = self.n_heads, self.n_kv_heads, self.head_dim
        self.q_proj = Linear(cfg.dim, H * d, bias=False)
        self.k_proj = Linear(cfg.dim, G * d, bias=False)
        self.v_proj = Linear(cfg.dim, G * d, bias=False)
        self.o_proj = Linear(H * d, cfg.dim, bias=False)
        self.q_norm = RMSNorm(d, cfg.norm_eps)
        self.k_norm = RMSNorm(d, cfg.norm_eps)

    def forward(self, x_BLD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
        B, L, _ = x_BLD.shape
        H, G, d = self.n_heads, self.n_kv_heads, self.head_dim
        q_BLHd = apply_rope(self.q_norm(self.q_proj(x_BLD).view(B, L, H, d)), cos, sin, interleave=False)
        k_BLGd = apply_rope(self.k_norm(self.k_proj(x_BLD).view(B, L, G, d)), cos, sin, interleave=False)
        v_BLGd = self.v_proj(x_BLD).view(B, L, G, d)
        out_BHLd = F.scaled_dot_product_attention(q_BLHd.transpose(1, 2), k_BLGd.transpose(1, 2),
                                                  v_BLGd.transpose(1, 2), is_causal=True, scale=d ** -0.5,
                                                  enable_gqa=G != H)
        return self.o_proj(out_BHLd.transpose(1, 2).reshape(B, L, H * d))
