"""``moetrain`` command line: count | train | prepare | export | eval | sample | plan | bench | plot."""

from __future__ import annotations

import argparse
import json
import os
import sys
from pathlib import Path
from typing import Any


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
        print(json.dumps({"model": name, "family": cfg.family.value, "params": p.to_dict(),
                          "flops_per_token": f.to_dict()}, indent=2))
        return 0
    b, unit = (1e9, "B") if p.total >= 1e9 else (1e6, "M")
    print(f"model {name}  ({cfg.family.value}, seq_len {args.seq_len}, MTP depth {cfg.mtp_depth})")
    print(f"  total parameters (no MTP)             {p.total / b:10.3f} {unit}")
    print(f"  MTP modules (unique)                  {p.mtp / b:10.3f} {unit}")
    print(f"  total incl. MTP                       {p.total_with_mtp / b:10.3f} {unit}")
    print(f"  active per token incl. embedding      {p.active / b:10.3f} {unit}")
    print(f"  active per token excl. embedding      {p.active_nonembedding / b:10.3f} {unit}")
    print(f"  active per token excl. routers        {p.active_without_router / b:10.3f} {unit}")
    print(f"  training FLOPs/token, Megatron-Core   {f.megatron / 1e9:10.2f} GFLOP "
          f"(dense {f.megatron_dense / 1e9:.2f} + attention {f.megatron_attention / 1e9:.2f})")
    print(f"  training FLOPs/token, 6N + attention  {f.six_n / 1e9:10.2f} GFLOP (TorchTitan-style, full attention square)")
    return 0


def add_job_args(ap: argparse.ArgumentParser) -> None:
    """The options that describe a job's model and data (shared by ``train`` and ``prepare``): --config, --set,
    --preset, --data, --tokenizer; each help names its ``--set`` spelling and its default."""
    from moetrain.config import DEMO_PRESET
    from moetrain.model.config import PRESETS

    ap.add_argument("--config", metavar="FILE", help="job file (.toml or .json) with [model] [parallel] [data] "
                    "[train] tables; --set and the options below override it")
    ap.add_argument("--set", action="append", default=[], metavar="SECTION.FIELD=VALUE",
                    help="override one field, e.g. --set train.lr=1e-3 (repeatable; values are TOML: numbers, "
                    "true/false, \"strings\", [lists]); `moetrain train --help-config` lists every field with its "
                    "type, default and meaning")
    ap.add_argument("--preset", metavar="NAME", help=f"model preset to start from, with its own training defaults "
                    f"(sequence length, batch, learning rate, EP): {', '.join(PRESETS)} (--set model.preset=NAME; "
                    f"default {DEMO_PRESET})")
    ap.add_argument("--data", action="append", metavar="GLOB", help="training text: files or globs (.txt, .jsonl, "
                    ".parquet), repeatable (--set data.paths='[\"GLOB\", ...]'; default: the built-in corpus, the "
                    "Python standard library sources)")
    ap.add_argument("--source", action="append", metavar="SPEC", help="one source of a weighted mixture, "
                    "repeatable: a file, glob or Hugging Face datasets folder, or hub:NAME (a dataset in the local "
                    "datasets cache), then ,KEY=VALUE items: weight, split, text_field, config, streaming; e.g. "
                    "--source 'web/*.parquet,weight=3' --source 'hub:wikitext,config=wikitext-2-raw-v1,weight=1' "
                    "(--set data.sources='[\"SPEC\", ...]' or [[data.sources]] tables in --config; default: none, "
                    "the --data files)")
    ap.add_argument("--tokenizer", metavar="FILE", help="an existing tokenizer.json; its size sets model.vocab_size "
                    "unless that is set (--set data.tokenizer=\"FILE\"; default: train a byte-level BPE of "
                    "data.vocab_size tokens, the preset's vocabulary)")


