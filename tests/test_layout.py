"""One layout vocabulary (moetrain.layout): the enums, the trainer's older names translated once, and a plan becoming
a job by a typed function that runs every field exactly or refuses it by name."""

from __future__ import annotations

import json

import pytest

from moetrain.config import build_job_config, load_job_config, translate_aliases
from moetrain.errors import ConfigError
from moetrain.layout import (LAYOUT_FIELDS, CudaGraphs, Dispatcher, Framework, Layout, OptimizerStates, Precision,
                             Recompute, Routing, Schedule)
from moetrain.parallel.config import PP_SCHEDULES, ParallelConfig
from moetrain.plan.plan import Plan
from moetrain.toml_write import dumps
from moetrain.train.from_plan import PlanFile, megatron_layout, plan_from_dict, plan_job

TINY_PLAN = dict(pp=2, ep=2, dp=2, micro_batch=2, global_batch=8, seq_len=64, optimizer="fp32", routing="real")


def _job(plan: Plan, **kw):
    return plan_job(PlanFile(plan, model="tiny", **kw))


# ---- the enums -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("enum", [Schedule, Dispatcher, Recompute, Precision, OptimizerStates, CudaGraphs, Routing,
                                  Framework])
def test_names_are_their_strings_and_every_member_is_described(enum):
    for m in enum:
        assert m == m.value and str(m) == m.value and f"{m}" == m.value and repr(m) == repr(m.value)
        assert json.dumps(m) == json.dumps(m.value) and hash(m) == hash(m.value)
        assert {m.value: 1}[m] == 1  # usable as a key of a dict of plain names
        assert dumps({"k": m}) == dumps({"k": m.value})  # a saved job holds the plain name
    assert enum.__doc__
    src = __import__("inspect").getsource(enum)
    for m in enum:  # every member carries a "#:" line saying what it means, above it
        line = next(i for i, s in enumerate(src.splitlines()) if s.strip().startswith(f"{m.name} ="))
        assert src.splitlines()[line - 1].strip().startswith("#:"), m


def test_parse_takes_older_names_and_names_the_field_when_wrong():
    assert Schedule.parse("interleaved-1f1b", "schedule") is Schedule.INTERLEAVED
    assert Schedule.parse("dualpipe-v", "schedule") is Schedule.DUALPIPEV
    with pytest.raises(ConfigError, match=r"parallel.schedule='gpipe'; allowed: '1f1b'"):
        Schedule.parse("gpipe", "parallel.schedule")


def test_layout_has_one_meaning_of_dp_and_plan_builds_on_it():
    lay = Layout(pp=2, ep=8, dp=16)
    assert (lay.world, lay.stage_size, lay.edp) == (32, 16, 2)
    assert issubclass(Plan, Layout) and issubclass(ParallelConfig, Layout)
    assert set(LAYOUT_FIELDS) <= set(Plan().to_dict()) and set(LAYOUT_FIELDS) <= set(ParallelConfig().layout_dict())
    p = Plan(schedule="interleaved-1f1b", vpp=2, pp=2, dispatcher="flex", precision="fp8")
    assert p.schedule is Schedule.INTERLEAVED and p.dispatcher is Dispatcher.FLEX and p.precision is Precision.FP8
    assert p.to_dict()["schedule"] == "interleaved" and json.loads(json.dumps(p.to_dict()))["precision"] == "fp8"


# ---- the trainer's older names -----------------------------------------------------------------------------------

