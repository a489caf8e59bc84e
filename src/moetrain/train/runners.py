"""What a rank trains (:class:`ModelParts`: its pipeline stages, the loss function, the step runner) and the three
step runners, one of which is chosen when the job is built (:func:`build_runner`):

    SequentialRunner   PP = 1: the micro-batches one after the other through the one stage (the whole model)
    PairedRunner       PP = 1 with ``parallel.ep_overlap``: micro-batch i+1's forward beside i's backward
                       (``moetrain.parallel.overlap.run_paired``)
    PipelinedRunner    PP > 1: ``torch.distributed.pipelining``'s schedule over this rank's stages
                       (``moetrain.parallel.pipeline``)

Every runner drives :class:`~moetrain.model.stage.TransformerStage` modules with the same forward contract and hands
the last stage's loss sums to one :class:`Objective`; ``moetrain.train.step.train_step`` does the rest of a step
(normalisers, statistics, clipping, optimizer, bias update) the same way for all three.
"""

from __future__ import annotations

from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Any, Protocol

import torch
from torch.distributed.fsdp import FSDPModule

from moetrain.model.config import ModelConfig
from moetrain.model.moe import MoE
from moetrain.model.stage import TransformerStage
from moetrain.model.transformer import IGNORE_INDEX, loss_mask
from moetrain.parallel.comm import named_phase
from moetrain.parallel.mesh import ParallelContext
from moetrain.parallel.overlap import defer_fsdp_reduction, finish_fsdp_reduction, run_paired
from moetrain.parallel.pipeline import build_schedule, is_duplicate
from moetrain.parallel.timing import clock_for

MicroBatches = list[tuple[torch.Tensor, torch.Tensor]]


class Objective:
    """The loss function of the last stage: divides its loss sums (1 + D,) by this step's global counts and keeps
    the terms for the metrics. Called once per micro-batch (by the pipeline schedule, or the runner's loop)."""

    def __init__(self, cfg: ModelConfig):
        self.cfg = cfg
        self.depth = cfg.mtp_depth
        self.weight = 1.0  # 0: the sums are recorded, the returned loss is zero (a forward run as a training step)
        self.start(torch.ones(()), torch.ones(cfg.mtp_depth))

    def start(self, n_tok: torch.Tensor, n_mtp: torch.Tensor) -> None:
        """Begin a step (or an evaluation) with its global counts: the terms start again from zero."""
        self.n_tok, self.n_mtp = n_tok, n_mtp
        zero = torch.zeros((), dtype=torch.float64, device=n_tok.device)
        self.lm, self.mtp, self.lm_sum = zero, zero.clone(), zero.clone()

    def __call__(self, sums_S: torch.Tensor, _target: Any = None) -> torch.Tensor:
        lm = sums_S[0] / self.n_tok.to(sums_S)
        loss = lm
        self.lm = self.lm + lm.detach().double()
        self.lm_sum = self.lm_sum + sums_S[0].detach().double()
        if self.depth:
            mtp = (sums_S[1:] / self.n_mtp.to(sums_S)).sum() / self.depth
            loss = loss + self.cfg.mtp_loss_weight * mtp
            self.mtp = self.mtp + mtp.detach().double()
        return loss * self.weight if self.weight != 1.0 else loss


class StepRunner(Protocol):
    """Runs the forward and backward passes of one optimizer step over a rank's stages (chosen once per job)."""

    def forward_backward(self, micro_batches: MicroBatches, amp: AbstractContextManager,
                         events: list | None) -> None:
        """Forward and backward of this rank's (tokens_BL, labels_BL) micro-batches under ``amp`` (autocast); the
        last stage's loss sums go through the objective. ``events`` receives EP overlap's phase events (or None).
        Gradients are fully reduced over the stage's ranks on return."""

    def timing(self) -> tuple[float, float]:
        """(seconds in the pipeline schedule, the part of them this rank did not compute) of the last step; read
        once the host has waited for the step's device work. (0, 0) without pipelining."""

    def eval_sums(self, batches: MicroBatches) -> torch.Tensor:
        """float64 (2,) on the device: [CE sum, loss tokens] of the main model over ``batches``, as counted by this
        rank's last stage (zeros on a rank without one). Run under the caller's ``no_grad`` and autocast."""


def _eval_whole(stage: TransformerStage, batches: MicroBatches, device: torch.device) -> torch.Tensor:
    total = torch.zeros(2, dtype=torch.float64, device=device)
    for x, y in batches:
        sums = stage(tokens_BL=x, labels_BL=y)
        total += torch.stack([sums[0].double(), loss_mask(y).sum().double()])
    return total


