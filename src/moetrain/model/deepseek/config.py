"""The DeepSeek-V3 architecture's config (also DeepSeek-V2 and Kimi-K2): Multi-head Latent Attention with YaRN RoPE,
DeepSeekMoE routing with expert groups, shared experts and auxiliary-loss-free balancing, MTP modules.

Sources: deepseek-ai/DeepSeek-V3 ``inference/configs/config_671B.json`` and the HF ``config.json`` of DeepSeek-V3,
DeepSeek-V2-Lite (see ``docs/reference.md`` section 2) and Kimi-K2 (section 15).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

from torch import nn

from moetrain.errors import ConfigError
from moetrain.model.config_base import ModelConfig, ModelFamily, Yarn, check_int
from moetrain.model.deepseek.attention import MLA


@dataclass
class DeepSeekV3Config(ModelConfig):
    """A DeepSeek-V3-architecture model; the defaults are the released DeepSeek-V3 (671B).

    Attributes, besides :class:`~moetrain.model.config_base.ModelConfig`'s:
        q_lora_rank: rank of the query compression; 0 means a plain query projection (V2-Lite).
        kv_lora_rank: rank of the joint key/value compression.
        qk_nope_head_dim: per-head dims of the non-rotary (content) part of queries and keys.
        qk_rope_head_dim: per-head dims of the decoupled rotary part (its key shared by all heads).
        v_head_dim: per-head dims of the values.
        rope_factor: YaRN scaling factor; 1.0 disables YaRN (plain RoPE).
        rope_beta_fast: YaRN ramp's high-frequency bound: rotary dims turning more often than this over the
            original context keep their frequency (arXiv 2309.00071).
        rope_beta_slow: YaRN ramp's low-frequency bound: dims turning fewer times are fully interpolated by
            rope_factor.
        rope_mscale: YaRN temperature numerator: cos/sin tables times mscale(factor, rope_mscale) /
            mscale(factor, rope_mscale_all_dim).
        rope_mscale_all_dim: YaRN softmax-scale coefficient: the attention scale times mscale(factor,
            rope_mscale_all_dim)^2, DeepSeek's variant.
        rope_original_seq_len: pre-training context of the YaRN ramp [original_max_position_embeddings].
        rope_interleave: rotary pairs are (x0,x1),(x2,x3)... as in the released weights; False = rotate-half pairs.
    """

    family = ModelFamily.DEEPSEEK_V3
    hf_model_type = "deepseek_v3"

    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_factor: float = 40.0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 1.0
    rope_original_seq_len: int = 4096
    rope_interleave: bool = True

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim", "v_head_dim", "rope_original_seq_len"):
            check_int(name, getattr(self, name), minimum=1)
        check_int("q_lora_rank", self.q_lora_rank, minimum=0)
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if self.rope_factor < 1.0:
            raise ConfigError(f"model.rope_factor={self.rope_factor} must be >= 1.0 (1.0 = plain RoPE, > 1 = YaRN)")

    @property
    def qk_head_dim(self) -> int:
        return self.qk_nope_head_dim + self.qk_rope_head_dim

    @property
    def softmax_scale(self) -> float:
        """Attention softmax scale: qk_head_dim^-0.5, times mscale(factor, mscale_all_dim)^2 under YaRN.

        For DeepSeek-V3: 192^-0.5 * (0.1 ln 40 + 1)^2 = 0.13523 (docs/reference.md section 2)."""
        scale = self.qk_head_dim ** -0.5
        if self.rope_factor > 1.0 and self.rope_mscale_all_dim:
            m = 0.1 * self.rope_mscale_all_dim * math.log(self.rope_factor) + 1.0
            scale *= m * m
        return scale

    # ---- hooks ---------------------------------------------------------------------------------------------
    @property
    def rope_dim(self) -> int:
        return self.qk_rope_head_dim

    @property
    def yarn(self) -> Yarn | None:
        if self.rope_factor <= 1.0:
            return None
        return Yarn(self.rope_factor, self.rope_original_seq_len, self.rope_beta_fast, self.rope_beta_slow,
                    self.rope_mscale, self.rope_mscale_all_dim)

    def build_attention(self) -> nn.Module:
        return MLA(self)

    def attention_params(self) -> int:
        """Parameters of one Multi-head Latent Attention block (projections + the two latent RMSNorm weights)."""
        H, D = self.n_heads, self.dim
        if self.q_lora_rank:
            q = D * self.q_lora_rank + self.q_lora_rank + self.q_lora_rank * H * self.qk_head_dim
        else:
            q = D * H * self.qk_head_dim
        kv = D * (self.kv_lora_rank + self.qk_rope_head_dim) + self.kv_lora_rank
        kv += self.kv_lora_rank * H * (self.qk_nope_head_dim + self.v_head_dim)
        o = H * self.v_head_dim * D
        return q + kv + o

    def attention_projection_flops_factor(self) -> int:
        """Megatron-Core's A_mla: multiply-adds per token of the MLA projections (docs/reference.md section 3).

        A_mla = q_lora*(h + n_h*(d_nope+d_rope) + 1) + kv_lora*(h + n_h*(d_nope+d_v) + 1) + h*d_rope + n_h*d_v*h,
        with the query term h*n_h*(d_nope+d_rope) when q_lora_rank is 0.
        """
        h, H = self.dim, self.n_heads
        if self.q_lora_rank:
            q = self.q_lora_rank * (h + H * self.qk_head_dim + 1)
        else:
            q = h * H * self.qk_head_dim
        kv = self.kv_lora_rank * (h + H * (self.qk_nope_head_dim + self.v_head_dim) + 1)
        return q + kv + h * self.qk_rope_head_dim + H * self.v_head_dim * h

    @property
    def attention_core_dims(self) -> tuple[int, int]:
        return self.n_heads * self.qk_head_dim, self.n_heads * self.v_head_dim
