"""Smoke test of the benchmark suite's cheapest path: it runs, writes its JSON and markdown, and the JSON carries the
figures and ratios. No timing assertions: timing belongs to the benchmarks, not to the tests."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

REPO = Path(__file__).resolve().parents[2]
RUN_ALL = REPO / "benchmarks" / "run_all.py"


@pytest.mark.skipif(not RUN_ALL.exists(), reason="benchmarks/ not present")
def test_quick_moe_layer_writes_json_with_ratios(tmp_path: Path):
    pytest.importorskip("transformers")
    cmd = [sys.executable, str(RUN_ALL), "--quick", "--cases", "moe_layer", "--systems", "moetrain,hf[eager]",
           "--no-wait", "--no-patches", "--out", str(tmp_path)]
    proc = subprocess.run(cmd, cwd=REPO, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    files = sorted(tmp_path.glob("*-quick.json"))
    assert len(files) == 1, list(tmp_path.iterdir())
    res = json.loads(files[0].read_text())
    assert res["command"].startswith("python benchmarks/run_all.py")
    assert res["machine"]["torch"] and res["machine"]["cpu"]
    assert "load_at_start" in res["load"]["moe_layer"]
    case = res["cases"]["moe_layer"]
    rows = {r["system"]: r for r in case["rows"]}
    assert set(rows) == {"moetrain", "hf[eager]"}
    for r in rows.values():
        assert "error" not in r, r
        assert r["tokens_per_s"] > 0 and r["peak_mem_mb"] >= 0
    # Same weights, same input: HF computes the same function as moetrain.
    assert rows["hf[eager]"]["same_function"], rows["hf[eager]"]
    assert case["ratios"]["fastest_peer"] == "hf[eager]"
    assert case["ratios"]["moetrain/fastest_peer"] > 0
    md = files[0].with_suffix(".md").read_text()
    assert "MoE layer forward+backward" in md and "moetrain" in md
