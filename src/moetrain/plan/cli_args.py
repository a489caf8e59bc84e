"""The options of ``moetrain plan``: which plan fields the command line sets (:data:`PLAN_FLAGS`), the defaults of the
search / scale options, and :func:`add_plan_args`. The command itself is :mod:`moetrain.plan.cli`.
"""

from __future__ import annotations

import argparse

from moetrain.plan.plan import (ATTN_PRECISIONS, CUDA_GRAPHS, DISPATCH_PRECISIONS, DISPATCHERS, FRAMEWORKS,
                                OPTIMIZERS, PRECISIONS, RECOMPUTE, RECOMPUTE_MODULES, ROUTING, SCHEDULE_ALIASES,
                                SCHEDULES)
from moetrain.plan.records import RECORDS


#: plan fields settable from the command line: (flag, Plan field, type)
PLAN_FLAGS = (("tp", "tp", int), ("pp", "pp", int), ("vpp", "vpp", int), ("ep", "ep", int), ("cp", "cp", int),
               ("dp", "dp", int), ("mbs", "micro_batch", int), ("gbs", "global_batch", int), ("seq", "seq_len", int),
               ("precision", "precision", str), ("attn_precision", "attn_precision", str),
               ("dispatch_precision", "dispatch_precision", str), ("recompute", "recompute", str),
               ("routing", "routing", str), ("imbalance", "imbalance", float), ("node_limit", "node_limit_m", int),
               ("schedule", "schedule", str), ("pp_layout", "pp_layout", str), ("optimizer", "optimizer", str),
               ("dispatcher", "dispatcher", str), ("framework", "framework", str),
               ("cuda_graphs", "cuda_graphs", str), ("mtp_depth", "mtp_depth", int))


#: defaults of the search / scale / time-to-train options: --records, --validate and --compare refuse any other value
#: (they would ignore it)
OPTION_DEFAULTS = {"top": 10, "tokens": 14.8e12, "scale_mode": "search", "scale_batch": "fixed"}


