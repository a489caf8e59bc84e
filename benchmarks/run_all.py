#!/usr/bin/env python
"""moetrain benchmark suite: one command, every figure as a ratio against its peers or its practical limit.

    .venv/bin/python benchmarks/run_all.py                 # CPU, `small` preset, all cases (~11 min on 2 cores)
    .venv/bin/python benchmarks/run_all.py --quick         # `tiny` preset, short runs (a smoke run)
    .venv/bin/python benchmarks/run_all.py --cases moe_layer,grouped_gemm
    .venv/bin/python benchmarks/run_all.py --gpu --out /path/results   # CUDA: bf16 autocast, NCCL, gpu-1x preset

Cases: moe_layer (MoE fwd+bwd tokens/s vs HF/TorchTitan), train_step (full step tokens/s, TFLOP/s, MFU on GPU),
grouped_gemm (expert GEMM FLOP/s vs one plain matmul of the same FLOPs), dispatcher (EP=2 vs EP=1 per-token
overhead, overlap on/off, 1/2 chunks), profile (torch.profiler of moetrain's and the fastest peer's step).

Writes ``<out>/<machine>-<date>.json`` and ``.md`` (default out: benchmarks/results) and prints the table. Before
each case it waits (up to --max-wait s) for the 1-minute load average to drop below --max-load, because the cores
may be shared, and records the load it measured under.
"""

from __future__ import annotations

import argparse
import datetime
import json
import shlex
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent))

from common import Gate, Settings, load1, machine_info, machine_tag, wait_for_quiet  # noqa: E402

ALL_CASES = ("moe_layer", "train_step", "grouped_gemm", "dispatcher", "profile")
GPU_CASES = ("train_step", "grouped_gemm", "moe_layer", "dispatcher", "profile")
GOALS = {
    "train_step": ("moetrain training step tokens/s / fastest peer's (small preset)", ">=", 1.5),
    "grouped_gemm": ("routed-expert GEMMs FLOP/s (fwd+bwd) / one plain matmul of the same FLOPs", ">=", 0.70),
    "dispatcher": ("EP=2 per-token overhead vs EP=1, overlap on (best of 1/2 chunks)", "<", 0.15),
}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--cases", default=",".join(ALL_CASES), help=f"comma-separated subset of {','.join(ALL_CASES)}")
    p.add_argument("--systems", default="", help="comma-separated subset of systems for moe_layer/train_step "
                                                 "(e.g. moetrain,hf[eager]); default all")
    p.add_argument("--quick", action="store_true", help="tiny preset, short runs (smoke run; figures not meaningful)")
    p.add_argument("--gpu", action="store_true", help="run on CUDA: bf16 autocast, NCCL, the gpu-1x preset")
    p.add_argument("--preset", default=None, help="model preset (default small; tiny with --quick; gpu-1x with --gpu)")
    p.add_argument("--batch", type=int, default=None)
    p.add_argument("--seq-len", type=int, default=None)
    p.add_argument("--threads", type=int, default=2, help="torch threads for every system (dispatcher: 1 per process)")
    p.add_argument("--iters", type=int, default=None, help="timed steps per system (best of them reported, median shown)")
    p.add_argument("--warmup", type=int, default=None)
    p.add_argument("--no-patches", action="store_true", help="skip the moetrain+patch rows (proposed src patches)")
    p.add_argument("--patches", default=None, help="comma-separated proposed patches that make up moetrain+patch "
                                                   "(default: all of benchmarks/patches.py DEFAULT)")
    p.add_argument("--out", default=None, help="results directory (default benchmarks/results)")
    p.add_argument("--max-load", type=float, default=0.7, help="wait until the 1-min load average is below this")
    p.add_argument("--max-wait", type=float, default=600, help="seconds to wait for a quiet machine per case")
    p.add_argument("--max-wait-system", type=float, default=120,
                   help="seconds to wait again before each system of moe_layer / train_step")
    p.add_argument("--no-wait", action="store_true", help="do not wait for a quiet machine (load still recorded)")
    return p.parse_args(argv)


