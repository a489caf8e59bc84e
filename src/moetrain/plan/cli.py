"""Command line of ``moetrain plan`` and ``moetrain bench`` (also ``python -m moetrain.plan``).

``add_plan_parser(subparsers)`` / ``add_bench_parser(subparsers)`` register the subcommands on the main
``moetrain`` parser; :func:`main` runs them standalone.

Without ``--ep`` (and without ``--record`` or ``--gpu local``) a single prediction is of the best plan that fits
the GPUs given (:func:`moetrain.plan.search.best_fitting`), and says so; with ``--ep`` it is the plan as given.

Exit codes: 0 success; 2 bad input (unknown GPU or model, invalid plan); 3 the plan does not fit in memory (without
``--ep``: no plan searched fits).
"""

from __future__ import annotations

import argparse
import json
import sys
from typing import Any

from moetrain.config import JobConfig, build_job_config
from moetrain.model.config import ModelConfig
from moetrain.plan.hardware import HardwareError, get_gpu, gpu_from_bench, load_gpu_file, with_overrides
from moetrain.plan.model import predict
from moetrain.plan.plan import Plan, PlanError
from moetrain.plan.records import RECORDS, Record, Role, get_record
from moetrain.plan.cli_args import OPTION_DEFAULTS, PLAN_FLAGS, add_plan_args
from moetrain.plan.local import local_plan
from moetrain.plan.measured import imbalance_from_run
from moetrain.plan.shape import ShapeError, load_shape


def add_plan_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``plan`` on the main ``moetrain`` sub-parsers."""
    p = subparsers.add_parser("plan", help="predict step time, TFLOP/s and memory of a training plan; --search, "
                              "--scale, --records",
                              description="Analytical performance model of MoE pre-training (docs/performance-model.md). A "
                              "single-plan prediction ends with its track record: the model's error on the published "
                              "validation runs on its GPU and of its model (docs/validation.md)")
    add_plan_args(p)
    p.set_defaults(func=cmd_plan)
    return p


def add_bench_parser(subparsers: Any) -> argparse.ArgumentParser:
    """Register ``bench`` on the main ``moetrain`` sub-parsers."""
    p = subparsers.add_parser("bench", help="measure this machine (matmul, memory, all-to-all) for `plan --gpu local`")
    p.add_argument("--out", help="JSON path (default .cache/moetrain/bench.json)")
    p.add_argument("--procs", type=int, default=2, help="local processes of the all-to-all test (default 2)")
    p.add_argument("--threads", type=int, help="threads per process (default cores // procs)")
    p.add_argument("--quick", action="store_true", help="fewer sizes, shorter timing")
    p.add_argument("--json", action="store_true", help="print the JSON")
    p.set_defaults(func=cmd_bench)
    return p


# ---- commands ---------------------------------------------------------------------------------------------------

def _resolve(args: argparse.Namespace) -> tuple[Any, Any, int, Plan, Record | None]:
    for f in args.gpu_file:
        load_gpu_file(f)
    rec = get_record(args.record) if args.record else None
    gpu_name = args.gpu or (rec.gpu if rec else "gb300")
    gpu = gpu_from_bench(args.bench_file) if gpu_name == "local" else get_gpu(gpu_name)
    # a `moetrain bench` machine defaults to the trainer's own run on it (model, data, batch, EP, processes)
    local = gpu.host_procs is not None
    shape = load_shape(args.model or (rec.model if rec else _trainer_preset() if local else "deepseek-v3-671b"))
    if args.nic_gbit is not None:
        gpu = with_overrides(gpu, nic_gbps=args.nic_gbit / 8)
    if args.nvlink_domain is not None:
        gpu = with_overrides(gpu, nvlink_domain=args.nvlink_domain)
    n = args.gpus if args.gpus is not None else (rec.n_gpus if rec else gpu.host_procs if local else 256)
    plan = rec.plan if rec else _builtin_job_plan(shape, n, args) if local else Plan()
    if args.imbalance_from is not None:
        if args.imbalance is not None:
            raise ValueError("--imbalance and --imbalance-from both give the imbalance; give one of them")
        args.imbalance = imbalance_from_run(args.imbalance_from, args.redundant_experts)
        args.routing = args.routing or "real"
    elif args.redundant_experts is not None:
        raise ValueError("--redundant-experts places copies on a run's measured loads; add --imbalance-from RUN_DIR")
    changes: dict[str, Any] = {}
    for flag, field, _ in PLAN_FLAGS:
        v = getattr(args, flag, None)
        if v is not None and not (flag == "framework" and args.search):
            changes[field] = v
    if args.recompute_modules:
        if args.recompute in ("full", "none"):
            raise ValueError(f"--recompute-modules names the modules of --recompute selective; with --recompute "
                             f"{args.recompute} drop --recompute-modules (or use --recompute selective)")
        changes["recompute_modules"] = tuple(x.strip() for x in args.recompute_modules.split(",") if x.strip())
        changes.setdefault("recompute", "selective")
    elif args.recompute in ("full", "none"):
        changes["recompute_modules"] = None
    for f in ("ep_overlap", "fp8_param", "dp_overlap", "fsdp", "fused_mlp"):
        if getattr(args, f, None) is not None:
            changes[f] = getattr(args, f)
    if rec and changes:
        # a record's DP and layout belong to its own sizes: re-derive them when the sizes change (a flag that
        # repeats the record's own value changes nothing)
        moved = {k for k, v in changes.items() if getattr(rec.plan, k) != v}
        if moved & {"tp", "pp", "cp"} and "dp" not in changes:
            changes["dp"] = None
        if moved & {"pp", "vpp", "schedule"} and "pp_layout" not in changes:
            changes["pp_layout"] = None
        # another framework's recipe takes that framework's defaults, under the flags given
        plan = plan.for_framework(changes.get("framework", plan.framework))
    if rec and args.gpus and args.gpus != rec.n_gpus and "dp" not in changes:
        changes["dp"] = None
    if changes:
        plan = plan.replace(**changes)
    if plan.ep_overlap and plan.ep > 1 and plan.pp == 1 and plan.overlap_schedule is None:
        print(f"moetrain plan: note: --ep-overlap pairs micro-batches, and this plan has "
              f"{plan.n_microbatches if plan.dp else 'one'} per step: nothing is hidden (raise --gbs)",
              file=sys.stderr)
    return shape, gpu, n, plan, rec


def _trainer_preset() -> str:
    """The model preset of `moetrain train`'s built-in job."""
    return JobConfig().preset


