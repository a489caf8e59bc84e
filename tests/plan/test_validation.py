"""Bad input gets a clear message; a plan that does not fit is reported as such, never as a throughput."""

from __future__ import annotations

import json

import pytest

from moetrain.plan import Plan, PlanError, predict
from moetrain.plan.cli import main as plan_main
from moetrain.plan.hardware import CATALOGUE, HardwareError, get_gpu
from moetrain.plan.shape import ShapeError, load_shape


def test_unknown_gpu_lists_the_catalogue():
    with pytest.raises(HardwareError) as e:
        get_gpu("a100")
    for name in ("h100", "h800", "h200", "b200", "b300", "gb200", "gb300"):
        assert name in str(e.value)
    assert set(CATALOGUE) == {"h100", "h800", "h200", "b200", "b300", "gb200", "gb300"}
    assert get_gpu("GB300-NVL72") is get_gpu("gb300")


def test_sizes_must_multiply_to_gpu_count():
    with pytest.raises(PlanError, match="must multiply to the GPU count"):
        predict("deepseek-v3-671b", "gb300", 256, Plan(tp=1, pp=2, dp=100, ep=8, global_batch=4000))
    with pytest.raises(PlanError, match="does not divide the 256 GPUs"):
        predict("deepseek-v3-671b", "gb300", 256, Plan(tp=1, pp=3, ep=8))


def test_ep_must_divide_experts():
    with pytest.raises(PlanError) as e:
        predict("deepseek-v3-671b", "gb300", 256, Plan(pp=2, ep=48))
    assert "256 routed experts" in str(e.value) and "allowed EP" in str(e.value)


def test_other_invalid_plans():
    with pytest.raises(PlanError, match="global_batch"):
        predict("deepseek-v3-671b", "gb300", 256, Plan(pp=2, ep=32, global_batch=100))
    with pytest.raises(PlanError, match="Blackwell"):
        predict("deepseek-v3-671b", "h100", 1024, Plan(tp=2, pp=8, ep=64, precision="mxfp8", global_batch=8192))
    with pytest.raises(PlanError, match="interleaved"):
        predict("deepseek-v3-671b", "h100", 1024, Plan(tp=2, pp=8, vpp=4, ep=64, global_batch=64 * 130))
    with pytest.raises(PlanError, match="stages"):
        predict("deepseek-v3-671b", "gb300", 256, Plan(pp=2, vpp=8, ep=32, global_batch=4096, pp_layout="Et|tmL"))
    with pytest.raises(ShapeError, match="unknown model"):
        load_shape("no-such-model")


def test_plan_that_cannot_fit_is_reported_without_throughput():
    # DeepSeek-V3 on 8 H100 without pipeline parallelism: 671B parameters on 8 x 80 GB
    p = predict("deepseek-v3-671b", "h100", 8, Plan(tp=8, ep=8, global_batch=64, precision="fp8"))
    assert not p.fits
    assert p.tflops_per_gpu is None and p.tokens_per_s_per_gpu is None and p.step is None
    assert "does not fit" in p.message and "GiB" in p.message
    assert p.memory.total > 80


def test_cli_errors_and_not_fitting(capsys):
    assert plan_main(["--gpu", "a100"]) == 2
    assert "unknown GPU 'a100'" in capsys.readouterr().err
    assert plan_main(["--gpu", "gb300", "--gpus", "256", "--pp", "2", "--ep", "48"]) == 2
    assert "must divide the 256 routed experts" in capsys.readouterr().err
    assert plan_main(["--gpu", "gb300", "--gpus", "256", "--tp", "1", "--pp", "3"]) == 2
    capsys.readouterr()
    rc = plan_main(["--gpu", "h100", "--gpus", "8", "--tp", "8", "--ep", "8", "--gbs", "64", "--precision", "fp8",
                    "--json"])
    assert rc == 3
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] is False and d["tflops_per_gpu"] is None and "does not fit" in d["message"]
