"""``moetrain`` command line: count | train | export | plan | bench | plot."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path


def _model_from_arg(arg: str):
    from moetrain.config import build_job_config, read_config_file
    from moetrain.model.config import PRESETS, ConfigError, get_preset

    if arg in PRESETS:
        return get_preset(arg), arg
    p = Path(arg)
    if p.is_dir() or p.name == "config.json" or (p.suffix == ".json" and p.is_file() and "model_type" in p.read_text()):
        from moetrain.interop.hf import load_hf_config
        return load_hf_config(p), str(p)
    if p.is_file():
        return build_job_config(read_config_file(p)).model, str(p)
    raise ConfigError(f"{arg!r} is neither a preset ({sorted(PRESETS)}) nor a config file")


def cmd_count(args: argparse.Namespace) -> int:
    from moetrain.accounting import count_params, flops_per_token

    cfg, name = _model_from_arg(args.model)
    if args.seq_len < 1:
        from moetrain.model.config import ConfigError
        raise ConfigError(f"--seq-len {args.seq_len} must be >= 1")
    p = count_params(cfg)
    f = flops_per_token(cfg, args.seq_len)
    if args.json:
        print(json.dumps({"model": name, "params": p.to_dict(), "flops_per_token": f.to_dict()}, indent=2))
        return 0
    b, unit = (1e9, "B") if p.total >= 1e9 else (1e6, "M")
    print(f"model {name}  (seq_len {args.seq_len}, MTP depth {cfg.mtp_depth})")
    print(f"  total parameters (no MTP)             {p.total / b:10.3f} {unit}")
    print(f"  MTP modules (unique)                  {p.mtp / b:10.3f} {unit}")
    print(f"  total incl. MTP                       {p.total_with_mtp / b:10.3f} {unit}")
    print(f"  active per token incl. embedding      {p.active / b:10.3f} {unit}")
    print(f"  active per token excl. embedding      {p.active_nonembedding / b:10.3f} {unit}")
    print(f"  training FLOPs/token, Megatron-Core   {f.megatron / 1e9:10.2f} GFLOP "
          f"(dense {f.megatron_dense / 1e9:.2f} + attention {f.megatron_attention / 1e9:.2f})")
    print(f"  training FLOPs/token, 6N + attention  {f.six_n / 1e9:10.2f} GFLOP (TorchTitan-style, full attention square)")
    return 0


def add_train_args(ap: argparse.ArgumentParser) -> None:
    ap.add_argument("--config", help="job file (.toml or .json) with [model] [parallel] [data] [train] sections")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="override one field, e.g. --set train.lr=1e-3 (repeatable)")
    ap.add_argument("--preset", help="model preset to start from (tiny, small, deepseek-v2-lite-16b, ...)")
    ap.add_argument("--data", action="append", help="training text: files or globs (.txt, .jsonl, .parquet); "
                    "repeatable. Default: the built-in corpus (Python standard library sources)")
    ap.add_argument("--tokenizer", help="an existing tokenizer.json (default: train a byte-level BPE)")
    ap.add_argument("--steps", type=int)
    ap.add_argument("--ep", type=int, help="expert-parallel size")
    ap.add_argument("--nproc", type=int, help="local worker processes (default: one per GPU, 2 on CPU)")
    ap.add_argument("--out", help="run directory (default runs/default)")
    ap.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"])
    ap.add_argument("--init-from", metavar="HF_DIR", help="start from released weights: a HF checkpoint directory "
                    "(config.json + safetensors); its config.json gives the model unless --preset is given; "
                    "--set model.X=... still overrides fields")
    ap.add_argument("--dry-run", action="store_true", help="all set-up (checks, data, mesh, meta build, parallelize, "
                    "materialise, --init-from), no step; print each rank's parameters, gradient and optimizer bytes, "
                    "measured peak memory and the performance model's prediction")
    ap.add_argument("--world", type=int, metavar="N", help="with --dry-run: report rank 0 of an N-rank layout that "
                    "does not exist here, built on meta in this process (no data preparation, no workers)")


def job_from_args(args: argparse.Namespace):
    from moetrain.config import load_job_config

    sets = list(args.set)
    if args.preset:
        sets.append(f"model.preset={json.dumps(args.preset)}")
    if args.data:
        sets.append(f"data.paths={json.dumps(args.data)}")
    if args.tokenizer:
        sets.append(f"data.tokenizer={json.dumps(args.tokenizer)}")
    for flag, key in (("steps", "train.steps"), ("ep", "parallel.ep"), ("nproc", "train.nproc")):
        if getattr(args, flag) is not None:
            sets.append(f"{key}={getattr(args, flag)}")
    if args.out:
        sets.append(f"train.out_dir={json.dumps(args.out)}")
    if args.resume:
        sets.append("train.resume=true")
    if args.device:
        sets.append(f"train.device={json.dumps(args.device)}")
    if args.init_from:
        sets.append(f"train.init_from={json.dumps(args.init_from)}")
    return load_job_config(args.config, sets)


def cmd_train(args: argparse.Namespace) -> int:
    from moetrain.train.launch import train_main

    summary = train_main(job_from_args(args), dry_run=args.dry_run, world=args.world)
    if summary and len(summary.get("val", [])) >= 2:
        (s0, v0), (s1, v1) = summary["val"][0], summary["val"][-1]
        print(f"validation loss: step {s0} {v0:.4f} -> step {s1} {v1:.4f} ({v1 / v0:.2%} of start)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from moetrain.interop.export import DTYPES, export_run

    out = export_run(args.run_dir, args.out_dir, step=args.step, dtype=DTYPES.get(args.dtype),
                     overwrite=args.overwrite)
    print(f"exported {args.run_dir} to {out}")
    return 0


def cmd_plot(args: argparse.Namespace) -> int:
    from moetrain.train.plot import plot_run

    for path in plot_run(args.run_dir, args.out):
        print(path)
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moetrain", description="DeepSeek-V3-style MoE pre-training")
    sub = ap.add_subparsers(dest="command", required=True)

    c = sub.add_parser("count", help="parameter counts and FLOPs per token of a preset or config file")
    c.add_argument("model", help="preset name, HF config.json, or job file")
    c.add_argument("--seq-len", type=int, default=4096)
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_count)

    t = sub.add_parser("train", help="pre-train (default: tiny preset, built-in corpus, EP=2 over 2 workers)")
    add_train_args(t)
    t.set_defaults(func=cmd_train)

    e = sub.add_parser("export", help="write a run's checkpoint in the released HF layout (safetensors, index, "
                       "config.json, tokenizer.json), never gathering the whole model")
    e.add_argument("run_dir", help="the run directory (moetrain train --out)")
    e.add_argument("out_dir", help="the HF checkpoint directory to write (created atomically)")
    e.add_argument("--step", type=int, help="the checkpoint step (default: the newest complete one)")
    e.add_argument("--dtype", choices=["bf16", "fp32"], help="cast the weights (default: as trained, fp32)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing out_dir")
    e.set_defaults(func=cmd_export)

    p = sub.add_parser("plot", help="loss curves and expert-load heatmap of a run, as PNG")
    p.add_argument("run_dir", nargs="?", default="runs/default")
    p.add_argument("--out", help="output directory (default: the run directory)")
    p.set_defaults(func=cmd_plot)

    try:
        from moetrain.plan.cli import add_bench_parser, add_plan_parser
    except ImportError:  # the planner is optional at import time
        pass
    else:
        add_plan_parser(sub)
        add_bench_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    from moetrain.data import DataError
    from moetrain.model.config import ConfigError
    from moetrain.errors import CheckpointError

    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except (ConfigError, DataError, CheckpointError, FileNotFoundError, FileExistsError,
            json.JSONDecodeError) as e:
        print(f"moetrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except RuntimeError as e:
        if args.command != "train":
            raise
        print(f"moetrain {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
