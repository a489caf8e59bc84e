"""Issue "moetrain plan must generalise": the mechanisms that are inputs now (dispatcher, schedule-driven EP
overlap, host launch cost, recipe vocabulary), the validation set and its report, --compare, and a search that
keeps to what a framework runs."""

from __future__ import annotations

import json

import pytest

from moetrain.plan import Plan, PlanError, predict
from moetrain.plan import validation
from moetrain.plan.cli import main as plan_main
from moetrain.plan.hardware import get_gpu
from moetrain.plan.model import _Ctx, a2a_rows
from moetrain.plan.constants import efficiency_for
from moetrain.plan.plan import RECOMPUTE_MODULES, validate
from moetrain.plan.records import RECORDS
from moetrain.plan.search import search
from moetrain.plan.shape import load_shape

DS = "deepseek-v3-671b"


def _ctx(plan: Plan, gpu: str = "h100", n: int = 1024) -> _Ctx:
    shape, spec = load_shape(DS), get_gpu(gpu)
    plan = plan.replace(imbalance=1.2) if plan.routing == "real" else plan
    return _Ctx(shape, spec, validate(plan, shape, spec, n), efficiency_for(spec.generation))


def test_dispatcher_rows_follow_the_routing_statistics():
    base = Plan(tp=2, pp=8, vpp=4, ep=64, global_batch=8192, precision="fp8")
    flex = a2a_rows(_ctx(base.replace(dispatcher="flex")))
    a2a = a2a_rows(_ctx(base.replace(dispatcher="alltoall")))
    ag = a2a_rows(_ctx(base.replace(dispatcher="allgather")))
    # top-8 of 256 experts on 64 ranks: up to 8 pairs per token, fewer distinct ranks, fewer distinct nodes
    assert 7.0 < sum(a2a) <= 8.0
    assert flex[1] < 0.5 * a2a[1]           # one NIC copy per destination node, not per expert
    assert ag[0] == 63 and ag[1] > 2 * flex[1]
    rec = RECORDS["h100"].plan
    slow = predict(DS, "h100", 1024, rec.replace(dispatcher="alltoall"))
    fast = predict(DS, "h100", 1024, rec.replace(dispatcher="flex"))
    assert slow.step.exposed_a2a > fast.step.exposed_a2a
    assert slow.details["dispatcher"] == "alltoall"
    # the default follows the framework, never silently the best one
    assert Plan().resolved_dispatcher == "alltoall" and Plan(framework="deepseek").resolved_dispatcher == "flex"
    with pytest.raises(PlanError, match="dispatcher"):
        predict(DS, "h100", 1024, base.replace(dispatcher="deepep"))


def test_ep_overlap_follows_the_schedule():
    def sched(**kw):
        return Plan(ep=8, ep_overlap=True, **kw)

    assert sched(pp=4, global_batch=64).overlap_schedule is None          # plain 1F1B with PP > 1: nothing pairs
    assert sched(pp=1, global_batch=2, dp=1).overlap_schedule == "paired-microbatch"
    assert sched(pp=1, global_batch=1, dp=1).overlap_schedule is None     # one micro-batch: no partner
    assert sched(pp=4, vpp=2).overlap_schedule == "combined-1f1b"
    assert sched(pp=4, schedule="interleaved-1f1b", vpp=2).resolved_schedule == "interleaved"
    assert Plan(ep=8, pp=4, schedule="dualpipev").overlap_schedule == "dualpipev"
    assert Plan(ep=8, pp=4, schedule="dualpipe").overlap_schedule == "dualpipe"
    assert sched(pp=4, schedule="zbv").overlap_schedule is None
    # PP = 1: EP overlap hides the all-to-all once there are two micro-batches, not with one
    shape = "deepseek-v2-lite-16b"
    p1 = Plan(ep=8, micro_batch=1, global_batch=32, seq_len=4096, precision="bf16")
    on = predict(shape, "h100", 8, p1.replace(ep_overlap=True))
    off = predict(shape, "h100", 8, p1.replace(ep_overlap=False))
    assert on.step.exposed_a2a < 0.7 * off.step.exposed_a2a
    # 1F1B at PP 2 with ep_overlap requested: same as no overlap
    p2 = Plan(pp=2, ep=4, micro_batch=1, global_batch=16, seq_len=4096)
    a = predict(shape, "h100", 8, p2.replace(ep_overlap=True))
    b = predict(shape, "h100", 8, p2.replace(ep_overlap=False))
    assert a.step.step == pytest.approx(b.step.step)


