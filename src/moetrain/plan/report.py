"""Output of the performance model: tables (rich), JSON, and PNG charts (matplotlib, headless)."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any, Sequence

from moetrain.plan.constants import all_constants
from moetrain.plan.model import Prediction
from moetrain.plan.records import Record, Role
from moetrain.plan.search import ScalePoint, SearchResult

BREAKDOWN = (("compute", "compute"), ("exposed_a2a", "exposed all-to-all"), ("other_comm", "other communication"),
             ("bubble", "pipeline bubble"), ("optimizer", "optimizer step"))
COLORS = {"compute": "#4C72B0", "exposed_a2a": "#DD8452", "other_comm": "#55A868", "bubble": "#C44E52",
          "optimizer": "#8172B3"}


def _num(x: float, unit: str = "") -> str:
    """1,648.0 for large numbers, 4 significant digits for small ones (CPU runs)."""
    s = f"{x:,.1f}" if abs(x) >= 100 else f"{x:.4g}"
    return s + unit


def _console(file: Any = None):
    from rich.console import Console

    return Console(file=file, width=120, highlight=False)


def prediction_table(pred: Prediction, record: Record | None = None, overrides: Sequence[str] = ()):
    """A rich Table with the step breakdown, throughput and memory of one prediction."""
    from rich.table import Table

    t = Table(title=f"{pred.model} on {pred.n_gpus} x {pred.gpu.upper()}: {pred.plan.short()}", show_lines=False,
              title_justify="left")
    t.add_column("quantity")
    t.add_column("value", justify="right")
    t.add_column("note")
    if not pred.fits:
        t.add_row("fits in memory", "[bold red]NO[/]", pred.message)
    elif pred.step is not None:
        step = pred.step.step
        for key, label in BREAKDOWN:
            v = getattr(pred.step, key)
            note = f"{v / step:6.1%}"
            if key == "compute" and pred.step.compute_parts:
                note += "  (" + ", ".join(f"{k} {x / step:.0%}" for k, x in pred.step.compute_parts.items()
                                          if x > 0.0005 * step) + ")"
            t.add_row(f"  {label}", f"{v:.3f} s", note)
        t.add_row("step time", f"{step:.3f} s", f"{pred.plan.n_microbatches} micro-batches per pipeline")
        t.add_row("tokens/s per GPU", _num(pred.tokens_per_s_per_gpu), "")
        t.add_row("TFLOP/s per GPU", _num(pred.tflops_per_gpu),
                  f"{_num(pred.flops_per_token / 1e9)} GFLOP/token (Megatron accounting)")
        t.add_row("MFU", f"{pred.mfu:.1%}", f"of the {pred.plan.precision} peak ({pred.mfu_bf16:.1%} of BF16)")
        if record is not None:
            err = pred.tflops_per_gpu / record.tflops_per_gpu - 1
            lo, hi = record.band
            if overrides:
                t.add_row("published", f"{record.tflops_per_gpu:,.0f}",
                          f"{record.source}, the record's own plan, for comparison: this plan differs by "
                          f"{', '.join(overrides)} ({err:+.1%} against it)")
            else:
                ok = record.in_band(pred.tflops_per_gpu)
                t.add_row("published", f"{record.tflops_per_gpu:,.0f}",
                          f"{record.source}: error {err:+.1%} ({'within' if ok else 'OUTSIDE'} the band "
                          f"[{lo:,.0f}, {hi:,.0f}])")
            t.add_row("role", str(record.role), record.role.meaning)
    m = pred.memory
    t.add_row("memory per GPU", f"{m.total:.1f} GiB",
              f"of {pred.memory_limit_gib:.0f}: weights {m.weights:.1f} + FP8 copies {m.fp8_weights:.1f} + grads "
              f"{m.gradients:.1f} + optimizer {m.optimizer:.1f} + activations {m.activations:.1f} + reserved "
              f"{m.reserved:.1f} (pipeline rank {m.device})")
    if pred.fits and pred.message:
        t.add_row("note", "", pred.message)
    return t


def print_prediction(pred: Prediction, record: Record | None = None, file: Any = None,
                     overrides: Sequence[str] = ()) -> None:
    c = _console(file)
    c.print(prediction_table(pred, record, overrides))
    if pred.fits:
        c.print("stages: " + " | ".join(pred.details.get("stages", [])))


def records_table(rows: Sequence[tuple[Record, Prediction]], held_out: Sequence[Any] = ()):
    """Predicted vs published for the rows of docs/reference.md section 4 (the calibration rows), then the held-out
    rows of the same model (``held_out``: :class:`moetrain.plan.validation.Row`), each row's role in its own
    column."""
    from rich.table import Table

    title = "Predicted vs published DeepSeek-V3 throughput (one set of constants)"
    if held_out:
        title += (f": {len(rows)} calibration rows (the constants were set while comparing with them), "
                  f"{len(held_out)} held out (never compared with while the model was built)")
    t = Table(title=title, title_justify="left")
    for col, just in (("role", "left"), ("source", "left"), ("GPUs", "right"), ("plan", "left"),
                      ("published TFLOP/s", "right"), ("predicted", "right"), ("error", "right"),
                      ("tolerance", "right"), ("memory GiB", "right")):
        t.add_column(col, justify=just)
    for r, p in rows:
        lo, hi = r.band
        band = f"[{lo:,.0f}, {hi:,.0f}]"
        if p.fits:
            err = p.tflops_per_gpu / r.tflops_per_gpu - 1
            ok = r.in_band(p.tflops_per_gpu)
            t.add_row(str(r.role), r.source, f"{r.n_gpus} {r.gpu.upper()}",
                      f"TP{r.plan.tp}/PP{r.plan.pp}/VPP{r.plan.vpp}/EP{r.plan.ep}",
                      f"{r.tflops_per_gpu:,.0f}", f"{p.tflops_per_gpu:,.0f}",
                      f"[{'green' if ok else 'red'}]{err:+.1%}[/]", band,
                      f"{p.memory.total:.0f}/{p.memory_limit_gib:g}")
        else:
            t.add_row(str(r.role), r.source, f"{r.n_gpus} {r.gpu.upper()}", "", f"{r.tflops_per_gpu:,.0f}",
                      "does not fit", "", band, f"{p.memory.total:.0f}/{p.memory_limit_gib:g}")
    for row in held_out:
        pt, p = row.point, row.prediction
        plan = p.plan if p is not None else pt.plan
        t.add_row(str(Role.HELD_OUT), pt.source, f"{pt.n_gpus} {pt.gpu.upper()}",
                  f"TP{plan.tp}/PP{plan.pp}/VPP{plan.vpp}/EP{plan.ep}", f"{pt.tflops_per_gpu:,.0f}",
                  f"{row.predicted:,.0f}" if row.predicted is not None else "does not fit",
                  f"{row.error:+.1%}" if row.error is not None else "", "-",
                  f"{p.memory.total:.0f}/{p.memory_limit_gib:g}" if p is not None else "")
    return t


def held_out_json(h: Any) -> dict[str, Any]:
    """A held-out validation row (``validation.Row``) in the JSON of ``--records``."""
    pt = h.point
    return {"key": pt.key, "source": pt.source, "model": pt.model, "gpu": pt.gpu, "n_gpus": pt.n_gpus,
            "plan": (h.prediction.plan if h.prediction else pt.plan).short(),
            "published_tflops_per_gpu": pt.tflops_per_gpu, "predicted_tflops_per_gpu": h.predicted,
            "error": h.error, "fits": h.predicted is not None, "role": str(Role.HELD_OUT)}


def chosen_words(chosen: tuple[Any, Any], n: int, gpu: str) -> dict[str, Any]:
    """What ``moetrain plan`` without ``--ep`` chose, and how: a line and its JSON record."""
    best, res = chosen
    base = res.baseline.plan if res.baseline is not None else None
    kept = (f"TP {base.tp}, CP {base.cp}, micro-batch {base.micro_batch}" if base else "TP, CP, micro-batch") + \
        " and the flags given kept"
    if best is None:
        words = (f"no --ep given, and no plan for {n} {gpu.upper()} fits (of {res.evaluated} predicted over EP, PP, "
                 f"VPP, schedule and recompute; {kept}); the plan as given, at EP 1, follows")
    else:
        words = (f"no --ep given: the best plan that fits {n} {gpu.upper()}, {best.plan.short()} (by predicted "
                 f"TFLOP/s per GPU; {len(res.ranked)} of {res.evaluated} plans predicted fit: EP, PP, VPP, schedule "
                 f"and recompute searched, {kept}); --ep N predicts one EP, --search ranks the others")
    return {"found": best is not None, "searched": "ep, pp, vpp, schedule, recompute", "fitting": len(res.ranked),
            "evaluated": res.evaluated, "restriction": res.restriction, "words": words}


def breakdown_rows(pred: Prediction) -> dict[str, float]:
    """Seconds per step by mechanism: the compute classes, exposed all-to-all, other communication, bubble,
    optimizer (the parts sum to the step)."""
    st = pred.step
    if st is None:
        return {}
    out = {f"compute: {k}": v for k, v in st.compute_parts.items()}
    out.update({"exposed all-to-all": st.exposed_a2a, "other communication": st.other_comm,
                "pipeline bubble": st.bubble, "optimizer step": st.optimizer})
    return out


def compare_table(a: Prediction, b: Prediction, label_a: str, label_b: str):
    """Two predictions side by side, per mechanism: share of the step and seconds per 1e6 tokens on one GPU, so the
    mechanism that makes the difference shows as the largest entry of the last column."""
    from rich.table import Table

    t = Table(title=f"{label_a} against {label_b} (seconds per million tokens per GPU)", title_justify="left")
    for col, just in (("mechanism", "left"), (label_a, "right"), ("share", "right"), (label_b, "right"),
                      ("share", "right"), (f"{label_a} - {label_b}", "right")):
        t.add_column(col, justify=just)
    ra, rb = breakdown_rows(a), breakdown_rows(b)

    def per_mtok(p: Prediction, v: float) -> float:
        return v / (p.plan.tokens_per_step / p.n_gpus) * 1e6

    def signed(x: float) -> str:
        return f"{x:+.3f}" if round(x, 3) else "0.000"  # no "-0.000" for a difference that rounds away

    for k in ra:
        va, vb = per_mtok(a, ra[k]), per_mtok(b, rb.get(k, 0.0))
        t.add_row(k, f"{va:.3f}", f"{ra[k] / a.step.step:.1%}", f"{vb:.3f}", f"{rb.get(k, 0.0) / b.step.step:.1%}",
                  signed(va - vb))
    t.add_row("step", f"{per_mtok(a, a.step.step):.3f}", "", f"{per_mtok(b, b.step.step):.3f}", "",
              signed(per_mtok(a, a.step.step) - per_mtok(b, b.step.step)))
    t.add_row("TFLOP/s per GPU", f"{a.tflops_per_gpu:,.0f}", "", f"{b.tflops_per_gpu:,.0f}", "", "")
    return t


def compare_summary(a: Prediction, b: Prediction, label_a: str, label_b: str) -> str:
    """One line naming the mechanisms that make most of the difference in time per token."""
    ra, rb = breakdown_rows(a), breakdown_rows(b)
    ta, tb = a.plan.tokens_per_step / a.n_gpus, b.plan.tokens_per_step / b.n_gpus
    diffs = sorted(((ra[k] / ta - rb.get(k, 0.0) / tb, k) for k in ra), key=lambda x: -abs(x[0]))
    total = a.step.step / ta - b.step.step / tb
    # a mechanism's share is positive where it works for the faster run, negative where against it
    parts = [f"{k} {d / total:+.0%}" if total else k for d, k in diffs[:3]]
    faster = label_b if total > 0 else label_a
    return (f"{faster} is faster per token by {abs(total) / max(a.step.step / ta, b.step.step / tb):.1%}; "
            f"largest differences (share of the gap): " + ", ".join(parts))


def validation_table(rows: Sequence[Any], summary: dict[str, Any]):
    """Predicted against published for the validation set (moetrain.plan.validation)."""
    from rich.table import Table

    t = Table(title=(f"Validation: {summary['predicted']} of {summary['points']} published points predicted, "
                     f"MAE {summary['mae']:.1%} (goal <= {summary['mae_goal']:.0%}), largest "
                     f"{summary['max_abs_error']:.1%} (goal <= {summary['max_goal']:.0%})")
              if summary["mae"] is not None else "Validation: nothing predicted", title_justify="left")
    for col, just in (("point", "left"), ("source", "left"), ("GPUs", "right"), ("plan", "left"),
                      ("published", "right"), ("predicted", "right"), ("error", "right")):
        t.add_column(col, justify=just)
    for r in rows:
        pt = r.point
        pl = pt.plan
        desc = (f"TP{pl.tp}/PP{pl.pp}/VPP{pl.vpp}/EP{pl.ep} mbs{pl.micro_batch} gbs{pl.global_batch} {pl.precision} "
                f"{pl.resolved_dispatcher}{' ovl' if pl.ep_overlap else ''} graphs-{pl.resolved_cuda_graphs}"
                f"{' fused-mlp' if pl.fused_mlp else ''}"
                f"{' framework-' + pl.framework if pl.framework != 'megatron' else ''}")
        # a source that publishes tokens/s is compared in tokens/s (its TFLOP/s is derived, Megatron's formula)
        tok = pt.tokens_per_s_per_gpu
        published = f"{pt.tflops_per_gpu:,.0f}" + (f" ({tok:,.0f} tok/s)" if tok else "")
        if r.error is None:
            t.add_row(pt.key, pt.source, f"{pt.n_gpus} {pt.gpu.upper()}", desc, published,
                      "does not fit" if r.prediction is not None else "invalid", "")
        else:
            col = "green" if abs(r.error) <= 0.12 else "yellow" if abs(r.error) <= 0.25 else "red"
            pred = f"{r.predicted:,.0f}" + (f" ({r.prediction.tokens_per_s_per_gpu:,.0f} tok/s)" if tok else "")
            t.add_row(pt.key, pt.source, f"{pt.n_gpus} {pt.gpu.upper()}", desc, published, pred,
                      f"[{col}]{r.error:+.1%}[/]")
    return t


def search_table(res: SearchResult, n: int = 10):
    from rich.table import Table

    t = Table(title=f"Best plans (of {res.evaluated} predicted; {res.not_fitting} did not fit, {res.invalid} invalid)",
              title_justify="left")
    for col, just in (("#", "right"), ("plan", "left"), ("TFLOP/s/GPU", "right"), ("tok/s/GPU", "right"),
                      ("memory GiB", "right"), ("compute", "right"), ("a2a", "right"), ("comm", "right"),
                      ("bubble", "right")):
        t.add_column(col, justify=just)

    def shares(p: Prediction) -> list[str]:
        st = p.step
        return [f"{v / st.step:.0%}" for v in (st.compute, st.exposed_a2a, st.other_comm, st.bubble)]

    b = res.baseline
    if b is not None and b.fits and b.step is not None:
        t.add_row("base", b.plan.short(), f"{b.tflops_per_gpu:,.1f}", f"{b.tokens_per_s_per_gpu:,.0f}",
                  f"{b.memory.total:.0f}/{b.memory_limit_gib:g}", *shares(b))
    for i, p in enumerate(res.ranked[:n], 1):
        t.add_row(str(i), p.plan.short(), f"{p.tflops_per_gpu:,.1f}", f"{p.tokens_per_s_per_gpu:,.0f}",
                  f"{p.memory.total:.0f}/{p.memory_limit_gib:g}", *shares(p))
    return t


def print_search(res: SearchResult, file: Any = None, n: int = 10) -> None:
    c = _console(file)
    c.print(search_table(res, n))
    if res.baseline is not None:
        b = res.baseline
        if b.fits:
            c.print(f"baseline: {b.plan.short()} -> {b.tflops_per_gpu:,.1f} TFLOP/s/GPU")
        else:
            c.print(f"baseline: {b.plan.short()} -> does not fit ({b.message})")
    elif res.baseline_error:
        c.print(f"baseline plan is invalid: {res.baseline_error}")
    if res.best is None:
        c.print("[bold red]no plan fits[/]")
        return
    g = res.gain()
    c.print(f"best:     {res.best.plan.short()} -> {res.best.tflops_per_gpu:,.1f} TFLOP/s/GPU"
            + (f" ({g - 1:+.1%} vs baseline)" if g else ""))
    ch = res.changes()
    c.print("changed:  " + ("; ".join(ch) if ch else "nothing (the baseline is the best plan found)"
                            if res.baseline is not None else "(no valid baseline to compare with)"))
    if res.framework:
        c.print(f"searched: plans {res.framework} runs ({res.restriction})")
    b = res.baseline
    if b is not None and b.fits and b.step is not None and res.best.step is not None and ch:
        c.print(compare_table(res.best, b, "best", "baseline"))
        c.print("why:      " + compare_summary(res.best, b, "best", "baseline"))


def scale_table(points: Sequence[ScalePoint], tokens: float):
    from rich.table import Table

    t = Table(title=f"Scaling (time to train {tokens / 1e12:g}T tokens)", title_justify="left")
    for col, just in (("GPUs", "right"), ("plan", "left"), ("TFLOP/s/GPU", "right"), ("tok/s/GPU", "right"),
                      ("days", "right")):
        t.add_column(col, justify=just)
    for pt in points:
        p = pt.prediction
        if p is None:
            t.add_row(str(pt.n_gpus), pt.note, "-", "-", "-")
        else:
            t.add_row(str(pt.n_gpus), p.plan.short(), f"{p.tflops_per_gpu:,.1f}", f"{p.tokens_per_s_per_gpu:,.0f}",
                      f"{pt.days(tokens):,.1f}")
    return t


# ---- JSON ------------------------------------------------------------------------------------------------------

def to_json(obj: Any, path: str | os.PathLike | None = None) -> str:
    """Serialise a Prediction, SearchResult, list of ScalePoints or a dict; write to ``path`` if given."""
    if isinstance(obj, Prediction):
        d = obj.to_dict()
    elif isinstance(obj, SearchResult):
        d = obj.to_dict()
    else:
        d = obj
    d = {**d, "constants": all_constants()} if isinstance(d, dict) else d
    text = json.dumps(d, indent=2, default=_json_default)
    if path:
        Path(path).parent.mkdir(parents=True, exist_ok=True)
        Path(path).write_text(text)
    return text


def _json_default(o: Any) -> Any:
    try:
        import numpy as np

        if isinstance(o, np.generic):
            return o.item()
    except ImportError:  # pragma: no cover
        pass
    if hasattr(o, "to_dict"):
        return o.to_dict()
    if isinstance(o, (set, frozenset, tuple)):
        return list(o)
    raise TypeError(f"not JSON serialisable: {type(o).__name__}")


# ---- PNG -------------------------------------------------------------------------------------------------------

def _plt():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    return plt


SUB_COLORS = {"dense GEMM": "#4C72B0", "expert GEMM": "#6C8EBF", "attention": "#8FAADC", "memory-bound": "#B4C7E7",
              "recompute/overhead": "#D9E2F3", "host launch": "#937860"}


def plot_breakdown(preds: Sequence[Prediction], path: str | os.PathLike, labels: Sequence[str] | None = None,
                   published: Sequence[float | None] | None = None, published_note: str = "") -> Path:
    """Stacked horizontal bars of the step-time breakdown (share of each step; compute split by kernel class),
    TFLOP/s per GPU, step time and memory annotated; ``published_note`` follows each published figure (e.g. that
    it is the record's own plan, not the one drawn)."""
    return _save(breakdown_figure(preds, labels, published, published_note), path, bbox_inches="tight")


def _save(fig, path: str | os.PathLike, **kw) -> Path:
    out = Path(path)
    out.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out, dpi=110, **kw)
    _plt().close(fig)
    return out


