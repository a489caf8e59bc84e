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
        active_nonembedding: active minus the input embedding (the output head stays in).
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
    f_shared = cfg.n_shared_experts * cfg.expert_ffn_dim
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


# ---- grouped-query-attention MoE models (Mixtral / Qwen-MoE style), for the performance model -----------------

@dataclass(frozen=True)
class GQAMoEConfig:
    """Shape of a MoE transformer with grouped-query attention (Mixtral, Qwen2/3-MoE, ...), enough for accounting.

    Not a trainable moetrain model (moetrain trains the DeepSeek-V3 architecture); ``moetrain plan`` uses it to
    predict other MoE transformers "structurally". Built from a HF ``config.json`` by
    :func:`moetrain.plan.shape.shape_from_hf_config`.

    Attributes:
        vocab_size, dim, n_layers: V, hidden size h, decoder layers.
        n_heads, n_kv_heads, head_dim: query heads, key/value heads (GQA groups), per-head dim d.
        n_dense_layers: layers with a dense FFN of width ``dense_ffn_dim`` (counted as the first ones).
        expert_ffn_dim: width F of one routed expert; n_routed_experts E; top_k k.
        shared_ffn_dim: total width of the shared expert(s) of each MoE layer (0 = none; Qwen2-MoE: 5632).
        qkv_bias: q/k/v projections carry a bias (Qwen2); adds parameters, no Megatron-counted FLOPs.
        qk_norm: per-head RMSNorm of q and k (Qwen3); parameters only.
        tie_embeddings: the output head shares the embedding.
        max_seq_len: longest sequence the model is built for.
        name: a label for reports.
    """

    vocab_size: int
    dim: int
    n_layers: int
    n_heads: int
    n_kv_heads: int
    head_dim: int
    expert_ffn_dim: int
    n_routed_experts: int
    top_k: int
    n_dense_layers: int = 0
    dense_ffn_dim: int = 0
    shared_ffn_dim: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False
    tie_embeddings: bool = False
    max_seq_len: int = 32_768
    name: str = "gqa-moe"

    def __post_init__(self) -> None:
        for f in ("vocab_size", "dim", "n_layers", "n_heads", "n_kv_heads", "head_dim", "expert_ffn_dim",
                  "n_routed_experts", "top_k", "max_seq_len"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ValueError(f"{f}={v!r} must be an integer >= 1")
        for f in ("n_dense_layers", "dense_ffn_dim", "shared_ffn_dim"):
            v = getattr(self, f)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"{f}={v!r} must be an integer >= 0")
        if self.n_heads % self.n_kv_heads:
            raise ValueError(f"n_kv_heads={self.n_kv_heads} must divide n_heads={self.n_heads}")
        if self.top_k > self.n_routed_experts:
            raise ValueError(f"top_k={self.top_k} must be <= n_routed_experts={self.n_routed_experts}")
        if self.n_dense_layers > self.n_layers:
            raise ValueError(f"n_dense_layers={self.n_dense_layers} must be <= n_layers={self.n_layers}")
        if self.n_dense_layers and not self.dense_ffn_dim:
            raise ValueError("dense_ffn_dim must be > 0 when n_dense_layers > 0")

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers


def gqa_attention_params(cfg: GQAMoEConfig) -> int:
    """Parameters of one grouped-query attention block: q, k, v, o projections (+ q/k/v biases, + q/k norms)."""
    D, H, G, d = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    p = D * (H * d + 2 * G * d) + H * d * D
    if cfg.qkv_bias:
        p += H * d + 2 * G * d
    if cfg.qk_norm:
        p += 2 * d
    return p


def gqa_attention_projection_flops_factor(cfg: GQAMoEConfig) -> int:
    """Multiply-adds per token of the GQA projections, as Megatron counts them: h*(q + k + v) + q*h."""
    D, H, G, d = cfg.dim, cfg.n_heads, cfg.n_kv_heads, cfg.head_dim
    return D * (H * d + 2 * G * d) + H * d * D


