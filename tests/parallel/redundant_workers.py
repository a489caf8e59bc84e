"""Functions run on every rank by the redundant-experts tests (importable by spawned processes)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from moetrain.parallel.mesh import init_parallel
from moetrain.train.optim import build_optimizers
from moetrain.train.step import train_step

from .pipeline_workers import ACCUM, GLOBAL_SEQS, _full_params, batch, pipeline_job

#: Router bias on experts 0..7 (all on EP rank 0 at EP 2): the loads stay skewed, so copies are placed.
SKEW = 0.1


def _build(pcfg_kwargs: dict, out_dir: str = "runs/unused"):
    from moetrain.train.trainer import build_model_parts

    job = pipeline_job(pcfg_kwargs, out_dir=out_dir)
    ctx = init_parallel(job.parallel, job.model.n_routed_experts, "cpu")
    per = GLOBAL_SEQS // ctx.stage_size
    job = dataclasses.replace(job, train=dataclasses.replace(job.train, micro_batch_size=per // ACCUM))
    mp = build_model_parts(job, ctx, None)
    with torch.no_grad():
        for _, moe in mp.moe_layers():
            moe.gate.expert_bias[:8] += SKEW
    return job, ctx, per, mp, build_optimizers(mp.parts, lr=3e-3, eps=1e-5)


def _step(job, ctx, per, mp, opt, i: int) -> float:
    data = batch(i, job.model.vocab_size)[ctx.data_rank * per:(ctx.data_rank + 1) * per]
    mbs = [(c[:, :-1].contiguous(), c[:, 1:].contiguous()) for c in data.chunk(ACCUM)]
    return train_step(mp, opt, mbs, job.model, ctx).loss


def placements(mp) -> dict[int, Any]:
    """{global MoE index: (replicas per rank, shares)} of this rank's layers with redundant experts."""
    return {m: (moe.experts.replicas.placement.replicas, moe.experts.replicas.placement.shares)
            for m, moe in mp.moe_layers() if moe.experts.replicas is not None}


def redundant_train_run(pcfg_kwargs: dict, steps: int) -> dict[str, Any]:
    """Train ``steps`` steps of 4 micro-batches on deterministic data with skewed routing; return the losses, the
    placement of every layer after each step and the full parameters at the end."""
    job, ctx, per, mp, opt = _build(pcfg_kwargs)
    losses, placed = [], []
    for i in range(steps):
        losses.append(_step(job, ctx, per, mp, opt, i))
        placed.append(placements(mp))
    return {"losses": losses, "placements": placed, "params": _full_params(mp, ctx), "pp_rank": ctx.pp_rank,
            "ep_rank": ctx.ep_rank}


def redundant_checkpoint_run(pcfg_kwargs: dict, run_dir: str, save: bool, steps: int) -> dict[str, Any]:
    """save=True: train ``steps`` steps, checkpoint, train one more. save=False: load that checkpoint (written at
    any layout and placement), train the one more step. Returns the full parameters at the checkpoint and the
    last step's loss."""
    from moetrain.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    job, ctx, per, mp, opt = _build(pcfg_kwargs, run_dir)
    if save:
        for i in range(steps):
            _step(job, ctx, per, mp, opt, i)
        save_checkpoint(run_dir, steps, mp, opt, {"model_config": job.model.to_dict()}, ctx)
    else:
        load_checkpoint(latest_checkpoint(run_dir), mp, opt, ctx)
    at_ckpt = _full_params(mp, ctx)
    return {"params": at_ckpt, "loss": _step(job, ctx, per, mp, opt, steps), "placements": placements(mp)}