def _builtin_job_plan(shape: Any, n: int, args: argparse.Namespace | None = None) -> Plan:
    """The plan of `moetrain train`'s built-in job (data, batch and EP defaults) on ``n`` local processes, with the
    pipeline flags given (``--pp``, ``--vpp``, ``--schedule``, ``--pp-layout``) applied the way the trainer applies
    them (an unset micro-batch count becomes the schedule's minimum; an unset split the trainer's default, the
    planner's own), so the plan is the run ``moetrain train`` would do with the same flags."""
    pp = getattr(args, "pp", None) or 1
    parallel: dict[str, Any] = {}
    if pp > 1:
        given = {"pp": pp, "vpp": getattr(args, "vpp", None), "schedule": getattr(args, "schedule", None),
                 "pp_layout": getattr(args, "pp_layout", None)}
        parallel = {k: v for k, v in given.items() if v is not None}
    job = build_job_config({"parallel": parallel})
    cfg = shape.config
    layout = job.parallel.pp_layout
    own_model = isinstance(cfg, ModelConfig)  # a moetrain model (not a GQA accounting shape)
    if pp > 1 and layout is None and own_model:
        from moetrain.parallel.pipeline import default_layout
        layout = default_layout(cfg, job.parallel.n_stages)  # the trainer's split where the planner has none
    stage = n // pp
    ep = job.parallel.ep if stage % job.parallel.ep == 0 and shape.n_experts % job.parallel.ep == 0 else 1
    plan = local_plan(cfg if own_model else job.model, job.data.seq_len, job.train.micro_batch_size,
                      job.train.grad_accum, world=n, ep=ep, pp=pp, vpp=job.parallel.vpp,
                      schedule=job.parallel.schedule, pp_layout=layout)
    return plan if own_model else plan.replace(routing="real")


