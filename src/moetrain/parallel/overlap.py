"""Expert-parallel overlap across micro-batches (``parallel.ep_overlap``): micro-batch i+1's forward paired with
micro-batch i's backward, phase by phase, so every all-to-all is in flight while the other micro-batch computes.

The mechanism is :mod:`moetrain.model.phases` (the forward cut at its all-to-alls, the backward run one segment at a
time); this module runs the micro-batches of one optimizer step through it and keeps FSDP2 correct when a
backward is many autograd calls::

    F(0)                     forward of micro-batch 0, recorded on its tape
    B(0) step | F(1) ...     at every all-to-all of F(1), one backward step of micro-batch 0
    ...
    B(n-1)                   the last backward, alone

This is Megatron-Core's combined 1F1B (``--overlap-moe-expert-parallel-comm``) for PP = 1: one micro-batch's
activations beside another's, as in 1F1B.

FSDP2 reduces gradients in a post-backward hook and at the end of each autograd call; with the backward split into
many calls, gradient reduction and resharding are switched off during the step and run once at its end, the way
``torch.distributed.pipelining`` drives FSDP2 stages (``PipelineStage.perform_reduce_grad``).
"""

from __future__ import annotations

from contextlib import contextmanager
from functools import lru_cache
from typing import Any, Callable, Iterator

import torch

from moetrain.model.phases import Tape
from moetrain.parallel.torch_compat import fsdp_param_groups


