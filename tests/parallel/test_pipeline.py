"""Pipeline parallelism (torch.distributed.pipelining) composed with EP and FSDP2, on gloo: every pipelined layout
trains exactly like the single process -- losses, parameters, expert biases -- with MTP on and a first stage that
holds no MoE layer."""

from __future__ import annotations

import pytest
import torch

from moetrain.model.config import ConfigError
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.pipeline import default_layout, local_stages, stage_specs
from moetrain.parallel.schedules import bubble_formula

from .harness import assert_ranks_match, ok_values, run_ranks, run_single
from .pipeline_workers import pipeline_train_run
from .workers import tiny_test_config


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return run_single(pipeline_train_run, {"pp": 1}, 3)


def _check_against(reference, ranks, what):
    assert all(len(r["losses"]) == 3 for r in ranks)
    merged = assert_ranks_match(reference, ranks, what)
    biases = [n for n in reference["params"] if n.endswith("expert_bias")]
    assert biases and any(reference["params"][n].abs().sum() > 0 for n in biases), "biases never moved"
    for name in biases:
        for got in merged[name]:  # every rank holding the layer: bit-identical, and equal to the single process
            assert torch.equal(got, reference["params"][name]), (what, name)


@pytest.mark.dist
@pytest.mark.parametrize("pp,vpp,dp,ep,schedule", [
    (2, 1, 1, 1, "1f1b"),
    (2, 2, 1, 1, "interleaved"),
    (2, 1, 1, 1, "dualpipev"),
    (2, 1, 1, 1, "zbv"),
    pytest.param(2, 1, 2, 2, "1f1b", marks=pytest.mark.slow),
    pytest.param(4, 1, 1, 1, "1f1b", marks=pytest.mark.slow),
])
def test_pipelined_training_matches_single_process(reference, pp, vpp, dp, ep, schedule):
    kw = {"pp": pp, "vpp": vpp, "dp": dp * ep, "ep": ep, "schedule": schedule}  # dp counts the EP ranks too
    ranks = ok_values(run_ranks(pp * dp * ep, pipeline_train_run, kw, 3))
    _check_against(reference, ranks, kw)
    for r in ranks:  # the schedule ran and was timed: compute time never exceeds the step
        for total, bubble in r["bubbles"]:
            assert total > 0 and 0 <= bubble <= total


@pytest.mark.dist
@pytest.mark.parametrize("vpp,schedule", [(2, "interleaved"), pytest.param(1, "1f1b", marks=pytest.mark.slow)])
def test_resharding_after_every_forward_under_pp_matches_single_process(reference, vpp, schedule):
    """parallel.fsdp = true under PP (TorchTitan's and NeMo AutoModel's recipes): each stage's parameters resharded
    after every micro-batch's forward over DP 2, trained like one process."""
    kw = {"pp": 2, "vpp": vpp, "dp": 2, "schedule": schedule, "fsdp": True}
    _check_against(reference, ok_values(run_ranks(4, pipeline_train_run, kw, 3)), kw)


@pytest.mark.dist
@pytest.mark.parametrize("pp,vpp,schedule", [(2, 1, "1f1b"), (2, 2, "interleaved")])
def test_a_validation_before_the_first_step_leaves_training_unchanged(reference, pp, vpp, schedule):
    """The trainer validates at step 0, before any training step. On torch 2.11 a forward-only first call left the
    stages' receive buffers without requires_grad and the first training step failed ("gradients None ...
    expecting to send gradients", parallel/torch_compat.recv_buffers_ready_for_backward); the steps after the
    validation must equal the single process's."""
    kw = {"pp": pp, "vpp": vpp, "dp": 1, "ep": 1, "schedule": schedule}
    _check_against(reference, ok_values(run_ranks(pp, pipeline_train_run, kw, 3, 4, True)), kw)


def test_default_layout_and_stage_mapping():
    cfg = tiny_test_config(n_layers=6)
    assert default_layout(cfg, 4) == "Ett|tt|t|t" + "m" * cfg.mtp_depth + "L"
    v = ParallelConfig(pp=2, schedule="dualpipev")
    assert local_stages(v, 0) == [0, 3] and local_stages(v, 1) == [1, 2]
    loop = ParallelConfig(pp=2, vpp=2, schedule="interleaved")
    assert local_stages(loop, 0) == [0, 2] and local_stages(loop, 1) == [1, 3]
    specs = stage_specs(cfg, ParallelConfig(pp=2, pp_layout="Et*4|t*2mL"))
    assert [s.layers for s in specs] == [(0, 1, 2, 3), (4, 5)]
    assert specs[0].embed and not specs[0].head and specs[1].head and specs[1].mtp == (0,)
    assert specs[1].needs_embedding_copy


