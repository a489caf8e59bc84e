"""The DeepSeek-V3/V2 family's Hugging Face layout (also Kimi-K2, a DeepSeek-V3 architecture): ``config.json`` <->
:class:`DeepSeekV3Config`, and the tensor names of a :class:`~moetrain.model.Transformer` in the released checkpoints.

Released layout (docs/reference.md section 7; one tensor per expert)::

    model.embed_tokens.weight                    embed_tokens.weight
    model.layers.{i}.input_layernorm.weight      layers.{i}.input_layernorm.weight  (same for post_attention_layernorm)
    model.layers.{i}.self_attn.X                 layers.{i}.self_attn.X   (q_a_proj, q_a_layernorm, q_b_proj, q_proj,
                                                                          kv_a_proj_with_mqa, kv_a_layernorm, kv_b_proj,
                                                                          o_proj)
    model.layers.{i}.mlp.{gate,up,down}_proj     layers.{i}.mlp.{w1,w3,w2}                 (dense FFN)
    model.layers.{i}.mlp.gate.weight             layers.{i}.mlp.gate.weight                (router)
    model.layers.{i}.mlp.gate.e_score_correction_bias  layers.{i}.mlp.gate.expert_bias     (buffer)
    model.layers.{i}.mlp.shared_experts.{gate,up,down}_proj  layers.{i}.mlp.shared_experts.{w1,w3,w2}
    model.layers.{i}.mlp.experts.{e}.gate_proj   layers.{i}.mlp.experts.w1_EFD[e]   (F, D)
    model.layers.{i}.mlp.experts.{e}.up_proj     layers.{i}.mlp.experts.w3_EFD[e]   (F, D)
    model.layers.{i}.mlp.experts.{e}.down_proj   layers.{i}.mlp.experts.w2_EDF[e]   (D, F)
    model.norm.weight, lm_head.weight            norm.weight, lm_head.weight
    model.layers.{n+k}.{enorm,hnorm,eh_proj}     mtp.{k}.{enorm,hnorm,eh_proj}       (n = n_layers, MTP depth k)
    model.layers.{n+k}.shared_head.norm          mtp.{k}.norm
    model.layers.{n+k}.{self_attn,mlp,...}       mtp.{k}.block.{self_attn,mlp,...}
    model.layers.{n+k}.embed_tokens / shared_head.head   copies of the main embedding / head: written on save,
                                                          shape-checked and otherwise ignored on load

The loader also accepts the stacked in-memory layout of ``transformers`` v5 (``mlp.experts.gate_up_proj`` (E, 2F, D)
and ``mlp.experts.down_proj`` (E, D, F)) and FP8 block-scaled weights (float8_e4m3fn + ``<name>_scale_inv``). A
V2-style model (softmax router, no expert-bias balancing: :func:`is_v2_layout`) is written as ``deepseek_v2``, which
has no ``e_score_correction_bias``.
"""

from __future__ import annotations

import math
import warnings
from typing import Any

from torch import nn

from moetrain.errors import ConfigError
from moetrain.model.config_base import TRAINING_FIELDS, ModelConfig
from moetrain.model.deepseek.config import DeepSeekV3Config
from moetrain.model.hf_config import HFConfigReader
from moetrain.model.state_dict import (SWIGLU_NAMES, StateDictAdapter, StateMap, TensorEntry, add_attention_entries,
                                       add_expert_entries, indexed, training_fields)
from moetrain.model.moe import MoE

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v2")
#: Key of the block in ``config.json`` that carries moetrain fields the HF config has no name for (training
#: coefficients, and the YaRN parameters of a model without YaRN) so that configs round-trip exactly.
EXTRA_KEY = "moetrain"
#: The keys without which config.json does not describe a model (transformers would fill them with DeepSeek-V3
#: 671B's sizes; a config missing one is refused rather than read as another model).
ARCH_KEYS = ("vocab_size", "hidden_size", "num_hidden_layers", "num_attention_heads", "moe_intermediate_size",
             "n_routed_experts", "num_experts_per_tok", "kv_lora_rank", "qk_nope_head_dim", "qk_rope_head_dim",
             "v_head_dim")
_YARN_FIELDS = ("rope_beta_fast", "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim", "rope_original_seq_len")


# ----------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------

