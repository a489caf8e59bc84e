"""Imbalance telemetry (``moetrain.parallel.imbalance``): rows per EP rank against a hand count, the time lost to
imbalance larger under a forced skew than under forced-balanced routing at EP 2 (gloo), nothing lost in a single
process, the per-layer arithmetic on hand values, the metrics window, and the device-event path read only once the
step has synchronised."""

from __future__ import annotations

import json

import pytest
import torch

from moetrain.model.moe import DispatchStats
from moetrain.parallel import timing
from moetrain.parallel.imbalance import ExpertTimer, ImbalanceStep
from moetrain.plan.measured import imbalance_from_run
from moetrain.train.metrics import ImbalanceWindow, StepMetrics

from .fake_events import FakeApi
from .harness import ok_values, run_ranks, run_single
from .imbalance_workers import SKEWED_EXPERTS, imbalance_pipeline_run, imbalance_train_run
from .workers import GLOBAL_SEQS


def test_lost_time_per_layer_by_hand():
    # layer 0: rank 0 computes 30 ms, rank 1 10 ms and waits 18 ms more in the combine than rank 0:
    #   rank 0: (30 - 20) + (2 - 2) = 10 ms, rank 1: (10 - 20) + (20 - 2) = 8 ms -> 10 ms lost.
    # layer 1: equal compute, but rank 1 waits 5 ms longer (the hot link): 0 + 5 -> 5 ms lost.
    # layer 2: balanced and equal waits -> 0.
    step = ImbalanceStep([0, 1, 2], rows_MR=[[30, 10], [8, 8], [4, 4]],
                         expert_s_MR=[[0.030, 0.010], [0.010, 0.010], [0.004, 0.004]],
                         wait_s_MR=[[0.002, 0.020], [0.001, 0.006], [0.003, 0.003]])
    assert step.rows_max_over_mean() == [1.5, 1.0, 1.0]
    assert step.rows_step_max_over_mean() == pytest.approx(42 / 32)  # rows of all layers: 42 and 22
    assert step.lost_s() == pytest.approx([0.010, 0.005, 0.0])
    assert step.expert_gap_s() == pytest.approx([0.010, 0.0, 0.0])
    assert step.wait_caused_s() == pytest.approx([0.018, 0.005, 0.0])
    # without EP nothing is measured and nothing is lost
    none = ImbalanceStep([0, 1])
    assert none.rows_max_over_mean() == [1.0, 1.0] and none.lost_s() == [0.0, 0.0]
    assert none.rows_step_max_over_mean() == 1.0


def test_under_pp_the_step_lost_what_the_pipeline_rank_that_lost_most_lost():
    # pipeline rank 0 holds layer 0 (10 ms lost, as above), rank 1 layers 1 and 2: 5 ms, and 2 ms (compute 6 | 2 ms,
    # mean 4, equal waits). The ranks run concurrently: the step lost rank 0's 10 ms, not the 17 ms of all layers.
    kw = dict(rows_MR=[[30, 10], [8, 8], [6, 2]], expert_s_MR=[[0.030, 0.010], [0.010, 0.010], [0.006, 0.002]],
              wait_s_MR=[[0.002, 0.020], [0.001, 0.006], [0.0, 0.0]])
    pp = ImbalanceStep([0, 1, 2], pp_rank_M=[0, 1, 1], **kw)
    one = ImbalanceStep([0, 1, 2], **kw)
    assert pp.lost_s() == one.lost_s() == pytest.approx([0.010, 0.005, 0.002])
    assert pp.step_totals() == pytest.approx((0.010, 0.010, 0.018))  # (lost, expert gap, wait caused) of rank 0
    assert one.step_totals() == pytest.approx((0.017, 0.012, 0.023))  # PP 1: all layers
    assert pp.rows_step_max_over_mean() == pytest.approx(1.5)  # rank 0: 30 | 10; rank 1: 14 | 10 -> 14 / 12
    assert one.rows_step_max_over_mean() == pytest.approx(44 / 32)
    w = ImbalanceWindow()
    w.add(pp)
    w.add(pp)
    f = w.fields(n_steps=2, window_s=0.4)
    assert f["imbalance_lost_ms"] == pytest.approx(10.0) and f["imbalance_lost_share"] == pytest.approx(0.05)
    assert f["imbalance_lost_share_per_layer"] == pytest.approx([0.05, 0.025, 0.01])
    assert f["imbalance_expert_ms"] == pytest.approx(10.0) and f["imbalance_combine_wait_ms"] == pytest.approx(18.0)
    assert f["imbalance_moe_layers"] == [0, 1, 2] and f["ep_rows_per_rank"] == kw["rows_MR"]