def _said_chart(args: argparse.Namespace) -> None:
    """Name the chart just written (not under --json, whose stdout is the JSON alone)."""
    if not args.json:
        print(f"chart: {args.png}")


def _record_vs(rec: Record, pred: Any) -> dict[str, Any]:
    """A record's published figure beside a prediction of its plan: the JSON of --records and --record."""
    return {"key": rec.key, "source": rec.source, "published_tflops_per_gpu": rec.tflops_per_gpu,
            "error": pred.tflops_per_gpu / rec.tflops_per_gpu - 1 if pred.fits else None,
            "band": list(rec.band), "in_band": bool(pred.fits and rec.in_band(pred.tflops_per_gpu)),
            "role": str(rec.role), "role_meaning": rec.role.meaning}


def _emit_json(obj: Any, args: argparse.Namespace) -> None:
    from moetrain.plan.report import to_json

    text = to_json(obj, args.json_out)
    if args.json:
        print(text)


_PNG_SUFFIXES = (".png", ".pdf", ".svg", ".jpg", ".jpeg")


def _check_args(args: argparse.Namespace) -> None:
    """Input errors that need no model: one mode at a time, positive counts, a chart path matplotlib can write.
    Raises ValueError naming the flag and the fix."""
    from pathlib import Path

    modes = [m for m, on in (("--records", args.records), ("--validate", args.validate),
                             ("--compare", args.compare), ("--search", args.search), ("--scale", args.scale)) if on]
    if len(modes) > 1:
        raise ValueError(f"{' and '.join(modes)} are separate modes; give one of them per run")
    for flag, v, low in (("--gpus", args.gpus, 1), ("--top", args.top, 1), ("--nvlink-domain", args.nvlink_domain, 1)):
        if v is not None and v < low:
            raise ValueError(f"{flag} {v}: must be >= {low}")
    for flag, v in (("--nic-gbit", args.nic_gbit), ("--tokens", args.tokens)):
        if v is not None and not v > 0:
            raise ValueError(f"{flag} {v:g}: must be > 0")
    if args.png:
        out = Path(args.png)
        if out.is_dir():
            raise ValueError(f"--png {args.png} is a directory; give a file name, e.g. {out / 'plan.png'}")
        if out.suffix == "":
            args.png = str(out.with_suffix(".png"))
        elif out.suffix.lower() not in _PNG_SUFFIXES:
            raise ValueError(f"--png {args.png}: unknown image type {out.suffix!r}; use one of {list(_PNG_SUFFIXES)}")


