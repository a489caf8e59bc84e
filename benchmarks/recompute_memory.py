"""Activation memory per selective-recompute module, measured on the CPU beside the planner's activation bytes.

For each setting (no recompute, each module alone, the default set, all but ``moe``, full) a fresh process builds one
model, runs one forward of a batch with gradients recorded and reads how much its resident memory grew: what the
graph keeps for the backward (the model and its input exist before the first reading; the loss is a scalar).
Allocations of 16 KiB and more are mmap'd (``MALLOC_MMAP_THRESHOLD_``), so a freed tensor leaves the resident set
at once and the growth is the bytes still held. Beside it, the planner's activation memory for the same model, batch
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
from pathlib import Path

SETTINGS = [("none", None), *[(m, m) for m in ("core_attn", "mla_up_proj", "layernorm", "mlp", "shared_experts",
                                                "moe_act", "moe")],
            ("default", ""), ("all but moe", "core_attn,mla_up_proj,layernorm,mlp,shared_experts,moe_act"),
            ("full", "full")]


def rss() -> int:
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmRSS:"):
            return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS")


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
        model(x, y)  # warm-up: one-time allocations (RoPE cache, kernels' workspaces) before the first reading
    before = rss()
    loss = model(x, y).loss(cfg)
    held = rss() - before
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
    pred = predict(cfg, "local", 1, trainer_plan(cfg, lay, batch, 1, seq), _ignore_memory=True)
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
    env = {**os.environ, "MALLOC_MMAP_THRESHOLD_": "16384"}
    print(f"{a.preset}, {a.batch} x {a.seq} tokens, fp32, one forward kept for the backward\n")
    print("| recompute | measured MiB | planner MiB | measured / planner | measured vs none |")
    print("|---|---:|---:|---:|---:|")
    base = None
    for label, setting in SETTINGS:
        out = subprocess.run([sys.executable, __file__, "--preset", a.preset, "--batch", str(a.batch), "--seq",
                              str(a.seq), "--child", "<none>" if setting is None else setting],
                             env=env, capture_output=True, text=True, check=True).stdout
        held = json.loads(out.strip().splitlines()[-1])["held"]
        base = held if base is None else base
        plan = planner_bytes(a.preset, a.batch, a.seq, setting)
        print(f"| {label} | {held / 2**20:.1f} | {plan / 2**20:.1f} | {held / plan:.2f} | {held / base:.2f} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