@pytest.mark.parametrize("old,new", [
    ({"parallel": {"pp_schedule": "interleaved-1f1b"}}, {"parallel": {"schedule": "interleaved-1f1b"}}),
    ({"parallel": {"dispatch_dtype": "fp8"}}, {"parallel": {"dispatch_precision": "fp8"}}),
    ({"parallel": {"activation_checkpointing": True}}, {"parallel": {"recompute": "full"}}),
    ({"parallel": {"activation_checkpointing": False}}, {"parallel": {"recompute": "none"}}),
    ({"parallel": {"dedup": False}}, {"parallel": {"dispatcher": "alltoall"}}),
    ({"parallel": {"dedup": True, "dispatcher": "alltoall"}}, {"parallel": {"dispatcher": "flex"}}),
    ({"parallel": {"dedup": True, "dispatcher": "auto"}}, {"parallel": {}}),
    ({"parallel": {"dispatcher": "auto"}}, {"parallel": {}}),
    ({"train": {"fp8": "blockwise"}}, {"train": {}, "parallel": {"precision": "fp8"}}),
    ({"train": {"fp8": "mxfp8", "dtype": "auto"}}, {"train": {}, "parallel": {"precision": "mxfp8"}}),
    # FP8 GEMMs with the rest in bf16 (the fp8-loss-gap acceptance script's spelling): the FP8 precision
    ({"train": {"fp8": "blockwise", "dtype": "bf16"}}, {"train": {}, "parallel": {"precision": "fp8"}}),
    ({"train": {"fp8": "none", "dtype": "bf16"}}, {"train": {}, "parallel": {"precision": "bf16"}}),
    ({"train": {"dtype": "fp32"}}, {"train": {}, "parallel": {"precision": "fp32"}}),
    # a [parallel] section the older trainer saved (all its keys) counted dp per expert replica; a hand-written
    # dp beside one older key is read as written (never guessed at: ParallelConfig.resolve names the new meaning)
    ({"parallel": {"pp_schedule": "1f1b", "dedup": True, "dispatch_dtype": "bf16", "activation_checkpointing": False,
                   "dp": 2, "ep": 4}},
     {"parallel": {"schedule": "1f1b", "dispatch_precision": "bf16", "recompute": "none", "dp": 8, "ep": 4}}),
    ({"parallel": {"pp_schedule": "1f1b", "dp": 2, "ep": 4}}, {"parallel": {"schedule": "1f1b", "dp": 2, "ep": 4}}),
    ({"parallel": {"dp": 2, "ep": 4}}, {"parallel": {"dp": 2, "ep": 4}}),  # today's names: today's meaning
])
def test_older_trainer_keys_are_translated_once(old, new):
    assert translate_aliases(old) == new


def test_older_keys_load_into_the_same_job_and_clash_with_their_new_names():
    old = load_job_config(None, ['parallel.pp_schedule="interleaved-1f1b"', "parallel.pp=2", "parallel.vpp=2",
                                 "parallel.activation_checkpointing=true", 'train.fp8="blockwise"',
                                 "parallel.dedup=false"], world=4)
    new = load_job_config(None, ['parallel.schedule="interleaved"', "parallel.pp=2", "parallel.vpp=2",
                                 'parallel.recompute="full"', 'parallel.precision="fp8"',
                                 'parallel.dispatcher="alltoall"'], world=4)
    assert old.parallel == new.parallel and old.train == new.train
    assert new.parallel.schedule is Schedule.INTERLEAVED and new.parallel.recompute is Recompute.FULL
    with pytest.raises(ConfigError, match="older name of parallel.schedule"):
        build_job_config({"parallel": {"pp_schedule": "1f1b", "schedule": "1f1b"}})
    with pytest.raises(ConfigError, match=r"parallel.activation_checkpointing='yes'"):
        build_job_config({"parallel": {"activation_checkpointing": "yes"}})
    with pytest.raises(ConfigError, match="dispatcher='local'.*leave parallel.dispatcher unset"):
        ParallelConfig(dispatcher="local")


def test_older_keys_that_cannot_mean_one_thing_are_refused():
    with pytest.raises(ConfigError, match="older name of parallel.dispatcher"):
        translate_aliases({"parallel": {"dispatcher": "flex", "dedup": False}})
    with pytest.raises(ConfigError, match="set only parallel.precision"):
        translate_aliases({"train": {"fp8": "blockwise", "dtype": "fp32"}})
    # a dp that fits only the older per-replica meaning is refused naming the new one
    with pytest.raises(ConfigError, match="now written parallel.dp=2"):
        load_job_config(None, ["parallel.dp=1", "parallel.ep=2"], world=2).parallel.resolve(2, 8)


