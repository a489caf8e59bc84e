"""benchmarks/gpu_check.py runs on a machine without a GPU: every CPU check at a small size, one table, the skipped
checks named, the fast paths it can run agreeing with the reference."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"


@pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the full check is run by hand (minutes)")
def test_gpu_check_runs_on_cpu_and_names_what_it_skipped(tmp_path: Path):
    out = tmp_path / "gc.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--steps", "1", "--json", str(out)], cwd=REPO,
                          capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-2000:]
    res = json.loads(out.read_text())
    checks = {r["check"].split(" (")[0]: r for r in res["rows"]}
    assert res["device"] == "CPU" and res["quick"] and res["fast_paths_ok"]
    for name in ("train step MFU", "grouped GEMM vs matmul", "FP8 GEMM blockwise", "FP8 GEMM mxfp8",
                 "SDPA kernel, MLA tiny", "host-device syncs per training step"):
        assert name in checks, sorted(checks)
    assert checks["host-device syncs per training step"]["value"] == "skipped"
    assert checks["FP8 GEMM row-wise CPU"]["detail"].endswith("ok")
    assert any(k.startswith("FP8 blockwise vs") for k in checks) and any(k.startswith("FP8 mxfp8 vs") for k in checks)
    assert "skipped:" in proc.stdout and any("host-device syncs" in s for s in res["skipped"])
