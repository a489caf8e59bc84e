"""The systems under test, built from one moetrain config with the same weights.

* ``moetrain``: the project's own modules, exactly as in ``src/`` (``moetrain+patch``: with the proposed speed patches
  of :mod:`patches` applied by monkeypatching, to measure them before they land).
* ``hf[<impl>]``: Hugging Face ``transformers`` DeepseekV3 (``DeepseekV3MoE`` / ``DeepseekV3ForCausalLM``), one
  system per expert implementation it offers (``experts_implementation``: "eager", "grouped_mm", "batched_mm").
  Weights reach it through moetrain's HF interchange (``save_hf_checkpoint`` -> ``from_pretrained``).
* ``torchtitan``: TorchTitan 0.3.0's DeepSeek-V3 (``torchtitan.models.deepseek_v3``). It does not train on a CPU as
  shipped (see ``TORCHTITAN_CPU_NOTES``); the CPU head-to-head uses it with two documented adaptations.

Same work for all: the benchmark config is the preset with ``mtp_depth=0`` (HF has no MTP; TorchTitan's MTP is off
by default) and plain RoPE (``rope_factor=1.0``; the ``small`` preset already has it), dropless learned routing with
the same router weights, so every system routes every token to the same experts.
"""

from __future__ import annotations

import math
import os
from pathlib import Path
from typing import Any

import torch
from torch import nn

from moetrain.model.config import ModelConfig, get_preset

TORCHTITAN_CPU_NOTES = [
    "attention: its only language-model backends are FlexAttention ('flex', 'flex_flash') and 'varlen'; on CPU "
    "'flex' fails in backward (NotImplementedError: FlexAttention does not support backward on CPU) and 'varlen' "
    "has no CPU kernel (aten::_flash_attention_forward is CUDA-only); 'sdpa' is rejected for language models "
    "(ValueError: sdpa is no longer supported for language models). Adaptation: every layer's inner attention is "
    "TorchTitan's own ScaledDotProductAttention (causal; same math as moetrain's and HF's SDPA).",
    "experts: GroupedExperts.forward casts tokens and expert weights to bfloat16 (x_RD.bfloat16()) whatever the "
    "model dtype, so it cannot run the fp32 work of the other systems. Adaptation: the same three grouped GEMMs in "
    "the input dtype (the cast removed, nothing else changed).",
    "import: torchtitan.models.common.moe imports triton unconditionally (minimal_async_ep kernels); the suite "
    "keeps triton out of the project venv, in .cache/bench-peers (see BENCHMARKS.md).",
]


# ----------------------------------------------------------------------------------------------------------------
# Configs
# ----------------------------------------------------------------------------------------------------------------

def gpu_1x() -> ModelConfig:
    """A ~3.9B-total / ~0.6B-active V3-architecture model sized for one 141 GB GPU with fp32 AdamW states
    (16 B/param = 62 GB) plus bf16 activations of 4 x 2048 tokens."""
    return get_preset("small").replace(
        vocab_size=32_768, dim=2048, n_layers=10, n_dense_layers=1, dense_ffn_dim=8192, expert_ffn_dim=1024,
        n_routed_experts=64, n_shared_experts=1, top_k=6, n_expert_groups=8, n_limited_groups=4, n_heads=16,
        q_lora_rank=768, kv_lora_rank=512, qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128,
        max_seq_len=4096, rope_original_seq_len=4096)


def bench_config(preset: str) -> ModelConfig:
    """The preset as every system runs it: no MTP (HF has none), plain RoPE (identical in all three codebases)."""
    base = gpu_1x() if preset == "gpu-1x" else get_preset(preset)
    return base.replace(mtp_depth=0, rope_factor=1.0)


# ----------------------------------------------------------------------------------------------------------------
# HF transformers
# ----------------------------------------------------------------------------------------------------------------

HF_IMPLS = ("eager", "grouped_mm", "batched_mm")


def hf_config(cfg: ModelConfig, impl: str):
    from transformers import DeepseekV3Config

    from moetrain.interop.hf import config_to_hf
    c = DeepseekV3Config(**config_to_hf(cfg))
    c._experts_implementation = impl
    c._attn_implementation = "sdpa"
    return c


