"""Issue "moetrain plan must generalise": the mechanisms that are inputs now (dispatcher, schedule-driven EP
overlap, host launch cost, recipe vocabulary), the validation set and its report, --compare, and a search that
keeps to what a framework runs."""

from __future__ import annotations

import json
import math

import pytest

from moetrain.plan import Plan, PlanError, predict
from moetrain.plan import validation
from moetrain.plan.cli import main as plan_main
from moetrain.plan.hardware import GPUSpec, get_gpu
from moetrain.plan.model import CostContext, a2a_rows
from moetrain.plan.constants import efficiency_for
from moetrain.plan.plan import RECOMPUTE_MODULES, validate
from moetrain.plan.records import RECORDS
from moetrain.plan.search import search
from moetrain.plan.shape import ModelShape, load_shape

DS = "deepseek-v3-671b"


def _ctx(plan: Plan, gpu: str | GPUSpec = "h100", n: int = 1024, shape: ModelShape | None = None) -> CostContext:
    """The model's context for ``plan`` on ``n`` GPUs (a catalogue name or a spec) of ``shape`` (default
    DeepSeek-V3)."""
    shape = shape or load_shape(DS)
    spec = gpu if isinstance(gpu, GPUSpec) else get_gpu(gpu)
    plan = plan.replace(imbalance=1.2) if plan.routing == "real" else plan
    return CostContext(shape, spec, validate(plan, shape, spec, n), efficiency_for(spec.generation))


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
    from moetrain.plan.model import host_launch

    p = Plan(ep=8, micro_batch=1, global_batch=8, seq_len=1024, precision="bf16", cuda_graphs="partial")
    shape, grace = load_shape("deepseek-v2-lite-16b"), get_gpu("gb200")
    assert grace.host_cpu == "grace" and get_gpu("b200").host_cpu == "x86"
    x86 = with_overrides(grace, host_cpu="x86")

    def host(spec, plan, n=8):
        return host_launch(_ctx(plan, spec, n, shape), "t").total

    assert host(grace, p) > host(x86, p) > 0.0
    assert host(x86, p.replace(ep=4, global_batch=8)) > host(x86, p)
    assert host(x86, p.replace(cuda_graphs="full")) == 0.0


def test_sustained_tensor_rate_per_sku():
    # Where one harness measured two SKUs of a generation under load, the slower one sustains its measured share
    # of the other (sourced in the catalogue); HGX B200 from its own measurement; HGX B300, unmeasured under load,
    # its HGX sibling's rate times their power limits; the rest take the generation's figure
    from moetrain.plan.hardware import CATALOGUE, with_overrides

    b200, b300, gb200 = get_gpu("b200"), get_gpu("b300"), get_gpu("gb200")
    assert b200.tensor_sustain < 1.0 and "#1747" in b200.source
    assert b300.tensor_sustain == pytest.approx(b200.tensor_sustain * b300.power_w / b200.power_w, abs=1e-3)
    # the power-limit rule B300 relies on, against the SKUs that were measured: GB200 / GB300 and H200 / H100
    gb300, h100, h200 = get_gpu("gb300"), get_gpu("h100"), get_gpu("h200")
    assert gb200.tensor_sustain / gb300.tensor_sustain == pytest.approx(gb200.power_w / gb300.power_w, rel=0.03)
    assert h200.tensor_sustain / h100.tensor_sustain == pytest.approx(h200.power_w / h100.power_w, rel=0.01)
    assert gb200.tensor_sustain == pytest.approx(2906.9 / 3308.5, abs=1e-3) and "Azure" in gb200.source
    assert all(g.tensor_sustain == 1.0 for k, g in CATALOGUE.items() if k not in ("b200", "b300", "gb200"))
    p = next(pt.plan for pt in validation.POINTS if pt.key == "dsv3-b200-gbs4096")
    slow = predict(DS, b200, 256, p)
    full = predict(DS, with_overrides(b200, tensor_sustain=1.0), 256, p)
    assert slow.step.compute_parts["dense GEMM"] > full.step.compute_parts["dense GEMM"]
    assert slow.tflops_per_gpu < full.tflops_per_gpu
    # same datasheet peaks, same plan: GB200 is slower than GB300 by its sustained rate, not by its clock on paper
    rec = RECORDS["gb200"].plan
    g2 = predict(DS, gb200, 256, rec)
    g2_at_gb300_rate = predict(DS, with_overrides(gb200, tensor_sustain=1.0), 256, rec)
    assert g2.step.compute_parts["expert GEMM"] == pytest.approx(
        g2_at_gb300_rate.step.compute_parts["expert GEMM"] / gb200.tensor_sustain, rel=0.05)


