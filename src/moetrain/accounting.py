"""Parameter counts and training FLOPs per token: the one place where these formulas live.

Used by ``moetrain count``, the trainer's TFLOP/s and MFU, and the performance model (``moetrain plan``), so that
every number the project prints is computed the same way.

Two FLOPs conventions are reported, always by name:

* ``megatron``: Megatron-Core ``num_floating_point_operations`` for MLA + MoE (REFERENCE.md section 3). This is the
  accounting behind the published 1,648 TFLOP/s per GPU record, so numbers computed with it compare to the record.
  Causal attention is counted at half the square; the router GEMM is not counted; MTP layers count as MoE layers.
* ``6n``: ``6 * N_active_nonembedding + 6 * n_layers * n_heads * (d_qk + d_v) * L`` -- the TorchTitan/PaLM style
  "6N + attention" estimate with the full (non-causal) attention square. It is larger than the Megatron number for
  long sequences; it is reported for comparison with tools that use it.

All counts are closed-form; nothing here allocates weights. ``tests/test_accounting.py`` checks the closed forms
against modules built on the meta device for every preset.
"""

from __future__ import annotations

from dataclasses import asdict, dataclass

from moetrain.model.config import ModelConfig


@dataclass(frozen=True)
class ParamCounts:
    """Parameter counts of a model (numbers of scalars, not bytes).

    Attributes:
        total: every parameter of the main model (embedding, head, all experts), MTP modules excluded.
        mtp: unique parameters of the MTP modules (they share the main model's embedding and head).
        total_with_mtp: total + mtp.
        active: parameters touched per token by the main model (top-k routed + shared experts), embedding included.
        active_nonembedding: active minus the input embedding (the output head stays in).
        embedding: input embedding. head: output head (0 when tied).
        attention_per_layer, dense_ffn_per_layer, expert: one MLA block, one dense FFN, one routed expert.
        moe_layer_total, moe_layer_active: one MoE FFN (router + experts + shared), all vs active per token.
    """

    total: int
    mtp: int
    total_with_mtp: int
    active: int
    active_nonembedding: int
    embedding: int
    head: int
    attention_per_layer: int
    dense_ffn_per_layer: int
    expert: int
    moe_layer_total: int
    moe_layer_active: int

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def attention_params(cfg: ModelConfig) -> int:
    """Parameters of one Multi-head Latent Attention block (projections + the two latent RMSNorm weights)."""
    H, D = cfg.n_heads, cfg.dim
    if cfg.q_lora_rank:
        q = D * cfg.q_lora_rank + cfg.q_lora_rank + cfg.q_lora_rank * H * cfg.qk_head_dim
    else:
        q = D * H * cfg.qk_head_dim
    kv = D * (cfg.kv_lora_rank + cfg.qk_rope_head_dim) + cfg.kv_lora_rank
    kv += cfg.kv_lora_rank * H * (cfg.qk_nope_head_dim + cfg.v_head_dim)
    o = H * cfg.v_head_dim * D
    return q + kv + o


def count_params(cfg: ModelConfig) -> ParamCounts:
    """Closed-form parameter counts of ``cfg`` (see :class:`ParamCounts`)."""
    D, V = cfg.dim, cfg.vocab_size
    attn = attention_params(cfg)
    norms = 2 * D
    dense_ffn = 3 * D * cfg.dense_ffn_dim
    expert = 3 * D * cfg.expert_ffn_dim
    router = cfg.n_routed_experts * D
    shared = cfg.n_shared_experts * expert
    moe_total = router + cfg.n_routed_experts * expert + shared
    moe_active = router + cfg.top_k * expert + shared
    embedding = V * D
    head = 0 if cfg.tie_embeddings else V * D
    final_norm = D

    n_dense, n_moe = cfg.n_dense_layers, cfg.n_moe_layers
    body_total = cfg.n_layers * (attn + norms) + n_dense * dense_ffn + n_moe * moe_total
    body_active = cfg.n_layers * (attn + norms) + n_dense * dense_ffn + n_moe * moe_active
    total = embedding + head + final_norm + body_total
    active = embedding + head + final_norm + body_active
    # One MTP module: enorm + hnorm + eh_proj (2D -> D) + one MoE block + its own output norm.
    mtp_one = 2 * D + 2 * D * D + (attn + norms + moe_total) + D
    mtp = cfg.mtp_depth * mtp_one
    return ParamCounts(
        total=total, mtp=mtp, total_with_mtp=total + mtp, active=active, active_nonembedding=active - embedding,
        embedding=embedding, head=head, attention_per_layer=attn, dense_ffn_per_layer=dense_ffn, expert=expert,
        moe_layer_total=moe_total, moe_layer_active=moe_active,
    )


