"""EP overlap across micro-batches (``parallel.ep_overlap``): micro-batch i+1's forward paired with micro-batch i's
backward phase by phase. Trains exactly like the single process and the non-overlapped run, and really issues the
phases interleaved (read from the recorded phase events, not from timing)."""

from __future__ import annotations

import pytest
import torch

from moetrain.model.config import ConfigError
from moetrain.parallel.config import ParallelConfig

from moetrain.parallel.overlap import LEAD_STEPS
from moetrain.parallel.schedules import one_f_one_b_order, paired_fraction

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
    pytest.param({"ep": 2, "ep_overlap": True, "dispatcher": "alltoall", "dispatch_precision": "bf16"}, marks=pytest.mark.slow),
])
def test_overlapped_training_matches_single_process(reference, kw):
    ranks = ok_values(run_ranks(2, pipeline_train_run, kw, 3))
    _check_against(reference, ranks, kw)


@pytest.mark.dist
def test_fp8_dispatch_under_overlap_matches_it_without():
    """FP8 rows on the wire (quantised on send, straight-through gradient): the same with and without pairing."""
    kw = {"ep": 2, "dispatch_precision": "fp8"}
    off = ok_values(run_ranks(2, pipeline_train_run, kw, 2))
    on = ok_values(run_ranks(2, pipeline_train_run, {**kw, "ep_overlap": True}, 2))
    for a, b in zip(off, on):
        assert a["losses"] == pytest.approx(b["losses"], rel=1e-5)
        for name, want in a["params"].items():
            torch.testing.assert_close(b["params"][name], want, msg=lambda m, n=name: f"{n}: {m}")


def _check_pair(events, f, b):
    """Forward tape ``f`` paired with backward tape ``b``: LEAD_STEPS backward steps of ``b`` before ``f``'s first
    all-to-all issue, then exactly one step of ``b`` after each issue of ``f`` while ``b`` has steps left, the rest
    after ``f``'s forward; each reverse all-to-all of ``b`` issued inside its step. Returns the number of issues of
    ``f`` that a backward step followed (the interleaved ones)."""
    sub = [(m, k, d) for m, k, d in events if m in (f, b) and k != "wgrad"]
    for i, (m, k, _) in enumerate(sub):
        if k == "bwd-issue":
            assert sub[i - 1][:2] == (m, "backward"), (f, b, sub[i - 1:i + 1])
    seq = [(m, k, d) for m, k, d in sub if k != "bwd-issue"]
    start = [x[:2] for x in seq].index((f, "issue"))
    n_b = sum(1 for x in seq if x[:2] == (b, "backward"))
    lead = [x for x in seq[:start] if x[:2] == (b, "backward")]
    steps = list(range(n_b - 1, -1, -1))
    before = n_b - len([x for x in seq[start:] if x[:2] == (b, "backward")])
    assert before == min(LEAD_STEPS, n_b) and [x[2] for x in lead][-before:] == steps[:before], (f, b, seq)
    steps = steps[before:]
    want, n_f = [], sum(1 for x in seq if x[:2] == (f, "issue"))
    for _ in range(n_f):
        want.append((f, "issue", None))
        if steps:
            want.append((b, "backward", steps.pop(0)))
    want += [(b, "backward", s) for s in steps]
    got = [(m, k, d if k == "backward" else None) for m, k, d in seq[start:] if m == b or k == "issue"]
    assert got == want, (f, b, got, want)
    return min(n_f, n_b - before)


def _check_interleaved(events, n_micro):
    issues = {f"mb{i}": [d for m, k, d in events if m == f"mb{i}" and k == "issue"] for i in range(n_micro)}
    n_bound = len(issues["mb0"])
    assert n_bound >= 12 and all(len(v) == n_bound for v in issues.values()), issues
    assert issues["mb0"][:3] == ["layer0 counts", "layer0 dispatch", "layer0 combine"], issues["mb0"]
    for i in range(1, n_micro):
        f, b = f"mb{i}", f"mb{i - 1}"
        assert _check_pair(events, f, b) == n_bound - 1, (f, b)
        steps_b = [d for m, k, d in events if m == b and k == "backward"]
        assert steps_b == list(range(n_bound, -1, -1)), steps_b


