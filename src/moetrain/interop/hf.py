"""Hugging Face interchange for DeepSeek-V3/V2 models: ``config.json`` <-> :class:`ModelConfig`, and safetensors
checkpoints in the released layout <-> a :class:`~moetrain.model.Transformer`.

Released layout (REFERENCE.md section 7; one tensor per expert)::

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

Loading streams tensor by tensor (``safe_open``); under expert parallelism only the experts this rank holds are read
(``mlp.dispatcher.local_expert_offset`` and the leading dim of the stacked expert parameters say which). Saving writes
each shard from freshly gathered tensors, so peak extra memory is one shard, into a temporary directory that is
renamed onto the target only when complete.
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
from typing import Any, Iterator

import torch
from safetensors import safe_open
from safetensors.torch import save_file
from torch import nn

from moetrain.fsutil import fsync_path
from moetrain.model.config import ConfigError, ModelConfig
from moetrain.model.moe import MoE

SUPPORTED_MODEL_TYPES = ("deepseek_v3", "deepseek_v2")
INDEX_NAME = "model.safetensors.index.json"
SINGLE_NAME = "model.safetensors"
CONFIG_NAME = "config.json"
FP8_BLOCK = 128
#: Key of the block in ``config.json`` that carries moetrain fields the HF config has no name for (training
#: coefficients, and the YaRN parameters of a model without YaRN) so that configs round-trip exactly.
EXTRA_KEY = "moetrain"
_TRAINING_FIELDS = ("balance_loss_alpha", "mtp_loss_weight", "bias_update_rate", "routing")
_YARN_FIELDS = ("rope_beta_fast", "rope_beta_slow", "rope_mscale", "rope_mscale_all_dim", "rope_original_seq_len")
_IGNORED_SUFFIXES = ("rotary_emb.inv_freq",)  # non-persistent buffers some old exports contain


class CheckpointError(ValueError):
    """A checkpoint does not fit the model (missing/unexpected tensors, shape mismatch) or cannot be read/written."""


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
    allowed = set(_TRAINING_FIELDS) | (set(_YARN_FIELDS) if out["rope_factor"] == 1.0 else set())
    bad = sorted(set(extra) - allowed)
    if bad:
        raise ConfigError(f"unexpected field(s) {bad} in the {EXTRA_KEY!r} block; allowed here: {sorted(allowed)}")
    out.update(extra)
    return ModelConfig.from_dict(out)


def config_to_hf(cfg: ModelConfig) -> dict[str, Any]:
    """The HF ``config.json`` dict of ``cfg`` (DeepSeek-V3 keys, released style plus v5 ``rope_parameters``).

    ``config_from_hf(config_to_hf(cfg)) == cfg`` for every valid config. Note that HF's ``DeepseekV3`` modeling
    hard-codes the sigmoid router; a softmax-router config keeps ``scoring_func`` for tools that honour it.
    """
    rope_scaling = None
    extra: dict[str, Any] = {name: getattr(cfg, name) for name in _TRAINING_FIELDS}
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
    return {
        "architectures": ["DeepseekV3ForCausalLM"],
        "model_type": "deepseek_v3",
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
        "topk_method": "noaux_tc",
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
    """One HF tensor name and where it lives in the model.

    tensor: the destination parameter/buffer; index: expert slot within a stacked tensor (None = whole tensor);
    local: this rank holds it (False for other ranks' experts); copy: a duplicate of another tensor (MTP's copies of
    the embedding and head, a tied head) -- written on save, only shape-checked on load."""

    hf_name: str
    name: str
    tensor: torch.Tensor
    index: int | None = None
    local: bool = True
    copy: bool = False

    @property
    def shape(self) -> tuple[int, ...]:
        return tuple(self.tensor.shape[1:] if self.index is not None else self.tensor.shape)

    def view(self) -> torch.Tensor:
        return self.tensor[self.index] if self.index is not None else self.tensor


@dataclass
class _Packed:
    """A stacked expert tensor of the transformers-v5 in-memory layout (all E experts of one layer)."""

    hf_name: str
    experts: nn.Module
    offset: int
    covers: list[str]  # the per-expert names it stands for


_SWIGLU = (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj"))
_EXPERT = (("w1_EFD", "gate_proj"), ("w3_EFD", "up_proj"), ("w2_EDF", "down_proj"))


def _block_entries(block: nn.Module, hf: str, ours: str, n_experts: int
                   ) -> tuple[list[_Entry], list[_Packed]]:
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
    n_local = mlp.experts.w1_EFD.shape[0]
    offset = int(getattr(mlp.dispatcher, "local_expert_offset", 0) or 0)
    if offset < 0 or offset + n_local > n_experts:
        raise CheckpointError(f"{ours}mlp.experts holds {n_local} experts from offset {offset}, outside the "
                              f"{n_experts} experts of the config")
    covers = []
    for e in range(n_experts):
        local = offset <= e < offset + n_local
        for a, b in _EXPERT:
            t = getattr(mlp.experts, a)
            hf_name = hf + f"mlp.experts.{e}.{b}.weight"
            covers.append(hf_name)
            entries.append(_Entry(hf_name, ours + f"mlp.experts.{a}[{e}]", t, index=e - offset if local else 0,
                                  local=local))
    packed.append(_Packed(hf + "mlp.experts.gate_up_proj", mlp.experts, offset, covers))
    packed.append(_Packed(hf + "mlp.experts.down_proj", mlp.experts, offset, covers))
    return entries, packed


def _entries(model: nn.Module) -> tuple[list[_Entry], list[_Packed]]:
    """Every HF tensor of ``model`` in checkpoint order, plus the stacked-layout alternatives."""
    cfg: ModelConfig = model.cfg
    E = cfg.n_routed_experts
    out = [_Entry("model.embed_tokens.weight", "embed_tokens.weight", model.embed_tokens.weight)]
    packed: list[_Packed] = []
    for i, block in enumerate(model.layers):
        e, p = _block_entries(block, f"model.layers.{i}.", f"layers.{i}.", E)
        out += e
        packed += p
    out.append(_Entry("model.norm.weight", "norm.weight", model.norm.weight))
    out.append(_Entry("lm_head.weight", "lm_head.weight", model.lm_head.weight, copy=cfg.tie_embeddings))
    for k, mtp in enumerate(model.mtp):
        hf, ours = f"model.layers.{cfg.n_layers + k}.", f"mtp.{k}."
        out.append(_Entry(hf + "embed_tokens.weight", "embed_tokens.weight", model.embed_tokens.weight, copy=True))
        for n in ("enorm", "hnorm", "eh_proj"):
            out.append(_Entry(hf + f"{n}.weight", ours + f"{n}.weight", getattr(mtp, n).weight))
        e, p = _block_entries(mtp.block, hf, ours + "block.", E)
        out += e
        packed += p
        out.append(_Entry(hf + "shared_head.norm.weight", ours + "norm.weight", mtp.norm.weight))
        out.append(_Entry(hf + "shared_head.head.weight", "lm_head.weight", model.lm_head.weight, copy=True))
    return out, packed


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
        files: the safetensors files read.
    """

    loaded: int = 0
    skipped_nonlocal: int = 0
    missing: list[str] = field(default_factory=list)
    unexpected: list[str] = field(default_factory=list)
    files: list[str] = field(default_factory=list)


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
def load_hf_checkpoint(model: nn.Module, path: str | os.PathLike, strict: bool = True) -> LoadResult:
    """Copy a HF-layout safetensors checkpoint into ``model`` in place, streaming one tensor at a time.

    Args:
        model: a :class:`~moetrain.model.Transformer` on any (non-meta) device; under expert parallelism each MoE
            layer's ``experts`` holds El experts starting at ``mlp.dispatcher.local_expert_offset`` and only those
            are read.
        path: a checkpoint directory (``model.safetensors`` or ``model.safetensors.index.json`` with its shards),
            or a single ``.safetensors`` file.
        strict: raise when the checkpoint lacks tensors the model needs or has tensors the model lacks.

    FP8 (float8_e4m3fn) weights with a ``<name>_scale_inv`` are dequantised per 128x128 block. Shape mismatches
    always raise. Returns a :class:`LoadResult`.

    Raises:
        CheckpointError: missing/unexpected tensors (strict), a shape mismatch, an FP8 weight without its scale.
    """
    path = Path(path)
    files, weight_map = _checkpoint_files(path)
    entries, packed = _entries(model)
    by_name = {e.hf_name: e for e in entries}
    packed_by_name = {p.hf_name: p for p in packed}
    for e in entries:
        if e.local and not e.copy and e.tensor.is_meta:
            raise CheckpointError(f"{e.name} is on the meta device; materialise the model (to_empty) before loading")
    seen: set[str] = set()
    res = LoadResult(files=[str(f) for f in files])

    def read_scale(f, fpath: Path, key: str) -> torch.Tensor:
        scale_key = key + "_scale_inv"
        if scale_key in file_keys:
            return f.get_tensor(scale_key)
        other = weight_map.get(scale_key)
        if other is not None and other != fpath:
            with safe_open(str(other), framework="pt", device="cpu") as g:
                return g.get_tensor(scale_key)
        raise CheckpointError(f"FP8 tensor {key!r} has no {scale_key!r} in the checkpoint")

    def read(f, fpath: Path, key: str) -> torch.Tensor:
        t = f.get_tensor(key)
        if t.dtype in _FP8_DTYPES:
            t = dequantize_fp8_blockwise(t, read_scale(f, fpath, key))
        return t

    for fpath in files:
        with safe_open(str(fpath), framework="pt", device="cpu") as f:
            file_keys = set(f.keys())
            for key in f.keys():
                if key.endswith("_scale_inv") or key.endswith(_IGNORED_SUFFIXES):
                    continue
                if weight_map and weight_map.get(key, fpath) != fpath:
                    continue  # the index assigns it to another shard; read it there
                entry = by_name.get(key)
                if entry is None and key in packed_by_name:
                    _load_packed(f, fpath, key, packed_by_name[key], seen, res, read_scale)
                    continue
                if entry is None:
                    res.unexpected.append(key)
                    continue
                shape = tuple(f.get_slice(key).get_shape())
                if shape != entry.shape:
                    raise _shape_error(key, entry.name, shape, entry.shape)
                seen.add(key)
                if entry.copy:
                    continue
                if not entry.local:
                    res.skipped_nonlocal += 1
                    continue
                entry.view().copy_(read(f, fpath, key))
                res.loaded += 1

    res.missing = [e.hf_name for e in entries if e.local and not e.copy and e.hf_name not in seen]
    if strict and (res.missing or res.unexpected):
        parts = []
        if res.missing:
            parts.append(f"{len(res.missing)} tensor(s) the model needs are missing from the checkpoint, e.g. "
                         f"{res.missing[:5]}")
        if res.unexpected:
            parts.append(f"{len(res.unexpected)} checkpoint tensor(s) have no place in the model, e.g. "
                         f"{res.unexpected[:5]}")
        raise CheckpointError(f"checkpoint {path} does not match the model ({'; '.join(parts)}); is it from a "
                              "different model/config? Pass strict=False to load what matches.")
    return res