@dataclass(frozen=True)
class FlopsPerToken:
    """Training FLOPs (forward + backward) per token at one sequence length.

    Attributes:
        megatron: Megatron-Core accounting (the record's), FLOP per token.
        six_n: 6 * N_active_nonembedding (MTP included) + full-square attention, FLOP per token.
        megatron_dense: the non-attention part of ``megatron`` (GEMMs of projections, FFNs, experts, head).
        megatron_attention: the attention-score part of ``megatron`` (grows linearly with seq_len).
        seq_len: the sequence length L used.
    """

    megatron: float
    six_n: float
    megatron_dense: float
    megatron_attention: float
    seq_len: int

    def to_dict(self) -> dict[str, float]:
        return asdict(self)


def mla_projection_flops_factor(cfg: ModelConfig) -> int:
    """Megatron-Core's A_mla: multiply-adds per token of the MLA projections (REFERENCE.md section 3).

    A_mla = q_lora*(h + n_h*(d_nope+d_rope) + 1) + kv_lora*(h + n_h*(d_nope+d_v) + 1) + h*d_rope + n_h*d_v*h,
    with the query term h*n_h*(d_nope+d_rope) when q_lora_rank is 0.
    """
    h, H = cfg.dim, cfg.n_heads
    if cfg.q_lora_rank:
        q = cfg.q_lora_rank * (h + H * cfg.qk_head_dim + 1)
    else:
        q = h * H * cfg.qk_head_dim
    kv = cfg.kv_lora_rank * (h + H * (cfg.qk_nope_head_dim + cfg.v_head_dim) + 1)
    return q + kv + h * cfg.qk_rope_head_dim + H * cfg.v_head_dim * h


def flops_per_token(cfg: ModelConfig, seq_len: int, mtp_depth: int | None = None) -> FlopsPerToken:
    """Training FLOPs per token for sequences of ``seq_len`` tokens.

    Args:
        cfg: the model.
        seq_len: tokens per sequence L (every sequence assumed this long).
        mtp_depth: MTP modules to count (default: ``cfg.mtp_depth``).

    Returns:
        :class:`FlopsPerToken`. For DeepSeek-V3 at L = 4096 with one MTP module, ``megatron`` is 260.0e9.

    Raises:
        ValueError: seq_len < 1.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    mtp = cfg.mtp_depth if mtp_depth is None else mtp_depth
    h, V = cfg.dim, cfg.vocab_size
    n_dense = cfg.n_dense_layers
    n_moe = cfg.n_moe_layers + mtp
    n_layers = cfg.n_layers + mtp
    f_shared = cfg.n_shared_experts * cfg.expert_ffn_dim
    ffn = h * (3 * cfg.dense_ffn_dim * n_dense + 3 * cfg.expert_ffn_dim * cfg.top_k * n_moe + 3 * f_shared * n_moe)
    dense = 6 * (ffn + n_layers * mla_projection_flops_factor(cfg) + mtp * (3 * h + 2 * h * h) + h * V * (mtp + 1))
    H = cfg.n_heads
    attn = 6 * n_layers * seq_len * (H * cfg.qk_head_dim / 2 + H * cfg.v_head_dim / 2)

    counts = count_params(cfg)
    per_mtp = counts.mtp // cfg.mtp_depth if cfg.mtp_depth else 0
    mtp_active = mtp * (per_mtp - (cfg.n_routed_experts - cfg.top_k) * counts.expert)
    six_n = 6 * (counts.active_nonembedding + mtp_active)
    six_n += 6 * n_layers * H * (cfg.qk_head_dim + cfg.v_head_dim) * seq_len
    return FlopsPerToken(megatron=dense + attn, six_n=float(six_n), megatron_dense=float(dense),
                         megatron_attention=float(attn), seq_len=seq_len)