def cmd_plan(args: argparse.Namespace) -> int:
    from moetrain.plan import report

    try:
        _check_args(args)
        if args.records or args.validate:
            _refuse_flags(args, "--records" if args.records else "--validate")
            return _cmd_records(args) if args.records else _cmd_validate(args)
        if args.compare:
            _refuse_flags(args, "--compare")
            return _cmd_compare(args)
        shape, gpu, n, plan, rec = _resolve(args)
        if (args.scale or args.search) and gpu.host_procs is not None:
            raise ValueError("--search and --scale plan GPU clusters; on --gpu local predict one run (the trainer "
                             "runs data + expert parallelism only), e.g. `moetrain plan --gpu local --ep 1`")
        if args.scale or args.search:
            # the plan the search starts from (or the scale keeps) must be valid: an invalid one is an input error,
            # not a baseline to drop
            from moetrain.plan.plan import validate

            validate(plan.replace(dp=None), shape, gpu, n)
        if args.scale:
            return _cmd_scale(args, shape, gpu, n, plan)
        if args.search:
            return _cmd_search(args, shape, gpu, n, plan, rec)
        if args.framework:
            from moetrain.plan.search import framework_conflicts

            bad = framework_conflicts(plan, plan.framework)
            if bad:
                other = rec.plan.framework if rec else "megatron"
                raise ValueError(f"--framework {plan.framework} does not run this plan: {'; '.join(bad)}; change "
                                 f"those settings" + (f", or drop --framework to cost the plan as {other} runs it"
                                                      if other != plan.framework else ""))
        chosen = _choose_ep(args, shape, gpu, n, plan) if args.ep is None and rec is None and \
            gpu.host_procs is None else None
        if chosen is not None and chosen[0] is not None:
            pred = chosen[0]
        elif gpu.generation == "cpu":
            from moetrain.plan.local import predict_measured

            pred = predict_measured(shape, gpu, n, plan)
        else:
            pred = predict(shape, gpu, n, plan)
    except (PlanError, HardwareError, ShapeError, ValueError, KeyError) as e:
        print(f"moetrain plan: error: {e}", file=sys.stderr)
        return 2
    overrides = _overrides(args, rec) if rec else []
    from moetrain.plan.validation import track_record

    track = (track_record(gpu, pred.plan.resolved_cuda_graphs, pred.model)
             if pred.fits and gpu.generation != "cpu" else None)
    chose = report.chosen_words(chosen, n, gpu.name) if chosen is not None else None
    if args.json or args.json_out:
        out: Any = {**pred.to_dict(), "track_record": track}
        if chose is not None:
            out["chosen"] = chose
        if rec:
            vs = _record_vs(rec, pred)
            if overrides:  # the band is the record's own plan's
                vs.update(band=None, in_band=None)
            out["record"] = {**vs, "overrides": overrides}
        _emit_json(out, args)
    if not args.json:
        if chose is not None:
            print(f"moetrain plan: {chose['words']}", file=sys.stdout if chose["found"] else sys.stderr)
        report.print_prediction(pred, rec, overrides=overrides)
        if track is not None:
            print(_track_words(track, gpu.name, pred.model))
    if args.png:
        report.plot_breakdown([pred], args.png, published=[rec.tflops_per_gpu] if rec else None,
                              published_note=", the record's own plan" if overrides else "")
        _said_chart(args)
    return 0 if pred.fits else 3


def _given_fields(args: argparse.Namespace) -> list[str]:
    """The Plan fields the command line set (a chosen plan keeps them)."""
    given = [field for flag, field, _ in PLAN_FLAGS if getattr(args, flag, None) is not None]
    given += [f for f in ("ep_overlap", "fp8_param", "dp_overlap", "fsdp", "fused_mlp") if getattr(args, f) is not None]
    return given + (["recompute_modules"] if args.recompute_modules else [])


def _choose_ep(args: argparse.Namespace, shape: Any, gpu: Any, n: int, plan: Plan) -> tuple[Any, Any]:
    """``moetrain plan`` without ``--ep``: the best plan that fits (``search.best_fitting``: EP, PP, VPP, schedule
    and recompute searched, TP, CP, micro-batch and every flag given kept). Returns ``(prediction or None, search)``.

    Raises:
        PlanError: the plan as given is invalid on this cluster (before any search).
    """
    from moetrain.plan.plan import validate
    from moetrain.plan.search import best_fitting

    checked = plan.replace(dp=None)
    if args.pp is None:
        # the search picks PP and with it DP: whether the global batch splits over DP x micro-batch is asked of
        # each candidate (a record's 15,360 sequences on 2,048 GPUs split at PP 16, not at PP 1)
        checked = checked.replace(global_batch=n * plan.micro_batch)
    validate(checked, shape, gpu, n)
    return best_fitting(shape, gpu, n, plan, _given_fields(args))


