"""Hugging Face interchange for DeepSeek-V3/V2 models: ``config.json`` <-> :class:`ModelConfig`, and safetensors
checkpoints in the released layout <-> a :class:`~moetrain.model.Transformer`.

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
and ``mlp.experts.down_proj`` (E, D, F)) and FP8 block-scaled weights (float8_e4m3fn + ``<name>_scale_inv``).

Loading streams tensor by tensor (``safe_open``) and reads, of each tensor, only the box this process holds (its
FSDP2 shard; under expert parallelism only its own experts), from the placement of the parameter itself. Saving
writes one shard at a time into a temporary directory that is renamed onto the target only when complete, from a
whole model (:func:`save_hf_checkpoint`) or from any source of tensors (:func:`write_hf_checkpoint`, which
``moetrain export`` feeds from a DCP checkpoint).
"""

from __future__ import annotations

import json
import math
import os
import shutil
import tempfile
import uuid
import warnings
from dataclasses import dataclass, field
from pathlib import Path
from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from moetrain.errors import CheckpointError
from moetrain.fsutil import fsync_path
from moetrain.model.config import TRAINING_FIELDS, ConfigError, ModelConfig
from moetrain.model.init import ShardBox
from moetrain.model.moe import MoE

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v2")
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
FP8_BLOCK = 128
#: Key of the block in ``config.json`` that carries moetrain fields the HF config has no name for (training
#: coefficients, and the YaRN parameters of a model without YaRN) so that configs round-trip exactly.
EXTRA_KEY = "moetrain"
_YARN_FIELDS = ("rope_beta_fast", "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim", "rope_original_seq_len")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # non-persistent buffers some old exports contain


# ----------------------------------------------------------------------------------------------------------------
# Config
# ----------------------------------------------------------------------------------------------------------------

def _yarn_mscale(factor: float, mscale: float) -> float:
    return 1.0 if factor <= 1 else 0.1 * mscale * math.log(factor) + 1.0


