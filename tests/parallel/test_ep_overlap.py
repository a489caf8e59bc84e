"""EP overlap across micro-batches (``parallel.ep_overlap``): micro-batch i+1's forward paired with micro-batch i's
backward phase by phase. Trains exactly like the single process and the non-overlapped run, and really issues the
phases interleaved (read from the recorded phase events, not from timing)."""

from __future__ import annotations

import pytest
import torch

from moetrain.model.config import ConfigError
from moetrain.parallel.config import ParallelConfig

from .harness import ok_values, run_ranks, run_single
from .overlap_workers import overlap_events_run
from .pipeline_workers import pipeline_train_run
from .test_pipeline import _check_against


@pytest.fixture(scope="module")
def reference():
    torch.set_num_threads(1)
    return run_single(pipeline_train_run, {"pp": 1}, 3)


@pytest.mark.dist
@pytest.mark.parametrize("kw", [
    {"ep": 2, "ep_overlap": True},
    pytest.param({"ep": 2, "ep_overlap": True, "dedup": False, "dispatch_dtype": "bf16"}, marks=pytest.mark.slow),
])
def test_overlapped_training_matches_single_process(reference, kw):
    ranks = ok_values(run_ranks(2, pipeline_train_run, kw, 3))
    _check_against(reference, ranks, kw)


@pytest.mark.dist
def test_fp8_dispatch_under_overlap_matches_it_without():
    """FP8 rows on the wire (quantised on send, straight-through gradient): the same with and without pairing."""
    kw = {"ep": 2, "dispatch_dtype": "fp8"}
    off = ok_values(run_ranks(2, pipeline_train_run, kw, 2))
    on = ok_values(run_ranks(2, pipeline_train_run, {**kw, "ep_overlap": True}, 2))
    for a, b in zip(off, on):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-5)
        for name, want in a["params"].items():
            torch.testing.assert_close(b["params"][name], want, msg=lambda m, n=name: f"{n}: {m}")


def _check_interleaved(events, n_micro):
    issues = {f"mb{i}": [d for m, k, d in events if m == f"mb{i}" and k == "issue"] for i in range(n_micro)}
    n_bound = len(issues["mb0"])
    assert n_bound >= 8 and all(len(v) == n_bound for v in issues.values()), issues
    assert issues["mb0"][:2] == ["layer0 dispatch", "layer0 combine"], issues["mb0"]
    for i in range(1, n_micro):
        f, b = f"mb{i}", f"mb{i - 1}"
        # The pair: one backward step of micro-batch i-1 before the forward of i starts, then one after every
        # forward all-to-all of i, and its reverse all-to-alls issued before i computes on.
        pair = [(m, k) for m, k, _ in events if m in (f, b) and k != "wgrad"]
        start = pair.index((f, "issue"))
        assert pair[start - 2:start] == [(b, "backward"), (b, "bwd-issue")], pair[start - 3:start + 1]
        window = pair[start:]
        for j in range(n_bound - 1):
            assert window[3 * j:3 * j + 3] == [(f, "issue"), (b, "backward"), (b, "bwd-issue")], (j, window)
        steps_b = [d for m, k, d in events if m == b and k == "backward"]
        assert steps_b == list(range(n_bound, -1, -1)), steps_b


@pytest.mark.dist
def test_overlapped_schedule_issues_phases_interleaved():
    ranks = ok_values(run_ranks(2, overlap_events_run, {"ep": 2, "ep_overlap": True}, 4))
    assert ranks[0]["events"] == ranks[1]["events"]  # the same collectives in the same order on every rank
    events = ranks[0]["events"]
    _check_interleaved(events, 4)
    # Delayed wgrad: the weight gradients of a backward step (routed experts, projections) run after the step's
    # reverse all-to-alls are issued; with two boundaries per MoE layer, every step but the loss's defers some.
    n_moe = len(ranks[0]["phases"])
    for i, e in enumerate(events):
        if e[1] == "wgrad":
            assert events[i - 1] in ((e[0], "backward", 0), (e[0], "bwd-issue", events[i - 1][2])), events[i - 2:i + 1]
    for mb in range(4):
        assert sum(1 for e in events if e[:2] == (f"mb{mb}", "wgrad")) >= 2 * n_moe, events
    for layer in ranks[0]["phases"]:  # every phase of every MoE layer was timed, forward and backward
        assert set(layer) == {"counts", "dispatch", "combine", "dispatch backward", "combine backward"}, layer
        assert all(total >= exposed >= 0 for total, exposed in layer.values()), layer
    # Off: no tape, no phase events; the same loss.
    off = ok_values(run_ranks(2, overlap_events_run, {"ep": 2, "ep_overlap": False}, 4))
    assert off[0]["events"] == []
    assert abs(off[0]["loss"] - ranks[0]["loss"]) <= 1e-5 * abs(off[0]["loss"])


@pytest.mark.parametrize("kw,msg", [
    ({"pp": 2, "ep_overlap": True}, "parallel.pp=2"),
    ({"activation_checkpointing": True, "ep_overlap": True}, "activation_checkpointing"),
    ({"n_chunks": 2, "ep_overlap": True}, "n_chunks=2"),
    ({"overlap": False, "ep_overlap": True}, "parallel.overlap=false"),
    ({"ep_overlap": "yes"}, "must be true or false"),
])
def test_ep_overlap_refuses_what_it_does_not_combine_with(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        ParallelConfig(**kw)


def test_plan_files_map_ep_overlap_at_pp1_and_refuse_it_under_pipelining():
    from moetrain.plan.local import local_plan
    from moetrain.train.from_plan import plan_overrides
    from .workers import tiny_test_config

    plan = local_plan(tiny_test_config(), 32, 2, 2, world=2, ep=2, ep_overlap=True)
    assert plan.overlap_schedule == "paired-microbatch"  # the planner models the schedule the trainer runs
    sets, world = plan_overrides(plan.to_dict())
    assert "parallel.ep_overlap=true" in sets and world == 2
    with pytest.raises(ConfigError, match="pipelining"):
        plan_overrides({**plan.to_dict(), "pp": 2, "dp": 1})
    with pytest.raises(ConfigError, match="cannot run this plan yet: .*full recompute.*--recompute none"):
        plan_overrides({**plan.to_dict(), "recompute": "full"})


def test_job_notes_for_overlap_that_hides_nothing_and_profile_steps_past_the_end():
    from moetrain.config import build_job_config

    job = build_job_config({"parallel": {"ep_overlap": True}, "train": {"grad_accum": 1, "steps": 4,
                                                                        "profile_steps": [2, 9]}}, world=1)
    text = " ".join(job.notes)
    assert "train.grad_accum=1" in text and "parallel.ep=1" in text and "[9] lie past train.steps=4" in text
    with pytest.raises(ConfigError, match=r"train.profile_steps=0 must be a list"):
        build_job_config({"train": {"profile_steps": 0}})