def test_v_schedules_run_with_the_trainers_names():
    p = Plan(pp=4, ep=2, micro_batch=1, global_batch=64, seq_len=4096)
    z = predict("deepseek-v2-lite-16b", "h100", 8, p.replace(schedule="zbv", vpp=2))   # the trainer's VPP 2
    f = predict("deepseek-v2-lite-16b", "h100", 8, p.replace(schedule="1f1b"))
    v = predict("deepseek-v2-lite-16b", "h100", 8, p.replace(schedule="dualpipev", vpp=2, ep_overlap=True))
    d = predict("deepseek-v2-lite-16b", "h100", 8, p.replace(schedule="dualpipe"))
    assert len(z.details["stages"]) == 8 and z.step.bubble < f.step.bubble
    assert len(v.details["stages"]) == 8 and v.plan.vpp == 1 and v.details["overlap_schedule"] == "dualpipev"
    assert v.step.exposed_a2a < z.step.exposed_a2a        # F&B pairs hide the all-to-all, ZBV does not
    assert v.memory.weights < d.memory.weights            # one copy of the parameters, not DualPipe's two
    i = predict("deepseek-v2-lite-16b", "h100", 8, p.replace(schedule="interleaved-1f1b", vpp=2))
    assert i.plan.resolved_schedule == "interleaved"


def test_host_launch_cost_without_cuda_graphs():
    # a small model with few tokens per GPU: eager launches bound the step, whole-iteration graphs remove them
    p = Plan(ep=8, micro_batch=1, global_batch=8, seq_len=1024, precision="bf16")
    eager = predict("deepseek-v2-lite-16b", "gb200", 8, p.replace(cuda_graphs="none"))
    graphs = predict("deepseek-v2-lite-16b", "gb200", 8, p.replace(cuda_graphs="full"))
    partial = predict("deepseek-v2-lite-16b", "gb200", 8, p.replace(cuda_graphs="partial"))
    assert graphs.step.compute_parts["host launch"] == 0.0
    assert eager.step.compute_parts["host launch"] > partial.step.compute_parts["host launch"] > 0.0
    assert eager.tflops_per_gpu < partial.tflops_per_gpu < graphs.tflops_per_gpu


def test_host_cost_follows_the_host_cpu_and_the_local_experts():
    # the same eager step on a Grace host (GB200 NVL72) costs more host time than on an x86 one; an eager grouped
    # GEMM launches its kernels once per local expert, so fewer EP ranks (more experts each) mean more launches
    from moetrain.plan.hardware import with_overrides
    from moetrain.plan.model import host_launch_s

    p = Plan(ep=8, micro_batch=1, global_batch=8, seq_len=1024, precision="bf16", cuda_graphs="partial")
    shape, grace = load_shape("deepseek-v2-lite-16b"), get_gpu("gb200")
    assert grace.host_cpu == "grace" and get_gpu("b200").host_cpu == "x86"
    x86 = with_overrides(grace, host_cpu="x86")

    def host(spec, plan, n=8):
        return host_launch_s(_Ctx(shape, spec, validate(plan, shape, spec, n), efficiency_for(spec.generation)), "t")

    assert host(grace, p) > host(x86, p) > 0.0
    assert host(x86, p.replace(ep=4, global_batch=8)) > host(x86, p)
    assert host(x86, p.replace(cuda_graphs="full")) == 0.0


def test_sustained_tensor_rate_per_sku():
    # HGX B200 sustains less of its generation's tensor rate than its datasheet peak says (power cap; sourced in
    # the catalogue); the other SKUs take the generation's figure
    from moetrain.plan.hardware import CATALOGUE, with_overrides

    b200 = get_gpu("b200")
    assert b200.tensor_sustain < 1.0 and "#1747" in b200.source
    assert all(g.tensor_sustain == 1.0 for k, g in CATALOGUE.items() if k != "b200")
    p = next(pt.plan for pt in validation.POINTS if pt.key == "dsv3-b200-gbs4096")
    slow = predict(DS, b200, 256, p)
    full = predict(DS, with_overrides(b200, tensor_sustain=1.0), 256, p)
    assert slow.step.compute_parts["dense GEMM"] > full.step.compute_parts["dense GEMM"]
    assert slow.tflops_per_gpu < full.tflops_per_gpu