def _overrides(args: argparse.Namespace, rec: Record | None = None) -> list[str]:
    """The flags given on top of ``--record`` whose value differs from the record's (what makes this plan differ
    from the published one; a flag that repeats the record's own value is not an override). Without ``rec``:
    every plan or cluster flag given."""
    own: dict[str, Any] = {}
    if rec is not None:
        own = {f: getattr(rec.plan, f) for f in Plan.__dataclass_fields__}
        own.update(gpus=rec.n_gpus, gpu=rec.gpu, model=rec.model,
                   recompute_modules=",".join(rec.plan.recompute_modules or ()) or None)
    out = []
    for flag, field, _ in PLAN_FLAGS:
        v = getattr(args, flag, None)
        if v is not None and (field not in own or own[field] != v):
            out.append(f"--{flag.replace('_', '-')} {v}")
    for f in ("recompute_modules", "ep_overlap", "fp8_param", "dp_overlap", "fsdp", "fused_mlp", "gpus", "gpu",
              "model", "nic_gbit", "nvlink_domain", "gpu_file"):
        v = getattr(args, f, None)
        same = f in own and (own[f] == v or (f == "gpu" and str(v).strip().lower() == str(own[f]).lower()))
        if v is not None and v != [] and not same:
            out.append(f"--{f.replace('_', '-')} {v}")
    return out


def _refuse_flags(args: argparse.Namespace, mode: str) -> None:
    """``--records`` / ``--validate`` / ``--compare`` predict published rows with their own plans: a plan or cluster
    flag would be silently ignored, so it is refused."""
    given = [o.split()[0] for o in _overrides(args)]
    if args.record:
        given.append("--record")
    if args.any_framework:
        given.append("--any-framework")
    given += [f"--{k.replace('_', '-')}" for k, d in OPTION_DEFAULTS.items() if getattr(args, k) != d]
    if given:
        raise ValueError(f"{mode} predicts each published row with its own plan and would ignore "
                         f"{', '.join(sorted(set(given)))}; drop them, or use --record KEY with overrides")


def _track_words(track: dict[str, Any], gpu: str, model: str) -> str:
    """One line on the model's error on the validation runs most like a plan (``validation.track_record``)."""
    def errs(d: dict[str, Any]) -> str:
        return (f"mean {d['mean_signed_error']:+.0%}, median {d['median_error']:+.0%}, range {d['min_error']:+.0%} "
                f"to {d['max_error']:+.0%}")

    g, m = track["gpu"], track["model"]
    parts = [f"{g['group']}: {errs(g)}" + (f" (they ran on the catalogue {g['gpu'].upper()}; this GPU is changed)"
                                           if g["modified"] else "")] if g else [f"no run on {gpu.upper()}"]
    parts.append(f"{m['points']} {m['model']} runs on any GPU: {errs(m)}" if m else f"no run of {model}")
    return ("track record on validation runs (published, never calibrated on; predicted / published - 1, + is too "
            "high): " + "; ".join(parts) + " (docs/validation.md)")