def hf_batched_mm_bytes(cfg: ModelConfig, tokens: int, n_layers: int) -> float:
    """HF ``batched_mm`` gathers a private copy of the expert weights for every routed token (``gate_up_proj[ids]``,
    ``down_proj[ids]``): forward holds T*K*3*F*D floats per layer, backward as many again for their gradient."""
    per_layer = tokens * cfg.top_k * 3 * cfg.expert_ffn_dim * cfg.dim * 4
    return 2.0 * per_layer * n_layers


def available_ram_bytes(device: str = "cpu") -> float:
    """Memory free for tensors: CUDA free memory on a GPU, else MemAvailable."""
    if device == "cuda":
        return float(torch.cuda.mem_get_info()[0])
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except OSError:
        pass
    return float("inf")


def hf_moe_from_moetrain(moe, cfg: ModelConfig, impl: str, device: str = "cpu") -> nn.Module:
    """A ``DeepseekV3MoE`` holding exactly the weights of moetrain MoE layer ``moe``."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE
    with torch.device(device):
        hf = DeepseekV3MoE(hf_config(cfg, impl))
    with torch.no_grad():
        hf.gate.weight.copy_(moe.gate.weight)
        hf.gate.e_score_correction_bias.copy_(moe.gate.expert_bias)
        hf.experts.gate_up_proj.copy_(torch.cat([moe.experts.w1_EFD, moe.experts.w3_EFD], dim=1))
        hf.experts.down_proj.copy_(moe.experts.w2_EDF)
        hf.shared_experts.gate_proj.weight.copy_(moe.shared_experts.w1.weight)
        hf.shared_experts.up_proj.weight.copy_(moe.shared_experts.w3.weight)
        hf.shared_experts.down_proj.weight.copy_(moe.shared_experts.w2.weight)
    return hf


def hf_causal_lm(ckpt_dir: str | Path, impl: str, device: str):
    """HF model loaded with ``from_pretrained`` from the checkpoint moetrain wrote (``save_hf_checkpoint``)."""
    from transformers import DeepseekV3ForCausalLM
    m = DeepseekV3ForCausalLM.from_pretrained(str(ckpt_dir), dtype=torch.float32, experts_implementation=impl,
                                              attn_implementation="sdpa")
    return m.to(device).train()


def hf_causal_lm_from_moetrain(src: nn.Module, cfg: ModelConfig, impl: str, device: str):
    """HF model with ``src``'s weights copied in memory (no checkpoint on disk: used on GPU, where the model is too
    large to write and read back within the suite's time budget). Names follow moetrain.model.deepseek.adapter's table; the
    experts go to transformers v5's stacked layout (gate_up_proj = [w1; w3], down_proj = w2)."""
    from transformers import DeepseekV3ForCausalLM
    hcfg = hf_config(cfg, impl)
    hcfg.torch_dtype = torch.float32
    with torch.device(device):
        m = DeepseekV3ForCausalLM(hcfg)  # real buffers (rotary tables); its random weights are overwritten below
    ours = moetrain_tensors(src)
    sd: dict[str, torch.Tensor] = {}
    for k in m.state_dict():
        name = k.removeprefix("model.")
        t = None
        if ".mlp.experts.gate_up_proj" in k:
            base = name.replace("experts.gate_up_proj", "experts.")
            t = torch.cat([ours[base + "w1_EFD"], ours[base + "w3_EFD"]], dim=1)
        elif ".mlp.experts.down_proj" in k:
            t = ours[name.replace("experts.down_proj", "experts.w2_EDF")]
        elif name.endswith("gate.e_score_correction_bias"):
            t = ours[name.replace("e_score_correction_bias", "expert_bias")]
        else:
            for hf_w, our_w in (("gate_proj", "w1"), ("up_proj", "w3"), ("down_proj", "w2")):
                name = name.replace(f"mlp.{hf_w}.", f"mlp.{our_w}.").replace(f"shared_experts.{hf_w}.",
                                                                               f"shared_experts.{our_w}.")
            t = ours.get(name)
        if t is None:
            raise RuntimeError(f"HF tensor {k} has no moetrain counterpart")
        sd[k] = t.detach()
    m.load_state_dict(sd, strict=True)
    return m.to(device).train()


