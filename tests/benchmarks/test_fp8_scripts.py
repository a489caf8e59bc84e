"""The FP8 benchmark scripts that only a GPU runs in earnest, run on CPU so that a lent GPU's minutes are not lost to
a slip in them: ``fp8_gpu_verify``'s correctness checks (the CPU reference path stands in for the kernels, so every
difference must be 0; the GEMM and expert checks with CPU emulators of the kernels patched in) and
``fp8_division_rounding``'s claim that a quotient rounded another way changes codes and moves dW past the fp32
bound at the tiny linear's shape."""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

BENCH = Path(__file__).resolve().parents[2] / "benchmarks"


@pytest.fixture()
def bench_path(monkeypatch):
    monkeypatch.syspath_prepend(str(BENCH))
    yield
    for name in ("fp8_gpu_verify", "fp8_division_rounding"):
        sys.modules.pop(name, None)


def test_gpu_verify_correctness_checks_run_on_cpu_and_find_no_difference(bench_path, monkeypatch):
    import fp8_gpu_verify as v

    monkeypatch.setattr(v, "DEV", torch.device("cpu"))
    monkeypatch.setattr(v, "RESULTS", [])
    v.linear_check("tiny")
    v.check("compiled quantisers equal the definitions", v.quantiser_agreement)
    assert [r["ok"] for r in v.RESULTS] == [True, True], v.RESULTS
    linear = v.RESULTS[0]["detail"]
    assert "dW 0.0e+00 (limit 5.7e-04)" in linear  # dW is held to the fp32 output's bound
    assert "dW vs its own operands 0.0e+00" in linear and "x 0, dy^T 0, x^T 0" in linear


def test_gpu_verify_kernel_checks_pass_on_cpu_with_the_kernels_emulated(bench_path, monkeypatch):
    # gemm_checks and expert_check call the CUDA kernels (blockwise F.scaled_mm, torch._scaled_grouped_mm): here CPU
    # emulators that read operands and scales where the kernels do (tests/precision/emulated_kernels.py) stand in,
    # with the device gates patched to True, so the checks run the kernel paths' code and their verdicts are real
    import fp8_gpu_verify as v

    from moetrain.precision import gemm, grouped
    from tests.precision.emulated_kernels import EmulatedScaledGroupedMM, EmulatedScaledMM

    mm, gmm = EmulatedScaledMM(), EmulatedScaledGroupedMM()
    monkeypatch.setattr(gemm, "F", mm)
    monkeypatch.setattr(gemm, "blockwise_kernel", lambda device: True)
    monkeypatch.setattr(torch, "_scaled_grouped_mm", gmm, raising=False)
    monkeypatch.setattr(grouped, "grouped_kernel", lambda device: True)
    monkeypatch.setattr(v, "DEV", torch.device("cpu"))
    monkeypatch.setattr(v, "RESULTS", [])
    v.gemm_checks("tiny")
    v.expert_check("tiny")
    assert [r["ok"] for r in v.RESULTS] == [True] * 4, v.RESULTS
    # the blockwise emulator multiplies the dequantised blocks as fp8_mm_reference does: any misplaced scale shows
    assert all("fprop 0.0e+00 dgrad 0.0e+00 wgrad 0.0e+00" in r["detail"] for r in v.RESULTS[:3]), v.RESULTS
    assert mm.calls == 3 * 3 and gmm.calls == ["2d3d", "2d3d", "2d2d"]  # every GEMM went through a kernel
    assert "empty expert dW = 0 and padding rows 0: True" in v.RESULTS[-1]["detail"], v.RESULTS[-1]


def test_another_rounding_of_the_quotient_changes_codes_and_moves_dw(bench_path):
    import fp8_division_rounding as d

    from moetrain.precision.gemm import fast_path_rtol

    r = d.run("tiny", *d.SHAPES["tiny"])
    assert 0.003 < r["near_midpoint_share_x"] < 0.02, r
    assert r["codes_changed"]["x"] > 0 and r["codes_changed"]["x^T"] > 0, r
    assert r["rel_error"]["dW"] > 5 * fast_path_rtol(torch.float32), r
