"""Qwen3-MoE trains exactly like the single process at EP 2, PP 2 (dualpipev with ep_overlap) and DP 2 x EP 2, with
its global-batch balance loss counted over the data-parallel group."""

from __future__ import annotations

import pytest
import torch

from .harness import assert_ranks_match, ok_values, run_ranks, run_single
from .qwen3_workers import qwen3_train_run

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return run_single(qwen3_train_run, {}, 2)


def _check(reference, ranks, what):
    assert all(b > 0 for b in reference["balance"]), "no balance loss: the test would prove nothing about it"
    assert_ranks_match(reference, ranks, what, series=("losses", "balance"))


@pytest.mark.parametrize("kw", [
    {"ep": 2, "dp": 2},
    {"pp": 2, "ep": 2, "dp": 2, "schedule": "dualpipev", "ep_overlap": True},
    {"ep": 2, "dp": 4},
])
def test_qwen3_layouts_match_single_process(reference, kw):
    world = kw.get("pp", 1) * kw["dp"]
    _check(reference, ok_values(run_ranks(world, qwen3_train_run, kw, 2)), kw)


def test_micro_batch_balance_loss_is_not_the_global_one(reference):
    """The same layout with the per-rank micro-batch loss gives another balance loss: what the test above
    distinguishes is the reduction over the data-parallel group."""
    ranks = ok_values(run_ranks(2, qwen3_train_run, {"ep": 2, "dp": 2}, 1, 4, {"balance_loss": "micro_batch"}))
    assert abs(ranks[0]["balance"][0] - reference["balance"][0]) > 1e-4 * reference["balance"][0]