def _cmd_validate(args: argparse.Namespace) -> int:
    from moetrain.plan import report, validation

    rows = validation.run()
    summ = validation.summary(rows)
    if args.json or args.json_out:
        _emit_json({"summary": summ, "points": [
            {"key": r.point.key, "source": r.point.source, "model": r.point.model, "gpu": r.point.gpu,
             "n_gpus": r.point.n_gpus, "plan": (r.prediction.plan if r.prediction else r.point.plan).short(),
             "published_tflops_per_gpu": r.point.tflops_per_gpu,
             "predicted_tflops_per_gpu": r.predicted, "error": r.error, "note": r.point.note,
             "published_tokens_per_s_per_gpu": r.point.tokens_per_s_per_gpu,
             "predicted_tokens_per_s_per_gpu": r.prediction.tokens_per_s_per_gpu if r.prediction else None,
             "message": r.message} for r in rows]}, args)
    if not args.json:
        report._console().print(report.validation_table(rows, summ))
        if summ["mae_consistent_rows"] is not None and summ["mae_consistent_rows"] != summ["mae"]:
            print(f"MAE without source rows whose tok/s and TFLOP/s disagree: {summ['mae_consistent_rows']:.1%}")
        for rel, b in summ["by_release"].items():
            if b["mae"] is not None:
                print(f"release or source {rel}: {b['predicted']} of {b['points']} points, MAE {b['mae']:.1%}, "
                      f"largest {b['max_abs_error']:.1%}, mean signed {b['mean_signed_error']:+.1%}")
        for name, groups in summ["by_group"].items():
            print(f"by {name.replace('_', ' ')}: " + "; ".join(
                f"{g} {b['predicted']} points MAE {b['mae']:.1%} (signed {b['mean_signed_error']:+.1%})"
                for g, b in groups.items() if b["mae"] is not None))
        if summ["repeats_bound"]:
            rep, b = summ["repeats"], summ["repeats_bound"]
            print(f"one plan published more than once (only the release differs): {b['groups']} groups, "
                  f"{b['points']} points, spread up to {rep[0]['spread']:.1%} ({' / '.join(rep[0]['keys'])}); one "
                  f"prediction per plan can at best reach an MAE of {b['best_mae']:.1%} on them (the model: "
                  f"{b['model_mae']:.1%})")
        print(f"mean signed error {summ['mean_signed_error']:+.1%}; goal "
              f"{'met' if summ['goal_met'] else 'NOT met'} (MAE <= {summ['mae_goal']:.0%}, none beyond "
              f"{summ['max_goal']:.0%}); no constant is fitted to these points (docs/validation.md)")
    if args.png:
        fit = [r for r in rows if r.prediction is not None and r.prediction.fits]
        report.plot_breakdown([r.prediction for r in fit], args.png, labels=[r.point.key for r in fit],
                              published=[r.point.tflops_per_gpu for r in fit])
        _said_chart(args)
    return 0


def _run_by_key(key: str) -> tuple[Any, str]:
    """A record or validation point predicted with its own plan."""
    from moetrain.plan import validation

    k = key.lower()
    if k in RECORDS:
        r = RECORDS[k]
        return predict(r.model, r.gpu, r.n_gpus, r.plan), f"{k} ({r.n_gpus} {r.gpu.upper()})"
    for pt in validation.POINTS:
        if pt.key == k:
            return (predict(validation.model_shape(pt.model), pt.gpu, pt.n_gpus, pt.plan),
                    f"{k} ({pt.n_gpus} {pt.gpu.upper()})")
    raise ValueError(f"unknown run {key!r}; records: {sorted(RECORDS)}; validation points: "
                   f"{[p.key for p in validation.POINTS]}")


def _cmd_compare(args: argparse.Namespace) -> int:
    from moetrain.plan import report

    (a, la), (b, lb) = _run_by_key(args.compare[0]), _run_by_key(args.compare[1])
    for p, lab in ((a, la), (b, lb)):
        if not p.fits:
            raise ValueError(f"{lab} does not fit: {p.message}")
    if args.json or args.json_out:
        _emit_json({"a": {"label": la, "breakdown_s": report.breakdown_rows(a), "prediction": a.to_dict()},
                    "b": {"label": lb, "breakdown_s": report.breakdown_rows(b), "prediction": b.to_dict()}}, args)
    if not args.json:
        c = report._console()
        c.print(f"A: {la}: {a.plan.short()}")
        c.print(f"B: {lb}: {b.plan.short()}")
        c.print(report.compare_table(a, b, "A", "B"))
        c.print(report.compare_summary(a, b, "A", "B"))
    if args.png:
        report.plot_breakdown([a, b], args.png, labels=[la, lb])
        _said_chart(args)
    return 0


def _cmd_records(args: argparse.Namespace) -> int:
    from moetrain.plan import report, validation

    rows = [(r, predict(r.model, r.gpu, r.n_gpus, r.plan)) for r in RECORDS.values()]
    # beside the calibration rows, the held-out published runs of the same model (its validation points)
    models = {r.model for r in RECORDS.values()}
    held = validation.run(tuple(pt for pt in validation.POINTS if pt.model in models))
    if args.json or args.json_out:
        _emit_json({"records": [{**_record_vs(r, p), "gpu": r.gpu, "n_gpus": r.n_gpus, "plan": r.plan.short(),
                                 "predicted_tflops_per_gpu": p.tflops_per_gpu, "fits": p.fits,
                                 "tolerance": r.tolerance, "step_s": p.step.to_dict() if p.step else None}
                                for r, p in rows],
                    "held_out": [report.held_out_json(h) for h in held],
                    "roles": {str(k): k.meaning for k in Role}}, args)
    if not args.json:
        report._console().print(report.records_table(rows, held))
    if args.png:
        report.plot_breakdown([p for _, p in rows], args.png,
                              labels=[f"{r.n_gpus} {r.gpu.upper()} ({r.source})" for r, _ in rows],
                              published=[r.tflops_per_gpu for r, _ in rows])
        _said_chart(args)
    return 0


