"""The Qwen3-MoE family's Hugging Face layout (transformers ``qwen3_moe``): ``config.json`` <-> :class:`Qwen3MoeConfig`,
and the tensor names of a :class:`~moetrain.model.Transformer` in the released checkpoints::

    model.embed_tokens.weight                      embed_tokens.weight
    model.layers.{i}.input_layernorm.weight        layers.{i}.input_layernorm.weight (and post_attention_layernorm)
    model.layers.{i}.self_attn.{q,k,v,o}_proj      layers.{i}.self_attn.{q,k,v,o}_proj
    model.layers.{i}.self_attn.{q,k}_norm          layers.{i}.self_attn.{q,k}_norm
    model.layers.{i}.mlp.gate.weight               layers.{i}.mlp.gate.weight                (router)
    model.layers.{i}.mlp.experts.{e}.gate_proj     layers.{i}.mlp.experts.w13_E2FD[e, :F]
    model.layers.{i}.mlp.experts.{e}.up_proj       layers.{i}.mlp.experts.w13_E2FD[e, F:]
    model.layers.{i}.mlp.experts.{e}.down_proj     layers.{i}.mlp.experts.w2_EDF[e]
    model.layers.{i}.mlp.{gate,up,down}_proj       layers.{i}.mlp.{w1,w3,w2}                 (dense layers)
    model.norm.weight, lm_head.weight              norm.weight, lm_head.weight

The loader also accepts the stacked layout of transformers v5 (``mlp.experts.gate_up_proj`` (E, 2F, D),
``mlp.experts.down_proj`` (E, D, F)). Dense layers are the first ``n_dense_layers`` (HF ``mlp_only_layers`` =
[0, k)); other ``mlp_only_layers``, ``decoder_sparse_step`` > 1 and an enabled sliding window are refused by name.
"""

from __future__ import annotations

from typing import Any

from torch import nn

from moetrain.errors import ConfigError
from moetrain.model.config_base import TRAINING_FIELDS, ModelConfig
from moetrain.model.hf_config import HFConfigReader
from moetrain.model.moe import MoE
from moetrain.model.qwen3.config import Qwen3MoeConfig
from moetrain.model.state_dict import (StateDictAdapter, StateMap, TensorEntry, add_attention_entries,
                                       add_expert_entries, indexed, training_fields)

#: Key of the block in ``config.json`` that carries moetrain fields the HF config has no name for.
EXTRA_KEY = "moetrain"


#: The keys a qwen3_moe config.json must give (a missing hidden size is an error, never a released model's value).
ARCH_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "num_key_value_heads",
             "moe_intermediate_size", "num_experts_per_tok")


