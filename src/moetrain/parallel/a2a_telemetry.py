"""The expert all-to-alls' timers and dispatch bytes of every MoE layer, under pipeline parallelism too.

Each MoE layer's dispatcher accumulates, on its own rank, the seconds of its all-to-alls, the part of them the
compute waited for (exposed), both by phase, and the bytes of the token rows it dispatched
(:class:`~moetrain.model.moe.DispatchStats`), until the metrics logger reads and resets them. At PP 1 one rank's
layers are all the model's: :meth:`A2AStep.of` takes them as they are. Under PP a rank holds one stage's layers; at
the end of every step each pipeline rank packs its layers' figures (:func:`pack`) by global MoE index into the
all-reduce over the PP group that carries the imbalance telemetry (``moetrain.parallel.imbalance``: one collective
for both, read back with it), so every rank holds every layer's figures (:meth:`A2AStep.unpack`) -- those of the
ranks of its pipeline, each stage's rank with the same DP and EP coordinates. (At EP 1 with the all-to-all
dispatcher over one rank the all-reduce runs for these figures alone; with local dispatch nothing is gathered: every
figure is zero.)

Step totals under PP (:meth:`A2AStep.step_totals`): the pipeline ranks run concurrently, so a figure summed over
layers is that of one pipeline rank -- all layers at PP 1, and under PP the rank whose all-to-alls the compute
waited for longest (its all-to-all and exposed seconds both: the pair of one rank, so their ratio is that rank's
exposed share): exposed seconds are what the all-to-alls cost the step, and a step loses about what its slowest
pipeline rank lost, the rule of the imbalance telemetry's lost time. Summing over stages would count concurrent
transfers PP times. Byte counts are not time: :meth:`A2AStep.bytes_totals` sums them over every stage's layers.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from moetrain.model.moe import DispatchStats

#: Values per MoE layer in the packed buffer: all-to-all s, exposed s, bytes, remote bytes, pipeline rank + 1 (0:
#: no rank filled the row), launch s, then per phase of ``DispatchStats.PHASES`` (present, all-to-all s, exposed s).
_HEAD = 6
PACKED_PER_LAYER = _HEAD + 3 * len(DispatchStats.PHASES)


@dataclass
class A2AStep:
    """All-to-all figures of MoE layers, accumulated in their dispatchers since the metrics logger's last reset.

    Attributes:
        moe_layers: global MoE index of each layer (M): this rank's at PP 1, every layer of the model under PP.
        a2a_s_M: seconds of the layer's all-to-alls (dispatch and combine, forward and backward).
        exposed_s_M: the part of them the compute waited for.
        by_phase_M: per layer {phase: [all-to-all s, exposed s]}, phases of ``DispatchStats.PHASES`` that ran.
        bytes_M: bytes of the token rows the layer dispatched (to every EP rank, this one included).
        remote_bytes_M: the part of them sent to other EP ranks.
        pp_rank_M: the pipeline rank that ran each layer (-1: none); empty at PP 1.
        launch_s_M: host seconds in the issue calls of the layer's all-to-alls (their launch, not in a2a_s_M).
    """

    moe_layers: list[int]
    a2a_s_M: list[float] = field(default_factory=list)
    exposed_s_M: list[float] = field(default_factory=list)
    by_phase_M: list[dict[str, list[float]]] = field(default_factory=list)
    bytes_M: list[int] = field(default_factory=list)
    remote_bytes_M: list[int] = field(default_factory=list)
    pp_rank_M: list[int] = field(default_factory=list)
    launch_s_M: list[float] = field(default_factory=list)

    @classmethod
    def of(cls, layers: list[tuple[int, DispatchStats]]) -> "A2AStep":
        """The figures of this rank's layers ((global MoE index, stats) each), as the dispatchers hold them."""
        return cls([m for m, _ in layers], [s.a2a_seconds for _, s in layers], [s.exposed_seconds for _, s in layers],
                   [{k: list(v) for k, v in s.by_phase.items()} for _, s in layers],
                   [s.bytes_sent for _, s in layers], [s.remote_bytes_sent for _, s in layers], [],
                   [s.launch_seconds for _, s in layers])

    @classmethod
    def unpack(cls, packed_MK: list[list[float]]) -> "A2AStep":
        """The figures of every layer of the model from the all-reduced :func:`pack` buffers of all pipeline ranks
        (``packed_MK``: n_moe rows of :data:`PACKED_PER_LAYER` values; bytes are exact up to 2**53)."""
        by_phase = [{k: [row[_HEAD + 3 * i + 1], row[_HEAD + 3 * i + 2]]
                     for i, k in enumerate(DispatchStats.PHASES) if row[_HEAD + 3 * i] > 0} for row in packed_MK]
        return cls(list(range(len(packed_MK))), [r[0] for r in packed_MK], [r[1] for r in packed_MK], by_phase,
                   [int(r[2]) for r in packed_MK], [int(r[3]) for r in packed_MK], [int(r[4]) - 1 for r in packed_MK],
                   [r[5] for r in packed_MK])

    def step_totals(self) -> tuple[float, float]:
        """(all-to-all s, exposed s) summed over the layers of one pipeline rank: all layers at PP 1, under PP the
        rank with the most exposed seconds (module docstring)."""
        if not self.pp_rank_M:
            return sum(self.a2a_s_M), sum(self.exposed_s_M)
        exposed, a2a = max((sum(e for e, p in zip(self.exposed_s_M, self.pp_rank_M) if p == q),
                            sum(a for a, p in zip(self.a2a_s_M, self.pp_rank_M) if p == q))
                           for q in sorted(set(self.pp_rank_M)))
        return a2a, exposed

    def launch_total(self) -> float:
        """Launch seconds summed over the layers of one pipeline rank: all at PP 1, under PP the rank with the most
        (pipeline ranks launch concurrently)."""
        if not self.pp_rank_M:
            return sum(self.launch_s_M)
        return max(sum(v for v, p in zip(self.launch_s_M, self.pp_rank_M) if p == q) for q in set(self.pp_rank_M))

    def bytes_totals(self) -> tuple[int, int]:
        """(bytes, remote bytes) dispatched, summed over every layer (of every stage under PP)."""
        return sum(self.bytes_M), sum(self.remote_bytes_M)


def pack(layers: list[tuple[int, DispatchStats]], out_MK: torch.Tensor, pp_rank: int) -> None:
    """Write the figures of this rank's layers ((global MoE index, stats) each) into their rows of ``out_MK``
    ((n_moe, :data:`PACKED_PER_LAYER`) float64 zeros, on the collective's device), for the PP all-reduce;
    ``pp_rank``: this rank's pipeline rank."""
    if not layers:
        return
    rows = []
    for _, s in layers:
        row = [s.a2a_seconds, s.exposed_seconds, float(s.bytes_sent), float(s.remote_bytes_sent), float(pp_rank + 1),
               s.launch_seconds]
        for k in DispatchStats.PHASES:
            a, e = s.by_phase.get(k, (0.0, 0.0))
            row += [1.0 if k in s.by_phase else 0.0, a, e]
        rows.append(row)
    idx = torch.tensor([m for m, _ in layers], device=out_MK.device)
    out_MK[idx] = torch.tensor(rows, dtype=torch.float64).to(out_MK.device)