def settings_from(a: argparse.Namespace) -> Settings:
    if a.gpu:
        import torch
        if not torch.cuda.is_available():
            raise SystemExit("--gpu: no CUDA device visible to torch")
        s = Settings(preset="gpu-1x", batch=4, seq_len=2048, threads=a.threads, device="cuda", dtype="bf16",
                     warmup=2, iters=5)
    elif a.quick:
        s = Settings(preset="tiny", batch=2, seq_len=64, threads=a.threads, warmup=1, iters=2, quick=True)
    else:
        s = Settings(threads=a.threads)
    for k in ("preset", "batch", "seq_len", "iters", "warmup"):
        v = getattr(a, k)
        if v is not None:
            setattr(s, k, v)
    return s


def main(argv: list[str] | None = None) -> dict[str, Any]:
    a = parse_args(argv)
    s = settings_from(a)
    if a.gpu and a.cases == ",".join(ALL_CASES):
        a.cases = ",".join(GPU_CASES)  # one GPU: no EP=2 (needs 2 GPUs); keeps the run near 5 minutes
    cases = [c.strip() for c in a.cases.split(",") if c.strip()]
    bad = sorted(set(cases) - set(ALL_CASES))
    if bad:
        raise SystemExit(f"unknown case(s) {bad}; choose from {list(ALL_CASES)}")
    systems = [x.strip() for x in a.systems.split(",") if x.strip()] or None
    import patches as P
    patch_names = [] if a.no_patches else (
        [x.strip() for x in a.patches.split(",") if x.strip()] if a.patches else list(P.DEFAULT))
    unknown = sorted(set(patch_names) - set(P.PATCHES))
    if unknown:
        raise SystemExit(f"unknown patch(es) {unknown}; known: {sorted(P.PATCHES)}")
    out_dir = Path(a.out) if a.out else Path(__file__).resolve().parent / "results"
    out_dir.mkdir(parents=True, exist_ok=True)
    info = machine_info(s)
    command = " ".join(["python benchmarks/run_all.py"] + [shlex.quote(x) for x in (argv if argv is not None
                                                                                      else sys.argv[1:])])
    print(f"moetrain benchmark suite  |  {command}")
    print(f"machine: {info['cpu']} ({info['cores_visible']} cores), {info.get('gpu', 'no GPU')}, torch "
          f"{info['torch']}, transformers {info['transformers']}, torchtitan {info['torchtitan']}")
    print(f"settings: preset {s.preset}, batch {s.batch} x seq {s.seq_len}, {s.dtype} on {s.device}, "
          f"{s.threads} threads, {s.warmup} warm-up + {s.iters} timed steps (best; median shown)")
    if patch_names:
        print(f"proposed patches measured as moetrain+patch: {', '.join(patch_names)}")
    results: dict[str, Any] = {"command": command, "machine": info, "settings": s.to_dict(),
                               "patches": {n: P.DESCRIPTIONS[n] for n in patch_names}, "cases": {}, "load": {}}
    t_start = time.time()
    with tempfile.TemporaryDirectory(prefix="moetrain-bench-ref-") as ref_dir:
        for case in cases:
            print(f"\n== {case}")
            if a.no_wait or s.device == "cuda":
                load = {"load_at_start": load1(), "waited_s": 0, "quiet": load1() < a.max_load}
            else:
                load = wait_for_quiet(a.max_load, a.max_wait, log=lambda m: print(m, flush=True))
            t0 = time.time()
            try:
                gate = Gate(a.max_load, a.max_wait_system, enabled=not (a.no_wait or s.device == "cuda"),
                            log=lambda m: print(m, flush=True))
                results["cases"][case] = run_case(case, s, patch_names, ref_dir, systems, results, gate)
            except Exception as e:  # noqa: BLE001 - one case failing must not lose the others
                results["cases"][case] = {"error": f"{type(e).__name__}: {e}"}
                print(f"    ERROR {type(e).__name__}: {e}")
            load.update(load_at_end=load1(), seconds=round(time.time() - t0, 1))
            results["load"][case] = load
            print(f"    (1-min load {load['load_at_start']:.2f} at start, {load['load_at_end']:.2f} at end"
                  f"{'' if load['quiet'] else ' -- NOT QUIET, figures unreliable'}; {load['seconds']:.0f} s)")
    results["wall_s"] = round(time.time() - t_start, 1)
    results["goals"] = evaluate_goals(results)
    table = markdown(results)
    print("\n" + table)
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    base = out_dir / f"{machine_tag(info)}-{stamp}{'-quick' if s.quick else ''}"
    base.with_suffix(".json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    base.with_suffix(".md").write_text(table + "\n")
    print(f"\nwrote {base}.json and {base}.md  ({results['wall_s']:.0f} s)")
    return results


def run_case(case: str, s: Settings, patch_names: list[str], ref_dir: str, systems: list[str] | None,
             results: dict[str, Any], gate: Gate) -> dict[str, Any]:
    if case == "moe_layer":
        import moe_layer
        return moe_layer.run(s, patch_names, ref_dir, systems, gate=gate)
    if case == "train_step":
        import train_step
        return train_step.run(s, patch_names, ref_dir, systems, gate=gate)
    if case == "grouped_gemm":
        import grouped_gemm
        return grouped_gemm.run(s, patch_names)
    if case == "dispatcher":
        import dispatcher
        return dispatcher.run(s, patch_names)
    if case == "profile":
        import profile_step
        prof_systems = ["moetrain+patch"] if patch_names else ["moetrain"]
        ts = results["cases"].get("train_step", {}).get("ratios", {})
        if s.device == "cpu":  # on GPU only moetrain's own profile, to stay within the device-time budget
            prof_systems.append(ts.get("fastest_peer", "hf[grouped_mm]"))
        if systems:
            prof_systems = [x for x in prof_systems if x in systems]
        return profile_step.run(s, patch_names, ref_dir, prof_systems)
    raise ValueError(case)


def evaluate_goals(r: dict[str, Any]) -> dict[str, Any]:
    goals: dict[str, Any] = {}
    cases = r["cases"]

    def verdict(v: float | None, op: str, target: float) -> bool | None:
        if v is None:
            return None
        return v >= target if op == ">=" else v < target

    ts = cases.get("train_step", {}).get("ratios", {})
    if ts:
        desc, op, tgt = GOALS["train_step"]
        before, after = ts.get("moetrain/fastest_peer"), ts.get("moetrain+patch/fastest_peer")
        goals["train_step"] = {"goal": f"{desc} {op} {tgt}", "fastest_peer": ts.get("fastest_peer"),
                               "before": before, "after": after, "met_before": verdict(before, op, tgt),
                               "met_after": verdict(after, op, tgt)}
        goals["train_step"].update(_matmul_ceiling(cases))
    gg = cases.get("grouped_gemm", {})
    if "baseline" in gg and "ratios" in gg["baseline"]:
        desc, op, tgt = GOALS["grouped_gemm"]
        before = gg["baseline"]["ratios"].get("experts[grouped_mm] routed fwd+bwd")
        after = gg["baseline"]["ratios"].get("experts[grouped_mm] routed +patch fwd+bwd")
        goals["grouped_gemm"] = {"goal": f"{desc} {op} {tgt}", "before": before, "after": after,
                                 "met_before": verdict(before, op, tgt), "met_after": verdict(after, op, tgt)}
    dp = cases.get("dispatcher", {})
    if "baseline" in dp and "rows" in dp["baseline"]:
        desc, op, tgt = GOALS["dispatcher"]

        def best(res: dict[str, Any]) -> float | None:
            v = [x["overhead_vs_ep1"] for x in res.get("rows", []) if x["ep"] > 1 and x["overlap"]]
            return min(v) if v else None
        before, after = best(dp["baseline"]), best(dp.get("patched", {}))
        goals["dispatcher"] = {"goal": f"{desc} {op} {tgt}", "before": before, "after": after,
                               "met_before": verdict(before, op, tgt), "met_after": verdict(after, op, tgt)}
    return goals


def _matmul_ceiling(cases: dict[str, Any]) -> dict[str, Any]:
    """The most any implementation could lead the fastest peer by on this machine: a step that ran every
    Megatron-counted FLOP at the rate of one large plain matmul (grouped_gemm case, fwd+bwd) and spent no time on
    anything else. Returns {} unless both cases ran."""
    ts, gg = cases.get("train_step", {}), cases.get("grouped_gemm", {}).get("baseline", {})
    peer = ts.get("ratios", {}).get("fastest_peer")
    rows = {x["system"]: x for x in ts.get("rows", []) if "tokens_per_s" in x}
    lim = next((x for x in gg.get("rows", []) if x["label"].startswith("plain matmul")), None)
    if peer not in rows or "moetrain" not in rows or lim is None:
        return {}
    flops = rows["moetrain"]["tflops"] * 1e12 * rows["moetrain"]["min_s"]
    bound_s = flops / lim["fwd_bwd_flops_per_s"]
    return {"matmul_bound_ms": bound_s * 1e3, "ceiling_vs_fastest_peer": rows[peer]["min_s"] / bound_s,
            "moetrain_share_of_bound": bound_s / rows["moetrain"]["min_s"],
            "peer_share_of_bound": bound_s / rows[peer]["min_s"]}


def _load(x: dict[str, Any]) -> str:
    if "load_at_start" not in x:
        return "-"
    return f"{x['load_at_start']:.2f}/{x['load_at_end']:.2f}" + (" NOT QUIET" if x.get("quiet") is False else "")


def _f(v: Any, pct: bool = False, digits: int = 2) -> str:
    if v is None:
        return "-"
    if pct:
        return f"{v * 100:+.1f}%"
    return f"{v:.{digits}f}"


def markdown(r: dict[str, Any]) -> str:
    m, s = r["machine"], r["settings"]
    lines = [f"### moetrain benchmarks: {m['date']}",
             "",
             f"- command: `{r['command']}`",
             f"- machine: {m['cpu']} ({m['cores_visible']} cores visible, {m['mem_gb']} GB), "
             f"{m.get('gpu', 'no GPU')}; torch {m['torch']}, transformers {m['transformers']}, "
             f"torchtitan {m['torchtitan']}; git {m['git']}",
             f"- settings: preset `{s['preset']}` (mtp_depth=0, plain RoPE), batch {s['batch']} x seq {s['seq_len']},"
             f" {s['dtype']} on {s['device']}, {s['threads']} threads per system, best of {s['iters']} timed "
             f"steps after {s['warmup']} warm-up",
             "- 1-min load at each case's start/end: " + ", ".join(
                 f"{c} {v['load_at_start']:.2f}/{v['load_at_end']:.2f}{'' if v['quiet'] else ' (NOT QUIET)'}"
                 for c, v in r["load"].items()),
             ""]
    cases = r["cases"]
    for case in ("moe_layer", "train_step"):
        c = cases.get(case)
        if not c or "rows" not in c:
            if c and "error" in c:
                lines += [f"**{case}**: error {c['error']}", ""]
            continue
        title = ("MoE layer forward+backward" if case == "moe_layer"
                 else "Training step (fwd + bwd + clip + AdamW)")
        lines += [f"**{title}**", "",
                  "| system | tokens/s | ms/step best (median) | GFLOP/s (Megatron) | " + ("MFU | " if s["device"] == "cuda" else "")
                  + "peak mem MiB | vs fastest peer | same function | load start/end |",
                  "|---|---:|---:|---:|" + ("---:|" if s["device"] == "cuda" else "") + "---:|---:|---|---|"]
        fastest = c.get("ratios", {}).get("fastest_peer")
        best = next((x for x in c["rows"] if x["system"] == fastest), None)
        for x in c["rows"]:
            if "tokens_per_s" not in x:
                why = x.get("skipped") or x.get("error", "")
                lines.append(f"| {x['system']} | " + ("skipped" if "skipped" in x else "error")
                             + f": {why[:160].replace('|', '/')} | | | " + ("| " if s["device"] == "cuda" else "")
                             + "| | | |")
                continue
            ratio = x["tokens_per_s"] / best["tokens_per_s"] if best else None
            same = ("reference" if x["system"] == "moetrain" else
                    ("yes" if x.get("same_function", True) else "NO") + (
                        f" ({x['max_rel_err_vs_moetrain']:.0e})" if "max_rel_err_vs_moetrain" in x else
                        f" ({x['rel_loss_diff_vs_moetrain']:.0e})" if "rel_loss_diff_vs_moetrain" in x else ""))
            mfu = f"{x['mfu'] * 100:.1f}% | " if s["device"] == "cuda" and "mfu" in x else (
                "- | " if s["device"] == "cuda" else "")
            lines.append(f"| {x['system']} | {x['tokens_per_s']:.1f} | {x['min_s'] * 1e3:.1f} ({x['median_s'] * 1e3:.1f}) | "
                         f"{x['tflops'] * 1e3:.1f} | {mfu}{x['peak_mem_mb']:.0f} | {_f(ratio)}"
                         f"{' (fastest peer)' if x['system'] == fastest else ''} | {same} | {_load(x)} |")
        for n in c.get("notes", []):
            lines.append(f"\nNote: {n}")
        lines.append("")
    gg = cases.get("grouped_gemm", {})
    if "baseline" in gg and "rows" in gg["baseline"]:
        b = gg["baseline"]
        lines += [f"**Expert GEMMs vs one plain matmul of the same FLOPs** (E={b['E']}, D={b['D']}, F={b['F']}, "
                  f"S={b['S']} routed rows; rows per expert: " + ", ".join(
                      f"{k} {min(c)}..{max(c)}" for k, c in b.get("counts", {"routed": b["counts_routed"]}).items())
                  + "; variants timed round-robin in one process)",
                  "", "| variant | fwd GFLOP/s | fwd+bwd GFLOP/s | fwd vs matmul | fwd+bwd vs matmul |",
                  "|---|---:|---:|---:|---:|"]
        rows = list(b["rows"])
        lim = next(x for x in b["rows"] if x["label"].startswith("plain matmul"))
        for x in rows:
            lines.append(f"| {x['label']} | {x['fwd_flops_per_s'] / 1e9:.1f} | {x['fwd_bwd_flops_per_s'] / 1e9:.1f} | "
                         f"{x['fwd_flops_per_s'] / lim['fwd_flops_per_s']:.2f} | "
                         f"{x['fwd_bwd_flops_per_s'] / lim['fwd_bwd_flops_per_s']:.2f} |")
        lines.append("")
    dp = cases.get("dispatcher", {})
    for label in ("baseline", "patched"):
        d = dp.get(label)
        if not d:
            continue
        if "rows" not in d:
            lines += [f"**Dispatcher ({label})**: {d.get('skipped') or d.get('error', '')[:300]}", ""]
            continue
        lines += [f"**Dispatcher overhead, EP=2 vs EP=1, 2 processes x 1 thread, {d['backend']} "
                  f"({'as in src' if label == 'baseline' else 'with proposed patches'})**", "",
                  "| layout | ms/step (slower rank) | overhead per token | all-to-all ms/step | exposed ms/step "
                  "| rows/step to the other rank |",
                  "|---|---:|---:|---:|---:|---:|"]
        for x in d["rows"]:
            ov = _f(x.get("overhead_vs_ep1"), pct=True) if x["ep"] > 1 else "reference"
            lines.append(f"| {x['name']} | {x['median_s'] * 1e3:.1f} | {ov} | {x['a2a_s_per_step'] * 1e3:.1f} | "
                         f"{x['exposed_s_per_step'] * 1e3:.1f} | {x.get('remote_rows_per_step', 0):.0f} |")
        lines.append("")
    g = r.get("goals", {})
    if g:
        lines += ["**Goals**", "", "| goal | src | with proposed patches | met |", "|---|---:|---:|---|"]
        for k, v in g.items():
            pct = k == "dispatcher"
            met = v["met_after"] if v["after"] is not None else v["met_before"]
            lines.append(f"| {v['goal']}{' (fastest peer: ' + v['fastest_peer'] + ')' if v.get('fastest_peer') else ''}"
                         f" | {_f(v['before'], pct)} | {_f(v['after'], pct)} | "
                         f"{'yes' if met else 'no' if met is not None else '-'} |")
        c = g.get("train_step", {})
        if "matmul_bound_ms" in c:
            lines += ["", f"Matmul ceiling: the step's {c['matmul_bound_ms']:.0f} ms if every Megatron-counted FLOP ran "
                      f"at the plain-matmul rate and nothing else took time = {c['ceiling_vs_fastest_peer']:.2f}x the "
                      f"fastest peer, the most any implementation could lead by on this machine. moetrain runs at "
                      f"{c['moetrain_share_of_bound'] * 100:.0f}% of that bound, the fastest peer at "
                      f"{c['peer_share_of_bound'] * 100:.0f}%."]
        lines.append("")
    prof = cases.get("profile", {})
    for system, p in prof.items():
        if not isinstance(p, dict) or "top" not in p:
            continue
        lines += [f"**Profile of one training step: {system}** ({p['total_ms']:.0f} ms of op self time, "
                  f"matmul-class ops {p['gemm_share'] * 100:.0f}%)", "", "| op | self ms | share | calls |",
                  "|---|---:|---:|---:|"]
        for e in p["top"][:10]:
            lines.append(f"| `{e['op']}` | {e['self_ms']:.1f} | {e['share'] * 100:.1f}% | {e['calls']} |")
        lines.append("")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