class SequentialRunner:
    """PP = 1: the micro-batches one after the other through the one stage. Under FSDP2 the gradients are reduced
    in the last micro-batch's backward only (the others accumulate locally); with ``parallel.fsdp`` false the
    parameters, gathered at the first forward, stay gathered until the last backward (Megatron's distributed
    optimizer: one all-gather and one reduce-scatter per step). With ``parallel.dp_overlap`` false the
    reduce-scatters run after the whole backward instead of behind it (Megatron without ``--overlap-grad-reduce``)."""

    def __init__(self, stage: TransformerStage, objective: Objective, ctx: ParallelContext):
        self.stage, self.objective, self.ctx = stage, objective, ctx
        self.fsdp = isinstance(stage, FSDPModule)
        self.keep_gathered = self.fsdp and ctx.pcfg.keeps_params_gathered
        self.reduce_after = self.fsdp and not ctx.pcfg.dp_overlap

    def forward_backward(self, micro_batches: MicroBatches, amp: AbstractContextManager,
                         events: list | None) -> None:
        if self.reduce_after:
            defer_fsdp_reduction(self.stage)
            for x, y in micro_batches:
                with named_phase("forward (FSDP parameter all-gather or expert dispatch)", self.ctx.distributed), amp:
                    loss = self.objective(self.stage(tokens_BL=x, labels_BL=y))
                with named_phase("backward", self.ctx.distributed):
                    loss.float().backward()
            with named_phase("gradient sync (after the backward: dp_overlap false)", self.ctx.distributed):
                finish_fsdp_reduction(self.stage)
            return
        for i, (x, y) in enumerate(micro_batches):
            last = i == len(micro_batches) - 1
            if self.fsdp:
                self.stage.set_requires_gradient_sync(last)
            if self.keep_gathered:
                self.stage.set_reshard_after_backward(last)
            with named_phase("forward (FSDP parameter all-gather or expert dispatch)", self.ctx.distributed), amp:
                loss = self.objective(self.stage(tokens_BL=x, labels_BL=y))
            with named_phase("backward / gradient sync", self.ctx.distributed):
                loss.float().backward()

    def timing(self) -> tuple[float, float]:
        return 0.0, 0.0

    def eval_sums(self, batches: MicroBatches) -> torch.Tensor:
        return _eval_whole(self.stage, batches, self.ctx.device)


class PairedRunner:
    """PP = 1 with ``parallel.ep_overlap``: micro-batch i+1's forward paired with micro-batch i's backward, phase by
    phase (``moetrain.parallel.overlap``); FSDP2's gradient reduction runs once, at the end."""

    def __init__(self, stage: TransformerStage, objective: Objective, ctx: ParallelContext):
        self.stage, self.objective, self.ctx = stage, objective, ctx

    def forward_backward(self, micro_batches: MicroBatches, amp: AbstractContextManager,
                         events: list | None) -> None:
        defer_fsdp_reduction(self.stage)

        def forward(i: int) -> torch.Tensor:
            x, y = micro_batches[i]
            with amp:
                return self.objective(self.stage(tokens_BL=x, labels_BL=y))
        with named_phase("forward/backward with EP overlap (expert dispatch, combine or their backward)",
                         self.ctx.distributed):
            run_paired(forward, len(micro_batches), self.ctx.device.type, events, self.stage)
        with named_phase("gradient sync", self.ctx.distributed):
            finish_fsdp_reduction(self.stage)

    def timing(self) -> tuple[float, float]:
        return 0.0, 0.0

    def eval_sums(self, batches: MicroBatches) -> torch.Tensor:
        return _eval_whole(self.stage, batches, self.ctx.device)