def config_from_hf(d: dict[str, Any]) -> ModelConfig:
    """Build a :class:`ModelConfig` from a Hugging Face DeepSeek-V3/V2 ``config.json`` dict.

    Accepts both the released style (top-level ``rope_theta``, ``rope_scaling`` with key ``type``) and the
    ``transformers`` v5 style (``rope_parameters`` with ``rope_type``). Keys that do not affect the architecture
    (``bos_token_id``, ``use_cache``, quantization_config, ...) are ignored; keys absent from ``d`` take moetrain's
    defaults, except ``n_group``/``topk_group`` (absent or None -> 1), ``q_lora_rank`` (None -> 0),
    ``num_nextn_predict_layers`` (absent -> 0), ``scoring_func`` (absent -> sigmoid for V3, softmax for V2).
    A ``"moetrain"`` block (written by :func:`config_to_hf`) restores the fields HF has no name for.

    Raises:
        ConfigError: unsupported ``model_type``, RoPE type, activation, MoE layer frequency, attention bias or
            V2 ``group_limited_greedy`` routing with several groups (its group score is the max, not a top-2 sum);
            and every inconsistency :class:`ModelConfig` itself rejects.
    """
    if not isinstance(d, dict):
        raise ConfigError(f"expected a config dict, got {type(d).__name__}")
    model_type = d.get("model_type")
    if model_type is not None and model_type not in SUPPORTED_MODEL_TYPES:
        raise ConfigError(f"model_type={model_type!r} is not supported; moetrain reads {list(SUPPORTED_MODEL_TYPES)}"
                          " (DeepSeek-V3 / DeepSeek-V2 architectures)")
    is_v2 = model_type == "deepseek_v2"
    out: dict[str, Any] = {}

    def take(hf_key: str, name: str, conv=lambda v: v) -> None:
        if d.get(hf_key) is not None:
            out[name] = conv(d[hf_key])

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
    out["q_lora_rank"] = int(d["q_lora_rank"]) if d.get("q_lora_rank") is not None else 0
    out["mtp_depth"] = int(d.get("num_nextn_predict_layers") or d.get("num_mtp_layers") or 0)
    out["score_func"] = d.get("scoring_func") or ("softmax" if is_v2 else "sigmoid")
    n_group = int(d.get("n_group") or 1)
    topk_group = int(d.get("topk_group") or 1)
    topk_method = d.get("topk_method")
    if is_v2 and topk_method in (None, "greedy"):
        n_group = topk_group = 1  # HF/DeepSeek V2 "greedy" ignores the groups
    elif is_v2 and topk_method == "group_limited_greedy" and n_group > 1:
        raise ConfigError(f"topk_method='group_limited_greedy' with n_group={n_group}: DeepSeek-V2 scores a group by "
                          "its best expert, moetrain (V3) by the sum of its top-2; this routing is not supported")
    out["n_expert_groups"], out["n_limited_groups"] = n_group, topk_group
    if is_v2:
        out["bias_update_rate"] = 0.0  # V2 has no expert-bias (aux-loss-free) balancing

    act = d.get("hidden_act", "silu")
    if act != "silu":
        raise ConfigError(f"hidden_act={act!r}; moetrain's FFNs are SwiGLU, allowed: 'silu'")
    if d.get("attention_bias"):
        raise ConfigError("attention_bias=True is not supported (MLA projections have no bias)")
    if (d.get("moe_layer_freq") or 1) != 1:
        raise ConfigError(f"moe_layer_freq={d['moe_layer_freq']}; moetrain supports only 1 (every layer after the "
                          "first_k_dense_replace dense ones is MoE)")

    # --- RoPE ---------------------------------------------------------------------------------------------------
    rp = d.get("rope_parameters")
    if not isinstance(rp, dict) or not rp:
        rp = d.get("rope_scaling") if isinstance(d.get("rope_scaling"), dict) else {}
    theta = rp.get("rope_theta") if rp.get("rope_theta") is not None else d.get("rope_theta")
    if theta is not None:
        out["rope_theta"] = float(theta)
    rope_type = rp.get("rope_type") or rp.get("type") or "default"
    if rope_type == "default":
        out["rope_factor"] = 1.0
    elif rope_type == "yarn":
        max_pos = int(d.get("max_position_embeddings") or ModelConfig.max_seq_len)
        orig = rp.get("original_max_position_embeddings") or d.get("original_max_position_embeddings") or max_pos
        factor = rp.get("factor")
        factor = float(factor) if factor is not None else max_pos / orig
        out["rope_factor"] = factor
        out["rope_original_seq_len"] = int(orig)
        out["rope_beta_fast"] = float(rp.get("beta_fast") or 32.0)
        out["rope_beta_slow"] = float(rp.get("beta_slow") or 1.0)
        mscale, mscale_all = rp.get("mscale"), rp.get("mscale_all_dim")
        out["rope_mscale"] = float(mscale) if mscale is not None else 1.0
        out["rope_mscale_all_dim"] = float(mscale_all) if mscale_all is not None else 0.0
        # HF/YaRN scale cos and sin by attention_factor: given, else mscale(f, mscale)/mscale(f, mscale_all_dim)
        # when both are set, else mscale(f, 1). moetrain applies the ratio only when both are set, otherwise 1.
        if mscale and mscale_all:
            hf_attn = _yarn_mscale(factor, mscale) / _yarn_mscale(factor, mscale_all)
        else:
            hf_attn = _yarn_mscale(factor, 1.0)
        if rp.get("attention_factor") is not None:
            hf_attn = float(rp["attention_factor"])
        ours = (_yarn_mscale(factor, out["rope_mscale"]) / _yarn_mscale(factor, out["rope_mscale_all_dim"])
                if out["rope_mscale"] and out["rope_mscale_all_dim"] else 1.0)
        if factor > 1 and abs(hf_attn - ours) > 1e-12:
            warnings.warn(f"YaRN attention factor {hf_attn:.6g} of this HF config (mscale={mscale}, mscale_all_dim="
                          f"{mscale_all}, attention_factor={rp.get('attention_factor')}) is not representable; "
                          f"moetrain will scale cos/sin by {ours:.6g}", stacklevel=2)
        if rp.get("truncate") is False:
            warnings.warn("YaRN truncate=False is not supported; moetrain floors/ceils the correction range",
                          stacklevel=2)
    else:
        raise ConfigError(f"rope type {rope_type!r} is not supported; allowed: 'default' (plain RoPE), 'yarn'")

    extra = d.get(EXTRA_KEY) or {}
    if not isinstance(extra, dict):
        raise ConfigError(f"config key {EXTRA_KEY!r} must be a dict, got {type(extra).__name__}")
    allowed = set(TRAINING_FIELDS) | (set(_YARN_FIELDS) if out["rope_factor"] == 1.0 else set())
    bad = sorted(set(extra) - allowed)
    if bad:
        raise ConfigError(f"unexpected field(s) {bad} in the {EXTRA_KEY!r} block; allowed here: {sorted(allowed)}")
    out.update(extra)
    return ModelConfig.from_dict(out)


def is_v2_layout(cfg: ModelConfig) -> bool:
    """A DeepSeek-V2-style model (softmax router, no expert-bias balancing): written as ``deepseek_v2``, whose HF
    modeling routes with a softmax and has no ``e_score_correction_bias`` -- ``DeepseekV3`` hard-codes the sigmoid."""
    return cfg.score_func == "softmax" and cfg.bias_update_rate == 0


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
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
    extra: dict[str, Any] = {name: getattr(cfg, name) for name in TRAINING_FIELDS}
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


def load_hf_config(path: str | os.PathLike) -> ModelConfig:
    """Read ``config.json`` (a file, or a checkpoint directory holding one) into a :class:`ModelConfig`."""
    p = Path(path)
    if p.is_dir():
        p = p / CONFIG_NAME
    if not p.is_file():
        raise FileNotFoundError(f"no HF config at {p}")
    with open(p) as f:
        return config_from_hf(json.load(f))


# ----------------------------------------------------------------------------------------------------------------
# Name mapping
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class _Entry:
    """One HF tensor and the region of one model tensor it fills.

    tensor: the destination parameter/buffer (plain, DTensor or meta; its *global* shape is what counts);
    expert: the global expert index within a stacked expert tensor (None = the whole tensor); row_offset: first row
    of that expert's slab (F for the up projection inside w13); copy: a duplicate of another tensor (MTP's copies of
    the embedding and head, a tied head) -- written on save, only shape-checked on load."""

    hf_name: str
    name: str
    tensor: torch.Tensor
    expert: int | None = None
    row_offset: int = 0
    rows: int | None = None
    copy: bool = False
    n_experts: int | None = None  # a stacked expert tensor: E of the config (the local tensor may hold fewer)

    @property
    def shape(self) -> tuple[int, ...]:
        """The HF tensor's shape."""
        g = tuple(self.tensor.shape)
        if self.expert is None:
            return (self.n_experts, *g[1:]) if self.n_experts else g
        return (self.rows if self.rows is not None else g[1], *g[2:])

    def region(self) -> tuple[int, ...]:
        """Offsets of the HF tensor inside the global model tensor (leading expert index included)."""
        if self.expert is None:
            return (0,) * self.tensor.dim()
        return (self.expert, self.row_offset) + (0,) * (self.tensor.dim() - 2)

    def view(self) -> torch.Tensor:
        """The region in a plain (unsharded) tensor."""
        if self.expert is None:
            return self.tensor
        return self.tensor[self.expert, self.row_offset:self.row_offset + self.shape[0]]