def test_older_dedup_cannot_silently_lose_to_a_config_files_dispatcher(tmp_path):
    f = tmp_path / "job.toml"
    f.write_text('[parallel]\ndispatcher = "alltoall"\n')
    with pytest.raises(ConfigError, match="cannot override the parallel.dispatcher of the config file"):
        load_job_config(f, ["parallel.dedup=true"])


def test_a_plan_cannot_be_changed_by_set():
    with pytest.raises(ConfigError, match="--plan fixes the layout.*parallel.ep"):
        load_job_config(None, ["parallel.ep=4"], plan={"parallel": {"ep": 8, "pp": 2}})
    with pytest.raises(ConfigError, match="would change parallel.dedup"):  # older names too
        load_job_config(None, ["parallel.dedup=true"], plan={"parallel": {"ep": 2}})
    # run-time knobs that are not part of the layout stay settable
    job = load_job_config(None, ["parallel.timeout_s=60"], plan={"parallel": {"ep": 1}})
    assert job.parallel.timeout_s == 60


def test_a_saved_older_job_reads_back(tmp_path):
    from moetrain.config import job_config_from_dict

    job = load_job_config(None, ["parallel.ep=2"], world=4)
    d = json.loads(json.dumps(job.to_dict()))
    par = d["parallel"]
    old = {k: v for k, v in par.items() if k not in ("schedule", "dispatch_precision", "recompute", "dispatcher",
                                                     "precision")}
    old.update(pp_schedule="1f1b", dispatch_dtype="bf16", activation_checkpointing=False, dedup=True,
               dispatcher="auto", dp=2)  # the trainer's dp of 2 ranks per expert replica at ep 2
    d["parallel"] = old
    d["train"] = {**d["train"], "fp8": "none", "dtype": "auto"}
    back = job_config_from_dict(d)
    assert back.parallel == job.parallel.replace(dp=4) and back.train == job.train


def test_trainer_dp_includes_ep_and_edp_holds_the_same_experts():
    pcfg = ParallelConfig(pp=2, ep=2).resolve(8, 8)
    assert (pcfg.dp, pcfg.edp, pcfg.stage_size) == (4, 2, 4)
    with pytest.raises(ConfigError, match=r"parallel.pp=2 x parallel.dp=2 = 4 != world size 8"):
        ParallelConfig(pp=2, ep=2, dp=2).resolve(8, 8)
    assert ParallelConfig(dp=0).dp is None  # the older "derive it"


def test_precision_auto_and_fsdp_default_resolve_as_the_trainer_did():
    assert ParallelConfig().run_precision("cuda") is Precision.BF16
    assert ParallelConfig().run_precision("cpu") is Precision.FP32
    assert ParallelConfig(precision="fp8").run_precision("cpu") is Precision.FP8
    assert ParallelConfig(precision="fp8").autocast_bf16("cuda") and not ParallelConfig(precision="fp8").autocast_bf16("cpu")
    assert ParallelConfig(precision="bf16").autocast_bf16("cpu") and not ParallelConfig(precision="fp32").autocast_bf16("cuda")
    assert ParallelConfig().resolve(2, 8).fsdp is True  # PP 1 without EP overlap: resharded after every pass
    assert ParallelConfig(pp=2).resolve(2, 8).fsdp is False  # pipelining keeps the parameters through the step
    assert ParallelConfig(ep_overlap=True).resolve(2, 8).fsdp is False
    assert ParallelConfig(fsdp=False).keeps_params_gathered


# ---- plan -> job -------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("schedule,vpp", [("1f1b", 1), ("interleaved", 2), ("dualpipev", 1), ("zbv", 1)])
@pytest.mark.parametrize("dispatcher", ["alltoall", "flex"])
def test_every_runnable_schedule_and_dispatcher_runs_as_planned(schedule, vpp, dispatcher):
    plan = Plan(**TINY_PLAN, vpp=vpp, schedule=schedule, dispatcher=dispatcher)
    pj = _job(plan)
    job = load_job_config(None, [], world=pj.world, plan=pj.sections)
    par = job.parallel
    assert (par.schedule, par.dispatcher, par.pp, par.vpp, par.ep, par.dp) == (schedule, dispatcher, 2, vpp, 2, 2)
    assert pj.world == 4 and job.train.grad_accum * job.train.micro_batch_size * 2 == plan.global_batch