class PipelinedRunner:
    """PP > 1: the step's micro-batches through ``torch.distributed.pipelining``'s schedule. The token ids and
    labels reach every stage as keyword arguments (``moetrain.model.stage``); the last stage's loss function (the
    objective) gets the labels as its target. The bubble is the time in the schedule minus the time this rank's
    stages computed (``moetrain.parallel.pipeline._timed``)."""

    def __init__(self, parts: list[TransformerStage], objective: Objective, ctx: ParallelContext, schedule: Any,
                 pipeline_stages: list[Any], n_microbatches: int):
        self.parts, self.objective, self.ctx = parts, objective, ctx
        self.schedule, self.pipeline_stages, self.n_microbatches = schedule, pipeline_stages, n_microbatches
        self.last = any(p.spec.head for p in parts)
        self.clock = clock_for(ctx.device)
        self._span: tuple[Any, Any] | None = None

    def _kwargs(self, x: torch.Tensor, y: torch.Tensor) -> dict[str, torch.Tensor]:
        return {"tokens_BL": x, "labels_BL": y, **({"target": y} if self.last else {})}

    def forward_backward(self, micro_batches: MicroBatches, amp: AbstractContextManager,
                         events: list | None) -> None:
        x = torch.cat([b[0] for b in micro_batches])
        y = torch.cat([b[1] for b in micro_batches])
        for s in self.pipeline_stages:
            s.spans = []
            s.events = events  # with parallel.ep_overlap: the tapes of the OVERLAP_F_B pairs record there
        t_schedule = self.clock.mark()  # a point on the compute stream (a CUDA event on a GPU), read at the end
        try:
            with named_phase("pipeline schedule (stage send/recv, expert dispatch or FSDP gather)", True), amp:
                self.schedule.step(return_outputs=False, **self._kwargs(x, y))
        finally:
            for s in self.pipeline_stages:
                s.events = None
        self._span = (t_schedule, self.clock.mark())

    def timing(self) -> tuple[float, float]:
        if self._span is None:
            return 0.0, 0.0
        pipeline_s = self.clock.seconds(*self._span)
        self._span = None
        return pipeline_s, max(0.0, pipeline_s - sum(s.compute_seconds() for s in self.pipeline_stages))

    def eval_sums(self, batches: MicroBatches) -> torch.Tensor:
        """The batches through the schedule's forward in groups of the step's micro-batch count, the last group
        padded with sequences whose labels are all ignored. torch's zero-bubble V schedules cannot run
        forward-only (their eval() asserts on the split backward actions), so there a group runs as a training
        step with a zero loss and no balance term, and the (zero) gradients are dropped."""
        device = self.ctx.device
        total = torch.zeros(2, dtype=torch.float64, device=device)
        batches = list(batches)
        n = self.n_microbatches
        while len(batches) % n:
            x, y = batches[-1]
            batches.append((torch.zeros_like(x), torch.full_like(y, IGNORE_INDEX)))
        obj = self.objective
        v = self.ctx.pcfg.schedule.is_v
        for g in range(0, len(batches), n):
            x = torch.cat([b[0] for b in batches[g:g + n]])
            y = torch.cat([b[1] for b in batches[g:g + n]])
            obj.start(torch.ones((), device=device), torch.ones(obj.depth, device=device))
            if v:
                for p in self.parts:
                    p.start_step(0.0)
                obj.weight = 0.0
                try:
                    with torch.enable_grad():
                        self.schedule.step(return_outputs=False, **self._kwargs(x, y))
                finally:
                    obj.weight = 1.0
                    for p in self.parts:
                        p.zero_grad(set_to_none=True)
            else:
                self.schedule.eval(**self._kwargs(x, y))
            if self.last:
                total += torch.stack([obj.lm_sum, loss_mask(y).sum().double()])
        return total


def build_runner(parts: list[TransformerStage], objective: Objective, ctx: ParallelContext, n_microbatches: int,
                 micro_batch: int, seq_len: int) -> StepRunner:
    """The step runner of ``ctx.pcfg``: pipelined when PP > 1 (the schedule built here, with static message shapes
    for ``micro_batch`` x ``seq_len`` micro-batches), else paired under ``parallel.ep_overlap``, else sequential.

    Raises:
        ConfigError: a schedule given fewer micro-batches than it needs (``moetrain.parallel.pipeline``).
    """
    if ctx.pcfg.pp > 1:
        schedule, stages = build_schedule(parts, ctx, n_microbatches, micro_batch, seq_len, objective)
        return PipelinedRunner(parts, objective, ctx, schedule, stages, n_microbatches)
    (stage,) = parts
    return _whole_model_runner(stage, objective, ctx)


def _whole_model_runner(stage: TransformerStage, objective: Objective, ctx: ParallelContext) -> StepRunner:
    return PairedRunner(stage, objective, ctx) if ctx.pcfg.ep_overlap else SequentialRunner(stage, objective, ctx)


@dataclass
class ModelParts:
    """What a rank trains: its pipeline stages (one, the whole model, without pipelining), the loss function of
    the last stage and the runner that drives them.

    Attributes:
        parts: this rank's :class:`~moetrain.model.stage.TransformerStage` modules, in model order.
        objective: the loss function the runner hands the last stage's loss sums to.
        runner: the step runner chosen for the job (:func:`build_runner`).
        embedding_group: process group summing the embedding gradients of first and last stage (or None).
        embedding_sync: whether the model has an embedding copy to sum at all.
    """

    parts: list[TransformerStage]
    objective: Objective
    runner: StepRunner
    embedding_group: Any = None
    embedding_sync: bool = False

    def moe_layers(self) -> list[tuple[int, MoE]]:
        """(global MoE index, layer) of every MoE layer on this rank."""
        return [pair for p in self.parts for pair in zip(p.moe_indices(), p.moe_layers())]

    def parameters(self, counted_once: bool = False) -> list[torch.nn.Parameter]:
        """Every parameter of the rank's parts; ``counted_once`` leaves out the last stage's embedding copy."""
        return [t for p in self.parts for name, t in p.named_parameters()
                if not (counted_once and is_duplicate(p, name))]

    def train(self, mode: bool = True) -> None:
        for p in self.parts:
            p.train(mode)


def single_stage_parts(stage: TransformerStage, ctx: ParallelContext) -> ModelParts:
    """A whole-model stage (``moetrain.parallel.pipeline.build_stages`` at PP = 1) with its objective and the
    sequential or paired runner of ``ctx.pcfg``. Parallelize the stage first: the runner reads its FSDP state."""
    objective = Objective(stage.cfg)
    return ModelParts([stage], objective, _whole_model_runner(stage, objective, ctx))
