"""Parameter counts and training FLOPs per token: the one place where these formulas live.

Used by ``moetrain count``, the trainer's TFLOP/s and MFU, and the performance model (``moetrain plan``), so that
every number the project prints is computed the same way.

Two FLOPs conventions are reported, always by name:

* ``megatron``: Megatron-Core ``num_floating_point_operations`` for MLA + MoE (docs/reference.md section 3). This is the
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
        active_nonembedding: active minus the input embedding (the output head stays in; a tied one counts once).
        embedding: input embedding. head: output head (0 when tied).
        attention_per_layer, dense_ffn_per_layer, expert: one MLA block, one dense FFN, one routed expert.
        moe_layer_total, moe_layer_active: one MoE FFN (router + experts + shared), all vs active per token.
        active_without_router: ``active`` less the routers' weights, the count under which a published "active"
            figure may be given (Qwen3-30B-A3B's 3.3B: 3.340B without the routers, 3.353B with them).
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
    active_without_router: int = 0

    def to_dict(self) -> dict[str, int]:
        return asdict(self)


def attention_params(cfg: ModelConfig) -> int:
    """Parameters of one attention block of ``cfg``'s family (MLA: projections + the two latent RMSNorm weights;
    Qwen3 GQA: projections + the q/k norm weights): ``cfg.attention_params()``."""
    return cfg.attention_params()


def count_params(cfg: ModelConfig) -> ParamCounts:
    """Closed-form parameter counts of ``cfg`` (see :class:`ParamCounts`)."""
    D, V = cfg.dim, cfg.vocab_size
    attn = attention_params(cfg)
    norms = 2 * D
    dense_ffn = 3 * D * cfg.dense_ffn_dim
    expert = 3 * D * cfg.expert_ffn_dim
    router = cfg.n_routed_experts * D
    shared = 3 * D * cfg.shared_ffn_width
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
        # a tied head still runs its GEMM per token: the shared matrix counts once, as the head
        total=total, mtp=mtp, total_with_mtp=total + mtp, active=active,
        active_nonembedding=active - embedding if head else active,
        embedding=embedding, head=head, attention_per_layer=attn, dense_ffn_per_layer=dense_ffn, expert=expert,
        moe_layer_total=moe_total, moe_layer_active=moe_active, active_without_router=active - n_moe * router,
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
    """Megatron-Core's multiply-adds per token of one block's attention projections (docs/reference.md section 3):
    A_mla for MLA, h (n_h d + 2 n_kv d) + n_h d h for GQA: ``cfg.attention_projection_flops_factor()``."""
    return cfg.attention_projection_flops_factor()


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
    f_shared = cfg.shared_ffn_width
    ffn = h * (3 * cfg.dense_ffn_dim * n_dense + 3 * cfg.expert_ffn_dim * cfg.top_k * n_moe + 3 * f_shared * n_moe)
    dense = 6 * (ffn + n_layers * mla_projection_flops_factor(cfg) + mtp * (3 * h + 2 * h * h) + h * V * (mtp + 1))
    qk_width, v_width = cfg.attention_core_dims
    attn = 6 * n_layers * seq_len * (qk_width / 2 + v_width / 2)

    counts = count_params(cfg)
    per_mtp = counts.mtp // cfg.mtp_depth if cfg.mtp_depth else 0
    mtp_active = mtp * (per_mtp - (cfg.n_routed_experts - cfg.top_k) * counts.expert)
    six_n = 6 * (counts.active_nonembedding + mtp_active)
    six_n += 6 * n_layers * (qk_width + v_width) * seq_len
    return FlopsPerToken(megatron=dense + attn, six_n=float(six_n), megatron_dense=float(dense),
                         megatron_attention=float(attn), seq_len=seq_len)


@dataclass(frozen=True)
class FlopsBreakdown:
    """Megatron-convention training FLOPs per token, split by component (forward + backward, factor 6 included).

    Per-layer entries are for ONE layer of that kind; ``total`` is the whole model (MTP modules counted as extra
    MoE layers, as in :func:`flops_per_token`) and equals ``flops_per_token(...).megatron`` (a test holds this).

    Attributes:
        attn_proj: attention projections of one layer (MLA: A_mla; GQA: q,k,v,o).
        attn_core: attention scores and weighted values of one layer (causal half), grows with seq_len.
        dense_ffn: one dense SwiGLU FFN. routed: the top-k routed experts of one MoE layer.
        shared: the shared expert(s) of one MoE layer. mtp_extra: eh_proj and norms of one MTP module.
        head: one output-head GEMM (the main head; each MTP module adds one more).
        n_dense, n_moe, n_layers, n_heads_out: counts (MTP included in n_moe, n_layers; n_heads_out = mtp + 1).
        mtp_depth: MTP modules counted. seq_len: the L used.
    """

    attn_proj: float
    attn_core: float
    dense_ffn: float
    routed: float
    shared: float
    mtp_extra: float
    head: float
    n_dense: int
    n_moe: int
    n_layers: int
    n_heads_out: int
    mtp_depth: int
    seq_len: int

    @property
    def total(self) -> float:
        return (self.n_dense * self.dense_ffn + self.n_moe * (self.routed + self.shared)
                + self.n_layers * (self.attn_proj + self.attn_core) + self.mtp_depth * self.mtp_extra
                + self.n_heads_out * self.head)

    def to_dict(self) -> dict[str, float]:
        d = asdict(self)
        d["total"] = self.total
        return d


def flops_breakdown(cfg: ModelConfig, seq_len: int, mtp_depth: int | None = None) -> FlopsBreakdown:
    """Per-component Megatron FLOPs per token of ``cfg`` (any family: MLA or GQA attention through the config's
    hooks) at sequence length ``seq_len``; the components sum to the ``megatron`` figure.

    Raises:
        ValueError: seq_len < 1.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    h, V = cfg.dim, cfg.vocab_size
    mtp = cfg.mtp_depth if mtp_depth is None else mtp_depth
    proj = 6.0 * mla_projection_flops_factor(cfg)
    qk_width, v_width = cfg.attention_core_dims
    core = 6.0 * seq_len * (qk_width / 2 + v_width / 2)
    f_shared = cfg.shared_ffn_width
    return FlopsBreakdown(
        attn_proj=proj, attn_core=core,
        dense_ffn=6.0 * 3 * h * cfg.dense_ffn_dim,
        routed=6.0 * 3 * h * cfg.expert_ffn_dim * cfg.top_k,
        shared=6.0 * 3 * h * f_shared,
        mtp_extra=6.0 * (3 * h + 2 * h * h),
        head=6.0 * h * V,
        n_dense=cfg.n_dense_layers, n_moe=cfg.n_layers - cfg.n_dense_layers + mtp, n_layers=cfg.n_layers + mtp,
        n_heads_out=mtp + 1, mtp_depth=mtp, seq_len=seq_len,
    )
