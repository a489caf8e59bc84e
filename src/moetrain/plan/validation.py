"""The validation set: published MoE training throughputs the model was NOT calibrated on, and its report.

Rules (issue "moetrain plan must generalise"): every point is a public figure with its source; the plan of each
point is the published layout plus the published recipe's settings (dispatcher, EP overlap, CUDA graphs,
recompute), never a value chosen to make the prediction agree; no constant of :mod:`moetrain.plan.constants` is
fitted to any of these points -- they are predicted with the same per-generation set as the four records.

Sources:

* ``MB-26.02`` / ``MB-25.11``: the Megatron-Bridge performance summary tables, sections "26.02 NeMo Container"
  and "25.11 NeMo Container" (NVIDIA-NeMo/Megatron-Bridge ``docs/performance-summary.md``; the same tables in
  ``docs/performance-summary-archive.md``). "In MoE training benchmarks, we force-balance the token distribution
  among experts and all benchmarks are token-dropless." Their recipes: ``scripts/performance/configs/deepseek/
  deepseek_workload_base_configs.py`` and ``scripts/performance/configs/qwen/qwen3_workload_base_configs.py``
  (dispatcher ``moe_flex_dispatcher_backend`` / ``moe_token_dispatcher_type``, ``moe_a2a_overlap``,
  ``cuda_graph_impl`` / ``cuda_graph_scope``, ``recompute_modules``). Where the table's layout differs from the
  recipe file now in the repository, the recipe settings of the same GPU family are used and the point says so.
* ``MB-26.06``: the same tables, section "26.06 NeMo Container" (``docs/performance-summary-archive.md``): the release
  of the GB300 and GB200 records (docs/reference.md section 4). Its recipes are those of the repository at the
  26.06 summary commits (8f341b04f "perf summary b300 26.06"): Qwen3 MXFP8 on GB300 / GB200 / B300 with
  ``moe_a2a_overlap=True``, ``cuda_graph_impl="full_iteration"``, ``cutedsl_fused_grouped_mlp``,
  ``fp8_dot_product_attention``; DeepSeek-V3 B300 V2 (MBS 2, PP8, EP8, hybridep, no overlap, TE graphs of attn /
  router / preprocess, ``mla_up_proj``); Qwen3-30B-A3B H100 FP8-CS (EP16, hybridep, no overlap, no graphs). The
  table's other MoE rows are not here: GPT-OSS (attention sinks, sliding windows: not in the accounting),
  Nemotron 3 (hybrid Mamba), Kimi-K2 (its tokens/s and TFLOP/s imply 204.6 GFLOP/token, the Megatron FLOPs of the
  Hugging Face Kimi-K2 config are 238.1: the benchmarked shape is not known).
* ``MB-26.04.01`` / ``MB-26.04``: the same tables, sections "26.04.01 NeMo Container" (every DeepSeek-V3 and Qwen3
  row) and "26.04 NeMo Container" (the three rows whose recipe 26.04.01 changed), recipes read at the release tags
  the containers were built from (v0.4.2, v0.4.0). The 26.06.01 and 26.08 tables repeat the 26.06 recipes
  unchanged (tags v0.5.1, v0.6.0) within 0.3-2% and their DeepSeek-V3 rows are the records' plans: not in the set.
* ``MLM-recipes``: Megatron-LM's self-contained MoE recipes (NVIDIA/Megatron-LM dev 9c5258f109,
  ``examples/moe_recipes/*.yaml`` with every training argument, median TFLOP/s in its README): every row with a
  figure and a model the planner shapes.
* ``ModelZoo``: NVIDIA's Megatron-MoE-ModelZoo (yanring/Megatron-MoE-ModelZoo ``best_practice/Qwen3/readme.md``,
  "Performance Results", 256 H100, InfiniBand 8 x 50 GB/s): Megatron-Core runs with the DeepEP and the A2A
  dispatchers, with and without 1F1B EP overlap; ``best_practice/mixtral/run_mixtral_8x22B.sh`` (e8650517):
  Mixtral-8x22B on 128 H100, BF16 and FP8 blockwise.
* Other frameworks: ``TorchTitan`` (the PyTorch + Nebius DeepSeek-V3 run on 256 B200, launch script
  nebius/ml-cookbook a2fb44d ``pytorch-dsv3-mxfp8/train_671b.sh``), ``AutoModel`` (NVIDIA-NeMo/Automodel 89e3a9f
  ``docs/performance-summary.md``), ``MegatronLM`` (NVIDIA/Megatron-LM
  ``docs/discussions/deepseek-v3-gb200-optimization/``). TorchTitan and AutoModel publish tokens/s: those points are
  compared in tokens/s (:attr:`Point.tokens_per_s_per_gpu`).

docs/validation.md holds the table with the latest predictions; ``moetrain plan --validate`` prints it.
"""

from __future__ import annotations

import functools
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from moetrain.plan.plan import Plan
from moetrain.plan.shape import ModelShape, load_shape, shape_from_hf

if TYPE_CHECKING:
    from moetrain.plan.hardware import GPUSpec

