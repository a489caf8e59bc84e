"""What expert-load imbalance costs a step, measured: rows and expert compute time per EP rank, and the time lost.

Under learned routing the EP rank whose experts receive the most rows computes longest, and the other ranks wait
for it in the combine all-to-all (in the backward: in the all-to-all that returns the dispatch's gradient). Every
step, per MoE layer:

* **Rows per EP rank**: the rows this rank's experts compute -- one per (token, local expert) assignment, the rows
  of the grouped GEMM (capacity padding included, since it is computed). On the deduplicated path a token with
  two experts on a rank crosses the wire once but is computed twice: it counts 2 here. The number is the length of
  the expert input the dispatcher hands over (known on the host from the count exchange: no synchronisation).
* **Expert time per EP rank**: from the expert input's hand-over to the combine's start (the grouped GEMMs and the
  SwiGLU between them), plus its backward (from the gradient's arrival at the expert output to its departure from
  the expert input), on the clocks of :mod:`moetrain.parallel.timing`: CUDA events on a GPU, read after the step's
  end synchronisation; the host clock on a CPU. Under EP overlap the weight gradients run later, deferred
  (``moetrain.model.phases.weight_grad``), and are not in the backward's interval. FSDP's gather of the expert
  weights (EDP > 1) falls inside the forward's interval; alike on every EP rank, it cancels in max - mean.
  Activation recomputation runs the experts' forward again: its rows and time count again (they are computed).
* **Combine wait per EP rank**: the exposed seconds of the layer's combine and of the dispatch's backward
  all-to-all (``DispatchStats.combine_wait_s``): the time the compute stood still for them.

Once per step the three (M layers each) are gathered over the EP group in one all-gather of 3 M numbers
(:func:`measure_moe_telemetry`); every layer's figures then follow on the host (:class:`ImbalanceStep`). The time lost
by layer l is

    lost_l = max_r [ (c_r - mean_r c) + (w_r - min_r w) ]

with c the expert time and w the combine wait of EP rank r: the time the layer took on rank r beyond a balanced
layer -- the mean expert time, and the least combine wait any rank had (the transfer itself, which the slowest
rank, finishing last, waits for alone) -- maximised over ranks (the step goes at the pace of its slowest path).
Without overlap every rank gives about ``max c - mean c``: the hottest rank computes that much longer, the others
wait that much longer in the combine. The fast ranks' waits are measured rather than assumed: a combine that takes
longer than the compute gap (the hot rank's link carries more rows) adds to it, and where overlapped work fills a
fast rank's wait, the hot rank's own extra compute is what remains on the critical path.

**Under pipeline parallelism** every stage measures its own MoE layers over its own EP group, as above; then one
all-reduce over the PP group (each pipeline rank fills the slots of its layers, by global MoE index, in a buffer of
4 x M_all x R zeros, the 4th row naming the pipeline rank that computed the layer) hands every rank the figures of
every MoE layer of the model, read back together with the EP all-gather's. A PP run therefore reports the same
layers, with the same rows for the same data and weights, as a PP 1 run of the model. The same all-reduce carries
every layer's all-to-all timers and dispatch bytes (``moetrain.parallel.a2a_telemetry``): one collective for both.

The step's time lost (:meth:`ImbalanceStep.step_totals`) is the sum of ``lost_l`` over the layers of one pipeline
rank -- all layers at PP 1 -- and under PP the largest such sum over the pipeline ranks. The pipeline ranks run
concurrently and each runs its micro-batches through its own layers; with many micro-batches the pipeline advances
at the pace of its slowest rank, so a step loses about what the rank that lost most lost (the same "slowest path"
as the max over EP ranks above). Summing over all stages instead would count concurrent losses PP times: under a
uniform imbalance it would report PP times the time actually lost. With few micro-batches the pipeline's fill and
drain also carry part of the other ranks' losses, so the figure is a lower bound there (within a factor of about 2
at as many micro-batches as stages). The per-layer figures stay per layer: under PP they need not sum to the step's.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

import torch
import torch.distributed as dist

from moetrain.model.moe import DispatchStats
from moetrain.parallel.a2a_telemetry import PACKED_PER_LAYER, A2AStep, pack
from moetrain.parallel.comm import named_phase
from moetrain.parallel.timing import Clock, clock_for


@dataclass
class _Span:
    """Points of one expert computation (one dispatch chunk): forward start/end, backward start/end (None until
    reached: a recomputed forward has no backward of its own, a forward without gradients none at all). The
    backward's points are marked by tensor hooks (no autograd node): when the gradient of the expert output has
    arrived (before the experts' backward) and when that of the expert input has been computed (after it)."""

    clock: Clock
    fwd_start: Any
    fwd_end: Any = None
    bwd_start: Any = None
    bwd_end: Any = None

    def start_backward(self, grad: torch.Tensor) -> None:
        self.bwd_start = self.clock.mark()

    def end_backward(self, grad: torch.Tensor) -> None:
        self.bwd_end = self.clock.mark()


class ExpertTimer:
    """Rows and expert compute time of this rank's experts in one MoE layer, since the last :meth:`take`.

    The dispatcher calls :meth:`start` on the expert input it hands over and :meth:`stop` on the expert output the
    combine receives; the MoE layer computes its experts in between and nothing else. Nothing is counted while
    ``stats.recording`` is off (validation).
    """

    def __init__(self, stats: DispatchStats):
        self.stats = stats
        self.rows = 0
        self.spans: list[_Span] = []

    def start(self, x_SD: torch.Tensor) -> torch.Tensor:
        """Mark the start of the experts' forward; count the rows of ``x_SD`` (S, D); when gradients flow, the end
        of the experts' backward will be marked when ``x_SD``'s gradient is computed. Returns ``x_SD``."""
        if not self.stats.recording:
            return x_SD
        clock = clock_for(x_SD.device)
        span = _Span(clock, clock.mark())
        self.spans.append(span)
        self.rows += x_SD.shape[0]
        if torch.is_grad_enabled() and x_SD.requires_grad:
            x_SD.register_hook(span.end_backward)
        return x_SD

    def stop(self, y_SD: torch.Tensor) -> torch.Tensor:
        """Mark the end of the experts' forward (``y_SD``: their output) and, when gradients flow, the start of
        their backward when ``y_SD``'s gradient arrives. Returns ``y_SD``."""
        if not self.stats.recording or not self.spans or self.spans[-1].fwd_end is not None:
            return y_SD
        span = self.spans[-1]
        span.fwd_end = span.clock.mark()
        if torch.is_grad_enabled() and y_SD.requires_grad:
            y_SD.register_hook(span.start_backward)
        return y_SD

    def take(self) -> tuple[int, float, float]:
        """(rows, expert seconds, combine-wait seconds) since the last call, and reset. On a GPU call it after a
        host synchronisation with the compute stream (the step's end), when every marked event has executed."""
        seconds = 0.0
        for s in self.spans:
            if s.fwd_end is not None:
                seconds += s.clock.seconds(s.fwd_start, s.fwd_end)
            elif s.clock.on_device:
                s.clock.release(s.fwd_start)
            if s.bwd_start is not None and s.bwd_end is not None:
                seconds += s.clock.seconds(s.bwd_start, s.bwd_end)
            elif s.clock.on_device:
                s.clock.release(*[p for p in (s.bwd_start, s.bwd_end) if p is not None])
        rows, wait = self.rows, self.stats.combine_wait_s
        self.rows, self.spans, self.stats.combine_wait_s = 0, [], 0.0
        return rows, seconds, wait


@dataclass
class ImbalanceStep:
    """One step's imbalance figures of this rank's MoE layers, from every EP rank of its group.

    Attributes:
        moe_layers: global MoE index of each layer (M; the rows of ``StepResult.tokens_per_expert_ME``).
        rows_MR: rows each EP rank's experts computed, per layer ([M][R]; empty lists without EP).
        expert_s_MR: seconds each EP rank's experts computed, forward and backward, per layer.
        wait_s_MR: seconds each EP rank stood still in the layer's combine and dispatch-backward all-to-alls.
        pp_rank_M: the pipeline rank that computed each layer (-1: none measured it); empty when one pipeline rank
            computed them all (PP 1).
    """

    moe_layers: list[int]
    rows_MR: list[list[int]] = field(default_factory=list)
    expert_s_MR: list[list[float]] = field(default_factory=list)
    wait_s_MR: list[list[float]] = field(default_factory=list)
    pp_rank_M: list[int] = field(default_factory=list)

    def rows_max_over_mean(self) -> list[float]:
        """max / mean rows per EP rank, per layer (1.0 = balanced, and where nothing was computed or without EP)."""
        out = []
        for rows in self.rows_MR:
            mean = sum(rows) / len(rows) if rows else 0.0
            out.append(max(rows) / mean if mean > 0 else 1.0)
        return out + [1.0] * (len(self.moe_layers) - len(out))

    def rows_step_max_over_mean(self) -> float:
        """max / mean over the EP ranks of their rows summed over the layers (1.0 without EP or rows); under PP over
        each pipeline rank's layers, and the largest over the pipeline ranks (each rank's devices are its EP group)."""
        out = 1.0
        for layers in self._by_pp_rank():
            total_R = [sum(col) for col in zip(*(self.rows_MR[i] for i in layers if i < len(self.rows_MR)))]
            mean = sum(total_R) / len(total_R) if total_R else 0.0
            out = max(out, max(total_R) / mean) if mean > 0 else out
        return out

    def step_totals(self) -> tuple[float, float, float]:
        """(seconds lost, expert gap seconds, combine wait seconds caused) of the step: :meth:`lost_s`,
        :meth:`expert_gap_s` and :meth:`wait_caused_s` summed over the layers of the pipeline rank that lost most
        (all layers at PP 1: module docstring)."""
        lost, gap, wait = self.lost_s(), self.expert_gap_s(), self.wait_caused_s()
        return max((sum(lost[i] for i in layers), sum(gap[i] for i in layers), sum(wait[i] for i in layers))
                   for layers in self._by_pp_rank())

    def expert_gap_s(self) -> list[float]:
        """max - mean expert seconds over the EP ranks, per layer."""
        return [max(c) - sum(c) / len(c) if c else 0.0 for c in self._padded(self.expert_s_MR)]

    def wait_caused_s(self) -> list[float]:
        """The largest combine wait beyond the least one, per layer: max_r (w_r - min w)."""
        return [max(w) - min(w) if w else 0.0 for w in self._padded(self.wait_s_MR)]

    def lost_s(self) -> list[float]:
        """Seconds lost to imbalance per layer: max_r [(c_r - mean c) + (w_r - min w)] (module docstring)."""
        out = []
        for c, w in zip(self._padded(self.expert_s_MR), self._padded(self.wait_s_MR)):
            if not c:
                out.append(0.0)
                continue
            mean_c, min_w = sum(c) / len(c), min(w)
            out.append(max(0.0, max(ci - mean_c + wi - min_w for ci, wi in zip(c, w))))
        return out

    def _by_pp_rank(self) -> list[list[int]]:
        """Positions of the layers each pipeline rank computed (one group of all layers at PP 1)."""
        if not self.pp_rank_M:
            return [list(range(len(self.moe_layers)))]
        groups: dict[int, list[int]] = {}
        for i, p in enumerate(self.pp_rank_M):
            groups.setdefault(p, []).append(i)
        return list(groups.values())

    def _padded(self, per_layer: list[list[float]]) -> list[list[float]]:
        return per_layer + [[] for _ in range(len(self.moe_layers) - len(per_layer))]


def measure_moe_telemetry(timers: list[tuple[int, ExpertTimer]], stats: list[tuple[int, DispatchStats]],
                          ep_group: Any, device: torch.device, pp_group: Any = None, n_moe: int = 0,
                          all_to_all: bool = True) -> tuple[ImbalanceStep, A2AStep]:
    """Take every layer's rows, expert time and combine wait since the last call and gather them over the EP group:
    one all-gather of 3 M float64 values (none without EP); under PP then one all-reduce over the PP group of
    4 x n_moe x EP float64 values, and in the same buffer each layer's all-to-all timers and dispatch bytes
    (``moetrain.parallel.a2a_telemetry``: n_moe x ``PACKED_PER_LAYER`` more), so that every rank holds the figures
    of every MoE layer of the model (module docstring). Call once per step on every rank, after the step's end
    synchronisation and ``DispatchStats.settle`` (device events are read here; the results are read back to the
    host once, after both collectives).

    Args:
        timers: (global MoE index, timer) of this rank's layers with an all-to-all dispatcher, the same layers on
            every rank of the EP group (one pipeline stage). Empty without expert parallelism, and on a pipeline
            rank without MoE layers.
        stats: (global MoE index, dispatcher stats) of every MoE layer of this rank.
        ep_group: the EP process group (None: a single process, or EP 1).
        device: where the collective's tensors live (the compute device).
        pp_group: the PP process group (None: PP 1). Every pipeline rank must call, with or without MoE layers.
        n_moe: with ``pp_group``, the MoE layers of the whole model (main and MTP; global indices 0..n_moe-1).
        all_to_all: the layers' dispatchers run all-to-alls (``ParallelConfig.moves_tokens``, alike on every
            rank). Without EP and without them, nothing is gathered under PP: every figure is zero on every stage.

    Returns:
        (imbalance, all-to-all figures): at PP 1 of this rank's layers; under PP of every layer of the model, in
        global order, with ``pp_rank_M``.

    Raises:
        CollectiveError: the all-gather or the all-reduce failed or timed out.
    """
    moe_layers = [m for m, _ in stats]
    R = dist.get_world_size(ep_group) if ep_group is not None else 0
    gathered_3MR = None
    if ep_group is None:
        for _, t in timers:
            t.take()
    elif timers:
        local_3M = torch.tensor([list(t.take()) for _, t in timers], dtype=torch.float64).t().contiguous()
        with named_phase("imbalance telemetry all-gather (EP group)"):
            parts = [torch.empty_like(local_3M, device=device) for _ in range(R)]
            dist.all_gather(parts, local_3M.to(device), group=ep_group)
        gathered_3MR = torch.stack(parts, dim=-1)
    if pp_group is None:
        if gathered_3MR is None:
            return ImbalanceStep(moe_layers), A2AStep.of(stats)
        with named_phase("imbalance telemetry all-gather (EP group)"):
            rows, expert_s, wait_s = gathered_3MR.cpu().tolist()  # (3, M, R)
        return (ImbalanceStep([m for m, _ in timers], [[int(v) for v in r] for r in rows], expert_s, wait_s),
                A2AStep.of(stats))
    pp_rank = dist.get_rank(pp_group)
    if ep_group is None and not all_to_all:
        # local dispatch on every stage: the other stages' figures are zeros, known without a collective
        local_MK = torch.zeros(n_moe, PACKED_PER_LAYER, dtype=torch.float64)
        pack(stats, local_MK, pp_rank)
        return ImbalanceStep(list(range(n_moe))), A2AStep.unpack(local_MK.tolist())
    # Pipeline ranks hold disjoint layers: the sum of the zero-padded buffers is their concatenation in global order.
    # One buffer for both telemetries: the imbalance's (4, n_moe, R), then the all-to-alls' (n_moe, K).
    n_imb = 4 * n_moe * R
    buf = torch.zeros(n_imb + n_moe * PACKED_PER_LAYER, dtype=torch.float64, device=device)
    all_4MR, a2a_MK = buf[:n_imb].view(4, n_moe, R), buf[n_imb:].view(n_moe, PACKED_PER_LAYER)
    if gathered_3MR is not None:
        idx = torch.tensor([m for m, _ in timers], device=device)
        all_4MR[:3, idx] = gathered_3MR
        all_4MR[3, idx] = float(pp_rank + 1)
    pack(stats, a2a_MK, pp_rank)
    with named_phase("imbalance and all-to-all telemetry all-reduce (PP group)"):
        dist.all_reduce(buf, group=pp_group)
        host = buf.cpu()
    a2a = A2AStep.unpack(host[n_imb:].view(n_moe, PACKED_PER_LAYER).tolist())
    if R == 0:
        return ImbalanceStep(list(range(n_moe))), a2a
    rows, expert_s, wait_s, owner = host[:n_imb].view(4, n_moe, R).tolist()
    return (ImbalanceStep(list(range(n_moe)), [[int(v) for v in r] for r in rows], expert_s, wait_s,
                          [int(o[0]) - 1 for o in owner]), a2a)
