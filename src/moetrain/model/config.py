"""Typed configuration of a DeepSeek-V3-architecture model, with named presets.

Field names are moetrain's own (short, TorchTitan-like); :mod:`moetrain.interop.hf` maps them to and from the
Hugging Face ``config.json`` names. Every inconsistency is rejected when the config is built (``__post_init__``), with
a message that names the field and the values it may take, so no weights are allocated for a config that cannot work.

Sources: deepseek-ai/DeepSeek-V3 ``inference/configs/config_671B.json`` and the HF ``config.json`` of
DeepSeek-V3 and DeepSeek-V2-Lite (see ``docs/reference.md`` section 2).
"""

from __future__ import annotations

import dataclasses
import math
import types
import typing
from dataclasses import dataclass, field
from typing import Any, Callable, Literal

from moetrain.errors import ConfigError  # noqa: F401 - re-exported: its home was here

ScoreFunc = Literal["sigmoid", "softmax"]
RoutingMode = Literal["learned", "balanced"]



#: ModelConfig fields that steer training rather than define the architecture: a checkpoint may resume under other
#: values, and the HF config.json has no names for them.
TRAINING_FIELDS = ("balance_loss_alpha", "mtp_loss_weight", "bias_update_rate", "routing")


@dataclass
class ModelConfig:
    """Shape and behaviour of a DeepSeek-V3-style MoE transformer.

    Attributes (HF name in brackets where it differs):
        vocab_size: tokens in the vocabulary (V).
        dim: hidden size D [hidden_size].
        n_layers: transformer blocks of the main model [num_hidden_layers]; MTP blocks come on top.
        n_dense_layers: the first k blocks use a dense SwiGLU FFN instead of MoE [first_k_dense_replace].
        dense_ffn_dim: hidden size of the dense FFN [intermediate_size].
        expert_ffn_dim: hidden size F of one routed or shared expert [moe_intermediate_size].
        n_routed_experts: routed experts E per MoE layer [n_routed_experts].
        n_shared_experts: shared experts, fused into one SwiGLU of width n_shared * F [n_shared_experts].
        top_k: routed experts per token K [num_experts_per_tok].
        n_expert_groups: experts are split into this many groups for group-limited routing [n_group].
        n_limited_groups: only the best this-many groups are eligible per token [topk_group].
        score_func: "sigmoid" (V3) or "softmax" (V2) router scores, computed in fp32 [scoring_func].
        norm_topk: renormalise the selected K weights to sum to one [norm_topk_prob].
        route_scale: multiplier of the gate weights [routed_scaling_factor].
        n_heads: attention heads H [num_attention_heads].
        q_lora_rank: rank of the query compression; 0 means a plain query projection (V2-Lite).
        kv_lora_rank: rank of the joint key/value compression.
        qk_nope_head_dim: per-head dims of the non-rotary (content) part of queries and keys.
        qk_rope_head_dim: per-head dims of the decoupled rotary part (its key shared by all heads).
        v_head_dim: per-head dims of the values.
        rope_theta: RoPE base frequency.
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
        max_seq_len: longest sequence the model is built for [max_position_embeddings].
        norm_eps: RMSNorm epsilon.
        init_std: std of the normal init of every weight matrix [initializer_range].
        mtp_depth: number of multi-token-prediction modules D [num_nextn_predict_layers].
        tie_embeddings: share the embedding and the output head (DeepSeek-V3 does not).
        balance_loss_alpha: coefficient of the sequence-wise balance loss (V3: 1e-4; 0 turns it off).
        mtp_loss_weight: lambda, weight of the mean MTP loss (V3: 0.3 then 0.1).
        bias_update_rate: gamma of auxiliary-loss-free balancing (V3: 1e-3; 0 turns it off).
        routing: "learned" or "balanced" (forced perfect balance for benchmarks, as the published records use).
    """

    vocab_size: int = 129_280
    dim: int = 7168
    n_layers: int = 61
    n_dense_layers: int = 3
    dense_ffn_dim: int = 18_432
    expert_ffn_dim: int = 2048
    n_routed_experts: int = 256
    n_shared_experts: int = 1
    top_k: int = 8
    n_expert_groups: int = 8
    n_limited_groups: int = 4
    score_func: ScoreFunc = "sigmoid"
    norm_topk: bool = True
    route_scale: float = 2.5
    n_heads: int = 128
    q_lora_rank: int = 1536
    kv_lora_rank: int = 512
    qk_nope_head_dim: int = 128
    qk_rope_head_dim: int = 64
    v_head_dim: int = 128
    rope_theta: float = 10_000.0
    rope_factor: float = 40.0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 1.0
    rope_mscale_all_dim: float = 1.0
    rope_original_seq_len: int = 4096
    rope_interleave: bool = True
    max_seq_len: int = 163_840
    norm_eps: float = 1e-6
    init_std: float = 0.006
    mtp_depth: int = 1
    tie_embeddings: bool = False
    balance_loss_alpha: float = 1e-4
    mtp_loss_weight: float = 0.3
    bias_update_rate: float = 1e-3
    routing: RoutingMode = "learned"

    def __post_init__(self) -> None:
        positive = ("vocab_size", "dim", "n_layers", "expert_ffn_dim", "n_routed_experts", "top_k",
                    "n_expert_groups", "n_limited_groups", "n_heads", "kv_lora_rank", "qk_nope_head_dim",
                    "qk_rope_head_dim", "v_head_dim", "max_seq_len", "rope_original_seq_len")
        for name in positive:
            _check_int(name, getattr(self, name), minimum=1)
        for name in ("n_dense_layers", "n_shared_experts", "q_lora_rank", "mtp_depth"):
            _check_int(name, getattr(self, name), minimum=0)
        if self.n_dense_layers > self.n_layers:
            raise ConfigError(f"model.n_dense_layers={self.n_dense_layers} must be in [0, n_layers={self.n_layers}]")
        if self.n_dense_layers > 0:
            _check_int("dense_ffn_dim", self.dense_ffn_dim, minimum=1)
        if self.top_k > self.n_routed_experts:
            raise ConfigError(f"model.top_k={self.top_k} must be in [1, n_routed_experts={self.n_routed_experts}]")
        if self.n_routed_experts % self.n_expert_groups:
            divisors = [d for d in range(1, self.n_routed_experts + 1) if self.n_routed_experts % d == 0]
            raise ConfigError(f"model.n_expert_groups={self.n_expert_groups} must divide n_routed_experts="
                              f"{self.n_routed_experts}; allowed: {divisors}")
        if self.n_limited_groups > self.n_expert_groups:
            raise ConfigError(f"model.n_limited_groups={self.n_limited_groups} must be in [1, n_expert_groups="
                              f"{self.n_expert_groups}]")
        per_group = self.n_routed_experts // self.n_expert_groups
        if self.n_expert_groups > 1 and per_group < 2:
            raise ConfigError(f"model.n_expert_groups={self.n_expert_groups}: group-limited routing scores a group by "
                              f"its top-2 experts, so each group needs >= 2 experts; use model.n_expert_groups <= "
                              f"{self.n_routed_experts // 2}")
        if self.n_expert_groups > 1 and self.n_limited_groups * per_group < self.top_k:
            raise ConfigError(f"model.n_limited_groups={self.n_limited_groups} groups of {per_group} experts cannot "
                              f"hold top_k={self.top_k} experts; need model.n_limited_groups >= "
                              f"{math.ceil(self.top_k / per_group)}")
        if self.score_func not in ("sigmoid", "softmax"):
            raise ConfigError(f"model.score_func={self.score_func!r}; allowed: 'sigmoid', 'softmax'")
        if self.routing not in ("learned", "balanced"):
            raise ConfigError(f"model.routing={self.routing!r}; allowed: 'learned', 'balanced'")
        if self.qk_rope_head_dim % 2:
            raise ConfigError(f"model.qk_rope_head_dim={self.qk_rope_head_dim} must be even (RoPE rotates pairs)")
        if self.rope_factor < 1.0:
            raise ConfigError(f"model.rope_factor={self.rope_factor} must be >= 1.0 (1.0 = plain RoPE, > 1 = YaRN)")
        for name in ("norm_eps", "init_std", "route_scale", "rope_theta"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be > 0")
        for name in ("balance_loss_alpha", "mtp_loss_weight", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be >= 0")

    # ---- derived sizes -------------------------------------------------------------------------------------
    @property
    def n_moe_layers(self) -> int:
        """MoE blocks of the main model (MTP blocks excluded)."""
        return self.n_layers - self.n_dense_layers

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

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.n_dense_layers

    # ---- (de)serialisation ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a dict; unknown keys raise ConfigError listing the valid ones."""
        return from_dict_strict(cls, d, "model")

    def replace(self, **changes: Any) -> "ModelConfig":
        return from_dict_strict(type(self), {**self.to_dict(), **changes}, "model")


def _check_int(name: str, value: Any, minimum: int) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < minimum:
        raise ConfigError(f"model.{name}={value!r} must be an integer >= {minimum}")


def from_dict_strict(cls: type, d: dict[str, Any], section: str) -> Any:
    """Build dataclass ``cls`` from ``d``, rejecting unknown keys with the list of valid ones.

    Raises:
        ConfigError: a key is not a field of ``cls``.
    """
    names = {f.name for f in dataclasses.fields(cls)}
    unknown = sorted(set(d) - names)
    if unknown:
        import difflib

        guesses = sorted({g for u in unknown for g in difflib.get_close_matches(u, names, n=1, cutoff=0.6)})
        hint = f" (did you mean {', '.join(f'{section}.{g}' for g in guesses)}?)" if guesses else ""
        raise ConfigError(f"unknown field(s) {', '.join(f'{section}.{u}' for u in unknown)}{hint}; valid fields of "
                          f"[{section}]: {', '.join(sorted(names))}; set one with --set {section}.FIELD=VALUE "
                          f"(`moetrain train --help-config` lists every field with its meaning)")
    hints = typing.get_type_hints(cls)
    for name, value in d.items():
        _check_type(f"{section}.{name}", value, hints[name])
    return cls(**d)


def _check_type(name: str, value: Any, tp: Any) -> None:
    """Reject values of the wrong type (a string where a bool or number belongs, ...) with a ConfigError."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin in (typing.Union, types.UnionType):
        if value is None and type(None) in args:
            return
        tp = next(a for a in args if a is not type(None))
        origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Literal:
        if value not in args:
            raise ConfigError(f"{name}={value!r}; allowed: {', '.join(repr(a) for a in args)}")
        return
    ok = {bool: lambda v: isinstance(v, bool),
          int: lambda v: isinstance(v, int) and not isinstance(v, bool),
          float: lambda v: isinstance(v, (int, float)) and not isinstance(v, bool),
          str: lambda v: isinstance(v, str)}.get(tp)
    if origin is list:
        ok = lambda v: isinstance(v, (list, tuple))  # noqa: E731
    if ok is not None and not ok(value):
        want = {bool: "true or false", int: "an integer", float: "a number", str: "a string"}.get(tp, "a list")
        raise ConfigError(f"{name}={value!r} must be {want}")


# ---- presets -------------------------------------------------------------------------------------------------

def deepseek_v3_671b() -> ModelConfig:
    """Exactly the released DeepSeek-V3 configuration (671B total, 37B active, one MTP module)."""
    return ModelConfig()


def deepseek_v2_lite_16b() -> ModelConfig:
    """The DeepSeek-V2-Lite shape (15.7B): softmax router, no groups, plain q projection, 2 shared experts."""
    return ModelConfig(
        vocab_size=102_400, dim=2048, n_layers=27, n_dense_layers=1, dense_ffn_dim=10_944, expert_ffn_dim=1408,
        n_routed_experts=64, n_shared_experts=2, top_k=6, n_expert_groups=1, n_limited_groups=1,
        score_func="softmax", norm_topk=False, route_scale=1.0, n_heads=16, q_lora_rank=0, kv_lora_rank=512,
        rope_mscale=0.707, rope_mscale_all_dim=0.707, mtp_depth=0, bias_update_rate=0.0,
    )


def tiny() -> ModelConfig:
    """A few-million-parameter model that trains on a CPU in minutes yet keeps every V3 feature: MLA with q_lora,
    4 expert groups with group-limited routing, a shared expert, a dense first layer, MTP depth 1, YaRN RoPE."""
    return ModelConfig(
        vocab_size=2048, dim=128, n_layers=4, n_dense_layers=1, dense_ffn_dim=384, expert_ffn_dim=64,
        n_routed_experts=16, n_shared_experts=1, top_k=4, n_expert_groups=4, n_limited_groups=2,
        n_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        rope_factor=4.0, rope_original_seq_len=256, max_seq_len=1024, mtp_depth=1, init_std=0.02,
        # A run of a few hundred steps needs a faster bias than V3's 1e-3 to keep the router from collapsing.
        bias_update_rate=1e-2,
    )


def small() -> ModelConfig:
    """About 295M total / 126M active parameters (318M with MTP): the benchmark preset."""
    return ModelConfig(
        vocab_size=32_768, dim=768, n_layers=12, n_dense_layers=1, dense_ffn_dim=3072, expert_ffn_dim=256,
        n_routed_experts=32, n_shared_experts=1, top_k=6, n_expert_groups=8, n_limited_groups=4,
        n_heads=12, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        rope_factor=1.0, rope_original_seq_len=2048, max_seq_len=2048, mtp_depth=1, init_std=0.02,
    )


PRESETS: dict[str, Callable[[], ModelConfig]] = {
    "deepseek-v3-671b": deepseek_v3_671b,
    "deepseek-v2-lite-16b": deepseek_v2_lite_16b,
    "tiny": tiny,
    "small": small,
}


#: What each preset brings to the rest of the job: training settings that fit its size, ``{section: {field: value}}``
#: over the dataclass defaults (the one table of them; ``"hf"`` is for a model taken from a HF config.json, by
#: ``model.hf_config`` or ``--init-from``). :func:`moetrain.config.build_job_config` applies them under job files and
#: ``--set``, and besides: ``data.seq_len`` is capped at the model's ``max_seq_len``; ``parallel.ep`` is lowered to
#: the largest size that divides the world and the experts when the user does not set it; ``data.vocab_size`` (the
#: size of a trained BPE) defaults to the model's ``vocab_size``, and ``model.vocab_size`` then follows the tokenizer.
#: ``tiny`` is the built-in CPU demo (``moetrain train`` with no arguments): its training values are TrainConfig's own
#: defaults, and 64-token sequences were measured to lower the validation loss fastest per step on a 2-core CPU (val
#: loss after 100 steps: 4.50 at L=64, 4.71 at 128, 4.78 at 256, 4.95 at 512; same tokens per step), which is what
#: lets the demo halve its loss in under five minutes. The others follow their published recipes (DeepSeek-V3: lr
#: 2.2e-4, 2,000 warm-up steps, 4K sequences, EP 64; DeepSeek-V2-Lite: lr 4.2e-4, 4K sequences) or, for ``small``
#: (126M active), GPT-3 Small's lr of 6e-4 with 1K sequences; ``hf`` is a conservative continued-pre-training start.
PRESET_JOB_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "deepseek-v3-671b": {"parallel": {"ep": 64}, "data": {"seq_len": 4096},
                         "train": {"micro_batch_size": 1, "lr": 2.2e-4, "min_lr": 2.2e-5, "warmup_steps": 2000}},
    "deepseek-v2-lite-16b": {"parallel": {"ep": 8}, "data": {"seq_len": 4096},
                             "train": {"micro_batch_size": 1, "lr": 4.2e-4, "min_lr": 4.2e-5, "warmup_steps": 2000}},
    "tiny": {"parallel": {"ep": 2}, "data": {"seq_len": 64}, "train": {}},
    "small": {"parallel": {"ep": 8}, "data": {"seq_len": 1024},
              "train": {"micro_batch_size": 8, "lr": 6e-4, "min_lr": 6e-5, "warmup_steps": 100}},
    "hf": {"parallel": {"ep": 8}, "data": {"seq_len": 1024},
           "train": {"micro_batch_size": 1, "lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 100}},
}


def get_preset(name: str) -> ModelConfig:
    """Return a fresh config of the named preset.

    Raises:
        ConfigError: unknown name; the message lists the presets.
    """
    try:
        return PRESETS[name]()
    except KeyError:
        raise ConfigError(f"unknown model preset {name!r}; choose one of {sorted(PRESETS)}") from None
