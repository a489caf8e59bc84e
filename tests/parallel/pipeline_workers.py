"""Functions run on every rank by the pipeline-parallel tests (importable by spawned processes)."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

from moetrain.config import JobConfig
from moetrain.data.config import DataConfig
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.mesh import init_parallel
from moetrain.parallel.parallelize import full_state_dict
from moetrain.train.config import TrainConfig
from moetrain.train.optim import build_optimizers
from moetrain.train.step import train_step

from .workers import SEQ_LEN, tiny_test_config

GLOBAL_SEQS = 16  # 4 micro-batches of 2 sequences at DP x EP = 2; of 4 at DP x EP = 1
ACCUM = 4


def pipeline_job(pcfg_kwargs: dict, n_layers: int = 4, out_dir: str = "runs/unused") -> JobConfig:
    cfg = tiny_test_config(n_layers=n_layers)
    assert cfg.n_dense_layers >= 1
    return JobConfig(model=cfg, parallel=ParallelConfig(**pcfg_kwargs),
                     data=dataclasses.replace(DataConfig(), seq_len=SEQ_LEN),
                     train=dataclasses.replace(TrainConfig(), micro_batch_size=1, grad_accum=ACCUM,
                                               out_dir=out_dir, lr=3e-3, eps=1e-5))


def batch(step: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(2000 + step)
    return torch.randint(0, vocab, (GLOBAL_SEQS, SEQ_LEN + 1), generator=g)


def pipeline_model(pcfg_kwargs: dict, n_layers: int = 4) -> tuple[JobConfig, Any, int, Any, Any]:
    """The pipeline tests' job at the given layout with the trainer's model parts and optimizer: (job with the
    micro-batch size of this layout, parallel context, sequences per data rank, model parts, optimizer)."""
    from moetrain.train.trainer import build_model_parts

    job = pipeline_job(pcfg_kwargs, n_layers)
    ctx = init_parallel(job.parallel, job.model.n_routed_experts, "cpu")
    per = GLOBAL_SEQS // ctx.stage_size
    job = dataclasses.replace(job, train=dataclasses.replace(job.train, micro_batch_size=per // ACCUM))
    mp = build_model_parts(job, ctx, None)
    return job, ctx, per, mp, build_optimizers(mp.parts, lr=3e-3, eps=1e-5, states=job.parallel.optimizer)


def pipeline_train_run(pcfg_kwargs: dict, steps: int = 3, n_layers: int = 4, eval_first: bool = False
                       ) -> dict[str, Any]:
    """Train ``steps`` steps of 4 micro-batches on deterministic data at the given layout (pp = 1: the whole
    model); return the per-step losses, bubble figures and every parameter and buffer this rank holds, in full.
    ``eval_first``: a forward-only evaluation pass (the runner's ``eval_sums``, as the trainer's step-0 validation
    runs it) before the first step."""
    job, ctx, per, mp, opt = pipeline_model(pcfg_kwargs, n_layers)
    losses, bubbles = [], []
    if eval_first:
        data = batch(99, job.model.vocab_size)[ctx.data_rank * per:(ctx.data_rank + 1) * per]
        mp.train(False)
        with torch.no_grad():
            mp.runner.eval_sums([(c[:, :-1].contiguous(), c[:, 1:].contiguous()) for c in data.chunk(ACCUM)])
        mp.train(True)
    for step in range(steps):
        data = batch(step, job.model.vocab_size)[ctx.data_rank * per:(ctx.data_rank + 1) * per]
        mbs = [(c[:, :-1].contiguous(), c[:, 1:].contiguous()) for c in data.chunk(ACCUM)]
        r = train_step(mp, opt, mbs, job.model, ctx)
        losses.append(r.loss)
        bubbles.append((r.pipeline_s, r.bubble_s))
    params: dict[str, torch.Tensor] = {}
    for part in mp.parts:
        for k, v in full_state_dict(part, ctx).items():
            params.setdefault(k, v)
    return {"losses": losses, "params": params, "bubbles": bubbles, "pp_rank": ctx.pp_rank,
            "stages": [getattr(p, "spec", None) and p.spec.index for p in mp.parts]}


def _full_params(mp, ctx) -> dict[str, torch.Tensor]:
    params: dict[str, torch.Tensor] = {}
    for part in mp.parts:
        for k, v in full_state_dict(part, ctx).items():
            params.setdefault(k, v)
    return params


def pipeline_checkpoint_run(pcfg_kwargs: dict, run_dir: str, save: bool) -> dict[str, Any]:
    """save=True: train steps 0-1, checkpoint, train step 2. save=False: load that checkpoint (written at any
    layout), then train step 2. Returns the full parameters right after the checkpoint and the step-2 loss."""
    from moetrain.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint

    job, ctx, per, mp, opt = pipeline_model(pcfg_kwargs)

    def step(i: int) -> float:
        data = batch(i, job.model.vocab_size)[ctx.data_rank * per:(ctx.data_rank + 1) * per]
        mbs = [(c[:, :-1].contiguous(), c[:, 1:].contiguous()) for c in data.chunk(ACCUM)]
        return train_step(mp, opt, mbs, job.model, ctx).loss

    if save:
        step(0), step(1)
        save_checkpoint(run_dir, 2, mp, opt, {"model_config": job.model.to_dict()}, ctx)
    else:
        load_checkpoint(latest_checkpoint(run_dir), mp, opt, ctx)
    at_ckpt = _full_params(mp, ctx)
    return {"params": at_ckpt, "loss2": step(2)}


def pipeline_init_from_run(pcfg_kwargs: dict, hf_dir: str) -> dict[str, torch.Tensor]:
    """Build the model parts with ``init_from=hf_dir``; return every parameter and buffer this rank holds, full."""
    from moetrain.train.trainer import build_model_parts

    job = pipeline_job(pcfg_kwargs)
    ctx = init_parallel(job.parallel, job.model.n_routed_experts, "cpu")
    return _full_params(build_model_parts(job, ctx, None, init_from=hf_dir), ctx)