def add_train_args(ap: argparse.ArgumentParser) -> None:
    """Every option of ``moetrain train``: the job options, the shortcuts (each help names its ``--set`` spelling and
    the demo's default), --init-from, --dry-run, --world and --help-config."""
    from moetrain.config import JobConfig
    from moetrain.model.config import PRESET_JOB_DEFAULTS

    demo = JobConfig()
    add_job_args(ap)
    eps = ", ".join(f"{'HF config' if k == 'hf' else k}: {v['parallel']['ep']}"
                    for k, v in PRESET_JOB_DEFAULTS.items())
    ap.add_argument("--steps", type=int, metavar="N",
                    help=f"optimizer steps (--set train.steps=N; default {demo.train.steps})")
    ap.add_argument("--ep", type=int, metavar="N", help=f"expert-parallel size (--set parallel.ep=N; default: the "
                    f"preset's ({eps}), lowered to the largest size that divides the processes and the experts; "
                    f"set, it must divide the processes)")
    ap.add_argument("--pp", type=int, metavar="N", help="pipeline-parallel stages (--set parallel.pp=N; default 1); "
                    "the schedule is parallel.schedule (1f1b, interleaved with parallel.vpp, dualpipev, zbv)")
    ap.add_argument("--nproc", type=int, metavar="N", help="local worker processes (--set train.nproc=N; default "
                    f"{demo.train.nproc} = one per GPU, 2 on CPU)")
    ap.add_argument("--out", metavar="DIR", help=f"run directory (--set train.out_dir=\"DIR\"; default "
                    f"{demo.train.out_dir})")
    ap.add_argument("--resume", action="store_true", help="continue from the newest complete checkpoint in --out "
                    "(--set train.resume=true; default false)")
    ap.add_argument("--device", choices=["auto", "cpu", "cuda"], help=f"--set train.device=\"...\"; default "
                    f"{demo.train.device} (cuda if available)")
    ap.add_argument("--init-from", metavar="HF_DIR", help="start from released weights: a HF checkpoint directory "
                    "(config.json + safetensors); its config.json gives the model unless --preset is given; "
                    "--set model.X=... still overrides fields (--set train.init_from=\"HF_DIR\"; default: none)")
    ap.add_argument("--plan", metavar="FILE", help="run exactly the plan of a `moetrain plan ... --json` output: its "
                    "layout field for field (sizes, schedule, the predicted pipeline split, dispatcher, precision, "
                    "recompute, overlap, FSDP), MTP depth, batch, sequence and routing (and, unless --nproc, its "
                    "process count); every field the trainer cannot run is refused by name before anything starts. "
                    "--set and the other options still override it")
    ap.add_argument("--dry-run", action="store_true", help="all set-up (checks, data, mesh, meta build, parallelize, "
                    "materialise, --init-from), no step; print each rank's parameters, gradient and optimizer bytes, "
                    "measured peak memory and the performance model's prediction")
    ap.add_argument("--world", type=int, metavar="N", help="with --dry-run: report rank 0 of an N-rank layout that "
                    "does not exist here, built on meta in this process (no data preparation, no workers)")
    ap.add_argument("--gpu", metavar="NAME", help="with --dry-run --world: the GPU the layout is predicted on and "
                    "judged against (fits / does not fit, exit 3 when it does not): a `moetrain plan` GPU name (h100, "
                    "h200, b200, gb300, ...); default the --plan file's GPU, else h100, which the verdict calls "
                    "assumed. A --world layout trains in the GPU's precision (bf16 activations) also when this host "
                    "has no GPU; --device cpu judges a CPU run (no verdict)")
    ap.add_argument("--help-config", nargs="?", const="all", metavar="SECTION",
                    help="list every section and field (type, this job's value, meaning) and exit; with a SECTION "
                    "(model, parallel, data, train) the full meaning of its fields")


def _plan_file(args: argparse.Namespace) -> Any:
    """The ``--plan`` file of ``args`` (a :class:`moetrain.train.from_plan.PlanFile`), read once ("-" is standard
    input, which can be read only once)."""
    from moetrain.train.from_plan import read_plan

    if getattr(args, "plan_file", None) is None:
        args.plan_file = read_plan(args.plan)
    return args.plan_file