@pytest.mark.dist
def test_overlapped_schedule_issues_phases_interleaved():
    ranks = ok_values(run_ranks(2, overlap_events_run, {"ep": 2, "ep_overlap": True}, 4))
    assert ranks[0]["events"] == ranks[1]["events"]  # the same collectives in the same order on every rank
    events = ranks[0]["events"]
    _check_interleaved(events, 4)
    # Delayed wgrad: the weight gradients of a backward step (routed experts, projections) run after the step's
    # reverse all-to-alls are issued; with three boundaries per MoE layer, every step but the loss's defers some.
    n_moe = len(ranks[0]["phases"])
    for i, e in enumerate(events):
        if e[1] == "wgrad":
            # right after the step: its reverse all-to-alls' issue, or its backward when it issued none
            assert events[i - 1][0] == e[0] and events[i - 1][1] in ("backward", "bwd-issue"), events[i - 2:i + 1]
    for mb in range(4):
        assert sum(1 for e in events if e[:2] == (f"mb{mb}", "wgrad")) >= 2 * n_moe, events
    for layer in ranks[0]["phases"]:  # every phase of every MoE layer was timed, forward and backward
        assert set(layer) == {"counts", "dispatch", "combine", "dispatch backward", "combine backward"}, layer
        assert all(total >= exposed >= 0 for total, exposed in layer.values()), layer
    # Off: no tape, no phase events; the same loss.
    off = ok_values(run_ranks(2, overlap_events_run, {"ep": 2, "ep_overlap": False}, 4))
    assert off[0]["events"] == []
    assert abs(off[0]["loss"] - ranks[0]["loss"]) <= 1e-5 * abs(off[0]["loss"])


@pytest.mark.dist
@pytest.mark.parametrize("kw", [
    # (2, 1) has no all-to-all boundaries: its tapes are single segments, a path (2, 2) runs too
    pytest.param({"pp": 2, "ep": 1, "schedule": "dualpipev"}, marks=pytest.mark.slow),
    {"pp": 2, "ep": 2, "schedule": "dualpipev"},
    pytest.param({"pp": 2, "vpp": 2, "ep": 2, "schedule": "interleaved"}, marks=pytest.mark.slow),
    pytest.param({"pp": 2, "ep": 2, "schedule": "1f1b"}, marks=pytest.mark.slow),
    pytest.param({"pp": 2, "dp": 2, "ep": 1, "schedule": "dualpipev"}, marks=pytest.mark.slow),
])
def test_pipelined_overlap_matches_single_process(reference, kw):
    """OVERLAP_F_B under pipelining (dualpipev's own pairs; 1F1B's merged steady state): the same losses,
    parameters and biases as the single process (and so as the schedule without pairing, which test_pipeline
    checks against the same reference)."""
    kw = {"dp": kw["ep"], **kw, "ep_overlap": True}  # dp counts the EP ranks (one expert replica unless given)
    ranks = ok_values(run_ranks(kw["pp"] * kw["dp"], pipeline_train_run, kw, 3))
    _check_against(reference, ranks, kw)


def _pairs(events):
    """The OVERLAP_F_B pairs in ``events``: (forward tape, backward tape) for every backward step of one tape that
    ran between two forward boundaries of another."""
    found = set()
    seq = [e for e in events if e[1] in ("issue", "backward")]
    for i in range(1, len(seq) - 1):
        (f, k0, _), (b, k1, _), (f2, k2, _) = seq[i - 1:i + 2]
        if (k0, k1, k2) == ("issue", "backward", "issue") and f == f2 != b:
            found.add((f, b))
    return found


