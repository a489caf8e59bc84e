"""The EP-overlap check of ``../shared/acceptance/overlap-exposed`` on several source trees side by side: tiny, EP 2, 2
processes, grad_accum 2, micro-batch 16, with ``parallel.ep_overlap`` on and off, the trees and settings run
round-robin, several rounds; per run the median over its logged steps (the first log line left out), per variant
the best round by tokens/s with its exposed share beside it, and every round's share.

    python benchmarks/overlap_side_by_side.py --src main=src --src old=/tmp/old/src --rounds 3

Each ``--src NAME=DIR`` is a ``src`` folder of a moetrain checkout (run with ``PYTHONPATH=DIR``); the data cache is
this checkout's (built on first use). Run it alone on the machine: the variants share its cores.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics as st
import subprocess
import sys
import tempfile
from pathlib import Path

ARGS = ["--preset", "tiny", "--ep", "2", "--nproc", "2", "--set", "train.grad_accum=2",
        "--set", "train.micro_batch_size=16", "--set", "train.eval_every=0", "--set", "train.log_every=10",
        "--set", "train.ckpt_every=0"]


def run(src: str, overlap: bool, steps: int, out: Path) -> dict[str, float]:
    env = {**os.environ, "PYTHONPATH": src}
    cmd = [sys.executable, "-m", "moetrain", "train", *ARGS, "--steps", str(steps),
           "--set", f"parallel.ep_overlap={'true' if overlap else 'false'}", "--out", str(out)]
    res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=900)
    if res.returncode:
        raise SystemExit(f"{src} overlap={overlap} failed: {res.stderr[-400:]}")
    recs = [r for r in map(json.loads, (out / "metrics.jsonl").open()) if r.get("kind") == "train"][1:]
    med = lambda k: st.median(r.get(k, 0.0) for r in recs)  # noqa: E731
    return {"tok_s": max(r["tokens_per_s_per_gpu"] for r in recs), "share": med("a2a_exposed_share"),
            "a2a_ms": 1e3 * med("a2a_s_per_step"), "exposed_ms": 1e3 * med("a2a_exposed_s_per_step"),
            "launch_ms": 1e3 * med("a2a_launch_s_per_step"), "step_ms": 1e3 * med("step_time_s")}


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--src", action="append", required=True, help="NAME=DIR (a checkout's src folder)")
    ap.add_argument("--rounds", type=int, default=3)
    ap.add_argument("--steps", type=int, default=40)
    a = ap.parse_args()
    trees = [s.split("=", 1) for s in a.src]
    results: dict[tuple[str, bool], list[dict[str, float]]] = {}
    with tempfile.TemporaryDirectory() as tmp:
        for r in range(a.rounds):
            for name, src in trees:
                for overlap in (True, False):
                    m = run(str(Path(src).resolve()), overlap, a.steps, Path(tmp) / f"{name}-{overlap}-{r}")
                    results.setdefault((name, overlap), []).append(m)
                    print(f"round {r} {name:>8} overlap {'on ' if overlap else 'off'}: {m}", flush=True)
    print(f"\n| tree | overlap | tokens/s (best round) | a2a ms/step | exposed ms/step | exposed share | launch ms/step "
          f"| shares of all rounds |")
    print("|---|---|---:|---:|---:|---:|---:|---|")
    for name, _ in trees:
        for overlap in (True, False):
            runs = results[(name, overlap)]
            best = max(runs, key=lambda m: m["tok_s"])
            shares = ", ".join(f"{m['share']:.1%}" for m in runs)
            print(f"| {name} | {'on' if overlap else 'off'} | {best['tok_s']:,.0f} | {best['a2a_ms']:.0f} | "
                  f"{best['exposed_ms']:.0f} | {best['share']:.1%} | {best['launch_ms']:.0f} | {shares} |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
