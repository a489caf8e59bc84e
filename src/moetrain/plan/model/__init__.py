"""The analytical performance model: step time, throughput and memory of a plan on a cluster.

How a step is built (docs/performance-model.md has the long version):

1. **Pipeline items.** The model is a sequence of items -- embedding ``E``, dense layers ``d``, MoE layers ``t``,
   MTP modules ``m``, the output head + loss ``L`` -- split into pipeline stages (a Megatron layout string, or a
   split that balances predicted time).
2. **One item, one micro-batch, one GPU (forward + backward).** Compute time from the FLOPs of
   :mod:`moetrain.accounting` (the ``moetrain count`` numbers) divided by peak x efficiency, per class of kernel:
   dense GEMMs, grouped expert GEMMs, attention (with its softmax bounded by the exponential units), the BF16
   output head; each GEMM is also bounded below by the time to stream its weights (roofline). Memory-bound
   kernels (norms, RoPE, SwiGLU, permutes, casts) move a number of bytes derived from the layer's tensor sizes.
   Recomputation adds forward work. The expert all-to-all (dispatch + combine, forward + backward) moves
   ``tokens x distinct destinations x hidden x bytes`` over NVLink inside a domain and over the NIC across
   domains (one copy per destination domain, forwarded over NVLink there), at the slowest rank's load, plus a
   fixed latency per call. TP collectives (sequence parallel) and CP ring exchanges add communication.
3. **Overlap.** With expert-parallel overlap (or DualPipe) the all-to-all of one micro-batch runs under the
   compute of another: an item takes ``max(a2a, compute + share * a2a)`` (the communication kernels hold
   ``share`` of the SMs) instead of ``compute + a2a``, except in pipeline warm-up/cool-down where no partner
   micro-batch exists.
4. **Pipeline.** ``step = m * t_slowest_device + bubble`` with the bubble of 1F1B ``(PP-1) t``, interleaved
   ``(PP-1)/VPP t`` or DualPipe ``(PP/2-1)(F&B + B - 3W)``; plus the pipeline P2P where the schedule exposes it
   (1F1B; Megatron's combined 1F1B = interleaved + EP overlap, minus the deferred attention weight gradient;
   hidden in plain interleaved 1F1B and DualPipe); plus the data-parallel gradient reduce-scatter and
   parameter all-gather not hidden behind the last/first micro-batch, plus the optimizer step (memory-bound).
   Real routing without an explicit imbalance factor: the max/mean load per EP rank is solved so that the step is
   ``constants.REAL_ROUTING_SLOWDOWN`` times the forced-balanced step (the published statement is per step).
5. **Memory** per GPU: weights, FP8 weight copies, gradients, sharded optimizer states, the activations of the
   micro-batches in flight on the busiest pipeline rank, and a fixed reserve. A plan that does not fit is
   reported as not fitting and gets no throughput.

Where each mechanism lives: :mod:`.routing` (routing statistics), :mod:`.context` (the GPU's rates and the GEMM
roofline), :mod:`.cost` (an item's cost record and EP-overlap timing), :mod:`.layer` (per-item compute and
communication, step 2), :mod:`.host` (host launch costs, CUDA graphs), :mod:`.pipeline` (stages, schedules,
P2P, bubble, steps 3-4), :mod:`.data_parallel` (DP / FSDP collectives and the optimizer step), :mod:`.memory`
(step 5), :mod:`.predict` (:func:`predict`, the real-routing solver). All efficiency constants live in
:mod:`moetrain.plan.constants`.
"""

from moetrain.plan.model.context import CostContext
from moetrain.plan.model.cost import ItemCost
from moetrain.plan.model.host import HostLaunch, exposed_host_s, host_launch
from moetrain.plan.model.layer import a2a_pass_time, a2a_rows, item_cost
from moetrain.plan.model.memory import MemoryBreakdown
from moetrain.plan.model.predict import Prediction, StepBreakdown, predict
from moetrain.plan.model.routing import RoutingStats, routing_stats

__all__ = [
    "CostContext", "HostLaunch", "ItemCost", "MemoryBreakdown", "Prediction", "RoutingStats", "StepBreakdown",
    "a2a_pass_time", "a2a_rows", "exposed_host_s", "host_launch", "item_cost", "predict", "routing_stats",
]
