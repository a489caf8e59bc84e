"""The trainer's validation: the main model's next-token cross-entropy on the held-out split, run by the parts' step
runner on every rank (pipelined: only the last stage counts).

One stream (``data.paths`` / the built-in corpus): the first ``train.eval_batches`` micro-batches of every data
rank's windows of the validation file (:func:`moetrain.data.iter_eval_batches`), the token-weighted mean.

A weighted mixture (``data.sources``): every source is scored on its own validation windows, the
``train.eval_batches`` split across the sources by the mixture's weights (:func:`split_eval_batches`, at least one
each), and the validation loss is the weight-averaged mean of the sources' losses (weights normalised) - the
validation blended with the training weights, as Megatron-Core's blended datasets do. Scoring the one file that holds
the sources' validation tokens one after the other took the first source's windows only.

Every rank runs the same sources in the same order with the same batch counts (the collectives of EP dispatch and
of the pipeline need it), and the windows depend on nothing a resume changes.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable, Sequence

import numpy as np
import torch
import torch.distributed as dist
from torch.distributed.fsdp import FSDPModule

from moetrain.config import JobConfig
from moetrain.data import iter_eval_batches
from moetrain.data.prepare import PreparedData
from moetrain.parallel.comm import named_phase
from moetrain.parallel.mesh import ParallelContext
from moetrain.train.runners import ModelParts

__all__ = ["Validation", "split_eval_batches", "evaluate", "validate"]


@dataclass(frozen=True)
class Validation:
    """One validation.

    Attributes:
        loss: the validation loss in nats per token (a mixture: the weight-averaged mean of ``by_source``).
        by_source: a mixture's per-source mean loss, {source label: nats per token}, in source order; empty for one
            stream.
    """

    loss: float
    by_source: dict[str, float] = field(default_factory=dict)


def split_eval_batches(weights: Sequence[float], eval_batches: int) -> list[int]:
    """Micro-batches per data rank of each source of a mixture: one each, and the other ``eval_batches - S`` shared
    by the normalised weights with the largest-remainder (Hamilton) rule, ties to the earlier source. Sums to
    ``max(eval_batches, S)`` for ``S`` sources. E.g. weights (3, 1): 4 -> [3, 1], 8 -> [6, 2], 1 -> [1, 1].

    Raises:
        ValueError: no weights, a weight that is not positive, ``eval_batches`` below 1.
    """
    w = np.asarray(weights, dtype=np.float64)
    if w.size == 0 or not np.all(np.isfinite(w) & (w > 0)):
        raise ValueError(f"need one positive weight per source; got {list(weights)}")
    if eval_batches < 1:
        raise ValueError(f"eval_batches must be >= 1; got {eval_batches}")
    rest = max(eval_batches - len(w), 0)
    share = rest * w / w.sum()
    out = np.floor(share).astype(np.int64)
    # stable sort: equal remainders go to the earlier source
    for i in np.argsort(-(share - out), kind="stable")[:rest - int(out.sum())]:
        out[i] += 1
    return [1 + int(n) for n in out]


def _sums(model: ModelParts, path: object, n_batches: int, job: JobConfig, ctx: ParallelContext,
          amp: torch.dtype | None) -> torch.Tensor:
    """float64 (2,): [CE sum, loss tokens] of this rank over the first ``n_batches`` of its validation batches of
    ``path`` (a token file or array)."""
    batches = [(x.to(ctx.device), y.to(ctx.device)) for x, y in
               iter_eval_batches(path, job.data.seq_len, job.train.micro_batch_size, ctx.data_rank,
                                 ctx.stage_size, n_batches)]
    with torch.no_grad(), named_phase("evaluation forward", ctx.distributed), \
            torch.autocast(ctx.device.type, dtype=amp, enabled=amp is not None):
        return model.runner.eval_sums(batches)


def _scored(model: ModelParts, fn: Callable[[], torch.Tensor]) -> torch.Tensor:
    """``fn()`` with the model in eval mode and its dispatch statistics paused; FSDP2's parameters resharded after
    it (a forward-only pass leaves those it keeps after a forward gathered -- the root's, and under pipelining every
    stage's -- which would hold their memory into the next step and spare that step its all-gathers)."""
    model.train(False)
    dispatch_stats = [m.dispatcher.stats for _, m in model.moe_layers()]
    for st in dispatch_stats:  # validation's all-to-alls are not the training step's
        st.recording = False
    try:
        return fn()
    finally:
        model.train(True)
        for st in dispatch_stats:
            st.recording = True
        for part in model.parts:
            for m in part.modules():
                if isinstance(m, FSDPModule):
                    m.reshard()


def evaluate(model: ModelParts, prep: PreparedData, job: JobConfig, ctx: ParallelContext,
             amp: torch.dtype | None) -> float:
    """Mean next-token cross-entropy on the validation file ``prep.val_path`` (first ``train.eval_batches`` batches
    per data rank; all ranks take part; global token-weighted mean)."""
    def run() -> torch.Tensor:
        total = _sums(model, prep.val_path, job.train.eval_batches, job, ctx, amp)
        if ctx.distributed:
            dist.all_reduce(total)
        return total
    total = _scored(model, run)
    return float(total[0] / total[1].clamp(min=1))


def validate(model: ModelParts, prep: PreparedData, job: JobConfig, ctx: ParallelContext,
             amp: torch.dtype | None) -> Validation:
    """The run's validation (see the module docstring): one stream as :func:`evaluate`; a mixture per source, its
    ``val_loss`` the weights' mean of the sources' losses.

    Raises:
        DataError: a source's validation split shorter than one window per data rank (names the file and the fix).
    """
    if not prep.sources:
        return Validation(evaluate(model, prep, job, ctx, amp))
    weights = [s.weight for s in prep.sources]
    counts = split_eval_batches(weights, job.train.eval_batches)

    def run() -> torch.Tensor:
        total_S2 = torch.stack([_sums(model, s.val_path, n, job, ctx, amp) for s, n in zip(prep.sources, counts)])
        if ctx.distributed:
            dist.all_reduce(total_S2)  # one collective for every source
        return total_S2
    total_S2 = _scored(model, run).cpu()
    losses = [float(ce / max(n, 1)) for ce, n in total_S2.tolist()]
    w = np.asarray(weights, dtype=np.float64)
    loss = float(np.dot(w / w.sum(), losses))
    return Validation(loss, {s.label: v for s, v in zip(prep.sources, losses)})
