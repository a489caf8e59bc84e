"""Functions the Qwen3-MoE distributed tests run on every rank (importable by spawned processes)."""

from __future__ import annotations

import torch

from moetrain.config import JobConfig
from moetrain.interop.hf import load_hf_config
from moetrain.model.moe import batch_balance_loss
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.mesh import init_parallel
from moetrain.parallel.parallelize import _stage_sum
from moetrain.train.config import TrainConfig
from moetrain.train.trainer import build_sharded_model


def hf_forward_backward_run(hf_dir: str, tokens_BL1: torch.Tensor, ep: int) -> dict:
    """Load a HF Qwen3-MoE checkpoint into a model parallelized at EP = ``ep`` over all ranks (``moetrain train
    --init-from``'s path), run this rank's rows of ``tokens_BL1`` forward and backward with the CE loss normalised
    over the global batch, and return this rank's logits and the full (gathered) gradients."""
    cfg = load_hf_config(hf_dir)
    job = JobConfig(model=cfg, parallel=ParallelConfig(ep=ep), train=TrainConfig(seed=0))
    ctx = init_parallel(job.parallel, cfg.n_routed_experts, device="cpu")
    model = build_sharded_model(job, ctx, None, init_from=hf_dir)
    per_rank = tokens_BL1.shape[0] // ctx.world_size
    rows = tokens_BL1[ctx.rank * per_rank:(ctx.rank + 1) * per_rank]
    x, y = rows[:, :-1].contiguous(), rows[:, 1:].contiguous()
    out = model(x, y, return_logits=True)
    (out.lm_loss_sum / y.numel() / ctx.world_size).backward()
    grads = {}
    for name, p in model.named_parameters():
        g = p.grad
        grads[name] = (g.full_tensor() if hasattr(g, "full_tensor") else g).detach().clone()
    return {"logits": out.logits_BLV.detach().clone(), "grads": grads}


def global_balance_loss_run(scores_TE: torch.Tensor, idx_TK: torch.Tensor, n_seqs: int) -> dict:
    """This rank's half of (scores, selection): the global-batch balance loss share and its gradient."""
    ctx = init_parallel(ParallelConfig(ep=1), scores_TE.shape[1], device="cpu")
    T = scores_TE.shape[0] // ctx.world_size
    s = scores_TE[ctx.rank * T:(ctx.rank + 1) * T].clone().requires_grad_(True)
    share = batch_balance_loss(s, idx_TK[ctx.rank * T:(ctx.rank + 1) * T], n_seqs // ctx.world_size,
                               reduce=_stage_sum(ctx))
    share.backward()
    return {"share": share.detach(), "grad": s.grad}
