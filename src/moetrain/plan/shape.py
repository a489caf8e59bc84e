"""The model as the performance model sees it: sizes, parameters per component, FLOPs per component.

A :class:`ModelShape` wraps a model config, the trainer's own type: a
:class:`~moetrain.model.deepseek.config.DeepSeekV3Config` (multi-head latent attention) or a
:class:`~moetrain.model.qwen3.config.Qwen3MoeConfig` (grouped-query attention: Qwen3-MoE, and, with its planner-only
fields ``qkv_bias`` / ``qk_norm`` / ``shared_ffn_dim``, Mixtral, Qwen2-MoE, ... predicted structurally). All
FLOPs and parameter counts come from :mod:`moetrain.accounting` -- the same functions ``moetrain count`` uses -- so
the TFLOP/s this package predicts are the TFLOP/s the trainer would report.

On top of accounting, this module knows the *intermediate tensor sizes* of a layer (per token), which the cost
model needs for activation memory and for the memory-bound (non-GEMM) traffic; they are derived from the shape,
never fitted.
"""

from __future__ import annotations

import json
import os
from dataclasses import dataclass, field
from functools import cached_property
from pathlib import Path
from typing import Any

from moetrain.accounting import FlopsBreakdown, ParamCounts, count_params, flops_breakdown, flops_per_token
from moetrain.model.config import PRESETS, ConfigError, DeepSeekV3Config, ModelConfig, Qwen3MoeConfig, get_preset
from moetrain.model.registry import supported_model_types

AnyConfig = ModelConfig


class ShapeError(ValueError):
    """A model could not be read (unknown preset, unreadable or unsupported config.json)."""


@dataclass(frozen=True)
class ModelShape:
    """Sizes of a MoE transformer used by the cost model.

    Attributes:
        name: label for reports.
        config: the underlying model config (DeepSeekV3Config or Qwen3MoeConfig).
        attention: "mla" or "gqa".
        vocab, dim, n_layers, n_dense_layers, mtp_depth: V, h, decoder layers, dense layers, MTP modules.
        dense_ffn, expert_ffn, shared_ffn: widths of the dense FFN, of one routed expert, of all shared experts.
        n_experts, top_k: routed experts E and experts per token k.
        n_expert_groups, n_limited_groups: group-limited routing (1, 1 = none).
        n_heads, n_kv_heads: query heads, key/value heads (MLA: n_kv_heads = n_heads after the up-projection).
        qk_head_dim, v_head_dim: per-head q/k and v dims (MLA: nope + rope, and v).
        q_lora, kv_lora, qk_rope: MLA latent ranks and the rotary dim (0 for GQA).
        tie_embeddings: head shares the embedding.
    """

    name: str
    config: AnyConfig = field(repr=False, compare=False)
    attention: str
    vocab: int
    dim: int
    n_layers: int
    n_dense_layers: int
    mtp_depth: int
    dense_ffn: int
    expert_ffn: int
    shared_ffn: int
    n_experts: int
    top_k: int
    n_expert_groups: int
    n_limited_groups: int
    n_heads: int
    n_kv_heads: int
    qk_head_dim: int
    v_head_dim: int
    q_lora: int
    kv_lora: int
    qk_rope: int
    tie_embeddings: bool

    # ---- accounting (single source: moetrain.accounting) ----------------------------------------------------
    @cached_property
    def params(self) -> ParamCounts:
        return count_params(self.config)

    def flops(self, seq_len: int) -> FlopsBreakdown:
        """Per-component Megatron FLOPs per token (see :func:`moetrain.accounting.flops_breakdown`)."""
        return flops_breakdown(self.config, seq_len)

    def flops_per_token(self, seq_len: int) -> float:
        """Megatron FLOPs per token -- the number behind every TFLOP/s this package prints."""
        return flops_per_token(self.config, seq_len).megatron

    @property
    def n_moe_layers(self) -> int:
        return self.n_layers - self.n_dense_layers

    # ---- parameters per component (numbers of scalars) ------------------------------------------------------
    @property
    def attn_params(self) -> int:
        """One attention block plus the layer's two norms."""
        return self.params.attention_per_layer + 2 * self.dim

    @property
    def expert_params(self) -> int:
        return self.params.expert

    @property
    def moe_nonexpert_params(self) -> int:
        """Router + shared experts of one MoE layer (replicated across EP, split by TP)."""
        return self.params.moe_layer_total - self.n_experts * self.params.expert

    @property
    def dense_ffn_params(self) -> int:
        return self.params.dense_ffn_per_layer

    @property
    def mtp_extra_params(self) -> int:
        """Per MTP module, besides its transformer block: enorm, hnorm, eh_proj (2h -> h), final norm."""
        return 3 * self.dim + 2 * self.dim * self.dim

    @property
    def embedding_params(self) -> int:
        return self.params.embedding

    @property
    def head_params(self) -> int:
        """Output head (the embedding when tied: a tied head still has to live on the last stage)."""
        return self.params.head or self.params.embedding

    # ---- intermediate tensor sizes per token (elements) ------------------------------------------------------
    @property
    def q_width(self) -> int:
        return self.n_heads * self.qk_head_dim

    @property
    def kv_width(self) -> int:
        """Keys + values per token as the attention kernel sees them."""
        return self.n_kv_heads * (self.qk_head_dim + self.v_head_dim)

    @property
    def o_width(self) -> int:
        return self.n_heads * self.v_head_dim

    @property
    def upproj_widths(self) -> int:
        """Outputs of the MLA up-projections (q_b, kv_b) per token: what selective recompute drops (0 for GQA)."""
        if self.attention != "mla":
            return 0
        nope = self.qk_head_dim - self.qk_rope
        q = self.q_width if self.q_lora else 0
        return q + self.n_heads * (nope + self.v_head_dim)

    def upproj_flops_per_token(self) -> float:
        """Forward FLOPs of the MLA up-projections per token (recomputed by selective recompute)."""
        if self.attention != "mla":
            return 0.0
        nope = self.qk_head_dim - self.qk_rope
        f = 2.0 * self.kv_lora * self.n_heads * (nope + self.v_head_dim)
        if self.q_lora:
            f += 2.0 * self.q_lora * self.q_width
        return f

    def to_dict(self) -> dict[str, Any]:
        p = self.params
        return {
            "name": self.name, "attention": self.attention, "vocab": self.vocab, "dim": self.dim,
            "n_layers": self.n_layers, "n_dense_layers": self.n_dense_layers, "mtp_depth": self.mtp_depth,
            "n_experts": self.n_experts, "top_k": self.top_k, "expert_ffn": self.expert_ffn,
            "total_params": p.total_with_mtp, "active_params": p.active,
        }


