"""What load imbalance costs a training step, and what redundant experts win back, side by side in one run.

    .venv/bin/python -m moetrain bench --quick --out bench.json
    .venv/bin/python benchmarks/imbalance.py [--steps 24] [--rounds 2] [--redundant 4] [--bench-file bench.json]

One DeepSeek-V3-style checkpoint (HF format, written here) whose router biases send nearly every token to experts
0-7 -- all on EP rank 0 at EP 2 -- trains with ``moetrain train --init-from`` at EP 2 on 2 processes, the same model
and the same tokens (same data order, same seed) three ways, with bias updates off so the skew stays:

    (a) forced-balanced routing (``model.routing=balanced``, what the published records benchmark)
    (b) the learned routing as trained
    (c) the learned routing with ``parallel.redundant_experts`` copies, ``parallel.rebalance_every`` 4

The variants run round-robin ``--rounds`` times (the two cores are shared); each run's tokens/s is the median of its
logged steps from step 8 on, and a variant's figure the median over its runs. Beside them the planner's prediction
of (b) and (c) relative to (a): ``moetrain plan --routing real --imbalance-from RUN`` on the (b) and (c) runs (the
max/mean rows per EP rank each measured), against ``--routing balanced``, for the same model, EP, batch and sequence
on ``--gpu`` (``local`` needs a ``moetrain bench`` file). Results go to benchmarks/results/imbalance-<host>-<date>
.{json,md} and are quoted in BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import platform
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "src"))

#: The acceptance setup of the issue (../shared/acceptance/imbalance): 16 experts, top-4 of 4 groups (2 kept).
MODEL = dict(vocab_size=2048, hidden_size=128, intermediate_size=384, moe_intermediate_size=512, num_hidden_layers=3,
             first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4, kv_lora_rank=32, q_lora_rank=64,
             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16, n_routed_experts=16, n_shared_experts=1,
             num_experts_per_tok=4, n_group=4, topk_group=2, max_position_embeddings=256, rope_scaling=None)
VARIANTS = ("balanced", "learned", "redundant")


def write_checkpoint(out: Path, hot_bias: float) -> None:
    import torch
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(3)
    m = DeepseekV3ForCausalLM(DeepseekV3Config(**MODEL))
    with torch.no_grad():
        for mod in m.modules():
            if hasattr(mod, "e_score_correction_bias"):  # a transformers module, not ours
                b = torch.zeros(MODEL["n_routed_experts"])
                b[:8] = hot_bias
                mod.e_score_correction_bias.copy_(b)
    m.save_pretrained(out, safe_serialization=True)


def train(hf: Path, variant: str, out: Path, args: argparse.Namespace) -> list[dict]:
    routing = "balanced" if variant == "balanced" else "learned"
    extra = (["--set", f"parallel.redundant_experts={args.redundant}", "--set", "parallel.rebalance_every=4"]
             if variant == "redundant" else [])
    cmd = [sys.executable, "-m", "moetrain", "train", "--init-from", str(hf), "--ep", "2", "--nproc", "2",
           "--steps", str(args.steps), "--out", str(out), "--set", "model.bias_update_rate=0",
           "--set", f"data.seq_len={args.seq}", "--set", f"train.micro_batch_size={args.mbs}",
           "--set", "train.eval_every=0", "--set", "train.log_every=4", "--set", "train.ckpt_every=1000",
           "--set", f"model.routing={json.dumps(routing)}", *extra]
    p = subprocess.run(cmd, cwd=hf.parent, capture_output=True, text=True)
    if p.returncode:
        raise SystemExit(f"{variant} failed:\n{p.stdout[-2000:]}\n{p.stderr[-2000:]}")
    return [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]


def tokens_per_s(rows: list[dict]) -> float:
    return statistics.median(r["tokens_per_s_per_gpu"] for r in rows if r.get("kind") == "train" and r["step"] >= 8)


def predict(hf: Path, args: argparse.Namespace, routing: list[str]) -> float | None:
    """The planner's tokens/s per GPU for this run's model, EP, batch and sequence on ``--gpu``."""
    cmd = [sys.executable, "-m", "moetrain", "plan", "--model", str(hf), "--gpu", args.gpu, "--gpus", "2",
           "--ep", "2", "--mbs", str(args.mbs), "--seq", str(args.seq), "--gbs", str(2 * args.mbs), "--json",
           *routing, *(["--bench-file", args.bench_file] if args.bench_file else [])]
    p = subprocess.run(cmd, cwd=ROOT, capture_output=True, text=True)
    if p.returncode:
        print(f"plan {' '.join(routing)}: {p.stderr.strip()[-300:]}", file=sys.stderr)
        return None
    return json.loads(p.stdout)["tokens_per_s_per_gpu"]


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--steps", type=int, default=24)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--redundant", type=int, default=4, help="parallel.redundant_experts of (c)")
    ap.add_argument("--mbs", type=int, default=32)
    ap.add_argument("--seq", type=int, default=64)
    ap.add_argument("--hot-bias", type=float, default=2.0, help="router bias of experts 0-7")
    ap.add_argument("--gpu", default="local", help="the planner's GPU for the predictions (default local: this "
                    "machine from a `moetrain bench` file)")
    ap.add_argument("--bench-file", help="the `moetrain bench` file of --gpu local (default the planner's)")
    ap.add_argument("--out", default=str(ROOT / "benchmarks" / "results"))
    args = ap.parse_args()
    from moetrain.plan.measured import imbalance_from_run

    with tempfile.TemporaryDirectory() as d:
        work = Path(d)
        hf = work / "hf"
        write_checkpoint(hf, args.hot_bias)
        tps: dict[str, list[float]] = {v: [] for v in VARIANTS}
        for i in range(args.rounds):
            for v in VARIANTS:
                t0 = time.monotonic()
                tps[v].append(tokens_per_s(train(hf, v, work / f"{v}{i}", args)))
                print(f"round {i} {v}: {tps[v][-1]:.0f} tokens/s per rank ({time.monotonic() - t0:.0f} s)",
                      flush=True)
        measured = {v: statistics.median(x) for v, x in tps.items()}
        imb = {v: imbalance_from_run(work / f"{v}0") for v in ("learned", "redundant")}
        pred_a = predict(hf, args, ["--routing", "balanced"])
        pred = {v: predict(hf, args, ["--imbalance-from", str(work / f"{v}0")]) for v in ("learned", "redundant")}
    a = measured["balanced"]
    res = {"host": platform.node(), "date": time.strftime("%Y-%m-%d"), "args": vars(args), "tokens_per_s": tps,
           "median": measured, "ratio_learned": measured["learned"] / a, "ratio_redundant": measured["redundant"] / a,
           "measured_imbalance": imb, "gpu": args.gpu,
           "predicted_ratio_learned": pred["learned"] / pred_a if pred_a and pred["learned"] else None,
           "predicted_ratio_redundant": pred["redundant"] / pred_a if pred_a and pred["redundant"] else None}
    lines = ["| | (a) balanced | (b) learned | (c) learned + redundant |", "|---|---|---|---|",
             f"| tokens/s per rank (median) | {a:.0f} | {measured['learned']:.0f} | {measured['redundant']:.0f} |",
             f"| ratio to (a), measured | 1.00 | {res['ratio_learned']:.2f} | {res['ratio_redundant']:.2f} |",
             f"| max/mean rows per EP rank (`--imbalance-from`) | 1.00 | {imb['learned']:.2f} | "
             f"{imb['redundant']:.2f} |"]
    if res["predicted_ratio_learned"] is not None and res["predicted_ratio_redundant"] is not None:
        lines.append(f"| ratio to (a), `moetrain plan --gpu {args.gpu}` | 1.00 | {res['predicted_ratio_learned']:.2f}"
                     f" | {res['predicted_ratio_redundant']:.2f} |")
    md = "\n".join(lines)
    print(md)
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    stem = out / f"imbalance-{platform.node()}-{time.strftime('%Y%m%d')}"
    stem.with_suffix(".json").write_text(json.dumps(res, indent=1))
    stem.with_suffix(".md").write_text(md + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
