"""Expert parallelism on CPU with gloo: every distributed configuration equals the single-process run."""

from __future__ import annotations

import pytest
import torch

from moetrain.model.config import ConfigError
from moetrain.parallel.config import ParallelConfig

from .harness import ok_values, run_ranks, run_single
from .workers import (hang_in_dispatch_run, mismatched_config_run, moe_layer_run, stall_in_dense_layer_run,
                      tiny_test_config, train_run)

pytestmark = pytest.mark.dist

# Adam divides by sqrt(v) + eps: with eps = 1e-8 it maps fp32 round-off in gradients of magnitude ~1e-8 to
# parameter differences of order lr, which says nothing about the distributed plumbing. The parameter comparison
# therefore uses eps = 1e-5; the losses are compared at every step, and test_first_step_gradients_match checks
# the raw gradients with the default eps.
ADAM_EPS = 1e-5



@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return run_single(train_run, {}, 3, 2, None, False, ADAM_EPS)


# Token deduplication is the default of the all-to-all dispatcher (EP > 1); the per-assignment path is checked too.
@pytest.mark.parametrize("dp,ep,dedup", [(2, 1, True), (1, 2, True), (2, 2, True), (1, 4, True),
                                         (1, 2, False), (1, 4, False)])
def test_training_matches_single_process(reference, dp, ep, dedup):
    kw = {"ep": ep, "dispatcher": "flex" if dedup else "alltoall"}
    ranks = ok_values(run_ranks(dp * ep, train_run, kw, 3, 2, None, False, ADAM_EPS))
    for r in ranks:
        for got, want in zip(r["losses"], reference["losses"]):
            assert abs(got - want) <= 1e-5 * abs(want), (r["losses"], reference["losses"])
    params = ranks[0]["params"]
    assert params.keys() == reference["params"].keys()
    for name, want in reference["params"].items():
        torch.testing.assert_close(params[name], want, msg=lambda m, n=name: f"{n}: {m}")
    # Expert biases: bit-identical on every rank and equal to the single-process ones.
    bias_names = [n for n in reference["params"] if n.endswith("expert_bias")]
    assert bias_names
    for name in bias_names:
        assert reference["params"][name].abs().sum() > 0, "biases never moved: the test would prove nothing"
        for r in ranks:
            assert torch.equal(r["params"][name], reference["params"][name]), name


def test_local_and_alltoall_dispatchers_agree():
    ref = run_single(moe_layer_run, {}, 24, 0.5)
    for kwargs in ({"ep": 2}, {"ep": 2, "overlap": False}, {"ep": 2, "n_chunks": 2}, {"ep": 1, "dispatcher": "alltoall"}):
        ranks = ok_values(run_ranks(2, moe_layer_run, kwargs, 24, 0.5))
        y = torch.cat([r["y"] for r in ranks])
        torch.testing.assert_close(y, ref["y"], msg=lambda m: f"{kwargs}: {m}")
        torch.testing.assert_close(torch.cat([r["x_grad"] for r in ranks]), ref["x_grad"])
        for name, g in ref["grads"].items():
            torch.testing.assert_close(ranks[0]["grads"][name], g, msg=lambda m, n=name: f"{kwargs} {n}: {m}")


def test_overlap_on_off_identical_and_measured():
    on = ok_values(run_ranks(2, train_run, {"ep": 2, "overlap": True}, 2, 2, None, False, ADAM_EPS))
    off = ok_values(run_ranks(2, train_run, {"ep": 2, "overlap": False}, 2, 2, None, False, ADAM_EPS))
    assert on[0]["losses"] == off[0]["losses"]
    for name, t in on[0]["params"].items():
        assert torch.equal(t, off[0]["params"][name]), name
    for run in (on, off):
        for layer in run[0]["comm"]:
            assert layer["calls"] > 0
            assert layer["a2a"] > 0 and layer["exposed"] > 0
    # Without overlap every all-to-all is waited for at once, so nothing is hidden.
    for layer in off[0]["comm"]:
        assert layer["exposed"] >= 0.9 * layer["a2a"]


