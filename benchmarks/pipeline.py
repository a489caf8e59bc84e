"""Pipeline parallelism on this machine: tokens/s at PP = 2 against PP = 1 with the same global batch, the measured
bubble against the schedule's formula, and ``moetrain plan --gpu local``'s prediction of the PP = 2 run.

    .venv/bin/python benchmarks/pipeline.py [--presets tiny small] [--steps 12] [--rounds 2]

For each preset, on 2 processes and the same global batch (2 x grad_accum micro-batches of ``--mbs`` sequences):
  PP=1  DP=2, grad_accum micro-batches per rank             (``moetrain train --nproc 2 --ep 1``)
  PP=2  1f1b, DP=1, 2 x grad_accum micro-batches per step    (``moetrain train --nproc 2 --pp 2``)
The variants run round-robin ``--rounds`` times; each run's tokens/s is the median of its logged windows after the
first, and the best run of each variant is kept (the cores are shared: best of several samples). The bubble is
rank 0's measured share of the step (``pp_bubble_share``) beside (p - 1) / (m + p - 1). The prediction needs a
``moetrain bench`` file (``--bench-file``, default .cache/moetrain/bench.json; ``--rebench`` measures one).
Results go to benchmarks/results/pipeline-<host>-<date>.{json,md}.
"""

from __future__ import annotations

import argparse
import json
import platform
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))


def run_train(preset: str, pp: int, steps: int, mbs: int, accum: int, seq: int, out: Path) -> dict:
    cmd = [sys.executable, "-m", "moetrain", "train", "--preset", preset, "--steps", str(steps), "--out", str(out),
           "--nproc", "2", "--ep", "1", "--pp", str(pp), "--device", "cpu",
           "--set", "train.log_every=3", "--set", "train.eval_every=0", "--set", "train.ckpt_every=0",
           "--set", "train.tensorboard=false", "--set", f"train.micro_batch_size={mbs}",
           "--set", f"train.grad_accum={accum}", "--set", f"data.seq_len={seq}"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{shlex.join(cmd)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in rows if r.get("kind") == "train"][1:]
    return {"tokens_per_s_per_proc": statistics.median(r["tokens_per_s_per_gpu"] for r in train),
            "step_s": statistics.median(r["step_time_s"] for r in train),
            "bubble_share": statistics.median(r.get("pp_bubble_share", 0.0) for r in train),
            "bubble_formula": train[-1].get("pp_bubble_formula", 0.0)}


def predict(preset: str, pp: int, mbs: int, accum: int, seq: int, bench: str) -> dict | None:
    from moetrain.model.config import get_preset
    from moetrain.plan.local import local_plan, predict_measured
    from moetrain.plan.hardware import gpu_from_bench

    cfg = get_preset(preset)
    try:
        gpu = gpu_from_bench(bench)
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        return {"error": str(e)}
    plan = local_plan(cfg, seq, mbs, accum, world=2, ep=1, pp=pp)
    pred = predict_measured(cfg, gpu, 2, plan)
    return {"tokens_per_s_per_proc": pred.tokens_per_s_per_gpu, "step_s": pred.step.step,
            "bubble_s": getattr(pred.step, "bubble", None)}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--steps", type=int, default=12)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--mbs", type=int, default=4)
    ap.add_argument("--accum", type=int, default=4, help="micro-batches per rank at PP=1 (2x that at PP=2)")
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--bench-file", default=str(ROOT / ".cache" / "moetrain" / "bench.json"))
    ap.add_argument("--rebench", action="store_true")
    args = ap.parse_args()
    if args.rebench or not Path(args.bench_file).is_file():
        subprocess.run([sys.executable, "-m", "moetrain", "bench", "--out", args.bench_file], cwd=ROOT, check=True)
    results = []
    with tempfile.TemporaryDirectory() as d:
        for preset in args.presets:
            best: dict[int, dict] = {}
            for r in range(args.rounds):
                for pp in (1, 2):
                    accum = args.accum * pp  # the same global batch: PP=2 has DP=1
                    m = run_train(preset, pp, args.steps, args.mbs, accum, args.seq, Path(d) / f"{preset}-{pp}-{r}")
                    if pp not in best or m["tokens_per_s_per_proc"] > best[pp]["tokens_per_s_per_proc"]:
                        best[pp] = m
            pred = predict(preset, 2, args.mbs, 2 * args.accum, args.seq, args.bench_file)
            results.append({"preset": preset, "pp1": best[1], "pp2": best[2], "predicted_pp2": pred})
    lines = ["| preset | tok/s/proc PP=1 | PP=2 | PP2/PP1 | bubble measured | formula | predicted PP=2 | "
             "predicted/measured |", "|---|---|---|---|---|---|---|---|"]
    for r in results:
        a, b, p = r["pp1"], r["pp2"], r["predicted_pp2"] or {}
        pv = p.get("tokens_per_s_per_proc")
        lines.append(f"| {r['preset']} | {a['tokens_per_s_per_proc']:,.0f} | {b['tokens_per_s_per_proc']:,.0f} | "
                     f"{b['tokens_per_s_per_proc'] / a['tokens_per_s_per_proc']:.2f} | {b['bubble_share']:.0%} | "
                     f"{b['bubble_formula']:.0%} | " + (f"{pv:,.0f} | {pv / b['tokens_per_s_per_proc']:.2f} |"
                                                       if pv else f"{p.get('error', 'n/a')} | |"))
    table = "\n".join(lines)
    print(table)
    stamp = time.strftime("%Y%m%d-%H%M%S")
    host = platform.node() or "host"
    out = ROOT / "benchmarks" / "results" / f"pipeline-{host}-{stamp}"
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "results": results}, indent=1))
    out.with_suffix(".md").write_text(f"# Pipeline benchmark {stamp}\n\n`{shlex.join(sys.argv)}`\n\n{table}\n")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
