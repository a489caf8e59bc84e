"""FP8 training against BF16 autocast: the loss gap of ``train.fp8 = blockwise / mxfp8`` over a full run.

``python benchmarks/fp8_loss_gap.py [--preset tiny] [--steps 300] [--eval-every 50] [--recipes blockwise mxfp8]``

Runs ``moetrain train`` (the main job, its default data and settings) once with ``train.dtype=bf16`` and no FP8,
then once per recipe, with the same seed, data order and schedule, and compares them:

* the validation loss at every evaluation, and its relative gap at the last one (issue goal: within 0.25%);
* the training loss at every logged step after warm-up (the same batch in every run; goal: within 1%).

Per-step seconds of each run are printed too (the median of the logged steps), so an emulated FP8 step's cost
against BF16 is measured on the same machine in the same session. Results go to
``benchmarks/results/fp8_loss_gap-<host>-<date>-<preset>.{json,md}``. Runs execute one after another: on a shared
CPU, run nothing else meanwhile.
"""

from __future__ import annotations

import argparse
import json
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def _records(run_dir: Path) -> list[dict]:
    return [json.loads(line) for line in (run_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]


def _run(moetrain: str, preset: str, steps: int, eval_every: int, fp8: str, out: Path, extra: list[str]) -> float:
    cmd = [moetrain, "train", "--preset", preset, "--steps", str(steps), "--out", str(out),
           "--set", f"train.eval_every={eval_every}", "--set", "train.ckpt_every=0", "--set", "train.dtype=bf16",
           "--set", f"train.fp8={fp8}", *extra]
    if out.exists():
        shutil.rmtree(out)  # an unfinished run: start it again
    t0 = time.perf_counter()
    log = out.with_suffix(".log")
    with open(log, "w") as f:
        rc = subprocess.run(cmd, stdout=f, stderr=subprocess.STDOUT).returncode
    if rc != 0:
        sys.exit(f"fp8={fp8} failed (rc {rc}); see {log}: {log.read_text()[-400:]}")
    return time.perf_counter() - t0


def compare(runs: dict[str, list[dict]], warmup: int) -> dict:
    """Gaps of each FP8 run to the "none" run: {recipe: {final_val_gap, val_gaps, max_train_gap, ...}}."""
    def val(rs):
        return {r["step"]: r["val_loss"] for r in rs if r.get("kind") == "val"}

    def train(rs):
        return {r["step"]: r["lm_loss"] for r in rs if r.get("kind") == "train"}

    def step_s(rs):
        t = sorted(r["step_time_s"] for r in rs if r.get("kind") == "train")
        return t[len(t) // 2] if t else float("nan")

    ref_v, ref_t = val(runs["none"]), train(runs["none"])
    last = max(ref_v)
    out = {"none": {"final_val": ref_v[last], "val": ref_v, "step_s": step_s(runs["none"])}}
    for k, rs in runs.items():
        if k == "none":
            continue
        v, t = val(rs), train(rs)
        tg = {s: t[s] / ref_t[s] - 1 for s in t if s in ref_t and s > warmup}
        worst = max(tg, key=lambda s: abs(tg[s]))
        out[k] = {"final_val": v[last], "final_val_gap": v[last] / ref_v[last] - 1, "val": v,
                  "val_gaps": {s: v[s] / ref_v[s] - 1 for s in v if s in ref_v},
                  "max_train_gap": tg[worst], "max_train_gap_step": worst, "train_gaps": tg,
                  "step_s": step_s(rs)}
    return out


def render(res: dict, args: argparse.Namespace) -> str:
    lines = [f"# FP8 vs BF16 autocast: {args.preset}, {args.steps} steps", "",
             f"`python benchmarks/fp8_loss_gap.py --preset {args.preset} --steps {args.steps} "
             f"--eval-every {args.eval_every}` on {platform.node()}, {time.strftime('%Y-%m-%d %H:%M')}", "",
             "| run | final val loss | gap | largest train-loss gap after warm-up (step) | s / step (median) |",
             "|---|---|---|---|---|",
             f"| bf16 | {res['none']['final_val']:.4f} | - | - | {res['none']['step_s']:.2f} |"]
    for k, r in res.items():
        if k != "none":
            lines.append(f"| {k} | {r['final_val']:.4f} | {r['final_val_gap']:+.2%} | "
                         f"{r['max_train_gap']:+.2%} ({r['max_train_gap_step']}) | {r['step_s']:.2f} |")
    lines += ["", "Validation loss at every evaluation:", "",
              "| step | " + " | ".join(res) + " |", "|---" * (len(res) + 1) + "|"]
    for s in sorted(res["none"]["val"]):
        lines.append(f"| {s} | " + " | ".join(f"{r['val'].get(s, float('nan')):.4f}" for r in res.values()) + " |")
    return "\n".join(lines) + "\n"


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=300)
    ap.add_argument("--eval-every", type=int, default=50)
    ap.add_argument("--recipes", nargs="+", default=["blockwise", "mxfp8"])
    ap.add_argument("--warmup", type=int, default=20, help="steps excluded from the train-loss gap (the "
                    "preset's train.warmup_steps)")
    ap.add_argument("--work", help="keep the runs in this folder (default: a temporary one); a run that finished "
                    "there before (its metrics end with a summary) is read again, not repeated")
    ap.add_argument("--set", action="append", default=[], help="extra --set for every run (e.g. train.lr=1e-3)")
    args = ap.parse_args()
    moetrain = str(Path(sys.executable).with_name("moetrain"))
    extra = [a for s in args.set for a in ("--set", s)]
    with tempfile.TemporaryDirectory() as tmp:
        d = Path(args.work) if args.work else Path(tmp)
        d.mkdir(parents=True, exist_ok=True)
        runs, wall = {}, {}
        for fp8 in ["none", *args.recipes]:
            rs = _records(d / fp8) if (d / fp8 / "metrics.jsonl").exists() else []
            done = any(r.get("kind") == "summary" and r.get("steps") == args.steps for r in rs)
            wall[fp8] = None if done else _run(moetrain, args.preset, args.steps, args.eval_every, fp8, d / fp8,
                                               extra)
            runs[fp8] = _records(d / fp8)
            print(f"fp8={fp8}: " + ("read from an earlier run" if done else f"{wall[fp8]:.0f} s"), flush=True)
    res = compare(runs, args.warmup)
    md = render(res, args)
    print(md)
    out = ROOT / "benchmarks" / "results" / f"fp8_loss_gap-{platform.node()}-{time.strftime('%Y%m%d')}-{args.preset}"
    out.with_suffix(".md").write_text(md)
    out.with_suffix(".json").write_text(json.dumps({"args": vars(args), "wall_s": wall, "results": res}, indent=1))
    print(f"results: {out}.md / .json")


if __name__ == "__main__":
    main()