def test_metrics_window_gives_share_of_the_step_and_resets():
    w = ImbalanceWindow()
    a = ImbalanceStep([3, 4], [[6, 2], [4, 4]], [[0.03, 0.01], [0.01, 0.01]], [[0.0, 0.02], [0.0, 0.0]])
    w.add(a)
    w.add(a)
    f = w.fields(n_steps=2, window_s=0.4)
    assert f["imbalance_lost_ms"] == pytest.approx(10.0)  # 2 x 10 ms over 2 steps
    assert f["imbalance_lost_share"] == pytest.approx(0.05)  # 20 ms of 400 ms
    assert f["imbalance_lost_share_per_layer"] == pytest.approx([0.05, 0.0])
    assert f["ep_rows_imbalance"] == [1.5, 1.0] and f["ep_rows_imbalance_max"] == 1.5
    assert f["ep_rows_imbalance_step"] == pytest.approx(10 / 8)
    assert f["ep_rows_per_rank"] == [[6, 2], [4, 4]] and f["imbalance_moe_layers"] == [3, 4]
    assert f["imbalance_expert_ms"] == pytest.approx(10.0) and f["imbalance_combine_wait_ms"] == pytest.approx(20.0)
    assert w.fields(1, 1.0) == {}  # a new window: nothing until the next step
    names = set(StepMetrics.__dataclass_fields__)
    assert set(f) <= names and any("lost" in k for k in names)


def test_expert_timer_on_device_events_reads_only_at_take():
    """The event path (a stand-in for CUDA): forward and backward spans are events, read by take() only."""
    api = FakeApi()
    prev = timing.install_device_api("cpu", api)
    try:
        stats = DispatchStats()
        t = ExpertTimer(stats)
        w = torch.randn(8, 8, requires_grad=True)
        x = t.start(torch.randn(5, 8, requires_grad=True))
        y = t.stop(x @ w)
        y.sum().backward()
        stats.add("combine", 0.5, 0.25)
        stats.add("dispatch (gate weights) backward", 0.5, 0.5)
        stats.add("dispatch", 0.5, 0.5)  # not a wait for the experts of another rank
        assert api.elapsed_reads == 0
        rows, seconds, wait = t.take()
        assert rows == 5 and seconds >= 0 and wait == pytest.approx(0.75)
        assert api.elapsed_reads == 2  # forward and backward spans
        assert t.take() == (0, 0.0, 0.0)
        stats.recording = False  # validation: nothing counted
        t.stop(t.start(torch.randn(3, 8)))
        assert t.take() == (0, 0.0, 0.0)
    finally:
        timing.install_device_api("cpu", prev)


def test_single_process_reports_nothing_lost():
    (step,) = run_single(imbalance_train_run, {}, "learned", 1)["steps"]
    assert step["lost_s"] == [0.0] * 4 and step["rows_ratio"] == [1.0] * 4 and step["rows"] == []


