"""Grouped-query attention of Qwen3 (transformers ``Qwen3MoeAttention``): q, k, v, o projections without bias, an
explicit head dim, a per-head RMSNorm of q and of k *before* rotate-half RoPE, softmax scale head_dim^-0.5, causal.

Shape legend: B batch, L sequence, D model dim, H query heads, G key/value heads, d head dim.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from moetrain.layout import RecomputeModule
from moetrain.model.config_base import ModelConfig
from moetrain.model.layers import Attention, Linear, RMSNorm, apply_rope
from moetrain.model.recompute import checkpointed


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
        if RecomputeModule.CORE_ATTN in self.recompute_modules:
            out_BHLd = checkpointed(self._sdpa, q_BLHd, k_BLGd, v_BLGd)
        else:
            out_BHLd = self._sdpa(q_BLHd, k_BLGd, v_BLGd)
        return self.o_proj(out_BHLd.transpose(1, 2).reshape(B, L, H * d))

    def _sdpa(self, q_BLHd: torch.Tensor, k_BLGd: torch.Tensor, v_BLGd: torch.Tensor) -> torch.Tensor:
        """The attention kernel -> (B, H, L, d); recomputed in the backward under ``core_attn``."""
        return F.scaled_dot_product_attention(q_BLHd.transpose(1, 2), k_BLGd.transpose(1, 2), v_BLGd.transpose(1, 2),
                                              is_causal=True, scale=self.head_dim ** -0.5,
                                              enable_gqa=self.n_kv_heads != self.n_heads)

    # -- decoding with a key/value cache (inference only; the training forward above is untouched) --------------
    def new_cache(self, batch: int, max_len: int, device: torch.device, dtype: torch.dtype) -> GQACache:
        """An empty :class:`GQACache` for ``batch`` sequences of up to ``max_len`` tokens (zeros)."""
        G, d = self.n_kv_heads, self.head_dim
        return GQACache(torch.zeros(batch, max_len, G, d, device=device, dtype=dtype),
                        torch.zeros(batch, max_len, G, d, device=device, dtype=dtype))

    def forward_cached(self, x_BLD: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor, cache: GQACache,
                       start: int) -> torch.Tensor:
        """The attention of L new tokens at positions ``start .. start+L-1`` over the ``start`` cached ones and
        themselves (causal), writing their normed, rotated keys and their values into ``cache``. Equals
        :meth:`forward` on the whole sequence at those positions, up to rounding.

        Args:
            x_BLD: the normed hidden states of the new tokens.
            cos, sin: the rotate-half RoPE rows of positions ``start .. start+L-1``.
            cache: this layer's cache, of room for at least ``start + L`` tokens.
            start: how many tokens the cache already holds.

        Returns:
            (B, L, D).
        """
        B, L, _ = x_BLD.shape
        H, G, d = self.n_heads, self.n_kv_heads, self.head_dim
        end = start + L
        q_BLHd = apply_rope(self.q_norm(self.q_proj(x_BLD).view(B, L, H, d)), cos, sin, interleave=False)
        cache.k_BTGd[:B, start:end] = apply_rope(self.k_norm(self.k_proj(x_BLD).view(B, L, G, d)), cos, sin,
                                                 interleave=False)
        cache.v_BTGd[:B, start:end] = self.v_proj(x_BLD).view(B, L, G, d)
        pos_L = torch.arange(start, end, device=x_BLD.device)
        visible_LT = torch.arange(end, device=x_BLD.device)[None, :] <= pos_L[:, None]
        out_BHLd = F.scaled_dot_product_attention(q_BLHd.transpose(1, 2), cache.k_BTGd[:B, :end].transpose(1, 2),
                                                  cache.v_BTGd[:B, :end].transpose(1, 2), attn_mask=visible_LT,
                                                  scale=d ** -0.5, enable_gqa=G != H)
        return self.o_proj(out_BHLd.transpose(1, 2).reshape(B, L, H * d))


@dataclass
class GQACache:
    """The decode cache of one grouped-query attention layer: per token and key/value head, the normed rotated key
    and the value (G heads, not H: the GQA saving).

    Attributes:
        k_BTGd: (B, T, G, d) keys after ``k_norm`` and RoPE; T is the room (max tokens).
        v_BTGd: (B, T, G, d) values.
    """

    k_BTGd: torch.Tensor
    v_BTGd: torch.Tensor

