"""Functions run on every rank by the EP-overlap tests (importable by spawned processes)."""

from __future__ import annotations

import dataclasses
from types import SimpleNamespace
from typing import Any

from moetrain.parallel.mesh import init_parallel
from moetrain.train.optim import build_optimizers
from moetrain.train.step import train_step

from .pipeline_workers import ACCUM, GLOBAL_SEQS, batch, pipeline_job


def overlap_events_run(pcfg_kwargs: dict, n_micro: int = ACCUM, n_layers: int = 4) -> dict[str, Any]:
    """One training step of ``n_micro`` micro-batches; returns the phase events the paired schedule recorded and
    every MoE layer's per-phase all-to-all timers."""
    from moetrain.train.trainer import build_model_parts

    job = pipeline_job(pcfg_kwargs, n_layers)
    ctx = init_parallel(job.parallel, job.model.n_routed_experts, "cpu")
    per = GLOBAL_SEQS // ctx.stage_size
    job = dataclasses.replace(job, train=dataclasses.replace(job.train, micro_batch_size=per // n_micro,
                                                             grad_accum=n_micro))
    mp = build_model_parts(job, ctx, None)
    opt = build_optimizers(mp.parts, lr=3e-3, eps=1e-5)
    data = batch(0, job.model.vocab_size)[ctx.data_rank * per:(ctx.data_rank + 1) * per]
    mbs = [(c[:, :-1].contiguous(), c[:, 1:].contiguous()) for c in data.chunk(n_micro)]
    events: list = []
    r = train_step(mp, opt, mbs, job.model, ctx, events=events)
    phases = [dict(m.dispatcher.stats.by_phase) for _, m in mp.moe_layers()]
    # Validation as the trainer runs it (under the V schedules: a training step with a zero loss).
    from moetrain.train.validation import evaluate
    val_tokens = batch(99, job.model.vocab_size).flatten().numpy()
    job = dataclasses.replace(job, train=dataclasses.replace(job.train, eval_batches=2))
    val = evaluate(mp, SimpleNamespace(val_path=val_tokens), job, ctx, None)
    return {"events": events, "loss": r.loss, "phases": phases, "pp_rank": ctx.pp_rank, "val": val}
