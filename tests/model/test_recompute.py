"""Activation checkpointing changes memory, not results: same loss, gradients and expert loads."""

from __future__ import annotations

import torch

from moetrain.model.config import tiny
from moetrain.model.transformer import build_model
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.mesh import ParallelContext
from moetrain.parallel.parallelize import parallelize


def _run(recompute: bool):
    cfg = tiny().replace(vocab_size=128, max_seq_len=64)
    model = build_model(cfg, seed=0)
    ctx = ParallelContext(0, 1, 0, torch.device("cpu"), ParallelConfig(ep=1, recompute="full" if recompute else "none", capacity_factor=1.0))
    parallelize(model, ctx)
    assert all(b.recompute == recompute for b in model.layers)
    tokens = torch.randint(0, 128, (2, 33), generator=torch.Generator().manual_seed(0))
    out = model(tokens[:, :-1], tokens[:, 1:])
    out.loss(cfg).backward()
    loads = torch.cat([torch.stack([s.tokens_per_expert_E for s in out.moe_stats]),
                       torch.stack([torch.as_tensor(s.dropped) for s in out.moe_stats])[:, None]], dim=1)
    assert sum(int(s.dropped) for s in out.moe_stats) > 0
    return out.loss(cfg).item(), {n: p.grad.clone() for n, p in model.named_parameters()}, loads


def test_recompute_matches_plain_backward():
    loss_a, grads_a, loads_a = _run(False)
    loss_b, grads_b, loads_b = _run(True)
    assert loss_a == loss_b
    assert torch.equal(loads_a, loads_b)  # recomputation counts neither loads nor drops twice
    for name, g in grads_a.items():
        torch.testing.assert_close(grads_b[name], g, rtol=1e-5, atol=1e-7, msg=lambda m, n=name: f"{n}: {m}")