def add_plan_args(p: argparse.ArgumentParser) -> None:
    """The options of ``moetrain plan`` on parser ``p`` (model and cluster, the plan's fields, modes, output)."""
    g = p.add_argument_group("model and cluster")
    g.add_argument("--model", help="preset (deepseek-v3-671b, deepseek-v2-lite-16b, small, tiny) or a HF "
                   "config.json / directory (DeepSeek-V3/V2, or a GQA MoE such as Mixtral / Qwen-MoE); "
                   "default deepseek-v3-671b (--gpu local: the trainer's, tiny)")
    g.add_argument("--gpu", help="GPU type: h100, h800, h200, b200, b300, gb200, gb300, a --gpu-file entry, or "
                   "'local' (this machine, from `moetrain bench`; the plan then starts from `moetrain train`'s "
                   "own run: fp32, FSDP2, its model, batch, sequence and EP); default gb300")
    g.add_argument("--gpus", type=int, help="number of GPUs (default 256; --gpu local: the bench's processes)")
    g.add_argument("--gpu-file", action="append", default=[], help="TOML/JSON file of user GPU entries")
    g.add_argument("--bench-file", help="bench results for --gpu local (default .cache/moetrain/bench.json)")
    g.add_argument("--nic-gbit", type=float, help="what-if: override the NIC bandwidth per GPU (Gb/s)")
    g.add_argument("--nvlink-domain", type=int, help="what-if: override the NVLink domain size")
    g.add_argument("--record", choices=sorted(RECORDS), help="start from a published plan of docs/reference.md "
                   "section 4 (model, GPU, count and plan); other flags override it")
    g = p.add_argument_group("plan")
    g.add_argument("--tp", type=int)
    g.add_argument("--pp", type=int)
    g.add_argument("--vpp", type=int, help="virtual pipeline stages (model chunks) per pipeline rank")
    g.add_argument("--ep", type=int, help="expert-parallel size; without it (and without --record or --gpu local) the "
                   "best plan that fits the GPUs is chosen -- EP, PP, VPP, schedule and recompute searched, the other "
                   "flags given kept -- and the output says so")
    g.add_argument("--cp", type=int)
    g.add_argument("--dp", type=int, help="data parallel size (default: derived from --gpus)")
    g.add_argument("--mbs", type=int, help="micro-batch (sequences)")
    g.add_argument("--gbs", type=int, help="global batch (sequences)")
    g.add_argument("--seq", type=int, help="sequence length")
    g.add_argument("--precision", choices=PRECISIONS)
    g.add_argument("--attn-precision", choices=ATTN_PRECISIONS)
    g.add_argument("--dispatch-precision", choices=DISPATCH_PRECISIONS)
    g.add_argument("--recompute", choices=RECOMPUTE)
    g.add_argument("--recompute-modules", help=f"comma list of Megatron's names {list(RECOMPUTE_MODULES)} (with "
                   "--recompute selective)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--ep-overlap", dest="ep_overlap", action="store_true", default=None)
    x.add_argument("--no-ep-overlap", dest="ep_overlap", action="store_false")
    g.add_argument("--routing", choices=ROUTING)
    g.add_argument("--imbalance", type=float, help="max/mean tokens per EP rank under --routing real")
    g.add_argument("--imbalance-from", metavar="RUN_DIR", help="--imbalance measured by a `moetrain train --out "
                   "RUN_DIR` run: max/mean rows per EP rank from its metrics.jsonl's expert loads (implies "
                   "--routing real)")
    g.add_argument("--redundant-experts", type=int, help="with --imbalance-from: the copies per EP rank to place "
                   "on the measured loads (default: the run's own parallel.redundant_experts)")
    g.add_argument("--node-limit", type=int, help="node-limited routing: experts on at most M NVLink domains")
    g.add_argument("--schedule", choices=list(SCHEDULES) + list(SCHEDULE_ALIASES),
                   help="pipeline schedule (moetrain.layout.Schedule); the older name interleaved-1f1b is accepted")
    g.add_argument("--dispatcher", choices=DISPATCHERS, help="token dispatcher: alltoall (a row per token-expert "
                   "pair), flex (DeepEP/HybridEP: a row per destination rank / domain), allgather; default: the "
                   "framework's (the record's recipe with --record)")
    g.add_argument("--framework", choices=FRAMEWORKS, help="the recipe's framework: its dispatcher and CUDA-graph "
                   "defaults, and the plans --search may propose (default megatron; --record: the record's)")
    g.add_argument("--cuda-graphs", choices=CUDA_GRAPHS, help="CUDA graph coverage (host launch cost): full "
                   "(whole iteration), partial (attention, router), none (eager); default: the framework's")
    g.add_argument("--mtp-depth", type=int, help="MTP modules trained (0 = MTP off; default: the model's)")
    g.add_argument("--pp-layout", help="Megatron pipeline layout, e.g. 'Et*4|(t*4|)*14tmL'")
    g.add_argument("--optimizer", choices=OPTIMIZERS, help="optimizer state precision")
    g.add_argument("--fp8-param", dest="fp8_param", action="store_true", default=None,
                   help="FP8 primary weights (no BF16 weight copy)")
    g.add_argument("--no-dp-overlap", dest="dp_overlap", action="store_false", default=None)
    g.add_argument("--fsdp", dest="fsdp", action="store_true", default=None,
                   help="FSDP2 / ZeRO-3: parameters gathered for every micro-batch (as `moetrain train` does)")
    x = g.add_mutually_exclusive_group()
    x.add_argument("--fused-mlp", dest="fused_mlp", action="store_true", default=None,
                   help="the routed experts as one fused grouped-MLP kernel (GEMM + SwiGLU + quantisation; "
                   "Megatron-Bridge cutedsl_fused_grouped_mlp, as the 26.06 record recipes)")
    x.add_argument("--no-fused-mlp", dest="fused_mlp", action="store_false", default=None)
    g = p.add_argument_group("what to do")
    g.add_argument("--records", action="store_true", help="predict every published row of docs/reference.md section 4 "
                   "and compare (takes no plan flags: each row is predicted with its own plan)")
    g.add_argument("--validate", action="store_true", help="predict the validation set (published runs the model "
                   "was not calibrated on: moetrain.plan.validation) and print its mean absolute error")
    g.add_argument("--compare", nargs=2, metavar=("A", "B"), help="two runs side by side, mechanism by mechanism: "
                   "record keys (gb300, gb200, h100, h800) or validation point keys")
    g.add_argument("--any-framework", action="store_true", help="--search: also plans the framework does not run")
    g.add_argument("--search", action="store_true", help="rank valid plans by predicted TFLOP/s per GPU")
    g.add_argument("--top", type=int, default=OPTION_DEFAULTS["top"], help="plans shown by --search")
    g.add_argument("--scale", help="GPU counts, e.g. 64,128,256 or 64-8192 (powers of two)")
    g.add_argument("--scale-mode", choices=("search", "keep"), default=OPTION_DEFAULTS["scale_mode"],
                   help="best plan at each count (search) or the given plan with more DP (keep)")
    g.add_argument("--scale-batch", choices=("fixed", "per-gpu"), default=OPTION_DEFAULTS["scale_batch"],
                   help="global batch fixed, or sequences per GPU fixed")
    g.add_argument("--tokens", type=float, default=OPTION_DEFAULTS["tokens"],
                   help="token budget for time-to-train (default 14.8T)")
    g = p.add_argument_group("output")
    g.add_argument("--json", action="store_true", help="print JSON instead of tables")
    g.add_argument("--json-out", help="also write the JSON to this file")
    g.add_argument("--png", help="write a chart (step breakdown; scaling curves with --scale)")