def _load_packed(f, fpath: Path, key: str, p: _Packed, seen: set[str], res: LoadResult, read_scale) -> None:
    """Load a v5 stacked expert tensor: gate_up_proj (E, 2F, D) or down_proj (E, D, F); only the local slice."""
    ex = p.experts
    El, F, D = ex.w1_EFD.shape
    E = len(p.covers) // 3
    shape = tuple(f.get_slice(key).get_shape())
    gate_up = key.endswith("gate_up_proj")
    want = (E, 2 * F, D) if gate_up else (E, D, F)
    ours = "experts.w1_EFD/w3_EFD" if gate_up else "experts.w2_EDF"
    if shape != want:
        raise _shape_error(key, ours, shape, want)
    if f.get_slice(key).get_dtype() in _FP8_ST_DTYPES:
        raise CheckpointError(f"FP8 stacked expert tensor {key!r} is not supported")
    t = f.get_slice(key)[p.offset:p.offset + El]
    if gate_up:
        ex.w1_EFD.copy_(t[:, :F])
        ex.w3_EFD.copy_(t[:, F:])
        suffixes = ("gate_proj.weight", "up_proj.weight")
    else:
        ex.w2_EDF.copy_(t)
        suffixes = ("down_proj.weight",)
    names = [n for n in p.covers if n.endswith(suffixes)]
    seen.update(names)
    res.loaded += El * len(suffixes)
    res.skipped_nonlocal += (E - El) * len(suffixes)


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
        CheckpointError: the model holds only a slice of the experts.
    """
    target = Path(path)
    if target.exists() and not overwrite:
        raise FileExistsError(f"{target} exists; pass overwrite=True to replace it")
    entries, _ = _entries(model)
    tied = model.cfg.tie_embeddings
    items = []
    for e in entries:
        if not e.local:
            raise CheckpointError(f"{e.name} is held by another expert-parallel rank; save_hf_checkpoint needs a "
                                  "model with all experts")
        if e.copy and e.hf_name == "lm_head.weight" and tied:
            continue
        t_dtype = torch.float32 if e.hf_name.endswith("e_score_correction_bias") else dtype
        items.append((e, t_dtype))

    def nbytes(e: _Entry, t_dtype: torch.dtype | None) -> int:
        v = e.view()
        dt = t_dtype if (t_dtype is not None and v.is_floating_point()) else v.dtype
        return v.numel() * dt.itemsize

    shards: list[list[tuple[_Entry, torch.dtype | None]]] = [[]]
    size = 0
    total = 0
    for e, t_dtype in items:
        n = nbytes(e, t_dtype)
        if shards[-1] and size + n > max_shard_bytes:
            shards.append([])
            size = 0
        shards[-1].append((e, t_dtype))
        size += n
        total += n
    N = len(shards)
    names = [f"model-{i + 1:05d}-of-{N:05d}.safetensors" for i in range(N)]

    target.parent.mkdir(parents=True, exist_ok=True)
    tmp = Path(tempfile.mkdtemp(prefix=f".{target.name}.tmp-", dir=target.parent))
    old: Path | None = None
    try:
        os.chmod(tmp, 0o755)
        weight_map: dict[str, str] = {}
        for fname, shard in zip(names, shards):
            tensors = {e.hf_name: _materialise(e.view(), t_dtype) for e, t_dtype in shard}
            save_file(tensors, str(tmp / fname), metadata={"format": "pt"})
            fsync_path(tmp / fname)
            weight_map.update({k: fname for k in tensors})
            del tensors
        index = {"metadata": {"total_size": total}, "weight_map": weight_map}
        _write_json(tmp / INDEX_NAME, index)
        hf_cfg = config_to_hf(model.cfg)
        saved_dtype = dtype or model.embed_tokens.weight.dtype
        hf_cfg["dtype"] = str(saved_dtype).removeprefix("torch.")
        _write_json(tmp / CONFIG_NAME, hf_cfg)
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
    """(HF name, CPU tensor) pairs of ``model`` one at a time, in checkpoint order (for custom writers)."""
    for e in _entries(model)[0]:
        if e.copy and e.hf_name == "lm_head.weight" and model.cfg.tie_embeddings:
            continue
        yield e.hf_name, _materialise(e.view(), dtype)