@dataclass
class _Packed:
    """A stacked expert tensor of the transformers-v5 in-memory layout (all E experts of one layer): gate_up_proj
    (E, 2F, D) is exactly ``w13_E2FD``, down_proj (E, D, F) exactly ``w2_EDF``."""

    hf_name: str
    entry: _Entry
    covers: list[str]  # the per-expert names it stands for


_SWIGLU = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))


def _block_entries(block: nn.Module, hf: str, ours: str, E: int) -> tuple[list[_Entry], list[_Packed]]:
    entries = [_Entry(hf + f"{n}.weight", ours + f"{n}.weight", getattr(block, n).weight)
               for n in ("input_layernorm", "post_attention_layernorm")]
    for pname, p in block.self_attn.named_parameters():
        entries.append(_Entry(hf + "self_attn." + pname, ours + "self_attn." + pname, p))
    packed: list[_Packed] = []
    mlp = block.mlp
    if not isinstance(mlp, MoE):
        for a, b in _SWIGLU:
            entries.append(_Entry(hf + f"mlp.{b}.weight", ours + f"mlp.{a}.weight", getattr(mlp, a).weight))
        return entries, packed
    entries.append(_Entry(hf + "mlp.gate.weight", ours + "mlp.gate.weight", mlp.gate.weight))
    entries.append(_Entry(hf + "mlp.gate.e_score_correction_bias", ours + "mlp.gate.expert_bias",
                          mlp.gate.expert_bias))
    if mlp.shared_experts is not None:
        for a, b in _SWIGLU:
            entries.append(_Entry(hf + f"mlp.shared_experts.{b}.weight", ours + f"mlp.shared_experts.{a}.weight",
                                  getattr(mlp.shared_experts, a).weight))
    w13, w2 = mlp.experts.w13_E2FD, mlp.experts.w2_EDF
    F = w13.shape[1] // 2
    gate_up, down = [], []
    for e in range(E):
        x = hf + f"mlp.experts.{e}."
        gate_up += [_Entry(x + "gate_proj.weight", ours + "mlp.experts.w13_E2FD", w13, e, 0, F),
                    _Entry(x + "up_proj.weight", ours + "mlp.experts.w13_E2FD", w13, e, F, F)]
        down.append(_Entry(x + "down_proj.weight", ours + "mlp.experts.w2_EDF", w2, e))
    entries += [t for e in range(E) for t in (gate_up[2 * e], gate_up[2 * e + 1], down[e])]
    for name, ours_name, t, covered in (("gate_up_proj", "w13_E2FD", w13, gate_up), ("down_proj", "w2_EDF", w2, down)):
        whole = _Entry(hf + "mlp.experts." + name, ours + "mlp.experts." + ours_name, t, n_experts=E)
        packed.append(_Packed(whole.hf_name, whole, [c.hf_name for c in covered]))
    return entries, packed


def _indexed(mods: nn.Module) -> list[tuple[int, nn.Module]]:
    """(global index, module) of a ModuleList, or of a pipeline stage's ModuleDict keyed by global index."""
    if isinstance(mods, nn.ModuleDict):
        return [(int(k), m) for k, m in mods.items()]
    return list(enumerate(mods))


def _entries(model: nn.Module) -> tuple[list[_Entry], list[_Packed]]:
    """Every HF tensor of ``model`` in checkpoint order, plus the stacked-layout alternatives. ``model`` is a whole
    Transformer or a pipeline stage (``moetrain.model.stage.TransformerStage``: only what it holds, layers under
    their global indices; a last stage's embedding copy reads the main embedding)."""
    cfg: ModelConfig = model.cfg
    embed = getattr(model, "embed_tokens", None)
    head = getattr(model, "lm_head", None)
    out = [_Entry("model.embed_tokens.weight", "embed_tokens.weight", embed.weight)] if embed is not None else []
    packed: list[_Packed] = []
    for i, block in _indexed(model.layers):
        e, p = _block_entries(block, f"model.layers.{i}.", f"layers.{i}.", cfg.n_routed_experts)
        out += e
        packed += p
    if getattr(model, "norm", None) is not None:
        out.append(_Entry("model.norm.weight", "norm.weight", model.norm.weight))
    if head is not None:
        out.append(_Entry("lm_head.weight", "lm_head.weight", head.weight, copy=cfg.tie_embeddings))
    for k, mtp in _indexed(model.mtp):
        hf, ours = f"model.layers.{cfg.n_layers + k}.", f"mtp.{k}."
        out.append(_Entry(hf + "embed_tokens.weight", "embed_tokens.weight", embed.weight, copy=True))
        for n in ("enorm", "hnorm", "eh_proj"):
            out.append(_Entry(hf + f"{n}.weight", ours + f"{n}.weight", getattr(mtp, n).weight))
        e, p = _block_entries(mtp.block, hf, ours + "block.", cfg.n_routed_experts)
        out += e
        packed += p
        out.append(_Entry(hf + "shared_head.norm.weight", ours + "norm.weight", mtp.norm.weight))
        out.append(_Entry(hf + "shared_head.head.weight", "lm_head.weight", head.weight, copy=True))
    return out, packed