def test_all_tokens_to_one_rank():
    ref = run_single(train_run, {}, 2, 2, None, True, ADAM_EPS)
    ranks = ok_values(run_ranks(2, train_run, {"ep": 2}, 2, 2, None, True, ADAM_EPS))
    loads = ranks[0]["stats"][0]["loads"]
    half = loads.shape[1] // 2
    assert loads[:, half:].sum() == 0 and loads[:, :half].sum() > 0  # rank 1's experts got nothing
    for got, want in zip(ranks[0]["losses"], ref["losses"]):
        assert abs(got - want) <= 1e-5 * abs(want)
    for name, want in ref["params"].items():
        torch.testing.assert_close(ranks[0]["params"][name], want)


@pytest.mark.parametrize("policy", ["probs", "position"])
def test_capacity_mode_matches_reference(policy):
    pc = {"capacity_factor": 1.0, "drop_policy": policy}
    # Capacity is computed per dispatch call from the local tokens, so the reference uses micro-batches of the
    # same size as each rank's (accumulation 4 on one process = 2 ranks x accumulation 2).
    ref = run_single(train_run, pc, 2, 4, None, False, ADAM_EPS)
    ranks = ok_values(run_ranks(2, train_run, {"ep": 2, **pc}, 2, 2, None, False, ADAM_EPS))
    dropped = [s["dropped"] for s in ranks[0]["stats"]]
    assert dropped == [s["dropped"] for s in ref["stats"]]
    assert all(d > 0 for d in dropped), "capacity factor 1.0 should drop tokens with learned routing"
    for got, want in zip(ranks[0]["losses"], ref["losses"]):
        assert abs(got - want) <= 1e-5 * abs(want)
    for name, want in ref["params"].items():
        torch.testing.assert_close(ranks[0]["params"][name], want)


def test_capacity_padding_gives_same_result():
    ref = run_single(moe_layer_run, {"capacity_factor": 1.0}, 24, 0.5)
    padded = ok_values(run_ranks(2, moe_layer_run, {"ep": 2, "capacity_factor": 1.0, "pad_to_capacity": True}, 24, 0.5))
    unpadded = ok_values(run_ranks(2, moe_layer_run, {"ep": 2, "capacity_factor": 1.0}, 24, 0.5))
    torch.testing.assert_close(torch.cat([r["y"] for r in padded]), torch.cat([r["y"] for r in unpadded]))
    assert sum(r["dropped"] for r in padded) > 0 and [r["dropped"] for r in padded] == [r["dropped"] for r in unpadded]


def test_bad_sizes_fail_before_training():
    with pytest.raises(ConfigError, match="must divide the number of routed experts"):
        ParallelConfig(ep=3).resolve(world_size=3, n_routed_experts=16)
    with pytest.raises(ConfigError, match="not divisible by parallel.ep=4"):
        ParallelConfig(ep=4).resolve(world_size=2, n_routed_experts=16)
    results = run_ranks(2, train_run, {"ep": 4}, 1, 1)
    assert all(s == "error" and "not divisible by parallel.ep=4" in v for s, v in results), results


def test_ranks_disagreeing_on_config_fail():
    results = run_ranks(2, mismatched_config_run)
    assert all(s == "error" and "different config" in v for s, v in results), results


def test_hanging_collective_names_the_phase():
    results = run_ranks(2, hang_in_dispatch_run, timeout=60)
    status, msg = results[0]
    assert status == "error" and "dispatch" in msg and "CollectiveError" in msg, msg


def test_stall_in_a_dense_layer_names_the_forward_phase():
    results = run_ranks(2, stall_in_dense_layer_run, timeout=90)
    status, msg = results[0]
    assert status == "error" and "CollectiveError" in msg and "during forward" in msg, msg
