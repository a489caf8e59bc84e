"""One optimizer step over a list of micro-batches, pipelined or not: global loss normalisation, the balance loss in
each stage's backward, embedding-gradient sum, gradient clipping, bias update.

Normalisation (so results do not depend on how a global batch is split over ranks, stages and micro-batches):
    loss = sum(CE) / N_tokens_global
         + lambda / D * sum_k sum(CE_k) / N_k_global              (MTP depths k = 1..D)
         + alpha * sum(balance loss per sequence) / N_sequences_global
The normalisers are summed over the ranks of a pipeline stage (DP x EP: each reads different data; the stages of
one pipeline read the same) once per step, before the first forward. The last stage returns the CE sums, which
:class:`Objective` divides; each MoE layer's balance term enters the backward of its own stage with weight
alpha / N_sequences (``moetrain.model.stage.AttachLoss``). FSDP sums gradients (divide factor 1), so the summed
gradient is exactly the gradient of the global loss.

Every rank trains :class:`~moetrain.model.stage.TransformerStage` parts (the whole model is one stage without
pipelining); the job's step runner (``moetrain.train.runners``: sequential, paired EP overlap or pipelined) runs the
forward and backward passes, everything else is the same for all three.
"""

from __future__ import annotations

import math

from dataclasses import dataclass, field
from typing import Any, Iterable

import torch
import torch.distributed as dist

from moetrain.model.config import ModelConfig
from moetrain.model.moe import MoE
from moetrain.model.transformer import IGNORE_INDEX
from moetrain.parallel.comm import name_collective_error, named_phase
from moetrain.parallel.dispatch import AllToAllDispatcher
from moetrain.parallel.a2a_telemetry import A2AStep
from moetrain.parallel.imbalance import ImbalanceStep, measure_moe_telemetry
from moetrain.parallel.mesh import ParallelContext
from moetrain.parallel.parallelize import local_tensor
from moetrain.parallel.pipeline import sync_embedding_grads
from moetrain.parallel.redundant import LayerReplicas
from moetrain.train.runners import ModelParts, Objective

__all__ = ["ModelParts", "Objective", "StepResult", "grad_norm_and_clip", "train_step", "update_expert_biases"]


@dataclass
class StepResult:
    """Global (all-rank) figures of one optimizer step.

    loss: total objective; lm_loss / mtp_loss / balance_loss: its terms (mtp_loss is the mean over depths before
    lambda, balance_loss before alpha; mtp_term / balance_term: the same as added to loss, after them, so loss =
    lm_loss + mtp_term + balance_term); grad_norm: before clipping; tokens_per_expert_ME: (M, E) loads summed over
    all micro-batches and ranks; n_tokens: loss tokens; dropped_tokens: token-expert assignments dropped by the
    capacity limit, summed over micro-batches and ranks; pipeline_s: seconds in the pipeline schedule and
    bubble_s: the part of them this rank spent not computing (waiting for and sending to neighbouring stages; 0
    without pipelining); imbalance: rows, expert time and combine wait of the MoE layers on every EP rank (under PP
    of every stage's layers, each over its own EP group), and the time lost to their imbalance
    (``moetrain.parallel.imbalance``); a2a: all-to-all seconds and dispatch bytes of the MoE layers (under PP of
    every stage's, from the ranks of this rank's pipeline), accumulated in the dispatchers since the metrics logger
    last reset them (``moetrain.parallel.a2a_telemetry``); applied: False when the gradient norm was not finite and
    the update was skipped (weights, optimizer states and expert biases untouched)."""

    loss: float
    lm_loss: float
    mtp_loss: float
    balance_loss: float
    grad_norm: float
    tokens_per_expert_ME: torch.Tensor
    n_tokens: int
    n_sequences: int
    dropped_tokens: int = 0
    pipeline_s: float = 0.0
    bubble_s: float = 0.0
    mtp_term: float = 0.0
    balance_term: float = 0.0
    imbalance: ImbalanceStep | None = None
    a2a: A2AStep = field(default_factory=lambda: A2AStep([]))
    applied: bool = True


def _all_reduce(t: torch.Tensor, ctx: ParallelContext, phase: str, group: Any = None) -> torch.Tensor:
    if ctx.distributed:
        try:
            dist.all_reduce(t, group=group)
        except RuntimeError as e:
            raise name_collective_error(phase, e) from e
    return t


