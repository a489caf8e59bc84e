"""The common base of every model family's typed configuration: :class:`ModelConfig`, with the family enum.

A family's config (``moetrain.model.deepseek.config.DeepSeekV3Config``, ``moetrain.model.qwen3.config.Qwen3MoeConfig``)
subclasses :class:`ModelConfig`, adds its attention's fields and implements the hooks the common code calls: the
attention module of a block, the attention parameter count and Megatron FLOPs, the rotary dimension. Field names are
moetrain's own (short, TorchTitan-like); each family's adapter maps them to and from its Hugging Face ``config.json``.
Every inconsistency is rejected when the config is built (``__post_init__``), with a message that names the field
and the values it may take, so no weights are allocated for a config that cannot work.

``moetrain.model.config`` re-exports this module together with the families and their presets (the import path
the rest of moetrain uses).
"""

from __future__ import annotations

import dataclasses
import enum
import math
import types
import typing
from dataclasses import dataclass
from typing import Any, ClassVar, Literal

from torch import nn

from moetrain.errors import ConfigError

ScoreFunc = Literal["sigmoid", "softmax"]
RoutingMode = Literal["learned", "balanced"]


class ModelFamily(str, enum.Enum):
    """The model families moetrain builds; the ``family`` key of a saved model config (absent = ``deepseek_v3``)."""

    DEEPSEEK_V3 = "deepseek_v3"
    QWEN3_MOE = "qwen3_moe"


class BalanceLoss(str, enum.Enum):
    """Over which tokens the auxiliary balance loss counts each expert's share f_i.

    ``sequence``: per sequence (DeepSeek-V3 report eqs. 17-20). ``micro_batch``: over one micro-batch of one rank
    (transformers' ``load_balancing_loss_func``, Switch Transformer eqs. 4-6). ``global_batch``: the counts summed
    over the data-parallel group (every rank that sees other tokens, expert-parallel ranks included), a detached
    all-reduce, so the loss equals the single-process loss of the whole global batch (Qiu et al. 2025, "Demons in the
    Detail", arXiv 2501.11817: the loss Qwen3 trains with).
    """

    SEQUENCE = "sequence"
    MICRO_BATCH = "micro_batch"
    GLOBAL_BATCH = "global_batch"


#: ModelConfig fields that steer training rather than define the architecture: a checkpoint may resume under other
#: values, and the HF config.json has no names for them.
TRAINING_FIELDS = ("balance_loss_alpha", "mtp_loss_weight", "bias_update_rate", "routing", "balance_loss")

#: The family of a config dict without a ``family`` key (every run saved before there were families).
DEFAULT_FAMILY = ModelFamily.DEEPSEEK_V3

_FAMILY_CLASSES: dict[ModelFamily, type["ModelConfig"]] = {}


@dataclass(frozen=True)
class Yarn:
    """YaRN rotary scaling (Peng et al. 2023, arXiv 2309.00071) as DeepSeek-V3 uses it; see ``moetrain.model.layers``.

    Attributes: factor (> 1), original_seq_len (pre-training context of the ramp), beta_fast / beta_slow (ramp
    bounds, in rotations), mscale / mscale_all_dim (attention temperature)."""

    factor: float
    original_seq_len: int
    beta_fast: float
    beta_slow: float
    mscale: float
    mscale_all_dim: float


class _ByFamily(type):
    """Metaclass of :class:`ModelConfig`: calling the base builds the config of the ``family`` keyword (absent:
    ``deepseek_v3``), so ``ModelConfig(**cfg.to_dict())`` round-trips and ``ModelConfig(q_lora_rank=...)`` is still
    the DeepSeek-V3 config it was before there were families; a family's own class accepts its own ``family``.

    Raises:
        ConfigError: an unknown family, or another family than the class called.
    """

    def __call__(cls, *args: Any, **kwargs: Any) -> Any:
        family = kwargs.pop("family", None)
        if "family" in cls.__dict__:
            if family is not None and family_class(family) is not cls:
                raise ConfigError(f"model.family={family!r} where a {cls.__dict__['family'].value} model is expected")
            return super().__call__(*args, **kwargs)
        return type.__call__(family_class(DEFAULT_FAMILY if family is None else family), *args, **kwargs)


