"""``moetrain plot``: a run's curves and its expert load over training, rendered to PNG from metrics.jsonl.

Three figures (:func:`build_figures` returns them for inspection, :func:`plot_run` writes them):

* ``loss.png`` -- train total / LM / MTP and validation loss against step, with the learning rate and the gradient
  norm beside it on the same steps.
* ``expert_load.png`` -- max/mean tokens per expert of every MoE layer (rows; main layers, then MTP) at every logged
  step (columns): 1.0 is perfect balance; the hottest expert of a layer sets its all-to-all and GEMM time.
* ``expert_share.png`` -- one panel per MoE layer: each routed expert's share of the layer's routed tokens
  (tokens of the expert / tokens of the layer) at every logged step; the colour is centred on the uniform share 1/E.
* ``imbalance.png`` -- the share of the step lost to expert-load imbalance per MoE layer (and the step's) over the
  logged steps, and beside it max/mean rows per EP rank per layer (``moetrain.parallel.imbalance``); runs whose
  tokens move between ranks only (EP > 1, or the all-to-all dispatcher at EP 1): at EP 1 with the local dispatcher
  (the run record's ``"dispatcher": "local"``) nothing is lost to imbalance by construction, and the figure would be
  a flat line at zero.

Rows of ``expert_load`` in the train records are the model's ``moe_layers()`` order: the MoE blocks of the main model
(transformer layers ``n_dense_layers .. n_layers-1``), then one per MTP module. The run record's model config names
them; without it the rows are numbered "MoE 0, 1, ...".
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Any

FILES = ("loss.png", "expert_load.png", "expert_share.png", "imbalance.png")


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}; run `moetrain train --out {run_dir}` first")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def _by_step(records: list[dict], kind: str) -> list[dict]:
    """Records of one kind, one per step (the last written wins: a resumed run rewrites its steps), sorted."""
    out: dict[int, dict] = {}
    for r in records:
        if r.get("kind") == kind and "step" in r:
            out[int(r["step"])] = r
    return [out[s] for s in sorted(out)]


def _run_config(records: list[dict]) -> dict[str, Any]:
    """The job config of the last run record (a resumed run writes one per start)."""
    cfg: dict[str, Any] = {}
    for r in records:
        if r.get("kind") == "run" and isinstance(r.get("config"), dict):
            cfg = r["config"]
    return cfg


def moves_tokens(records: list[dict]) -> bool:
    """Whether the run's tokens move between ranks: its last run record's dispatcher is not "local" (EP 1 without
    the all-to-all dispatcher, :attr:`moetrain.parallel.config.ParallelConfig.moves_tokens`); True without one."""
    run = [r for r in records if r.get("kind") == "run"]
    return not run or run[-1].get("dispatcher") != "local"


def not_drawn(records: list[dict]) -> dict[str, str]:
    """The figures of :data:`FILES` left out although their keys are in the records, by file name, with why."""
    if moves_tokens(records):
        return {}
    return {"imbalance.png": "EP 1 with the local dispatcher: no token leaves its rank, so no time is lost to "
                             "imbalance; metrics.jsonl keeps the zeros"}


def _train_config(records: list[dict]) -> dict[str, Any]:
    return _run_config(records).get("train") or {}


def moe_layer_labels(records: list[dict], n_rows: int) -> list[str]:
    """Names of the rows of ``expert_load``: "layer i" (the transformer block, 0-based as in the HF names
    ``model.layers.i``) for the main model's MoE blocks, then "MTP d" for the MTP modules."""
    model = _run_config(records).get("model") or {}
    try:
        n_layers, n_dense, mtp = int(model["n_layers"]), int(model["n_dense_layers"]), int(model["mtp_depth"])
    except (KeyError, TypeError, ValueError):
        return [f"MoE {i}" for i in range(n_rows)]
    labels = [f"layer {i}" for i in range(n_dense, n_layers)] + [f"MTP {d + 1}" for d in range(mtp)]
    return labels if len(labels) == n_rows else [f"MoE {i}" for i in range(n_rows)]