@pytest.mark.dist
@pytest.mark.parametrize("kw", [
    {"pp": 2, "ep": 2, "schedule": "dualpipev"},
    pytest.param({"pp": 2, "vpp": 2, "ep": 2, "schedule": "interleaved"}, marks=pytest.mark.slow),
])
def test_pipelined_overlap_interleaves_the_paired_chunks(kw):
    """Each OVERLAP_F_B's forward and backward chunks interleave phase by phase on the rank: between the
    forward's all-to-all issues run the backward's steps, each issuing its reverse all-to-all."""
    kw = {"dp": kw["ep"], **kw, "ep_overlap": True}  # dp counts the EP ranks
    ranks = ok_values(run_ranks(4, overlap_events_run, kw, 4, 8))
    # validation after the step (dualpipev runs it as a training step with a zero loss): the same on every rank
    assert all(r["val"] == ranks[0]["val"] and 0 < r["val"] < 20 for r in ranks), [r["val"] for r in ranks]
    by_pp = {}
    for r in ranks:
        by_pp.setdefault(r["pp_rank"], []).append(r["events"])
    for pp_rank, evs in by_pp.items():
        assert evs[0] == evs[1], pp_rank  # the EP peers issue the same collectives in the same order
        events = [e for e in evs[0] if e[1] != "wgrad"]
        pairs = _pairs(events)
        assert len(pairs) >= 2, (pp_rank, pairs, events)
        for f, b in pairs:
            assert f.split("mb")[0] != b.split("mb")[0] or kw["schedule"] != "dualpipev", (f, b)
            assert _check_pair(events, f, b) >= 2, (f, b)  # real interleaving, not one after the other
        # every micro-batch's backward of every stage ran once per segment, last segment first
        tapes = {m for m, _, _ in events}
        for t in tapes:
            steps = [d for m, k, d in events if m == t and k == "backward"]
            assert steps == list(range(len(steps) - 1, -1, -1)), (t, steps)


@pytest.mark.parametrize("pp,m", [(2, 4), (4, 4), (4, 8), (3, 5)])
def test_merged_1f1b_lowers_without_a_hang(pp, m):
    """Merging each steady-state backward with the forward that follows it keeps the schedule executable: torch's
    send/recv lowering (which simulates every rank and raises on a schedule that cannot progress) accepts it, and
    every compute action is still there once."""
    from torch.distributed.pipelining.schedules import OVERLAP_F_B, _add_send_recv
    from moetrain.parallel.schedules import pair_actions

    order = one_f_one_b_order(pp, m)
    merged = {r: pair_actions(a) for r, a in order.items()}
    for r in range(pp):
        flat = [x for a in merged[r] for x in (a.sub_actions if a.computation_type == OVERLAP_F_B else (a,))]
        assert sorted(map(str, flat)) == sorted(map(str, order[r]))
        n_pairs = sum(a.computation_type == OVERLAP_F_B for a in merged[r])
        assert n_pairs == max(0, m - (pp - 1 - r) - 1), (r, merged[r])
    _add_send_recv(merged, stage_to_rank=lambda s: s, num_stages=pp)


def test_one_f_one_b_order_is_the_textbook_one():
    order = one_f_one_b_order(2, 4)
    assert [str(a) for a in order[0]] == ["0F0", "0F1", "0B0", "0F2", "0B1", "0F3", "0B2", "0B3"]
    assert [str(a) for a in order[1]] == ["1F0", "1B0", "1F1", "1B1", "1F2", "1B2", "1F3", "1B3"]


def test_paired_fraction_counts_the_pairs_of_the_schedule_the_trainer_runs():
    """Hand-counted: 1F1B at PP 2, m 4 pairs m - (PP - 1 - r) - 1 backwards with a forward on rank r (2 and 3 of
    4); PP 1 pairs m - 1 of m; DualPipeV's own order pairs most of its passes once m >> PP; ZB-V none."""
    assert paired_fraction("1f1b", 2, 1, 4) == [2 * 2 / 8, 2 * 3 / 8]
    assert paired_fraction("1f1b", 1, 1, 4) == [0.75]
    assert paired_fraction("zbv", 2, 2, 4) == [0.0, 0.0]
    dv = paired_fraction("dualpipev", 4, 2, 64)
    assert len(dv) == 4 and all(0.85 < f < 1.0 for f in dv), dv
    il = paired_fraction("interleaved", 2, 2, 8)
    assert all(0 < f < 1 for f in il) and il[0] < il[1], il  # rank 0 warms up longest
    assert paired_fraction("dualpipev", 4, 2, 7) == [0.0] * 4  # fewer than the 8 it needs: refused by the trainer