def breakdown_figure(preds: Sequence[Prediction], labels: Sequence[str] | None = None,
                     published: Sequence[float | None] | None = None, published_note: str = ""):
    """The matplotlib Figure of :func:`plot_breakdown`."""
    plt = _plt()
    labels = list(labels) if labels else [f"{p.n_gpus}x{p.gpu.upper()}" for p in preds]
    # Constrained layout keeps the legend (below the axes, outside them) and the annotations right of the bars
    # clear of the bars, the tick labels and the x label, whatever the number of rows.
    fig, ax = plt.subplots(figsize=(12, 0.75 * len(preds) + 2.4), layout="constrained")
    seen: set[str] = set()
    for i, p in enumerate(preds):
        if p.step is None:
            ax.text(0.01, i, f"does not fit in memory ({p.memory.total:.0f} of {p.memory_limit_gib:g} GiB)",
                    va="center", color="red")
            continue
        step = p.step.step
        left = 0.0
        segs = [(f"compute: {k}", v, SUB_COLORS[k]) for k, v in p.step.compute_parts.items()]
        if not segs:
            segs = [("compute", p.step.compute, COLORS["compute"])]
        segs += [(label, getattr(p.step, key), COLORS[key]) for key, label in BREAKDOWN if key != "compute"]
        for label, v, color in segs:
            ax.barh(i, v / step, left=left, color=color, edgecolor="white", linewidth=0.5,
                    label=None if label in seen else label)
            seen.add(label)
            left += v / step
        txt = f"{p.tflops_per_gpu:,.0f} TFLOP/s/GPU, step {step:.2f} s, {p.memory.total:.0f} GiB"
        if published and published[i]:
            txt += f"\n(published {published[i]:,.0f}{published_note})"
        ax.text(1.01, i, txt, va="center", fontsize=8)
    ax.set_yticks(range(len(preds)), labels, fontsize=8)
    ax.set_xlim(0, 1)
    ax.set_ylim(len(preds) - 0.5, -0.5)  # first plan on top; a row without bars (does not fit) keeps its height
    ax.set_xlabel("share of step time")
    if ax.get_legend_handles_labels()[0]:
        fig.legend(loc="outside lower center", ncol=5, fontsize=8, frameon=False)
    ax.set_title("Predicted step-time breakdown")
    return fig