def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def config_from_hf(d: dict[str, Any]) -> DeepSeekV3Config:
    """Build a :class:`DeepSeekV3Config` from a Hugging Face DeepSeek-V3/V2 ``config.json`` dict.

    Accepts both the released style (top-level ``rope_theta``, ``rope_scaling`` with key ``type``) and the
    ``transformers`` v5 style (``rope_parameters`` with ``rope_type``). Keys that do not affect the architecture
    (``bos_token_id``, ``use_cache``, quantization_config, ...) are ignored; keys absent from ``d`` take moetrain's
    defaults, except ``n_group``/``topk_group`` (absent or None -> 1), ``q_lora_rank`` (None -> 0),
    ``num_nextn_predict_layers`` (absent -> 0), ``scoring_func`` (absent -> sigmoid for V3, softmax for V2).
    A ``"moetrain"`` block (written by :func:`config_to_hf`) restores the fields HF has no name for.

    Raises:
        ConfigError: a missing :data:`ARCH_KEYS` key or a value of the wrong JSON type (naming the key and the type,
            :class:`~moetrain.model.hf_config.HFConfigReader`); unsupported ``model_type``, RoPE type,
            activation, MoE layer frequency, attention bias or V2 ``group_limited_greedy`` routing with several
            groups (its group score is the max, not a top-2 sum); and every inconsistency
            :class:`DeepSeekV3Config` itself rejects.
    """
    r = HFConfigReader(d)
    model_type = r.get("model_type", str, None)
    if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model_type={model_type!r} is not supported; moetrain reads {list(SUPPORTED_MODEL_TYPES)}"
                          " (DeepSeek-V3 / DeepSeek-V2 architectures)")
    is_v2 = model_type == "deepseek_v2"
    r.require(ARCH_KEYS, "the DeepSeek architecture")
    out: dict[str, Any] = {}

    def take(hf_key: str, name: str, tp: type) -> None:
        if r.has(hf_key):
            out[name] = r.get(hf_key, tp)

    take("vocab_size", "vocab_size", int)
    take("hidden_size", "dim", int)
    take("num_hidden_layers", "n_layers", int)
    take("first_k_dense_replace", "n_dense_layers", int)
    take("intermediate_size", "dense_ffn_dim", int)
    take("moe_intermediate_size", "expert_ffn_dim", int)
    take("n_routed_experts", "n_routed_experts", int)
    take("n_shared_experts", "n_shared_experts", int)
    take("num_experts_per_tok", "top_k", int)
    take("norm_topk_prob", "norm_topk", bool)
    take("routed_scaling_factor", "route_scale", float)
    take("num_attention_heads", "n_heads", int)
    take("kv_lora_rank", "kv_lora_rank", int)
    take("qk_nope_head_dim", "qk_nope_head_dim", int)
    take("qk_rope_head_dim", "qk_rope_head_dim", int)
    take("v_head_dim", "v_head_dim", int)
    take("max_position_embeddings", "max_seq_len", int)
    take("rms_norm_eps", "norm_eps", float)
    take("initializer_range", "init_std", float)
    take("rope_interleave", "rope_interleave", bool)
    take("tie_word_embeddings", "tie_embeddings", bool)
    out["q_lora_rank"] = r.get("q_lora_rank", int, 0)
    out["mtp_depth"] = r.get("num_nextn_predict_layers", int, 0) or r.get("num_mtp_layers", int, 0)
    out["score_func"] = r.get("scoring_func", str, None) or ("softmax" if is_v2 else "sigmoid")
    n_group = r.get("n_group", int, 1)
    topk_group = r.get("topk_group", int, 1)
    topk_method = r.get("topk_method", str, None)
    if is_v2 and topk_method in (None, "greedy"):
        n_group = topk_group = 1  # HF/DeepSeek V2 "greedy" ignores the groups
    elif is_v2 and topk_method == "group_limited_greedy" and n_group > 1:
        raise ConfigError(f"topk_method='group_limited_greedy' with n_group={n_group}: DeepSeek-V2 scores a group by "
                          "its best expert, moetrain (V3) by the sum of its top-2; this routing is not supported")
    out["n_expert_groups"], out["n_limited_groups"] = n_group, topk_group
    if is_v2:
        out["bias_update_rate"] = 0.0  # V2 has no expert-bias (aux-loss-free) balancing

    act = r.get("hidden_act", str, "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act={act!r}; moetrain's FFNs are SwiGLU, allowed: 'silu'")
    if r.get("attention_bias", bool, False):
        raise ConfigError("attention_bias=True is not supported (MLA projections have no bias)")
    if r.get("moe_layer_freq", int, 1) != 1:
        raise ConfigError(f"moe_layer_freq={d['moe_layer_freq']}; moetrain supports only 1 (every layer after the "
                          "first_k_dense_replace dense ones is MoE)")

    # --- RoPE ---------------------------------------------------------------------------------------------------
    rp = r.block("rope_parameters")
    if not rp.d:
        rp = r.block("rope_scaling")
    theta = rp.get("rope_theta", float, None)
    theta = theta if theta is not None else r.get("rope_theta", float, None)
    if theta is not None:
        out["rope_theta"] = theta
    rope_type = rp.get("rope_type", str, None) or rp.get("type", str, None) or "default"
    if rope_type == "default":
        out["rope_factor"] = 1.0
    elif rope_type == "yarn":
        max_pos = r.get("max_position_embeddings", int, DeepSeekV3Config.max_seq_len)
        orig = (rp.get("original_max_position_embeddings", int, None)
                or r.get("original_max_position_embeddings", int, None) or max_pos)
        factor = rp.get("factor", float, None)
        factor = factor if factor is not None else max_pos / orig
        out["rope_factor"] = factor
        out["rope_original_seq_len"] = orig
        out["rope_beta_fast"] = rp.get("beta_fast", float, None) or 32.0
        out["rope_beta_slow"] = rp.get("beta_slow", float, None) or 1.0
        mscale, mscale_all = rp.get("mscale", float, None), rp.get("mscale_all_dim", float, None)
        out["rope_mscale"] = mscale if mscale is not None else 1.0
        out["rope_mscale_all_dim"] = mscale_all if mscale_all is not None else 0.0
        # HF/YaRN scale cos and sin by attention_factor: given, else mscale(f, mscale)/mscale(f, mscale_all_dim)
        # when both are set, else mscale(f, 1). moetrain applies the ratio only when both are set, otherwise 1.
        if mscale and mscale_all:
            hf_attn = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            hf_attn = _yarn_mscale(factor, 1.0)
        if rp.has("attention_factor"):
            hf_attn = rp.get("attention_factor", float)
        ours = (_yarn_mscale(factor, out["rope_mscale"]) / _yarn_mscale(factor, out["rope_mscale_all_dim"])
                if out["rope_mscale"] and out["rope_mscale_all_dim"] else 1.0)
        if factor > 1 and abs(hf_attn - ours) > 1e-12:
            warnings.warn(f"YaRN attention factor {hf_attn:.6g} of this HF config (mscale={mscale}, mscale_all_dim="
                          f"{mscale_all}, attention_factor={rp.d.get('attention_factor')}) is not representable; "
                          f"moetrain will scale cos/sin by {ours:.6g}", stacklevel=2)
        if rp.get("truncate", bool, True) is False:
            warnings.warn("YaRN truncate=False is not supported; moetrain floors/ceils the correction range",
                          stacklevel=2)
    else:
        raise ConfigError(f"rope type {rope_type!r} is not supported; allowed: 'default' (plain RoPE), 'yarn'")

    extra = r.get(EXTRA_KEY, dict, {})
    allowed = set(TRAINING_FIELDS) | (set(_YARN_FIELDS) if out["rope_factor"] == 1.0 else set())
    bad = sorted(set(extra) - allowed)
    if bad:
        raise ConfigError(f"unexpected field(s) {bad} in the {EXTRA_KEY!r} block; allowed here: {sorted(allowed)}")
    out.update(extra)
    return DeepSeekV3Config.from_dict(out)


def is_v2_layout(cfg: DeepSeekV3Config) -> bool:
    """A DeepSeek-V2-style model (softmax router, no expert-bias balancing): written as ``deepseek_v2``, whose HF
    modeling routes with a softmax and has no ``e_score_correction_bias`` -- ``DeepseekV3`` hard-codes the sigmoid."""
    return cfg.score_func == "softmax" and cfg.bias_update_rate == 0


def config_to_hf(cfg: DeepSeekV3Config) -> dict[str, Any]:
    """The HF ``config.json`` dict of ``cfg`` (DeepSeek-V3 keys, released style plus v5 ``rope_parameters``; a
    V2-style model, :func:`is_v2_layout`, as ``deepseek_v2``).

    ``config_from_hf(config_to_hf(cfg)) == cfg`` for every valid config.

    Raises:
        ConfigError: a V2-style model with several expert groups (V2's group-limited routing scores a group by its
            best expert, moetrain by its top-2 sum: no HF architecture routes this way).
    """
    if is_v2_layout(cfg) and cfg.n_expert_groups > 1:
        raise ConfigError(f"a softmax-routed model with model.n_expert_groups={cfg.n_expert_groups} has no HF "
                          "architecture that routes like it (DeepSeek-V2 scores a group by its best expert); export "
                          "needs n_expert_groups=1 or sigmoid routing")
    rope_scaling = None
    extra: dict[str, Any] = training_fields(cfg)
    if cfg.rope_factor > 1.0:
        rope_scaling = {
            "type": "yarn", "rope_type": "yarn", "factor": cfg.rope_factor,
            "original_max_position_embeddings": cfg.rope_original_seq_len,
            "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow,
            "mscale": cfg.rope_mscale, "mscale_all_dim": cfg.rope_mscale_all_dim,
        }
        rope_parameters = {k: v for k, v in rope_scaling.items() if k != "type"} | {"rope_theta": cfg.rope_theta}
    else:
        rope_parameters = {"rope_type": "default", "rope_theta": cfg.rope_theta}
        extra.update({name: getattr(cfg, name) for name in _YARN_FIELDS})
    v2 = is_v2_layout(cfg)
    return {
        "architectures": ["DeepseekV2ForCausalLM" if v2 else "DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v2" if v2 else "deepseek_v3",
        "vocab_size": cfg.vocab_size,
        "hidden_size": cfg.dim,
        "num_hidden_layers": cfg.n_layers,
        "first_k_dense_replace": cfg.n_dense_layers,
        "intermediate_size": cfg.dense_ffn_dim,
        "moe_intermediate_size": cfg.expert_ffn_dim,
        "moe_layer_freq": 1,
        "n_routed_experts": cfg.n_routed_experts,
        "n_shared_experts": cfg.n_shared_experts,
        "num_experts_per_tok": cfg.top_k,
        "n_group": cfg.n_expert_groups,
        "topk_group": cfg.n_limited_groups,
        "topk_method": "greedy" if v2 else "noaux_tc",
        "scoring_func": cfg.score_func,
        "norm_topk_prob": cfg.norm_topk,
        "routed_scaling_factor": cfg.route_scale,
        "num_attention_heads": cfg.n_heads,
        "num_key_value_heads": cfg.n_heads,
        "q_lora_rank": cfg.q_lora_rank or None,
        "kv_lora_rank": cfg.kv_lora_rank,
        "qk_nope_head_dim": cfg.qk_nope_head_dim,
        "qk_rope_head_dim": cfg.qk_rope_head_dim,
        "v_head_dim": cfg.v_head_dim,
        "hidden_act": "silu",
        "attention_bias": False,
        "attention_dropout": 0.0,
        "rope_theta": cfg.rope_theta,
        "rope_scaling": rope_scaling,
        "rope_parameters": rope_parameters,
        "rope_interleave": cfg.rope_interleave,
        "max_position_embeddings": cfg.max_seq_len,
        "rms_norm_eps": cfg.norm_eps,
        "initializer_range": cfg.init_std,
        "num_nextn_predict_layers": cfg.mtp_depth,
        "tie_word_embeddings": cfg.tie_embeddings,
        EXTRA_KEY: extra,
    }


# ----------------------------------------------------------------------------------------------------------------
# Tensor names
# ----------------------------------------------------------------------------------------------------------------

#: HF weights an FP8 export stores as float8_e4m3fn with a ``weight_scale_inv`` (layout: docs/reference.md section
#: 7): the linears of attention and of every FFN (dense, shared and routed experts), the GEMMs FP8 training runs in
#: FP8. Embedding, head, norms, the router and MTP's ``eh_proj`` stay in the high-precision dtype (whether the
#: release quantises ``eh_proj`` is not recorded here; the loader reads either form).
FP8_WEIGHT_SUFFIXES = tuple(f".{n}.weight" for n in ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa",
                                                      "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))


def is_fp8_weight(hf_name: str) -> bool:
    """Whether the released FP8 layout stores HF tensor ``hf_name`` in FP8 (see :data:`FP8_WEIGHT_SUFFIXES`)."""
    return hf_name.startswith("model.layers.") and hf_name.endswith(FP8_WEIGHT_SUFFIXES) and ".eh_proj." not in hf_name


def _block_entries(block: nn.Module, hf: str, ours: str, cfg: DeepSeekV3Config, mtp: bool) -> StateMap:
    """The tensors of one transformer block (a main layer, or an MTP module's block)."""
    out = StateMap()
    ent = out.entries
    mlp = add_attention_entries(out, block, hf, ours, mtp)
    if not isinstance(mlp, MoE):
        return out
    v2 = is_v2_layout(cfg)
    ent.append(TensorEntry(hf + "mlp.gate.weight", ours + "mlp.gate.weight", mlp.gate.weight, mtp=mtp))
    # V2 has no expert bias (and a V2-style run never moves it: bias_update_rate = 0): not written, and a V2
    # checkpoint without any leaves the biases at zero.
    ent.append(TensorEntry(hf + "mlp.gate.e_score_correction_bias", ours + "mlp.gate.expert_bias",
                           mlp.gate.expert_bias, saved=not v2, keep_fp32=True, optional=v2, mtp=mtp))
    if mlp.shared_experts is not None:
        for a, b in SWIGLU_NAMES:
            ent.append(TensorEntry(hf + f"mlp.shared_experts.{b}.weight", ours + f"mlp.shared_experts.{a}.weight",
                                   getattr(mlp.shared_experts, a).weight, mtp=mtp))
    add_expert_entries(out, mlp.experts, hf + "mlp.experts.", ours + "mlp.experts.", cfg.n_routed_experts, mtp)
    return out


def state_map(model: nn.Module) -> StateMap:
    """Every HF tensor of ``model`` in checkpoint order, plus the stacked-layout alternatives. ``model`` is a whole
    Transformer or a pipeline stage (``moetrain.model.stage.TransformerStage``: only what it holds, layers under
    their global indices, absent parts None; a last stage's embedding copy reads the main embedding)."""
    cfg: DeepSeekV3Config = model.cfg
    embed, head = model.embed_tokens, model.lm_head
    out = StateMap()
    if embed is not None:
        out.entries.append(TensorEntry("model.embed_tokens.weight", "embed_tokens.weight", embed.weight))

    def add(part: StateMap) -> None:
        out.entries.extend(part.entries)
        out.stacked.extend(part.stacked)

    for i, block in indexed(model.layers):
        add(_block_entries(block, f"model.layers.{i}.", f"layers.{i}.", cfg, mtp=False))
    if model.norm is not None:
        out.entries.append(TensorEntry("model.norm.weight", "norm.weight", model.norm.weight))
    if head is not None:
        tied = cfg.tie_embeddings  # HF does not store a tied head; one that is stored must equal the embedding
        out.entries.append(TensorEntry("lm_head.weight", "lm_head.weight", head.weight, copy=tied, saved=not tied,
                                       tied_to="model.embed_tokens.weight" if tied else None))
    for k, mtp in indexed(model.mtp):
        hf, ours = f"model.layers.{cfg.n_layers + k}.", f"mtp.{k}."
        out.entries.append(TensorEntry(hf + "embed_tokens.weight", "embed_tokens.weight", embed.weight, copy=True,
                                       mtp=True))
        for n in ("enorm", "hnorm", "eh_proj"):
            out.entries.append(TensorEntry(hf + f"{n}.weight", ours + f"{n}.weight", getattr(mtp, n).weight, mtp=True))
        add(_block_entries(mtp.block, hf, ours + "block.", cfg, mtp=True))
        out.entries.append(TensorEntry(hf + "shared_head.norm.weight", ours + "norm.weight", mtp.norm.weight,
                                       mtp=True))
        out.entries.append(TensorEntry(hf + "shared_head.head.weight", "lm_head.weight", head.weight, copy=True,
                                       mtp=True))
    return out


class DeepSeekAdapter(StateDictAdapter):
    """The HF layout of DeepSeek-V3 and DeepSeek-V2 models (and of presets with their architecture, e.g. Kimi-K2)."""

    model_types = SUPPORTED_MODEL_TYPES
    architectures = ("DeepseekV3ForCausalLM", "DeepseekV2ForCausalLM")
    family = "DeepSeek-V3 / DeepSeek-V2 architectures"

    def handles(self, cfg: ModelConfig) -> bool:
        """Every :class:`DeepSeekV3Config` (MLA attention, DeepSeekMoE routing)."""
        return isinstance(cfg, DeepSeekV3Config)

    def config_from_hf(self, d: dict[str, Any]) -> DeepSeekV3Config:
        """See :func:`config_from_hf`."""
        return config_from_hf(d)

    def config_to_hf(self, cfg: ModelConfig) -> dict[str, Any]:
        """See :func:`config_to_hf`."""
        return config_to_hf(cfg)

    def state_map(self, model: nn.Module) -> StateMap:
        """See :func:`state_map`."""
        return state_map(model)

    def is_fp8_weight(self, hf_name: str) -> bool:
        """See :func:`is_fp8_weight`."""
        return is_fp8_weight(hf_name)
