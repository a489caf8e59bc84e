"""Activation memory per selective-recompute module, measured on the CPU beside the planner's activation bytes.

For each setting (no recompute, each module alone, the default set, all but ``moe``, full) a fresh process builds one
model and runs one forward of a batch with gradients recorded under torch's profiler with memory recording: the sum
of the forward's CPU allocations and frees is what stays allocated, the tensors the graph keeps for the backward
(the model and its input exist before; the loss is a scalar). Beside it, the planner's activation memory for the same model, batch
and recompute (``moetrain.plan.model.predict`` of the trainer's plan: one micro-batch in flight, fp32 activations)
and the ratio. Run alone; takes about a minute.

    python benchmarks/recompute_memory.py [--preset tiny] [--batch 8] [--seq 256]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys

SETTINGS = [("none", None), *[(m, m) for m in ("core_attn", "mla_up_proj", "layernorm", "mlp", "shared_experts",
                                                "moe_act", "moe")],
            ("default", ""), ("all but moe", "core_attn,mla_up_proj,layernorm,mlp,shared_experts,moe_act"),
            ("full", "full")]


def child(preset: str, batch: int, seq: int, setting: str | None) -> None:
    import torch

    from moetrain.layout import DEFAULT_RECOMPUTE_MODULES, RecomputeModule
    from moetrain.model.config import get_preset
    from moetrain.model.recompute import set_recompute
    from moetrain.model.transformer import build_model

    torch.set_num_threads(1)
    cfg = get_preset(preset).replace(max_seq_len=max(seq, get_preset(preset).max_seq_len))
    model = build_model(cfg, seed=0)
    mods: frozenset = frozenset()
    if setting == "full":
        for b in model.blocks():
            b.recompute = True
    elif setting is not None:
        names = setting.split(",") if setting else [m.value for m in DEFAULT_RECOMPUTE_MODULES]
        mods = frozenset(RecomputeModule(m) for m in names)
    for b in model.blocks():
        set_recompute(b, mods)
    tokens = torch.randint(0, cfg.vocab_size, (batch, seq + 1), generator=torch.Generator().manual_seed(0))
    x, y = tokens[:, :-1].contiguous(), tokens[:, 1:].contiguous()
    with torch.no_grad():
        model(x, y)  # warm-up: one-time allocations (RoPE cache) before the reading
    # every CPU allocation and free of the forward, as torch's profiler records them: their sum is what is still
    # allocated when the forward returns -- the tensors the graph keeps for the backward, and the scalar loss
    with torch.profiler.profile(activities=[torch.profiler.ProfilerActivity.CPU], profile_memory=True) as prof:
        loss = model(x, y).loss(cfg)
    held = sum(e.self_cpu_memory_usage for e in prof.events())
    loss.backward()
    print(json.dumps({"held": held}))


def planner_bytes(preset: str, batch: int, seq: int, setting: str | None) -> float:
    from moetrain.layout import Layout, Precision, Recompute
    from moetrain.model.config import get_preset
    from moetrain.plan.local import trainer_plan
    from moetrain.plan.model import predict

    cfg = get_preset(preset)
    if setting == "full":
        lay = Layout(recompute=Recompute.FULL)
    elif setting is None:
        lay = Layout()
    else:
        lay = Layout(recompute=Recompute.SELECTIVE, recompute_modules=tuple(setting.split(",")) if setting else None)
    lay = lay.replace(precision=Precision.FP32, optimizer="fp32", dp=1)
    # activation bytes depend on the plan and its precision, not on the GPU: any catalogue entry gives them
    # one process (EP 1) holds every expert: max/mean rows per EP rank is 1 by definition
    plan = trainer_plan(cfg, lay, batch, 1, seq).replace(imbalance=1.0)
    pred = predict(cfg, "h100", 1, plan, _ignore_memory=True)
    return pred.memory.activations * 2 ** 30


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--seq", type=int, default=256)
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    a = ap.parse_args()
    if a.child is not None:
        child(a.preset, a.batch, a.seq, None if a.child == "<none>" else a.child)
        return 0
    env = {**os.environ}
    print(f"{a.preset}, {a.batch} x {a.seq} tokens, fp32, one forward kept for the backward\n")
    print("| recompute | measured MiB | planner MiB | measured / planner | saved vs none, measured MiB | "
          "saved vs none, planner MiB |")
    print("|---|---:|---:|---:|---:|---:|")
    base = plan_base = None
    for label, setting in SETTINGS:
        out = subprocess.run([sys.executable, __file__, "--preset", a.preset, "--batch", str(a.batch), "--seq",
                              str(a.seq), "--child", "<none>" if setting is None else setting],
                             env=env, capture_output=True, text=True, check=True).stdout
        held = json.loads(out.strip().splitlines()[-1])["held"]
        base = held if base is None else base
        plan = planner_bytes(a.preset, a.batch, a.seq, setting)
        plan_base = plan if plan_base is None else plan_base
        print(f"| {label} | {held / 2**20:.1f} | {plan / 2**20:.1f} | {held / plan:.2f} | "
              f"{(base - held) / 2**20:.1f} | {(plan_base - plan) / 2**20:.1f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
