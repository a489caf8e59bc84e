"""`moetrain plot` from a synthetic metrics.jsonl (2 MoE layers + 1 MTP layer), and the `moetrain plan --png`
figures: files are PNGs, the heatmaps hold max/mean and per-expert shares computed here by hand, the layers are
named (MTP labelled), ticks sit on whole layers / experts / steps, legends stay off the axes."""

from __future__ import annotations

import json

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pytest  # noqa: E402

from moetrain.cli import main as cli_main  # noqa: E402
from moetrain.train.plot import FILES, build_figures, plot_run, read_metrics  # noqa: E402

# layer 0 dense, layers 1-2 MoE, one MTP module: three rows of expert_load, 4 routed experts each.
MODEL = {"n_layers": 3, "n_dense_layers": 1, "mtp_depth": 1, "n_routed_experts": 4}
STEPS = [5, 10, 15, 20]
LOADS = {  # step -> [layer 1, layer 2, MTP 1] x 4 experts
    5: [[40, 0, 0, 0], [10, 10, 10, 10], [20, 20, 0, 0]],
    10: [[25, 5, 5, 5], [12, 8, 10, 10], [18, 12, 6, 4]],
    15: [[12, 10, 9, 9], [11, 9, 10, 10], [15, 10, 8, 7]],
    20: [[10, 10, 10, 10], [10, 10, 10, 10], [11, 10, 10, 9]],
}

IMBALANCE = {  # step -> the imbalance telemetry of an EP run: lost share per MoE layer, max/mean rows per EP rank
    s: {"imbalance_moe_layers": [0, 1, 2], "imbalance_lost_share_per_layer": [0.1 / (i + 1), 0.02, 0.05],
        "imbalance_lost_share": 0.1 / (i + 1) + 0.07, "ep_rows_imbalance": [2.0 - 0.25 * i, 1.0, 1.5]}
    for i, s in enumerate(STEPS)}


def _records() -> list[dict]:
    recs: list[dict] = [{"kind": "run", "step": 0, "config": {"model": MODEL, "train": {"max_grad_norm": 1.0}}},
                        {"kind": "val", "step": 0, "val_loss": 7.0}]
    for i, s in enumerate(STEPS):
        recs.append({"kind": "train", "step": s, "loss": 8.0 - i, "lm_loss": 6.0 - i, "mtp_loss": 6.5 - i,
                     "grad_norm": 2.0 - 0.3 * i, "lr": 1e-3 * (i + 1) / len(STEPS), "expert_load": LOADS[s],
                     **IMBALANCE[s]})
    recs.append({"kind": "val", "step": 20, "val_loss": 4.0})
    return recs


@pytest.fixture
def run_dir(tmp_path):
    d = tmp_path / "run"
    d.mkdir()
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in _records()) + "\n")
    return d


@pytest.fixture
def figs():
    f = build_figures(_records(), title="t")
    yield f
    for fig in f.values():
        plt.close(fig)


def _ax(fig, label):
    (ax,) = [a for a in fig.axes if a.get_label() == label]
    return ax


def _integer_ticks(ax, axis="y"):
    locs = ax.get_yticks() if axis == "y" else ax.get_xticks()
    return len(locs) > 0 and np.allclose(locs, np.round(locs))


def test_plot_run_writes_pngs(run_dir, tmp_path, capsys):
    out = tmp_path / "plots"
    assert cli_main(["plot", str(run_dir), "--out", str(out)]) == 0
    printed = capsys.readouterr().out.split()
    assert [p.rsplit("/", 1)[-1] for p in printed] == list(FILES)
    for name in FILES:
        data = (out / name).read_bytes()
        assert data[:8] == b"\x89PNG\r\n\x1a\n" and len(data) > 5_000, name
        img = plt.imread(out / name)
        assert img.ndim == 3 and img.shape[0] > 200 and img.shape[1] > 400, (name, img.shape)
    assert plot_run(run_dir) == [run_dir / n for n in FILES]  # default: into the run directory


def test_loss_figure_has_lr_and_grad_norm(figs):
    fig = figs["loss.png"]
    ax, lr, gn = _ax(fig, "loss"), _ax(fig, "lr"), _ax(fig, "grad_norm")
    assert {t.get_text() for t in ax.get_legend().get_texts()} == {"train total", "train LM", "train MTP",
                                                                  "validation LM"}
    val = [ln for ln in ax.get_lines() if ln.get_label() == "validation LM"][0]
    assert list(val.get_xdata()) == [0, 20] and list(val.get_ydata()) == [7.0, 4.0]
    (lr_line,) = lr.get_lines()
    assert list(lr_line.get_xdata()) == STEPS
    assert np.allclose(lr_line.get_ydata(), [1e-3 * (i + 1) / 4 for i in range(4)])
    assert lr.get_ylabel() == "learning rate" and gn.get_ylabel().startswith("grad norm")
    assert np.allclose(gn.get_lines()[0].get_ydata(), [2.0, 1.7, 1.4, 1.1])
    assert gn.get_lines()[1].get_ydata()[0] == 1.0  # the clip threshold of the run's config
    for a in (ax, lr, gn):
        assert _integer_ticks(a, "x")
    # the legend sits above the loss axes, not on the curves
    fig.canvas.draw()
    leg = ax.get_legend().get_window_extent()
    assert leg.y0 >= ax.get_window_extent().y1 - 1