@pytest.mark.parametrize("layout,pp,msg", [
    ("Et*3|t*2mL", 2, "places 5 layers 't'; the model has n_layers=6"),
    ("Et*3|t*3|mL", 2, "has 3 stages; expected PP x stages per rank = 2 x 1 = 2"),
    ("Et*3|t*3L", 2, "places 0 MTP modules"),
    ("t*3|Et*3mL", 2, "'E' must open the first stage"),
    ("Et*3m|t*3L", 2, "MTP modules 'm' must sit in the last stage"),
    ("Et*3|t*3mLx", 2, "unexpected character"),
])
def test_bad_layouts_fail_at_once_with_the_count(layout, pp, msg):
    cfg = tiny_test_config(n_layers=6)
    with pytest.raises(ConfigError, match=msg.replace("(", r"\(").replace(")", r"\)").replace("*", r"\*")):
        stage_specs(cfg, ParallelConfig(pp=pp, pp_layout=layout))


def test_too_few_layers_and_bad_schedule_settings():
    with pytest.raises(ConfigError, match="cannot fill 8 pipeline stages"):
        stage_specs(tiny_test_config(n_layers=6), ParallelConfig(pp=4, vpp=2, schedule="interleaved"))
    with pytest.raises(ConfigError, match="needs parallel.schedule='interleaved'"):
        ParallelConfig(pp=2, vpp=2)
    with pytest.raises(ConfigError, match="allowed: 1f1b, interleaved, dualpipe, dualpipev, zbv"):
        ParallelConfig(pp=2, schedule="gpipe")
    with pytest.raises(ConfigError, match="not divisible by parallel.pp=2"):
        ParallelConfig(pp=2).resolve(3, 8)
    assert ParallelConfig(pp=2, ep=2).resolve(8, 8).edp == 2  # ranks holding the same experts (dp = 4 / ep = 2)
    assert ParallelConfig(pp=2, ep=2).resolve(8, 8).dp == 4  # Megatron's DP: every rank of a stage


def test_bubble_formula():
    # (p - 1) / (v m + p - 1): Narayanan et al. 2021
    assert bubble_formula(ParallelConfig(pp=2), 4) == pytest.approx(1 / 5)
    assert bubble_formula(ParallelConfig(pp=2, vpp=2, schedule="interleaved"), 4) == pytest.approx(1 / 9)
    assert bubble_formula(ParallelConfig(pp=1), 4) == 0.0


def _merged(ranks):
    out: dict[str, torch.Tensor] = {}
    for r in ranks:
        for k, v in r["params"].items():
            out.setdefault(k, v)
    return out


@pytest.mark.dist
@pytest.mark.parametrize("save_kw,load_kw", [
    ({"pp": 2, "schedule": "1f1b"}, {"pp": 1}),
    ({"pp": 1}, {"pp": 2, "schedule": "dualpipev"}),  # the V puts the embedding and its copy on one rank
])
def test_checkpoints_reshard_across_pp(tmp_path, save_kw, load_kw):
    from .pipeline_workers import pipeline_checkpoint_run

    def go(kw, save):
        n = kw["pp"]
        if n == 1:
            return [run_single(pipeline_checkpoint_run, kw, str(tmp_path), save)]
        return ok_values(run_ranks(n, pipeline_checkpoint_run, kw, str(tmp_path), save))

    saved, loaded = go(save_kw, True), go(load_kw, False)
    a, b = _merged(saved), _merged(loaded)
    assert a.keys() == b.keys()
    for name in a:
        assert torch.equal(a[name], b[name]), name  # bit-exact state after the reshard
    for r in loaded:
        assert abs(r["loss2"] / saved[0]["loss2"] - 1) <= 1e-5, (r["loss2"], saved[0]["loss2"])


@pytest.mark.dist
def test_init_from_hf_under_pp(tmp_path):
    """Each stage reads its own tensors of a released-layout checkpoint: the union equals the written weights."""
    from moetrain.interop.hf import save_hf_checkpoint
    from moetrain.model.transformer import build_model

    from .pipeline_workers import pipeline_init_from_run, pipeline_job

    cfg = pipeline_job({"pp": 1}).model
    src = build_model(cfg, seed=7)
    with torch.no_grad():
        for m in src.moe_layers():
            m.gate.expert_bias.normal_()
    save_hf_checkpoint(src, tmp_path / "hf")
    ranks = ok_values(run_ranks(2, pipeline_init_from_run, {"pp": 2, "schedule": "dualpipev"}, str(tmp_path / "hf")))
    got = _merged([{"params": r} for r in ranks])
    want = dict(src.named_parameters()) | dict(src.named_buffers())
    assert got.keys() == want.keys()
    for name, t in want.items():
        assert torch.equal(got[name], t.detach()), name
    # the last stage's embedding copy (rank 0 under the V, beside stage 0) read the same embedding
    assert all(torch.equal(r["embed_tokens.weight"], want["embed_tokens.weight"]) for r in ranks
               if "embed_tokens.weight" in r)


