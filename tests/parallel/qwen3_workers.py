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


GLOBAL_SEQS = 16
SEQ_LEN = 32


def qwen3_test_config(**overrides):
    """``qwen3-tiny`` at test size, with a balance loss strong enough to matter within a few steps."""
    from moetrain.model.config import get_preset

    base = dict(vocab_size=256, max_seq_len=64, n_dense_layers=1, balance_loss_alpha=1e-2)
    return get_preset("qwen3-tiny").replace(**{**base, **overrides})


def qwen3_train_run(pcfg_kwargs: dict, steps: int = 2, n_micro: int = 4, model_overrides: dict | None = None) -> dict:
    """Train the test Qwen3 model ``steps`` steps of ``n_micro`` micro-batches at the given layout (the trainer's
    model parts and step). Global micro-batch i holds sequences [i G, (i + 1) G) of the step's batch (G =
    GLOBAL_SEQS / n_micro); each data-parallel rank reads its slice of every global micro-batch, so the micro-batches
    the ranks run together make up exactly the single process's micro-batch (what the global-batch balance loss
    counts over). Returns the per-step losses and every parameter this rank holds, in full."""
    import dataclasses

    from moetrain.data.config import DataConfig
    from moetrain.parallel.parallelize import full_state_dict
    from moetrain.train.optim import build_optimizers
    from moetrain.train.step import train_step
    from moetrain.train.trainer import build_model_parts

    cfg = qwen3_test_config(**(model_overrides or {}))
    pcfg = ParallelConfig(**pcfg_kwargs)
    ctx = init_parallel(pcfg, cfg.n_routed_experts, "cpu")
    G = GLOBAL_SEQS // n_micro
    per = G // ctx.stage_size
    job = JobConfig(model=cfg, parallel=pcfg, data=dataclasses.replace(DataConfig(), seq_len=SEQ_LEN),
                    train=dataclasses.replace(TrainConfig(), micro_batch_size=per, grad_accum=n_micro, lr=3e-3,
                                              eps=1e-5, out_dir="runs/unused"))
    mp = build_model_parts(job, ctx, None)
    opt = build_optimizers(mp.parts, lr=3e-3, eps=1e-5)
    losses, balance = [], []
    for step in range(steps):
        g = torch.Generator().manual_seed(3000 + step)
        data = torch.randint(0, cfg.vocab_size, (GLOBAL_SEQS, SEQ_LEN + 1), generator=g)
        mbs = [c[ctx.data_rank * per:(ctx.data_rank + 1) * per] for c in data.split(G)]
        r = train_step(mp, opt, [(c[:, :-1].contiguous(), c[:, 1:].contiguous()) for c in mbs], cfg, ctx)
        losses.append(r.loss)
        balance.append(r.balance_loss)
    params: dict[str, torch.Tensor] = {}
    for part in mp.parts:
        for k, v in full_state_dict(part, ctx).items():
            params.setdefault(k, v)
    return {"losses": losses, "balance": balance, "params": params}