def shape_from_config(cfg: AnyConfig, name: str | None = None) -> ModelShape:
    """Wrap a model config in a :class:`ModelShape`.

    Raises:
        ShapeError: a config of a family the cost model does not know."""
    if isinstance(cfg, Qwen3MoeConfig):
        return ModelShape(
            name=name or "custom", config=cfg, attention="gqa", vocab=cfg.vocab_size, dim=cfg.dim,
            n_layers=cfg.n_layers, n_dense_layers=cfg.n_dense_layers, mtp_depth=cfg.mtp_depth,
            dense_ffn=cfg.dense_ffn_dim if cfg.n_dense_layers else 0, expert_ffn=cfg.expert_ffn_dim,
            shared_ffn=cfg.shared_ffn_width, n_experts=cfg.n_routed_experts, top_k=cfg.top_k,
            n_expert_groups=cfg.n_expert_groups, n_limited_groups=cfg.n_limited_groups, n_heads=cfg.n_heads,
            n_kv_heads=cfg.n_kv_heads, qk_head_dim=cfg.head_dim, v_head_dim=cfg.head_dim, q_lora=0, kv_lora=0,
            qk_rope=0, tie_embeddings=cfg.tie_embeddings,
        )
    if isinstance(cfg, DeepSeekV3Config):
        return ModelShape(
            name=name or "custom", config=cfg, attention="mla", vocab=cfg.vocab_size, dim=cfg.dim,
            n_layers=cfg.n_layers, n_dense_layers=cfg.n_dense_layers, mtp_depth=cfg.mtp_depth,
            dense_ffn=cfg.dense_ffn_dim, expert_ffn=cfg.expert_ffn_dim,
            shared_ffn=cfg.shared_ffn_width, n_experts=cfg.n_routed_experts, top_k=cfg.top_k,
            n_expert_groups=cfg.n_expert_groups, n_limited_groups=cfg.n_limited_groups, n_heads=cfg.n_heads,
            n_kv_heads=cfg.n_heads, qk_head_dim=cfg.qk_head_dim, v_head_dim=cfg.v_head_dim,
            q_lora=cfg.q_lora_rank, kv_lora=cfg.kv_lora_rank, qk_rope=cfg.qk_rope_head_dim,
            tie_embeddings=cfg.tie_embeddings,
        )
    raise ShapeError(f"expected a DeepSeekV3Config or Qwen3MoeConfig, got {type(cfg).__name__}")


# ---- HF config.json ------------------------------------------------------------------------------------------