def _overlap(entry: _Entry, box: tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]
             ) -> tuple[tuple[slice, ...], torch.Tensor] | None:
    """Where ``entry``'s HF tensor meets this rank's box of its model tensor: (slices into the HF tensor, the
    matching view of the local tensor), or None when this rank holds none of it."""
    _, offsets, local = box
    region = entry.region()
    lead = 1 if entry.expert is not None else 0
    if lead:
        i = entry.expert - offsets[0]
        if not 0 <= i < local.shape[0]:
            return None
        local = local[i]
    hf_sl, loc_sl = [], []
    for d, n in enumerate(entry.shape):
        lo, hi = region[lead + d], region[lead + d] + n
        b0, b1 = offsets[lead + d], offsets[lead + d] + local.shape[d]
        a, b = max(lo, b0), min(hi, b1)
        if a >= b:
            return None
        hf_sl.append(slice(a - lo, b - lo))
        loc_sl.append(slice(a - b0, b - b0))
    return tuple(hf_sl), local[tuple(loc_sl)]


def hf_tensor_names(model: nn.Module) -> list[str]:
    """The HF names :func:`save_hf_checkpoint` writes for ``model``, in order (a tied head is not written)."""
    return [e.hf_name for e in _entries(model)[0] if not (e.copy and e.hf_name == "lm_head.weight")]


# ----------------------------------------------------------------------------------------------------------------
# FP8
# ----------------------------------------------------------------------------------------------------------------

def dequantize_fp8_blockwise(w_fp8: torch.Tensor, scale_inv: torch.Tensor, block: int = FP8_BLOCK) -> torch.Tensor:
    """W = W_fp8 * scale_inv per ``block`` x ``block`` tile (edge tiles cropped). Returns fp32 (out, in).

    ``scale_inv`` has shape (ceil(out/block), ceil(in/block)), as in the released DeepSeek-V3 FP8 weights."""
    if w_fp8.dim() != 2:
        raise CheckpointError(f"FP8 block dequantisation needs a 2-D weight, got shape {tuple(w_fp8.shape)}")
    rows, cols = w_fp8.shape
    want = (math.ceil(rows / block), math.ceil(cols / block))
    if tuple(scale_inv.shape) != want:
        raise CheckpointError(f"scale_inv of shape {tuple(scale_inv.shape)} does not fit a {rows}x{cols} weight "
                              f"in {block}x{block} blocks (expected {want})")
    s = scale_inv.float().repeat_interleave(block, 0)[:rows].repeat_interleave(block, 1)[:, :cols]
    return w_fp8.float() * s


_FP8_DTYPES = tuple(getattr(torch, n) for n in ("float8_e4m3fn", "float8_e5m2") if hasattr(torch, n))
_FP8_ST_DTYPES = ("F8_E4M3", "F8_E5M2")


# ----------------------------------------------------------------------------------------------------------------
# Load
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class LoadResult:
    """What :func:`load_hf_checkpoint` did.

    Attributes:
        loaded: tensors copied into the model (per-expert tensors count one each).
        skipped_nonlocal: experts present in the checkpoint but held by other expert-parallel ranks (not read).
        missing: HF names the model needs that the checkpoint lacks. unexpected: checkpoint names the model lacks.
        mtp_missing: the checkpoint has none of the MTP tensors (accepted with ``mtp_optional``).
        files: the safetensors files read.
    """

    loaded: int = 0
    skipped_nonlocal: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)
    mtp_missing: bool = False


def _checkpoint_files(path: Path) -> tuple[list[Path], dict[str, Path]]:
    """The safetensors files of a checkpoint and, for sharded ones, the file of every tensor name."""
    if path.is_file():
        if path.name == INDEX_NAME:
            path = path.parent
        else:
            return [path], {}
    index = path / INDEX_NAME
    if index.is_file():
        with open(index) as f:
            weight_map = json.load(f)["weight_map"]
        files = sorted(set(weight_map.values()))
        missing = [fn for fn in files if not (path / fn).is_file()]
        if missing:
            raise CheckpointError(f"{index} names shard(s) that do not exist: {missing[:5]}")
        return [path / fn for fn in files], {k: path / v for k, v in weight_map.items()}
    single = path / SINGLE_NAME
    if single.is_file():
        return [single], {}
    raise CheckpointError(f"no {SINGLE_NAME} or {INDEX_NAME} in {path}")


def _fmt_shape(s) -> str:
    return "(" + ", ".join(str(int(x)) for x in s) + ")"


def _shape_error(hf_name: str, ours: str, got, want) -> CheckpointError:
    return CheckpointError(f"tensor {hf_name!r} has shape {_fmt_shape(got)} in the checkpoint but the model's {ours!r} "
                           f"expects {_fmt_shape(want)}: is this a checkpoint from a different model/config?")