def test_gemm_shape_factor_against_its_sources():
    from moetrain.plan.constants import BLACKWELL, GEMM_REF_K, HOPPER

    for eff in (HOPPER, BLACKWELL):
        assert eff.shape_factor(GEMM_REF_K, True) == 1.0 and eff.shape_factor(GEMM_REF_K, False) == 1.0
        # the same time per output tile: FP8's K0 is larger by its rate over BF16's, so FP8 is never the slower
        assert eff.tile_k0(True) == pytest.approx(2 * eff.gemm_fp8 / eff.gemm_bf16 * eff.tile_k0(False))
        for k in (16, 64, 512, 2048):
            assert 2 * eff.gemm_fp8 * eff.shape_factor(k, True) > eff.gemm_bf16 * eff.shape_factor(k, False)
    assert HOPPER.tile_k0(True) == pytest.approx(500)
    # hand-computed: Hopper FP8 K0 = 500
    assert HOPPER.shape_factor(512, True) == pytest.approx((512 / 1012) / (8192 / 8692))
    # DeepGEMM's H800 FP8 table (README at 327ec92, M = 4,096; the rows K0 was fitted on): one scale times the
    # shape factor gives every row within 6%
    rows = ((512, 775), (1536, 1212), (2048, 1168), (7168, 1410), (16384, 1520))
    scale = math.exp(sum(math.log(t / HOPPER.shape_factor(k, True)) for k, t in rows) / len(rows))
    for k, tflops in rows:
        assert scale * HOPPER.shape_factor(k, True) == pytest.approx(tflops, rel=0.06), k
    # cuBLAS BF16 on B200, M = N = 8,192 (tritonbench #1011): K = 1,024 / 2,048 / 4,096 vs 8,192 (959)
    for k, tflops in ((1024, 714), (2048, 839), (4096, 915)):
        assert BLACKWELL.shape_factor(k, False) == pytest.approx(tflops / 959, rel=0.02), k


def test_fp8_weight_gradient_rates_against_their_sources():
    from moetrain.plan.constants import BLACKWELL, HOPPER

    # DeepGEMM H800: weight-gradient TFLOP/s at 4,096 tokens (PR #95) against the forward of the same weight
    # (README 327ec92, M = 4,096), forward moved to K = 4,096 by the shape factor: the median is wgrad_fp8
    pairs = (  # (forward K, forward TFLOP/s, weight-gradient TFLOP/s)
        (7168, 1127, 920), (1536, 1212, 986), (512, 775, 878), (16384, 1520, 994), (7168, 1410, 942),
        (2048, 1168, 920))
    ratios = sorted(w / (f * HOPPER.shape_factor(4096, True) / HOPPER.shape_factor(k, True)) for k, f, w in pairs)
    assert (ratios[2] + ratios[3]) / 2 == pytest.approx(HOPPER.wgrad_fp8, abs=0.01)
    # torchao's MXFP8 grouped GEMM on B200, DeepSeek-V3 experts (7,168 -> 2,048, 16,384 tokens a group): forward
    # (K = 7,168) and data gradient (K = 2,048) 2,094 TFLOP/s each, weight gradient 1,595
    sf = BLACKWELL.shape_factor
    fwd_dgrad = 2 / (1 / sf(7168, True) + 1 / sf(2048, True))
    assert 1595 / (2094 * sf(16384, True) / fwd_dgrad) == pytest.approx(BLACKWELL.wgrad_fp8, abs=0.01)


