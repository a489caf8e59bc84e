"""Presets of the Qwen3-MoE architecture: the released Qwen3-30B-A3B and Qwen3-235B-A22B configs and the demo size
``qwen3-tiny``; with the training settings each brings (``JOB_DEFAULTS``)."""

from __future__ import annotations

from typing import Any, Callable

from moetrain.model.qwen3.config import Qwen3MoeConfig


def qwen3_30b_a3b() -> Qwen3MoeConfig:
    """Exactly the released Qwen/Qwen3-30B-A3B ``config.json`` (30.5B total, 3.3B active): 48 layers, hidden 2048,
    32 query / 4 key-value heads of 128, 128 experts of width 768, top-8, vocabulary 151,936, rope_theta 1e6."""
    return Qwen3MoeConfig()


def qwen3_235b_a22b() -> Qwen3MoeConfig:
    """Exactly the released Qwen/Qwen3-235B-A22B ``config.json`` (235B total, 22B active): 94 layers, hidden 4096,
    64 query / 4 key-value heads of 128, 128 experts of width 1536, top-8, dense width 12,288 (unused: every layer
    is MoE)."""
    return Qwen3MoeConfig(dim=4096, n_layers=94, dense_ffn_dim=12_288, expert_ffn_dim=1536, n_heads=64)


def qwen3_tiny() -> Qwen3MoeConfig:
    """A few-million-parameter Qwen3-MoE that trains on a CPU like ``tiny``: GQA with 4 query / 2 key-value heads
    with q/k norms, 16 experts top-4 with the softmax router, global-batch balance loss."""
    return Qwen3MoeConfig(
        vocab_size=2048, dim=128, n_layers=4, dense_ffn_dim=384, expert_ffn_dim=64, n_routed_experts=16, top_k=4,
        n_heads=4, n_kv_heads=2, head_dim=32, rope_theta=10_000.0, max_seq_len=1024,
        # A short run needs a stronger pull towards balance than Qwen3's 1e-3 to keep the router from collapsing.
        balance_loss_alpha=1e-2,
    )


PRESETS: dict[str, Callable[[], Qwen3MoeConfig]] = {
    "qwen3-30b-a3b": qwen3_30b_a3b,
    "qwen3-235b-a22b": qwen3_235b_a22b,
    "qwen3-tiny": qwen3_tiny,
}

#: The training settings of each preset (see :data:`moetrain.model.config.PRESET_JOB_DEFAULTS`): the released sizes
#: take a conservative continued-pre-training start at 4K sequences (Qwen3's pre-training context, Qwen3 technical
#: report arXiv 2505.09388 sec. 3.2); ``qwen3-tiny`` is the demo's ``tiny`` row.
JOB_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    "qwen3-30b-a3b": {"parallel": {"ep": 8}, "data": {"seq_len": 4096},
                      "train": {"micro_batch_size": 1, "lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 100}},
    "qwen3-235b-a22b": {"parallel": {"ep": 64}, "data": {"seq_len": 4096},
                        "train": {"micro_batch_size": 1, "lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 100}},
    "qwen3-tiny": {"parallel": {"ep": 2}, "data": {"seq_len": 64}, "train": {}},
}
