"""Presets of the DeepSeek-V3 architecture: the released DeepSeek-V3 and Kimi-K2 configs, the DeepSeek-V2-Lite shape,
and the demo/benchmark sizes ``tiny`` and ``small``; with the training settings each brings (``JOB_DEFAULTS``)."""

from __future__ import annotations

from typing import Any, Callable

from moetrain.model.deepseek.config import DeepSeekV3Config


def deepseek_v3_671b() -> DeepSeekV3Config:
    """Exactly the released DeepSeek-V3 configuration (671B total, 37B active, one MTP module)."""
    return DeepSeekV3Config()


def deepseek_v2_lite_16b() -> DeepSeekV3Config:
    """The DeepSeek-V2-Lite shape (15.7B): softmax router, no groups, plain q projection, 2 shared experts."""
    return DeepSeekV3Config(
        vocab_size=102_400, dim=2048, n_layers=27, n_dense_layers=1, dense_ffn_dim=10_944, expert_ffn_dim=1408,
        n_routed_experts=64, n_shared_experts=2, top_k=6, n_expert_groups=1, n_limited_groups=1,
        score_func="softmax", norm_topk=False, route_scale=1.0, n_heads=16, q_lora_rank=0, kv_lora_rank=512,
        rope_mscale=0.707, rope_mscale_all_dim=0.707, mtp_depth=0, bias_update_rate=0.0,
    )


def kimi_k2_1t() -> DeepSeekV3Config:
    """Exactly the released Kimi-K2 configuration (moonshotai/Kimi-K2-Instruct ``config.json``; a DeepSeek-V3
    architecture): 384 experts, top-8 in one group, 64 heads, 61 layers with one dense, vocabulary 163,840, routed
    scale 2.827, YaRN factor 32 over a 4K original context (beta_fast = beta_slow = 1), rope_theta 50,000, no MTP.
    1.04T total / 32.6B active parameters (Kimi K2 technical report, arXiv 2507.20534; docs/reference.md
    section 15)."""
    return DeepSeekV3Config(
        vocab_size=163_840, dim=7168, n_layers=61, n_dense_layers=1, dense_ffn_dim=18_432, expert_ffn_dim=2048,
        n_routed_experts=384, n_shared_experts=1, top_k=8, n_expert_groups=1, n_limited_groups=1,
        score_func="sigmoid", norm_topk=True, route_scale=2.827, n_heads=64, q_lora_rank=1536, kv_lora_rank=512,
        qk_nope_head_dim=128, qk_rope_head_dim=64, v_head_dim=128, rope_theta=50_000.0, rope_factor=32.0,
        rope_beta_fast=1.0, rope_beta_slow=1.0, rope_mscale=1.0, rope_mscale_all_dim=1.0,
        rope_original_seq_len=4096, max_seq_len=131_072, norm_eps=1e-6, init_std=0.02, mtp_depth=0,
    )


def tiny() -> DeepSeekV3Config:
    """A few-million-parameter model that trains on a CPU in minutes yet keeps every V3 feature: MLA with q_lora,
    4 expert groups with group-limited routing, a shared expert, a dense first layer, MTP depth 1, YaRN RoPE."""
    return DeepSeekV3Config(
        vocab_size=2048, dim=128, n_layers=4, n_dense_layers=1, dense_ffn_dim=384, expert_ffn_dim=64,
        n_routed_experts=16, n_shared_experts=1, top_k=4, n_expert_groups=4, n_limited_groups=2,
        n_heads=4, q_lora_rank=64, kv_lora_rank=32, qk_nope_head_dim=32, qk_rope_head_dim=16, v_head_dim=32,
        rope_factor=4.0, rope_original_seq_len=256, max_seq_len=1024, mtp_depth=1, init_std=0.02,
        # A run of a few hundred steps needs a faster bias than V3's 1e-3 to keep the router from collapsing.
        bias_update_rate=1e-2,
    )


def small() -> DeepSeekV3Config:
    """About 295M total / 126M active parameters (318M with MTP): the benchmark preset."""
    return DeepSeekV3Config(
        vocab_size=32_768, dim=768, n_layers=12, n_dense_layers=1, dense_ffn_dim=3072, expert_ffn_dim=256,
        n_routed_experts=32, n_shared_experts=1, top_k=6, n_expert_groups=8, n_limited_groups=4,
        n_heads=12, q_lora_rank=384, kv_lora_rank=256, qk_nope_head_dim=64, qk_rope_head_dim=32, v_head_dim=64,
        rope_factor=1.0, rope_original_seq_len=2048, max_seq_len=2048, mtp_depth=1, init_std=0.02,
    )


PRESETS: dict[str, Callable[[], DeepSeekV3Config]] = {
    "deepseek-v3-671b": deepseek_v3_671b,
    "deepseek-v2-lite-16b": deepseek_v2_lite_16b,
    "kimi-k2-1t": kimi_k2_1t,
    "tiny": tiny,
    "small": small,
}

#: The training settings of each preset (see :data:`moetrain.model.config.PRESET_JOB_DEFAULTS`). ``tiny`` is the
#: built-in CPU demo (``moetrain train`` with no arguments): its training values are TrainConfig's own defaults, and
#: 64-token sequences were measured to lower the validation loss fastest per step on a 2-core CPU (val loss after 100
#: steps: 4.50 at L=64, 4.71 at 128, 4.78 at 256, 4.95 at 512; same tokens per step), which is what lets the demo
#: halve its loss in under five minutes. The others follow their published recipes (DeepSeek-V3: lr 2.2e-4, 2,000
#: warm-up steps, 4K sequences, EP 64; DeepSeek-V2-Lite: lr 4.2e-4, 4K sequences; Kimi-K2: lr 2e-4 decaying to
#: 2e-5, 4K sequences, arXiv 2507.20534, with DeepSeek-V3's warm-up) or, for ``small`` (126M active), GPT-3 Small's
#: lr of 6e-4 with 1K sequences.
JOB_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "deepseek-v3-671b": {"parallel": {"ep": 64}, "data": {"seq_len": 4096},
                         "train": {"micro_batch_size": 1, "lr": 2.2e-4, "min_lr": 2.2e-5, "warmup_steps": 2000}},
    "deepseek-v2-lite-16b": {"parallel": {"ep": 8}, "data": {"seq_len": 4096},
                             "train": {"micro_batch_size": 1, "lr": 4.2e-4, "min_lr": 4.2e-5, "warmup_steps": 2000}},
    "kimi-k2-1t": {"parallel": {"ep": 64}, "data": {"seq_len": 4096},
                   "train": {"micro_batch_size": 1, "lr": 2e-4, "min_lr": 2e-5, "warmup_steps": 2000}},
    "tiny": {"parallel": {"ep": 2}, "data": {"seq_len": 64}, "train": {}},
    "small": {"parallel": {"ep": 8}, "data": {"seq_len": 1024},
              "train": {"micro_batch_size": 8, "lr": 6e-4, "min_lr": 6e-5, "warmup_steps": 100}},
}
