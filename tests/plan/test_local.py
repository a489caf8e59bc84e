"""Local-run prediction (moetrain bench + moetrain.plan.local) and the bench itself (quick mode)."""

from __future__ import annotations

import pytest

from moetrain.model.config import get_preset
from moetrain.plan.local import local_plan, predict_local_train

BENCH = {"matmul": {"fp32": [{"n": 64, "tflops": 0.02}, {"n": 256, "tflops": 0.08}, {"n": 1024, "tflops": 0.1}],
                    "bf16": []},
         "memory_bandwidth_gbps": 20.0, "op_overhead_us": 4.0,
         "all_to_all": {"bandwidth_gbps": 1.0, "latency_us": 200.0}, "memory_gb": 16}


def test_local_plan_matches_the_trainer_layout():
    p = local_plan(get_preset("tiny"), 256, 8, 2, world=2, ep=2)
    assert (p.dp, p.ep, p.global_batch, p.fsdp, p.precision) == (2, 2, 32, True, "fp32")


def test_predict_local_train_is_positive_and_scales_with_work():
    cfg = get_preset("tiny")
    a = predict_local_train(cfg, 256, 8, 1, world=2, ep=2, bench_json=BENCH)
    b = predict_local_train(cfg, 256, 8, 1, world=2, ep=2, bench_json={**BENCH, "op_overhead_us": 40.0})
    assert a.tokens_per_s_per_proc > b.tokens_per_s_per_proc > 0
    assert a.tokens_per_s == pytest.approx(2 * a.tokens_per_s_per_proc)
    assert a.prediction.step.exposed_a2a > 0  # EP=2 over gloo


@pytest.mark.dist
def test_quick_bench(tmp_path):
    from moetrain.plan.bench import run_bench
    from moetrain.plan.hardware import gpu_from_bench

    res = run_bench(tmp_path / "b.json", procs=2, quick=True, verbose=False)
    assert res["matmul"]["fp32"][0]["tflops"] > 0
    assert res["all_to_all"]["bandwidth_gbps"] > 0 and res["all_to_all"]["latency_us"] > 0
    g = gpu_from_bench(tmp_path / "b.json")
    assert g.peak_tflops["fp32"] > 0