def _plan_sections(args: argparse.Namespace) -> dict[str, dict[str, Any]] | None:
    """The job sections of ``--plan FILE`` (:func:`moetrain.train.from_plan.plan_job`), its process count as
    ``train.nproc`` unless ``--nproc`` is given; None without ``--plan``. Prints what of the plan is only a
    prediction's input."""
    if not getattr(args, "plan", None):
        return None
    from moetrain.train.from_plan import plan_job
    from moetrain.train.rank0 import is_rank0

    pj = plan_job(_plan_file(args))
    if is_rank0():
        print(f"[moetrain] --plan {args.plan}: prediction-only, not run: {'; '.join(pj.prediction_only)}")
    sections = {k: dict(v) for k, v in pj.sections.items()}
    if getattr(args, "nproc", None) is None:
        sections["train"]["nproc"] = pj.world
    return sections


def _sets_from_args(args: argparse.Namespace) -> list[str]:
    sets = list(args.set)
    if args.preset:
        sets.append(f"model.preset={json.dumps(args.preset)}")
    if args.data:
        sets.append(f"data.paths={json.dumps(args.data)}")
    if args.tokenizer:
        sets.append(f"data.tokenizer={json.dumps(args.tokenizer)}")
    if args.source:
        sets.append(f"data.sources={json.dumps(args.source)}")
    for flag, key in (("steps", "train.steps"), ("ep", "parallel.ep"), ("pp", "parallel.pp"),
                      ("nproc", "train.nproc")):
        if getattr(args, flag, None) is not None:
            sets.append(f"{key}={getattr(args, flag)}")
    if getattr(args, "out", None):
        sets.append(f"train.out_dir={json.dumps(args.out)}")
    if getattr(args, "resume", False):
        sets.append("train.resume=true")
    if getattr(args, "device", None):
        sets.append(f"train.device={json.dumps(args.device)}")
    if getattr(args, "init_from", None):
        sets.append(f"train.init_from={json.dumps(args.init_from)}")
    return sets


def _launch_world(args: argparse.Namespace):
    """The number of processes ``train_main`` will train on (--world, torchrun's WORLD_SIZE, else the local
    launcher's count), as a function of the preliminary job; None when not known."""
    def world(job) -> int | None:
        if getattr(args, "world", None) is not None:
            return args.world
        if "RANK" in os.environ and "WORLD_SIZE" in os.environ:
            return int(os.environ["WORLD_SIZE"])
        from moetrain.train.launch import default_nproc
        return default_nproc(job)
    return world


def job_from_args(args: argparse.Namespace, fit_world: bool = True):
    """The JobConfig of parsed ``train`` (or ``prepare``) arguments: --config, then --set, then the shortcuts.

    ``fit_world``: size an unset EP to the processes that will train (see :func:`moetrain.config.build_job_config`)
    and print a note when it is lowered."""
    from moetrain.config import load_job_config
    from moetrain.train.rank0 import is_rank0

    job = load_job_config(args.config, _sets_from_args(args), world=_launch_world(args) if fit_world else None,
                          plan=_plan_sections(args), dry_run_world=getattr(args, "world", None) is not None)
    if is_rank0():  # under torchrun every rank builds the same job: rank 0 says its notes once
        for note in job.notes:
            print(f"[moetrain] note: {note}")
    return job


def cmd_help_config(args: argparse.Namespace) -> int:
    """``moetrain train --help-config [SECTION]``: every field of the job's config, with this job's values."""
    from moetrain.config import describe_config

    section = None if args.help_config == "all" else args.help_config
    print(describe_config(job_from_args(args, fit_world=False), section))
    return 0


