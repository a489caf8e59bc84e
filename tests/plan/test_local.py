"""Local-run prediction (moetrain bench + moetrain.plan.local) and the bench itself (quick mode)."""

from __future__ import annotations

import pytest

from moetrain.model.config import get_preset
from moetrain.plan.local import local_plan, predict_local_train

BENCH = {"bench_version": 2,
         "matmul": {"fp32": [{"n": 64, "tflops": 0.02}, {"n": 256, "tflops": 0.08}, {"n": 1024, "tflops": 0.1}],
                    "bf16": []},
         "memory_bandwidth_gbps": 20.0, "op_overhead_us": 4.0, "cross_entropy_gelem_s": 0.7,
         "all_to_all": {"bandwidth_gbps": 1.0, "latency_us": 200.0},
         "fsdp_unit": {"bandwidth_gbps": 0.2, "latency_us": 4000.0}, "memory_gb": 16}


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


def _step(bench: dict, seq: int = 64, mb: int = 8, **kw) -> float:
    """Predicted step of tiny under forced-balanced routing (learned routing scales the whole step by the solved
    real-routing slowdown, which would blur the per-event sums these tests check)."""
    from dataclasses import replace

    cfg = replace(get_preset("tiny"), routing="balanced")
    return predict_local_train(cfg, seq, mb, 1, world=2, ep=2, bench_json=bench, **kw).step_s


def test_each_fsdp_unit_pays_the_measured_unit_latency_once_per_micro_batch():
    # tiny: blocks d, t, t, t, the MTP block and the root (embedding + head) are the FSDP units of moetrain train
    cfg = get_preset("tiny")
    units = cfg.n_layers + cfg.mtp_depth + 1
    d_lat = 1000.0
    slow = {**BENCH, "fsdp_unit": {**BENCH["fsdp_unit"], "latency_us": BENCH["fsdp_unit"]["latency_us"] + d_lat}}
    assert _step(slow) - _step(BENCH) == pytest.approx(units * d_lat * 1e-6, rel=1e-6)


def test_every_dispatcher_call_pays_the_measured_all_to_all_latency():
    from moetrain.parallel.dispatch import AllToAllDispatcher

    cfg = get_preset("tiny")
    moe_layers = cfg.n_layers - cfg.n_dense_layers + cfg.mtp_depth
    calls = sum(AllToAllDispatcher.CALLS_DEDUP)
    d_lat = 500.0
    slow = {**BENCH, "all_to_all": {**BENCH["all_to_all"], "latency_us": BENCH["all_to_all"]["latency_us"] + d_lat}}
    assert _step(slow) - _step(BENCH) == pytest.approx(moe_layers * calls * d_lat * 1e-6, rel=1e-6)


def test_a_slower_cross_entropy_rate_slows_the_step():
    assert _step({**BENCH, "cross_entropy_gelem_s": 0.1}) > _step(BENCH)


def test_old_bench_files_are_refused_with_the_fix():
    from moetrain.plan.hardware import HardwareError, gpu_from_bench

    old = {k: v for k, v in BENCH.items() if k not in ("bench_version", "fsdp_unit", "cross_entropy_gelem_s")}
    with pytest.raises(HardwareError, match="rerun `moetrain bench`"):
        gpu_from_bench(old)


def test_latency_bandwidth_fit_recovers_a_line():
    from moetrain.plan.bench import fit_latency_bandwidth

    xs = [1e3, 1e5, 1e6, 4e6]
    lat, bw = fit_latency_bandwidth(xs, [2e-4 + x / 1.5e9 for x in xs])
    assert lat == pytest.approx(2e-4, rel=1e-6) and bw == pytest.approx(1.5e9, rel=1e-6)
    # noise that makes the slope non-positive falls back to the largest point's average rate
    lat, bw = fit_latency_bandwidth([1e3, 1e6], [3e-3, 2e-3])
    assert lat == 2e-3 and bw == pytest.approx(1e6 / 2e-3)


