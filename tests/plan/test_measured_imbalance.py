"""``moetrain plan --imbalance-from RUN_DIR``: the imbalance a run measured, from its metrics.jsonl (by hand)."""

from __future__ import annotations

import json

import pytest

from moetrain.plan.cli import main
from moetrain.plan.measured import imbalance_from_run, rank_imbalance


def _run(tmp_path, loads_per_step, ep=2, redundant=0):
    rows = [{"kind": "run", "step": 0, "ep": ep, "config": {"parallel": {"redundant_experts": redundant}}}]
    rows += [{"kind": "train", "step": i + 1, "expert_load": loads} for i, loads in enumerate(loads_per_step)]
    (tmp_path / "metrics.jsonl").write_text("".join(json.dumps(r) + "\n" for r in rows))
    return tmp_path


def test_rank_imbalance_by_hand():
    assert rank_imbalance([4, 4, 0, 0], 2) == 2.0             # rows 8 | 0, mean 4
    assert rank_imbalance([4, 4, 0, 0], 2, redundant=1) == 1.0  # one copy takes a whole hot expert: 4 | 4
    assert rank_imbalance([3, 1, 1, 1], 2) == 4 / 3           # rows 4 | 2, mean 3
    assert rank_imbalance([0, 0, 0, 0], 2) == 1.0


def test_imbalance_from_run_by_hand(tmp_path):
    # Step 1 is the first quarter of 4 steps and is left out; steps 2-4: layers (2.0, 4/3) -> 5/3 each.
    steps = [[[1, 1, 1, 1], [1, 1, 1, 1]]] + [[[4, 4, 0, 0], [3, 1, 1, 1]]] * 3
    run = _run(tmp_path, steps)
    assert imbalance_from_run(run) == pytest.approx(5 / 3)
    # A copy per rank evens both: [4,4,0,0] -> 4 | 4; [3,1,1,1]: expert 0 water-filled over rank 0 (at 1) and
    # rank 1 (at 2) -> shares 2 | 1, rows 3 | 3.
    assert imbalance_from_run(run, redundant=1) == 1.0
    run_r = _run(tmp_path, steps, redundant=1)
    assert imbalance_from_run(run_r) == imbalance_from_run(run, redundant=1)


def test_cli_refuses_bad_input(tmp_path, capsys):
    assert main(["plan", "--imbalance-from", str(tmp_path)]) == 2
    assert "no metrics.jsonl" in capsys.readouterr().err
    run = _run(tmp_path, [[[4, 4, 0, 0]]], ep=1)
    assert main(["plan", "--imbalance-from", str(run)]) == 2
    assert "EP 1" in capsys.readouterr().err
    assert main(["plan", "--imbalance-from", str(run), "--imbalance", "1.5"]) == 2
    assert main(["plan", "--redundant-experts", "2"]) == 2
