"""The pipeline model: which items each stage and pipeline rank holds, how many micro-batches a rank keeps in
flight, which micro-batches an overlapped schedule can pair, the stage-to-stage P2P a schedule exposes, the
bubble, and the time of one pipeline rank per micro-batch."""

from __future__ import annotations

from dataclasses import dataclass

from moetrain.layout import Framework
from moetrain.plan.model.context import P2P_LATENCY_S, CostContext
from moetrain.plan.model.cost import ItemCost
from moetrain.plan.plan import Plan, balanced_partition, default_items, layout_items, n_pipeline_stages
from moetrain.plan.shape import ModelShape


def stage_items(shape: ModelShape, plan: Plan, item_times: dict[str, float]) -> list[list[str]]:
    """The items of each pipeline stage: the plan's layout, or else the split that balances the items' predicted
    times (``item_times``, seconds per micro-batch by item kind)."""
    n_stages = n_pipeline_stages(plan)
    if plan.pp_layout:
        return layout_items(plan.pp_layout, shape, n_stages)
    items = default_items(shape)
    # The MTP modules are one unit of the split with the output head they share, on the last stage: moetrain's
    # pipeline-stage contract (moetrain.model.stage), and one of the layouts Megatron-Core runs (its "m|L", MTP
    # standalone in a stage of its own, is the other; a plan gets it only by naming the layout), so that a
    # recommended plan runs in either
    tail = len(items) - 1
    while tail > 0 and items[tail - 1] == "m":
        tail -= 1
    units: list[list[str]] = [[i] for i in items[:tail]] + [items[tail:]]
    parts = balanced_partition([sum(item_times[i] for i in u) for u in units], n_stages)
    return [[i for u in units[a:b] for i in u] for a, b in parts]


def device_stages(plan: Plan, n_stages: int) -> list[list[int]]:
    """Stage indices held by each pipeline rank."""
    if plan.resolved_schedule == "dualpipe":
        return [[d, plan.pp - 1 - d] for d in range(plan.pp)]
    if plan.resolved_schedule in ("zbv", "dualpipev"):
        return [[d, 2 * plan.pp - 1 - d] for d in range(plan.pp)]
    return [[s for s in range(n_stages) if s % plan.pp == d] for d in range(plan.pp)]


