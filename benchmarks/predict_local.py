"""Predicted vs measured tokens/s of a local 2-process ``moetrain train`` run.

    .venv/bin/python benchmarks/predict_local.py [--steps 40] [--preset tiny] [--rebench] [--set SECTION.FIELD=V]

1. ``moetrain bench`` measures this machine (matmul curve, memory bandwidth, per-operator overhead, gloo
   all-to-all), unless a bench file exists (``--rebench`` forces it).
2. The performance model predicts the run's tokens/s from those measurements (moetrain.plan.local).
3. ``moetrain train`` runs for ``--steps`` steps; tokens/s per process is read from its metrics.jsonl (the first
   logging window -- warm-up, tokenizer and data caches -- is skipped).
4. Both are printed side by side; the issue's target is agreement within +-25%.

Run it on an otherwise idle machine: other processes competing for the cores slow the measured run but not the
bench-based prediction (or, when they load the bench, the other way round).
"""

from __future__ import annotations

import argparse
import json
import os
import resource
import shlex
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

# The same run `moetrain train` would do on its defaults, minus evaluation, checkpoints and TensorBoard (they are
# not part of the step the model predicts). Extra `--set` overrides go to both the run and the prediction.
TRAIN_CMD = ("{python} -m moetrain train --preset {preset} --steps {steps} --out {out} --nproc 2 --ep 2 "
             "--set train.log_every={log_every} --set train.eval_every=0 --set train.ckpt_every=0 "
             "--set train.tensorboard=false --device cpu")