def _cmd_search(args: argparse.Namespace, shape: Any, gpu: Any, n: int, plan: Plan, rec: Record | None = None) -> int:
    from moetrain.plan import report
    from moetrain.plan.search import search

    res = search(shape, gpu, n, plan, framework=None if args.any_framework else (args.framework or "plan"))
    if args.json or args.json_out:
        _emit_json(res, args)
    if not args.json:
        report.print_search(res, n=args.top)
    if args.png and res.ranked:
        ranked = res.ranked[: max(1, args.top)]
        preds = ([res.baseline] if res.baseline is not None else []) + ranked
        labels = (["baseline"] if res.baseline is not None else []) + [f"#{i}" for i in range(1, len(ranked) + 1)]
        report.plot_breakdown(preds, args.png, labels=labels)
        _said_chart(args)
    return 0 if res.best is not None else 3


def _cmd_scale(args: argparse.Namespace, shape: Any, gpu: Any, n: int, plan: Plan) -> int:
    from moetrain.plan import report
    from moetrain.plan.search import parse_counts, scale

    counts = parse_counts(args.scale)
    pts = scale(shape, gpu, counts, plan, mode=args.scale_mode, batch=args.scale_batch, base_gpus=n)
    if args.json or args.json_out:
        _emit_json({"model": shape.name, "gpu": gpu.name, "tokens": args.tokens,
                    "points": [pt.to_dict(args.tokens) for pt in pts]}, args)
    if not args.json:
        report._console().print(report.scale_table(pts, args.tokens))
    if args.png:
        report.plot_scale(pts, args.png, args.tokens,
                          title=f"{shape.name} on {gpu.name.upper()}: global batch {plan.global_batch} x "
                                f"{plan.seq_len} ({args.scale_batch}), plan {args.scale_mode}")
        _said_chart(args)
    if not any(pt.prediction is not None and pt.prediction.fits for pt in pts):
        print("moetrain plan: no GPU count has a valid plan that fits (each row says why)", file=sys.stderr)
        return 3
    return 0


def cmd_bench(args: argparse.Namespace) -> int:
    from moetrain.plan.bench import run_bench, summary

    res = run_bench(args.out, procs=args.procs, quick=args.quick, threads=args.threads, verbose=not args.json)
    if args.json:
        print(json.dumps(res, indent=2))
    else:
        print(summary(res))
    return 0


def build_parser() -> argparse.ArgumentParser:
    ap = argparse.ArgumentParser(prog="python -m moetrain.plan", description="moetrain plan / bench")
    sub = ap.add_subparsers(dest="command", required=True)
    add_plan_parser(sub)
    add_bench_parser(sub)
    return ap


def main(argv: list[str] | None = None) -> int:
    """Standalone entry: ``python -m moetrain.plan plan ...`` or ``python -m moetrain.plan bench``; a first
    argument that is a flag means ``plan``."""
    argv = list(sys.argv[1:] if argv is None else argv)
    if not argv or argv[0].startswith("-"):
        argv = ["plan"] + argv
    args = build_parser().parse_args(argv)
    try:
        return int(args.func(args) or 0)
    except BrokenPipeError:
        quiet_broken_pipe()
        return 0


def quiet_broken_pipe() -> None:
    """A reader that stops early (``| head``) closes stdout: exit quietly, not with a traceback."""
    import os

    devnull = os.open(os.devnull, os.O_WRONLY)
    os.dup2(devnull, sys.stdout.fileno())