def config_from_hf(d: dict[str, Any]) -> Qwen3MoeConfig:
    """Build a :class:`Qwen3MoeConfig` from a Hugging Face ``qwen3_moe`` ``config.json`` dict (released style:
    ``num_experts``, top-level ``rope_theta``; or transformers v5: ``num_local_experts``, ``rope_parameters``).
    The shape keys (:data:`ARCH_KEYS`, and ``num_experts`` or ``num_local_experts``) are required; other keys absent
    from ``d`` take the Qwen3-30B-A3B values; ``router_aux_loss_coef`` is the balance-loss alpha.

    Raises:
        ConfigError: a missing :data:`ARCH_KEYS` key or expert count; a value of the wrong JSON type (naming the key
            and the type, :class:`~moetrain.model.hf_config.HFConfigReader`); another model_type; a sliding window;
            ``decoder_sparse_step`` != 1 or ``mlp_only_layers`` other than the first k layers; a RoPE scaling; attention bias; an activation other than silu; no experts;
            and every inconsistency :class:`Qwen3MoeConfig` itself rejects.
    """
    if not isinstance(d, dict):
        raise ConfigError(f"expected a config dict, got {type(d).__name__}")
    if d.get("model_type", "qwen3_moe") != "qwen3_moe":
        raise ConfigError(f"model_type={d['model_type']!r} is not qwen3_moe")
    r = HFConfigReader(d)
    r.require(ARCH_KEYS, "the Qwen3-MoE architecture")
    if not (r.has("num_experts") or r.has("num_local_experts")):
        raise ConfigError("num_experts is missing (or num_local_experts, transformers v5's name): it is required to "
                          "describe the Qwen3-MoE architecture")
    out: dict[str, Any] = {}

    # Typed reads: int("four") would be a traceback, int(2.5) a silent 2, bool("false") a silent True.
    def take(hf_key: str, name: str, tp: type) -> None:
        if r.has(hf_key):
            out[name] = r.get(hf_key, tp)

    take("vocab_size", "vocab_size", int)
    take("hidden_size", "dim", int)
    take("num_hidden_layers", "n_layers", int)
    take("intermediate_size", "dense_ffn_dim", int)
    take("moe_intermediate_size", "expert_ffn_dim", int)
    take("num_experts", "n_routed_experts", int)
    take("num_local_experts", "n_routed_experts", int)
    take("num_experts_per_tok", "top_k", int)
    take("norm_topk_prob", "norm_topk", bool)
    take("num_attention_heads", "n_heads", int)
    take("num_key_value_heads", "n_kv_heads", int)
    take("head_dim", "head_dim", int)
    take("max_position_embeddings", "max_seq_len", int)
    take("rms_norm_eps", "norm_eps", float)
    take("initializer_range", "init_std", float)
    take("tie_word_embeddings", "tie_embeddings", bool)
    take("router_aux_loss_coef", "balance_loss_alpha", float)
    if out.get("n_routed_experts") == 0:
        raise ConfigError("num_experts=0: a Qwen3-MoE without experts is a dense Qwen3; moetrain trains MoE models")
    if "head_dim" not in out and "dim" in out and "n_heads" in out:
        out["head_dim"] = out["dim"] // out["n_heads"]
    if d.get("use_sliding_window"):
        raise ConfigError("use_sliding_window=true is not supported (moetrain's Qwen3 attention is full causal); "
                          "set it to false")
    step = r.get("decoder_sparse_step", int, 1)
    if step != 1:
        raise ConfigError(f"decoder_sparse_step={step} is not supported (only every layer MoE, after the "
                          "mlp_only_layers); use 1")
    dense = sorted(set(int(i) for i in (d.get("mlp_only_layers") or [])))
    if dense != list(range(len(dense))):
        raise ConfigError(f"mlp_only_layers={dense} is not supported: moetrain's dense layers are the first k "
                          f"(mlp_only_layers = [0, ..., k-1])")
    out["n_dense_layers"] = len(dense)
    if d.get("attention_bias"):
        raise ConfigError("attention_bias=true is not supported (Qwen3 projections have no bias)")
    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act={act!r}; moetrain's FFNs are SwiGLU, allowed: 'silu'")
    rp = d.get("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else {}
    scaling = d.get("rope_scaling") if isinstance(d.get("rope_scaling"), dict) else {}
    types = {rp.get("rope_type"), scaling.get("rope_type") or scaling.get("type")} - {None, "default"}
    if types:
        rope_type = sorted(types)[0]
        raise ConfigError(f"rope type {rope_type!r} is not supported for Qwen3-MoE; allowed: 'default' (plain RoPE)")
    theta_reader = r.block("rope_parameters") if isinstance(d.get("rope_parameters"), dict) else r
    if not theta_reader.has("rope_theta"):
        theta_reader = r
    if theta_reader.has("rope_theta"):
        out["rope_theta"] = theta_reader.get("rope_theta", float)
    extra = d.get(EXTRA_KEY) or {}
    if not isinstance(extra, dict):
        raise ConfigError(f"config key {EXTRA_KEY!r} must be a dict, got {type(extra).__name__}")
    bad = sorted(set(extra) - set(TRAINING_FIELDS))
    if bad:
        raise ConfigError(f"unexpected field(s) {bad} in the {EXTRA_KEY!r} block; allowed here: "
                          f"{sorted(TRAINING_FIELDS)}")
    out.update(extra)
    return Qwen3MoeConfig.from_dict(out)


def config_to_hf(cfg: Qwen3MoeConfig) -> dict[str, Any]:
    """The HF ``config.json`` dict of ``cfg`` (``qwen3_moe``; released keys plus v5 ``rope_parameters``);
    ``config_from_hf(config_to_hf(cfg)) == cfg``.

    Raises:
        ConfigError: ``cfg`` routes or is built unlike Qwen3-MoE (naming the field and the value it needs).
    """
    need = {"score_func": "softmax", "n_expert_groups": 1, "n_shared_experts": 0, "route_scale": 1.0,
            "bias_update_rate": 0.0, "mtp_depth": 0, "qk_norm": True, "qkv_bias": False, "shared_ffn_dim": 0}
    got = cfg.to_dict()
    bad = [f"model.{k}={got[k]!r} (needs {v!r})" for k, v in need.items() if got[k] != v]
    if bad:
        raise ConfigError(f"this Qwen3-MoE config has no HF architecture that computes like it: {', '.join(bad)}")
    return {
        "architectures": ["Qwen3MoeForCausalLM"],
        "model_type": "qwen3_moe",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "intermediate_size": cfg.dense_ffn_dim,
        "moe_intermediate_size": cfg.expert_ffn_dim,
        "num_experts": cfg.n_routed_experts,
        "num_experts_per_tok": cfg.top_k,
        "norm_topk_prob": cfg.norm_topk,
        "decoder_sparse_step": 1,
        "mlp_only_layers": list(range(cfg.n_dense_layers)),
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_kv_heads,
        "head_dim": cfg.head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "use_sliding_window": False,
        "sliding_window": None,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": None,
        "rope_parameters": {"rope_type": "default", "rope_theta": cfg.rope_theta},
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "initializer_range": cfg.init_std,
        "tie_word_embeddings": cfg.tie_embeddings,
        "router_aux_loss_coef": cfg.balance_loss_alpha,
        "output_router_logits": False,
        EXTRA_KEY: {k: v for k, v in training_fields(cfg).items() if k != "balance_loss_alpha"},
    }


def state_map(model: nn.Module) -> StateMap:
    """Every HF tensor of ``model`` (a whole Transformer or a pipeline stage: only what it holds, layers under their
    global indices, absent parts None) in checkpoint order, plus the stacked-layout alternatives."""
    cfg: Qwen3MoeConfig = model.cfg
    out = StateMap()
    if model.embed_tokens is not None:
        out.entries.append(TensorEntry("model.embed_tokens.weight", "embed_tokens.weight", model.embed_tokens.weight))
    for i, block in indexed(model.layers):
        hf, ours = f"model.layers.{i}.", f"layers.{i}."
        mlp = add_attention_entries(out, block, hf, ours, mtp=False)
        if isinstance(mlp, MoE):
            out.entries.append(TensorEntry(hf + "mlp.gate.weight", ours + "mlp.gate.weight", mlp.gate.weight))
            add_expert_entries(out, mlp.experts, hf + "mlp.experts.", ours + "mlp.experts.", cfg.n_routed_experts,
                               mtp=False)
    if model.norm is not None:
        out.entries.append(TensorEntry("model.norm.weight", "norm.weight", model.norm.weight))
    if model.lm_head is not None:
        tied = cfg.tie_embeddings
        out.entries.append(TensorEntry("lm_head.weight", "lm_head.weight", model.lm_head.weight, copy=tied,
                                       saved=not tied, tied_to="model.embed_tokens.weight" if tied else None))
    return out


class Qwen3MoeAdapter(StateDictAdapter):
    """The HF layout of Qwen3-MoE models."""

    model_types = ("qwen3_moe",)
    architectures = ("Qwen3MoeForCausalLM",)
    family = "Qwen3-MoE"

    def handles(self, cfg: ModelConfig) -> bool:
        """Every :class:`Qwen3MoeConfig`."""
        return isinstance(cfg, Qwen3MoeConfig)

    def config_from_hf(self, d: dict[str, Any]) -> Qwen3MoeConfig:
        """See :func:`config_from_hf`."""
        return config_from_hf(d)

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        """See :func:`config_to_hf`."""
        return config_to_hf(cfg)

    def state_map(self, model: nn.Module) -> StateMap:
        """See :func:`state_map`."""
        return state_map(model)

    def is_fp8_weight(self, hf_name: str) -> bool:
        """The linears of attention and of every FFN (dense and routed experts), as DeepSeek's FP8 layout."""
        return hf_name.startswith("model.layers.") and hf_name.endswith(
            tuple(f".{n}.weight" for n in ("q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj",
                                            "down_proj")))
