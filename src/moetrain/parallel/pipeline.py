"""Pipeline parallelism on ``torch.distributed.pipelining``: stage layout, stage modules, schedules, the embedding
shared by the first and last stages, and the measured bubble. (The schedules' orders and counts, which need no
process, are ``moetrain.parallel.schedules``.)

Order of application (``moetrain.train.trainer.build_model_parts``): the model is built on the meta device, split
into this rank's stages (:func:`build_stages`), each stage is parallelized like a whole model (EP placement, FSDP2
over the stage's DP x EP ranks), materialised and initialised by name, then wrapped in ``PipelineStage`` objects
driven by one of torch's schedules (:func:`build_schedule`).

Stage-to-rank mapping (torch's own): "1f1b" / "interleaved" loop -- stage s on pipeline rank s mod PP, so a
rank holds VPP stages PP apart; "dualpipev" / "zbv" a V -- rank r holds stages r and 2 PP - 1 - r, so the first and
last stages (embedding and head) share rank 0.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist

from moetrain.model.config import ConfigError, ModelConfig
from moetrain.model.stage import StageSpec, TransformerStage
from moetrain.model.transformer import Transformer
from moetrain.errors import PlanError
from moetrain.layout import Schedule, parse_layout
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.overlap import pair_schedule, paired_stage
from moetrain.parallel.parallelize import local_tensor
from moetrain.parallel.schedules import check_microbatches, one_f_one_b_order
from moetrain.parallel.timing import clock_for
from moetrain.parallel.torch_compat import (keep_split_backward_graph, recv_buffers_ready_for_backward,
                                           without_self_p2p_warmup)


# ---- layout ------------------------------------------------------------------------------------------------------

def default_layout(cfg: ModelConfig, n_stages: int) -> str:
    """Layers split as evenly as possible, the earlier stages taking the remainder (the last stage also runs the
    head, the loss and the MTP modules); embedding first, MTP and head last. E.g. 6 layers, 4 stages:
    "Ett|tt|t|tmL".

    Raises:
        ConfigError: fewer layers than stages.
    """
    n = cfg.n_layers
    if n < n_stages:
        raise ConfigError(f"the model has {n} layers and cannot fill {n_stages} pipeline stages (PP x VPP); lower "
                          f"parallel.pp / parallel.vpp or give parallel.pp_layout (stages may be empty)")
    sizes = [n // n_stages + (1 if s < n % n_stages else 0) for s in range(n_stages)]
    stages = ["t" * k for k in sizes]
    stages[0] = "E" + stages[0]
    stages[-1] = stages[-1] + "m" * cfg.mtp_depth + "L"
    return "|".join(stages)


def stage_specs(cfg: ModelConfig, pcfg: ParallelConfig) -> list[StageSpec]:
    """Every stage of the pipeline, in model order, from ``pcfg.pp_layout`` (Megatron's pipeline-layout grammar,
    parsed by ``moetrain.layout.parse_layout``, which the planner uses too) or :func:`default_layout`.

    Raises:
        ConfigError: the layout does not match the model or the schedule, naming the expected count; tied
            embeddings (the last stage's head would share the first stage's embedding).
    """
    n_stages = pcfg.n_stages
    if n_stages > 1 and cfg.tie_embeddings:
        raise ConfigError("model.tie_embeddings with parallel.pp > 1 is not supported (the head on the last stage "
                          "would share the first stage's embedding); untie it or use pp = 1")
    layout = pcfg.pp_layout or default_layout(cfg, n_stages)
    try:
        stages = parse_layout(layout)
    except PlanError as e:
        raise ConfigError(f"parallel.{e}") from None
    where = (f"parallel.pp_layout={layout!r}" if pcfg.pp_layout else f"the default layout {layout!r}")
    if len(stages) != n_stages:
        raise ConfigError(f"{where} has {len(stages)} stages; expected PP x stages per rank = {pcfg.pp} x "
                          f"{pcfg.stages_per_rank} = {n_stages} ({pcfg.schedule})")
    flat = "".join(stages)
    if flat.count("t") != cfg.n_layers:
        raise ConfigError(f"{where} places {flat.count('t')} layers 't'; the model has n_layers={cfg.n_layers}")
    if flat.count("m") != cfg.mtp_depth:
        raise ConfigError(f"{where} places {flat.count('m')} MTP modules 'm'; the model has "
                          f"mtp_depth={cfg.mtp_depth}")
    if flat.count("E") != 1 or not stages[0].startswith("E"):
        raise ConfigError(f"{where}: the embedding 'E' must open the first stage, once")
    if flat.count("L") != 1 or not stages[-1].endswith("L"):
        raise ConfigError(f"{where}: the head and loss 'L' must close the last stage, once")
    last = stages[-1]
    if "m" in "".join(stages[:-1]) or ("m" in last and "t" in last[last.index("m"):]):
        raise ConfigError(f"{where}: MTP modules 'm' must sit in the last stage after its layers, before 'L' "
                          f"(they take the main model's last hidden state and the labels)")
    specs, layer, mtp = [], 0, 0
    for s, items in enumerate(stages):
        nl, nm = items.count("t"), items.count("m")
        specs.append(StageSpec(s, n_stages, tuple(range(layer, layer + nl)), tuple(range(mtp, mtp + nm)),
                               embed=s == 0, head=s == n_stages - 1))
        layer, mtp = layer + nl, mtp + nm
    return specs


def stage_to_rank(pcfg: ParallelConfig, stage: int) -> int:
    """Pipeline rank of ``stage`` (torch's loop or V mapping)."""
    pp = pcfg.pp
    if pcfg.schedule.is_v and pp > 1:
        return stage if stage < pp else 2 * pp - 1 - stage
    return stage % pp


def local_stages(pcfg: ParallelConfig, pp_rank: int) -> list[int]:
    """The stage indices pipeline rank ``pp_rank`` holds, ascending."""
    return [s for s in range(pcfg.n_stages) if stage_to_rank(pcfg, s) == pp_rank]


def check_pipeline(cfg: ModelConfig, pcfg: ParallelConfig, n_microbatches: int) -> None:
    """Every check of a pipelined job that needs no process: the layout against the model and the schedule, tied
    embeddings, the schedule's micro-batch count (run by the launcher before any worker starts).

    Raises:
        ConfigError: naming the problem and the expected value.
    """
    if pcfg.pp == 1:
        return
    stage_specs(cfg, pcfg)
    check_microbatches(pcfg, n_microbatches)


def build_stages(model: Transformer, pcfg: ParallelConfig, pp_rank: int) -> list[TransformerStage]:
    """This rank's stage modules, sharing ``model``'s modules (build ``model`` on the meta device: the stages of
    other ranks are never allocated).

    Raises:
        ConfigError: a layout that does not match (see :func:`stage_specs`), or tied embeddings under pipelining.
    """
    specs = stage_specs(model.cfg, pcfg)
    return [TransformerStage(model, specs[s]) for s in local_stages(pcfg, pp_rank)]


# ---- the embedding held by the first and the last stage --------------------------------------------------------

def embedding_groups(ctx: Any) -> Any:
    """The process group joining, for this rank's (dp, ep) coordinate, the pipeline ranks of the first and the last
    stage, when those differ and the last stage holds an embedding copy (MTP). Every rank must call this (groups
    are created collectively). None when no group is needed."""
    pcfg = ctx.pcfg
    if not ctx.distributed or pcfg.pp == 1:
        return None
    first, last = stage_to_rank(pcfg, 0), stage_to_rank(pcfg, pcfg.n_stages - 1)
    if first == last:
        return None
    mine = None
    for c in range(ctx.stage_size):
        ranks = [first * ctx.stage_size + c, last * ctx.stage_size + c]
        g = dist.new_group(ranks, timeout=_timeout(pcfg))
        if ctx.rank in ranks:
            mine = g
    return mine


def _timeout(pcfg: ParallelConfig):
    import datetime
    return datetime.timedelta(seconds=pcfg.timeout_s)


def sync_embedding_grads(parts: list[TransformerStage], group: Any, needs_sync: bool) -> None:
    """Sum the embedding gradients of the first stage and of the last stage's copy, so both copies take the same
    optimizer step -- the gradient of the one shared weight (Megatron-Core sums its first and last stages' word
    embedding gradients the same way). Both copies are FSDP-sharded alike over their stage's DP x EP ranks, so the
    local shards of one (dp, ep) coordinate cover the same box.

    ``needs_sync``: the model has an embedding copy somewhere (MTP with the last stage not the first); every rank of
    the embedding group must call this then.
    """
    if not needs_sync:
        return
    copies = [p.embed_tokens.weight for p in parts if p.embed_tokens is not None]
    if not copies:
        return
    grads = [local_tensor(w.grad) if w.grad is not None else None for w in copies]
    local = [g for g in grads if g is not None]
    total = local[0].clone() if local else torch.zeros_like(local_tensor(copies[0]))
    for g in local[1:]:
        total += g
    if group is not None:
        dist.all_reduce(total, group=group)
    for w, g in zip(copies, grads):
        if g is None:
            raise RuntimeError("a stage's embedding received no gradient in this step")
        g.copy_(total)


def is_duplicate(part: TransformerStage, name: str) -> bool:
    """The parameter ``name`` of ``part`` is the last stage's embedding copy (counted once, on the first stage, in
    the gradient norm)."""
    return part.shared_embedding_copy() and name == "embed_tokens.weight"


# ---- schedules -------------------------------------------------------------------------------------------------

def _timed(cls: type) -> type:
    """A ``PipelineStage`` subclass recording the intervals this rank spends computing (forward, backward and
    weight-backward of its micro-batches); the rest of a schedule step is waiting for the neighbouring stages and
    sending to them: the bubble.

    The intervals are points of :func:`moetrain.parallel.timing.clock_for` -- CUDA events on the compute stream on a
    GPU, host time on a CPU -- kept in ``spans`` and read once the step has executed (:meth:`compute_seconds`): no
    host synchronisation per chunk, which would stop the host from queueing the next chunk's work and the
    communication of one chunk from overlapping the compute of the next. A chunk's interval starts after its input
    arrived (the schedule waits for the receive before calling the chunk; on a GPU that wait is on the compute
    stream, before the first event)."""

    depth = [0]  # an OVERLAP_F_B runs one stage's forward inside another's backward: time the outer call only

    class Timed(cls):  # type: ignore[misc, valid-type]
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            self.spans: list[tuple[Any, Any]] = []

        def _time(self, fn: Callable, *a: Any, **k: Any) -> Any:
            if depth[0]:
                return fn(*a, **k)
            clock = clock_for(self.device)
            t0 = clock.mark()
            depth[0] += 1
            try:
                return fn(*a, **k)
            finally:
                depth[0] -= 1
                self.spans.append((t0, clock.mark()))

        def compute_seconds(self) -> float:
            """Seconds of the recorded intervals, which are then cleared. On a GPU only after the host synchronised
            with the compute stream past the last of them (the end of a training step)."""
            clock = clock_for(self.device)
            spans, self.spans = self.spans, []
            return sum(clock.seconds(a, b) for a, b in spans)

        def forward_one_chunk(self, *a: Any, **k: Any) -> Any:
            return self._time(super().forward_one_chunk, *a, **k)

        def backward_one_chunk(self, *a: Any, **k: Any) -> Any:
            return self._time(super().backward_one_chunk, *a, **k)

        def backward_weight_one_chunk(self, *a: Any, **k: Any) -> Any:
            return self._time(super().backward_weight_one_chunk, *a, **k)

    Timed.__name__ = Timed.__qualname__ = "TimedPipelineStage"
    return Timed


def stage_class(base: type, ep_overlap: bool) -> type:
    """The stage class :func:`build_schedule` instantiates: ``base`` (torch's ``PipelineStage``) timed per chunk
    (:func:`_timed`), with the torch-version fixes of :mod:`moetrain.parallel.torch_compat`, and paired for
    ``ep_overlap`` (:func:`moetrain.parallel.overlap.paired_stage`)."""
    cls = recv_buffers_ready_for_backward(keep_split_backward_graph(without_self_p2p_warmup(_timed(base))))
    return paired_stage(cls) if ep_overlap else cls


def build_schedule(parts: list[TransformerStage], ctx: Any, n_microbatches: int, micro_batch: int, seq_len: int,
                   loss_fn: Callable[[torch.Tensor, Any], torch.Tensor]) -> tuple[Any, list[Any]]:
    """The ``torch.distributed.pipelining`` schedule of ``ctx.pcfg.schedule`` over this rank's stages.

    Message shapes are declared up front (static metadata: no trial forward, whose MoE statistics and all-to-alls
    would count): a stage receives and sends the hidden state h (B, L, D) in ``act_dtype`` -- the token ids and
    labels reach every stage as keyword arguments of ``schedule.step`` (``moetrain.model.stage``) -- and the last
    stage returns the (1 + MTP depth,) fp32 loss sums. Gradients are not rescaled by the schedule
    (``scale_grads=False``): the loss is normalised by global counts.

    Returns (schedule, pipeline stages).

    Raises:
        ConfigError: the schedule needs more micro-batches than given (1F1B and DualPipeV: at least the number of
            stages; interleaved 1F1B: a multiple of PP).
    """
    from torch.distributed.pipelining import (PipelineStage, Schedule1F1B, ScheduleDualPipeV,
                                              ScheduleInterleaved1F1B, ScheduleZBVZeroBubble)

    pcfg = ctx.pcfg
    name = pcfg.schedule
    n_stages = pcfg.n_stages
    check_microbatches(pcfg, n_microbatches)
    B, L, D = micro_batch, seq_len, parts[0].cfg.dim
    dev = ctx.device
    stages = []
    Timed = stage_class(PipelineStage, pcfg.ep_overlap)
    for part in parts:
        h = torch.empty(B, L, D, dtype=part.act_dtype, device="meta")
        inputs = () if part.spec.embed else (h,)  # token ids and labels: keyword arguments, not sent
        outputs = ((torch.empty(1 + len(part.spec.mtp), dtype=torch.float32, device="meta"),) if part.spec.head
                   else (h,))
        stages.append(Timed(part, part.spec.index, n_stages, dev, input_args=_to(inputs, dev),
                            output_args=_to(outputs, dev), group=ctx.pp_group))
    cls = {Schedule.ONE_F_ONE_B: Schedule1F1B, Schedule.INTERLEAVED: ScheduleInterleaved1F1B,
           Schedule.DUALPIPEV: ScheduleDualPipeV, Schedule.ZBV: ScheduleZBVZeroBubble}[name]
    order = None
    if pcfg.ep_overlap and cls is Schedule1F1B:
        # The 1F1B order on the runtime that executes OVERLAP_F_B actions (torch's Schedule1F1B has its own loop).
        cls, order = ScheduleInterleaved1F1B, one_f_one_b_order(pcfg.pp, n_microbatches)
    arg = stages[0] if cls is Schedule1F1B else stages
    schedule = cls(arg, n_microbatches=n_microbatches, loss_fn=loss_fn, scale_grads=False)
    if pcfg.ep_overlap:
        pair_schedule(schedule, order)
    return schedule, stages


def _to(ts: tuple[torch.Tensor, ...], dev: torch.device) -> tuple[torch.Tensor, ...]:
    """Example tensors for the static stage metadata: floating ones (activations, losses) carry gradients."""
    return tuple(torch.empty(t.shape, dtype=t.dtype, device=dev, requires_grad=t.is_floating_point()) for t in ts)