def in_flight(plan: Plan, device: int) -> list[float]:
    """Micro-batches whose activations a pipeline rank holds at its peak, per model chunk it holds."""
    m, pp, vpp = plan.n_microbatches, plan.pp, plan.vpp
    sched = plan.resolved_schedule
    if sched == "dualpipe":
        # rank d holds stage d of one direction and stage PP-1-d of the other; like 1F1B, a stage at pipeline
        # position s keeps PP-s micro-batches: (PP-d) + (d+1) = PP+1 in all (the DualPipe paper's figure)
        return [float(min(m, pp - device)), float(min(m, device + 1))]
    if sched == "1f1b":
        return [float(min(m, pp - device))]
    if sched == "dualpipev":
        # the V: chunk d sits at position d of a 2 PP-chunk pipeline, chunk 2PP-1-d at position 2PP-1-d; a chunk
        # at position s keeps (2PP - s) micro-batches in flight, as 1F1B would (DualPipe README: PP+1 activations)
        return [float(min(m, 2 * pp - device)), float(min(m, device + 1))]
    if sched == "zbv":
        # zero-bubble V: the peak activation memory of 1F1B (PP micro-batches of a whole rank's layers; Qi et al.,
        # "Zero Bubble Pipeline Parallelism", arXiv 2401.10241, ZB-V), i.e. PP micro-batches of each of its chunks
        return [float(min(m, pp)), float(min(m, pp))]
    warm = min(m * vpp, (pp - device - 1) * 2 + (vpp - 1) * pp + 1)
    counts = [0.0] * vpp
    for f in range(warm):
        counts[(f // pp) % vpp] += 1
    return counts


def unpaired_fraction(plan: Plan) -> float:
    """Share of a rank's micro-batch chunks in pipeline warm-up / cool-down, where EP overlap has no partner.

    Framework "moetrain": counted on the compute order its trainer runs (torch's schedule after moetrain's
    pairing, ``moetrain.parallel.schedules.paired_fraction``), for the rank that pairs least -- the pipeline waits
    for its slowest rank."""
    m, pp, vpp = plan.n_microbatches, plan.pp, plan.vpp
    sched = plan.resolved_schedule
    if plan.framework == "moetrain" and sched in ("1f1b", "interleaved", "dualpipev"):
        from moetrain.parallel.schedules import paired_fraction
        return 1.0 - min(paired_fraction(sched, pp, 2 if sched == "dualpipev" else vpp, m))
    if sched == "dualpipe":
        return min(1.0, (pp / 2) / m)
    if sched == "dualpipev":
        return min(1.0, pp / (2 * m))  # warm-up and cool-down: PP - 1 unpaired chunk passes of 2 m
    if sched == "interleaved":
        return min(1.0, ((pp - 1) * 2 + (vpp - 1) * pp + 1) / (m * vpp))
    if sched == "1f1b" and pp == 1:
        return min(1.0, 1.0 / m)  # micro-batch i+1's forward pairs with i's backward: the first and last are alone
    return 1.0


def item_time(cost: ItemCost, plan: Plan, overlap: bool, unpaired: float, sm_share: float) -> tuple[float, float]:
    """(time, exposed all-to-all) of one item per micro-batch, seconds, averaged over the schedule: with EP overlap
    a share ``unpaired`` (:func:`unpaired_fraction`) of the micro-batches has no partner and runs without overlap,
    the rest overlapped (:meth:`ItemCost.time`); ``sm_share`` is the share of SMs the all-to-all kernels hold."""
    t_ov, a_ov = cost.time(True, sm_share)
    t_no, a_no = cost.time(False, sm_share)
    if not overlap:
        return t_no, a_no
    if plan.framework == "moetrain" and cost.a2a_s > 0 and len(cost.a2a_passes) == 4:
        # moetrain's unpaired passes still delay their weight gradients behind the backward all-to-alls
        t_solo = cost.solo_time(sm_share) + cost.tp_s + cost.cp_s
        t_no, a_no = t_solo, t_solo - cost.compute_s - cost.tp_s - cost.cp_s
    return (1 - unpaired) * t_ov + unpaired * t_no, (1 - unpaired) * a_ov + unpaired * a_no


def p2p_time(c: CostContext, shape: ModelShape, plan: Plan) -> float:
    """Pipeline P2P per stage boundary and micro-batch, seconds: activations forward, gradients backward (0 without
    pipeline parallelism)."""
    p2p_bytes = c.tok_mb / (plan.cp * plan.tp) * shape.dim * 2
    # stages are blocks of consecutive ranks (PP outermost): once the pipeline outgrows one NVLink domain some
    # boundary (and, interleaved, the wrap from the last rank to the first) crosses the NIC, and since every
    # rank waits on its neighbours each step, the slowest boundary paces all of them
    p2p_link = c.link(plan.stage_size * plan.pp > c.domain) if plan.pp > 1 else c.nvl
    return 2 * (p2p_bytes / p2p_link + P2P_LATENCY_S) if plan.pp > 1 else 0.0


def p2p_stage_time(plan: Plan, overlap: bool, p2p_t: float, costs: dict[str, ItemCost], items: list[str]) -> float:
    """P2P time a stage holding ``items`` adds per micro-batch on its rank, seconds, given the transfer time
    ``p2p_t`` (:func:`p2p_time`) and whether EP overlap is on."""
    # Which schedules hide the P2P transfers:
    # * 1F1B (Megatron, no interleaving): blocking send/recv between the steps -> exposed.
    # * interleaved 1F1B without EP overlap: with ``overlap_p2p_comm`` the forward send/recv is posted after a
    #   chunk's forward and waited before the next forward, so it runs under the backward of the same 1F1B step
    #   (and the backward's under the next forward) -> hidden.
    # * interleaved 1F1B with EP overlap = Megatron's combined 1F1B (``overlap_moe_expert_parallel_comm`` /
    #   Megatron-Bridge ``moe_a2a_overlap``): the forward of one chunk and the backward of another are merged into
    #   ONE step (``combined_1f1b.combined_forward_backward_step`` ->
    #   ``TransformerModelChunkSchedulePlan.run``), so the activation this rank's forward produces leaves only at
    #   the end of the merged step (``post_forward``), and the next merged step starts by waiting for the
    #   neighbours' (``pre_forward`` / ``pre_backward``). Between the two only the deferred weight gradient of
    #   the chunk's first attention runs ("Delay the last attn_dw in backward pass ... for overlapping with the
    #   p2p comm", megatron/core/models/common/model_chunk_schedule_plan.py): the transfer minus that dW is
    #   exposed, once per model chunk per micro-batch. Forward and backward sends leave on the same NIC at once
    #   (to the next and previous stage), hence the 2x of p2p_t.
    # * DualPipe: "both all-to-all and PP communication can be fully hidden" (DeepSeek-V3 report sec. 3.2.1).
    sched = plan.resolved_schedule
    if sched in ("1f1b", "zbv"):
        return p2p_t
    if sched == "interleaved" and overlap and plan.pp > 1:
        first = next((k for k in items if k in ("d", "t", "m")), None)
        hide = costs[first].attn_wgrad_s if first else 0.0
        return max(0.0, p2p_t - hide)
    return 0.0


def rank_params(costs: dict[str, ItemCost], stages: list[list[str]], sts: list[int]) -> tuple[float, float]:
    """(dense, expert) parameters a pipeline rank holding stages ``sts`` keeps on one GPU."""
    return (sum(costs[k].params_dense for s_idx in sts for k in stages[s_idx]),
            sum(costs[k].params_expert for s_idx in sts for k in stages[s_idx]))


@dataclass
class RankTime:
    """One pipeline rank's time per micro-batch, seconds: ``total``, and ``parts`` -- compute, exposed all-to-all,
    other communication (TP, CP, P2P, FSDP gathers) -- which sum to it."""

    total: float
    parts: dict[str, float]


def rank_time(plan: Plan, costs: dict[str, ItemCost], item_times: dict[str, tuple[float, float]],
              stages: list[list[str]], sts: list[int], stage_p2p: list[float], gather_s: float) -> RankTime:
    """Time per micro-batch of the pipeline rank holding stages ``sts``: ``gather_s`` (its exposed FSDP gathers),
    then each item's time (:func:`item_time`) and each stage's P2P (``stage_p2p``, per stage). Under DualPipe each
    micro-batch visits one of the rank's two stages, hence half of the sum."""
    parts = {"compute": 0.0, "a2a": 0.0, "comm": gather_s}
    t_total = gather_s
    for s_idx in sts:
        for k in stages[s_idx]:
            t, a = item_times[k]
            comm = costs[k].tp_s + costs[k].cp_s
            parts["a2a"] += a
            parts["comm"] += comm
            parts["compute"] += t - a - comm
            t_total += t
        t_p2p = stage_p2p[s_idx]
        parts["comm"] += t_p2p
        t_total += t_p2p
    if plan.resolved_schedule == "dualpipe":
        parts = {k: v / 2 for k, v in parts.items()}
        t_total /= 2
    return RankTime(t_total, parts)


def bubble_time(plan: Plan, t_mean: float) -> float:
    """Pipeline bubble of one step, seconds, for a mean pipeline-rank time ``t_mean`` per micro-batch: 1F1B
    ``(PP-1) t``, interleaved ``(PP-1)/VPP t``, DualPipe ``(PP/2-1)(F&B + B - 3W)`` (docs/reference.md section 9)."""
    sched = plan.resolved_schedule
    if plan.pp == 1:
        return 0.0
    if sched == "interleaved":
        return (plan.pp - 1) / plan.vpp * t_mean
    if sched == "dualpipe":
        return (plan.pp / 2 - 1) * (2 / 3) * t_mean
    if sched == "dualpipev":
        # DualPipe's (PP'/2 - 1)(F&B + B - 3W) with PP' = 2 PP half-size chunks (docs/reference.md section 9:
        # DualPipeV is DualPipe on half the devices): (PP - 1) x (2/3) x t/2
        return (plan.pp - 1) * t_mean / 3
    if sched == "zbv":
        # ZB-1P's (PP-1)(F + B - 2W) with F = W = t/3, B = 2t/3, for the V's half-size chunks: (PP-1) t/6
        return (plan.pp - 1) * t_mean / 6
    return (plan.pp - 1) * t_mean