#: Hugging Face ``config.json`` fields of the other models (Qwen/Qwen3-235B-A22B, Qwen/Qwen3-30B-A3B).
MODEL_CONFIGS: dict[str, dict[str, Any]] = {
    "qwen3-235b-a22b": {
        "model_type": "qwen3_moe", "hidden_size": 4096, "num_hidden_layers": 94, "num_attention_heads": 64,
        "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "intermediate_size": 12288,
        "moe_intermediate_size": 1536, "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "tie_word_embeddings": False, "max_position_embeddings": 40960},
    # mistralai/Mixtral-8x22B-v0.1 config.json (the ModelZoo's Mixtral-8x22B runs)
    "mixtral-8x22b": {
        "model_type": "mixtral", "hidden_size": 6144, "num_hidden_layers": 56, "num_attention_heads": 48,
        "num_key_value_heads": 8, "vocab_size": 32000, "intermediate_size": 16384, "num_local_experts": 8,
        "num_experts_per_tok": 2, "max_position_embeddings": 65536, "tie_word_embeddings": False},
    "qwen3-30b-a3b": {
        "model_type": "qwen3_moe", "hidden_size": 2048, "num_hidden_layers": 48, "num_attention_heads": 32,
        "num_key_value_heads": 4, "head_dim": 128, "vocab_size": 151936, "intermediate_size": 6144,
        "moe_intermediate_size": 768, "num_experts": 128, "num_experts_per_tok": 8, "decoder_sparse_step": 1,
        "mlp_only_layers": [], "tie_word_embeddings": False, "max_position_embeddings": 40960},
}

#: Goal of the issue: mean absolute error at most 12%, no point beyond 25%.
MAE_GOAL = 0.12
MAX_GOAL = 0.25


def model_shape(name: str) -> ModelShape:
    """A validation model: a moetrain preset or one of :data:`MODEL_CONFIGS`."""
    if name in MODEL_CONFIGS:
        return shape_from_hf(MODEL_CONFIGS[name], name=name)
    return load_shape(name)


@dataclass(frozen=True)
class Point:
    """One published throughput outside the calibration records."""

    key: str
    source: str
    model: str
    gpu: str
    n_gpus: int
    plan: Plan
    tflops_per_gpu: float
    note: str = ""
    what_differs: tuple[str, ...] = field(default=())
    #: the source row's tokens/s and TFLOP/s disagree with the Megatron FLOPs of its model (kept in the set and in
    #: the MAE; the report also gives the MAE without such rows). No row of the set is flagged at present.
    inconsistent: bool = False
    #: the source's own figure when it publishes tokens/s (TorchTitan, NeMo AutoModel: their TFLOP/s use other
    #: FLOPs formulas); ``tflops_per_gpu`` is then that rate times the Megatron FLOPs per token of the plan
    #: (:func:`megatron_tflops`), so the comparison is one of tokens/s.
    tokens_per_s_per_gpu: float | None = None

    @property
    def release(self) -> str:
        """Software release the figure was measured with: the NeMo container of a Megatron-Bridge table ("26.06",
        "26.02", "25.11"), or the source ("ModelZoo", "TorchTitan", ...). The same configuration moves by tens of
        percent between releases (docs/validation.md), so the report also gives the MAE per release."""
        head = self.source.split()[0]
        return head[3:] if head.startswith("MB-") else head


def tokens_point(key: str, source: str, model: str, gpu: str, n_gpus: int, plan: Plan, tokens_per_s_per_gpu: float,
                 note: str, what_differs: tuple[str, ...]) -> Point:
    """A :class:`Point` whose source publishes tokens/s per GPU: its TFLOP/s is :func:`megatron_tflops` of that
    rate for this plan, so the point's error is the tokens/s error."""
    return Point(key, source, model, gpu, n_gpus, plan, megatron_tflops(model, plan, tokens_per_s_per_gpu), note,
                 what_differs, tokens_per_s_per_gpu=tokens_per_s_per_gpu)


def megatron_tflops(model: str, plan: Plan, tokens_per_s_per_gpu: float) -> float:
    """A published tokens/s per GPU in Megatron-Core TFLOP/s per GPU: times the Megatron FLOPs per token of
    ``model`` at the plan's sequence length and MTP depth (``moetrain.accounting``, what ``predict`` reports)."""
    from moetrain.plan.shape import with_mtp_depth

    return tokens_per_s_per_gpu * with_mtp_depth(model_shape(model), plan.mtp_depth).flops_per_token(
        plan.seq_len) / 1e12


def even_layout(n_layers: int, pp: int, vpp: int = 1) -> str:
    """The pipeline layout Megatron-Core builds with ``account_for_embedding_in_pipeline_split`` and
    ``account_for_loss_in_pipeline_split`` (the Qwen3 recipes of Megatron-Bridge and Megatron-LM): the embedding
    and the loss count as one layer each, and the ``n_layers + 2`` slots split evenly over the ``pp x vpp``
    chunks. E.g. 94 layers on PP4 x VP12: ``"Et|(t*2|)*46tL"``. Raises ValueError if the slots do not divide."""
    chunks = pp * vpp
    if (n_layers + 2) % chunks:
        raise ValueError(f"{n_layers} layers + embedding + loss do not split evenly over {chunks} chunks")
    per = (n_layers + 2) // chunks

    def run(n: int) -> str:
        return "t" if n == 1 else f"t*{n}"

    if chunks == 1:
        return f"E{run(n_layers)}L"
    middle = f"({run(per)}|)*{chunks - 2}" if chunks > 2 else ""
    return f"E{run(per - 1)}|{middle}{run(per - 1)}L"


_DS = "deepseek-v3-671b"
_Q235, _Q30, _MIX = "qwen3-235b-a22b", "qwen3-30b-a3b", "mixtral-8x22b"
#: Megatron-Bridge's DeepSeek-V3 pipeline layouts (``set_deepseek_v3_pipeline_model_parallel_layout`` in
#: src/megatron/bridge/recipes/deepseek/deepseek_v3.py, there since August 2025): (PP, VP) = (16, 1), (8, 2) and
#: (4, 4) put the embedding and 4 layers first, then 4 layers a stage, then 1 layer, MTP and the loss; (8, 1)
#: 8 layers a stage and 5 with MTP and the loss last.
_LAYOUT = "Et*4|(t*4|)*14tmL"
_LAYOUT_NO_MTP = "Et*4|(t*4|)*14tL"
_LAYOUT_PP8 = "Et*8|(t*8|)*6t*5mL"

#: TorchTitan's DeepSeek-V3 run on 256 B200 (nebius/ml-cookbook a2fb44d, pytorch-dsv3-mxfp8/train_671b.sh, torchtitan
#: 1a36996b): TP2, PP2 with Interleaved1F1B (2 stages a rank), EP32, the rest FSDP (64), 64 sequences of 8,192 per
#: data-parallel rank, micro-batch 1, full activation checkpointing, torch.compile, forced balance, no MTP.
_TITAN_DSV3 = Plan(tp=2, pp=2, vpp=2, ep=32, micro_batch=1, global_batch=4096, seq_len=8192, precision="bf16",
                   recompute="full", fsdp=True, framework="torchtitan", cuda_graphs="none", mtp_depth=0,
                   optimizer="fp32", name="DSv3 B200 TorchTitan")
#: NeMo AutoModel's DeepSeek-V3 row (NVIDIA-NeMo/Automodel 89e3a9f, docs/performance-summary.md and
#: examples/benchmark/configs/deepseek_v3_te_deepep.yaml): PyTorch-native FSDP2 with TE layers and DeepEP, eager,
#: PP4 interleaved (2 layers a stage: VP8), EP64, FSDP64, micro-batch 1, 512 sequences, full checkpointing.
_AUTOMODEL_DSV3 = Plan(pp=4, vpp=8, ep=64, micro_batch=1, global_batch=512, precision="bf16", recompute="full",
                       fsdp=True, dispatcher="flex", framework="torchtitan", cuda_graphs="none", mtp_depth=0,
                       optimizer="fp32", name="DSv3 H100 AutoModel")
#: Megatron-MoE-ModelZoo best_practice/mixtral/run_mixtral_8x22B.sh (yanring/Megatron-MoE-ModelZoo e8650517): 128
#: H100, TP2/PP8/VPP7/EP8, micro-batch 1, 256 sequences of 4,096, NCCL alltoall, no recompute, no CUDA graphs.
_MIXTRAL = Plan(tp=2, pp=8, vpp=7, ep=8, micro_batch=1, global_batch=256, precision="bf16", dispatcher="alltoall",
                ep_overlap=False, cuda_graphs="none", optimizer="bf16", name="Mixtral-8x22B H100")

#: Megatron-Bridge 26.04 / 26.04.01 recipe defaults (release tags v0.4.0 / v0.4.2): DeepSeek-V3 -- MXFP8 with FP8
#: primary weights, precision-aware optimizer (BF16 moments and gradients), MTP 1, the recipes' 16-stage layout,
#: selective recompute, hybridep, no EP overlap; Qwen3 -- MXFP8 with FP8 primary weights, FP32 optimizer, no
#: recompute, hybridep, no EP overlap, TE graphs. Each point overrides what its recipe entry sets differently.
_MB_DS = Plan(micro_batch=1, global_batch=4096, precision="mxfp8", fp8_param=True, optimizer="bf16",
              dispatcher="flex", ep_overlap=False, recompute="selective", recompute_modules=("mla_up_proj",),
              pp_layout=_LAYOUT, name="Megatron-Bridge 26.04 DeepSeek-V3 recipe")
_MB_QW = Plan(micro_batch=1, global_batch=8192, precision="mxfp8", fp8_param=True, optimizer="fp32",
              dispatcher="flex", ep_overlap=False, recompute="none", cuda_graphs="partial",
              name="Megatron-Bridge 26.04 Qwen3 recipe")

#: The common settings of Megatron-LM's MoE recipes (NVIDIA/Megatron-LM dev 9c5258f109, examples/moe_recipes/*.yaml):
#: MXFP8 with FP8 primary weights, FP32 master and BF16 moments (precision-aware optimizer), the flex dispatcher
#: (HybridEP, or DeepEP where the point says so), forced balance, sequences of 4,096, micro-batch 1; each point
#: overrides what its YAML sets differently.
_MLM = Plan(micro_batch=1, global_batch=8192, precision="mxfp8", fp8_param=True, optimizer="bf16-moments",
            dispatcher="flex", ep_overlap=False, recompute="none", name="Megatron-LM MoE recipe")

POINTS: tuple[Point, ...] = (
    # ---- DeepSeek-V3 on other GPUs / recipes / batch sizes ------------------------------------------------------
    Point("dsv3-b200-gbs4096", "MB-26.02 DGX-B200", _DS, "b200", 256,
          Plan(pp=16, ep=8, micro_batch=1, global_batch=4096, precision="mxfp8", recompute="selective",
               recompute_modules=("mla_up_proj",), dispatcher="flex", ep_overlap=False, cuda_graphs="none",
               pp_layout=_LAYOUT, optimizer="bf16", fp8_param=True, name="DSv3 B200"),
          699, "recipe DEEPSEEK_V3_PRETRAIN_CONFIG_B200_V2: hybridep, no a2a overlap, no CUDA graphs, mla_up_proj",
          ("HGX B200 (8-GPU NVLink domain)", "PP16 x EP8")),
    Point("dsv3-b200-gbs2048", "MB-25.11 DGX-B200", _DS, "b200", 256,
          Plan(pp=16, ep=8, micro_batch=1, global_batch=2048, precision="mxfp8", recompute="selective",
               recompute_modules=("mla_up_proj",), dispatcher="flex", ep_overlap=False, cuda_graphs="none",
               pp_layout=_LAYOUT, optimizer="bf16", fp8_param=True, name="DSv3 B200 GBS2048"),
          557, "recipe DEEPSEEK_V3_PRETRAIN_CONFIG_B200_V1 (GBS 2048)", ("batch size",)),
    Point("dsv3-b300", "MB-26.02 DGX-B300", _DS, "b300", 256,
          Plan(pp=16, ep=8, micro_batch=1, global_batch=4096, precision="mxfp8", recompute="selective",
               recompute_modules=("mla_up_proj",), dispatcher="flex", ep_overlap=False, cuda_graphs="none",
               pp_layout=_LAYOUT, optimizer="bf16", fp8_param=True, name="DSv3 B300"),
          776, "the table's PP16/EP8 is not the B300 recipe now in the repository (PP8/VP2); the B200 recipe's "
               "settings of that layout are assumed", ("HGX B300",)),
    Point("dsv3-gb300-mbs2", "MB-26.02 DGX-GB300", _DS, "gb300", 256,
          Plan(pp=2, vpp=8, ep=32, micro_batch=2, global_batch=4096, precision="mxfp8", recompute="selective",
               recompute_modules=("mla_up_proj",), dispatcher="flex", ep_overlap=False, cuda_graphs="none",
               pp_layout=_LAYOUT, optimizer="bf16", fp8_param=True, name="DSv3 GB300 26.02"),
          1199, "recipe DEEPSEEK_V3_PRETRAIN_CONFIG_GB300_V1 (MBS 2, hybridep, no a2a overlap, cuda_graph_scope [], "
                "mla_up_proj): the record's layout before overlap, graphs and FP8 attention",
          ("no EP overlap", "no CUDA graphs", "MBS 2")),
    Point("dsv3-gb200-2602", "MB-26.02 DGX-GB200", _DS, "gb200", 256,
          Plan(pp=4, vpp=4, ep=64, micro_batch=1, global_batch=4096, precision="mxfp8", recompute="selective",
               recompute_modules=("mlp",), dispatcher="flex", ep_overlap=False, cuda_graphs="partial",
               pp_layout=_LAYOUT, optimizer="bf16", fp8_param=True, name="DSv3 GB200 26.02"),
          1028, "recipe DEEPSEEK_V3_PRETRAIN_CONFIG_GB200_V1: hybridep, no a2a overlap, partial CUDA graphs (attn, "
                "moe_router, moe_preprocess), recompute mlp", ("no EP overlap", "partial CUDA graphs")),
    Point("dsv3-gb200-bf16", "MB-25.11 DGX-GB200", _DS, "gb200", 256,
          Plan(pp=4, vpp=4, ep=64, micro_batch=1, global_batch=4096, precision="bf16", recompute="selective",
               recompute_modules=("mla_up_proj",), dispatcher="flex", ep_overlap=False, cuda_graphs="partial",
               pp_layout=_LAYOUT_NO_MTP, mtp_depth=0, optimizer="bf16", name="DSv3 GB200 BF16"),
          782, "DeepSeekV3 (w/o MTP); recipe DEEPSEEK_V3_PRETRAIN_CONFIG_GB200_BF16_V1", ("BF16", "no MTP")),
    Point("dsv3-gb300-bf16", "MB-25.11 DGX-GB300", _DS, "gb300", 256,
          Plan(pp=2, vpp=4, ep=32, micro_batch=1, global_batch=4096, precision="bf16", recompute="selective",
               recompute_modules=("moe_act",), dispatcher="flex", ep_overlap=False, cuda_graphs="partial",
               mtp_depth=0, optimizer="bf16", name="DSv3 GB300 BF16"),
          961, "DeepSeekV3 (w/o MTP); the BF16 recipe of the repository is PP4/VP4/EP64 now: its settings "
               "(hybridep, no overlap, partial graphs, moe_act) are assumed for the table's PP2/VP4/EP32",
          ("BF16", "no MTP")),
    # ---- Qwen3-235B-A22B ---------------------------------------------------------------------------------------
    Point("qwen3-235b-gb300", "MB-26.02 DGX-GB300", _Q235, "gb300", 256,
          Plan(pp=4, ep=32, micro_batch=2, global_batch=8192, precision="mxfp8", dispatcher="flex",
               ep_overlap=False, cuda_graphs="partial", optimizer="fp32", fp8_param=True,
               pp_layout=even_layout(94, 4, 1), name="Qwen3-235B GB300"),
          974, "recipe QWEN3_235B_A22B_PRETRAIN_CONFIG_GB300_*_V2: hybridep, partial CUDA graphs", ("other model",)),
    Point("qwen3-235b-gb200", "MB-26.02 DGX-GB200", _Q235, "gb200", 256,
          Plan(pp=8, ep=32, micro_batch=1, global_batch=8192, precision="mxfp8", dispatcher="flex",
               ep_overlap=False, cuda_graphs="partial", optimizer="fp32", fp8_param=True,
               pp_layout=even_layout(94, 8, 1), name="Qwen3-235B GB200"),
          806, "recipe QWEN3_235B_A22B_PRETRAIN_CONFIG_GB200_FP8_CS_V2: hybridep, partial CUDA graphs",
          ("other model",)),
    Point("qwen3-235b-b200", "MB-26.02 DGX-B200", _Q235, "b200", 256,
          Plan(pp=8, ep=8, micro_batch=1, global_batch=8192, precision="mxfp8", dispatcher="alltoall",
               ep_overlap=False, cuda_graphs="none", optimizer="fp32", fp8_param=True,
               pp_layout=even_layout(94, 8, 1), name="Qwen3-235B B200"),
          563, "recipe QWEN3_235B_A22B_PRETRAIN_CONFIG_B200_FP8_CS_V2: alltoall dispatcher, no a2a overlap",
          ("other model", "alltoall dispatcher")),
    Point("qwen3-235b-h100", "MB-26.02 DGX-H100", _Q235, "h100", 256,
          Plan(tp=2, pp=8, vpp=4, ep=32, micro_batch=1, global_batch=8192, precision="fp8", dispatcher="alltoall",
               ep_overlap=True, cuda_graphs="none", optimizer="fp32", fp8_param=True, pp_layout=even_layout(94, 8, 4),
               name="Qwen3-235B H100"),
          242, "recipe QWEN3_235B_A22B_PRETRAIN_CONFIG_H100_FP8_CS_V2: alltoall dispatcher, moe_a2a_overlap",
          ("other model", "alltoall dispatcher", "combined 1F1B")),
    # ---- Qwen3-30B-A3B -----------------------------------------------------------------------------------------
    Point("qwen3-30b-gb200", "MB-26.02 DGX-GB200", _Q30, "gb200", 8,
          Plan(ep=8, micro_batch=4, global_batch=512, precision="mxfp8", dispatcher="flex", ep_overlap=False,
               cuda_graphs="partial", optimizer="fp32", fp8_param=True, name="Qwen3-30B GB200"),
          600, "recipe QWEN3_30B_A3B_PRETRAIN_CONFIG_GB200_FP8_MX_V1: hybridep, partial CUDA graphs",
          ("small model", "8 GPUs")),
    Point("qwen3-30b-h100", "MB-26.02 DGX-H100", _Q30, "h100", 16,
          Plan(pp=2, vpp=12, ep=8, micro_batch=1, global_batch=1024, precision="fp8", dispatcher="flex",
               ep_overlap=False, cuda_graphs="none", optimizer="fp32", fp8_param=True, name="Qwen3-30B H100"),
          118, "recipe QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1: hybridep, no a2a overlap (the table's EP8 "
               "used, the recipe file says 16). The row is consistent: 5,113 tok/s x 23.0 GFLOP/token = 118 TFLOP/s "
               "(an earlier revision of this file misread it as 2,557 tok/s and flagged it); the same layout "
               "published 9,058 tok/s (208) in the 26.02.01 container", ("small model",)),
    # ---- Megatron-MoE-ModelZoo: dispatcher and overlap on one layout ---------------------------------------------
    Point("qwen3-235b-h100-deepep", "ModelZoo Qwen3 H100", _Q235, "h100", 256,
          Plan(tp=2, pp=8, vpp=4, ep=32, micro_batch=1, global_batch=2048, precision="bf16",
               recompute="selective", recompute_modules=("layernorm", "moe_act"), dispatcher="flex",
               ep_overlap=False, cuda_graphs="none", optimizer="bf16", name="Qwen3-235B H100 DeepEP"),
          245, "DeepEP, BF16, recompute norm + act", ("BF16", "DeepEP")),
    Point("qwen3-235b-h100-deepep-overlap", "ModelZoo Qwen3 H100", _Q235, "h100", 256,
          Plan(tp=2, pp=8, vpp=4, ep=32, micro_batch=1, global_batch=2048, precision="bf16",
               recompute="selective", recompute_modules=("layernorm", "moe_act"), dispatcher="flex",
               ep_overlap=True, cuda_graphs="none", optimizer="bf16", name="Qwen3-235B H100 DeepEP + overlap"),
          276, "DeepEP, BF16, recompute norm + act, + 1F1B EP overlap", ("combined 1F1B",)),
    Point("qwen3-235b-h100-a2a", "ModelZoo Qwen3 H100", _Q235, "h100", 256,
          Plan(tp=2, pp=32, vpp=3, ep=8, micro_batch=1, global_batch=2048, precision="bf16",
               recompute="selective", recompute_modules=("layernorm", "moe_act"), dispatcher="alltoall",
               ep_overlap=False, cuda_graphs="none", optimizer="bf16", name="Qwen3-235B H100 A2A"),
          200, "A2A dispatcher, intra-node EP8, PP32/VPP3", ("alltoall dispatcher", "PP32")),
    # ---- 26.06 NeMo container: the release of the GB300 / GB200 records, its recipes ---------------------------
    Point("dsv3-gb300-gbs15360", "MB-26.06 DGX-GB300", _DS, "gb300", 256,
          Plan(pp=2, vpp=8, ep=32, micro_batch=1, global_batch=15360, precision="mxfp8", attn_precision="fp8",
               recompute="none", ep_overlap=True, pp_layout=_LAYOUT, optimizer="bf16", fp8_param=True,
               dispatcher="flex",
               cuda_graphs="full", fused_mlp=True, name="DSv3 GB300 GBS15360"),
          1670, "recipe DEEPSEEK_V3_PRETRAIN_CONFIG_GB300_FP8_MX (the record's) at GBS 15,360", ("batch size",)),
    Point("dsv3-b300-2606", "MB-26.06 DGX-B300", _DS, "b300", 256,
          Plan(pp=8, ep=8, micro_batch=2, global_batch=4096, precision="mxfp8", recompute="selective",
               recompute_modules=("mla_up_proj",), dispatcher="flex", ep_overlap=False, cuda_graphs="partial",
               pp_layout=_LAYOUT_PP8, optimizer="bf16", fp8_param=True, name="DSv3 B300 26.06"),
          920, "recipe DEEPSEEK_V3_PRETRAIN_CONFIG_B300_V2: MBS 2, PP8, EP8, hybridep, no a2a overlap, TE graphs of "
               "attn / moe_router / moe_preprocess, mla_up_proj; the recipes' DeepSeek-V3 layout for PP8",
          ("HGX B300", "PP8 x EP8", "MBS 2")),
    Point("qwen3-30b-gb300-2606", "MB-26.06 DGX-GB300", _Q30, "gb300", 8,
          Plan(ep=8, micro_batch=8, global_batch=512, precision="mxfp8", attn_precision="fp8", dispatcher="flex",
               ep_overlap=True, cuda_graphs="full", fused_mlp=True, optimizer="fp32", fp8_param=True,
               name="Qwen3-30B GB300 26.06"),
          1041, "recipe QWEN3_30B_A3B_PRETRAIN_CONFIG_GB300_FP8_MX_V1: MBS 8, hybridep, a2a overlap, full-iteration "
                "graphs, fused grouped MLP, FP8 attention", ("small model", "8 GPUs")),
    Point("qwen3-30b-gb200-2606", "MB-26.06 DGX-GB200", _Q30, "gb200", 8,
          Plan(ep=8, micro_batch=4, global_batch=512, precision="mxfp8", attn_precision="fp8", dispatcher="flex",
               ep_overlap=True, cuda_graphs="full", fused_mlp=True, optimizer="fp32", fp8_param=True,
               name="Qwen3-30B GB200 26.06"),
          936, "recipe QWEN3_30B_A3B_PRETRAIN_CONFIG_GB200_FP8_MX_V1: MBS 4, hybridep, a2a overlap, full-iteration "
               "graphs, fused grouped MLP, FP8 attention", ("small model", "8 GPUs")),
    Point("qwen3-30b-b300-2606", "MB-26.06 DGX-B300", _Q30, "b300", 8,
          Plan(ep=8, micro_batch=8, global_batch=512, precision="mxfp8", attn_precision="fp8", dispatcher="flex",
               ep_overlap=True, cuda_graphs="full", fused_mlp=True, optimizer="fp32", fp8_param=True,
               name="Qwen3-30B B300 26.06"),
          938, "recipe QWEN3_30B_A3B_PRETRAIN_CONFIG_B300_FP8_MX_V1: as GB300 (MBS 8), on one HGX B300 node",
          ("HGX B300", "small model")),
    Point("qwen3-30b-h100-2606", "MB-26.06 DGX-H100", _Q30, "h100", 16,
          Plan(ep=16, micro_batch=1, global_batch=1024, precision="fp8", dispatcher="flex", ep_overlap=False,
               cuda_graphs="none", optimizer="fp32", fp8_param=True, name="Qwen3-30B H100 26.06"),
          203, "recipe QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1: EP16 over two nodes, hybridep, no a2a overlap, "
               "no CUDA graphs", ("small model", "EP over InfiniBand")),
    Point("qwen3-235b-gb300-2606", "MB-26.06 DGX-GB300", _Q235, "gb300", 256,
          Plan(pp=4, vpp=12, ep=32, micro_batch=2, global_batch=8192, precision="mxfp8", attn_precision="fp8",
               dispatcher="flex", ep_overlap=True, cuda_graphs="full", fused_mlp=True, optimizer="fp32", fp8_param=True,
               pp_layout=even_layout(94, 4, 12), name="Qwen3-235B GB300 26.06"),
          1335, "recipe QWEN3_235B_A22B_PRETRAIN_CONFIG_GB300_FP8_MX_V2: PP4/VP12, hybridep, a2a overlap, "
                "full-iteration graphs, fused grouped MLP, FP8 attention", ("other model",)),
    Point("qwen3-235b-gb200-2606", "MB-26.06 DGX-GB200", _Q235, "gb200", 256,
          Plan(pp=8, vpp=3, ep=32, micro_batch=1, global_batch=8192, precision="mxfp8", attn_precision="fp8",
               dispatcher="flex", ep_overlap=True, cuda_graphs="full", fused_mlp=True, optimizer="fp32", fp8_param=True,
               pp_layout=even_layout(94, 8, 3), name="Qwen3-235B GB200 26.06"),
          1092, "recipe QWEN3_235B_A22B_PRETRAIN_CONFIG_GB200_FP8_MX_V2: PP8/VP3, hybridep, a2a overlap, "
                "full-iteration graphs, fused grouped MLP, FP8 attention", ("other model",)),
    # ---- 26.04.01 NeMo container (and the 26.04 rows whose recipe 26.04.01 changed): recipes at the release tags
    # v0.4.2 / v0.4.0 (the branch each container was built from). No fused grouped MLP, no FP8 attention yet. -----
    Point("dsv3-gb300-260401", "MB-26.04.01 DGX-GB300", _DS, "gb300", 256,
          _MB_DS.replace(pp=2, vpp=8, ep=32, micro_batch=2, recompute_modules=("mla_up_proj",), cuda_graphs="none",
                         name="DSv3 GB300 26.04.01"), 1298,
          "DEEPSEEK_V3_PRETRAIN_CONFIG_GB300_FP8_MX_V2 @v0.4.2: MBS 2, hybridep, no overlap, no graphs, mla_up_proj",
          ("no EP overlap", "no CUDA graphs", "MBS 2")),
    Point("dsv3-gb200-260401", "MB-26.04.01 DGX-GB200", _DS, "gb200", 256,
          _MB_DS.replace(pp=4, vpp=4, ep=64, recompute_modules=("mlp",), cuda_graphs="partial",
                         name="DSv3 GB200 26.04.01"), 1106,
          "DEEPSEEK_V3_PRETRAIN_CONFIG_GB200_FP8_MX_V2 @v0.4.2: hybridep, no overlap, TE graphs of attn / moe_router "
          "/ moe_preprocess, recompute mlp", ("no EP overlap", "partial CUDA graphs")),
    Point("dsv3-b300-260401", "MB-26.04.01 DGX-B300", _DS, "b300", 256,
          _MB_DS.replace(pp=8, ep=8, micro_batch=2, recompute_modules=("mla_up_proj",), cuda_graphs="partial",
                         pp_layout=_LAYOUT_PP8, name="DSv3 B300 26.04.01"), 898,
          "DEEPSEEK_V3_PRETRAIN_CONFIG_B300_V2 @v0.4.2: MBS 2, PP8, EP8, hybridep, no overlap, TE graphs of attn / "
          "moe_router / moe_preprocess, mla_up_proj", ("HGX B300", "PP8 x EP8")),
    Point("dsv3-b200-260401", "MB-26.04.01 DGX-B200", _DS, "b200", 256,
          _MB_DS.replace(pp=8, vpp=2, ep=32, recompute_modules=("mla_up_proj", "mlp"), ep_overlap=True,
                         cuda_graphs="partial", name="DSv3 B200 26.04.01"), 864,
          "DEEPSEEK_V3_PRETRAIN_CONFIG_B200_FP8_MX_V2 @v0.4.2: PP8/VP2, EP32 over four nodes, DeepEP, EP overlap, TE "
          "graphs of attn / moe_router / moe_preprocess, recompute mla_up_proj + mlp",
          ("HGX B200", "EP32 over InfiniBand", "DeepEP costed as flex")),
    Point("qwen3-30b-gb300-260401", "MB-26.04.01 DGX-GB300", _Q30, "gb300", 8,
          _MB_QW.replace(ep=8, micro_batch=8, global_batch=512, name="Qwen3-30B GB300 26.04.01"), 729,
          "QWEN3_30B_A3B_PRETRAIN_CONFIG_GB300_FP8_MX_V1 @v0.4.2: hybridep, no overlap, TE graphs of moe_router / "
          "moe_preprocess (attention eager: a plan's partial graphs take it as graphed)",
          ("small model", "attention not graphed")),
    Point("qwen3-30b-gb200-260401", "MB-26.04.01 DGX-GB200", _Q30, "gb200", 8,
          _MB_QW.replace(ep=8, micro_batch=4, global_batch=512, name="Qwen3-30B GB200 26.04.01"), 599,
          "QWEN3_30B_A3B_PRETRAIN_CONFIG_GB200_FP8_MX_V1 @v0.4.2: as GB300 at MBS 4",
          ("small model", "attention not graphed")),
    Point("qwen3-30b-b300-260401", "MB-26.04.01 DGX-B300", _Q30, "b300", 8,
          _MB_QW.replace(ep=8, micro_batch=8, global_batch=512, name="Qwen3-30B B300 26.04.01"), 704,
          "QWEN3_30B_A3B_PRETRAIN_CONFIG_B300_FP8_MX_V1 @v0.4.2: as GB300, one HGX B300 node",
          ("HGX B300", "small model", "attention not graphed")),
    Point("qwen3-30b-b200-260401", "MB-26.04.01 DGX-B200", _Q30, "b200", 8,
          _MB_QW.replace(ep=8, micro_batch=4, global_batch=512, name="Qwen3-30B B200 26.04.01"), 619,
          "QWEN3_30B_A3B_PRETRAIN_CONFIG_B200_FP8_MX_V1 @v0.4.2: hybridep, no overlap, TE graphs of attn / "
          "moe_router / moe_preprocess, one HGX B200 node", ("HGX B200", "small model")),
    Point("qwen3-30b-h100-260401", "MB-26.04.01 DGX-H100", _Q30, "h100", 16,
          _MB_QW.replace(ep=16, global_batch=1024, precision="fp8", cuda_graphs="none",
                         name="Qwen3-30B H100 26.04.01"), 206,
          "QWEN3_30B_A3B_PRETRAIN_CONFIG_H100_FP8_CS_V1 @v0.4.2: EP16 over two nodes, hybridep, no graphs",
          ("small model", "EP over InfiniBand")),
    Point("qwen3-235b-gb300-260401", "MB-26.04.01 DGX-GB300", _Q235, "gb300", 256,
          _MB_QW.replace(pp=4, vpp=12, ep=32, micro_batch=2, pp_layout=even_layout(94, 4, 12),
                         name="Qwen3-235B GB300 26.04.01"), 1029,
          "QWEN3_235B_A22B_PRETRAIN_CONFIG_GB300_FP8_MX_V2 @v0.4.2: PP4/VP12, hybridep, no overlap, TE graphs of "
          "attn / moe_router / moe_preprocess", ("partial CUDA graphs", "no EP overlap")),
    Point("qwen3-235b-gb200-260401", "MB-26.04.01 DGX-GB200", _Q235, "gb200", 256,
          _MB_QW.replace(pp=8, vpp=3, ep=32, pp_layout=even_layout(94, 8, 3), name="Qwen3-235B GB200 26.04.01"), 840,
          "QWEN3_235B_A22B_PRETRAIN_CONFIG_GB200_FP8_MX_V2 @v0.4.2: PP8/VP3, hybridep, no overlap, TE graphs of "
          "attn / moe_router / moe_preprocess", ("partial CUDA graphs", "no EP overlap")),
    Point("qwen3-235b-b300-260401", "MB-26.04.01 DGX-B300", _Q235, "b300", 256,
          _MB_QW.replace(pp=8, ep=8, micro_batch=2, cuda_graphs="none", pp_layout=even_layout(94, 8, 1),
                         name="Qwen3-235B B300 26.04.01"), 878,
          "QWEN3_235B_A22B_PRETRAIN_CONFIG_B300_FP8_MX_V2 @v0.4.2: PP8, EP8, hybridep, no overlap, no graphs",
          ("HGX B300", "no CUDA graphs")),
    Point("qwen3-235b-b200-260401", "MB-26.04.01 DGX-B200", _Q235, "b200", 256,
          _MB_QW.replace(pp=8, ep=8, dispatcher="alltoall", cuda_graphs="none", pp_layout=even_layout(94, 8, 1),
                         name="Qwen3-235B B200 26.04.01"),
          560, "QWEN3_235B_A22B_PRETRAIN_CONFIG_B200_FP8_MX_V2 @v0.4.2: PP8, EP8, alltoall, no overlap, no graphs",
          ("HGX B200", "alltoall dispatcher")),
    Point("qwen3-235b-h100-260401", "MB-26.04.01 DGX-H100", _Q235, "h100", 256,
          _MB_QW.replace(tp=2, pp=8, vpp=4, ep=32, precision="fp8", dispatcher="alltoall", ep_overlap=True,
                         cuda_graphs="none", pp_layout=even_layout(94, 8, 4), name="Qwen3-235B H100 26.04.01"), 253,
          "QWEN3_235B_A22B_PRETRAIN_CONFIG_H100_FP8_CS_V2 @v0.4.2: TP2/PP8/VP4/EP32, alltoall, EP overlap, no graphs",
          ("alltoall dispatcher", "combined 1F1B")),
    Point("dsv3-b300-2604", "MB-26.04 DGX-B300", _DS, "b300", 256,
          _MB_DS.replace(pp=16, ep=8, recompute_modules=("mla_up_proj",), cuda_graphs="none",
                         name="DSv3 B300 26.04"), 814,
          "DEEPSEEK_V3_PRETRAIN_CONFIG_B300_V2 @v0.4.0: PP16, EP8, hybridep, no overlap, no graphs, mla_up_proj",
          ("HGX B300", "PP16 x EP8")),
    Point("dsv3-b200-2604", "MB-26.04 DGX-B200", _DS, "b200", 256,
          _MB_DS.replace(pp=16, ep=8, recompute_modules=("mla_up_proj",), cuda_graphs="none",
                         name="DSv3 B200 26.04"), 732,
          "DEEPSEEK_V3_PRETRAIN_CONFIG_B200_V2 @v0.4.0: PP16, EP8, hybridep, no overlap, no graphs, mla_up_proj",
          ("HGX B200", "PP16 x EP8")),
    Point("qwen3-235b-b300-2604", "MB-26.04 DGX-B300", _Q235, "b300", 256,
          _MB_QW.replace(pp=8, ep=8, micro_batch=2, dispatcher="alltoall", cuda_graphs="none",
                         pp_layout=even_layout(94, 8, 1), name="Qwen3-235B B300 26.04"), 720,
          "QWEN3_235B_A22B_PRETRAIN_CONFIG_B300_FP8_MX_V2 @v0.4.0: alltoall (26.04.01 moved it to hybridep: 720 -> "
          "878 TFLOP/s)", ("HGX B300", "alltoall dispatcher")),
    # ---- other frameworks and other published guides -----------------------------------------------------------
    tokens_point("dsv3-b200-torchtitan-a2a", "TorchTitan PyTorch+Nebius blog", _DS, "b200", 256,
                 _TITAN_DSV3.replace(dispatcher="alltoall"), 651,
                 "PyTorch's NCCL all_to_all (the blog \"Enabling up to 41% faster pre-training: MXFP8 and DeepEP for "
                 "DeepSeek-V3 on B200 with TorchTitan\")",
                 ("TorchTitan", "FSDP + TP + PP", "full recompute", "8K sequences")),
    tokens_point("dsv3-b200-torchtitan-deepep", "TorchTitan PyTorch+Nebius blog", _DS, "b200", 256,
                 _TITAN_DSV3.replace(dispatcher="flex"), 859, "DeepEP (same run and blog)", ("TorchTitan", "DeepEP")),
    tokens_point("dsv3-h100-automodel", "AutoModel performance summary", _DS, "h100", 256, _AUTOMODEL_DSV3, 1002,
                 "250 TFLOP/s by AutoModel's formula; an eager PyTorch-native FSDP2 stack, costed as framework "
                 "torchtitan (no CUDA graphs, no EP overlap)", ("NeMo AutoModel", "FSDP", "full recompute")),
    Point("dsv3-gb200-mlm-guide", "MegatronLM GB200 guide", _DS, "gb200", 256,
          Plan(pp=8, vpp=4, ep=32, micro_batch=1, global_batch=2048, precision="mxfp8", recompute="selective",
               recompute_modules=("moe_act", "mlp"), dispatcher="flex", ep_overlap=False, cuda_graphs="partial",
               pp_layout="Et|(tt|)*30L", mtp_depth=0, fp8_param=True, optimizer="bf16-moments",
               name="DSv3 GB200 Megatron-LM guide"),
          970, "NVIDIA/Megatron-LM docs/discussions/deepseek-v3-gb200-optimization (launch command in its reproduce "
               "guide): HybridEP, TE graphs of attn / moe_router / moe_preprocess, recompute moe_act + mlp, "
               "fp8-param-gather, no MTP", ("Megatron-LM guide", "PP8/VPP4")),
    Point("mixtral-8x22b-h100-bf16", "ModelZoo Mixtral H100", _MIX, "h100", 128, _MIXTRAL, 465,
          "forced balance (445 dropless); BF16", ("Mixtral", "top-2 of 8 experts", "GQA")),
    Point("mixtral-8x22b-h100-fp8", "ModelZoo Mixtral H100", _MIX, "h100", 128,
          _MIXTRAL.replace(precision="fp8", name="Mixtral-8x22B H100 FP8"), 560,
          "forced balance; FP8 blockwise (DeepSeek 1x128 / 128x128)", ("Mixtral", "FP8 blockwise")),
    # ---- Megatron-LM's self-contained MoE recipes (examples/moe_recipes, dev branch 9c5258f109): every argument in
    # the YAML, the median TFLOP/s in its README; pairs that differ only in CUDA graphs or precision ------------------
    Point("mlm-dsv3-b200", "MLM-recipes B200", _DS, "b200", 256,
          _MLM.replace(pp=8, vpp=2, ep=32, global_batch=2048, recompute="selective",
                       recompute_modules=("mla_up_proj", "mlp"), ep_overlap=True, cuda_graphs="none",
                       pp_layout=_LAYOUT, name="DSv3 B200 MLM recipe"), 776.7,
          "deepseek_v3/b200/mxfp8_256GPU_TP1PP8EP32.yaml: DeepEP (24 SMs), EP overlap, no graphs, recompute "
          "mla_up_proj + mlp", ("HGX B200", "EP32 over four nodes", "DeepEP costed as flex")),
    Point("mlm-dsv3-gb200", "MLM-recipes GB200", _DS, "gb200", 256,
          _MLM.replace(pp=4, vpp=4, ep=64, recompute="selective", recompute_modules=("mla_up_proj",),
                       ep_overlap=True, cuda_graphs="partial", pp_layout=_LAYOUT, name="DSv3 GB200 MLM recipe"),
          1127.6, "deepseek_v3/gb200/mxfp8_256GPU_TP1PP4EP64.yaml: HybridEP, EP overlap, TE graphs of attn / "
                  "moe_router / moe_preprocess, recompute mla_up_proj; it also offloads expert_fc1 activations and "
                  "optimizer states to the host, which a plan does not express",
          ("activation and optimizer offload", "partial graphs")),
    Point("mlm-dsv3-gb300", "MLM-recipes GB300", _DS, "gb300", 256,
          _MLM.replace(pp=4, vpp=4, ep=64, ep_overlap=True, cuda_graphs="partial", pp_layout=_LAYOUT,
                       name="DSv3 GB300 MLM recipe"), 1357.7,
          "deepseek_v3/gb300/mxfp8_256GPU_TP1PP4EP64.yaml: HybridEP, EP overlap, TE graphs of attn / moe_router / "
          "moe_preprocess, no recompute", ("PP4 x EP64", "partial graphs")),
    Point("mlm-qwen3-235b-h100", "MLM-recipes H100", _Q235, "h100", 256,
          _MLM.replace(tp=2, pp=8, vpp=4, ep=32, global_batch=2048, precision="bf16", fp8_param=False,
                       recompute="selective", recompute_modules=("moe_act", "layernorm"), ep_overlap=True,
                       cuda_graphs="partial", pp_layout=even_layout(94, 8, 4), optimizer="fp32", dp_overlap=False,
                       name="Qwen3-235B H100 MLM recipe"), 214.3,
          "qwen3_235b/h100/bf16_256GPU_TP2PP8EP32.yaml: HybridEP over InfiniBand, EP overlap, TE graphs of "
          "moe_router / moe_preprocess only (a plan's partial graphs take attention as graphed too)",
          ("BF16", "attention not graphed")),
    Point("mlm-qwen3-235b-b200", "MLM-recipes B200", _Q235, "b200", 128,
          _MLM.replace(tp=2, pp=4, vpp=12, ep=16, micro_batch=3, global_batch=3072, ep_overlap=True,
                       cuda_graphs="none", pp_layout=even_layout(94, 4, 12), name="Qwen3-235B B200 MLM recipe"), 633.9,
          "qwen3_235b/b200/mxfp8_128GPU_TP2PP4EP16.yaml: DeepEP (20 SMs), EP overlap, no graphs, VPP12",
          ("HGX B200", "EP16 over two nodes", "DeepEP costed as flex")),
    Point("mlm-qwen3-235b-b300", "MLM-recipes B300", _Q235, "b300", 128,
          _MLM.replace(tp=2, ep=16, micro_batch=3, global_batch=9216, ep_overlap=True, cuda_graphs="partial",
                       name="Qwen3-235B B300 MLM recipe"), 922.6,
          "qwen3_235b/b300/mxfp8_128GPU_TP2PP1EP16_partial_cg.yaml: HybridEP, EP overlap, TE graphs of attn / "
          "moe_router", ("HGX B300", "EP16 over two nodes")),
    Point("mlm-qwen3-235b-gb200-fullcg", "MLM-recipes GB200", _Q235, "gb200", 128,
          _MLM.replace(ep=64, ep_overlap=True, cuda_graphs="full", fused_mlp=True,
                       name="Qwen3-235B GB200 MLM recipe, full graphs"), 1159.5,
          "qwen3_235b/gb200/mxfp8_128GPU_TP1PP1EP64_paged_stash_fullcg_overlap.yaml: paged stash, full-iteration "
          "graphs, TE op fuser with the CuTe DSL fused grouped MLP, HybridEP, EP overlap", ("PP1 x EP64",)),
    Point("mlm-qwen3-235b-gb200-partial", "MLM-recipes GB200", _Q235, "gb200", 128,
          _MLM.replace(ep=64, ep_overlap=True, cuda_graphs="partial",
                       name="Qwen3-235B GB200 MLM recipe, partial graphs"), 1018,
          "qwen3_235b/gb200/mxfp8_128GPU_TP1PP1EP64_partial_cg_overlap.yaml: the full-graph recipe's layout with TE "
          "graphs of attn / moe_router / moe_preprocess and the unfused grouped MLP", ("partial graphs",)),
    Point("mlm-qwen3-235b-gb300-fullcg", "MLM-recipes GB300", _Q235, "gb300", 128,
          _MLM.replace(ep=64, ep_overlap=True, cuda_graphs="full", fused_mlp=True,
                       name="Qwen3-235B GB300 MLM recipe, full graphs"), 1323.1,
          "qwen3_235b/gb300/mxfp8_128GPU_TP1PP1EP64_paged_stash_full_cg.yaml: as the GB200 full-graph recipe",
          ("PP1 x EP64",)),
    Point("mlm-qwen3-30b-h100-fp8", "MLM-recipes H100", _Q30, "h100", 32,
          _MLM.replace(ep=8, global_batch=256, precision="fp8", cuda_graphs="partial",
                       name="Qwen3-30B H100 FP8 MLM recipe"), 232.4,
          "qwen3_30b/h100/fp8_32GPU_TP1PP1EP8.yaml: FP8 blockwise, HybridEP, TE graphs of attn / moe_router / "
          "moe_preprocess, no EP overlap", ("small model", "FP8 blockwise")),
    Point("mlm-qwen3-30b-h100-bf16", "MLM-recipes H100", _Q30, "h100", 32,
          _MLM.replace(ep=8, global_batch=256, precision="bf16", fp8_param=False, cuda_graphs="none",
                       optimizer="fp32", name="Qwen3-30B H100 BF16 MLM recipe"), 234.1,
          "qwen3_30b/h100/bf16_32GPU_TP1PP1EP8.yaml: BF16, HybridEP, no graphs, no EP overlap",
          ("small model", "BF16")),
    Point("mlm-qwen3-30b-gb200-bf16", "MLM-recipes GB200", _Q30, "gb200", 16,
          _MLM.replace(ep=16, micro_batch=4, global_batch=512, precision="bf16", fp8_param=False,
                       cuda_graphs="none", optimizer="fp32", dp_overlap=False,
                       name="Qwen3-30B GB200 BF16 MLM recipe"), 528,
          "qwen3_30b/gb200/bf16_16GPU_TP1PP1EP16.yaml: BF16, HybridEP, no graphs, no EP overlap",
          ("small model", "BF16", "no graphs")),
    Point("mlm-qwen3-30b-gb200-partial", "MLM-recipes GB200", _Q30, "gb200", 16,
          _MLM.replace(ep=16, micro_batch=4, global_batch=512, fp8_param=False, cuda_graphs="partial",
                       optimizer="fp32", dp_overlap=False,
                       name="Qwen3-30B GB200 MXFP8 MLM recipe, partial graphs"), 514,
          "qwen3_30b/gb200/mxfp8_16GPU_TP1PP1EP16_partial_cg.yaml: MXFP8, TE graphs of attn / moe_router / "
          "moe_preprocess: published slower than the BF16 recipe without graphs", ("small model", "MXFP8")),
    Point("mlm-qwen3-30b-gb200-fullcg", "MLM-recipes GB200", _Q30, "gb200", 16,
          _MLM.replace(ep=16, micro_batch=4, global_batch=512, fp8_param=False, cuda_graphs="full", fused_mlp=True,
                       optimizer="fp32", dp_overlap=False, name="Qwen3-30B GB200 MXFP8 MLM recipe, full graphs"), 646.8,
          "qwen3_30b/gb200/mxfp8_16GPU_TP1PP1EP16_paged_stash.yaml: MXFP8, paged stash, full-iteration graphs, "
          "fused grouped MLP", ("small model", "full graphs")),
)


@dataclass
class Row:
    """A validation point with its prediction (``predicted`` None when the plan does not fit or is invalid)."""

    point: Point
    predicted: float | None
    error: float | None
    message: str = ""
    prediction: Any = None


def run(points: tuple[Point, ...] = POINTS) -> list[Row]:
    """Predict every point with the catalogue's GPU and constants (no per-point setting beyond its published
    plan)."""
    from moetrain.plan.hardware import CATALOGUE
    from moetrain.plan.model import predict
    from moetrain.plan.plan import PlanError

    rows = []
    for pt in points:
        try:
            # the catalogue's entry, never a user's (--gpu-file, register_gpu) that shares its name
            pr = predict(model_shape(pt.model), CATALOGUE[pt.gpu], pt.n_gpus, pt.plan)
        except PlanError as e:
            rows.append(Row(pt, None, None, f"invalid plan: {e}"))
            continue
        if not pr.fits:
            rows.append(Row(pt, None, None, pr.message, pr))
            continue
        rows.append(Row(pt, pr.tflops_per_gpu, pr.tflops_per_gpu / pt.tflops_per_gpu - 1, pr.message, pr))
    return rows


def _group_stats(rows: list[Row]) -> dict[str, Any]:
    """``points`` (all rows), ``predicted``, ``mae`` and ``mean_signed_error`` (None without a prediction) of one
    group of rows."""
    errs = [r.error for r in rows if r.error is not None]
    return {"points": len(rows), "predicted": len(errs),
            "mae": sum(abs(e) for e in errs) / len(errs) if errs else None,
            "mean_signed_error": sum(errs) / len(errs) if errs else None}


def by_release(rows: list[Row]) -> dict[str, dict[str, Any]]:
    """Points, MAE, mean signed and largest error per software release (:attr:`Point.release`), newest first."""
    out: dict[str, dict[str, Any]] = {}
    rels = {r.point.release for r in rows}
    for rel in sorted((x for x in rels if x[:1].isdigit()), reverse=True) + sorted(x for x in rels if not x[:1].isdigit()):
        rs = [r for r in rows if r.point.release == rel]
        errs = [abs(r.error) for r in rs if r.error is not None]
        out[rel] = {**_group_stats(rs), "max_abs_error": max(errs) if errs else None}
    return out


def by_group(rows: list[Row]) -> dict[str, dict[str, dict[str, Any]]]:
    """Points, MAE and mean signed error grouped four ways -- by CUDA-graph coverage, by host CPU (x86 on HGX /
    DGX boards, Grace on NVL72), by GPU and by model -- the groupings that show where the error is
    (docs/validation.md, "Where the error is"). Rows without a prediction are left out of the errors, counted in
    ``points``."""
    from moetrain.plan.hardware import CATALOGUE

    keys = {"cuda_graphs": lambda pt: pt.plan.resolved_cuda_graphs,
            "host": lambda pt: CATALOGUE[pt.gpu].host_cpu or "x86",  # the catalogue's part, as in run()
            "gpu": lambda pt: pt.gpu,
            "model": lambda pt: pt.model}
    out: dict[str, dict[str, dict[str, Any]]] = {}
    for name, key in keys.items():
        groups: dict[str, list[Row]] = {}
        for r in rows:
            groups.setdefault(key(r.point), []).append(r)
        out[name] = {g: _group_stats(rs) for g, rs in sorted(groups.items())}
    return out


def repeats(rows: list[Row]) -> list[dict[str, Any]]:
    """Groups of points that publish one plan more than once (same model, GPU, GPU count, plan and source table;
    only the release differs), with the spread of their published figures.

    A model that sees only the plan gives every point of a group one prediction ``p``, so the group bounds the
    error any such model can reach there: the smallest largest error is ``(hi - lo) / (hi + lo)`` (``p`` the
    harmonic middle ``2 hi lo / (hi + lo)``); the smallest mean error is reached at one of the published figures
    (the mean of ``|p / x - 1|`` is convex and piecewise linear in ``p``), for a pair ``(1 - lo / hi) / 2``. E.g.
    1,199 and 1,298 TFLOP/s: 4.0% and 3.8%.

    Returns: one dict per group of two or more points, largest ``spread`` (hi / lo - 1) first, with ``keys``,
    ``published`` (TFLOP/s per GPU, in the order of ``keys``), ``spread``, ``min_max_error``, ``min_mean_error``.
    """
    groups: dict[tuple[Any, ...], list[Row]] = {}
    for r in rows:
        pt = r.point
        plan = pt.plan.to_dict()
        plan.pop("name", None)
        where = pt.source.split(None, 1)[1:] if pt.source.startswith("MB-") else [pt.source]
        key = (pt.model, pt.gpu, pt.n_gpus, tuple(where), tuple(sorted((k, repr(v)) for k, v in plan.items())))
        groups.setdefault(key, []).append(r)
    out = []
    for rs in groups.values():
        if len(rs) < 2:
            continue
        pub = [r.point.tflops_per_gpu for r in rs]
        lo, hi = min(pub), max(pub)
        out.append({"keys": [r.point.key for r in rs], "published": pub, "spread": hi / lo - 1,
                    "min_max_error": (hi - lo) / (hi + lo),
                    "min_mean_error": min(sum(abs(p / x - 1) for x in pub) / len(pub) for p in pub)})
    return sorted(out, key=lambda g: -g["spread"])


#: Fewest points of one GPU and CUDA-graph coverage for :func:`track_record` to speak of that group alone; with
#: fewer it speaks of all of the GPU's points and says so.
TRACK_RECORD_MIN_POINTS = 3

_GRAPHS_WORDS = {"full": "whole-iteration CUDA graphs", "partial": "partial CUDA graphs", "none": "no CUDA graphs"}


@functools.lru_cache(maxsize=None)
def _rows_where(gpu: str | None, model: str | None) -> tuple[Row, ...]:
    """The validation rows on one catalogue GPU or of one model, predicted once per process."""
    return tuple(run(tuple(p for p in POINTS if p.gpu == gpu or p.model == model)))


def _errors(rows: list[Row] | tuple[Row, ...]) -> dict[str, Any]:
    errs = sorted(r.error for r in rows if r.error is not None)
    m = len(errs)
    return {"points": m, "keys": [r.point.key for r in rows if r.error is not None],
            "mean_signed_error": sum(errs) / m, "median_error": (errs[(m - 1) // 2] + errs[m // 2]) / 2,
            "min_error": errs[0], "max_error": errs[-1]}


def track_record(gpu: GPUSpec, cuda_graphs: str, model: str | None = None) -> dict[str, Any]:
    """How the model did on the validation points (published runs no constant was set from) most like a plan: on
    its GPU with its CUDA-graph coverage -- all of that GPU's points when fewer than
    :data:`TRACK_RECORD_MIN_POINTS` share the coverage, flagged ``fallback`` -- and of its model on any GPU. A
    reader of one prediction sees the error of its kind of run (docs/validation.md); nothing here changes the
    prediction, a search or a constant.

    Args:
        gpu: the plan's GPU; its catalogue name selects the points. A ``--gpu-file`` entry or a what-if flag that
            changes a catalogue GPU gets that GPU's record with ``modified`` True (the points ran on the catalogue
            part); a GPU outside the catalogue gets no GPU record.
        cuda_graphs: the plan's resolved coverage, "full", "partial" or "none".
        model: the plan's model name (``Prediction.model``); points of the same name give the model record.

    Returns: ``{"gpu": G or None, "model": M or None}``. G has ``group`` (words), ``gpu``, ``cuda_graphs``,
    ``fallback``, ``modified`` and the error fields; M has ``model`` and the error fields. Error fields:
    ``points``, ``keys``, ``mean_signed_error``, ``median_error``, ``min_error``, ``max_error`` (fractions,
    predicted / published - 1: positive is over-predicted).
    """
    from moetrain.plan.hardware import CATALOGUE

    known_gpu = gpu.name if gpu.name in CATALOGUE and any(p.gpu == gpu.name for p in POINTS) else None
    known_model = model if model and any(p.model == model for p in POINTS) else None
    out: dict[str, Any] = {"gpu": None, "model": None}
    if known_gpu is None and known_model is None:
        return out
    rows = _rows_where(known_gpu, known_model)
    if known_gpu:
        on_gpu = [r for r in rows if r.point.gpu == known_gpu]
        same = [r for r in on_gpu if r.point.plan.resolved_cuda_graphs == cuda_graphs]
        fallback = len(same) < TRACK_RECORD_MIN_POINTS
        words = _GRAPHS_WORDS.get(cuda_graphs, cuda_graphs)
        group = (f"all {len(on_gpu)} {known_gpu.upper()} runs ({len(same)} with {words}, too few alone)" if fallback
                 else f"{len(same)} {known_gpu.upper()} runs with {words}")
        if any(r.error is not None for r in (on_gpu if fallback else same)):
            out["gpu"] = {"group": group, "gpu": known_gpu, "cuda_graphs": cuda_graphs, "fallback": fallback,
                          "modified": gpu != CATALOGUE[known_gpu], **_errors(on_gpu if fallback else same)}
    if known_model:
        of_model = [r for r in rows if r.point.model == known_model]
        if any(r.error is not None for r in of_model):
            out["model"] = {"model": known_model, **_errors(of_model)}
    return out


def repeats_bound(rows: list[Row], groups: list[dict[str, Any]] | None = None) -> dict[str, Any] | None:
    """Over all points of :func:`repeats` (``groups``, computed from ``rows`` when not given): ``points``,
    ``best_mae`` (the MAE one prediction per plan could reach on them, each group's ``min_mean_error`` weighted by
    its points) and ``model_mae`` (the model's MAE on the same points); None when no plan is published twice."""
    groups = repeats(rows) if groups is None else groups
    if not groups:
        return None
    keys = {k for g in groups for k in g["keys"]}
    n = sum(len(g["keys"]) for g in groups)
    errs = [abs(r.error) for r in rows if r.point.key in keys and r.error is not None]
    return {"groups": len(groups), "points": n,
            "best_mae": sum(g["min_mean_error"] * len(g["keys"]) for g in groups) / n,
            "model_mae": sum(errs) / len(errs) if errs else None}


def summary(rows: list[Row]) -> dict[str, Any]:
    """Mean absolute error, largest error and the goal checks over the rows that have a prediction."""
    errs = [abs(r.error) for r in rows if r.error is not None]
    mae = sum(errs) / len(errs) if errs else None
    worst = max(errs) if errs else None
    clean = [abs(r.error) for r in rows if r.error is not None and not r.point.inconsistent]
    rep = repeats(rows)
    return {"points": len(rows), "predicted": len(errs), "mae": mae, "max_abs_error": worst,
            "mae_consistent_rows": sum(clean) / len(clean) if clean else None,
            "by_release": by_release(rows), "by_group": by_group(rows), "repeats": rep,
            "repeats_bound": repeats_bound(rows, rep),
            "mean_signed_error": (sum(r.error for r in rows if r.error is not None) / len(errs)) if errs else None,
            "mae_goal": MAE_GOAL, "max_goal": MAX_GOAL,
            "goal_met": bool(errs) and len(errs) == len(rows) and mae <= MAE_GOAL and worst <= MAX_GOAL}
