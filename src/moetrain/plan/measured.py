"""The load imbalance a training run measured, as the planner's ``imbalance`` (``moetrain plan --routing real
--imbalance-from RUN_DIR``).

A run's ``metrics.jsonl`` logs every step's tokens per expert of every MoE layer (``expert_load``, summed over all
ranks) and, in its first row, the run's EP size and configuration. The rows a rank computes are its experts' loads;
with ``parallel.redundant_experts`` the copies take their water-filled shares (``moetrain.parallel.eplb``, the
placement the trainer computes, here from the logged step's own loads). Per step the imbalance is the mean over MoE
layers of max/mean rows per EP rank -- each layer waits for its own hottest rank, and the layers run one after
another -- and the run's figure is the median over its logged steps after the first quarter (the router's early
collapse is not the steady state).
"""

from __future__ import annotations

import json
import statistics
from pathlib import Path

from moetrain.parallel.eplb import no_replicas, plan_replicas


def rank_imbalance(load_E: list[int], ep: int, redundant: int = 0) -> float:
    """max/mean rows per EP rank of one layer's per-expert loads (assignments), its copies placed as the trainer
    places them when ``redundant`` > 0. 1.0 for a layer without load."""
    placement = plan_replicas(load_E, ep, redundant) if redundant else no_replicas(len(load_E), ep, 0)
    rows = placement.rank_loads(load_E)
    mean = sum(rows) / len(rows)
    return max(rows) / mean if mean > 0 else 1.0


def imbalance_from_run(run_dir: str | Path, redundant: int | None = None) -> float:
    """The measured max/mean rows per EP rank of a run (see the module docstring), >= 1.

    Args:
        run_dir: a ``moetrain train --out`` directory (its ``metrics.jsonl``).
        redundant: copies per EP rank to assume; None = the run's own ``parallel.redundant_experts``.

    Raises:
        ValueError: no metrics file, no run record or no logged training step in it, or a run at EP 1 (every
            expert on one rank: nothing to be imbalanced over).
    """
    path = Path(run_dir) / "metrics.jsonl"
    if not path.is_file():
        raise ValueError(f"--imbalance-from {run_dir}: no metrics.jsonl there; give a `moetrain train --out` "
                         f"directory")
    rows = [json.loads(line) for line in path.read_text().splitlines() if line.strip()]
    run = next((r for r in rows if r.get("kind") == "run"), None)
    steps = [r for r in rows if r.get("kind") == "train" and r.get("expert_load")]
    if run is None or not steps:
        raise ValueError(f"--imbalance-from {run_dir}: {path} has no run record or no logged training step")
    ep = int(run["ep"])
    if ep < 2:
        raise ValueError(f"--imbalance-from {run_dir}: the run trained at EP {ep}; the imbalance is over EP ranks, "
                         f"measure a run at ep >= 2")
    if redundant is None:
        redundant = int(run.get("config", {}).get("parallel", {}).get("redundant_experts", 0) or 0)
    steps = steps[len(steps) // 4:]
    per_step = [statistics.fmean(rank_imbalance([int(x) for x in layer], ep, redundant)
                                 for layer in r["expert_load"]) for r in steps]
    return max(1.0, statistics.median(per_step))