def test_unset_grad_accum_becomes_the_schedule_minimum_and_plan_files_map():
    import json

    from moetrain.config import load_job_config
    from moetrain.train.from_plan import PlanFile, plan_from_dict, plan_job

    job = load_job_config(None, ["parallel.pp=2", 'parallel.schedule="dualpipev"'], world=2)
    assert (job.train.grad_accum, job.train.micro_batch_size) == (4, 8)  # 32 sequences per step kept
    assert any("needs 4 micro-batches" in n for n in job.notes)
    job = load_job_config(None, ["parallel.pp=2", "train.grad_accum=3"], world=2)
    assert job.train.grad_accum == 3  # set by the user: kept (the schedule checks it)
    plan = {"tp": 1, "pp": 2, "vpp": 2, "ep": 1, "cp": 1, "dp": 1, "micro_batch": 4, "global_batch": 16,
            "seq_len": 64, "recompute": "none", "schedule": "interleaved", "optimizer": "fp32", "routing": "real",
            "model": "tiny"}
    pj = plan_job(PlanFile(plan_from_dict(plan), model="tiny"))
    par = pj.sections["parallel"]
    assert pj.world == 2 and pj.sections["train"]["grad_accum"] == 4 and par["dp"] == 1 and par["schedule"] == "interleaved"
    job = load_job_config(None, [], world=pj.world, plan=pj.sections)
    assert (job.parallel.pp, job.parallel.vpp, job.train.micro_batch_size) == (2, 2, 4)
    with pytest.raises(ConfigError, match=r"tensor parallelism \(tp=2"):
        plan_job(PlanFile(plan_from_dict({**plan, "tp": 2, "fp8_param": True, "precision": "fp8"})))
    fp8 = plan_job(PlanFile(plan_from_dict({**plan, "fp8_param": True, "precision": "fp8"}), model="tiny"))
    assert fp8.sections["parallel"]["fp8_param"] is True
    sel = plan_job(PlanFile(plan_from_dict({**plan, "recompute": "selective", "recompute_modules": ["mlp"]})))
    assert sel.sections["parallel"]["recompute_modules"] == ("mlp",)
    assert json.dumps(pj.sections)  # typed values that are still plain JSON


def test_plan_dp_includes_ep_and_so_does_the_trainer_dp():
    from moetrain.config import load_job_config
    from moetrain.train.from_plan import PlanFile, plan_from_dict, plan_job

    d = {"pp": 2, "ep": 2, "dp": 2, "micro_batch": 2, "global_batch": 8, "seq_len": 64}
    pj = plan_job(PlanFile(plan_from_dict(d), given=frozenset(d)))
    par = pj.sections["parallel"]
    assert pj.world == 4 and par["dp"] == 2 and par["ep"] == 2 and pj.sections["train"]["grad_accum"] == 2
    job = load_job_config(None, [], world=4, plan=pj.sections)
    assert job.parallel.resolve(4, job.model.n_routed_experts).edp == 1  # the ranks holding the same experts
    d = {"pp": 2, "dp": 1}
    pj = plan_job(PlanFile(plan_from_dict(d), given=frozenset(d)))
    assert "seq_len" not in pj.sections["data"]  # no sequence length: the job's own


def test_pipeline_checks_run_before_any_worker():
    """The launcher's preflight runs these: a bad layout, tied embeddings or too few micro-batches never start a
    worker."""
    from moetrain.parallel.pipeline import check_pipeline

    cfg = tiny_test_config(n_layers=4)
    check_pipeline(cfg, ParallelConfig(pp=2), 2)
    with pytest.raises(ConfigError, match="places 5 layers"):
        check_pipeline(cfg, ParallelConfig(pp=2, pp_layout="Ettt|ttmL"), 2)
    with pytest.raises(ConfigError, match="needs at least 4 micro-batches"):
        check_pipeline(cfg, ParallelConfig(pp=2, schedule="dualpipev"), 2)
    with pytest.raises(ConfigError, match="tie_embeddings"):
        check_pipeline(cfg.replace(tie_embeddings=True), ParallelConfig(pp=2), 2)
