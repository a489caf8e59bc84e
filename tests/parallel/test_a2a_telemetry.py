"""The all-to-all figures of every MoE layer (``moetrain.parallel.a2a_telemetry``) on hand-made dispatcher stats:
PP 1 as the dispatchers hold them, the PP all-reduce's packing, and the step totals under PP. The PP 2 x EP 2 run
against the PP 1 one is in test_imbalance.py (its worker and runs)."""

from __future__ import annotations

import pytest
import torch

from moetrain.model.moe import DispatchStats
from moetrain.parallel.a2a_telemetry import PACKED_PER_LAYER, A2AStep, pack
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.mesh import init_parallel
from moetrain.train.callbacks import LoopState, StepMetricsLogger
from moetrain.train.metrics import NullSink, StepMetrics, a2a_fields
from moetrain.train.step import StepResult


def _stats(phases: dict[str, tuple[float, float]], sent: int, remote: int) -> DispatchStats:
    s = DispatchStats(bytes_sent=sent, remote_bytes_sent=remote)
    for k, (a, e) in phases.items():
        s.add(k, a, e)
    return s


def _layers() -> list[tuple[int, DispatchStats]]:
    return [(0, _stats({"counts": (0.001, 0.001), "dispatch": (0.004, 0.002), "combine": (0.005, 0.0)}, 600, 400)),
            (1, _stats({"dispatch": (0.002, 0.002), "combine backward": (0.0, 0.0)}, 300, 100)),
            (2, _stats({"combine": (0.010, 0.001)}, 900, 450))]


def test_pp1_fields_are_the_dispatchers_own():
    # two steps in the window, 0.5 s long: per step, shares of the window
    f = a2a_fields(A2AStep.of(_layers()), n_steps=2, window_s=0.5)
    assert f["a2a_s_per_step"] == pytest.approx(0.011) and f["a2a_exposed_s_per_step"] == pytest.approx(0.003)
    assert f["a2a_exposed_share"] == pytest.approx(6 / 22) and f["a2a_share_of_step"] == pytest.approx(0.012)
    assert f["a2a_s_per_layer"] == pytest.approx([0.005, 0.001, 0.005])
    assert f["a2a_exposed_s_per_layer"] == pytest.approx([0.0015, 0.001, 0.0005])
    assert f["a2a_s_per_layer_phase"][1] == {"dispatch": [0.001, 0.001], "combine backward": [0.0, 0.0]}
    assert f["dispatch_bytes_per_step"] == 900.0 and f["dispatch_remote_bytes_per_step"] == 475.0


def test_packed_over_two_pipeline_ranks_gives_every_layer_and_the_step_of_the_rank_most_exposed():
    # pipeline rank 0 holds layers 0 and 2, rank 1 layer 1 (non-contiguous, as under DualPipeV); the all-reduce is
    # the sum of the two ranks' zero-padded buffers
    layers = _layers()
    bufs = [torch.zeros(4, PACKED_PER_LAYER, dtype=torch.float64) for _ in range(2)]
    pack([layers[0], layers[2]], bufs[0], pp_rank=0)
    pack([layers[1]], bufs[1], pp_rank=1)
    pp = A2AStep.unpack((bufs[0] + bufs[1]).tolist())
    one = A2AStep.of(layers)
    assert pp.moe_layers == [0, 1, 2, 3] and pp.pp_rank_M == [0, 1, 0, -1] and one.pp_rank_M == []
    assert pp.a2a_s_M[:3] == one.a2a_s_M and pp.exposed_s_M[:3] == one.exposed_s_M
    # a phase that ran with zero seconds stays listed; the unset layer 3 has none
    assert pp.by_phase_M == one.by_phase_M + [{}] and pp.by_phase_M[1]["combine backward"] == [0.0, 0.0]
    assert pp.bytes_M == [600, 300, 900, 0] and pp.remote_bytes_M == [400, 100, 450, 0]
    # rank 0: 0.020 s, 0.004 s exposed; rank 1: 0.002 s all exposed. The step's: rank 0's, not the 0.022 s sum.
    assert pp.step_totals() == pytest.approx((0.020, 0.004))
    assert one.step_totals() == pytest.approx((0.022, 0.006))
    # bytes are summed over every stage
    assert pp.bytes_totals() == one.bytes_totals() == (1800, 950)
    # the rank exposed longest decides, even with fewer all-to-all seconds
    skew = A2AStep([0, 1], [0.010, 0.004], [0.001, 0.003], [{}, {}], [1, 2], [0, 0], [0, 1])
    assert skew.step_totals() == pytest.approx((0.004, 0.003))
    f = a2a_fields(skew, n_steps=1, window_s=0.1)
    assert f["a2a_exposed_share"] == pytest.approx(0.75) and f["dispatch_bytes_per_step"] == 3.0


class _Records(NullSink):
    def __init__(self) -> None:
        self.logged: list[StepMetrics] = []

    def log_step(self, m: StepMetrics, pipelined: bool, moves_tokens: bool = True) -> None:
        self.logged.append(m)


def test_the_metrics_logger_logs_the_step_figures_of_every_stage():
    # Stage 0 ran MoE layer 0 (no all-to-all time in it), stage 1 layers 1-3. The logger reads the step's
    # (all-reduced) figures, not its own dispatchers (it holds none here).
    a2a = A2AStep.unpack(torch.cat([_packed([(0, DispatchStats())], 0), _packed(_layers(), 1)]).tolist())
    assert a2a.pp_rank_M == [0, 1, 1, 1]
    ctx = init_parallel(ParallelConfig(), 4, device="cpu")
    logger = StepMetricsLogger(ctx, [], log_every=1, tokens_per_step=64, flops_per_token=1.0, peak_tflops=1.0,
                               bubble_formula=0.0, pipelined=True)
    sink = _Records()
    loop = LoopState(steps=1, start_step=0, sink=sink)
    logger.pre_step(loop)
    loop.step = 1
    logger.post_step(loop, StepResult(loss=1.0, lm_loss=1.0, mtp_loss=0.0, balance_loss=0.0, grad_norm=1.0,
                                      tokens_per_expert_ME=torch.ones(4, 4), n_tokens=64, n_sequences=2, a2a=a2a))
    (m,) = sink.logged
    assert m.a2a_s_per_layer == pytest.approx([0.0, 0.010, 0.002, 0.010])
    assert m.a2a_s_per_step == pytest.approx(0.022) and m.a2a_exposed_s_per_step == pytest.approx(0.006)
    assert m.dispatch_bytes_per_step == 1800.0 and m.dispatch_remote_bytes_per_step == 950.0
    assert m.a2a_s_per_layer_phase[0] == {} and set(m.a2a_s_per_layer_phase[3]) == {"combine"}


def _packed(layers: list[tuple[int, DispatchStats]], pp_rank: int) -> torch.Tensor:
    out = torch.zeros(len(layers), PACKED_PER_LAYER, dtype=torch.float64)
    pack([(i, s) for i, (_, s) in enumerate(layers)], out, pp_rank)
    return out