@torch.no_grad()
def load_hf_checkpoint(model: nn.Module, path: str | os.PathLike, strict: bool = True,
                       shard_box: ShardBox | None = None, check_only: bool = False,
                       mtp_optional: bool = False) -> LoadResult:
    """Copy a HF-layout safetensors checkpoint into ``model`` in place, streaming one tensor at a time and reading
    only the part of each tensor that this process holds.

    Args:
        model: a :class:`~moetrain.model.Transformer` on any (non-meta) device, whole or parallelized (FSDP2 shards,
            experts sharded over EP: each rank reads exactly its boxes, so no rank ever holds more than its shard
            plus one HF tensor's slice).
        path: a checkpoint directory (``model.safetensors`` or ``model.safetensors.index.json`` with its shards),
            or a single ``.safetensors`` file.
        strict: raise when the checkpoint lacks tensors the model needs or has tensors the model lacks.
        shard_box: where each model tensor's local part sits in its global tensor (default: DTensor placements;
            plain tensors are whole).
        check_only: check names and shapes (the model may be on meta) and copy nothing; reads only file headers.
        mtp_optional: a checkpoint with no MTP tensors at all (``transformers`` saves DeepseekV3 without them,
            although its config.json keeps ``num_nextn_predict_layers``) leaves the model's MTP modules as they are
            (``LoadResult.mtp_missing``); a checkpoint with only some of them is still an error.

    FP8 (float8_e4m3fn) weights with a ``<name>_scale_inv`` are dequantised per 128x128 block (the whole HF tensor is
    read for that). Shape mismatches always raise, before anything is copied from that tensor. Returns a
    :class:`LoadResult`.

    Raises:
        CheckpointError: missing/unexpected tensors (strict), a shape mismatch, an FP8 weight without its scale.
    """
    if shard_box is None:
        from moetrain.parallel.parallelize import shard_box
    path = Path(path)
    files, weight_map = _checkpoint_files(path)
    entries, packed = _entries(model)
    boxes = {id(e.tensor): shard_box(e.tensor) for e in entries}
    for e in entries:
        if not check_only and not e.copy and boxes[id(e.tensor)][2].is_meta:
            raise CheckpointError(f"{e.name} is on the meta device; materialise the model (to_empty) before loading")
    _check_expert_boxes(entries, boxes)
    by_name = {e.hf_name: e for e in entries}
    packed_by_name = {p.hf_name: p for p in packed}
    seen: set[str] = set()
    res = LoadResult(files=[str(f) for f in files])

    def read_scale(f, fpath: Path, key: str, header: bool = False) -> Any:
        """The ``_scale_inv`` of FP8 tensor ``key`` (its shape only, with ``header``)."""
        scale_key = key + "_scale_inv"
        if scale_key in file_keys:
            return tuple(f.get_slice(scale_key).get_shape()) if header else f.get_tensor(scale_key)
        other = weight_map.get(scale_key)
        if other is not None and other != fpath:
            with _open_safetensors(other) as g:
                return tuple(g.get_slice(scale_key).get_shape()) if header else g.get_tensor(scale_key)
        raise CheckpointError(f"FP8 tensor {key!r} has no {scale_key!r} in the checkpoint")

    def load(f, fpath: Path, key: str, entry: _Entry) -> bool:
        """Copy this rank's part of HF tensor ``key`` into ``entry``'s tensor; False if it holds none of it."""
        hit = _overlap(entry, boxes[id(entry.tensor)])
        if hit is not None and f.get_slice(key).get_dtype() in _FP8_ST_DTYPES and check_only:
            _check_scale_shape(key, tuple(f.get_slice(key).get_shape()), read_scale(f, fpath, key, header=True))
        if hit is None or check_only:
            return hit is not None
        hf_sl, dst = hit
        sl = f.get_slice(key)
        if sl.get_dtype() in _FP8_ST_DTYPES:
            t = dequantize_fp8_blockwise(f.get_tensor(key), read_scale(f, fpath, key))[hf_sl]
        else:
            t = sl[hf_sl]
        dst.copy_(t)
        return True

    for fpath in files:
        with _open_safetensors(fpath) as f:
            file_keys = set(f.keys())
            for key in f.keys():
                if key.endswith("_scale_inv") or key.endswith(_IGNORED_SUFFIXES):
                    continue
                if weight_map and weight_map.get(key, fpath) != fpath:
                    continue  # the index assigns it to another shard; read it there
                entry = by_name.get(key)
                if entry is not None and entry.copy and key == "lm_head.weight" and not check_only:
                    _check_tied_head(f, fpath, weight_map, entry, boxes[id(entry.tensor)], path)
                pk = packed_by_name.get(key) if entry is None else None
                if pk is not None:
                    entry = pk.entry
                if entry is None:
                    res.unexpected.append(key)
                    continue
                shape = tuple(f.get_slice(key).get_shape())
                if shape != entry.shape:
                    raise _shape_error(key, entry.name, shape, entry.shape)
                if pk is not None:
                    if f.get_slice(key).get_dtype() in _FP8_ST_DTYPES:
                        raise CheckpointError(f"FP8 stacked expert tensor {key!r} is not supported")
                    seen.update(pk.covers)
                    per_expert = len(pk.covers) // shape[0]
                    n_local = boxes[id(entry.tensor)][2].shape[0] if load(f, fpath, key, entry) else 0
                    res.loaded += per_expert * n_local
                    res.skipped_nonlocal += per_expert * (shape[0] - n_local)
                    continue
                seen.add(key)
                if entry.copy:
                    continue
                if load(f, fpath, key, entry):
                    res.loaded += 1
                else:
                    res.skipped_nonlocal += 1

    res.missing = [e.hf_name for e in entries if not e.copy and e.hf_name not in seen
                   and _overlap(e, boxes[id(e.tensor)]) is not None]
    mtp_names = {e.hf_name for e in entries if e.name.startswith("mtp.") and not e.copy}
    if mtp_optional and mtp_names and not (mtp_names & seen):
        res.mtp_missing = True
        res.missing = [n for n in res.missing if n not in mtp_names]
    bias_names = {e.hf_name for e in entries if e.hf_name.endswith("e_score_correction_bias")}
    if is_v2_layout(model.cfg) and not (bias_names & seen):
        res.missing = [n for n in res.missing if n not in bias_names]  # V2 has none: the biases stay zero
    if strict and (res.missing or res.unexpected):
        parts = []
        if res.missing:
            parts.append(f"{len(res.missing)} tensor(s) the model needs are missing from the checkpoint, e.g. "
                         f"{res.missing[:5]}")
        if res.unexpected:
            parts.append(f"{len(res.unexpected)} checkpoint tensor(s) have no place in the model, e.g. "
                         f"{res.unexpected[:5]}")
        raise CheckpointError(f"checkpoint {path} does not match the model ({'; '.join(parts)}); is it from a "
                              "different model or config?")
    return res