# ----------------------------------------------------------------------------------------------------------------
# TorchTitan
# ----------------------------------------------------------------------------------------------------------------

def _titan_patch_fp32_experts() -> None:
    """Replace TorchTitan's GroupedExperts.forward by the same computation without the bfloat16 cast (CPU fp32
    head-to-head only; on CUDA bf16 autocast runs it unmodified)."""
    import torch.nn.functional as F
    from torchtitan.models.common.moe import GroupedExperts

    if getattr(GroupedExperts, "_moetrain_bench_fp32", False):
        return

    def forward(self, x_RD, num_tokens_per_expert_E):
        offsets_E = torch.cumsum(num_tokens_per_expert_E, dim=0, dtype=torch.int32)
        dt = x_RD.dtype
        w1, w2, w3 = (w.to(dt) for w in (self.w1_EFD, self.w2_EDF, self.w3_EFD))
        h_RF = F.silu(self._grouped_mm(A=x_RD, B_t=w1.transpose(-2, -1), offs=offsets_E))
        h_RF = h_RF * self._grouped_mm(A=x_RD, B_t=w3.transpose(-2, -1), offs=offsets_E)
        return self._grouped_mm(A=h_RF, B_t=w2.transpose(-2, -1), offs=offsets_E).type_as(x_RD)

    GroupedExperts.forward = forward
    GroupedExperts._moetrain_bench_fp32 = True


def titan_model_config(cfg: ModelConfig, sdpa: bool = True):
    """TorchTitan ``DeepSeekV3Model.Config`` with moetrain's shapes (same layer layout, router, experts)."""
    from torchtitan.models.common import ComplexRoPE, Embedding, Linear, RMSNorm
    from torchtitan.models.common.attention import ScaledDotProductAttention
    from torchtitan.models.deepseek_v3 import (_EMBEDDING_INIT, _NORM_INIT, DeepSeekV3Model, _build_dsv3_layers,
                                               _output_linear_init)
    layers = _build_dsv3_layers(
        n_layers=cfg.n_layers, n_dense_layers=cfg.n_dense_layers, dim=cfg.dim, n_heads=cfg.n_heads,
        q_lora_rank=cfg.q_lora_rank, kv_lora_rank=cfg.kv_lora_rank, qk_nope_head_dim=cfg.qk_nope_head_dim,
        qk_rope_head_dim=cfg.qk_rope_head_dim, v_head_dim=cfg.v_head_dim, mscale=cfg.rope_mscale,
        dense_hidden_dim=cfg.dense_ffn_dim, moe_hidden_dim=cfg.expert_ffn_dim, num_experts=cfg.n_routed_experts,
        num_shared_experts=cfg.n_shared_experts, router_top_k=cfg.top_k, router_score_func=cfg.score_func,
        router_num_expert_groups=cfg.n_expert_groups if cfg.n_expert_groups > 1 else None,
        router_num_limited_groups=cfg.n_limited_groups if cfg.n_expert_groups > 1 else None,
        router_route_scale=cfg.route_scale, router_route_norm=cfg.norm_topk, attn_backend="flex",
        moe_comm_backend="standard", non_blocking_capacity_factor=None,
        rope=ComplexRoPE.Config(dim=cfg.qk_rope_head_dim, max_seq_len=cfg.max_seq_len, theta=cfg.rope_theta,
                                scaling="none"))
    from moetrain.model.deepseek.attention import LATENT_NORM_EPS
    for lc in layers:
        if sdpa:
            lc.attention.inner_attention = ScaledDotProductAttention.Config()
        # TorchTitan's RMSNorm default eps is 1e-5; use the model's (and the fixed latent-norm eps of DeepSeek/HF).
        lc.attention_norm.eps = lc.ffn_norm.eps = cfg.norm_eps
        lc.attention.q_norm.eps = lc.attention.kv_norm.eps = LATENT_NORM_EPS
    return DeepSeekV3Model.Config(
        vocab_size=cfg.vocab_size, dim=cfg.dim,
        tok_embeddings=Embedding.Config(num_embeddings=cfg.vocab_size, embedding_dim=cfg.dim,
                                        param_init=_EMBEDDING_INIT),
        norm=RMSNorm.Config(normalized_shape=cfg.dim, param_init=_NORM_INIT, eps=cfg.norm_eps),
        lm_head=Linear.Config(in_features=cfg.dim, out_features=cfg.vocab_size,
                              param_init=_output_linear_init(cfg.dim)),
        layers=layers, mtp_layers=[])