def cmd_prepare(args: argparse.Namespace) -> int:
    """``moetrain prepare``: tokenise and shard the job's corpus into the data cache that ``moetrain train`` reuses."""
    from moetrain.data import prepare_data

    job = job_from_args(args, fit_world=False)
    prep = prepare_data(job.data)
    print(f"{'reused' if prep.reused else 'prepared'}: {prep.n_train_tokens:,} training + {prep.n_val_tokens:,} "
          f"validation tokens, tokenizer of {prep.vocab_size:,} tokens")
    if prep.sources:
        _print_mixture(job, prep)
    print(f"data cache: {prep.data_dir}")
    print("moetrain train with the same --preset/--config/--set data.*/--data/--source/--tokenizer options reuses it")
    return 0


def _print_mixture(job: Any, prep: Any) -> None:
    """``moetrain prepare``'s table of a mixture: each source's tokens, its weight, and the share of the first
    train.steps steps' sequences (one data-parallel rank's worth: every rank takes as many) it gives."""
    from moetrain.data import mixture_report

    tc = job.train
    n = tc.steps * tc.micro_batch_size * tc.grad_accum
    rows = mixture_report(prep, job.data.seq_len, n, job.data.seed)
    width = max(12, *(len(r["label"]) for r in rows))
    print(f"{'source':<{width}}  {'docs':>8}  {'train tokens':>13}  {'val tokens':>10}  {'of tokens':>9}  "
          f"{'weight':>6}  {'realised':>8}  {'epochs':>6}")
    for r in rows:
        print(f"{r['label']:<{width}}  {r['docs']:>8,}  {r['train_tokens']:>13,}  {r['val_tokens']:>10,}  "
              f"{r['token_share']:>9.1%}  {r['weight']:>6.1%}  {r['share']:>8.1%}  {r['epochs']:>6.2f}")
    print(f"realised: each source's share of the first {n:,} training sequences (train.steps={tc.steps} x "
          f"micro-batch {tc.micro_batch_size} x grad_accum {tc.grad_accum}, one data-parallel rank's worth; N ranks "
          f"read N times as many); epochs: how often those sequences read the source")


def _cmd_train_or_help(args: argparse.Namespace) -> int:
    return cmd_help_config(args) if args.help_config is not None else cmd_train(args)


def cmd_train(args: argparse.Namespace) -> int:
    from moetrain.train.launch import train_main
    from moetrain.train.resume import check_run_config_copy

    if args.config:  # before anything is read or printed: a copied run's config would train into the original
        out_given = bool(args.out) or any(s.split("=", 1)[0].strip() == "train.out_dir" for s in args.set)
        check_run_config_copy(args.config, out_given, args.resume)
    job = job_from_args(args)
    plan = _plan_file(args) if getattr(args, "plan", None) and args.dry_run else None  # set beside the run
    summary = train_main(job, dry_run=args.dry_run, world=args.world, plan=plan, gpu=args.gpu)
    if summary and summary.get("verdict", {}).get("fits") is False:
        return 3  # as `moetrain plan`: the layout does not fit the GPU's memory
    if summary and summary.get("stopped"):  # a clean stop on SIGINT/SIGTERM (moetrain.train.stopping)
        from moetrain.train.stopping import resume_command, stop_line
        if "RANK" not in os.environ:  # under torchrun rank 0 printed it already
            print(stop_line({**summary["stopped"], "resume": resume_command()}))  # this process's command line
        return summary["stopped"]["exit_code"]
    if summary and len(summary.get("val", [])) >= 2:
        (s0, v0), (s1, v1) = summary["val"][0], summary["val"][-1]
        print(f"validation loss: step {s0} {v0:.4f} -> step {s1} {v1:.4f} ({v1 / v0:.2%} of start)")
    return 0


def cmd_export(args: argparse.Namespace) -> int:
    from moetrain.interop.export import DTYPES
    from moetrain.train.export import export_run

    out = export_run(args.run_dir, args.out_dir, step=args.step, dtype=DTYPES.get(args.dtype),
                     overwrite=args.overwrite, fp8=args.fp8)
    print(f"exported {args.run_dir} to {out}")
    return 0


