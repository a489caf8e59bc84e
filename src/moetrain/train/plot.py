"""``moetrain plot``: loss curves and an expert-load heatmap of a run, rendered to PNG from metrics.jsonl."""

from __future__ import annotations

import json
from pathlib import Path


def read_metrics(run_dir: str | Path) -> list[dict]:
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise FileNotFoundError(f"no metrics.jsonl in {run_dir}; run `moetrain train --out {run_dir}` first")
    return [json.loads(line) for line in path.read_text().splitlines() if line.strip()]


def plot_run(run_dir: str | Path, out_dir: str | Path | None = None) -> list[Path]:
    """Write ``loss.png`` (train LM/MTP/total and validation loss vs step) and ``expert_load.png`` (tokens per expert
    per MoE layer at the last logged step). Returns the paths written."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    records = read_metrics(run_dir)
    out = Path(out_dir or run_dir)
    out.mkdir(parents=True, exist_ok=True)
    train = [r for r in records if r.get("kind") == "train"]
    val = [r for r in records if r.get("kind") == "val"]
    fig, ax = plt.subplots(figsize=(7, 4.5))
    if train:
        steps = [r["step"] for r in train]
        ax.plot(steps, [r["loss"] for r in train], label="train total")
        ax.plot(steps, [r["lm_loss"] for r in train], label="train LM")
        if any(r.get("mtp_loss") for r in train):
            ax.plot(steps, [r["mtp_loss"] for r in train], label="train MTP", alpha=0.7)
    if val:
        ax.plot([r["step"] for r in val], [r["val_loss"] for r in val], "o-", label="validation LM")
    ax.set_xlabel("step")
    ax.set_ylabel("cross-entropy (nats)")
    ax.set_title(f"moetrain: {Path(run_dir).name}")
    ax.grid(alpha=0.3)
    ax.legend()
    paths = [out / "loss.png"]
    fig.tight_layout()
    fig.savefig(paths[0], dpi=120)
    plt.close(fig)

    loads = [r for r in train if r.get("expert_load")]
    if loads:
        last = np.asarray(loads[-1]["expert_load"], dtype=float)
        rel = last / np.maximum(last.mean(axis=1, keepdims=True), 1e-9)
        fig, ax = plt.subplots(figsize=(max(6, last.shape[1] * 0.35), 1.5 + 0.5 * last.shape[0]))
        im = ax.imshow(rel, aspect="auto", cmap="viridis")
        ax.set_xlabel("routed expert")
        ax.set_ylabel("MoE layer (main, then MTP)")
        ax.set_title(f"expert load / mean at step {loads[-1]['step']}")
        fig.colorbar(im, ax=ax, label="tokens / mean")
        fig.tight_layout()
        paths.append(out / "expert_load.png")
        fig.savefig(paths[-1], dpi=120)
        plt.close(fig)
    return paths