def _titan_names(layer: str, moe: bool) -> dict[str, str]:
    """TorchTitan parameter name -> moetrain parameter name, for one block."""
    m = {"attention.wq_a.weight": "self_attn.q_a_proj.weight", "attention.q_norm.weight": "self_attn.q_a_layernorm.weight",
         "attention.wq_b.weight": "self_attn.q_b_proj.weight", "attention.wq.weight": "self_attn.q_proj.weight",
         "attention.wkv_a.weight": "self_attn.kv_a_proj_with_mqa.weight",
         "attention.kv_norm.weight": "self_attn.kv_a_layernorm.weight",
         "attention.wkv_b.weight": "self_attn.kv_b_proj.weight", "attention.wo.weight": "self_attn.o_proj.weight",
         "attention_norm.weight": "input_layernorm.weight", "ffn_norm.weight": "post_attention_layernorm.weight"}
    if moe:
        m.update({"moe.routed_experts.inner_experts.w1_EFD": "mlp.experts.w1_EFD",
                  "moe.routed_experts.inner_experts.w2_EDF": "mlp.experts.w2_EDF",
                  "moe.routed_experts.inner_experts.w3_EFD": "mlp.experts.w3_EFD",
                  "moe.router.gate.weight": "mlp.gate.weight", "moe.expert_bias_E": "mlp.gate.expert_bias",
                  "moe.shared_experts.w1.weight": "mlp.shared_experts.w1.weight",
                  "moe.shared_experts.w2.weight": "mlp.shared_experts.w2.weight",
                  "moe.shared_experts.w3.weight": "mlp.shared_experts.w3.weight"})
    else:
        m.update({f"feed_forward.{w}.weight": f"mlp.{w}.weight" for w in ("w1", "w2", "w3")})
    return {f"layers.{layer}.{k}": f"layers.{layer}.{v}" for k, v in m.items()}


def titan_model_from_moetrain(src: nn.Module, cfg: ModelConfig, device: str, fp32_experts: bool = True):
    """TorchTitan DeepSeek-V3 with ``src``'s weights (CPU adaptations of ``TORCHTITAN_CPU_NOTES`` applied)."""
    if fp32_experts:
        _titan_patch_fp32_experts()
    mc = titan_model_config(cfg)
    with torch.device(device):
        model = mc.build()  # parameters uninitialised (torch.empty), RoPE cache computed in __init__
    names = {"tok_embeddings.weight": "embed_tokens.weight", "norm.weight": "norm.weight",
             "lm_head.weight": "lm_head.weight"}
    for i in range(cfg.n_layers):
        names.update(_titan_names(str(i), cfg.is_moe_layer(i)))
    ours = moetrain_tensors(src)
    params = dict(model.named_parameters())
    missing = sorted(set(params) - set(names))
    if missing:
        raise RuntimeError(f"TorchTitan parameters without a moetrain counterpart: {missing[:8]}")
    with torch.no_grad():
        for k, t in (params | dict(model.named_buffers())).items():
            if k in names:
                t.copy_(ours[names[k]])
            elif k.endswith("tokens_per_expert_E"):
                t.zero_()
    return model.train()


