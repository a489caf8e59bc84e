"""Sanity of the memory model and monotonicity of the step-time model."""

from __future__ import annotations

import dataclasses

import pytest

from moetrain.plan import Plan, get_gpu, predict
from moetrain.plan.hardware import with_overrides
from moetrain.plan.records import RECORDS

GB300 = RECORDS["gb300"]
H100 = RECORDS["h100"]


def _pred(rec, _ignore_memory=True, gpu=None, **changes):
    return predict(rec.model, gpu or rec.gpu, rec.n_gpus, rec.plan.replace(**changes), _ignore_memory=_ignore_memory)


def test_recompute_lowers_activation_memory():
    none = _pred(GB300).memory.activations
    sel = _pred(GB300, recompute="selective").memory.activations
    sel3 = _pred(GB300, recompute="selective", recompute_modules=("norm", "mla_up_proj", "moe_act")).memory.activations
    full = _pred(GB300, recompute="full").memory.activations
    assert none > sel > sel3 > full > 0


def test_recompute_costs_time():
    base = _pred(GB300)
    full = _pred(GB300, recompute="full")
    assert full.step.step > base.step.step


def test_more_pp_lowers_weights_per_gpu():
    w = [_pred(GB300, pp=pp, vpp=1, pp_layout=None, dp=None, schedule=None).memory for pp in (1, 2, 4, 8)]
    for a, b in zip(w, w[1:]):
        assert b.weights < a.weights and b.gradients < a.gradients


def test_more_ep_lowers_expert_memory():
    m = [_pred(GB300, ep=ep).memory for ep in (8, 16, 32, 64)]
    for a, b in zip(m, m[1:]):
        assert b.weights < a.weights


def test_fp8_primary_weights_and_bf16_optimizer_save_memory():
    a = _pred(GB300, optimizer="fp32").memory
    b = _pred(GB300, optimizer="bf16").memory
    c = _pred(GB300, optimizer="bf16", fp8_param=True).memory
    assert a.total > b.total > c.total


def test_ep_overlap_never_slower():
    for rec in (GB300, H100, RECORDS["gb200"]):
        on = _pred(rec, ep_overlap=True)
        off = _pred(rec, ep_overlap=False)
        assert on.step.step <= off.step.step
        assert on.step.exposed_a2a <= off.step.exposed_a2a


@pytest.mark.parametrize("rec", [GB300, H100])
def test_balanced_routing_never_slower(rec):
    bal = _pred(rec, routing="balanced")
    steps = [_pred(rec, routing="real", imbalance=f).step.step for f in (1.0, 1.1, 1.3, 1.6)]
    assert bal.step.step <= steps[0] + 1e-12
    assert all(a <= b for a, b in zip(steps, steps[1:]))


@pytest.mark.parametrize("rec", [H100, GB300, RECORDS["h800"]])
def test_more_nic_bandwidth_never_slower(rec):
    base = get_gpu(rec.gpu)
    steps = [_pred(rec, gpu=with_overrides(base, nic_gbps=g)).step.step for g in (12.5, 25, 50, 100, 200, 400)]
    assert all(b <= a + 1e-12 for a, b in zip(steps, steps[1:])), steps


def test_more_nvlink_bandwidth_and_peak_never_slower():
    base = get_gpu("gb300")
    s1 = _pred(GB300, gpu=with_overrides(base, nvlink_gbps=450)).step.step
    s2 = _pred(GB300, gpu=base).step.step
    assert s2 <= s1
    faster = with_overrides(base, peak_tflops={k: 2 * v for k, v in base.peak_tflops.items()})
    assert _pred(GB300, gpu=faster).step.step < s2


def test_node_limited_routing_cuts_cross_domain_traffic():
    # H100: EP64 spans 8 nodes of 8 GPUs; limiting tokens to 2 nodes must cut NIC traffic
    free = _pred(H100, node_limit_m=None).details["routing"]
    lim = _pred(H100, node_limit_m=2).details["routing"]
    assert lim["remote_domains"] < free["remote_domains"] <= 7
    assert _pred(H100, node_limit_m=2).step.exposed_a2a < _pred(H100, node_limit_m=None).step.exposed_a2a


def test_breakdown_sums_to_step_and_throughput_is_consistent():
    p = _pred(GB300, _ignore_memory=False)
    s = p.step
    assert s.step == pytest.approx(s.compute + s.exposed_a2a + s.other_comm + s.bubble + s.optimizer)
    assert sum(s.compute_parts.values()) == pytest.approx(s.compute)
    tok = GB300.plan.global_batch * GB300.plan.seq_len / (s.step * GB300.n_gpus)
    assert p.tokens_per_s_per_gpu == pytest.approx(tok)
    assert p.tflops_per_gpu == pytest.approx(tok * p.flops_per_token / 1e12)
    assert 0 < p.mfu < 1


def test_more_microbatches_shrink_the_bubble():
    small = _pred(H100, global_batch=64 * 8)    # 8 micro-batches per pipeline
    big = _pred(H100, global_batch=64 * 128)
    assert small.step.bubble / small.step.step > big.step.bubble / big.step.step


def test_plan_is_frozen_and_replace_works():
    p = Plan(tp=2)
    with pytest.raises(dataclasses.FrozenInstanceError):
        p.tp = 4  # type: ignore[misc]
    assert p.replace(tp=4).tp == 4 and p.tp == 2
