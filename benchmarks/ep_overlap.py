"""EP overlap across micro-batches on this machine: the exposed share of the all-to-all and the step time with
``parallel.ep_overlap`` on against off, and ``moetrain plan --gpu local``'s predicted exposed share beside them.

    .venv/bin/python benchmarks/ep_overlap.py [--presets tiny small] [--routing learned balanced] [--rounds 2]
    .venv/bin/python benchmarks/ep_overlap.py --pp 2 --schedule dualpipev --accum 8 --presets tiny   # 4 processes

Each variant is ``moetrain train --nproc 2 --ep 2`` with ``--accum`` micro-batches per step (the paired schedule
runs micro-batch i+1's forward with micro-batch i's backward; the first forward and the last backward of a step are
alone). Variants run round-robin ``--rounds`` times; each run's figures are the medians of its logged windows after
the first; the best run (highest tokens/s) of each variant is kept, since the two cores are shared. Printed per
preset and routing: exposed share on and off, the on/off step-time ratio, the exposed time by phase, and the
planner's predicted exposed share for the same two runs (needs a ``moetrain bench`` file, ``--bench-file``).
With ``--pp`` the runs are pipelined (``--nproc 2 PP``, EP 2 inside each stage) on ``--schedule``, whose own
forward-backward pairs carry the overlap. Results go to benchmarks/results/ep_overlap-<host>-<date>[-pp<P>-<schedule>]
.{json,md}.
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

#: Sizes per preset: (micro-batch sequences, steps); small is ~10x tiny's cost per token on the CPU.
SIZES = {"tiny": (16, 24), "small": (4, 8)}


def run_train(preset: str, routing: str, overlap: bool, mbs: int, steps: int, accum: int, seq: int,
              out: Path, pp: int = 1, schedule: str = "1f1b", vpp: int = 1) -> dict:
    piped = ["--pp", str(pp), "--set", f"parallel.pp_schedule={json.dumps(schedule)}",
             "--set", f"parallel.vpp={vpp}"] if pp > 1 else []
    cmd = [sys.executable, "-m", "moetrain", "train", "--preset", preset, "--steps", str(steps), "--out", str(out),
           "--nproc", str(2 * pp), "--ep", "2", "--device", "cpu", *piped,
           "--set", f"train.log_every={max(2, steps // 4)}", "--set", "train.eval_every=0",
           "--set", "train.ckpt_every=0", "--set", "train.tensorboard=false",
           "--set", f"train.micro_batch_size={mbs}", "--set", f"train.grad_accum={accum}",
           "--set", f"data.seq_len={seq}", "--set", f"model.routing={json.dumps(routing)}",
           "--set", f"parallel.ep_overlap={'true' if overlap else 'false'}"]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        raise RuntimeError(f"{shlex.join(cmd)} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    rows = [json.loads(x) for x in (out / "metrics.jsonl").read_text().splitlines() if x.strip()]
    train = [r for r in rows if r.get("kind") == "train"][1:]
    phases: dict[str, list[float]] = {}
    for r in train:
        for layer in r["a2a_s_per_layer_phase"]:
            for k, (tot, exp) in layer.items():
                acc = phases.setdefault(k, [0.0, 0.0])
                acc[0] += tot / len(train)
                acc[1] += exp / len(train)
    return {"tokens_per_s_per_proc": statistics.median(r["tokens_per_s_per_gpu"] for r in train),
            "step_s": statistics.median(r["step_time_s"] for r in train),
            "a2a_s": statistics.median(r["a2a_s_per_step"] for r in train),
            "exposed_s": statistics.median(r["a2a_exposed_s_per_step"] for r in train),
            "exposed_share": statistics.median(r["a2a_exposed_share"] for r in train),
            "phases": phases, "command": shlex.join(cmd[1:])}


def predict(preset: str, routing: str, overlap: bool, mbs: int, accum: int, seq: int, bench: str, pp: int = 1,
            schedule: str = "1f1b", vpp: int = 1) -> dict:
    """The planner's exposed share and step time for the same run (``moetrain plan --gpu local``)."""
    from moetrain.model.config import get_preset
    from moetrain.plan.hardware import gpu_from_bench
    from moetrain.plan.local import local_plan, predict_measured

    try:
        gpu = gpu_from_bench(bench)
    except Exception as e:  # noqa: BLE001 - reported, not fatal
        return {"error": str(e)}
    cfg = get_preset(preset).replace(routing=routing)
    plan = local_plan(cfg, seq, mbs, accum, world=2 * pp, ep=2, ep_overlap=overlap, pp=pp, vpp=vpp,
                      schedule=schedule)
    try:
        pred = predict_measured(cfg, gpu, 2 * pp, plan)
    except Exception as e:  # noqa: BLE001 - e.g. a bench file measured for another process count; reported
        return {"error": str(e)}
    d = pred.details
    # the all-to-all of every item ("E" embedding, "d" dense layer, "t" MoE layer, "m" MTP, "L" head) of the stages
    # of the pipeline rank with the most of it (the prediction's exposed time is the slowest rank's)
    from moetrain.plan.model.pipeline import device_stages
    per_rank = [sum(d["item_cost_s"][k]["a2a"] for s in sts for k in d["stages"][s])
                for sts in device_stages(pred.plan, len(d["stages"]))]
    total = d["microbatches"] * max(per_rank)
    return {"exposed_share": pred.step.exposed_a2a / total if total else 0.0, "step_s": pred.step.step,
            "schedule": d["overlap_schedule"]}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--presets", nargs="+", default=["tiny", "small"])
    ap.add_argument("--routing", nargs="+", default=["learned", "balanced"])
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--accum", type=int, default=2)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--steps", type=int, default=0, help="override the per-preset step count")
    ap.add_argument("--pp", type=int, default=1, help="pipeline ranks (2 x PP processes)")
    ap.add_argument("--schedule", default="1f1b", help="parallel.pp_schedule under --pp")
    ap.add_argument("--vpp", type=int, default=1, help="parallel.vpp under --pp (interleaved-1f1b)")
    ap.add_argument("--bench-file", default=str(ROOT / ".cache" / "moetrain" / "bench.json"))
    ap.add_argument("--from-json", help="re-render a results .json of this script (no runs; predictions again)")
    args = ap.parse_args()
    variants = [(p, r, o) for p in args.presets for r in args.routing for o in (True, False)]
    best: dict[tuple, dict] = {}
    if args.from_json:
        old = json.loads(Path(args.from_json).read_text())
        for r in old["rows"]:
            best[(r["preset"], r["routing"], True)], best[(r["preset"], r["routing"], False)] = r["on"], r["off"]
        args.presets = list(dict.fromkeys(r["preset"] for r in old["rows"]))
        args.routing = list(dict.fromkeys(r["routing"] for r in old["rows"]))
        variants = []
    with tempfile.TemporaryDirectory() as d:
        for rnd in range(args.rounds):
            for i, (preset, routing, o) in enumerate(variants):
                mbs, steps = SIZES.get(preset, (4, 8))
                res = run_train(preset, routing, o, mbs, args.steps or steps, args.accum, args.seq,
                                Path(d) / f"r{rnd}-{i}", args.pp, args.schedule, args.vpp)
                key = (preset, routing, o)
                if key not in best or res["tokens_per_s_per_proc"] > best[key]["tokens_per_s_per_proc"]:
                    best[key] = res
                print(f"round {rnd} {preset} {routing} overlap={o}: {res['tokens_per_s_per_proc']:.0f} tok/s/proc, "
                      f"exposed {res['exposed_share']:.0%}", flush=True)
    rows = []
    for preset in args.presets:
        for routing in args.routing:
            on, off = best[(preset, routing, True)], best[(preset, routing, False)]
            mbs, _ = SIZES.get(preset, (4, 8))
            piped = (args.pp, args.schedule, args.vpp)
            p_on = predict(preset, routing, True, mbs, args.accum, args.seq, args.bench_file, *piped) \
                if Path(args.bench_file).is_file() else {"error": "no bench file"}
            p_off = predict(preset, routing, False, mbs, args.accum, args.seq, args.bench_file, *piped) \
                if Path(args.bench_file).is_file() else {"error": "no bench file"}
            rows.append({"preset": preset, "routing": routing, "on": on, "off": off,
                         "step_on_over_off": on["step_s"] / off["step_s"],
                         "tokens_on_over_off": on["tokens_per_s_per_proc"] / off["tokens_per_s_per_proc"],
                         "predicted_on": p_on, "predicted_off": p_off})
    lines = ["| preset | routing | exposed share on | off | step s on | off | step on/off | tok/s on/off | "
             "predicted exposed on | off | predicted step s on | off |",
             "|---|---|---|---|---|---|---|---|---|---|---|---|"]
    for r in rows:
        pon, poff = r["predicted_on"], r["predicted_off"]
        fmt = (lambda p, k, f: format(p[k], f) if k in p else "n/a")
        lines.append(f"| {r['preset']} | {r['routing']} | {r['on']['exposed_share']:.0%} | "
                     f"{r['off']['exposed_share']:.0%} | {r['on']['step_s']:.2f} | {r['off']['step_s']:.2f} | "
                     f"{r['step_on_over_off']:.2f} | {r['tokens_on_over_off']:.2f} | "
                     f"{fmt(pon, 'exposed_share', '.0%')} | {fmt(poff, 'exposed_share', '.0%')} | "
                     f"{fmt(pon, 'step_s', '.2f')} | {fmt(poff, 'step_s', '.2f')} |")
    lines += ["", "Exposed ms per step by phase (overlap on / off):", ""]
    for r in rows:
        ph = sorted(set(r["on"]["phases"]) | set(r["off"]["phases"]))
        lines.append(f"- {r['preset']} {r['routing']}: " + ", ".join(
            f"{k} {1e3 * r['on']['phases'].get(k, [0, 0])[1]:.1f} / {1e3 * r['off']['phases'].get(k, [0, 0])[1]:.1f}"
            for k in ph))
    table = "\n".join(lines)
    print(table)
    stamp = time.strftime("%Y%m%d")
    tag = f"-pp{args.pp}-{args.schedule}" if args.pp > 1 else ""
    out = ROOT / "benchmarks" / "results" / f"ep_overlap-{platform.node()}-{stamp}{tag}"
    out.parent.mkdir(parents=True, exist_ok=True)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "rows": rows}, indent=1))
    out.with_suffix(".md").write_text(table + "\n")
    print(f"results: {out}.md / .json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