def expert_load_arrays(records: list[dict]):
    """(steps [S], loads [S, M, E]) of the train records that carry ``expert_load`` (all with the same shape)."""
    import numpy as np

    rows = [r for r in _by_step(records, "train") if r.get("expert_load")]
    if not rows:
        return np.zeros(0, dtype=int), np.zeros((0, 0, 0))
    shape = np.asarray(rows[-1]["expert_load"]).shape
    rows = [r for r in rows if np.asarray(r["expert_load"]).shape == shape]
    return np.asarray([r["step"] for r in rows], dtype=int), np.asarray([r["expert_load"] for r in rows], dtype=float)


def max_over_mean(loads_SME):
    """max/mean tokens per expert, [M, S] (layers by steps); 1.0 where a layer routed nothing."""
    import numpy as np

    mean = loads_SME.mean(axis=2)
    ratio = np.where(mean > 0, loads_SME.max(axis=2) / np.maximum(mean, 1e-30), 1.0)
    return ratio.T


def expert_share(loads_SME):
    """Each expert's share of its layer's routed tokens, [M, E, S]; 0 where a layer routed nothing."""
    import numpy as np

    total = loads_SME.sum(axis=2, keepdims=True)
    share = np.where(total > 0, loads_SME / np.maximum(total, 1e-30), 0.0)
    return share.transpose(1, 2, 0)


def _step_ticks(ax, steps, max_ticks: int = 8) -> None:
    """Columns of a heatmap are logged steps: x ticks on whole columns, labelled with their step numbers -- the
    columns whose step is a multiple of a round number (1, 2, 5 x 10^k) when there are enough of them, else every
    k-th column."""
    n = len(steps)
    span = max(int(steps[-1]) - int(steps[0]), 1)
    nice = next(m * 10 ** k for k in range(12) for m in (1, 2, 5) if m * 10 ** k * max_ticks >= span)
    idx = [i for i, s in enumerate(steps) if int(s) % nice == 0]
    if len(idx) < min(2, n) or len(idx) > max_ticks + 1:
        stride = max(1, math.ceil(n / max_ticks))
        idx = list(range(0, n, stride))
    ax.set_xticks(idx, [str(int(steps[i])) for i in idx])


def _expert_ticks(ax, n_experts: int, max_ticks: int = 9) -> None:
    """Expert ids at a power-of-two stride (expert counts are powers of two): whole experts only."""
    stride = 1
    while n_experts / stride > max_ticks:
        stride *= 2
    ax.set_yticks(range(0, n_experts, stride))