def test_megatron_recompute_names_and_mtp_depth():
    base = RECORDS["gb300"].plan
    none = predict(DS, "gb300", 256, base)
    for mod in RECOMPUTE_MODULES:
        pr = predict(DS, "gb300", 256, base.replace(recompute="selective", recompute_modules=(mod,)))
        assert pr.fits and pr.memory.activations <= none.memory.activations + 1e-9, mod
        assert pr.step.step >= none.step.step * 0.999, mod
    moe = predict(DS, "gb300", 256, base.replace(recompute="selective", recompute_modules=("moe",)))
    assert moe.memory.activations < 0.8 * none.memory.activations
    assert predict(DS, "gb300", 256, base.replace(recompute="selective", recompute_modules=("norm",))).fits
    off = predict(DS, "gb300", 256, base.replace(mtp_depth=0, pp_layout="Et*4|(t*4|)*14tL"))
    assert off.flops_per_token == pytest.approx(249.8e9, rel=1e-3)
    with pytest.raises(PlanError, match="MTP"):
        predict(DS, "gb300", 256, base.replace(mtp_depth=0))   # the layout still places an MTP module


def test_comm_kernels_take_their_sms():
    assert _ctx(RECORDS["gb200"].plan, "gb200", 256).comm_share == pytest.approx(32 / 148)
    assert _ctx(RECORDS["gb300"].plan, "gb300", 256).comm_share == pytest.approx(32 / 160)
    assert _ctx(RECORDS["h800"].plan, "h800", 2048).comm_share == pytest.approx(20 / 132)


def test_cli_records_refuse_flags_and_record_overrides_keep_the_published_figure(capsys):
    assert plan_main(["--records", "--tp", "2"]) == 2
    assert "would ignore --tp" in capsys.readouterr().err
    assert plan_main(["--record", "gb300", "--pp", "4", "--vpp", "4"]) == 0
    out = capsys.readouterr().out
    assert "1,648" in out and "for comparison" in out and "--pp 4" in out
    assert plan_main(["--compare", "gb300", "gb200"]) == 0
    out = capsys.readouterr().out
    assert "exposed all-to-all" in out and "largest differences" in out


def test_validation_set_and_report(capsys):
    assert len(validation.POINTS) >= 8
    keys = [p.key for p in validation.POINTS]
    assert len(set(keys)) == len(keys) and not set(keys) & set(RECORDS)
    models = {p.model for p in validation.POINTS}
    gpus = {p.gpu for p in validation.POINTS}
    assert len(models) >= 2 and {"b200", "b300"} <= gpus
    for p in validation.POINTS:
        assert p.source and p.note and p.tflops_per_gpu > 0
    rows = validation.run()
    gens = {"b200": "blackwell", "b300": "blackwell", "gb200": "blackwell", "gb300": "blackwell", "h100": "hopper"}
    for r in rows:
        assert r.prediction is not None, f"{r.point.key}: {r.message}"      # every plan is valid
        # the same constants for every point of a generation (none per point)
        assert r.prediction.details["efficiency"] == efficiency_for(gens[r.point.gpu]).to_dict()
    assert plan_main(["--validate", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    errs = [abs(x["error"]) for x in d["points"] if x["error"] is not None]
    assert d["summary"]["mae"] == pytest.approx(sum(errs) / len(errs))
    assert d["summary"]["points"] == len(validation.POINTS)
    # the MAE per software release covers every point once
    rel = d["summary"]["by_release"]
    assert sum(b["points"] for b in rel.values()) == len(validation.POINTS) and "26.06" in rel
    assert {p.release for p in validation.POINTS} == set(rel)


@pytest.mark.xfail(strict=True, reason="validation MAE ~41% over 23 points (goal 12%; 29% on the records' 26.06 "
                   "release): every point over-predicted (DeepSeek-V3 on GB300 least), most on HGX systems at "
                   "256 GPUs, small models on H100 and Qwen3 on GB200; see docs/validation.md")
def test_validation_goal():
    s = validation.summary(validation.run())
    assert s["goal_met"], s


def test_search_keeps_to_the_framework():
    base = Plan(ep=8, micro_batch=1, global_batch=64, seq_len=4096, precision="fp8", framework="moetrain")
    res = search("deepseek-v2-lite-16b", "h100", 16, base, micro_batch=(1,), vpp=(2,))
    assert res.ranked and res.framework == "moetrain"
    for p in res.ranked:
        assert p.plan.tp == 1 and p.plan.cp == 1 and p.plan.precision == "bf16" and p.plan.fsdp
    anyf = search("deepseek-v2-lite-16b", "h100", 16, base, micro_batch=(1,), vpp=(2,), framework=None)
    assert any(p.plan.tp > 1 for p in anyf.ranked)