def titan_moe_from_moetrain(moe, cfg: ModelConfig, fp32_experts: bool = True, device: str = "cpu") -> nn.Module:
    """TorchTitan's MoE module (standalone) with the weights of moetrain MoE layer ``moe``."""
    if fp32_experts:
        _titan_patch_fp32_experts()
    mc = titan_model_config(cfg)
    layer_cfg = mc.layers[cfg.n_dense_layers]
    with torch.device(device):
        tm = layer_cfg.moe.build()
    with torch.no_grad():
        tm.routed_experts.inner_experts.w1_EFD.copy_(moe.experts.w1_EFD)
        tm.routed_experts.inner_experts.w2_EDF.copy_(moe.experts.w2_EDF)
        tm.routed_experts.inner_experts.w3_EFD.copy_(moe.experts.w3_EFD)
        tm.router.gate.weight.copy_(moe.gate.weight)
        tm.expert_bias_E.copy_(moe.gate.expert_bias)
        tm.tokens_per_expert_E.zero_()
        tm.shared_experts.w1.weight.copy_(moe.shared_experts.w1.weight)
        tm.shared_experts.w2.weight.copy_(moe.shared_experts.w2.weight)
        tm.shared_experts.w3.weight.copy_(moe.shared_experts.w3.weight)
    return tm.train()


def torchtitan_import_error() -> str | None:
    """None if TorchTitan's DeepSeek-V3 imports here, else the reason (exact exception)."""
    try:
        import torchtitan.models.deepseek_v3  # noqa: F401
    except Exception as e:  # noqa: BLE001
        return f"{type(e).__name__}: {e}"
    return None


def peer_site_path() -> list[str]:
    from common import PEER_SITE
    return [str(PEER_SITE)] if PEER_SITE.exists() else []


def init_moe_reference(cfg: ModelConfig, device: str = "cpu"):
    """moetrain's MoE layer with the suite's reference weights (seed 0, N(0, init_std) in registration order),
    built from the unpatched class."""
    from moetrain.model.moe import MoE
    torch.manual_seed(0)
    with torch.device(device):
        ref = MoE(cfg)
    with torch.no_grad():
        for p in ref.parameters():
            p.normal_(0.0, cfg.init_std)
    return ref


def copy_moe_weights(dst, src) -> None:
    """Copy a MoE layer's weights by name; expert weights through ``w1_EFD``/``w2_EDF``/``w3_EFD``, which a patched
    layout may expose as views of one fused parameter."""
    with torch.no_grad():
        for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
            getattr(dst.experts, name).copy_(getattr(src.experts, name))
        dst.gate.weight.copy_(src.gate.weight)
        dst.gate.expert_bias.copy_(src.gate.expert_bias)
        if src.shared_experts is not None:
            for a, b in zip(dst.shared_experts.parameters(), src.shared_experts.parameters()):
                a.copy_(b)


def moetrain_tensors(model: nn.Module) -> dict[str, torch.Tensor]:
    """moetrain's parameters and buffers by name, plus the gate/up views ``...experts.w1_EFD`` / ``w3_EFD`` of every
    stacked ``w13_E2FD`` (the peers store the two projections separately)."""
    from moetrain.model.experts import GroupedExperts
    out = dict(model.named_parameters()) | dict(model.named_buffers())
    for name, mod in model.named_modules():
        if isinstance(mod, GroupedExperts):
            out[f"{name}.w1_EFD"], out[f"{name}.w3_EFD"] = mod.w1_EFD, mod.w3_EFD
    return out


def peer_optimizer(model: nn.Module, lr: float, weight_decay: float = 0.1, betas=(0.9, 0.95), eps: float = 1e-8):
    """AdamW with moetrain's settings and grouping (decay on matrices, none on vectors), in the implementation the
    peers use by default: the fused kernel (HF Trainer ``optim="adamw_torch_fused"`` for torch >= 2.8; TorchTitan
    ``implementation="fused"``)."""
    decay = [p for p in model.parameters() if p.requires_grad and p.ndim >= 2]
    no_decay = [p for p in model.parameters() if p.requires_grad and p.ndim < 2]
    groups = [{"params": decay, "weight_decay": weight_decay}, {"params": no_decay, "weight_decay": 0.0}]
    return torch.optim.AdamW(groups, lr=lr, betas=betas, eps=eps, fused=True)


def rel_diff(a: float, b: float) -> float:
    return abs(a - b) / max(abs(a), 1e-30)


def finite(x: float) -> bool:
    return isinstance(x, (int, float)) and math.isfinite(x)


__all__ = ["bench_config", "gpu_1x", "hf_moe_from_moetrain", "hf_causal_lm", "titan_model_from_moetrain",
           "titan_moe_from_moetrain", "TORCHTITAN_CPU_NOTES", "HF_IMPLS", "os"]