def grad_norm_and_clip(params: Iterable[torch.nn.Parameter], max_norm: float, ctx: ParallelContext,
                       also_clip: Iterable[torch.nn.Parameter] = ()) -> torch.Tensor:
    """Global L2 norm of all gradients (FSDP shards, expert slices and every pipeline stage included) and in-place
    clipping to ``max_norm`` (<= 0: no clipping) when the norm exceeds it.

    Every parameter is sharded or sliced without replication (FSDP over a stage's ranks, experts FSDP over DP and
    sliced over EP, stages disjoint; the last stage's embedding copy is left out by the caller), so the sum of local
    squared norms over all ranks is the squared global norm. A rank whose stage has no gradient (no MoE layer, or no
    parameter at all) adds zero. ``also_clip``: gradients scaled with the others but not counted (copies of a
    counted weight, such as the last stage's embedding).

    Returns the norm, a 0-dim float64 tensor on the gradients' device. The clip decision is taken on the device
    (a factor of exactly 1 when not clipping), as ``torch.nn.utils.clip_grad_norm_`` does, so the host does not wait
    for the backward here and queues the optimizer step behind it; read the norm after that.
    """
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    device = grads[0].device if grads else ctx.device
    extra = [local_tensor(p.grad) for p in also_clip if p.grad is not None]
    sq = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        # Multi-tensor kernels: no full-size fp32 temporary per parameter (squaring tiny gradients elementwise
        # also produced subnormal floats, which run up to 10x slower on x86).
        sq = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)).square().sum()
    total = _all_reduce(sq, ctx, "gradient-norm all-reduce").double().sqrt()
    if max_norm > 0 and grads + extra:
        # The factor in float64, rounded once to fp32 as a Python scalar would be; NaN norms are not clipped.
        coef = torch.where(total > max_norm, max_norm / (total + 1e-6), torch.ones_like(total))
        torch._foreach_mul_(grads + extra, coef.float())
    return total


def update_expert_biases(layers: list[tuple[int, MoE]], tokens_per_expert_ME: torch.Tensor, rate: float) -> None:
    """bias_e += rate * sign(mean(load) - load_e) for every MoE layer (DeepSeek-V3 report, sec. 2.1.2), with the
    loads of each layer's global MoE index (summed over all micro-batches and ranks, so every rank of a stage
    applies the same update)."""
    if rate == 0:
        return
    with torch.no_grad():
        load = tokens_per_expert_ME.float()
        delta = rate * torch.sign(load.mean(dim=1, keepdim=True) - load)
        for m, moe in layers:
            moe.gate.expert_bias.add_(delta[m].to(moe.gate.expert_bias.device))