def _device(name: str) -> str:
    """``--device`` of eval and sample: "auto" is cuda when a GPU is visible, else cpu.

    Raises:
        ConfigError: ``cuda`` asked for where no CUDA device is visible (as ``train.device`` is refused).
    """
    import torch

    from moetrain.errors import ConfigError
    if name == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    if name == "cuda" and not torch.cuda.is_available():
        raise ConfigError("--device cuda but no CUDA device is visible; use --device cpu or auto")
    return name


def cmd_eval(args: argparse.Namespace) -> int:
    from moetrain.train.evaluate import check_json_path, evaluate_run, write_json

    if args.json:
        check_json_path(args.json)  # before the evaluation: a bad path would lose its result
    report = evaluate_run(args.run_dir, args.data, step=args.step, device=_device(args.device),
                          micro_batch_size=args.micro_batch_size, max_batches=args.max_batches, nproc=args.nproc,
                          ep=args.ep, pp=args.pp, text_field=args.text_field)
    # With JSON on standard output the table goes to stderr, so that `moetrain eval ... --json | jq` parses.
    print(report.table(), file=sys.stderr if args.json == "-" else sys.stdout)
    if args.json:
        write_json(report, args.json)
    return 0


def cmd_sample(args: argparse.Namespace) -> int:
    from moetrain.train.sample import sample_run

    text = sample_run(args.run_dir, args.prompt, args.max_new_tokens, args.temperature, args.top_p, args.seed,
                      args.step, _device(args.device))
    print(args.prompt + text)
    return 0


def add_eval_sample_parsers(sub: Any) -> None:
    """The ``eval`` and ``sample`` subcommands."""
    ev = sub.add_parser("eval", help="loss and perplexity of a run's checkpoint on held-out text (default: its own "
                        "validation split), per source")
    ev.add_argument("run_dir", help="the run directory (moetrain train --out)")
    ev.add_argument("--data", action="append", metavar="SPEC", help="a held-out source, as train --source takes it: "
                    "file or glob (.txt, .jsonl, .parquet), datasets folder, or hub:NAME (,split=, ,text_field=, "
                    ",config=), tokenised with the run's tokenizer; repeatable, one row each (default: the run's own "
                    "validation split, one row per source)")
    ev.add_argument("--step", type=int, help="the checkpoint step (default: the newest complete one)")
    ev.add_argument("--text-field", metavar="NAME", help="the JSON-lines key / column holding the text of --data "
                    "(default: the run's data.text_field)")
    ev.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="default: cuda if available")
    ev.add_argument("--micro-batch-size", type=int, metavar="N", help="sequences per forward (default: the run's)")
    ev.add_argument("--max-batches", type=int, metavar="N", help="score at most N micro-batches per source")
    ev.add_argument("--nproc", type=int, metavar="N", help="run on N local worker processes at --ep/--pp through the "
                    "trainer's model parts (default: ep x pp with --ep/--pp, else one process, the checkpoint read "
                    "whole)")
    ev.add_argument("--ep", type=int, metavar="N", help="expert-parallel size with --nproc (default 1)")
    ev.add_argument("--pp", type=int, metavar="N", help="pipeline stages with --nproc (default 1)")
    ev.add_argument("--json", nargs="?", const="-", metavar="FILE", help="also write the report as JSON to FILE "
                    "(standard output without FILE)")
    ev.set_defaults(func=cmd_eval)

    sa = sub.add_parser("sample", help="continue a prompt with a run's checkpoint (greedy, or temperature/top-p)")
    sa.add_argument("run_dir", help="the run directory (moetrain train --out)")
    sa.add_argument("--prompt", required=True, help="the text to continue")
    sa.add_argument("--max-new-tokens", type=int, default=64, metavar="N", help="at most N tokens (default 64)")
    sa.add_argument("--temperature", type=float, default=0.0, metavar="T", help="0 = greedy (default)")
    sa.add_argument("--top-p", type=float, default=1.0, metavar="P", help="nucleus sampling mass (default 1: all)")
    sa.add_argument("--seed", type=int, default=0)
    sa.add_argument("--step", type=int, help="the checkpoint step (default: the newest complete one)")
    sa.add_argument("--device", choices=["auto", "cpu", "cuda"], default="auto", help="default: cuda if available")
    sa.set_defaults(func=cmd_sample)