#: model_type values read as DeepSeek (MLA) models, through moetrain.interop.hf.config_from_hf.
DEEPSEEK_TYPES = ("deepseek_v3", "deepseek_v2")
#: model_type values read as GQA MoE models by :func:`gqa_config_from_hf` (qwen3_moe, which moetrain trains, is read
#: through its family's adapter like the DeepSeek types: plan and run then hold the same config).
GQA_TYPES = ("mixtral", "qwen2_moe", "qwen3_moe", "qwen_moe", "olmoe", "gpt_oss", "phimoe", "granitemoe",
             "jetmoe", "minimax", "llama4_text", "glm4_moe", "hunyuan_v1_moe", "ernie4_5_moe", "dots1")


def _first(d: dict[str, Any], *keys: str, default: Any = None) -> Any:
    """The value of the first of ``keys`` present in ``d``. A per-layer list (Hunyuan's ``moe_topk``,
    ``moe_intermediate_size``) whose entries agree is read as that value.

    Raises:
        ShapeError: a per-layer list whose entries differ (layers of different shapes are not modelled).
    """
    for k in keys:
        v = d.get(k)
        if v is None:
            continue
        if isinstance(v, (list, tuple)):
            if not v or any(x != v[0] for x in v):
                raise ShapeError(f"config.json {k}={v!r}: layers with different values are not modelled (the "
                                 f"cost model takes one {k} for every MoE layer)")
            return v[0]
        return v
    return default