@pytest.mark.parametrize("schedule,pp,vpp,m", [("1f1b", 4, 1, 40), ("dualpipev", 2, 2, 48), ("dualpipev", 3, 2, 50),
                                               ("interleaved", 2, 2, 40), ("interleaved", 4, 2, 64)])
def test_paired_fraction_past_the_counting_size_equals_the_full_count(schedule, pp, vpp, m):
    """Past 4 PP x stages per rank micro-batches the unpaired passes are counted at that size: the same as counting
    the whole order (warm-up and cool-down no longer grow)."""
    from moetrain.parallel.schedules import _unpaired_passes
    n_local = {"1f1b": 1, "dualpipev": 2}.get(schedule, vpp)
    full = [1.0 - u / (2 * n_local * m) for u in _unpaired_passes(schedule, pp, n_local, m)]
    assert paired_fraction(schedule, pp, vpp, m) == pytest.approx(full, abs=1e-12)


@pytest.mark.parametrize("kw,msg", [
    ({"pp": 2, "schedule": "zbv", "ep_overlap": True}, "schedule='zbv'"),
    ({"recompute": "full", "ep_overlap": True}, "recompute='full'"),
    ({"n_chunks": 2, "ep_overlap": True}, "n_chunks=2"),
    ({"overlap": False, "ep_overlap": True}, "parallel.overlap=false"),
    ({"ep_overlap": "yes"}, "must be true or false"),
])
def test_ep_overlap_refuses_what_it_does_not_combine_with(kw, msg):
    with pytest.raises(ConfigError, match=msg):
        ParallelConfig(**kw)


def test_plan_files_map_ep_overlap_to_the_schedule_the_trainer_runs():
    from moetrain.plan.local import local_plan
    from moetrain.train.from_plan import PlanFile, plan_from_dict, plan_job
    from .workers import tiny_test_config

    def plan_overrides(d):
        pj = plan_job(PlanFile(plan_from_dict(d)))
        return pj.sections["parallel"], pj.world

    plan = local_plan(tiny_test_config(), 32, 2, 2, world=2, ep=2, ep_overlap=True)
    assert plan.overlap_schedule == "paired-microbatch"  # the planner models the schedule the trainer runs
    par, world = plan_overrides(plan.to_dict())
    assert par["ep_overlap"] is True and world == 2
    piped = local_plan(tiny_test_config(), 32, 2, 4, world=4, ep=2, pp=2, vpp=2, schedule="dualpipev",
                       ep_overlap=True)
    assert piped.overlap_schedule == "dualpipev"
    assert local_plan(tiny_test_config(), 32, 2, 4, world=4, ep=2, pp=2, vpp=2, schedule="dualpipev",
                      ep_overlap=False).overlap_schedule is None  # the trainer's dualpipev pairs only with it
    assert local_plan(tiny_test_config(), 32, 2, 4, world=4, ep=2, pp=2,
                      ep_overlap=True).overlap_schedule == "combined-1f1b"
    par, world = plan_overrides(piped.to_dict())
    assert par["ep_overlap"] is True and par["schedule"] == "dualpipev" and world == 4
    with pytest.raises(ConfigError, match="zbv"):
        plan_overrides({**piped.to_dict(), "schedule": "zbv"})
    with pytest.raises(ConfigError, match="cannot run this plan yet: .*recompute='full'.*--no-ep-overlap"):
        plan_overrides({**plan.to_dict(), "recompute": "full"})


def test_job_notes_for_overlap_that_hides_nothing_and_profile_steps_past_the_end():
    from moetrain.config import build_job_config

    job = build_job_config({"parallel": {"ep_overlap": True}, "train": {"grad_accum": 1, "steps": 4,
                                                                        "profile_steps": [2, 9]}}, world=1)
    text = " ".join(job.notes)
    assert "train.grad_accum=1" in text and "parallel.ep=1" in text and "[9] lie past train.steps=4" in text
    with pytest.raises(ConfigError, match=r"train.profile_steps=0 must be a list"):
        build_job_config({"train": {"profile_steps": 0}})