@contextmanager
def _open_safetensors(path: str | os.PathLike) -> Iterator[Any]:
    """``safe_open`` whose failure on a damaged file (truncated, garbage, empty) names the file."""
    try:
        cm = safe_open(str(path), framework="pt", device="cpu")
        f = cm.__enter__()
    except Exception as e:  # noqa: BLE001 - SafetensorError and friends
        raise CheckpointError(f"{path} is not a readable safetensors file ({type(e).__name__}: {e}); re-download or "
                              f"re-export it") from None
    try:
        yield f
    finally:
        cm.__exit__(None, None, None)


def _check_tied_head(f: Any, fpath: Path, weight_map: dict[str, Path], entry: _Entry, box: Any, path: Path) -> None:
    """A model that ties its head to the embedding may load a checkpoint that stores the head too only if the two are
    equal (some exports write both); a distinct head would be silently dropped. Compares this rank's box."""
    hit = _overlap(entry, box)
    if hit is None:
        return
    hf_sl, _ = hit
    head = f.get_slice("lm_head.weight")[hf_sl]
    other = weight_map.get("model.embed_tokens.weight", fpath)
    if other == fpath:
        emb = f.get_slice("model.embed_tokens.weight")[hf_sl]
    else:
        with _open_safetensors(other) as g:
            emb = g.get_slice("model.embed_tokens.weight")[hf_sl]
    if not torch.equal(head, emb):
        raise CheckpointError(f"{path} has its own lm_head.weight, different from the embedding, but the model ties "
                              f"them (model.tie_embeddings=true): loading would drop the head; untie them "
                              f"(--set model.tie_embeddings=false)")


def _check_scale_shape(key: str, shape: tuple[int, ...], scale_shape: tuple[int, ...]) -> None:
    want = tuple(math.ceil(n / FP8_BLOCK) for n in shape)
    if len(shape) != 2 or scale_shape != want:
        raise CheckpointError(f"FP8 tensor {key!r} of shape {_fmt_shape(shape)} has a {key}_scale_inv of shape "
                              f"{_fmt_shape(scale_shape)}; {FP8_BLOCK}x{FP8_BLOCK} blocks need {_fmt_shape(want)}")


def check_hf_checkpoint(cfg: ModelConfig, path: str | os.PathLike, mtp_optional: bool = False) -> LoadResult:
    """Check, from the safetensors headers alone, that the checkpoint at ``path`` holds every tensor of a ``cfg``
    model with its shape (nothing is allocated: the model is built on meta).

    Raises:
        CheckpointError: a missing or unexpected tensor, or a shape mismatch (naming the tensor and both shapes).
    """
    from moetrain.model.transformer import build_model
    return load_hf_checkpoint(build_model(cfg, device="meta"), path, check_only=True, mtp_optional=mtp_optional)


def _check_expert_boxes(entries: list[_Entry], boxes: dict[int, Any]) -> None:
    """A local expert slice must sit inside the config's experts (a layout bug, not a checkpoint problem)."""
    for e in entries:
        if e.expert != 0:
            continue
        g, off, local = boxes[id(e.tensor)]
        if off[0] < 0 or off[0] + local.shape[0] > g[0]:
            raise CheckpointError(f"{e.name} holds {local.shape[0]} experts from offset {off[0]}, outside the "
                                  f"{g[0]} experts of the config")


# ----------------------------------------------------------------------------------------------------------------
# Save
# ----------------------------------------------------------------------------------------------------------------

def _materialise(t: torch.Tensor, dtype: torch.dtype | None) -> torch.Tensor:
    if hasattr(t, "full_tensor"):  # a DTensor (FSDP/TP): gather the full value
        t = t.full_tensor()
    t = t.detach()
    if dtype is not None and t.is_floating_point():
        t = t.to(dtype)
    return t.to("cpu").contiguous().clone()


