"""One optimizer step over a list of micro-batches: global loss normalisation, gradient clipping, bias update.

Normalisation (so results do not depend on how a global batch is split over ranks and micro-batches):
    loss = sum(CE) / N_tokens_global
         + lambda / D * sum_k sum(CE_k) / N_k_global              (MTP depths k = 1..D)
         + alpha * sum(balance loss per sequence) / N_sequences_global
Every rank back-propagates its own share of that one scalar; FSDP sums gradients (divide factor 1), so the
summed gradient is exactly the gradient of the global loss. The normalisers are all-reduced once per step, before
the first forward.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import Iterable

import torch
import torch.distributed as dist

from moetrain.model.config import ModelConfig
from moetrain.model.transformer import IGNORE_INDEX, Transformer
from moetrain.parallel.comm import name_collective_error, named_phase
from moetrain.parallel.mesh import ParallelContext
from moetrain.parallel.parallelize import local_tensor


@dataclass
class StepResult:
    """Global (all-rank) figures of one optimizer step.

    loss: total objective; lm_loss / mtp_loss / balance_loss: its terms (mtp_loss is the mean over depths before
    lambda, balance_loss before alpha); grad_norm: before clipping; tokens_per_expert_ME: (M, E) loads summed over
    all micro-batches and ranks; n_tokens: loss tokens; dropped_tokens: token-expert assignments dropped by the
    capacity limit, summed over micro-batches and ranks."""

    loss: float
    lm_loss: float
    mtp_loss: float
    balance_loss: float
    grad_norm: float
    tokens_per_expert_ME: torch.Tensor
    n_tokens: int
    n_sequences: int
    dropped_tokens: int = 0
    extra: dict = field(default_factory=dict)


def _all_reduce(t: torch.Tensor, ctx: ParallelContext, phase: str) -> torch.Tensor:
    if ctx.distributed:
        try:
            dist.all_reduce(t)
        except RuntimeError as e:
            raise name_collective_error(phase, e) from e
    return t


def grad_norm_and_clip(params: Iterable[torch.nn.Parameter], max_norm: float, ctx: ParallelContext) -> float:
    """Global L2 norm of all gradients (FSDP shards and expert slices included) and in-place clipping.

    Every parameter is sharded or sliced without replication (FSDP over all ranks, experts FSDP over DP and sliced
    over EP), so the sum of local squared norms over all ranks is the squared global norm.
    """
    grads = [local_tensor(p.grad) for p in params if p.grad is not None]
    device = grads[0].device if grads else ctx.device
    sq = torch.zeros((), dtype=torch.float32, device=device)
    if grads:
        # Multi-tensor kernels: no full-size fp32 temporary per parameter (squaring tiny gradients elementwise
        # also produced subnormal floats, which run up to 10x slower on x86).
        sq = torch.stack(torch._foreach_norm(grads, 2.0, dtype=torch.float32)).square().sum()
    total = math.sqrt(float(_all_reduce(sq, ctx, "gradient-norm all-reduce")))
    if max_norm > 0 and total > max_norm and grads:
        torch._foreach_mul_(grads, max_norm / (total + 1e-6))
    return total


def train_step(model: Transformer, optimizer: torch.optim.Optimizer,
               micro_batches: list[tuple[torch.Tensor, torch.Tensor]], cfg: ModelConfig, ctx: ParallelContext,
               max_grad_norm: float = 1.0, autocast_dtype: torch.dtype | None = None,
               bias_update_rate: float | None = None) -> StepResult:
    """Forward/backward every micro-batch, then clip, step the optimizer and update the expert biases.

    Args:
        model: the (possibly parallelized) model, in train mode.
        micro_batches: this rank's (inputs_BL, labels_BL) int64 pairs for this step, on ctx.device.
        cfg: model config (loss weights, MTP depth).
        ctx: parallel context (single process when not distributed).
        max_grad_norm: clip threshold (<= 0 disables clipping; the norm is still measured).
        autocast_dtype: e.g. torch.bfloat16 on GPU; None = full precision.
        bias_update_rate: gamma for auxiliary-loss-free balancing (default cfg.bias_update_rate).

    Raises:
        CollectiveError: a collective (dispatch, combine, gradient sync ...) failed or timed out; names the phase.
    """
    device = ctx.device
    depth = len(model.mtp) if hasattr(model, "mtp") else 0
    # Global normalisers: [loss tokens, MTP tokens per depth..., sequences].
    counts = [sum(int((y != IGNORE_INDEX).sum()) for _, y in micro_batches)]
    for k in range(1, depth + 1):
        counts.append(sum(int((y[:, k:] != IGNORE_INDEX).sum()) for _, y in micro_batches))
    counts.append(sum(int(x.shape[0]) for x, _ in micro_batches))
    norm = _all_reduce(torch.tensor(counts, dtype=torch.float64, device=device), ctx, "loss-normaliser all-reduce")
    n_tok, n_mtp, n_seq = norm[0].clamp(min=1), norm[1:1 + depth].clamp(min=1), norm[-1].clamp(min=1)

    moe_layers = model.moe_layers()
    loads = torch.zeros(len(moe_layers), cfg.n_routed_experts, dtype=torch.int64, device=device)
    terms = torch.zeros(3, dtype=torch.float64, device=device)  # lm, mtp (mean over depths), balance
    dropped = torch.zeros(1, dtype=torch.float64, device=device)
    for i, (x, y) in enumerate(micro_batches):
        last = i == len(micro_batches) - 1
        if ctx.distributed and hasattr(model, "set_requires_gradient_sync"):
            model.set_requires_gradient_sync(last)
        with named_phase("forward (FSDP parameter all-gather or expert dispatch)", ctx.distributed), \
                torch.autocast(device.type, dtype=autocast_dtype, enabled=autocast_dtype is not None):
            out = model(x, y)
        lm = out.lm_loss_sum / n_tok
        mtp = sum((s / n for s, n in zip(out.mtp_loss_sums, n_mtp)), torch.zeros((), device=device)) / max(depth, 1)
        bal = (out.balance_loss_sum if out.balance_loss_sum is not None else torch.zeros((), device=device)) / n_seq
        loss = lm + cfg.mtp_loss_weight * mtp + cfg.balance_loss_alpha * bal
        with named_phase("backward / gradient sync", ctx.distributed):
            loss.float().backward()
        terms += torch.stack([lm.detach(), mtp.detach(), bal.detach()]).double()
        if out.moe_stats:
            loads += torch.stack([s.tokens_per_expert_E for s in out.moe_stats])
            dropped += sum(s.dropped for s in out.moe_stats)

    packed = _all_reduce(torch.cat([terms, loads.flatten().double(), dropped]), ctx, "metrics all-reduce")
    terms = packed[:3]
    loads = packed[3:3 + loads.numel()].round().long().view_as(loads)
    gnorm = grad_norm_and_clip(model.parameters(), max_grad_norm, ctx)
    optimizer.step()
    optimizer.zero_grad(set_to_none=True)
    rate = cfg.bias_update_rate if bias_update_rate is None else bias_update_rate
    if moe_layers:
        model.update_expert_biases(loads, rate)
    lm_v, mtp_v, bal_v = (float(v) for v in terms)
    total = lm_v + cfg.mtp_loss_weight * mtp_v + cfg.balance_loss_alpha * bal_v
    return StepResult(loss=total, lm_loss=lm_v, mtp_loss=mtp_v, balance_loss=bal_v, grad_norm=gnorm,
                      tokens_per_expert_ME=loads.cpu(), n_tokens=int(norm[0]), n_sequences=int(norm[-1]),
                      dropped_tokens=int(packed[-1]))
