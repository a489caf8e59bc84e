"""Functions run on every rank by the distributed tests (importable by spawned processes)."""

from __future__ import annotations

import os
from typing import Any

import torch

from moetrain.model.config import tiny
from moetrain.model.transformer import build_model
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.mesh import check_same_config, init_parallel
from moetrain.parallel.parallelize import full_state_dict, parallelize
from moetrain.train.optim import build_optimizer
from moetrain.train.step import train_step

GLOBAL_SEQS = 8
SEQ_LEN = 32


def tiny_test_config(**overrides: Any):
    # Larger alpha and bias rate than V3's so that both mechanisms visibly act within 3 steps.
    base = dict(vocab_size=256, balance_loss_alpha=1e-2, bias_update_rate=1e-2, max_seq_len=64)
    base.update(overrides)
    return tiny().replace(**base)


def global_batch(step: int, vocab: int) -> torch.Tensor:
    g = torch.Generator().manual_seed(1000 + step)
    return torch.randint(0, vocab, (GLOBAL_SEQS, SEQ_LEN + 1), generator=g)


def train_run(pcfg_kwargs: dict, steps: int = 3, accum: int = 2, model_overrides: dict | None = None,
              force_one_rank: bool = False, adam_eps: float = 1e-8) -> dict:
    """Train the tiny model for ``steps`` optimizer steps on deterministic data; return losses and full params."""
    cfg = tiny_test_config(**(model_overrides or {}))
    ctx = init_parallel(ParallelConfig(**pcfg_kwargs), cfg.n_routed_experts)
    check_same_config(ctx, {"model": cfg.to_dict(), "parallel": pcfg_kwargs})
    model = build_model(cfg, seed=0)
    if force_one_rank:
        _force_routing_to_first_experts(model, cfg)
    parallelize(model, ctx)
    opt = build_optimizer(model, lr=3e-3, eps=adam_eps)
    per_rank = GLOBAL_SEQS // ctx.world_size
    losses, stats = [], []
    for step in range(steps):
        data = global_batch(step, cfg.vocab_size)[ctx.rank * per_rank:(ctx.rank + 1) * per_rank]
        mbs = [(c[:, :-1].contiguous(), c[:, 1:].contiguous()) for c in data.chunk(accum)]
        r = train_step(model, opt, mbs, cfg, ctx)
        losses.append(r.loss)
        stats.append({"dropped": r.dropped_tokens, "loads": r.tokens_per_expert_ME})
    comm = [{"a2a": m.dispatcher.stats.a2a_seconds, "exposed": m.dispatcher.stats.exposed_seconds,
             "calls": m.dispatcher.stats.calls} for m in model.moe_layers()]
    return {"losses": losses, "params": full_state_dict(model, ctx), "stats": stats, "comm": comm}


def _force_routing_to_first_experts(model, cfg) -> None:
    """Bias every router so all tokens pick experts 0..K-1 (all on EP rank 0)."""
    with torch.no_grad():
        for moe in model.moe_layers():
            moe.gate.expert_bias.zero_()
            moe.gate.expert_bias[: cfg.top_k] = 100.0


def moe_layer_run(pcfg_kwargs: dict, tokens_per_rank: int = 24, routing_bias: float = 0.0, data_world: int = 2
                  ) -> dict:
    """One MoE layer forward+backward on inputs laid out for ``data_world`` ranks (a single process takes them all);
    returns outputs, input gradients and full parameter gradients (gathered)."""
    import torch.distributed as dist

    from moetrain.model.moe import MoE
    from moetrain.parallel.parallelize import full_state_dict

    cfg = tiny_test_config()
    ctx = init_parallel(ParallelConfig(**pcfg_kwargs), cfg.n_routed_experts)
    torch.manual_seed(0)
    layer = MoE(cfg)
    for p in layer.parameters():
        torch.nn.init.normal_(p, 0, 0.1)
    layer.gate.expert_bias.normal_(0, routing_bias) if routing_bias else None

    class Wrap(torch.nn.Module):  # parallelize() expects a model with moe_layers(), layers and mtp
        def __init__(self):
            super().__init__()
            self.layer = layer
            self.layers, self.mtp = torch.nn.ModuleList(), torch.nn.ModuleList()

        def moe_layers(self):
            return [self.layer]

        def forward(self, x):
            return self.layer(x)

    model = parallelize(Wrap(), ctx)
    g = torch.Generator().manual_seed(7)
    x_all = torch.randn(data_world * 2, tokens_per_rank // 2, cfg.dim, generator=g)
    w_all = torch.randn(data_world * 2, tokens_per_rank // 2, cfg.dim, generator=g)
    mine = slice(ctx.rank * 2, (ctx.rank + 1) * 2) if ctx.distributed else slice(None)
    x = x_all[mine].clone().requires_grad_(True)
    y, stats = model(x)
    (y * w_all[mine]).sum().backward()
    grads = {}
    for name, p in model.named_parameters():
        gr = p.grad
        if gr is not None:
            gr = gr.full_tensor() if hasattr(gr, "full_tensor") else gr
            if ".experts.w" in name and ctx.distributed and ctx.pcfg.ep > 1:
                parts = [torch.empty_like(gr) for _ in range(ctx.pcfg.ep)]
                dist.all_gather(parts, gr.contiguous(), group=ctx.ep_group)
                gr = torch.cat(parts)
            if ctx.distributed and ".experts.w" not in name:
                pass  # FSDP already summed non-expert grads over all ranks
            grads[name.replace("layer.", "")] = gr.detach().clone()
    return {"y": y.detach(), "x_grad": x.grad.detach(), "grads": grads, "counts": stats.tokens_per_expert_E,
            "dropped": int(stats.dropped)}


def mismatched_config_run() -> str:
    cfg = tiny_test_config()
    ctx = init_parallel(ParallelConfig(ep=1), cfg.n_routed_experts)
    lr = 1e-3 if ctx.rank == 0 else 2e-3
    check_same_config(ctx, {"model": cfg.to_dict(), "lr": lr})
    return "no error"


def hang_in_dispatch_run() -> str:
    """Rank 1 never enters the MoE layer: rank 0's dispatch must time out with an error naming the phase.

    No FSDP here, so that the first collective rank 0 waits in is the dispatcher's own."""
    import time

    from moetrain.model.moe import MoE
    from moetrain.parallel.dispatch import AllToAllDispatcher
    from moetrain.parallel.parallelize import _keep_local_experts

    cfg = tiny_test_config()
    ctx = init_parallel(ParallelConfig(ep=2, timeout_s=3), cfg.n_routed_experts)
    torch.manual_seed(0)
    layer = MoE(cfg)
    layer.dispatcher = AllToAllDispatcher(cfg.n_routed_experts, 2, ctx.ep_rank, ctx.ep_group)
    _keep_local_experts(layer.experts, layer.dispatcher.local_expert_offset, layer.dispatcher.n_local_experts)
    if ctx.rank == 1:
        time.sleep(8)
        return "slept"
    layer(torch.randn(1, 8, cfg.dim))
    return "no error"