def plot_scale(points: Sequence[ScalePoint], path: str | os.PathLike, tokens: float, title: str = "") -> Path:
    """TFLOP/s per GPU and days to train ``tokens`` against GPU count (log-2 x axis)."""
    return _save(scale_figure(points, tokens, title), path)


def scale_figure(points: Sequence[ScalePoint], tokens: float, title: str = ""):
    """The matplotlib Figure of :func:`plot_scale`."""
    plt = _plt()
    xs = [pt.n_gpus for pt in points if pt.prediction is not None]
    tf = [pt.prediction.tflops_per_gpu for pt in points if pt.prediction is not None]
    days = [pt.days(tokens) for pt in points if pt.prediction is not None]
    from matplotlib.ticker import FuncFormatter, LogLocator, NullFormatter

    plain = FuncFormatter(lambda v, _: f"{v:,.0f}" if v >= 10 else f"{v:g}")
    fig, (a1, a2) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    a1.plot(xs, tf, "o-", color="#4C72B0")
    a1.set_xscale("log", base=2)
    a1.set_xlabel("GPUs")
    a1.set_ylabel("predicted TFLOP/s per GPU")
    a1.set_ylim(0, 1.15 * max(tf, default=1.0))  # headroom for the plan labels above the points
    a1.grid(alpha=0.3)
    a1.margins(x=0.1)  # room for the first and last plan labels inside the axes
    for x, y, pt in zip(xs, tf, [p for p in points if p.prediction is not None]):
        pl = pt.prediction.plan
        a1.annotate(f"TP{pl.tp}PP{pl.pp}EP{pl.ep}", (x, y), fontsize=7, textcoords="offset points", xytext=(0, 6),
                    ha="center")
    a2.plot(xs, days, "o-", color="#C44E52")
    a2.set_xscale("log", base=2)
    a2.set_yscale("log")
    a2.set_xlabel("GPUs")
    a2.set_ylabel(f"days to train {tokens / 1e12:g}T tokens")
    a2.grid(alpha=0.3, which="both")
    for a in (a1, a2):  # GPU counts and days as plain numbers, one tick per count
        a.set_xticks(xs)
        a.xaxis.set_major_formatter(plain)
        a.xaxis.set_minor_formatter(NullFormatter())
    a2.margins(x=0.1)
    # 1-2-5 ticks on the log axis (every integer mantissa when the days span less than a factor of 5)
    wide = len(days) > 1 and max(days) / max(min(days), 1e-9) >= 5
    a2.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0) if wide else tuple(range(1, 10))))
    a2.yaxis.set_major_formatter(plain)
    a2.yaxis.set_minor_formatter(NullFormatter())
    missing = [pt.n_gpus for pt in points if pt.prediction is None]
    if missing:  # below the axes, not over the curve
        fig.text(0.5, 0.0, f"no fitting plan at {missing} GPUs", ha="center", va="bottom", fontsize=8,
                 color="red")
        fig.get_layout_engine().set(rect=(0, 0.04, 1, 0.96))
    fig.suptitle(title or "Predicted scaling")
    return fig