@dataclass
class ModelConfig(metaclass=_ByFamily):
    """What every family's MoE transformer shares: embedding, pre-norm blocks of attention + (dense | MoE) FFN,
    routed experts with a router, optional shared experts, MTP modules, output head. Families subclass it.

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
        score_func: "sigmoid" (V3) or "softmax" (V2, Qwen3) router scores, computed in fp32 [scoring_func].
        norm_topk: renormalise the selected K weights to sum to one [norm_topk_prob].
        route_scale: multiplier of the gate weights [routed_scaling_factor].
        n_heads: attention (query) heads H [num_attention_heads].
        rope_theta: RoPE base frequency.
        max_seq_len: longest sequence the model is built for [max_position_embeddings].
        norm_eps: RMSNorm epsilon.
        init_std: std of the normal init of every weight matrix [initializer_range].
        mtp_depth: number of multi-token-prediction modules D [num_nextn_predict_layers].
        tie_embeddings: share the embedding and the output head (DeepSeek-V3 does not).
        balance_loss_alpha: coefficient of the auxiliary balance loss (V3: 1e-4; Qwen3: 1e-3; 0 turns it off).
        mtp_loss_weight: lambda, weight of the mean MTP loss (V3: 0.3 then 0.1).
        bias_update_rate: gamma of auxiliary-loss-free balancing (V3: 1e-3; 0 turns it off).
        routing: "learned" or "balanced" (forced perfect balance for benchmarks, as the published records use).
        balance_loss: the tokens the balance loss counts over (:class:`BalanceLoss`; V3: sequence, Qwen3:
            global_batch).

    Class attributes: ``family`` (:class:`ModelFamily`); ``hf_model_type`` (the transformers ``model_type``).
    """

    family: ClassVar[ModelFamily]
    hf_model_type: ClassVar[str]

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
    rope_theta: float = 10_000.0
    max_seq_len: int = 163_840
    norm_eps: float = 1e-6
    init_std: float = 0.006
    mtp_depth: int = 1
    tie_embeddings: bool = False
    balance_loss_alpha: float = 1e-4
    mtp_loss_weight: float = 0.3
    bias_update_rate: float = 1e-3
    routing: RoutingMode = "learned"
    balance_loss: BalanceLoss = BalanceLoss.SEQUENCE

    def __init_subclass__(cls, **kwargs: Any) -> None:
        super().__init_subclass__(**kwargs)
        family = cls.__dict__.get("family")
        if family is not None:
            _FAMILY_CLASSES[family] = cls

    def __post_init__(self) -> None:
        positive = ("vocab_size", "dim", "n_layers", "expert_ffn_dim", "n_routed_experts", "top_k",
                    "n_expert_groups", "n_limited_groups", "n_heads", "max_seq_len")
        for name in positive:
            check_int(name, getattr(self, name), minimum=1)
        for name in ("n_dense_layers", "n_shared_experts", "mtp_depth"):
            check_int(name, getattr(self, name), minimum=0)
        if self.n_dense_layers > self.n_layers:
            raise ConfigError(f"model.n_dense_layers={self.n_dense_layers} must be in [0, n_layers={self.n_layers}]")
        if self.n_dense_layers > 0:
            check_int("dense_ffn_dim", self.dense_ffn_dim, minimum=1)
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
        try:
            self.balance_loss = BalanceLoss(self.balance_loss)
        except ValueError:
            raise ConfigError(f"model.balance_loss={self.balance_loss!r}; allowed: "
                              f"{', '.join(repr(b.value) for b in BalanceLoss)}") from None
        for name in ("norm_eps", "init_std", "route_scale", "rope_theta"):
            if not getattr(self, name) > 0:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be > 0")
        for name in ("balance_loss_alpha", "mtp_loss_weight", "bias_update_rate"):
            if getattr(self, name) < 0:
                raise ConfigError(f"model.{name}={getattr(self, name)} must be >= 0")

    # ---- hooks a family implements -------------------------------------------------------------------------
    def build_attention(self) -> nn.Module:
        """The attention module of one block (forward(x_BLD, cos_LR, sin_LR) -> (B, L, D))."""
        raise NotImplementedError(f"{type(self).__name__} does not build an attention module")

    def attention_params(self) -> int:
        """Parameters of one attention block (projections and the norms inside it)."""
        raise NotImplementedError(f"{type(self).__name__} does not count its attention parameters")

    def attention_projection_flops_factor(self) -> int:
        """Multiply-adds per token of one block's attention projections, as Megatron-Core counts them."""
        raise NotImplementedError(f"{type(self).__name__} does not count its attention FLOPs")

    @property
    def attention_core_dims(self) -> tuple[int, int]:
        """(H * d_qk, H * d_v): the per-token widths of the attention scores' and weighted values' GEMMs."""
        raise NotImplementedError(f"{type(self).__name__} does not give its attention widths")

    @property
    def rope_dim(self) -> int:
        """The rotary dimension R (the per-head slice RoPE rotates)."""
        raise NotImplementedError(f"{type(self).__name__} does not give its rotary dimension")

    @property
    def yarn(self) -> Yarn | None:
        """YaRN scaling of the rotary embedding, or None for plain RoPE."""
        return None

    @property
    def shared_ffn_width(self) -> int:
        """Total hidden width of the shared expert(s) of one MoE layer (one fused SwiGLU; 0 = none)."""
        return self.n_shared_experts * self.expert_ffn_dim

    # ---- derived sizes -------------------------------------------------------------------------------------
    @property
    def n_moe_layers(self) -> int:
        """MoE blocks of the main model (MTP blocks excluded)."""
        return self.n_layers - self.n_dense_layers

    def is_moe_layer(self, layer_id: int) -> bool:
        return layer_id >= self.n_dense_layers

    # ---- (de)serialisation ---------------------------------------------------------------------------------
    def to_dict(self) -> dict[str, Any]:
        """Every field (enums by value) and ``family``: what :meth:`from_dict` reads back."""
        d = {k: (v.value if isinstance(v, enum.Enum) else v) for k, v in dataclasses.asdict(self).items()}
        return {"family": self.family.value, **d}

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelConfig":
        """Build from a dict: the class of its ``family`` key (absent: ``deepseek_v3``, as every older saved run);
        unknown keys raise ConfigError listing the valid ones.

        Raises:
            ConfigError: an unknown family, an unknown field, a wrong type.
        """
        d = dict(d)
        target = family_class(d.pop("family", DEFAULT_FAMILY.value if cls is ModelConfig else cls.family.value))
        if cls is not ModelConfig and not issubclass(target, cls):
            raise ConfigError(f"model.family={target.family.value!r} where a {cls.family.value} model is expected")
        return from_dict_strict(target, d, "model")

    def replace(self, **changes: Any) -> "ModelConfig":
        """A copy with ``changes``; ``family`` may be given only as this config's own.

        Raises:
            ConfigError: another family (start from a preset of that family instead), an unknown field.
        """
        family = changes.pop("family", self.family.value)
        if family != self.family.value:
            raise ConfigError(f"model.family={family!r} cannot change a {self.family.value} model; start from a "
                              f"preset of that family (--preset) or its HF config (--set model.hf_config=...)")
        d = dataclasses.asdict(self)
        return from_dict_strict(type(self), {**d, **changes}, "model")


def family_class(family: Any) -> type[ModelConfig]:
    """The config class of ``family`` (a :class:`ModelFamily` or its value).

    Raises:
        ConfigError: an unknown family (naming the known ones).
    """
    try:
        return _FAMILY_CLASSES[ModelFamily(family)]
    except (ValueError, KeyError):
        raise ConfigError(f"model.family={family!r}; allowed: "
                          f"{', '.join(repr(f.value) for f in _FAMILY_CLASSES)}") from None


def check_int(name: str, value: Any, minimum: int) -> None:
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


