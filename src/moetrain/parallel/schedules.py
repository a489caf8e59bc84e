"""The pipeline schedules' compute orders and what is counted on them, with no process and no model: the
micro-batches a schedule needs, the textbook 1F1B order, the pairs EP overlap runs (a backward merged with the
forward that follows it), the share of chunk passes they pair, and the bubble formula.

Both the runtime (``moetrain.parallel.pipeline`` builds the schedules, ``moetrain.parallel.overlap`` runs the
pairs) and the planner (``moetrain.plan``) read these, so the plan counts what the trainer runs.
"""

from __future__ import annotations

from functools import lru_cache

from moetrain.errors import ConfigError
from moetrain.layout import Schedule
from moetrain.parallel.config import ParallelConfig


def check_microbatches(pcfg: ParallelConfig, n_microbatches: int) -> None:
    """1F1B, ZB-V and interleaved 1F1B need at least PP micro-batches per step (interleaved: a multiple of PP),
    DualPipeV at least its number of stages.

    Raises:
        ConfigError: naming the schedule, the need and ``train.grad_accum``.
    """
    name, n_stages = pcfg.schedule, pcfg.n_stages
    need = n_stages if name == Schedule.DUALPIPEV else pcfg.pp
    if n_microbatches < need or (name == Schedule.INTERLEAVED and n_microbatches % pcfg.pp):
        rule = "a multiple of" if name == Schedule.INTERLEAVED else "at least"
        raise ConfigError(f"parallel.schedule={name!r} with {n_stages} stages needs {rule} {need} micro-batches "
                          f"per step; train.grad_accum={n_microbatches} (leave it unset for the minimum)")


def pair_actions(actions: list) -> list:
    """One rank's compute actions with every full backward merged with the forward that directly follows it into an
    ``OVERLAP_F_B`` action (sub-actions: that forward, that backward); idle slots (None) dropped. Merging the
    backward with the *following* forward keeps every dependency the lowering needs: the merged forward's input
    was sent by a neighbour's earlier action, never by its own merged pair (the runtime's send/recv lowering
    checks it, and raises on a schedule that could hang)."""
    from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, OVERLAP_F_B, _Action
    acts = [a for a in actions if a is not None]
    out, i = [], 0
    while i < len(acts):
        a = acts[i]
        if (a.computation_type == FULL_BACKWARD and i + 1 < len(acts)
                and acts[i + 1].computation_type == FORWARD):
            out.append(_Action(-1, OVERLAP_F_B, None, (acts[i + 1], a)))
            i += 2
        else:
            out.append(a)
            i += 1
    return out


def one_f_one_b_order(pp: int, n_microbatches: int) -> dict[int, list]:
    """The 1F1B compute order as runtime actions (Narayanan et al., SC'21, sec. 2.2): rank r runs
    min(pp - 1 - r, m) warm-up forwards, then alternates forward and backward, then drains the backwards. (torch's
    ``Schedule1F1B`` runs this order on its own loop, which has no OVERLAP_F_B; its interleaved runtime with one
    stage per rank would warm up 2 (pp - 1 - r) forwards.)"""
    from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, _Action
    m, order = n_microbatches, {}
    for r in range(pp):
        warm = min(pp - 1 - r, m)
        acts = [_Action(r, FORWARD, i) for i in range(warm)]
        for i in range(m - warm):
            acts += [_Action(r, FORWARD, warm + i), _Action(r, FULL_BACKWARD, i)]
        order[r] = acts + [_Action(r, FULL_BACKWARD, i) for i in range(m - warm, m)]
    return order