@pytest.mark.dist
def test_skew_at_ep2_counts_rows_by_hand_and_loses_more_time_than_balanced():
    # Skewed and balanced routing alternate step by step in one run, so both meet the same load of the host. Four
    # times the tokens of the other tests, so that the experts' time follows their rows more than their weights
    # (FSDP's copies, the weight gradients of experts without rows).
    ranks = ok_values(run_ranks(2, imbalance_train_run, {"ep": 2}, "alternate", 9, 256, 4 * GLOBAL_SEQS))
    assert ranks[0]["steps"] == [{**s, "step_s": s0["step_s"]} for s, s0 in zip(ranks[1]["steps"], ranks[0]["steps"])]
    r = ranks[0]
    tk = r["tokens_per_step"] * r["top_k"]  # assignments per MoE layer and step, all ranks
    # one row per (token, local expert) assignment: the deduplicated dispatch's rows are counted per expert
    hand = [[sum(e < 8 for e in ex) * tk // 4, sum(e >= 8 for e in ex) * tk // 4] for ex in SKEWED_EXPERTS]
    assert hand == [[tk, 0], [tk, 0], [3 * tk // 4, tk // 4], [3 * tk // 4, tk // 4]]
    skewed = [s for s in r["steps"][1:] if s["routing"] == "skewed"]  # after the first step (warm-up)
    balanced = [s for s in r["steps"][1:] if s["routing"] == "balanced"]
    assert len(skewed) == len(balanced) == 4
    for s in skewed:
        assert s["layers"] == [0, 1, 2, 3] and s["rows"] == hand and s["rows_ratio"] == [2.0, 2.0, 1.5, 1.5]
        assert s["rows_step_ratio"] == 1.75  # 3.5 tk of 4 tk on rank 0
    for s in balanced:
        assert s["rows"] == [[tk // 2, tk // 2]] * 4 and s["rows_ratio"] == [1.0] * 4 and s["rows_step_ratio"] == 1.0
    # Time lost per step, summed over layers. A busy host only adds waits (a rank taken off its core keeps the other
    # waiting), to either kind of step: the least of each kind compares the imbalance itself.
    lost_skewed = min(sum(s["lost_s"]) for s in skewed)
    lost_balanced = min(sum(s["lost_s"]) for s in balanced)
    assert lost_skewed > 0 and lost_skewed > lost_balanced
    # the hot rank computes longer in the all-on-rank-0 layers, and the other waits longer in their combine
    expert_R = [sum(s["expert_s"][m][r] for s in skewed for m in (0, 1)) for r in (0, 1)]
    wait_R = [sum(s["wait_s"][m][r] for s in skewed for m in (0, 1)) for r in (0, 1)]
    assert expert_R[0] > expert_R[1] and wait_R[1] > wait_R[0]


@pytest.mark.dist
@pytest.mark.parametrize("pcfg", [{"dispatcher": "alltoall"}, {"ep_overlap": True}])
def test_rows_per_rank_by_hand_on_the_per_assignment_path_and_under_ep_overlap(pcfg):
    for r in ok_values(run_ranks(2, imbalance_train_run, {"ep": 2, **pcfg}, "skewed", 1)):
        (s,) = r["steps"]
        tk = r["tokens_per_step"] * r["top_k"]
        assert s["rows"] == [[tk, 0], [tk, 0], [3 * tk // 4, tk // 4], [3 * tk // 4, tk // 4]]
        assert all(c > 0 for layer in s["expert_s"][2:] for c in layer) and all(v >= 0 for v in s["lost_s"])


@pytest.fixture(scope="module")
def pp1_run():
    return ok_values(run_ranks(2, imbalance_pipeline_run, {"ep": 2, "dp": 2}))


@pytest.fixture(scope="module")
def pp2_runs():
    """The PP 2 x EP 2 run of a schedule, run once for the tests of this module that read it."""
    runs: dict[str, list] = {}

    def run(schedule: str) -> list:
        if schedule not in runs:
            runs[schedule] = ok_values(run_ranks(4, imbalance_pipeline_run,
                                                 {"pp": 2, "ep": 2, "dp": 2, "schedule": schedule}))
        return runs[schedule]
    return run


#: The schedules of the PP 2 x EP 2 tests and the pipeline rank of each MoE layer under them.
PP2_SCHEDULES = [
    ("1f1b", [0, 1, 1, 1]),  # stage 0: MoE layer 0; stage 1: MoE 1, 2 and the MTP's 3
    ("dualpipev", [1, 1, 0, 0]),  # the V: rank 0 holds stages 0 (dense only) and 3 (MoE 2, MTP 3), rank 1 MoE 0, 1
]


@pytest.mark.dist
@pytest.mark.parametrize("schedule,pp_rank_M", PP2_SCHEDULES)
def test_pp2_reports_every_stage_layers_as_the_pp1_run(tmp_path, pp1_run, pp2_runs, schedule, pp_rank_M):
    # The same weights and data at PP 1 x EP 2 and PP 2 x EP 2: step 0 under learned routing, step 1 skewed. Every
    # rank of the PP run reports every layer of the model, with the rows of the PP 1 run.
    pp1 = pp1_run
    pp2 = pp2_runs(schedule)
    assert [(r["pp_rank"], r["ep_rank"]) for r in pp2] == [(0, 0), (0, 1), (1, 0), (1, 1)]
    ref = pp1[0]["steps"]
    tk = pp1[0]["tokens_per_step"] * pp1[0]["top_k"]
    hand = [[sum(e < 8 for e in ex) * tk // 4, sum(e >= 8 for e in ex) * tk // 4] for ex in SKEWED_EXPERTS]
    assert ref[1]["rows"] == hand and ref[0]["layers"] == [0, 1, 2, 3] and ref[0]["pp_rank_M"] == []
    assert [sum(r) for r in ref[0]["rows"]] == [tk] * 4 and ref[0]["rows"] != hand  # learned: some other split
    for r in pp2:
        for s, s1 in zip(r["steps"], ref):
            assert s["layers"] == [0, 1, 2, 3] and s["pp_rank_M"] == pp_rank_M
            assert s["rows"] == s1["rows"] and s["loads"] == s1["loads"]
            # the step's lost time: that of the pipeline rank that lost most
            per_rank = [sum(v for v, p in zip(s["lost_s"], pp_rank_M) if p == q) for q in (0, 1)]
            assert s["totals"][0] == pytest.approx(max(per_rank))
        # every rank holds the same imbalance figures (the all-to-all figures are each rank's own: another test)
        assert [{k: v for k, v in s.items() if k != "a2a"} for s in r["steps"]] == \
            [{k: v for k, v in s.items() if k != "a2a"} for s in pp2[0]["steps"]]
    # `moetrain plan --imbalance-from` reads the logged expert loads: complete under PP, so the same figure
    for name, run in (("pp1", pp1), ("pp2", pp2)):
        d = tmp_path / name
        d.mkdir()
        records = [{"kind": "run", "step": 0, "ep": 2}]
        records += [{"kind": "train", "step": i + 1, "expert_load": s["loads"]} for i, s in enumerate(run[0]["steps"])]
        (d / "metrics.jsonl").write_text("".join(json.dumps(x) + "\n" for x in records))
    assert imbalance_from_run(tmp_path / "pp2") == imbalance_from_run(tmp_path / "pp1") > 1.0


PHASES = ["combine", "combine backward", "counts", "dispatch", "dispatch backward"]


@pytest.mark.dist
@pytest.mark.parametrize("schedule,pp_rank_M", PP2_SCHEDULES)
def test_pp2_a2a_metrics_cover_every_stage_layer_with_the_pp1_run_bytes(pp1_run, pp2_runs, schedule, pp_rank_M):
    # The all-to-all figures of a rank are its own dispatchers' and, under PP, those of its pipeline's ranks (the
    # same EP rank in the other stage): the PP 1 rank with that EP rank sent the same rows, so the same bytes.
    pp2 = pp2_runs(schedule)
    for r in pp2:
        peer = next(p for p in pp2 if p["ep_rank"] == r["ep_rank"] and p["pp_rank"] != r["pp_rank"])
        ref = next(p for p in pp1_run if p["ep_rank"] == r["ep_rank"])
        for s, s_peer, s1 in zip(r["steps"], peer["steps"], ref["steps"], strict=True):
            a, a1 = s["a2a"], s1["a2a"]
            assert a1["layers"] == [0, 1, 2, 3] and a1["pp_rank_M"] == []
            assert a["layers"] == [0, 1, 2, 3] and a["pp_rank_M"] == pp_rank_M
            assert a == s_peer["a2a"]  # one all-reduce: the pipeline's ranks hold the same figures
            assert a["bytes"] == a1["bytes"] and a["remote_bytes"] == a1["remote_bytes"]
            assert all(b > rb > 0 for b, rb in zip(a["bytes"], a["remote_bytes"]))
            assert a["phases"] == a1["phases"] == [PHASES] * 4
            f = a["fields"]  # the metrics record's fields (one step, one second)
            assert len(f["a2a_s_per_layer"]) == len(f["a2a_exposed_s_per_layer"]) == 4
            assert all(v > 0 for v in f["a2a_s_per_layer"]) and len(f["a2a_s_per_layer_phase"]) == 4
            assert f["dispatch_bytes_per_step"] == sum(a1["bytes"]) == a1["fields"]["dispatch_bytes_per_step"]
            assert f["dispatch_remote_bytes_per_step"] == sum(a1["remote_bytes"])
            # the step's seconds: the pipeline rank with the most exposed seconds, not the sum over the stages
            per_rank = [(sum(e for e, p in zip(a["exposed_s"], pp_rank_M) if p == q),
                         sum(t for t, p in zip(a["a2a_s"], pp_rank_M) if p == q)) for q in (0, 1)]
            exposed, total = max(per_rank)
            assert a["totals"] == pytest.approx([total, exposed]) and total < sum(a["a2a_s"])
            assert f["a2a_s_per_step"] == pytest.approx(total) and f["a2a_exposed_s_per_step"] == pytest.approx(exposed)


@pytest.mark.dist
def test_pp2_without_ep_a2a_metrics_of_the_one_rank_all_to_all_cover_every_stage_layer():
    # EP 1 with the all-to-all dispatcher (a one-GPU machine's path): no imbalance to gather, but all-to-all figures
    # under PP still come from every stage, the same bytes as the PP 1 run's
    pp1 = ok_values(run_ranks(1, imbalance_pipeline_run, {"dispatcher": "alltoall"}))
    pp2 = ok_values(run_ranks(2, imbalance_pipeline_run, {"pp": 2, "dispatcher": "alltoall"}))
    for r in pp2:
        for s, s1 in zip(r["steps"], pp1[0]["steps"], strict=True):
            a, a1 = s["a2a"], s1["a2a"]
            assert a["layers"] == a1["layers"] == [0, 1, 2, 3] and a["pp_rank_M"] == [0, 1, 1, 1]
            assert a["bytes"] == a1["bytes"] and all(b > 0 for b in a["bytes"])
            assert a["remote_bytes"] == a1["remote_bytes"] == [0] * 4  # one EP rank: nothing leaves it
            assert a["phases"] == a1["phases"] == [PHASES] * 4 and all(v > 0 for v in a["a2a_s"])
            assert s["layers"] == [0, 1, 2, 3] and s["rows"] == []
        assert r["steps"] == pp2[0]["steps"]