def build_figures(records: list[dict], title: str = "") -> dict[str, Any]:
    """The figures of :data:`FILES` that the records have data for, by file name (matplotlib Figure objects)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np
    from matplotlib.colors import TwoSlopeNorm
    from matplotlib.ticker import MaxNLocator

    figs: dict[str, Any] = {}
    train = _by_step(records, "train")
    val = _by_step(records, "val")

    # ---- loss, with learning rate and gradient norm beside it ----
    fig = plt.figure(figsize=(11, 5), layout="constrained")
    gs = fig.add_gridspec(2, 2, width_ratios=[1.7, 1])
    ax = fig.add_subplot(gs[:, 0])
    ax_lr = fig.add_subplot(gs[0, 1])
    ax_gn = fig.add_subplot(gs[1, 1], sharex=ax_lr)
    ax.set_label("loss")
    ax_lr.set_label("lr")
    ax_gn.set_label("grad_norm")
    steps = [r["step"] for r in train]
    if train:
        ax.plot(steps, [r["loss"] for r in train], label="train total")
        ax.plot(steps, [r.get("lm_loss", math.nan) for r in train], label="train LM")
        if any(r.get("mtp_loss") for r in train):
            ax.plot(steps, [r.get("mtp_loss", math.nan) for r in train], label="train MTP", alpha=0.8)
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation LM")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.grid(alpha=0.3)
    if ax.get_legend_handles_labels()[0]:
        # Above the axes, not over the curves.
        ax.legend(loc="lower left", bbox_to_anchor=(0.0, 1.01), ncol=4, fontsize=9, frameon=False,
                  borderaxespad=0.0)
    lr = [(r["step"], r["lr"]) for r in train if r.get("lr") is not None]
    ax_lr.plot([s for s, _ in lr], [v for _, v in lr], color="tab:purple")
    ax_lr.set_ylabel("learning rate")
    ax_lr.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))
    ax_lr.tick_params(labelbottom=False)
    gn = [(r["step"], r["grad_norm"]) for r in train if r.get("grad_norm") is not None]
    ax_gn.plot([s for s, _ in gn], [v for _, v in gn], color="tab:brown")
    clip = _train_config(records).get("max_grad_norm")
    if gn and isinstance(clip, (int, float)) and clip > 0:
        ax_gn.axhline(clip, color="grey", linestyle="--", linewidth=1)
        ax_gn.annotate(f"clip {clip:g}", (0.99, clip), xycoords=("axes fraction", "data"), ha="right",
                       va="bottom", fontsize=8, color="grey")
    ax_gn.set_ylabel("grad norm (before clip)")
    ax_gn.set_xlabel("step")
    for a in (ax, ax_lr, ax_gn):
        a.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 2.5, 5, 10]))
        a.grid(alpha=0.3)
    fig.suptitle(title or "moetrain run")
    figs["loss.png"] = fig

    # ---- expert load over steps ----
    steps_S, loads = expert_load_arrays(records)
    if len(steps_S):
        S, M, E = loads.shape
        labels = moe_layer_labels(records, M)
        imb = max_over_mean(loads)
        fig, ax = plt.subplots(figsize=(min(16, max(7, 0.35 * S + 3)), min(14, 1.6 + 0.4 * M)), layout="constrained")
        ax.set_label("max_over_mean")
        im = ax.imshow(imb, aspect="auto", cmap="magma_r", vmin=1.0, vmax=max(float(imb.max()), 1.01),
                       interpolation="nearest")
        ax.set_yticks(range(M), labels)
        _step_ticks(ax, steps_S, max_ticks=15)
        ax.set_xlabel("step")
        ax.set_ylabel("MoE layer")
        ax.set_title("expert load imbalance: max / mean tokens per routed expert (1 = balanced)")
        if S * M <= 120:
            for m in range(M):
                for s in range(S):
                    v = imb[m, s]
                    ax.text(s, m, f"{v:.2f}", ha="center", va="center", fontsize=7,
                            color="white" if v > 1 + 0.6 * (imb.max() - 1) else "black")
        fig.colorbar(im, ax=ax, label="max / mean")
        figs["expert_load.png"] = fig

        share = expert_share(loads)
        ncols = min(M, 4)
        nrows = math.ceil(M / ncols)
        panel_h = min(6.0, max(3.0, 0.06 * E))
        fig, axes = plt.subplots(nrows, ncols, squeeze=False, sharex=True, sharey=True, layout="constrained",
                                 figsize=(min(18, 3.6 * ncols + 1.8), min(40, 1.2 + panel_h * nrows)))
        uniform = 1.0 / E
        vmax = max(float(share.max()), 2 * uniform)
        norm = TwoSlopeNorm(vmin=0.0, vcenter=uniform, vmax=vmax)
        for m in range(nrows * ncols):
            a = axes[m // ncols][m % ncols]
            if m >= M:
                a.set_visible(False)
                continue
            a.set_label(f"share:{labels[m]}")
            im = a.imshow(share[m], aspect="auto", cmap="RdBu_r", norm=norm, interpolation="nearest")
            a.set_title(labels[m], fontsize=10)
            _step_ticks(a, steps_S, max_ticks=5)
            _expert_ticks(a, E)
            if m % ncols == 0:
                a.set_ylabel("routed expert")
            if m // ncols == nrows - 1 or m + ncols >= M:
                a.set_xlabel("step")
                a.tick_params(labelbottom=True)
        cbar = fig.colorbar(im, ax=axes, label="share of the layer's tokens", shrink=0.9)
        ticks = [0.0, uniform / 2, uniform, (uniform + vmax) / 2, vmax]
        cbar.set_ticks(ticks, labels=["0", f"{uniform / 2:.3g}", f"1/{E}", f"{ticks[3]:.3g}", f"{vmax:.3g}"])
        fig.suptitle(f"per-expert share of routed tokens per MoE layer (white = uniform 1/{E}, red = overloaded)")
        figs["expert_share.png"] = fig

    fig = imbalance_figure(records) if "imbalance.png" not in not_drawn(records) else None
    if fig is not None:
        figs["imbalance.png"] = fig
    return figs


def imbalance_figure(records: list[dict]):
    """Share of the step lost to imbalance per MoE layer over steps (with the total), and max/mean rows per EP rank
    per layer; None when no train record carries them. Layers are named by their global MoE index
    (``imbalance_moe_layers``: every stage's layers under PP). The step's share is that of all layers at PP 1, of
    the pipeline rank that lost most under PP (``moetrain.parallel.imbalance``)."""
    import matplotlib.pyplot as plt
    from matplotlib.ticker import MaxNLocator

    rows = [r for r in _by_step(records, "train") if r.get("imbalance_lost_share_per_layer")]
    if not rows:
        return None
    n_moe = max(max(r.get("imbalance_moe_layers") or [0]) for r in rows) + 1
    names = moe_layer_labels(records, n_moe)
    fig, (ax, ax_rows) = plt.subplots(1, 2, figsize=(12, 4.5), layout="constrained")
    ax.set_label("lost_share")
    ax_rows.set_label("ep_rows")
    layers = sorted({m for r in rows for m in r.get("imbalance_moe_layers") or []})
    for m in layers:
        pts = [(r["step"], v, rr) for r in rows
               for mm, v, rr in zip(r["imbalance_moe_layers"], r["imbalance_lost_share_per_layer"],
                                    r.get("ep_rows_imbalance") or [math.nan] * len(r["imbalance_moe_layers"]))
               if mm == m]
        label = names[m] if m < len(names) else f"MoE {m}"
        ax.plot([p[0] for p in pts], [100 * p[1] for p in pts], marker=".", label=label)
        ax_rows.plot([p[0] for p in pts], [p[2] for p in pts], marker=".", label=label)
    ax.plot([r["step"] for r in rows], [100 * r.get("imbalance_lost_share", math.nan) for r in rows], "k--",
            label="step")
    ax.set_xlabel("step")
    ax.set_ylabel("% of the step")
    ax.set_title("time lost to expert-load imbalance (expert time vs mean + combine wait)")
    ax_rows.set_xlabel("step")
    ax_rows.set_ylabel("max / mean")
    ax_rows.set_title("rows per EP rank: max / mean (1 = balanced)")
    for a in (ax, ax_rows):
        a.xaxis.set_major_locator(MaxNLocator(integer=True, steps=[1, 2, 2.5, 5, 10]))
        a.grid(alpha=0.3)
        a.legend(fontsize=8, ncol=2)
    return fig


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write the figures of :data:`FILES` that the run has data for (``loss.png`` always). Returns the paths."""
    records = read_metrics(run_dir)
    out = Path(out_dir or run_dir)
    out.mkdir(parents=True, exist_ok=True)
    figs = build_figures(records, title=f"moetrain: {Path(run_dir).resolve().name}")
    import matplotlib.pyplot as plt

    paths = []
    for name, fig in figs.items():
        paths.append(out / name)
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths
