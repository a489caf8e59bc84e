"""Run on every rank by the FP8-dispatch test (importable by spawned processes)."""

from __future__ import annotations

from typing import Any

import torch

from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.mesh import init_parallel

E, K, T, D = 8, 3, 96, 200  # D = 200: a full 128 tile and a 72-wide edge tile per row


def inputs(rank: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(rank)
    idx_TK = torch.argsort(torch.rand(T, E, generator=g), dim=1)[:, :K]
    x_TD = (torch.randn(T, D, generator=g) * torch.logspace(-2, 1, D)).to(torch.bfloat16)
    w_TK = torch.rand(T, K, generator=g)
    W_EDD = torch.randn(E, D, D, generator=torch.Generator().manual_seed(99)) / D ** 0.5
    return x_TD, idx_TK, w_TK, W_EDD


def fp8_dispatch_run() -> dict[str, Any]:
    """The all-to-all dispatcher at EP = 2 with BF16 and FP8 rows, both paths: outputs, gradients, bytes sent, and
    the rows the experts received."""
    from moetrain.parallel.dispatch import AllToAllDispatcher

    ctx = init_parallel(ParallelConfig(ep=2), E)
    x_TD, idx_TK, w_TK, W_EDD = inputs(ctx.rank)
    out: dict[str, Any] = {}
    for dedup in (True, False):
        for dtype in ("bf16", "fp8"):
            d = AllToAllDispatcher(E, 2, ctx.ep_rank, ctx.ep_group, dedup=dedup, dispatch_dtype=dtype)
            x = x_TD.clone().requires_grad_(True)
            x_AD, counts_El, state = d.dispatch(x, idx_TK, w_TK).wait()
            expert_A = torch.repeat_interleave(torch.arange(d.n_local_experts), counts_El) + d.local_expert_offset
            y_AD = torch.bmm(x_AD.float().unsqueeze(1), W_EDD[expert_A]).squeeze(1).to(x_AD.dtype)
            y_TD = d.combine(y_AD, state).wait()
            (gx,) = torch.autograd.grad(y_TD.float().square().sum(), [x])
            out[f"{'dedup' if dedup else 'per_assignment'}-{dtype}"] = {
                "x_AD": x_AD.detach().float(), "y": y_TD.detach().float(), "x_grad": gx.float(),
                "bytes_sent": d.stats.bytes_sent, "remote_bytes_sent": d.stats.remote_bytes_sent,
                "rows_sent": d.stats.rows_sent, "x_dtype": str(x_AD.dtype)}
    return out
