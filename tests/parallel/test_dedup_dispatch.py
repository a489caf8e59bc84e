"""Token deduplication in the all-to-all dispatcher: one row per (token, destination rank), same results."""

from __future__ import annotations

import pytest
import torch

from moetrain.model.config import ConfigError
from moetrain.parallel.config import ParallelConfig

from .harness import ok_values, run_ranks, run_single
from .test_expert_parallel import ADAM_EPS
from .workers import (DEDUP_E, DEDUP_K, a2a_calls_run, dedup_expert_reference, dedup_inputs, dedup_rows_run,
                      moe_layer_run, train_run)

pytestmark = pytest.mark.dist


@pytest.mark.parametrize("overlap", [True, False])
def test_dedup_sends_one_row_per_token_and_rank(overlap):
    ranks = ok_values(run_ranks(2, dedup_rows_run, overlap))
    El = DEDUP_E // 2
    for src, r in enumerate(ranks):
        x_TD, idx_TK, w_TK, W_EDD = dedup_inputs(src)
        rank_TK = idx_TK // El
        has_expert_TR = torch.stack([(rank_TK == dst).any(dim=1) for dst in range(2)], dim=1)
        # One row per token to each rank holding at least one of its experts, and nothing to the other ranks
        # (tokens 0-2 have no expert on rank 1, tokens 3-4 none on rank 0)...
        assert r["dedup"]["send_splits"] == has_expert_TR.sum(dim=0).tolist()
        assert not has_expert_TR[:3, 1].any() and not has_expert_TR[3:5, 0].any()
        # ... where the per-assignment path sends one per token-expert pair.
        per_assignment = [int((rank_TK == dst).sum()) for dst in range(2)]
        assert r["per_assignment"]["send_splits"] == per_assignment
        assert sum(per_assignment) == idx_TK.numel() > sum(r["dedup"]["send_splits"])
        assert r["dedup"]["rows_sent"] == sum(r["dedup"]["send_splits"])
        assert r["dedup"]["remote_rows_sent"] == int(has_expert_TR[:, 1 - src].sum())
        assert r["dedup"]["remote_rows_sent"] < r["per_assignment"]["remote_rows_sent"] == per_assignment[1 - src]
        # The experts see exactly the same rows in the same order on both paths.
        assert torch.equal(r["dedup"]["x_AD"], r["per_assignment"]["x_AD"])
        assert torch.equal(r["dedup"]["counts"], r["per_assignment"]["counts"])
        # Output and gradients (through the gate weights too) equal the direct computation.
        x, w = x_TD.clone().requires_grad_(True), w_TK.clone().requires_grad_(True)
        y_ref = dedup_expert_reference(x, idx_TK, w, W_EDD)
        gx_ref, gw_ref = torch.autograd.grad((y_ref * y_ref).sum(), [x, w])
        for path in ("dedup", "per_assignment"):
            torch.testing.assert_close(r[path]["y"], y_ref.detach(), msg=lambda m, p=path: f"{p}: {m}")
            torch.testing.assert_close(r[path]["x_grad"], gx_ref, msg=lambda m, p=path: f"{p}: {m}")
            torch.testing.assert_close(r[path]["w_grad"], gw_ref, msg=lambda m, p=path: f"{p}: {m}")
        assert idx_TK.shape[1] == DEDUP_K
        # Timers: metadata and rows all-to-alls are measured; without overlap all of it is exposed.
        d = r["dedup"]
        assert d["calls"] == 1 and d["a2a"] > 0 and d["exposed"] > 0
        if not overlap:
            assert d["exposed"] >= 0.9 * d["a2a"]


def test_dedup_and_per_assignment_layers_agree_and_dedup_sends_fewer_rows():
    ref = run_single(moe_layer_run, {}, 24, 0.5)
    # (test_local_and_alltoall_dispatchers_agree covers the default, dedup, path with overlap off as well.)
    for extra in ({}, {"n_chunks": 2}):
        dedup = ok_values(run_ranks(2, moe_layer_run, {"ep": 2, **extra}, 24, 0.5))
        plain = ok_values(run_ranks(2, moe_layer_run, {"ep": 2, "dispatcher": "alltoall", **extra}, 24, 0.5))
        for run, label in ((dedup, "dedup"), (plain, "per assignment")):
            torch.testing.assert_close(torch.cat([r["y"] for r in run]), ref["y"],
                                       msg=lambda m, lb=label: f"{lb} {extra}: {m}")
            torch.testing.assert_close(torch.cat([r["x_grad"] for r in run]), ref["x_grad"])
            for name, g in ref["grads"].items():
                torch.testing.assert_close(run[0]["grads"][name], g, msg=lambda m, n=name: f"{label} {n}: {m}")
        for d, p in zip(dedup, plain):
            # tiny: top-4 of 16 experts over 2 ranks -- a token's 4 assignments reach at most 2 ranks.
            assert 0 < d["remote_rows_sent"] < p["remote_rows_sent"]
            assert d["rows_sent"] < p["rows_sent"] == 24 * 4


def test_all_tokens_to_one_rank_send_one_row_each():
    """All tokens pick experts 0..K-1 (rank 0): rank 0 sends nothing to rank 1; rank 1 sends each token once."""
    ranks = ok_values(run_ranks(2, train_run, {"ep": 2}, 1, 2, None, True, ADAM_EPS))
    plain = ok_values(run_ranks(2, train_run, {"ep": 2, "dispatcher": "alltoall"}, 1, 2, None, True, ADAM_EPS))
    tokens_per_rank_per_step = 4 * 32  # GLOBAL_SEQS / 2 ranks x SEQ_LEN
    K = 4
    for layer, layer_plain in zip(ranks[0]["comm"], plain[0]["comm"]):
        assert layer["remote_rows_sent"] == layer_plain["remote_rows_sent"] == 0
    for layer, layer_plain in zip(ranks[1]["comm"], plain[1]["comm"]):
        assert layer["remote_rows_sent"] == layer["rows_sent"] == tokens_per_rank_per_step
        assert layer_plain["remote_rows_sent"] == K * tokens_per_rank_per_step
    assert ranks[0]["losses"] == pytest.approx(plain[0]["losses"], rel=1e-5)


def test_dedup_flag_validated_and_capacity_mode_keeps_per_assignment_path():
    from moetrain.model.moe import CapacityConfig
    from moetrain.parallel.dispatch import AllToAllDispatcher

    from moetrain.config import build_job_config

    with pytest.raises(ConfigError, match="parallel.dedup"):  # the older spelling, translated when a job is read
        build_job_config({"parallel": {"dedup": "yes"}})
    assert ParallelConfig().dedup is True
    assert AllToAllDispatcher(16, 2, 0, None).dedup
    assert not AllToAllDispatcher(16, 2, 0, None, dedup=False).dedup
    assert not AllToAllDispatcher(16, 2, 0, None, CapacityConfig(factor=1.0)).dedup


@pytest.mark.parametrize("dedup", [True, False])
def test_all_to_all_calls_per_layer_match_the_declared_counts(dedup):
    """The performance model charges AllToAllDispatcher.CALLS_* call latencies per MoE layer: keep them true."""
    from moetrain.parallel.dispatch import AllToAllDispatcher

    want = AllToAllDispatcher.CALLS_DEDUP if dedup else AllToAllDispatcher.CALLS_PER_ASSIGNMENT
    for fwd_bwd in ok_values(run_ranks(2, a2a_calls_run, {"ep": 2, "dispatcher": "flex" if dedup else "alltoall"})):
        assert tuple(fwd_bwd) == want