def count_params_gqa(cfg: GQAMoEConfig) -> ParamCounts:
    """Closed-form parameter counts of a GQA MoE model (same fields as :func:`count_params`; ``mtp`` is 0)."""
    D, V = cfg.dim, cfg.vocab_size
    attn = gqa_attention_params(cfg)
    norms = 2 * D
    dense_ffn = 3 * D * cfg.dense_ffn_dim
    expert = 3 * D * cfg.expert_ffn_dim
    router = cfg.n_routed_experts * D
    shared = 3 * D * cfg.shared_ffn_dim
    moe_total = router + cfg.n_routed_experts * expert + shared
    moe_active = router + cfg.top_k * expert + shared
    embedding = V * D
    head = 0 if cfg.tie_embeddings else V * D
    n_dense, n_moe = cfg.n_dense_layers, cfg.n_moe_layers
    body_total = cfg.n_layers * (attn + norms) + n_dense * dense_ffn + n_moe * moe_total
    body_active = cfg.n_layers * (attn + norms) + n_dense * dense_ffn + n_moe * moe_active
    total = embedding + head + D + body_total
    active = embedding + head + D + body_active
    return ParamCounts(
        total=total, mtp=0, total_with_mtp=total, active=active,
        active_nonembedding=active - embedding if head else active,
        embedding=embedding, head=head, attention_per_layer=attn, dense_ffn_per_layer=dense_ffn, expert=expert,
        moe_layer_total=moe_total, moe_layer_active=moe_active,
    )


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


def flops_breakdown(cfg: "ModelConfig | GQAMoEConfig", seq_len: int, mtp_depth: int | None = None) -> FlopsBreakdown:
    """Per-component Megatron FLOPs per token of ``cfg`` (a DeepSeek-V3 :class:`ModelConfig` or a
    :class:`GQAMoEConfig`) at sequence length ``seq_len``; the components sum to the ``megatron`` figure.

    Raises:
        ValueError: seq_len < 1.
    """
    if seq_len < 1:
        raise ValueError(f"seq_len={seq_len} must be >= 1")
    h, V = cfg.dim, cfg.vocab_size
    if isinstance(cfg, GQAMoEConfig):
        mtp = 0 if mtp_depth is None else mtp_depth
        if mtp:
            raise ValueError("GQA models have no MTP modules; mtp_depth must be 0")
        proj = 6.0 * gqa_attention_projection_flops_factor(cfg)
        core = 6.0 * cfg.n_heads * cfg.head_dim * seq_len  # QK^T and AV, each q_size * L / 2
        f_shared = cfg.shared_ffn_dim
    else:
        mtp = cfg.mtp_depth if mtp_depth is None else mtp_depth
        proj = 6.0 * mla_projection_flops_factor(cfg)
        qk_width, v_width = cfg.attention_core_dims
        core = 6.0 * seq_len * (qk_width / 2 + v_width / 2)
        f_shared = cfg.n_shared_experts * cfg.expert_ffn_dim
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


def flops_per_token_gqa(cfg: GQAMoEConfig, seq_len: int) -> FlopsPerToken:
    """Training FLOPs per token of a GQA MoE model: Megatron's ``num_floating_point_operations`` (MHA/GQA branch,
    SwiGLU, causal half-square attention) and the 6N + full-square-attention estimate.

    Raises:
        ValueError: seq_len < 1.
    """
    b = flops_breakdown(cfg, seq_len)
    dense = b.total - b.n_layers * b.attn_core
    counts = count_params_gqa(cfg)
    six_n = 6 * counts.active_nonembedding + 6 * cfg.n_layers * cfg.n_heads * 2 * cfg.head_dim * seq_len
    return FlopsPerToken(megatron=b.total, six_n=float(six_n), megatron_dense=float(dense),
                         megatron_attention=float(b.n_layers * b.attn_core), seq_len=seq_len)