def test_dispatch_row_cost_against_its_sources():
    import statistics

    from moetrain.plan.constants import A2A_REF_ROW_BYTES, BLACKWELL, CPU, HOPPER
    from moetrain.plan.model import a2a_pass_time as _a2a_pass_time

    fp8_row, bf16_row = 7168 + 56 * 4, 7168 * 2           # bytes: FP8 with an FP32 scale per 128, BF16

    def split(gbs_fp8: float, gbs_bf16: float) -> tuple[float, float]:
        """(byte rate, time per row) of one kernel that moved the same tokens as FP8 and as BF16 rows."""
        t8, t16 = fp8_row / (gbs_fp8 * 1e9), bf16_row / (gbs_bf16 * 1e9)
        rate = (bf16_row - fp8_row) / (t16 - t8)
        return rate, t8 - fp8_row / rate

    # HybridEP's GB200 table, 32 SMs, kernel time, EP 8 / 16 / 24 / 32 / 36: the median time per row
    kernel = {8: (713.98, 764.03), 16: (650.48, 706.95), 24: (577.96, 665.97), 32: (538.86, 642.23),
              36: (489.27, 632.31)}
    splits = [split(*v) for v in kernel.values()]
    assert all(770e9 < r < 920e9 for r, _ in splits)                      # byte rates near the 900 GB/s link
    assert BLACKWELL.a2a_row_s == pytest.approx(statistics.median(t for _, t in splits), rel=0.01)
    # the same table's Torch-API rows move BF16 rows slower than nvlink moves DeepSeek-V3's, its kernel rows as fast
    # or faster: the kernel rows are the reading consistent with nvlink (and with the Megatron-LM guide's 714.66)
    torch_api_bf16 = (545.71, 523.48, 507.32, 484.22, 479.02)
    assert max(torch_api_bf16) < BLACKWELL.nvlink * 900 < max(v for _, v in kernel.values())
    # DeepEP V1 on H800: FP8 dispatch 153, BF16 combine 158 GB/s -> 163.7 GB/s plus 3.16 ns a row
    rate_h, t_h = split(153, 158)
    assert rate_h == pytest.approx(163.7e9, rel=0.01) and HOPPER.a2a_row_s == pytest.approx(t_h, rel=0.01)
    # the factor: 1 at the reference row, hand-computed elsewhere, none on measured CPUs
    rate = 900e9 * BLACKWELL.nvlink
    for eff in (HOPPER, BLACKWELL):
        assert eff.row_factor(A2A_REF_ROW_BYTES, rate) == 1.0
    assert BLACKWELL.row_factor(4096, rate) == pytest.approx(1 + 675e9 * 3.49e-9 * (1 / 4096 - 1 / 14336))
    assert CPU.row_factor(64, rate) == 1.0
    with pytest.raises(ValueError):
        BLACKWELL.row_factor(0, rate)
    # in the model: a flex pass of Qwen3-30B's 2,048-wide BF16 rows over NVLink takes that factor longer per byte
    # than the same bytes in DeepSeek-V3's rows; the alltoall dispatcher (NCCL, one buffer a peer) does not
    shape = validation.model_shape("qwen3-30b-a3b")
    plan = Plan(ep=8, micro_batch=1, global_batch=64, precision="mxfp8", dispatcher="flex")
    c = _ctx(plan, "gb300", 8, shape)
    rows_nvl, _ = a2a_rows(c)
    byte_time = c.n * rows_nvl * 2048 * 2 / c.nvl
    assert _a2a_pass_time(c, 2.0) - c.a2a_lat == pytest.approx(byte_time * BLACKWELL.row_factor(4096, c.nvl))
    c2 = _ctx(plan.replace(dispatcher="alltoall"), "gb300", 8, shape)
    rows2, _ = a2a_rows(c2)
    assert _a2a_pass_time(c2, 2.0) - c2.a2a_lat == pytest.approx(c2.n * rows2 * 2048 * 2 / c2.nvl)