def _fsdp_modules(module: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def defer_fsdp_reduction(module: torch.nn.Module) -> None:
    """Keep gradients unsharded and accumulating, and parameters gathered, across the many backward calls of a
    step (no-op for a module without FSDP)."""
    from torch.distributed.fsdp import FSDPModule
    if isinstance(module, FSDPModule):
        module.set_is_last_backward(False)
        module.set_reshard_after_backward(False)
        module.set_requires_gradient_sync(False)


def finish_fsdp_reduction(module: torch.nn.Module) -> None:
    """Reduce-scatter the accumulated gradients of every FSDP group of ``module`` and reshard, as FSDP2 does at the
    end of a normal last backward."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    if not isinstance(module, FSDPModule):
        return
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    state = fully_shard.state(module)  # type: ignore[attr-defined]
    for s in state._state_ctx.all_states:
        for group in fsdp_param_groups(s):
            group.post_backward()
    state._root_post_backward_final_callback()


@contextmanager
def keep_fsdp_forward_state(module: torch.nn.Module) -> Iterator[None]:
    """Run a backward step inside the forward of FSDP modules without ending their forward.

    At the end of every autograd call FSDP2's root callback marks every parameter group idle; a group whose forward
    the call interrupted would then take its post-forward for one after the backward and free its gathered
    parameters (whatever ``reshard_after_forward`` says) while the forward still needs them. The training states
    of the interrupted groups and states (and the root's iteration marker) are put back afterwards."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    if not isinstance(module, FSDPModule):
        yield
        return
    root = fully_shard.state(module)  # type: ignore[attr-defined]
    ctx = root._state_ctx
    states = [(s, s._training_state) for s in ctx.all_states if s._training_state == TrainingState.FORWARD]
    groups = [(g, g._training_state) for s in ctx.all_states for g in fsdp_param_groups(s)
              if g._training_state == TrainingState.FORWARD]
    forward_root = ctx.iter_forward_root
    try:
        yield
    finally:
        for obj, st in states + groups:
            obj._training_state = st
        ctx.iter_forward_root = forward_root


#: Backward steps of the partner run before a paired forward starts. A tape has three boundaries per MoE layer
#: (count exchange, dispatch, combine issued) and so three backward steps: experts (waits for the combine's
#: gradient, issues the dispatch's), shared experts and permutation (issues nothing), attention (issues the previous
#: layer's combine gradient). Two lead steps align them so that every transfer has a large segment to hide behind:
#: the count exchange hides behind the shared experts' backward, the dispatch behind attention's backward, the combine
#: behind the experts' backward, and the backward's combine and dispatch gradients behind the forward's experts and
#: attention. (With one lead step the dispatch would meet the small shared-experts step.)
LEAD_STEPS = 2


def run_paired(forward: Callable[[int], torch.Tensor], n_micro: int, device_type: str,
               events: list | None = None, module: torch.nn.Module | None = None) -> None:
    """Forward and backward ``n_micro`` micro-batches with micro-batch i+1's forward paired with micro-batch i's
    backward (see module docstring).

    Args:
        forward: runs micro-batch i's forward (under the caller's autocast) and returns its scalar loss.
        n_micro: micro-batches in the step.
        device_type: the autocast device type switched off during backward steps.
        events: optional list receiving the tapes' ``(micro-batch, kind, detail)`` records in execution order.
        module: the (possibly FSDP-wrapped) model the forward runs, whose FSDP state the backward steps keep.
    """
    around = (lambda: keep_fsdp_forward_state(module)) if module is not None else None
    prev: Tape | None = None
    for i in range(n_micro):
        tape = Tape(f"mb{i}", partner=prev, events=events, no_autocast=device_type, around_backward=around)
        if prev is not None:
            for _ in range(LEAD_STEPS):  # the loss and last segment, then the last MoE layer's experts
                prev.backward_step()
        with tape.recording():
            loss = forward(i)
        tape.finish(loss.float())
        if prev is not None:
            prev.drain()
        prev = tape
    if prev is not None:
        prev.drain()


# ---- pipelined schedules: OVERLAP_F_B ---------------------------------------------------------------------------
#
# Under pipelining the pairs come from the schedule. ``torch.distributed.pipelining``'s runtime executes an
# ``OVERLAP_F_B`` action -- the forward of one chunk and the backward of another on the same rank -- through a
# registered custom function (by default it runs them one after the other). Here every forward chunk is recorded on a
# tape and every backward drains its chunk's tape seeded with the gradients received from the next stage; the
# custom function runs the forward with the backward's tape as its partner, so their phases interleave as at PP = 1.
# DualPipeV's schedule has the OVERLAP_F_B actions already; for 1F1B and interleaved 1F1B (Megatron-Core's combined
# 1F1B) each steady-state backward is merged with the forward that follows it on the rank (:func:`pair_actions`).

def paired_stage(cls: type) -> type:
    """A ``PipelineStage`` subclass whose training forwards are recorded on a :class:`Tape` per micro-batch and whose
    backwards run that tape piecewise: "full" drains it; "input" (a split backward) drains it holding the delayed
    weight gradients, which "weight" then runs. Gradients and the input gradients sent upstream are those of one
    ``torch.autograd.backward`` from the stage outputs (fp32 round-off aside).

    Attributes set by the schedule: ``partner`` (a tape whose backward steps run at this stage's forward
    boundaries, during an OVERLAP_F_B), ``meanwhile`` (the forward run by the next backward while it drains),
    ``events`` (a list receiving the tapes' phase events, or None)."""

    class Paired(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            self.partner: Tape | None = None
            self.meanwhile: Callable[[Tape | None], None] | None = None
            self.events: list | None = None
            self._tapes: dict[int, Tape] = {}
            self._held: dict[int, list[Callable[[], None]]] = {}
            self._chunk = -1

        def clear_runtime_states(self) -> None:
            super().clear_runtime_states()
            self._tapes.clear()
            self._held.clear()

        def forward_one_chunk(self, fwd_chunk_id: int, *a: Any, **k: Any) -> Any:
            self._chunk = fwd_chunk_id
            return super().forward_one_chunk(fwd_chunk_id, *a, **k)

        def backward_one_chunk(self, bwd_chunk_id: int, *a: Any, **k: Any) -> Any:
            self._chunk = bwd_chunk_id
            return super().backward_one_chunk(bwd_chunk_id, *a, **k)

        def backward_weight_one_chunk(self, bwd_chunk_id: int, *a: Any, **k: Any) -> Any:
            self._chunk = bwd_chunk_id
            return super().backward_weight_one_chunk(bwd_chunk_id, *a, **k)

        def forward_maybe_with_nosync(self, *args: Any, **kwargs: Any) -> Any:
            if not torch.is_grad_enabled():  # forward-only (evaluation): no backward will drain a tape
                return super().forward_maybe_with_nosync(*args, **kwargs)
            tape = Tape(f"s{self.stage_index}mb{self._chunk}", partner=self.partner, events=self.events,
                        no_autocast=self.device.type)
            with tape.recording():
                out = self.submod(*args, **kwargs)
            self._tapes[self._chunk] = tape
            return out

        def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict,
                                       last_backward: bool = False) -> tuple[tuple, None]:
            defer_fsdp_reduction(self.submod)  # the schedule's REDUCE_GRAD action reduces, as without pairing
            chunk = self._chunk
            if backward_type == "weight":
                if chunk not in self._held:  # its input backward ran without a tape (torch's own split)
                    return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
                with torch.autocast(self.device.type, enabled=False):
                    for run in self._held.pop(chunk):
                        run()
                return (), None
            meanwhile, self.meanwhile = self.meanwhile, None
            tape = self._tapes.pop(chunk, None)
            if tape is None:  # its forward ran without a tape: one backward call, then the paired forward alone
                result = super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)
                if meanwhile is not None:
                    meanwhile(None)
                return result
            tape.finish(bwd_kwargs["stage_output"], bwd_kwargs["output_grads"])
            if backward_type == "input":
                tape.hold_wgrad = self._held[chunk] = []
            if meanwhile is not None:
                meanwhile(tape)
            tape.drain()
            grads = []
            for v in bwd_kwargs["input_values"]:
                grads.append(v.grad if isinstance(v, torch.Tensor) else None)
                if isinstance(v, torch.Tensor):
                    v.grad = None  # sent upstream; not accumulated (as torch's stage_backward)
            return tuple(grads), None

    Paired.__name__ = Paired.__qualname__ = f"Paired{cls.__name__}"
    return Paired


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


def pair_schedule(schedule: Any, order: dict[int, list] | None = None) -> None:
    """Make ``schedule`` (a ``torch.distributed.pipelining`` runtime schedule over :func:`paired_stage` stages) run
    its OVERLAP_F_B actions interleaved. DualPipeV has such actions; for interleaved 1F1B -- or ``order``, the
    compute order to run instead (1F1B: :func:`one_f_one_b_order`) -- the steady state is merged first
    (:func:`pair_actions`) and lowered again (sends, receives, FSDP unshard / reshard and gradient reduction)."""
    from torch.distributed.pipelining.schedules import OVERLAP_F_B, ScheduleDualPipeV
    if order is not None or not isinstance(schedule, ScheduleDualPipeV):
        order = {r: pair_actions(a) for r, a in (order or schedule.pipeline_order).items()}
        schedule.pipeline_order = order
        schedule._prepare_schedule_with_comms(order)
    schedule.register_custom_function(OVERLAP_F_B, _overlap_f_b)


def _overlap_f_b(action: Any, ctx: Any) -> None:
    """The OVERLAP_F_B action: wait for both inputs (as the runtime's FORWARD and FULL_BACKWARD do), then run the
    backward with the forward as its ``meanwhile``: the forward's boundaries run the backward's steps."""
    from torch.distributed.pipelining.schedules import FORWARD, FULL_BACKWARD, _wait_batch_p2p
    sched = ctx.schedule_ref
    f, b = action.sub_actions
    if f.computation_type != FORWARD or b.computation_type != FULL_BACKWARD:
        raise RuntimeError(f"OVERLAP_F_B pairs a forward with a full backward; got {action.sub_actions}")
    stages = {s.stage_index: s for s in sched._stages}
    sf, sb = stages[f.stage_index], stages[b.stage_index]
    sched._assert_unsharded(sf)
    sched._assert_unsharded(sb)
    if not sf.is_first and f.stage_index - 1 not in stages:
        _wait_batch_p2p(sched.fwd_recv_ops.pop((f.stage_index, f.microbatch_index)))
    if not sb.is_last and b.stage_index + 1 not in stages:
        _wait_batch_p2p(sched.bwd_recv_ops.pop((b.stage_index, b.microbatch_index)))
    loss = sched._maybe_get_loss(sb, b.microbatch_index)
    sched.backward_counter[b.stage_index] += 1
    last = sched.backward_counter[b.stage_index] == sched._n_microbatches

    def forward(partner: Tape | None) -> None:
        if partner is not None:
            partner.around_backward = lambda: keep_fsdp_forward_state(sf.submod)
            for _ in range(LEAD_STEPS):  # as at PP = 1
                partner.backward_step()
        sf.partner = partner
        try:
            mb = f.microbatch_index
            out = sf.forward_one_chunk(mb, ctx.arg_mbs[mb], ctx.kwarg_mbs[mb], save_forward_output=False)
        finally:
            sf.partner = None
            if partner is not None:
                partner.around_backward = None
        sched._maybe_compute_loss(sf, out, ctx.target_mbs, f.microbatch_index)
        if f.stage_index + 1 in stages:
            stages[f.stage_index + 1].set_local_fwd_input(out, f.microbatch_index)

    sb.meanwhile = forward
    try:
        sb.backward_one_chunk(b.microbatch_index, loss=loss, full_backward=True, last_backward=last)
    finally:
        unrun, sb.meanwhile = sb.meanwhile, None
    if unrun is not None:  # no backward ran (forward-only evaluation: the stage has no backward)
        forward(None)
    if b.stage_index - 1 in stages:
        stages[b.stage_index - 1].set_local_bwd_input(sb.get_local_bwd_output(b.microbatch_index),
                                                      b.microbatch_index)


def paired_fraction(schedule: str, pp: int, vpp: int, n_microbatches: int) -> list[float]:
    """Per pipeline rank, the share of its forward and backward chunk passes that run inside an OVERLAP_F_B pair
    under ``parallel.ep_overlap`` -- the passes whose all-to-alls have another chunk's compute to hide behind.

    Counted on the compute order torch's schedule builds (the one the trainer runs; no processes needed), after
    :func:`pair_actions` for 1F1B and interleaved 1F1B; PP = 1 pairs micro-batch i+1's forward with i's backward
    (:func:`run_paired`): 2 (m - 1) of 2 m passes. ZB-V pairs nothing, nor does a schedule given fewer
    micro-batches than it needs (the trainer refuses those). The unpaired passes are the warm-up and cool-down, whose
    number stops growing with m: past 4 PP x stages per rank micro-batches they are counted at that size (the
    planner asks for thousands of plans; tests check the two counts agree).

    Args:
        schedule: a :class:`~moetrain.layout.Schedule` the trainer runs (``parallel.schedule``; older names
            such as "interleaved-1f1b" accepted).
        pp, vpp: pipeline ranks and stages per rank (interleaved 1F1B; 2 for the V schedules).
        n_microbatches: micro-batches per step.
    """
    from moetrain.model.config import ConfigError
    from moetrain.layout import Schedule
    from moetrain.parallel.config import ParallelConfig
    from moetrain.parallel.pipeline import check_microbatches

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
