"""Multi-head Latent Attention (DeepSeek-V2, arXiv 2405.04434, section 2.1; used unchanged in DeepSeek-V3).

Queries go through a low-rank compression (q_lora_rank; 0 = plain projection), keys and values through a joint
latent of rank kv_lora_rank, and a decoupled rotary key of qk_rope_head_dim is shared by all heads. This is the
training ("naive") form: the latent is expanded to per-head keys and values, as in HF ``DeepseekV3Attention``.

Shape legend: B batch, L sequence, D model dim, H heads, Cq q_lora_rank, Ckv kv_lora_rank, Dn qk_nope_head_dim,
R qk_rope_head_dim, Dv v_head_dim.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

import torch
import torch.nn.functional as F
from torch import nn

from moetrain.layout import RecomputeModule
from moetrain.model.config_base import ModelConfig
from moetrain.model.layers import Attention, Linear, RMSNorm, apply_rope
from moetrain.model.recompute import DroppedOutputs, checkpointed


# The latent norms use a fixed epsilon in DeepSeek's reference code and in HF, whatever rms_norm_eps says.
LATENT_NORM_EPS = 1e-6


class MLA(Attention):
    """Multi-head Latent Attention with causal masking over the whole (packed) sequence.

    Args:
        cfg: a :class:`~moetrain.model.deepseek.config.DeepSeekV3Config` (n_heads, q_lora_rank, kv_lora_rank, head
            dims, rope_interleave, softmax_scale); typed by the common base, which that module imports this one.

    forward(x_BLD, cos_LR, sin_LR) -> (B, L, D). Weight names match the released checkpoint (``q_a_proj`` ...).
    new_cache / forward_cached: decoding over a cache of the compressed latents (inference; :meth:`forward_cached`).
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
        rc = self.recompute_modules
        # the down-projections: the compressed latents (kept under every recompute)
        q_lat = self.q_a_proj(x_BLD) if self.q_lora_rank else x_BLD
        kv_lat, k_rope = self.kv_a_proj_with_mqa(x_BLD).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        if RecomputeModule.MLA_UP_PROJ not in rc:
            q_BLHP, k_BLHP, v_BLHP = self._up_proj(q_lat, kv_lat, k_rope, cos_LR, sin_LR)
            out = self._core(q_BLHP, k_BLHP, v_BLHP)
        else:
            # Megatron ``mla_up_proj``: the up-projected q / k / v and everything built from them are not kept;
            # the backward recomputes them once from the latents
            with DroppedOutputs(lambda: self._up_proj(q_lat, kv_lat, k_rope, cos_LR, sin_LR, every=True)) as drop:
                q_BLHP, k_BLHP, v_BLHP = self._up_proj(q_lat, kv_lat, k_rope, cos_LR, sin_LR, keep=drop.add)
                out = self._core(q_BLHP, k_BLHP, v_BLHP)
        return self.o_proj(out.transpose(1, 2).reshape(B, L, self.n_heads * self.v_dim))

    def _up_proj(self, q_lat: torch.Tensor, kv_lat: torch.Tensor, k_rope: torch.Tensor, cos_LR: torch.Tensor,
                 sin_LR: torch.Tensor, keep: Callable[[torch.Tensor], torch.Tensor] | None = None,
                 every: bool = False) -> tuple[torch.Tensor, ...]:
        """Latents -> the padded (B, L, H, P) q, k, v the attention kernel reads. ``keep``: called on every tensor
        the up-projection produces that a later step saves (under ``mla_up_proj``: dropped, recomputed); ``every``:
        return all those tensors, in that order, instead (the recomputation)."""
        B, L, _ = kv_lat.shape
        H = self.n_heads
        made: list[torch.Tensor] = []

        def mark(t: torch.Tensor) -> torch.Tensor:
            made.append(t)
            return keep(t) if keep is not None else t

        q = mark(self.q_b_proj(self.q_a_layernorm(q_lat)) if self.q_lora_rank else self.q_proj(q_lat))
        q_nope, q_rope = q.view(B, L, H, self.qk_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        q_rope = apply_rope(q_rope, cos_LR, sin_LR, self.interleave)
        k_rope_BL1R = apply_rope(k_rope.unsqueeze(2), cos_LR, sin_LR, self.interleave)
        kv = mark(self.kv_b_proj(self.kv_a_layernorm(kv_lat))).view(B, L, H, self.nope_dim + self.v_dim)
        k_nope, v_BLHV = kv.split([self.nope_dim, self.v_dim], dim=-1)
        # SDPA's fused kernels (CPU flash; CUDA flash, memory-efficient, cuDNN) need one head dim for q, k and v,
        # CUDA's memory-efficient one a multiple of 8 in 16-bit; otherwise SDPA falls back to the math kernel and its
        # B x H x L x L scores. Zero padding leaves QK^T unchanged and only adds output columns (sliced off); the
        # explicit scale keeps the real qk dim's.
        P = -(-max(self.qk_dim, self.v_dim) // 8) * 8
        q_BLHP = mark(_pad_to(torch.cat([q_nope, q_rope], dim=-1), P))
        k_BLHP = mark(_pad_to(torch.cat([k_nope, k_rope_BL1R.expand(B, L, H, self.rope_dim)], dim=-1), P))
        v_BLHP = mark(_pad_to(v_BLHV, P))
        return tuple(made) if every else (q_BLHP, k_BLHP, v_BLHP)

    def _core(self, q_BLHP: torch.Tensor, k_BLHP: torch.Tensor, v_BLHP: torch.Tensor) -> torch.Tensor:
        """The attention kernel -> (B, H, L, Dv); recomputed in the backward under ``core_attn``."""
        if RecomputeModule.CORE_ATTN in self.recompute_modules:
            return checkpointed(self._sdpa, q_BLHP, k_BLHP, v_BLHP)
        return self._sdpa(q_BLHP, k_BLHP, v_BLHP)

    def _sdpa(self, q_BLHP: torch.Tensor, k_BLHP: torch.Tensor, v_BLHP: torch.Tensor) -> torch.Tensor:
        return F.scaled_dot_product_attention(q_BLHP.transpose(1, 2), k_BLHP.transpose(1, 2), v_BLHP.transpose(1, 2),
                                              is_causal=True, scale=self.softmax_scale)[..., : self.v_dim]

    # -- decoding with a cache of the compressed latents (inference only; the training forward above is untouched) --
    def new_cache(self, batch: int, max_len: int, device: torch.device, dtype: torch.dtype) -> MLACache:
        """An empty :class:`MLACache` for ``batch`` sequences of up to ``max_len`` tokens (zeros)."""
        return MLACache(torch.zeros(batch, max_len, self.kv_lora_rank, device=device, dtype=dtype),
                        torch.zeros(batch, max_len, self.rope_dim, device=device, dtype=dtype))

    def forward_cached(self, x_BLD: torch.Tensor, cos_LR: torch.Tensor, sin_LR: torch.Tensor, cache: MLACache,
                       start: int) -> torch.Tensor:
        """The attention of L new tokens at positions ``start .. start+L-1`` over the ``start`` cached ones and
        themselves (causal), writing their latents into ``cache``. Equals :meth:`forward` on the whole sequence at
        those positions, up to rounding.

        The "absorb" form of DeepSeek's inference code (deepseek-ai/DeepSeek-V3 ``inference/model.py``, MLA): the
        cache holds per token only the normed latent c_kv (Ckv) and the rotated shared key k_rope (R), not per-head
        keys and values; kv_b_proj's key half is folded into the query, q_nope W_uk -> (Ckv) per head, and its value
        half applied after the weighted sum of latents, so scores are q_lat . c_kv + q_rope . k_rope.

        Args:
            x_BLD: the normed hidden states of the new tokens.
            cos_LR, sin_LR: the RoPE rows of positions ``start .. start+L-1`` (``rope_cos_sin`` sliced).
            cache: this layer's cache, of room for at least ``start + L`` tokens.
            start: how many tokens the cache already holds (their positions are 0 .. start-1).

        Returns:
            (B, L, D).
        """
        B, L, _ = x_BLD.shape
        H, end = self.n_heads, start + L
        if self.q_lora_rank:
            q = self.q_b_proj(self.q_a_layernorm(self.q_a_proj(x_BLD)))
        else:
            q = self.q_proj(x_BLD)
        q_nope, q_rope = q.view(B, L, H, self.qk_dim).split([self.nope_dim, self.rope_dim], dim=-1)
        q_rope_BLHR = apply_rope(q_rope, cos_LR, sin_LR, self.interleave)
        kv_lat, k_rope = self.kv_a_proj_with_mqa(x_BLD).split([self.kv_lora_rank, self.rope_dim], dim=-1)
        cache.kv_BTC[:B, start:end] = self.kv_a_layernorm(kv_lat)
        cache.k_rope_BTR[:B, start:end] = apply_rope(k_rope.unsqueeze(2), cos_LR, sin_LR, self.interleave).squeeze(2)
        kv_BTC, k_rope_BTR = cache.kv_BTC[:B, :end], cache.k_rope_BTR[:B, :end]

        w_HKC = self.kv_b_proj.weight.view(H, self.nope_dim + self.v_dim, self.kv_lora_rank)
        q_lat_BLHC = torch.einsum("blhd,hdc->blhc", q_nope, w_HKC[:, : self.nope_dim])
        scores_BLHT = (torch.einsum("blhc,btc->blht", q_lat_BLHC, kv_BTC)
                       + torch.einsum("blhr,btr->blht", q_rope_BLHR, k_rope_BTR)) * self.softmax_scale
        pos_L = torch.arange(start, end, device=x_BLD.device)
        future_LT = torch.arange(end, device=x_BLD.device)[None, :] > pos_L[:, None]
        scores_BLHT = scores_BLHT.masked_fill(future_LT[None, :, None, :], float("-inf"))
        probs_BLHT = scores_BLHT.float().softmax(dim=-1).to(kv_BTC.dtype)
        o_BLHC = torch.einsum("blht,btc->blhc", probs_BLHT, kv_BTC)
        o_BLHV = torch.einsum("blhc,hvc->blhv", o_BLHC, w_HKC[:, self.nope_dim:])
        return self.o_proj(o_BLHV.reshape(B, L, H * self.v_dim))


@dataclass
class MLACache:
    """The decode cache of one MLA layer: per token, the compressed latent after its norm and the rotated shared
    rope key -- (Ckv + R) numbers instead of H * (Dn + R + Dv) per-head keys and values (DeepSeek-V2, sec. 2.1.2).

    Attributes:
        kv_BTC: (B, T, Ckv) ``kv_a_layernorm(c_kv)`` of each cached position; T is the room (max tokens).
        k_rope_BTR: (B, T, R) the rotated decoupled key of each cached position.
    """

    kv_BTC: torch.Tensor
    k_rope_BTR: torch.Tensor


def _pad_to(x: torch.Tensor, size: int) -> torch.Tensor:
    """Zero-pad the last dim of ``x`` to ``size`` (``x`` itself when it already has that size)."""
    return x if x.shape[-1] == size else F.pad(x, (0, size - x.shape[-1]))