def measured_tokens_per_s(out_dir: Path) -> tuple[float, list[float]]:
    """Median tokens/s per process over the logged windows after the first."""
    rows = [json.loads(line) for line in (out_dir / "metrics.jsonl").read_text().splitlines() if line.strip()]
    vals = [r["tokens_per_s_per_gpu"] for r in rows if "tokens_per_s_per_gpu" in r]
    if not vals:
        raise RuntimeError(f"no tokens_per_s_per_gpu in {out_dir / 'metrics.jsonl'}")
    use = vals[1:] if len(vals) > 1 else vals
    return statistics.median(use), vals


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--preset", default="tiny")
    ap.add_argument("--steps", type=int, default=40)
    ap.add_argument("--log-every", type=int, default=10)
    ap.add_argument("--bench-file", default=str(ROOT / ".cache" / "moetrain" / "bench.json"))
    ap.add_argument("--rebench", action="store_true")
    ap.add_argument("--set", action="append", default=[], help="extra SECTION.FIELD=VALUE for train and prediction")
    ap.add_argument("--tolerance", type=float, default=0.25)
    ap.add_argument("--cpu-time", action="store_true", help="also run a short run and report the CPU-time "
                    "equivalent throughput (robust to other processes on the machine)")
    args = ap.parse_args()

    load0 = os.getloadavg()[0]
    cores = os.cpu_count() or 1
    if load0 > 0.5 * cores:
        print(f"WARNING: load average {load0:.1f} on {cores} cores -- other processes will slow the measured run "
              "(the bench was taken with only its own processes running, so the prediction is for an idle machine)")
    from moetrain.config import load_job_config
    from moetrain.plan.bench import run_bench, summary
    from moetrain.plan.local import predict_local_train

    bench = Path(args.bench_file)
    if args.rebench or not bench.is_file():
        print(summary(run_bench(bench)))
    else:
        print(f"using bench results {bench} (--rebench to measure again)")

    sets = [f"model.preset={json.dumps(args.preset)}"] + list(args.set)
    job = load_job_config(None, sets, world=2)  # an unset EP is the preset's, fitted to the 2 processes
    world, ep = 2, job.parallel.ep if job.parallel.ep > 1 else 2
    t0 = time.perf_counter()
    try:
        pred = predict_local_train(job.model, job.data.seq_len, job.train.micro_batch_size, job.train.grad_accum,
                                   world=world, ep=ep, bench_json=bench,
                                   activation_checkpointing=job.parallel.recompute == "full")
    except ValueError as e:  # PlanError / HardwareError: e.g. a bench of another process count
        print(f"predict_local: {e}", file=sys.stderr)
        return 2
    print(f"prediction: {pred.tokens_per_s_per_proc:,.0f} tok/s per process (step {pred.step_s * 1e3:.0f} ms; "
          f"computed in {time.perf_counter() - t0:.1f} s)")

    env = {**os.environ, "PYTHONPATH": str(ROOT / "src") + os.pathsep + os.environ.get("PYTHONPATH", "")}

    def train(steps: int) -> tuple[float, list[float], float]:
        """Run moetrain train; (median tok/s per process, all windows, CPU seconds used by the run)."""
        with tempfile.TemporaryDirectory() as d:
            out = Path(d) / "run"
            cmd = TRAIN_CMD.format(python=shlex.quote(sys.executable), preset=args.preset, steps=steps,
                                   out=shlex.quote(str(out)), log_every=args.log_every)
            cmd += "".join(f" --set {shlex.quote(s)}" for s in args.set)
            print(f"running: {cmd}")
            ru0 = resource.getrusage(resource.RUSAGE_CHILDREN)
            r = subprocess.run(cmd, shell=True, cwd=ROOT, env=env)
            ru1 = resource.getrusage(resource.RUSAGE_CHILDREN)
            if r.returncode != 0:
                raise RuntimeError(f"moetrain train failed (exit {r.returncode}); no measurement")
            cpu = (ru1.ru_utime + ru1.ru_stime) - (ru0.ru_utime + ru0.ru_stime)
            tps, windows = measured_tokens_per_s(out)
            return tps, windows, cpu

    try:
        meas, windows, cpu_long = train(args.steps)
        cpu_equiv = None
        if args.cpu_time:
            # CPU seconds per step from the difference of two runs (start-up cancels): a load-robust estimate
            # of what an idle machine would do (waits on the peer process are not counted)
            _, _, cpu_short = train(args.log_every)
            per_step_cpu = (cpu_long - cpu_short) / (args.steps - args.log_every)
            tokens_per_step = job.train.micro_batch_size * job.train.grad_accum * world * job.data.seq_len
            cpu_equiv = tokens_per_step / per_step_cpu  # per process: (tokens/2) / (cpu/2)
    except RuntimeError as e:
        print(e, file=sys.stderr)
        return 1

    load1 = os.getloadavg()[0]
    ratio = pred.tokens_per_s_per_proc / meas
    ok = abs(ratio - 1) <= args.tolerance
    print()
    print(f"{'':28s}{'tokens/s per process':>22s}")
    print(f"{'predicted (moetrain plan)':28s}{pred.tokens_per_s_per_proc:>22,.0f}")
    print(f"{'measured (moetrain train)':28s}{meas:>22,.0f}   windows: {', '.join(f'{v:,.0f}' for v in windows)}")
    print(f"{'predicted / measured':28s}{ratio:>22.2f}   {'within' if ok else 'OUTSIDE'} +-{args.tolerance:.0%}")
    if cpu_equiv is not None:
        r2 = pred.tokens_per_s_per_proc / cpu_equiv
        print(f"{'measured, CPU-time based':28s}{cpu_equiv:>22,.0f}   predicted / this = {r2:.2f}")
    print(f"load average before / after the run: {load0:.1f} / {load1:.1f} on {cores} cores"
          + ("  (measurement disturbed by other processes)" if max(load0, load1) > 0.5 * cores + 2 else ""))
    s = pred.prediction.step
    parts = ", ".join(f"{k} {v * 1e3:.0f} ms" for k, v in s.compute_parts.items())
    print(f"predicted step {s.step * 1e3:.0f} ms: compute {s.compute * 1e3:.0f} ms ({parts}), all-to-all "
          f"{s.exposed_a2a * 1e3:.0f} ms, other comm {s.other_comm * 1e3:.0f} ms, optimizer {s.optimizer * 1e3:.0f} ms")
    return 0 if ok else 2


if __name__ == "__main__":
    sys.exit(main())