@pytest.mark.parametrize("recompute", ["none", "full"])
@pytest.mark.parametrize("precision", ["bf16", "fp8", "mxfp8", "fp32"])
def test_every_runnable_recompute_and_precision_runs_as_planned(recompute, precision):
    from moetrain.precision.recipe import PLAN_PRECISION_TO_FP8
    from moetrain.train.dryrun import run_layout

    plan = Plan(**TINY_PLAN, recompute=recompute, precision=precision)
    pj = _job(plan)
    job = load_job_config(None, [], world=pj.world, plan=pj.sections)
    assert job.parallel.recompute == recompute and job.parallel.precision == precision
    assert PLAN_PRECISION_TO_FP8[job.parallel.precision] == {"fp8": "blockwise"}.get(precision, precision
                                                                                    if precision == "mxfp8" else "none")
    lay = run_layout(job, job.parallel.resolve(pj.world, job.model.n_routed_experts), "cpu")
    ran = lay.layout_dict()
    want = plan.layout().layout_dict()
    assert {k: v for k, v in want.items() if v is not None and k != "mtp_depth"} == \
        {k: ran[k] for k, v in want.items() if v is not None and k != "mtp_depth"}


def test_the_formerly_dropped_fields_are_run_or_refused():
    # dispatcher: run as planned (a plan ranked with the all-to-all runs the all-to-all, not the dedup dispatcher)
    assert _job(Plan(**TINY_PLAN, dispatcher="alltoall")).sections["parallel"]["dispatcher"] == "alltoall"
    assert _job(Plan(**TINY_PLAN)).sections["parallel"]["dispatcher"] == "alltoall"  # megatron's default, resolved
    # mtp_depth: the model's MTP depth
    assert _job(Plan(**TINY_PLAN, mtp_depth=0)).sections["model"]["mtp_depth"] == 0
    assert "mtp_depth" not in _job(Plan(**TINY_PLAN)).sections["model"]
    # fsdp: run (ZeRO-3 at PP 1), refused where the trainer keeps the parameters gathered
    one = dict(TINY_PLAN, pp=1, dp=4)
    assert _job(Plan(**one, fsdp=True)).sections["parallel"]["fsdp"] is True
    assert _job(Plan(**TINY_PLAN, fsdp=False)).sections["parallel"]["fsdp"] is False
    assert _job(Plan(**TINY_PLAN, fsdp=True, schedule="interleaved", vpp=2)).sections["parallel"]["fsdp"] is True
    with pytest.raises(ConfigError, match=r"fsdp=true with schedule='zbv'"):
        _job(Plan(**TINY_PLAN, fsdp=True, schedule="zbv"))
    with pytest.raises(ConfigError, match=r"fsdp=true with ep_overlap"):
        _job(Plan(**one, fsdp=True, ep_overlap=True))
    # dp_overlap, cuda_graphs, fused_mlp: refused by name; the runnable values pass
    assert _job(Plan(**TINY_PLAN, dp_overlap=True, cuda_graphs="none", fused_mlp=False)).world == 4
    with pytest.raises(ConfigError) as e:
        _job(Plan(**TINY_PLAN, dp_overlap=False, cuda_graphs="full", fused_mlp=True))
    for name in ("dp_overlap=false", "cuda_graphs='full'", "fused_mlp=true"):
        assert name in str(e.value), name
    # node_limit_m: run, the node being the plan GPU's NVLink domain (8 without a GPU)
    par = _job(Plan(**TINY_PLAN, node_limit_m=4)).sections["parallel"]
    assert (par["node_limit_m"], par["gpus_per_node"]) == (4, 8)
    # optimizer states and selective recompute: run as planned
    par = _job(Plan(**{**TINY_PLAN, "optimizer": "bf16-moments"}, recompute="selective",
                    recompute_modules=("moe_act", "layernorm"))).sections["parallel"]
    assert (par["optimizer"], par["recompute"], par["recompute_modules"]) == (
        "bf16-moments", "selective", ("moe_act", "layernorm"))
    # imbalance and framework: prediction-only, reported
    pj = _job(Plan(**TINY_PLAN, imbalance=1.3, framework="deepseek"))
    assert any("imbalance=1.3" in r for r in pj.prediction_only)
    assert any("framework='deepseek'" in r for r in pj.prediction_only)