def test_max_over_mean_heatmap(figs):
    fig = figs["expert_load.png"]
    ax = _ax(fig, "max_over_mean")
    data = np.asarray(ax.get_images()[0].get_array())
    expected = np.array([[max(LOADS[s][m]) / (sum(LOADS[s][m]) / 4) for s in STEPS] for m in range(3)])
    assert data.shape == (3, 4) and np.allclose(data, expected)
    assert data[0, 0] == pytest.approx(4.0) and data[1, 3] == pytest.approx(1.0)
    assert [t.get_text() for t in ax.get_yticklabels()] == ["layer 1", "layer 2", "MTP 1"]
    assert list(ax.get_yticks()) == [0, 1, 2]
    assert _integer_ticks(ax, "x")
    assert [t.get_text() for t in ax.get_xticklabels()] == [str(s) for s in STEPS]
    assert ax.get_xlabel() == "step" and ax.get_ylabel() == "MoE layer"


def test_expert_share_heatmaps(figs):
    fig = figs["expert_share.png"]
    for m, name in enumerate(["layer 1", "layer 2", "MTP 1"]):
        ax = _ax(fig, f"share:{name}")
        assert ax.get_title() == name
        data = np.asarray(ax.get_images()[0].get_array())  # experts x steps
        expected = np.array([[LOADS[s][m][e] / sum(LOADS[s][m]) for s in STEPS] for e in range(4)])
        assert data.shape == (4, 4) and np.allclose(data, expected)
        assert np.allclose(data.sum(axis=0), 1.0)
        assert _integer_ticks(ax, "y") and _integer_ticks(ax, "x")
        assert set(ax.get_yticks()) <= set(range(4))


def test_labels_without_config_and_resumed_steps():
    recs = [r for r in _records() if r["kind"] != "run"]
    recs.insert(3, {**recs[2], "loss": 99.0})  # a resumed run rewrites step 5: the last record wins
    figs = build_figures(recs)
    try:
        ax = _ax(figs["expert_load.png"], "max_over_mean")
        assert [t.get_text() for t in ax.get_yticklabels()] == ["MoE 0", "MoE 1", "MoE 2"]
        total = [ln for ln in _ax(figs["loss.png"], "loss").get_lines() if ln.get_label() == "train total"][0]
        assert list(total.get_xdata()) == STEPS
    finally:
        for fig in figs.values():
            plt.close(fig)


def test_no_expert_load_only_loss(tmp_path):
    d = tmp_path / "r"
    d.mkdir()
    recs = [{k: v for k, v in r.items() if k != "expert_load" and k not in IMBALANCE[STEPS[0]]} for r in _records()]
    (d / "metrics.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    assert plot_run(d) == [d / "loss.png"]
    assert len(read_metrics(d)) == len(recs)


def _overlaps(a, b) -> bool:
    return a.x0 < b.x1 and b.x0 < a.x1 and a.y0 < b.y1 and b.y0 < a.y1


@pytest.mark.parametrize("rows", [1, 4])
def test_plan_breakdown_legend_off_the_axes(rows):
    from moetrain.plan.model import predict
    from moetrain.plan.records import RECORDS
    from moetrain.plan.report import breakdown_figure

    recs = list(RECORDS.values())[:rows]
    fig = breakdown_figure([predict(r.model, r.gpu, r.n_gpus, r.plan) for r in recs],
                           labels=[f"{r.n_gpus} {r.gpu}" for r in recs])
    try:
        fig.canvas.draw()
        r = fig.canvas.get_renderer()
        (ax,) = fig.axes
        (leg,) = fig.legends
        assert not _overlaps(leg.get_window_extent(r), ax.get_tightbbox(r))  # bars, tick labels, x label
        assert ax.get_ylim() == (rows - 0.5, -0.5)
    finally:
        plt.close(fig)


def test_imbalance_figure_plots_lost_share_per_layer(figs):
    ax = _ax(figs["imbalance.png"], "lost_share")
    lines = {ln.get_label(): ln for ln in ax.get_lines()}
    assert set(lines) == {"layer 1", "layer 2", "MTP 1", "step"}
    assert list(lines["layer 1"].get_xdata()) == STEPS
    assert np.allclose(lines["layer 1"].get_ydata(), [100 * 0.1 / (i + 1) for i in range(len(STEPS))])
    assert np.allclose(lines["step"].get_ydata(), [100 * (0.1 / (i + 1) + 0.07) for i in range(len(STEPS))])
    rows = {ln.get_label(): ln for ln in _ax(figs["imbalance.png"], "ep_rows").get_lines()}
    assert np.allclose(rows["MTP 1"].get_ydata(), [1.5] * len(STEPS))