@torch.no_grad()
def save_hf_checkpoint(model: nn.Module, path: str | os.PathLike, max_shard_bytes: float = 5e9,
                       dtype: torch.dtype | None = None, overwrite: bool = False) -> Path:
    """Write ``model`` as a HF DeepSeek-V3 checkpoint directory: shards ``model-0000i-of-0000N.safetensors``,
    ``model.safetensors.index.json`` and ``config.json`` (from :func:`config_to_hf`), one tensor per expert.

    Args:
        model: a :class:`~moetrain.model.Transformer` holding all experts (gather expert-parallel slices first).
        path: target directory. It appears only when complete: everything is written into a temporary sibling
            directory that is renamed onto ``path`` at the end (removed again on any error).
        max_shard_bytes: a new shard starts before a tensor that would take the current one past this size.
        dtype: cast floating tensors (e.g. torch.bfloat16); None keeps each tensor's dtype. The router bias stays
            fp32 either way.
        overwrite: replace an existing ``path`` (swapped atomically by rename); otherwise an existing path raises.

    Returns: the target path.

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False.
        CheckpointError: the model is sharded (use ``moetrain export``) or on meta.
    """
    entries, _ = _entries(model)
    for e in entries:
        if hasattr(e.tensor, "to_local") or e.tensor.is_meta:
            raise CheckpointError(f"{e.name} is sharded or on meta; save_hf_checkpoint needs a whole model on one "
                                  "process (export a distributed run's checkpoint with `moetrain export`)")
    specs = hf_specs(model, dtype)
    by_name = {e.hf_name: e for e in entries}

    def fetch(shard: list[HFSpec]) -> dict[str, torch.Tensor]:
        return {s.hf_name: _materialise(by_name[s.hf_name].view(), s.dtype) for s in shard}

    saved_dtype = dtype or model.embed_tokens.weight.dtype
    return write_hf_checkpoint(model.cfg, specs, fetch, path, max_shard_bytes, saved_dtype, overwrite)


@dataclass
class HFSpec:
    """One tensor of a HF checkpoint to write: its name, shape and stored dtype, and where its values come from (the
    model tensor ``name`` at ``region`` offsets of its global tensor)."""

    hf_name: str
    shape: tuple[int, ...]
    dtype: torch.dtype
    name: str
    region: tuple[int, ...]


def hf_specs(model: nn.Module, dtype: torch.dtype | None = None) -> list[HFSpec]:
    """The tensors a HF checkpoint of ``model`` holds, in checkpoint order (the model may be on meta: only names,
    global shapes and dtypes are used). ``dtype`` casts floating tensors; the router bias stays fp32."""
    specs = []
    v2 = is_v2_layout(model.cfg)
    for e in _entries(model)[0]:
        if e.copy and e.hf_name == "lm_head.weight" and model.cfg.tie_embeddings:
            continue
        if v2 and e.hf_name.endswith("e_score_correction_bias"):
            continue  # V2 has no expert bias (and a V2-style run never moves it: bias_update_rate = 0)
        src = e.tensor.dtype
        t_dtype = torch.float32 if e.hf_name.endswith("e_score_correction_bias") else dtype
        out = t_dtype if (t_dtype is not None and src.is_floating_point) else src
        specs.append(HFSpec(e.hf_name, e.shape, out, e.name, e.region()))
    return specs