def test_every_refusal_in_one_message_naming_the_field():
    plan = Plan(**TINY_PLAN, tp=2, cp=2, attn_precision="fp8", dispatcher="allgather", schedule="dualpipe",
                precision="fp8")
    with pytest.raises(ConfigError) as e:
        _job(plan)
    msg = str(e.value)
    assert msg.startswith("moetrain train cannot run this plan yet: ")
    for name in ("tp=2", "cp=2", "attn_precision='fp8'", "dispatcher='allgather'", "schedule='dualpipe'"):
        assert name in msg, name
    assert Schedule.DUALPIPE not in PP_SCHEDULES


def test_the_planned_pipeline_split_is_the_run_split():
    stages = ("Edt", "tttmL")
    pj = _job(Plan(**TINY_PLAN), stages=stages)
    assert pj.sections["parallel"]["pp_layout"] == megatron_layout(stages) == "Ett|tttmL"
    assert "pp_layout" not in {k for k, v in _job(Plan(**TINY_PLAN)).sections["parallel"].items() if v}


def test_plan_files_round_trip(tmp_path):
    from moetrain.train.from_plan import read_plan

    plan = Plan(**TINY_PLAN, schedule="dualpipev", dispatcher="flex")
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"model": "tiny", "gpu": "h100", "plan": plan.to_dict(),
                             "details": {"stages": ["Ed", "tt", "tt", "tmL"]}}))
    pf = read_plan(f)
    assert pf.plan == plan.replace(cuda_graphs="none")  # the file holds the resolved defaults
    assert pf.model == "tiny" and pf.gpu == "h100" and pf.stages == ("Ed", "tt", "tt", "tmL")
    # a `moetrain plan --search --json` output: its best plan
    f.write_text(json.dumps({"best": {"model": "tiny", "gpu": "h100", "plan": plan.to_dict(),
                                      "details": {"stages": ["Ed", "tt", "tt", "tmL"]}}, "top": []}))
    assert read_plan(f).plan == pf.plan
    with pytest.raises(ConfigError, match="does not know"):
        plan_from_dict({**plan.to_dict(), "warp_drive": 1})


def test_the_trainer_default_split_is_the_planners():
    from moetrain.parallel.pipeline import default_layout
    from moetrain.plan.model import predict
    from moetrain.plan.local import trainer_plan

    job = load_job_config(None, ["parallel.pp=2", 'parallel.schedule="dualpipev"'], world=2)
    layout = job.parallel.resolve(2, job.model.n_routed_experts).replace(precision="bf16", mtp_depth=None)
    plan = trainer_plan(job.model, layout, job.train.micro_batch_size, job.train.grad_accum, job.data.seq_len)
    stages = predict(job.model, "H100", 2, plan, _ignore_memory=True).details["stages"]
    assert job.parallel.pp_layout == megatron_layout(stages) == "Ett|t|t|mL"
    assert job.parallel.pp_layout != default_layout(job.model, 4)  # not the even split
    given = load_job_config(None, ["parallel.pp=2", 'parallel.pp_layout="Et|t|t|tmL"'], world=2)
    assert given.parallel.pp_layout == "Et|t|t|tmL"  # a given split is kept


@pytest.mark.dist
def test_fsdp_false_keeps_parameters_through_the_step_and_trains_the_same():
    """Plan fsdp=false at PP 1 (parameters gathered once per step, Megatron's distributed-optimizer memory) trains
    exactly as ZeRO-3 (fsdp=true: resharded after every forward and backward)."""
    import torch

    from tests.parallel.harness import ok_values, run_ranks
    from tests.parallel.workers import train_run

    zero3 = ok_values(run_ranks(2, train_run, {"ep": 2, "fsdp": True}, 2, 2, None, False, 1e-5))
    kept = ok_values(run_ranks(2, train_run, {"ep": 2, "fsdp": False}, 2, 2, None, False, 1e-5))
    for a, b in zip(zero3, kept):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-6)
        for name, want in a["params"].items():
            torch.testing.assert_close(b["params"][name], want, msg=lambda m, n=name: f"{n}: {m}")