@pytest.mark.dist
def test_quick_bench(tmp_path):
    from moetrain.plan.bench import run_bench
    from moetrain.plan.hardware import gpu_from_bench

    res = run_bench(tmp_path / "b.json", procs=2, quick=True, verbose=False)
    assert res["matmul"]["fp32"][0]["tflops"] > 0
    for key in ("all_to_all", "all_to_all_idle", "all_gather", "reduce_scatter", "fsdp_unit"):
        assert res[key]["bandwidth_gbps"] > 0 and res[key]["latency_us"] >= 0
    assert res["cross_entropy_gelem_s"] > 0 and res["bench_version"] == 2
    g = gpu_from_bench(tmp_path / "b.json")
    assert g.peak_tflops["fp32"] > 0 and g.fsdp_unit_latency_us is not None and g.softmax_gelem_s > 0


def test_plan_cli_on_the_local_gpu_counts_moetrains_own_calls(tmp_path):
    """`moetrain plan --gpu local` and predict_local_train charge the same operator and all-to-all counts."""
    import json
    from dataclasses import replace

    from moetrain.plan.cli import main

    bench = tmp_path / "bench.json"
    bench.write_text(json.dumps(BENCH))
    out = tmp_path / "p.json"
    assert main(["plan", "--gpu", "local", "--bench-file", str(bench), "--gpus", "2", "--model", "tiny", "--ep", "2",
                 "--mbs", "8", "--gbs", "16", "--seq", "64", "--precision", "fp32", "--optimizer", "fp32", "--fsdp",
                 "--routing", "balanced", "--no-ep-overlap", "--json-out", str(out)]) == 0
    cli = json.loads(out.read_text())
    cfg = replace(get_preset("tiny"), routing="balanced")
    ref = predict_local_train(cfg, 64, 8, 1, world=2, ep=2, bench_json=BENCH)
    assert cli["step_s"]["step"] == pytest.approx(ref.step_s, rel=1e-9)


def test_local_pipelined_plan_is_the_run_the_trainer_makes(tmp_path):
    """`moetrain plan --gpu local --pp 2` plans what `moetrain train --pp 2` runs: DP = world / PP, the schedule's
    micro-batches, the trainer's default layer split; its bubble follows the schedule."""
    import argparse
    import json

    from moetrain.plan.cli import _builtin_job_plan as _trainer_plan
    from moetrain.plan.model import predict
    from moetrain.plan.hardware import gpu_from_bench
    from moetrain.plan.shape import load_shape

    shape = load_shape("tiny")
    args = argparse.Namespace(pp=2, vpp=None, schedule=None, pp_layout=None)
    from moetrain.config import load_job_config

    def trainer_split(*sets):  # the split `moetrain train` makes: the planner's cost-balanced one (issue 28)
        return load_job_config(None, ["parallel.pp=2", *sets], world=2).parallel.pp_layout

    p = _trainer_plan(shape, 2, args)
    assert (p.pp, p.dp, p.micro_batch, p.n_microbatches, p.pp_layout) == (2, 1, 16, 2, trainer_split())
    assert p.pp_layout == "Ettt|tmL"  # the cost-balanced split (the even one was "Ett|ttmL")
    v = _trainer_plan(shape, 2, argparse.Namespace(pp=2, vpp=2, schedule="interleaved-1f1b", pp_layout=None))
    assert (v.vpp, v.pp_layout) == (2, trainer_split("parallel.vpp=2", 'parallel.schedule="interleaved"'))
    assert v.pp_layout == "Ett|t|t|mL"  # (the even one was "Et|t|t|tmL")
    (tmp_path / "b.json").write_text(json.dumps(BENCH))
    gpu = gpu_from_bench(str(tmp_path / "b.json"))
    b1, b2 = (predict(shape, gpu, 2, x).step.bubble for x in (p, v))
    assert b1 > b2 > 0  # interleaving shrinks the bubble