def write_hf_checkpoint(cfg: ModelConfig, specs: list[HFSpec],
                        fetch: Callable[[list[HFSpec]], dict[str, torch.Tensor]], path: str | os.PathLike,
                        max_shard_bytes: float = 5e9, saved_dtype: torch.dtype = torch.float32,
                        overwrite: bool = False, extra_files: dict[str, Path] | None = None,
                        quantization_config: dict[str, Any] | None = None) -> Path:
    """Write shards ``model-0000i-of-0000N.safetensors`` (each from one ``fetch(specs of that shard)`` call, so at
    most one shard's tensors are in memory), the index and ``config.json``, into a temporary sibling directory that
    is renamed onto ``path`` only when complete. ``extra_files`` (name -> source path, e.g. the tokenizer) are
    copied in too. ``quantization_config`` goes into config.json as is (FP8 exports: :data:`FP8_QUANTIZATION_CONFIG`).

    Raises:
        FileExistsError: ``path`` exists and ``overwrite`` is False.
    """
    target = Path(path)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists; choose another directory, or replace it (moetrain export "
                              f"--overwrite)")
    shards: list[list[HFSpec]] = [[]]
    size = 0
    total = 0
    for sp in specs:
        n = math.prod(sp.shape) * sp.dtype.itemsize
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append(sp)
        size += n
        total += n
    N = len(shards)
    names = [f"model-{i + 1:05d}-of-{N:05d}.safetensors" for i in range(N)]

    target.parent.mkdir(parents=True, exist_ok=True)
    for stale in target.parent.glob(f".{target.name}.tmp-*"):  # left by a killed earlier write of this target
        shutil.rmtree(stale, ignore_errors=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    old: Path | None = None
    try:
        os.chmod(tmp, 0o755)
        weight_map: dict[str, str] = {}
        for fname, shard in zip(names, shards):
            tensors = fetch(shard)
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            os.chmod(tmp / fname, 0o644)  # readable like the index and config beside it
            fsync_path(tmp / fname)
            weight_map.update({sp.hf_name: fname for sp in shard})
            del tensors
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_json(tmp / INDEX_NAME, index)
        hf_cfg = config_to_hf(cfg)
        hf_cfg["dtype"] = str(saved_dtype).removeprefix("torch.")
        if quantization_config is not None:
            hf_cfg["quantization_config"] = quantization_config
        _write_json(tmp / CONFIG_NAME, hf_cfg)
        for name, src in (extra_files or {}).items():
            shutil.copyfile(src, tmp / name)
            fsync_path(tmp / name)
        if target.exists():
            old = target.parent / f".{target.name}.old-{uuid.uuid4().hex[:8]}"
            target.rename(old)
        try:
            tmp.rename(target)
        except BaseException:
            if old is not None:
                old.rename(target)
                old = None
            raise
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    if old is not None:
        shutil.rmtree(old, ignore_errors=True)
    return target


def _write_json(p: Path, obj: Any) -> None:
    with open(p, "w") as f:
        json.dump(obj, f, indent=2, sort_keys=False)
        f.write("\n")
        f.flush()
        os.fsync(f.fileno())


def iter_hf_state(model: nn.Module, dtype: torch.dtype | None = None) -> Iterator[tuple[str, torch.Tensor]]:
    """(HF name, CPU tensor) pairs of a whole single-process ``model`` one at a time, in checkpoint order."""
    by_name = {e.hf_name: e for e in _entries(model)[0]}
    for sp in hf_specs(model, dtype):
        yield sp.hf_name, _materialise(by_name[sp.hf_name].view(), sp.dtype)


# ----------------------------------------------------------------------------------------------------------------
# FP8 export: the released block-scaled layout
# ----------------------------------------------------------------------------------------------------------------

#: HF weights an FP8 export stores as float8_e4m3fn with a ``weight_scale_inv`` (layout: docs/reference.md section
#: 7): the linears of attention and of every FFN (dense, shared and routed experts), the GEMMs FP8 training runs in
#: FP8. Embedding, head, norms, the router and MTP's ``eh_proj`` stay in the high-precision dtype (whether the
#: release quantises ``eh_proj`` is not recorded here; the loader reads either form).
FP8_WEIGHT_SUFFIXES = tuple(f".{n}.weight" for n in ("q_a_proj", "q_b_proj", "q_proj", "kv_a_proj_with_mqa",
                                                      "kv_b_proj", "o_proj", "gate_proj", "up_proj", "down_proj"))
#: config.json's ``quantization_config`` of the release (README_WEIGHTS.md; docs/reference.md section 13).
FP8_QUANTIZATION_CONFIG = {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                           "weight_block_size": [FP8_BLOCK, FP8_BLOCK]}
_SCALE_SUFFIX = "_scale_inv"


def is_fp8_weight(hf_name: str) -> bool:
    """Whether the released FP8 layout stores HF tensor ``hf_name`` in FP8 (see :data:`FP8_WEIGHT_SUFFIXES`)."""
    return hf_name.startswith("model.layers.") and hf_name.endswith(FP8_WEIGHT_SUFFIXES) and ".eh_proj." not in hf_name


def fp8_specs(specs: list[HFSpec]) -> tuple[list[HFSpec], dict[str, HFSpec]]:
    """The tensors of the FP8 export of ``specs``: each FP8 weight (:func:`is_fp8_weight`) as float8_e4m3fn,
    followed by its ``<name>_scale_inv`` (fp32, (ceil(out/128), ceil(in/128))); the rest unchanged. Also returns the
    original spec of each FP8 weight and scale, by HF name, to read its source values."""
    out: list[HFSpec] = []
    source: dict[str, HFSpec] = {}
    for sp in specs:
        if not (is_fp8_weight(sp.hf_name) and len(sp.shape) == 2 and sp.dtype.is_floating_point):
            out.append(sp)
            continue
        rows, cols = sp.shape
        scale = HFSpec(sp.hf_name + _SCALE_SUFFIX, (-(-rows // FP8_BLOCK), -(-cols // FP8_BLOCK)), torch.float32,
                       sp.name, sp.region)
        out += [HFSpec(sp.hf_name, sp.shape, torch.float8_e4m3fn, sp.name, sp.region), scale]
        source[sp.hf_name] = source[scale.hf_name] = sp
    return out, source


def fp8_fetch(fetch: Callable[[list[HFSpec]], dict[str, torch.Tensor]], source: dict[str, HFSpec]
              ) -> Callable[[list[HFSpec]], dict[str, torch.Tensor]]:
    """Wrap a shard ``fetch`` of high-precision tensors into one of the FP8 specs of :func:`fp8_specs`: each FP8
    weight is read in its source dtype and quantised per 128x128 block (``moetrain.precision.quantise``: E4M3 of
    W / s, s = block amax / 448, which the loader's W_fp8 * weight_scale_inv dequantises back exactly)."""
    from moetrain.precision.quant import quantise

    def fetch_fp8(shard: list[HFSpec]) -> dict[str, torch.Tensor]:
        plain = [sp for sp in shard if sp.hf_name not in source]
        wanted = list(dict.fromkeys(source[sp.hf_name].hf_name for sp in shard if sp.hf_name in source))
        got = fetch(plain + [source[n] for n in wanted])
        out: dict[str, torch.Tensor] = {}
        for n in wanted:
            q = quantise(got.pop(n), (FP8_BLOCK, FP8_BLOCK), "fp32")
            out[n], out[n + _SCALE_SUFFIX] = q.data, q.scale
        return {sp.hf_name: (out[sp.hf_name] if sp.hf_name in source else got[sp.hf_name]) for sp in shard}

    return fetch_fp8