def train_step(model: ModelParts, optimizer: torch.optim.Optimizer,
               micro_batches: list[tuple[torch.Tensor, torch.Tensor]], cfg: ModelConfig, ctx: ParallelContext,
               max_grad_norm: float = 1.0, autocast_dtype: torch.dtype | None = None,
               bias_update_rate: float | None = None, events: list | None = None) -> StepResult:
    """Forward/backward every micro-batch (through the parts' step runner), then clip, step the optimizer and
    update the expert biases.

    Args:
        model: this rank's :class:`ModelParts`, in train mode.
        micro_batches: this rank's (inputs_BL, labels_BL) int64 pairs for this step, on ctx.device; the ranks of
            one pipeline get the same ones.
        cfg: model config (loss weights, MTP depth).
        ctx: parallel context (single process when not distributed).
        max_grad_norm: clip threshold (<= 0 disables clipping; the norm is still measured).
        autocast_dtype: e.g. torch.bfloat16 on GPU; None = full precision.
        bias_update_rate: gamma for auxiliary-loss-free balancing (default cfg.bias_update_rate).
        events: with ``parallel.ep_overlap``, a list that receives the phase events of the paired micro-batches
            (``moetrain.model.phases.Tape``), in execution order.

    Raises:
        CollectiveError: a collective (dispatch, combine, gradient sync ...) failed or timed out; names the phase.
    """
    device = ctx.device
    depth = cfg.mtp_depth
    # Global normalisers: [loss tokens, MTP tokens per depth..., sequences], counted on the device and read on the
    # host once (balance_scale and the result need them there): one synchronisation per step, before its compute.
    tokens = torch.stack([torch.stack([(y[:, k:] != IGNORE_INDEX).sum() for k in range(depth + 1)])
                          for _, y in micro_batches]).sum(dim=0).double()
    local = torch.cat([tokens, tokens.new_full((1,), float(sum(x.shape[0] for x, _ in micro_batches)))])
    norm = _all_reduce(local, ctx, "loss-normaliser all-reduce", ctx.stage_group)
    with named_phase("loss-normaliser all-reduce", ctx.distributed):
        norm_host = norm.tolist()
    n_tok, n_mtp = norm[0].clamp(min=1), norm[1:1 + depth].clamp(min=1)
    n_seq = max(norm_host[-1], 1.0)
    balance_scale = cfg.balance_loss_alpha / n_seq if cfg.balance_loss_alpha > 0 else 0.0

    objective = model.objective
    objective.start(n_tok, n_mtp)
    for p in model.parts:
        p.start_step(balance_scale)
    layers = model.moe_layers()
    # Redundant experts (moetrain.parallel.redundant): the copies are fetched again from this step's weights.
    replicas = [(m, moe.experts, r) for m, moe in layers if isinstance(r := moe.experts.replicas, LayerReplicas)]
    for _, _, r in replicas:
        r.invalidate()
    amp = torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None)
    model.runner.forward_backward(micro_batches, amp, events)
    with named_phase("embedding gradient sum (first and last stage)", ctx.distributed):
        sync_embedding_grads(model.parts, model.embedding_group, model.embedding_sync)
    for _, experts, r in replicas:
        r.return_grads(experts.w13_E2FD, experts.w2_EDF)

    loads = torch.zeros(cfg.n_moe_layers + depth, cfg.n_routed_experts, dtype=torch.float64, device=device)
    bal = torch.zeros((), dtype=torch.float64, device=device)
    dropped = torch.zeros((), dtype=torch.float64, device=device)
    for p in model.parts:
        for m, c in p.stats.loads.items():
            loads[m] += c.to(device).double()
        if p.stats.balance_sum is not None:
            bal += p.stats.balance_sum.to(device)
            dropped += p.stats.dropped.to(device)
    terms = torch.stack([objective.lm.to(device), objective.mtp.to(device), bal / n_seq])
    packed = _all_reduce(torch.cat([terms, loads.flatten(), dropped.view(1)]), ctx, "metrics all-reduce")
    terms = packed[:3]
    loads_ME = packed[3:3 + loads.numel()].round().long().view_as(loads)
    once = model.parameters(counted_once=True)
    ids = {id(p) for p in once}
    gnorm = grad_norm_and_clip(once, max_grad_norm, ctx, [p for p in model.parameters() if id(p) not in ids])
    # A non-finite gradient must never reach the weights: the norm (global, the same on every rank) is read before
    # the update, and a NaN or inf one leaves weights, optimizer states and expert biases as they were (the loop
    # then stops the run, naming the step). One host read a step earlier than the step's end would read it.
    applied = math.isfinite(gnorm.item())
    if applied:
        optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    if applied:
        rate = cfg.bias_update_rate if bias_update_rate is None else bias_update_rate
        update_expert_biases(layers, loads_ME, rate)
    # The step's one wait for the device: everything above is queued; these reads return when it has run.
    with named_phase("step end (waits for the step's queued work: gradient reduction, optimizer, metrics and "
                     "gradient-norm all-reduces)", ctx.distributed):
        lm_v, mtp_v, bal_v, gnorm_v, dropped_v = torch.cat([terms, gnorm.view(1).to(packed), packed[-1:]]).tolist()
        loads_cpu = loads_ME.cpu()
    for m, _, r in replicas:
        r.observe(loads_cpu[m].tolist())
    # Device-timed intervals and collectives of the step have executed by now: read their events.
    for _, moe in layers:
        moe.dispatcher.stats.settle()
    pipeline_s, bubble_s = model.runner.timing()
    timers = [(m, moe.dispatcher.expert_timer) for m, moe in layers if isinstance(moe.dispatcher, AllToAllDispatcher)]
    imbalance, a2a = measure_moe_telemetry(timers, [(m, moe.dispatcher.stats) for m, moe in layers],
                                           ctx.ep_group if ctx.pcfg.ep > 1 else None, device,
                                           ctx.pp_group if ctx.pcfg.pp > 1 else None, loads.shape[0],
                                           ctx.pcfg.moves_tokens)
    mtp_term, balance_term = cfg.mtp_loss_weight * mtp_v, cfg.balance_loss_alpha * bal_v
    return StepResult(loss=lm_v + mtp_term + balance_term, lm_loss=lm_v, mtp_loss=mtp_v, balance_loss=bal_v,
                      grad_norm=gnorm_v, tokens_per_expert_ME=loads_cpu, n_tokens=int(norm_host[0]),
                      n_sequences=int(norm_host[-1]), dropped_tokens=int(dropped_v), pipeline_s=pipeline_s,
                      bubble_s=bubble_s, mtp_term=mtp_term, balance_term=balance_term, imbalance=imbalance, a2a=a2a,
                      applied=applied)