def paired_fraction(schedule: str, pp: int, vpp: int, n_microbatches: int) -> list[float]:
    """Per pipeline rank, the share of its forward and backward chunk passes that run inside an OVERLAP_F_B pair
    under ``parallel.ep_overlap`` -- the passes whose all-to-alls have another chunk's compute to hide behind.

    Counted on the compute order torch's schedule builds (the one the trainer runs; no processes needed), after
    :func:`pair_actions` for 1F1B and interleaved 1F1B; PP = 1 pairs micro-batch i+1's forward with i's backward
    (``moetrain.parallel.overlap.run_paired``): 2 (m - 1) of 2 m passes. ZB-V pairs nothing, nor does a schedule
    given fewer micro-batches than it needs (the trainer refuses those). The unpaired passes are the warm-up and
    cool-down, whose number stops growing with m: past 4 PP x stages per rank micro-batches they are counted at that
    size (the planner asks for thousands of plans; tests check the two counts agree).

    Args:
        schedule: a :class:`~moetrain.layout.Schedule` the trainer runs (``parallel.schedule``; older names
            such as "interleaved-1f1b" accepted).
        pp, vpp: pipeline ranks and stages per rank (interleaved 1F1B; 2 for the V schedules).
        n_microbatches: micro-batches per step.
    """
    m = n_microbatches
    if pp == 1:
        return [(m - 1) / m if m > 1 else 0.0]
    schedule = Schedule.parse(schedule, "schedule")
    pcfg = ParallelConfig(pp=pp, vpp=vpp if schedule == Schedule.INTERLEAVED else 1, schedule=schedule)
    try:
        check_microbatches(pcfg, m)
    except ConfigError:
        return [0.0] * pp
    if schedule == "zbv":
        return [0.0] * pp
    n_local = pcfg.stages_per_rank
    cap = 4 * pp * n_local  # a multiple of pp: interleaved 1F1B's rounds keep their size
    unpaired = _unpaired_passes(schedule, pp, n_local, min(m, cap))
    return [1.0 - u / (2 * n_local * m) for u in unpaired]


@lru_cache(maxsize=4096)
def _unpaired_passes(schedule: str, pp: int, n_local: int, m: int) -> tuple[int, ...]:
    """Per rank, the chunk passes (forwards and backwards) outside OVERLAP_F_B pairs in the trainer's order, with
    ``n_local`` stages per rank."""
    from types import SimpleNamespace

    from torch.distributed.pipelining.schedules import OVERLAP_F_B, ScheduleDualPipeV, ScheduleInterleaved1F1B
    if schedule == "1f1b":
        orders = one_f_one_b_order(pp, m)
    elif schedule == "dualpipev":
        ns = SimpleNamespace(pp_group_size=pp, _n_microbatches=m)
        orders = {r: ScheduleDualPipeV._calculate_single_rank_operations(ns, r) for r in range(pp)}  # torch's own
    else:
        rounds = max(1, m // pp)
        ns = SimpleNamespace(pp_group_size=pp, _n_microbatches=m, n_local_stages=n_local, number_of_rounds=rounds,
                             microbatches_per_round=m // rounds)
        orders = {r: ScheduleInterleaved1F1B._calculate_single_rank_operations(ns, r) for r in range(pp)}
    out = []
    for r in range(pp):
        acts = orders[r] if schedule == "dualpipev" else pair_actions(orders[r])
        paired = sum(2 for a in acts if a is not None and a.computation_type == OVERLAP_F_B)
        out.append(2 * n_local * m - paired)
    return tuple(out)


def bubble_formula(pcfg: ParallelConfig, n_microbatches: int) -> float:
    """The schedule's idle fraction of a step with equal stage times and free communication: (p - 1) / (v m + p - 1)
    for 1F1B (v = 1) and interleaved 1F1B with v stages per rank (Narayanan et al., SC'21, sec. 2.2); the V
    schedules are counted as interleaving with v = 2 (an upper bound: ZB-V and DualPipeV fill part of it with
    weight-gradient work, Qi et al. 2024). 0 without pipelining."""
    p, m, v = pcfg.pp, n_microbatches, pcfg.stages_per_rank
    if p == 1:
        return 0.0
    return (p - 1) / (v * m + p - 1)
