"""benchmarks/gpu_check.py on a machine without a GPU: every check runs at a small size on CPU or names why it is
skipped, each in its own process; a failing or hanging check gives its own row and the others still run."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

REPO = Path(__file__).resolve().parents[2]
SCRIPT = REPO / "benchmarks" / "gpu_check.py"

pytestmark = pytest.mark.skipif(torch.cuda.is_available(), reason="on a GPU the full check is run by hand (minutes)")


def _run(tmp_path: Path, *args: str, env: dict | None = None) -> tuple[subprocess.CompletedProcess, dict]:
    out = tmp_path / "gc.json"
    proc = subprocess.run([sys.executable, str(SCRIPT), "--steps", "2", "--json", str(out), *args], cwd=tmp_path,
                          capture_output=True, text=True, timeout=900, env={**os.environ, **(env or {})})
    return proc, json.loads(out.read_text()) if out.is_file() else {}


def test_every_check_runs_on_cpu_and_names_what_it_skipped(tmp_path: Path):
    proc, res = _run(tmp_path)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-2000:]
    assert res["device"] == "CPU" and res["quick"] and res["failed"] == []
    groups = {r["group"] for r in res["rows"]}
    list_proc = subprocess.run([sys.executable, str(SCRIPT), "--list"], capture_output=True, text=True, check=True)
    assert groups == set(list_proc.stdout.split()), groups
    checks = {r["check"].split(" (")[0].split(",")[0]: r for r in res["rows"]}
    for name in ("python / torch", "train step MFU", "grouped GEMM vs matmul", "MoE layer fwd+bwd",
                 "dense layer fwd+bwd", "attention core", "trainer: 6 steps", "trainer: resume to step 8",
                 "trainer: ep_overlap", "trainer: FP8 dispatch"):
        assert name in checks, sorted(checks)
    for name in ("trainer: 6 steps", "trainer: resume to step 8", "trainer: ep_overlap", "trainer: FP8 dispatch"):
        assert checks[name]["value"] == "ok", checks[name]
    for name in ("process group", "event timer", "hang monitor during a blocked read"):
        assert checks[name]["value"] == "ok", checks[name]
    assert "skipped:" in proc.stdout and any("FP8 grouped experts" in s for s in res["skipped"])
    # each row is printed as its check ends, not in one table at the end
    assert proc.stdout.index("python / torch") < proc.stdout.index("[env:") < proc.stdout.index("[trainer:")


def _by_group(res: dict) -> dict[str, list[dict]]:
    groups: dict[str, list[dict]] = {}
    for r in res["rows"]:
        groups.setdefault(r["group"], []).append(r)
    return groups


def test_a_failing_or_hanging_check_keeps_the_others(tmp_path: Path):
    proc, res = _run(tmp_path, "--only", "env,attention", env={"MOETRAIN_GPU_CHECK_INJECT": "env:raise"})
    assert proc.returncode == 1
    groups = _by_group(res)
    assert [r["value"] for r in groups["env"]] == ["ERROR"]
    assert "injected failure in env" in groups["env"][0]["detail"]
    assert groups["attention"] and all(r["value"] not in ("ERROR", "TIMEOUT") for r in groups["attention"])
    assert res["failed"] == ["env"]
    proc, res = _run(tmp_path, "--only", "attention,env", env={"MOETRAIN_GPU_CHECK_INJECT": "attention:hang",
                                                                 "MOETRAIN_GPU_CHECK_CPU_LIMIT_S": "20"})
    assert proc.returncode == 1
    groups = _by_group(res)
    assert [r["value"] for r in groups["attention"]] == ["TIMEOUT"]
    assert groups["env"][0]["check"] == "python / torch"
    assert proc.stdout.index("TIMEOUT") < proc.stdout.index("python / torch")  # printed as it ended, in order


def test_unknown_check_is_refused_in_one_line(tmp_path: Path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--only", "nope"], capture_output=True, text=True)
    assert proc.returncode == 2 and "unknown check(s) ['nope']" in proc.stderr
