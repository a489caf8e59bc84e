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
    # --list: one check a line, its name, two spaces, what it measures
    listed = dict(line.split("  ", 1) for line in list_proc.stdout.splitlines())
    assert groups == {name.strip() for name in listed}, groups
    assert all(text.strip() for text in listed.values()), listed
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


def test_list_prints_each_checks_description(tmp_path: Path):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--list"], capture_output=True, text=True, check=True)
    lines = proc.stdout.splitlines()
    assert [line.split()[0] for line in lines] == list(_gpu_check_module().CHECKS)
    assert "loss_gap      FP8 (both recipes) against bf16, loss of the tiny model after --steps steps." in lines
    assert "env           torch, CUDA, NCCL, GPU, Python." in lines


@pytest.mark.parametrize("args,needle", [
    (["--json", "/nonexistent/dir/x.json"], "gpu_check.py: error: --json /nonexistent/dir/x.json: the folder "
                                            "/nonexistent/dir does not exist"),
    (["--json", "."], "--json . is a directory"),
    (["--steps", "0"], "argument --steps: 0 must be >= 1"),
    (["--budget-s", "-5"], "argument --budget-s: -5 must be >= 15"),
    (["--budget-s", "0"], "argument --budget-s: 0 must be >= 15"),
], ids=["json_folder", "json_dir", "steps", "budget_negative", "budget_zero"])
def test_bad_options_are_refused_before_any_check(tmp_path: Path, args, needle):
    proc = subprocess.run([sys.executable, str(SCRIPT), "--only", "env", *args], capture_output=True, text=True,
                          cwd=tmp_path, timeout=120)
    assert proc.returncode == 2 and needle in proc.stderr, proc.stderr
    assert proc.stdout == "" and "Traceback" not in proc.stderr  # no check started
    assert proc.stderr.strip().splitlines()[-1].startswith("gpu_check.py: error: "), proc.stderr


def test_budget_spent_leaves_not_run_rows_and_a_failing_exit(tmp_path: Path):
    """--budget-s cuts the running check's limit to what is left and starts no check once under 15 s are left: the
    hanging first check is stopped at the budget, the others are "not run" rows, and the exit status is 1."""
    proc, res = _run(tmp_path, "--only", "env,attention,layers", "--budget-s", "20",
                     env={"MOETRAIN_GPU_CHECK_INJECT": "env:hang"})
    assert proc.returncode == 1, proc.stdout[-3000:]
    groups = _by_group(res)
    assert [r["value"] for r in groups["env"]] == ["TIMEOUT"]
    assert groups["env"][0]["detail"].startswith("over 20 s")  # the check's 240 s CPU limit, cut to the budget
    for name in ("attention", "layers"):
        assert [(r["check"], r["value"], r["detail"]) for r in groups[name]] == [
            (name, "not run", "--budget-s 20 spent")]
    assert res["failed"] == ["env", "attention", "layers"]
    assert proc.stdout.rstrip().splitlines()[-1].endswith("FAILED: ['env', 'attention', 'layers']")


def test_env_row_names_this_torch_python_and_device(tmp_path: Path):
    import platform

    proc, res = _run(tmp_path, "--only", "env")
    assert proc.returncode == 0, proc.stdout[-3000:]
    assert res["device"] == "CPU" and res["failed"] == []
    env, gpu = res["rows"]
    assert env["check"] == "python / torch" and env["value"] == torch.__version__
    assert env["detail"] == (f"Python {platform.python_version()}, CUDA {torch.version.cuda}, NCCL -, gloo True, "
                             f"nccl {torch.distributed.is_nccl_available()}")
    assert (gpu["check"], gpu["value"], gpu["detail"]) == ("GPU", "skipped", "no CUDA device visible")


def _gpu_check_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("gpu_check_under_test", SCRIPT)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _validation_layer_rows() -> dict[str, tuple[float, dict[str, float]]]:
    """docs/validation.md's H200 layer table: layer -> (predicted ms, predicted parts ms)."""
    import re

    text = (REPO / "docs" / "validation.md").read_text()
    rows = {}
    for kind, label in (("t", "MoE"), ("d", "dense")):
        cells = [c.strip() for c in re.search(rf"^\| {label} \(.*$", text, re.M).group(0).strip("|").split("|")]
        parts = {name: float(ms) for name, ms in (part.rsplit(" ", 1) for part in cells[4].split(", "))}
        rows[kind] = (float(cells[2].removesuffix(" ms")), parts)
    return rows


def test_planned_layer_times_are_the_planners_figures_in_the_validation_doc():
    """The layers rows set the measurement beside ``moetrain plan --gpu h200``'s DeepSeek-V3 layer: the planner's
    figures, computed here, are the ones docs/validation.md records (31.8 ms MoE, 26.1 ms dense)."""
    gc = _gpu_check_module()
    doc = _validation_layer_rows()
    assert doc["t"][0] == 31.8 and doc["d"][0] == 26.1
    key = {"GEMM": "gemm", "grouped GEMM": "grouped", "attention": "attention", "memory-bound": "memory_bound"}
    for kind in ("t", "d"):
        plan = gc._planned_layer_s(kind, 4096, quick=False)
        doc_ms, doc_parts = doc[kind]
        assert plan["compute"] * 1e3 == pytest.approx(doc_ms, abs=0.06), (kind, plan)
        assert {key[k]: v for k, v in doc_parts.items()} == pytest.approx(
            {key[k]: plan[key[k]] * 1e3 for k in doc_parts}, abs=0.006)
        assert plan["a2a"] >= 0 and plan["compute"] == pytest.approx(
            sum(plan[k] for k in ("gemm", "grouped", "attention", "head", "memory_bound", "recompute", "overhead",
                                  "host_launch")), rel=1e-9)
    assert gc._planned_layer_s("t", 4096, quick=True) is None  # no prediction for the CPU's tiny layer