def test_gemm_passes_by_contraction_length():
    # One FP8 GEMM, compute-bound: forward (K = 8,192), data gradient (contraction N = 8,192) and weight gradient
    # (contraction M = 4,096 tokens, at wgrad_fp8) each a third of the FLOPs
    c = _ctx(RECORDS["gb300"].plan, "gb300", 256)
    m, k, n = 4096, 8192, 8192
    flops = 6 * m * k * n
    t, cast = c.gemm_time(flops, [(m, k, n, 1)], c.gemm_peak)
    third = flops / 3 / c.gemm_peak
    want = third * (1 + 1 + 1 / (c.eff.shape_factor(m, True) * c.eff.wgrad_fp8))
    assert t == pytest.approx(want, rel=1e-9)
    assert cast == pytest.approx(m * n * 4 / c.hbm)
    # the FP32 router GEMM runs on CUDA cores: no tile factor, no FP8 weight-gradient factor
    t32, _ = c.gemm_time(flops, [(m, k, n, 1)], c.fp32_peak, fp8=False, tensor=False)
    assert t32 == pytest.approx(flops / c.fp32_peak, rel=1e-9)
    # a short contraction is slower per FLOP than a long one
    t_short, _ = c.gemm_time(flops, [(m * 16, k // 16, n, 1)], c.gemm_peak)
    assert t_short > t


def test_fused_grouped_mlp_is_a_recipe_input(capsys):
    from moetrain.plan.constants import ELEMENTWISE_BWD_TO_FWD
    from moetrain.plan.model import host_launch, item_cost

    base = RECORDS["gb300"].plan
    assert base.fused_mlp and "fused-mlp" in base.short()
    unfused = base.replace(fused_mlp=False)
    shape = load_shape(DS)
    c_f, c_u = _ctx(base, "gb300", 256), _ctx(unfused, "gb300", 256)
    saved = item_cost(c_u, "t").mem_s - item_cost(c_f, "t").mem_s
    # the SwiGLU's read of the fc1 output and write of its own, forward and backward, for k rows a token
    assert saved == pytest.approx(c_u.n * 6 * shape.top_k * shape.expert_ffn * (1 + ELEMENTWISE_BWD_TO_FWD) / c_u.hbm)
    eager = Plan(pp=4, ep=8, global_batch=64, precision="mxfp8", cuda_graphs="partial")
    g = get_gpu("gb200")

    def host(plan):
        return host_launch(_ctx(plan, g, 32, shape), "t").total

    assert host(eager) > host(eager.replace(fused_mlp=True)) > 0.0   # no per-expert launches when fused
    assert predict(DS, "gb300", 256, base).tflops_per_gpu > predict(DS, "gb300", 256, unfused).tflops_per_gpu
    # another framework's recipe does not inherit the kernel
    bf16 = ["--precision", "bf16", "--attn-precision", "bf16"]  # what moetrain's trainer runs
    assert plan_main(["--record", "gb300", "--framework", "moetrain", *bf16, "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["fused_mlp"] is False
    assert plan_main(["--record", "gb200", "--no-fused-mlp", "--json"]) == 0
    assert json.loads(capsys.readouterr().out)["plan"]["fused_mlp"] is False
    # refused where the kernel does not exist: another framework, or a GPU that is not Blackwell
    assert plan_main(["--record", "gb300", "--framework", "moetrain", *bf16, "--fused-mlp"]) == 2
    assert "fused_mlp" in capsys.readouterr().err
    with pytest.raises(PlanError, match="Blackwell"):
        predict(DS, "h100", 1024, RECORDS["h100"].plan.replace(fused_mlp=True))


def test_record_override_with_the_records_own_value_changes_nothing(capsys):
    want = predict(DS, "gb300", 256, RECORDS["gb300"].plan).tflops_per_gpu
    assert plan_main(["--record", "gb300", "--pp", "2", "--fused-mlp", "--json"]) == 0
    got = json.loads(capsys.readouterr().out)
    assert got["tflops_per_gpu"] == pytest.approx(want) and got["plan"]["pp_layout"] == RECORDS["gb300"].plan.pp_layout


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
    # and so does each grouping of "where the error is"
    for name, groups in d["summary"]["by_group"].items():
        assert sum(b["points"] for b in groups.values()) == len(validation.POINTS), name
    assert set(d["summary"]["by_group"]["cuda_graphs"]) == {"full", "partial", "none"}
    assert set(d["summary"]["by_group"]["host"]) == {"x86", "grace"}
    assert set(d["summary"]["by_group"]["gpu"]) == {p.gpu for p in validation.POINTS}


def test_repeated_plans_bound_what_any_plan_only_model_can_reach(capsys):
    """Points that publish one plan twice (only the release differs) are grouped; their spread bounds the error of
    any model that sees only the plan. Hand-computed on 1,199 / 1,298: best largest error 99 / 2,497 = 3.96%,
    best mean error (1 - 1,199 / 1,298) / 2 = 3.81%."""
    pt = next(p for p in validation.POINTS if p.key == "dsv3-gb300-260401")
    twin = validation.Point("twin", pt.source, pt.model, pt.gpu, pt.n_gpus, pt.plan.replace(name="other name"),
                            1199.0, "test")
    other = validation.Point("other", pt.source, pt.model, pt.gpu, pt.n_gpus, pt.plan.replace(micro_batch=1),
                             900.0, "test")
    rows = [validation.Row(p, None, None) for p in (pt, twin, other)]
    (g,) = validation.repeats(rows)                              # the plan name does not count, the batch does
    assert g["keys"] == ["dsv3-gb300-260401", "twin"] and g["published"] == [1298, 1199.0]
    assert g["spread"] == pytest.approx(1298 / 1199 - 1)
    assert g["min_max_error"] == pytest.approx(99 / 2497)
    assert g["min_mean_error"] == pytest.approx((1 - 1199 / 1298) / 2)
    # three figures 100 / 200 / 300: the mean error at p = 100 is (0 + 1/2 + 2/3) / 3 = 0.389, at p = 200
    # (1 + 0 + 1/3) / 3 = 0.444, at p = 300 (2 + 1/2 + 0) / 3 = 0.833: the best is the lowest figure
    trio = [validation.Row(validation.Point(k, pt.source, pt.model, pt.gpu, pt.n_gpus, pt.plan, x, "test"), None, None)
            for k, x in (("a", 100.0), ("b", 200.0), ("c", 300.0))]
    (t,) = validation.repeats(trio)
    assert t["min_mean_error"] == pytest.approx((0 + 0.5 + 2 / 3) / 3)
    # the report prints the bound beside the model's error on the same points
    assert plan_main(["--validate"]) == 0
    out = capsys.readouterr().out
    assert "one plan published more than once" in out and "can at best reach an MAE of" in out


def test_a_prediction_shows_the_models_error_on_published_runs_like_it(capsys):
    import dataclasses
    import statistics

    rows = validation.run()
    # H100 without CUDA graphs: enough points to speak of that group alone
    h100_none = [r.error for r in rows if r.point.gpu == "h100" and r.point.plan.resolved_cuda_graphs == "none"]
    assert len(h100_none) >= validation.TRACK_RECORD_MIN_POINTS
    t = validation.track_record(get_gpu("h100"), "none", DS)
    g = t["gpu"]
    assert g["points"] == len(h100_none) and not g["fallback"] and not g["modified"]
    assert g["mean_signed_error"] == pytest.approx(sum(h100_none) / len(h100_none))
    assert g["median_error"] == pytest.approx(statistics.median(h100_none))
    assert (g["min_error"], g["max_error"]) == (pytest.approx(min(h100_none)), pytest.approx(max(h100_none)))
    ds = [r.error for r in rows if r.point.model == DS]
    assert t["model"]["points"] == len(ds) and t["model"]["mean_signed_error"] == pytest.approx(sum(ds) / len(ds))
    # GB300 without graphs has fewer points than that: all of GB300's are taken, and the group says so
    gb300_none = [r for r in rows if r.point.gpu == "gb300" and r.point.plan.resolved_cuda_graphs == "none"]
    assert 0 < len(gb300_none) < validation.TRACK_RECORD_MIN_POINTS
    g = validation.track_record(get_gpu("gb300"), "none")["gpu"]
    assert g["fallback"] and g["points"] == sum(r.point.gpu == "gb300" for r in rows)
    assert g["group"].startswith(f"all {g['points']} GB300 runs ({len(gb300_none)} with no CUDA graphs")
    # no published point on an H800 nor of an unknown model; a changed catalogue GPU keeps its name's record,
    # flagged; a user GPU of another name has none
    assert validation.track_record(get_gpu("h800"), "none", "tiny") == {"gpu": None, "model": None}
    changed = dataclasses.replace(get_gpu("h100"), nic_gbps=100.0)
    assert validation.track_record(changed, "none")["gpu"]["modified"]
    assert validation.track_record(dataclasses.replace(get_gpu("h100"), name="myh100"), "none")["gpu"] is None
    # the CLI prints it under the prediction and puts it in the JSON; the record's own figure stays in "record"
    assert plan_main(["--record", "h100"]) == 0
    out = capsys.readouterr().out
    assert "track record on validation runs" in out and "H100 runs with no CUDA graphs" in out
    assert plan_main(["--record", "gb300", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["track_record"]["gpu"]["points"] >= 1 and d["record"]["published_tflops_per_gpu"] == 1648


def test_validation_predicts_on_the_catalogue_gpu_even_when_a_user_entry_shares_its_name(tmp_path):
    from moetrain.plan import hardware

    before = {r.point.key: r.predicted for r in validation.run() if r.point.gpu == "h100"}
    f = tmp_path / "fast.toml"
    f.write_text('[gpu.h100]\ngeneration = "hopper"\npeak_tflops = {bf16 = 9890, fp8 = 19790}\nhbm_gb = 80\n'
                 'hbm_tbps = 33.5\nnvlink_gbps_bidir = 9000\nnvlink_domain = 8\nnic_gbit = 4000\n')
    try:
        hardware.load_gpu_file(f)
        after = {r.point.key: r.predicted for r in validation.run() if r.point.gpu == "h100"}
    finally:
        hardware._USER.pop("h100", None)
    assert after == before


@pytest.mark.xfail(strict=True, reason="validation MAE ~20% over 61 points (goal 12%; 6% on GB300, 9% with "
                   "whole-iteration CUDA graphs): over-predicted most where runs are launched eagerly, on x86 hosts "
                   "and for the smaller models -- host-bound execution under-charged; see docs/validation.md")
def test_validation_goal():
    s = validation.summary(validation.run())
    assert s["goal_met"], s


def test_search_keeps_to_the_framework():
    base = Plan(ep=8, micro_batch=1, global_batch=64, seq_len=4096, precision="fp8", framework="moetrain")
    res = search("deepseek-v2-lite-16b", "h100", 16, base, micro_batch=(1,), vpp=(2,))
    assert res.ranked and res.framework == "moetrain"
    for p in res.ranked:
        assert p.plan.tp == 1 and p.plan.cp == 1 and p.plan.precision == "fp8"
        # FSDP2 as the trainer runs it: resharded after every pass at PP 1 without EP overlap, else kept gathered
        assert p.plan.fsdp == (p.plan.pp == 1 and not p.plan.ep_overlap), p.plan
    assert any(p.plan.fsdp for p in res.ranked)
    # only plans `moetrain train` runs: never EP overlap beside full (or moe) recompute; every one through plan_job
    from moetrain.plan.search import trainer_conflicts
    from moetrain.train.from_plan import PlanFile, plan_job

    anyf = search("deepseek-v2-lite-16b", "h100", 16, base, micro_batch=(1,), vpp=(2,), framework=None)
    assert any(p.plan.tp > 1 for p in anyf.ranked)
    # only plans `moetrain train` runs: where memory needs full recompute, without EP overlap (the paired schedule
    # does not recompute blocks; unfiltered, 12 of this search's 28 plans paired them); each one through plan_job
    from moetrain.plan.search import trainer_conflicts
    from moetrain.train.from_plan import PlanFile, plan_job

    tight = search("deepseek-v2-lite-16b", "h100", 8, base.replace(ep=4, micro_batch=2, seq_len=8192,
                                                                     precision="bf16"), micro_batch=(2,), vpp=(2,))
    assert tight.ranked and all(not trainer_conflicts(p.plan) for p in tight.ranked)
    assert any(p.plan.recompute == "full" and not p.plan.ep_overlap and p.plan.ep > 1 for p in tight.ranked)
    for p in tight.ranked[:3]:
        plan_job(PlanFile(p.plan.replace(dp=8 // (p.plan.pp * p.plan.tp * p.plan.cp)), "deepseek-v2-lite-16b",
                          "h100"))


def test_qk_norm_charges_one_more_pass_over_q_and_k():
    """Qwen3's per-head RMSNorm of q and k (a separate norm before RoPE in Megatron's attention): the
    memory-bound time of an attention block grows by one read and write of q and k, forward and backward."""
    from moetrain.plan.constants import ELEMENTWISE_BWD_TO_FWD
    from moetrain.plan.model import item_cost
    from moetrain.plan.shape import shape_from_hf

    cfg = dict(validation.MODEL_CONFIGS["qwen3-30b-a3b"])
    with_norm = shape_from_hf(cfg, name="qwen3")
    without = shape_from_hf({**cfg, "model_type": "qwen2_moe"}, name="no-qk-norm")
    assert with_norm.config.qk_norm and not without.config.qk_norm
    plan, g = Plan(ep=8, global_batch=64, precision="mxfp8"), get_gpu("gb300")

    def mem(shape):
        c = _ctx(plan, g, 8, shape)
        return c, item_cost(c, "t").mem_s

    c, m_norm = mem(with_norm)
    _, m_plain = mem(without)
    kw = cfg["num_key_value_heads"] * cfg["head_dim"]
    q = cfg["num_attention_heads"] * cfg["head_dim"]
    assert m_norm - m_plain == pytest.approx(c.n * 4 * (q + kw) * (1 + ELEMENTWISE_BWD_TO_FWD) / c.hbm, rel=1e-9)


def test_host_launches_after_the_dispatch_sync_are_exposed_even_when_the_host_keeps_up_overall():
    """Hand-computed: a MoE layer whose host launches (3 ms) take less than its GPU time (6 ms) still waits when
    the expert MLP's launches after the dispatch sync outlast the GPU work they feed."""
    from moetrain.plan.model import HostLaunch, ItemCost, exposed_host_s

    # compute 6 ms: forward 2 ms, a quarter of it the expert MLP (1.5 ms attention part); all-to-all 0.2 ms a pass
    cost = ItemCost(kind="t", gemm_s=6e-3, attn_share=0.75, a2a_s=0.8e-3, a2a_passes=(0.2e-3,) * 4)
    g_moe, g_rest = 0.5e-3 + 0.2e-3, 0.2e-3 + 1.5e-3
    # expert launches 1.2 ms after the sync: the GPU idles 1.2 - 0.7 = 0.5 ms; the rest of the forward queues behind
    hl = HostLaunch(before_sync=0.3e-3, after_sync=1.2e-3, backward=1.5e-3)
    assert hl.total < cost.compute_s + cost.a2a_s
    assert exposed_host_s(cost, hl, overlap=False) == pytest.approx(1.2e-3 - g_moe)
    # launches that keep ahead of the GPU cost nothing; a backward beyond its GPU time (4 ms + 0.4 ms) is exposed
    assert exposed_host_s(cost, HostLaunch(0.3e-3, 0.5e-3, 1.5e-3), overlap=False) == 0.0
    assert exposed_host_s(cost, HostLaunch(0.3e-3, 0.5e-3, 5.0e-3), overlap=False) == pytest.approx(5e-3 - 4.4e-3)
    # a host slower than the whole forward: the forward takes the host's time
    slow = HostLaunch(before_sync=2.5e-3, after_sync=1.2e-3)
    assert exposed_host_s(cost, slow, overlap=False) == pytest.approx(3.7e-3 - (g_moe + g_rest))
    # the backward runs the MoE block's forward again (full / moe recompute): its sync, and its wait, come again
    assert exposed_host_s(cost, hl, overlap=False, resync=True) == pytest.approx(2 * (1.2e-3 - g_moe))
    # under an overlapped schedule the all-to-all runs on its own stream: only compute is there to hide launches
    assert exposed_host_s(cost, hl, overlap=True) == pytest.approx(1.2e-3 - 0.5e-3)
    # recompute runs in the backward: it hides backward launches, not the forward's
    rc = ItemCost(kind="t", gemm_s=6e-3, recompute_s=3e-3, attn_share=0.75, a2a_s=0.8e-3, a2a_passes=(0.2e-3,) * 4)
    assert exposed_host_s(rc, hl, overlap=False) == pytest.approx(1.2e-3 - g_moe)
    # (backward GPU time: 4 ms of compute + 3 ms of recompute + 0.4 ms of all-to-all)
    assert exposed_host_s(rc, HostLaunch(0.3e-3, 0.5e-3, 7.0e-3), overlap=False) == 0.0
    assert exposed_host_s(rc, HostLaunch(0.3e-3, 0.5e-3, 8.0e-3), overlap=False) == pytest.approx(8e-3 - 7.4e-3)
    # an item without a dispatch runs ahead freely: only host time beyond its GPU time shows
    dense = ItemCost(kind="d", gemm_s=6e-3)
    assert exposed_host_s(dense, HostLaunch(before_sync=2.5e-3, backward=3e-3), overlap=False) == pytest.approx(
        0.5e-3)


def test_alltoall_dispatcher_pays_its_second_permute():
    """Megatron's alltoall dispatcher permutes globally before the all-to-all and sorts the received rows by
    expert after it (and back in the combine); flex fuses the global permute into the dispatch: the difference
    is one more read and write of every routed row each way, forward and backward."""
    from moetrain.plan.constants import ELEMENTWISE_BWD_TO_FWD
    from moetrain.plan.model import item_cost

    shape, g = load_shape(DS), get_gpu("b300")
    plan = Plan(pp=8, ep=8, global_batch=4096, precision="mxfp8", routing="balanced")

    def mem(dispatcher):
        c = _ctx(plan.replace(dispatcher=dispatcher), g, 256, shape)
        return c, item_cost(c, "t").mem_s

    c, m_a2a = mem("alltoall")
    _, m_flex = mem("flex")
    want = c.n * 8 * shape.top_k * shape.dim * c.imb * (1 + ELEMENTWISE_BWD_TO_FWD) / c.hbm
    assert m_a2a - m_flex == pytest.approx(want, rel=1e-9)


def test_compare_shares_are_positive_for_what_makes_the_faster_run_faster():
    """--compare's summary: the shares of the gap sum to 1 over all mechanisms, each positive where it works
    for the faster run, whichever side that run is on."""
    from moetrain.plan.report import breakdown_rows, compare_summary

    a = predict(DS, "gb300", 256, RECORDS["gb300"].plan)
    b = predict(DS, "gb200", 256, RECORDS["gb200"].plan)
    for x, y in ((a, b), (b, a)):
        line = compare_summary(x, y, "X", "Y")
        assert line.startswith(("X is faster" if x.tflops_per_gpu > y.tflops_per_gpu else "Y is faster"))
        shares = [float(part.rsplit(" ", 1)[1].rstrip("%")) for part in line.split(": ", 1)[1].split(", ")]
        assert shares[0] > 0  # the largest difference here works for GB300
        rx, ry = breakdown_rows(x), breakdown_rows(y)
        tx, ty = x.plan.tokens_per_step / x.n_gpus, y.plan.tokens_per_step / y.n_gpus
        gap = x.step.step / tx - y.step.step / ty
        assert sum(rx[k] / tx - ry.get(k, 0.0) / ty for k in rx) / gap == pytest.approx(1.0, rel=1e-6)


def test_even_layout_counts_embedding_and_loss_as_layers():
    """Megatron-Core's account_for_embedding / account_for_loss split (the Qwen3 recipes): 94 layers + 2 slots
    evenly over PP x VPP chunks, the first chunk one layer short for the embedding, the last for the loss."""
    from moetrain.layout import parse_layout

    assert validation.even_layout(94, 4, 12) == "Et|(t*2|)*46tL"
    assert validation.even_layout(94, 8, 3) == "Et*3|(t*4|)*22t*3L"
    assert validation.even_layout(94, 2) == "Et*47|t*47L"
    for pp, vpp in ((4, 12), (8, 3), (8, 4), (8, 1), (4, 1)):
        stages = parse_layout(validation.even_layout(94, pp, vpp))
        assert len(stages) == pp * vpp and sum(st.count("t") for st in stages) == 94
    with pytest.raises(ValueError, match="do not split evenly"):
        validation.even_layout(94, 5)
