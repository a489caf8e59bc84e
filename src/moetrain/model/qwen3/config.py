"""The Qwen3-MoE architecture's config (transformers ``qwen3_moe``): grouped-query attention with per-head q/k
RMSNorm and rotate-half RoPE, a softmax router over all experts with top-k renormalisation, no shared expert, no
expert bias, the global-batch balance loss.

Sources: the ``config.json`` of Qwen/Qwen3-30B-A3B and Qwen/Qwen3-235B-A22B, and transformers'
``models/qwen3_moe/modeling_qwen3_moe.py`` (docs/reference.md section 15).
"""

from __future__ import annotations

from dataclasses import dataclass

from torch import nn

from moetrain.errors import ConfigError
from moetrain.model.config_base import BalanceLoss, ModelConfig, ModelFamily, RoutingMode, ScoreFunc, check_int
from moetrain.model.qwen3.attention import GQA


@dataclass
class Qwen3MoeConfig(ModelConfig):
    """A Qwen3-MoE model; the defaults are the released Qwen3-30B-A3B. The common fields' defaults follow Qwen3:
    softmax router, one expert group, no shared expert, route scale 1, no expert-bias balancing, no MTP, balance
    loss coefficient 1e-3 [router_aux_loss_coef] over the global batch.

    Attributes, besides :class:`~moetrain.model.config_base.ModelConfig`'s:
        n_kv_heads: key/value heads G (GQA groups; H % G == 0) [num_key_value_heads].
        head_dim: per-head dim d of queries, keys and values (explicit, not D / H) [head_dim].
        qk_norm: per-head RMSNorm of q and k before RoPE (Qwen3). False, and ``qkv_bias``, describe other GQA MoE
            architectures (Qwen2-MoE, Mixtral, ...) that ``moetrain plan`` predicts but moetrain does not train.
        qkv_bias: the q/k/v projections carry a bias (Qwen2) [attention_bias].
        shared_ffn_dim: a shared expert of this width besides ``n_shared_experts`` (Qwen2-MoE: 5632), for
            ``moetrain plan`` like ``qkv_bias``; Qwen3 has none.
    """

    family = ModelFamily.QWEN3_MOE
    hf_model_type = "qwen3_moe"

    vocab_size: int = 151_936
    dim: int = 2048
    n_layers: int = 48
    n_dense_layers: int = 0
    dense_ffn_dim: int = 6144
    expert_ffn_dim: int = 768
    n_routed_experts: int = 128
    n_shared_experts: int = 0
    top_k: int = 8
    n_expert_groups: int = 1
    n_limited_groups: int = 1
    score_func: ScoreFunc = "softmax"
    norm_topk: bool = True
    route_scale: float = 1.0
    n_heads: int = 32
    rope_theta: float = 1_000_000.0
    max_seq_len: int = 40_960
    norm_eps: float = 1e-6
    init_std: float = 0.02
    mtp_depth: int = 0
    tie_embeddings: bool = False
    balance_loss_alpha: float = 1e-3
    mtp_loss_weight: float = 0.3
    bias_update_rate: float = 0.0
    routing: RoutingMode = "learned"
    balance_loss: BalanceLoss = BalanceLoss.GLOBAL_BATCH
    n_kv_heads: int = 4
    head_dim: int = 128
    qk_norm: bool = True
    qkv_bias: bool = False
    shared_ffn_dim: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        check_int("n_kv_heads", self.n_kv_heads, minimum=1)
        check_int("head_dim", self.head_dim, minimum=2)
        check_int("shared_ffn_dim", self.shared_ffn_dim, minimum=0)
        if self.n_heads % self.n_kv_heads:
            divisors = [d for d in range(1, self.n_heads + 1) if self.n_heads % d == 0]
            raise ConfigError(f"model.n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads} (grouped-query "
                              f"attention); allowed: {divisors}")
        if self.head_dim % 2:
            raise ConfigError(f"model.head_dim={self.head_dim} must be even (RoPE rotates pairs)")
        if self.mtp_depth:
            raise ConfigError(f"model.mtp_depth={self.mtp_depth}: Qwen3-MoE has no multi-token prediction (the "
                              "qwen3_moe checkpoint layout has no MTP modules, so a run could not be exported); "
                              "set model.mtp_depth=0")

    # ---- hooks ---------------------------------------------------------------------------------------------
    @property
    def rope_dim(self) -> int:
        return self.head_dim

    def build_attention(self) -> nn.Module:
        """Qwen3's grouped-query attention.

        Raises:
            ConfigError: ``qkv_bias``, no ``qk_norm`` or a ``shared_ffn_dim`` (other GQA MoE architectures, which
                ``moetrain plan`` predicts but moetrain does not build)."""
        if self.qkv_bias or not self.qk_norm or self.shared_ffn_dim:
            raise ConfigError(f"model.qkv_bias={self.qkv_bias}, model.qk_norm={self.qk_norm}, model.shared_ffn_dim="
                              f"{self.shared_ffn_dim}: moetrain builds Qwen3-MoE (no q/k/v bias, per-head q/k norm, "
                              "no shared expert); this shape is for `moetrain plan` only; set model.qkv_bias=false, "
                              "model.qk_norm=true and model.shared_ffn_dim=0 to train it")
        return GQA(self)

    def attention_params(self) -> int:
        """q, k, v, o projections (H d + 2 G d outputs from D; H d -> D), + q/k/v biases, + the two d-wide q/k
        norm weights."""
        D, H, G, d = self.dim, self.n_heads, self.n_kv_heads, self.head_dim
        p = D * (H * d + 2 * G * d) + H * d * D
        if self.qkv_bias:
            p += H * d + 2 * G * d
        if self.qk_norm:
            p += 2 * d
        return p

    def attention_projection_flops_factor(self) -> int:
        """Multiply-adds per token of the GQA projections as Megatron-Core counts them (docs/reference.md section 3,
        ``num_floating_point_operations``' standard self-attention term):
        h (n_h d + 2 n_kv d) for q, k, v and n_h d h for the output; biases and norms are not counted."""
        D, H, G, d = self.dim, self.n_heads, self.n_kv_heads, self.head_dim
        return D * (H * d + 2 * G * d) + H * d * D

    @property
    def shared_ffn_width(self) -> int:
        return self.n_shared_experts * self.expert_ffn_dim + self.shared_ffn_dim

    @property
    def attention_core_dims(self) -> tuple[int, int]:
        return self.n_heads * self.head_dim, self.n_heads * self.head_dim