def test_train_plan_dry_run_records_the_layout_it_runs_and_each_stage(tmp_path, capsys):
    from moetrain.cli import main

    plan = Plan(**{**TINY_PLAN, "routing": "balanced", "global_batch": 16}, schedule="dualpipev", dispatcher="alltoall",
                mtp_depth=1)
    f = tmp_path / "p.json"
    f.write_text(json.dumps({"model": "tiny", "gpu": "h100", "plan": plan.to_dict(),
                             "details": {"stages": ["Ed", "tt", "t", "mL"]}}))
    assert main(["train", "--plan", str(f), "--dry-run", "--world", "4", "--out", str(tmp_path / "run")]) == 0
    out = capsys.readouterr().out
    ran = json.loads((tmp_path / "run" / "dry_run.json").read_text())["layout"]
    assert {k: v for k, v in plan.to_dict().items() if k in ran and v is not None} == \
        {k: ran[k] for k, v in plan.to_dict().items() if k in ran and v is not None}
    assert ran["pp_layout"] == "Et|tt|t|mL" and ran["dispatcher"] == "alltoall" and ran["dp"] == 2
    assert "Ed" in out and "tt" in out and "planned items" in out  # every stage beside the planner's
    f.write_text(json.dumps({"model": "tiny", "plan": plan.replace(cuda_graphs="full", tp=2).to_dict()}))
    assert main(["train", "--plan", str(f), "--dry-run", "--world", "8", "--out", str(tmp_path / "r2")]) == 2
    err = capsys.readouterr().err
    assert "tp=2" in err and "cuda_graphs='full'" in err and not (tmp_path / "r2" / "dry_run.json").exists()


@pytest.mark.parametrize("argv", [
    ["--model", "deepseek-v3-671b", "--gpu", "h100", "--gpus", "256"],
    ["--model", "deepseek-v3-671b", "--gpu", "gb200", "--gpus", "256"],
    ["--model", "deepseek-v3-671b", "--gpu", "h800", "--gpus", "2048", "--gbs", "15360"],
    ["--model", "qwen3-235b-a22b", "--gpu", "h100", "--gpus", "256"],
], ids=["dsv3-h100", "dsv3-gb200", "dsv3-h800", "qwen3-235b-h100"])
def test_the_planners_default_recommendation_runs(argv, tmp_path, capsys):
    """``moetrain plan`` without a framework costs Megatron-Core's plans; what it recommends for a record's model,
    GPU and size is one ``moetrain train --plan`` runs: EP overlap never beside full recompute (Megatron asserts
    the same), the MTP modules with the head, a global batch split over the DP of the PP it picked."""
    from moetrain.plan.cli import main as plan_main
    from moetrain.train.from_plan import read_plan

    assert plan_main([*argv, "--json"]) == 0
    f = tmp_path / "plan.json"
    f.write_text(capsys.readouterr().out)
    pf = read_plan(f)
    assert pf.plan.framework == "megatron" and not (pf.plan.ep_overlap and pf.plan.recompute == "full")
    job = plan_job(pf)
    assert job.world == int(argv[argv.index("--gpus") + 1])


def test_megatron_is_not_costed_with_ep_overlap_beside_full_recompute(capsys):
    from moetrain.plan.cli import main as plan_main

    argv = ["--model", "deepseek-v3-671b", "--gpu", "h100", "--gpus", "256", "--ep", "8", "--pp", "16", "--vpp",
            "2", "--schedule", "interleaved", "--recompute", "full", "--ep-overlap", "--framework", "megatron"]
    assert plan_main(argv) == 2
    err = capsys.readouterr().err
    assert "--framework megatron does not run this plan: EP overlap with recompute='full'" in err
    assert "drop --framework" not in err
