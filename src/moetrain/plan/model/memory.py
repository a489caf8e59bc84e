"""Memory per GPU of each pipeline rank: weights, FP8 weight copies, gradients, sharded optimizer states, the
activations of the micro-batches in flight, and a fixed reserve."""

from __future__ import annotations

from dataclasses import asdict, dataclass

from moetrain.plan.constants import RESERVED_GIB, RESERVED_GIB_CPU
from moetrain.plan.model.context import GIB, CostContext
from moetrain.plan.model.cost import ItemCost
from moetrain.plan.model.pipeline import in_flight, rank_params
from moetrain.plan.plan import Plan


@dataclass
class MemoryBreakdown:
    """Per-GPU memory of the most loaded pipeline rank, GiB."""

    weights: float
    fp8_weights: float
    gradients: float
    optimizer: float
    activations: float
    reserved: float
    device: int

    @property
    def total(self) -> float:
        return self.weights + self.fp8_weights + self.gradients + self.optimizer + self.activations + self.reserved

    def to_dict(self) -> dict[str, float]:
        d = asdict(self)
        d["total"] = self.total
        return d


def memory_per_rank(c: CostContext, plan: Plan, costs: dict[str, ItemCost], stages: list[list[str]],
                    dev_stages: list[list[int]]) -> list[MemoryBreakdown]:
    """Memory of one GPU of each pipeline rank (:class:`MemoryBreakdown`, GiB); rank ``d`` holds the stages
    ``dev_stages[d]`` of ``stages``. The optimizer states are sharded over the data-parallel group (ZeRO-1), the
    weights and gradients too under FSDP."""
    # the weights as held: bf16 under the precision-aware "bf16" states whatever the compute precision (their fp32
    # master is the weight plus a 2-byte remainder in the optimizer), else the compute precision's
    weight_bytes = 2.0 if plan.optimizer == "bf16" else c.param_bytes
    # optimizer shard: the fp32 master unless the held weights are fp32 already (then they are their own master),
    # the bf16 states' remainder, and the two moments
    master = 2.0 if plan.optimizer == "bf16" else (0.0 if weight_bytes == 4.0 else 4.0)
    opt_shard = master + {"fp32": 8.0, "bf16-moments": 4.0, "bf16": 4.0}[plan.optimizer]
    # FP8 working copies of the weights: MXFP8 needs a row-wise and a column-wise (transposed) copy, each with its
    # own 1x32 scales; 128x128 block-scaled FP8 weights are transpose-symmetric, one copy serves both GEMMs
    fp8_copy = {"mxfp8": 2.0, "fp8": 1.0}.get(plan.precision, 0.0)
    mems: list[MemoryBreakdown] = []
    for d, sts in enumerate(dev_stages):
        pd, pe = rank_params(costs, stages, sts)
        flight = in_flight(plan, d)
        act = sum(cnt * sum(costs[k].act_bytes for k in stages[s_idx]) for cnt, s_idx in zip(flight, sts))
        shard_w = 1.0
        if plan.fsdp:  # weights and gradients sharded too (+ one gathered block at a time, in the reserve)
            shard_w = (pd / (plan.dp * plan.cp) + pe / plan.edp) / max(pd + pe, 1.0)
        mems.append(MemoryBreakdown(
            weights=(pd + pe) * shard_w * (0.0 if plan.fp8_param else weight_bytes) / GIB,
            fp8_weights=(pd + pe) * fp8_copy / GIB,
            gradients=(pd + pe) * shard_w * c.grad_bytes / GIB,
            optimizer=(pd / (plan.dp * plan.cp) + pe / plan.edp) * opt_shard / GIB,
            activations=act / GIB, reserved=RESERVED_GIB_CPU if c.gpu.generation == "cpu" else RESERVED_GIB,
            device=d))
    return mems