def cmd_plot(args: argparse.Namespace) -> int:
    from moetrain.train.plot import not_drawn, plot_run, read_metrics

    for path in plot_run(args.run_dir, args.out):
        print(path)
    for name, why in not_drawn(read_metrics(args.run_dir)).items():
        print(f"not drawn: {name} ({why})")
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="moetrain", description="DeepSeek-V3-style MoE pre-training")
    sub = ap.add_subparsers(dest="command", required=True)

    c = sub.add_parser("count", help="parameter counts and FLOPs per token of a preset or config file")
    c.add_argument("model", help="preset name, HF config.json, or job file")
    c.add_argument("--seq-len", type=int, default=4096)
    c.add_argument("--json", action="store_true")
    c.set_defaults(func=cmd_count)

    t = sub.add_parser("train", help="pre-train (default: tiny preset, built-in corpus, EP=2 over 2 workers)",
                       epilog="Every other setting: --set SECTION.FIELD=VALUE or a job file; `moetrain train "
                       "--help-config` lists every field with its type, default and meaning.")
    add_train_args(t)
    t.set_defaults(func=_cmd_train_or_help)

    pr = sub.add_parser("prepare", help="tokenise and shard a corpus into the data cache that train reuses "
                        "(prepare once, e.g. on shared storage before a multi-node run)",
                        description="Tokenise and shard the corpus of a job (training a BPE first unless --tokenizer "
                        "is given) into data.cache_dir, with a progress bar, and print the cache path. `moetrain "
                        "train` with the same model and data options finds it and skips the preparation.")
    add_job_args(pr)
    pr.set_defaults(func=cmd_prepare)

    e = sub.add_parser("export", help="write a run's checkpoint in the released HF layout (safetensors, index, "
                       "config.json, tokenizer.json), never gathering the whole model")
    e.add_argument("run_dir", help="the run directory (moetrain train --out)")
    e.add_argument("out_dir", help="the HF checkpoint directory to write (created atomically)")
    e.add_argument("--step", type=int, help="the checkpoint step (default: the newest complete one)")
    e.add_argument("--dtype", choices=["bf16", "fp32"], help="cast the weights (default: as trained, fp32)")
    e.add_argument("--overwrite", action="store_true", help="replace an existing out_dir")
    e.add_argument("--fp8", action="store_true", help="write the released FP8 layout: float8_e4m3fn weights with a "
                   "weight_scale_inv per 128x128 block, as DeepSeek-V3 ships (norms, router, embedding, head stay)")
    e.set_defaults(func=cmd_export)

    add_eval_sample_parsers(sub)

    p = sub.add_parser("plot", help="loss, learning rate and grad norm; expert load and share per MoE layer over steps (PNG)")
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
        from moetrain.train.rank0 import ThisRankOnly, is_rank0

        if args.command == "train" and not (is_rank0() or isinstance(e.__cause__, ThisRankOnly)):
            return 2  # under torchrun rank 0 meets the same error (the same job, or its own passed on) and prints it
        print(f"moetrain {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print(f"moetrain {args.command}: interrupted", file=sys.stderr)
        return 130
    except BrokenPipeError:
        from moetrain.plan.cli import quiet_broken_pipe

        quiet_broken_pipe()
        return 0
    except RuntimeError as e:
        if args.command not in ("train", "eval"):
            raise
        print(f"moetrain {args.command}: error: {e}", file=sys.stderr)
        return 1


if __name__ == "__main__":
    sys.exit(main())