def gqa_config_from_hf(d: dict[str, Any], name: str = "gqa-moe") -> Qwen3MoeConfig:
    """Read a Mixtral / Qwen-MoE style HF ``config.json`` (grouped-query attention + routed experts).

    Recognised keys: hidden_size, num_hidden_layers, num_attention_heads, num_key_value_heads, head_dim,
    vocab_size, intermediate_size (| intermediate_size_mlp for Llama 4's dense layers), moe_intermediate_size,
    num_local_experts | num_experts | n_routed_experts | moe_num_experts, num_experts_per_tok | moe_topk | moe_k,
    shared_expert_intermediate_size | n_shared_experts | num_shared_expert | moe_num_shared_experts,
    first_k_dense_replace | moe_layer_start_index | mlp_only_layers, decoder_sparse_step |
    interleave_moe_layer_step | moe_layer_interval, qkv_bias | attention_bias, tie_word_embeddings,
    max_position_embeddings. Per-layer lists (Hunyuan) are read when their entries agree. Llama 4 has a shared
    expert of the routed width in every MoE layer.
    Mixtral's experts have width ``intermediate_size`` (it has no moe_intermediate_size). Layers in
    ``mlp_only_layers`` (or left dense by ``decoder_sparse_step``) are counted as dense layers; only their number
    matters for the cost model. The result is a :class:`Qwen3MoeConfig` with the planner-only fields set
    (``qkv_bias``, ``qk_norm`` for Qwen3 only, ``shared_ffn_dim``); ``name`` labels it in error messages.

    Raises:
        ShapeError: a required key is missing, the config has no routed experts, or its sizes are inconsistent.
    """
    try:
        h = int(d["hidden_size"])
        n_layers = int(d["num_hidden_layers"])
        n_heads = int(d["num_attention_heads"])
        vocab = int(d["vocab_size"])
    except KeyError as e:
        raise ShapeError(f"config.json lacks required key {e.args[0]!r}") from None
    n_kv = int(_first(d, "num_key_value_heads", default=n_heads))
    head_dim = int(_first(d, "head_dim", default=h // n_heads))
    n_exp = _first(d, "num_local_experts", "num_experts", "n_routed_experts", "moe_num_experts")
    if not n_exp:
        raise ShapeError("config.json has no routed experts (num_local_experts / num_experts / n_routed_experts / "
                         "moe_num_experts); moetrain plan models MoE transformers")
    top_k = int(_first(d, "num_experts_per_tok", "num_experts_per_token", "moe_topk", "moe_k", default=2))
    inter = int(_first(d, "intermediate_size", default=0))
    moe_inter = int(_first(d, "moe_intermediate_size", default=inter))
    dense_inter = int(_first(d, "intermediate_size_mlp", default=inter))   # Llama 4: its dense layers' width
    shared = int(_first(d, "shared_expert_intermediate_size", default=0))
    n_shared = _first(d, "n_shared_experts", "num_shared_expert", "moe_num_shared_experts")
    if not shared and n_shared:
        shared = int(n_shared) * moe_inter
    if not shared and d.get("model_type") == "llama4_text":
        shared = moe_inter  # every Llama 4 MoE layer has one shared expert of the routed experts' width
    n_dense = 0
    if d.get("first_k_dense_replace") is not None:
        n_dense = int(d["first_k_dense_replace"])
    elif d.get("moe_layer_start_index") is not None:       # ERNIE 4.5
        n_dense = int(_first(d, "moe_layer_start_index"))
    elif d.get("mlp_only_layers"):
        n_dense = len(set(int(i) for i in d["mlp_only_layers"]))
    step = int(_first(d, "decoder_sparse_step", "interleave_moe_layer_step", "moe_layer_interval", default=1) or 1)
    if step > 1:
        n_dense = max(n_dense, n_layers - n_layers // step)
    try:
        return Qwen3MoeConfig(
            vocab_size=vocab, dim=h, n_layers=n_layers, n_heads=n_heads, n_kv_heads=n_kv, head_dim=head_dim,
            expert_ffn_dim=moe_inter, n_routed_experts=int(n_exp), top_k=top_k, n_dense_layers=n_dense,
            dense_ffn_dim=dense_inter if n_dense else 0, n_shared_experts=0,
            shared_ffn_dim=shared, qkv_bias=bool(_first(d, "qkv_bias", "attention_bias", default=False)),
            qk_norm=d.get("model_type") == "qwen3_moe",
            tie_embeddings=bool(d.get("tie_word_embeddings", False)),
            max_seq_len=int(_first(d, "max_position_embeddings", default=32_768)),
        )
    except ConfigError as e:
        raise ShapeError(f"config.json of {name} is not a valid GQA MoE shape: {e}") from None


def shape_from_hf(d: dict[str, Any], name: str = "hf") -> ModelShape:
    """A :class:`ModelShape` from a HF ``config.json`` dict: DeepSeek-V3/V2 (MLA) or a GQA MoE model.

    Raises:
        ShapeError: unsupported or inconsistent config (the message says why).
    """
    mt = d.get("model_type")
    trained = mt in supported_model_types() or (mt is None and "kv_lora_rank" in d)
    if trained:
        try:
            from moetrain.interop.hf import config_from_hf
        except ImportError as e:  # pragma: no cover - interop is developed concurrently
            raise ShapeError(f"reading a DeepSeek config.json needs moetrain.interop.hf ({e})") from None
        try:
            return shape_from_config(config_from_hf(d), name=name)
        except ConfigError as e:
            raise ShapeError(f"{mt or 'DeepSeek'} config.json rejected: {e}") from None
    if "num_key_value_heads" in d or mt in GQA_TYPES:
        return shape_from_config(gqa_config_from_hf(d, name=name), name=name)
    raise ShapeError(f"config.json of model_type={mt!r} is neither DeepSeek-V3/V2 (kv_lora_rank) nor a "
                     f"grouped-query-attention MoE (num_key_value_heads); GQA MoE configs are read by their keys, "
                     f"known types: {list(DEEPSEEK_TYPES) + list(GQA_TYPES)}")


def load_shape(model: str | os.PathLike | AnyConfig | ModelShape) -> ModelShape:
    """Resolve ``--model``: a preset name, a path to a HF ``config.json`` (or a directory holding one), a config
    object, or a ModelShape.

    Raises:
        ShapeError: unknown preset / missing file / unsupported config; the message lists the presets.
    """
    if isinstance(model, ModelShape):
        return model
    if isinstance(model, ModelConfig):
        return shape_from_config(model)
    s = str(model)
    if s in PRESETS:
        return shape_from_config(get_preset(s), name=s)
    p = Path(s)
    if p.is_dir():
        p = p / "config.json"
    if p.is_file():
        try:
            with open(p) as f:
                d = json.load(f)
        except (OSError, json.JSONDecodeError) as e:
            raise ShapeError(f"cannot read {p}: {e}") from None
        if not isinstance(d, dict):
            raise ShapeError(f"{p} does not hold a JSON object")
        return shape_from_hf(d, name=p.parent.name if p.name == "config.json" else p.stem)
    raise ShapeError(f"unknown model {s!r}: not a preset ({sorted(PRESETS)}) and no config.json at that path")


def with_mtp_depth(shape: ModelShape, depth: int | None) -> ModelShape:
    """The model with ``depth`` MTP modules (None = as it is; 0 = MTP off; ``--mtp-depth``). FLOPs and parameters
    follow from :mod:`moetrain.accounting` for the new depth.

    Raises:
        ShapeError: MTP modules asked of a model without the DeepSeek-V3 (MLA) structure.
    """
    if depth is None or depth == shape.mtp_depth:
        return shape
    if not isinstance(shape.config, DeepSeekV3Config):
        raise ShapeError(f"{shape.name} has no MTP modules; --mtp-depth applies to DeepSeek-V3-style models")
    import dataclasses

    return shape_from_config(dataclasses.replace(shape.config, mtp_depth=depth), name=shape.name)
