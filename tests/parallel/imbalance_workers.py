"""Rank functions of the imbalance-telemetry tests (importable by spawned processes)."""

from __future__ import annotations

import dataclasses
import time
from typing import Any

import torch

from moetrain.model.transformer import build_model
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.mesh import init_parallel
from moetrain.train.metrics import a2a_fields
from moetrain.train.optim import build_optimizer
from moetrain.train.runners import single_stage_parts
from moetrain.train.step import train_step

from .workers import GLOBAL_SEQS, SEQ_LEN, tiny_test_config, whole_model_stage

#: Experts every token is sent to under the skewed routing, per MoE layer (3 main + 1 MTP): all four on EP rank 0
#: (experts 0-7 at EP 2) in the first two layers; three on rank 0 and one on rank 1 in the last two (expert 8 sits in
#: group 2 of the groups of 4, so group-limited routing keeps groups 0 and 2 and picks exactly these).
SKEWED_EXPERTS = ((0, 1, 2, 3), (0, 1, 2, 3), (0, 1, 2, 8), (0, 1, 2, 8))


def imbalance_train_run(pcfg_kwargs: dict, routing: str, steps: int = 3, expert_ffn_dim: int = 64,
                        seqs: int = GLOBAL_SEQS) -> dict[str, Any]:
    """Train the tiny model ``steps`` steps with routing "skewed" (every token to its layer's
    :data:`SKEWED_EXPERTS`), "learned", "balanced" or "alternate" (skewed on even steps, balanced on odd ones: both
    under the same load of the host), on ``seqs`` sequences of SEQ_LEN tokens a step; return every step's routing
    and imbalance figures and its wall time."""
    cfg = tiny_test_config(bias_update_rate=0.0, expert_ffn_dim=expert_ffn_dim,
                           routing="balanced" if routing == "balanced" else "learned")
    ctx = init_parallel(ParallelConfig(**pcfg_kwargs), cfg.n_routed_experts, device="cpu")
    model = build_model(cfg, seed=0)
    if routing in ("skewed", "alternate"):
        with torch.no_grad():
            for moe, experts in zip(model.moe_layers(), SKEWED_EXPERTS, strict=True):
                moe.gate.expert_bias.zero_()
                moe.gate.expert_bias[list(experts)] = 100.0
    model = whole_model_stage(model, ctx)
    opt = build_optimizer(model, lr=1e-3)
    mp = single_stage_parts(model, ctx)
    per_rank = seqs // ctx.world_size
    out: list[dict[str, Any]] = []
    for step in range(steps):
        this = routing
        if routing == "alternate":
            this = "balanced" if step % 2 else "skewed"
            for moe in model.moe_layers():
                moe.gate.routing = "balanced" if step % 2 else "learned"
        g = torch.Generator().manual_seed(1000 + step)
        data = torch.randint(0, cfg.vocab_size, (seqs, SEQ_LEN + 1), generator=g)[
            ctx.rank * per_rank:(ctx.rank + 1) * per_rank]
        mbs = [(c[:, :-1].contiguous(), c[:, 1:].contiguous()) for c in data.chunk(2)]
        t0 = time.perf_counter()
        r = train_step(mp, opt, mbs, cfg, ctx)
        dt = time.perf_counter() - t0
        imb = r.imbalance
        out.append({"routing": this, "step_s": dt, "layers": imb.moe_layers, "rows": imb.rows_MR,
                    "expert_s": imb.expert_s_MR, "wait_s": imb.wait_s_MR, "rows_ratio": imb.rows_max_over_mean(),
                    "rows_step_ratio": imb.rows_step_max_over_mean(),
                    "lost_s": imb.lost_s()})
    return {"steps": out, "tokens_per_step": seqs * SEQ_LEN, "top_k": cfg.top_k, "ep_rank": ctx.ep_rank}


def imbalance_pipeline_run(pcfg_kwargs: dict) -> dict[str, Any]:
    """Two steps of the pipeline tests' job (``pipeline_workers.pipeline_job``: the same weights and data at every
    layout) with the trainer's model parts: step 0 under learned routing, step 1 under the skewed routing of
    :data:`SKEWED_EXPERTS` (no bias update). Returns each step's imbalance figures, expert loads and all-to-all figures
    (accumulated since the start: nothing resets the dispatchers' timers here) with their metrics fields on this
    rank."""
    from .pipeline_workers import ACCUM, GLOBAL_SEQS as PP_SEQS, batch, pipeline_model

    job, ctx, per, mp, opt = pipeline_model(pcfg_kwargs)
    out: list[dict[str, Any]] = []
    for step in range(2):
        if step == 1:
            with torch.no_grad():
                for m, moe in mp.moe_layers():
                    moe.gate.expert_bias.zero_()
                    moe.gate.expert_bias[list(SKEWED_EXPERTS[m])] = 100.0
        data = batch(step, job.model.vocab_size)[ctx.data_rank * per:(ctx.data_rank + 1) * per]
        mbs = [(c[:, :-1].contiguous(), c[:, 1:].contiguous()) for c in data.chunk(ACCUM)]
        r = train_step(mp, opt, mbs, job.model, ctx, bias_update_rate=0.0)
        imb = r.imbalance
        a2a = r.a2a
        out.append({"layers": imb.moe_layers, "rows": imb.rows_MR, "pp_rank_M": imb.pp_rank_M,
                    "lost_s": imb.lost_s(), "totals": list(imb.step_totals()),
                    "loads": r.tokens_per_expert_ME.tolist(),
                    "a2a": {"layers": a2a.moe_layers, "a2a_s": a2a.a2a_s_M, "exposed_s": a2a.exposed_s_M,
                            "phases": [sorted(p) for p in a2a.by_phase_M], "bytes": a2a.bytes_M,
                            "remote_bytes": a2a.remote_bytes_M, "pp_rank_M": a2a.pp_rank_M,
                            "totals": list(a2a.step_totals()), "fields": a2a_fields(a2a, 1, 1.0)}})
    return {"steps": out, "tokens_per_step": PP_SEQS * SEQ_LEN, "top_k": job.model.top_k, "pp_rank": ctx.pp_rank,
            "ep_rank": ctx.ep_rank}
