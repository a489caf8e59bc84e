"""Rank functions of the timing and hang tests (importable by spawned processes)."""

from __future__ import annotations

import io
import time
from typing import Any

import torch

from moetrain.parallel.comm import named_phase
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.mesh import init_parallel

from .fake_events import FakeApi


def _no_synchronize(*_a: Any, **_k: Any) -> None:
    raise AssertionError("torch.cuda.synchronize called during a step")


def wall_timing_run(delay_s: float, compute_s: float) -> dict:
    """Rank 1 issues its side of an all-to-all ``delay_s`` late; rank 0 issues at once, computes for ``compute_s``
    (a sleep stands in for host compute: gloo's transfer runs on gloo's own threads meanwhile), then waits. Returns
    rank 0's a2a and exposed seconds."""
    from moetrain.model.moe import DispatchStats
    from moetrain.parallel.comm import all_to_all

    ctx = init_parallel(ParallelConfig(ep=2), 8, device="cpu")
    stats = DispatchStats()
    x = torch.full((4, 16), float(ctx.rank))
    if ctx.rank == 1:
        time.sleep(delay_s)
    out, pending = all_to_all(x, [2, 2], [2, 2], ctx.ep_group, "dispatch", stats)
    if ctx.rank == 0:
        time.sleep(compute_s)
    pending.wait()
    assert not stats.unsettled  # the host clock is read at once
    return {"a2a": stats.a2a_seconds, "exposed": stats.exposed_seconds, "out": out}


def _ep2_layer(ctx: Any, cfg: Any) -> Any:
    """One MoE layer with the all-to-all dispatcher over the 2 EP ranks (no FSDP)."""
    from moetrain.model.moe import MoE
    from moetrain.parallel.dispatch import AllToAllDispatcher
    from moetrain.parallel.parallelize import place_experts

    torch.manual_seed(0)
    layer = MoE(cfg)
    layer.dispatcher = AllToAllDispatcher(cfg.n_routed_experts, 2, ctx.ep_rank, ctx.ep_group)
    place_experts(layer.experts, ctx)
    return layer


def event_timing_layer_run() -> dict:
    """An EP=2 MoE layer, forward and backward, with the CPU's collectives timed by the event path (a stand-in
    API): nothing is read before ``settle()``, everything after."""
    from moetrain.parallel import timing

    from .workers import tiny_test_config

    api = FakeApi()
    timing.install_device_api("cpu", api)
    cfg = tiny_test_config()
    ctx = init_parallel(ParallelConfig(ep=2), cfg.n_routed_experts, device="cpu")
    layer = _ep2_layer(ctx, cfg)
    x = torch.randn(2, 12, cfg.dim, generator=torch.Generator().manual_seed(ctx.rank), requires_grad=True)
    y, _ = layer(x)
    (y * y).sum().backward()
    stats = layer.dispatcher.stats
    before = {"a2a": stats.a2a_seconds, "unsettled": len(stats.unsettled), "reads": api.elapsed_reads}
    stats.settle()
    return {"before": before, "a2a": stats.a2a_seconds, "exposed": stats.exposed_seconds,
            "phases": sorted(stats.by_phase), "reads": api.elapsed_reads, "events": api.events_made,
            "log": api.log}


def event_timing_train_run(pcfg_kwargs: dict) -> dict:
    """Train steps (EP=2, or pipelined) with the event path standing in for CUDA on the CPU: after every step the
    collectives' events are read, the pipeline's compute and schedule intervals come from events, and nothing
    calls ``torch.cuda.synchronize``."""
    from moetrain.parallel import timing

    api = FakeApi()
    timing.install_device_api("cpu", api)
    torch.cuda.synchronize = _no_synchronize
    if pcfg_kwargs.get("pp", 1) > 1:
        from .pipeline_workers import pipeline_train_run
        out = pipeline_train_run(pcfg_kwargs, steps=2)
        return {"bubbles": out["bubbles"], "reads": api.elapsed_reads, "log": api.log}
    from .workers import train_run
    out = train_run(pcfg_kwargs, steps=2)
    return {"comm": out["comm"], "reads": api.elapsed_reads, "losses": out["losses"]}


def hang_in_counts_run(report_after_s: float, late_s: float) -> dict:
    """Rank 1 enters the MoE layer ``late_s`` late (long after rank 0's monitor reports, but before any timeout):
    rank 0's monitor must name the count exchange of MoE layer 0, then see progress again."""
    from moetrain.parallel.hang import HangMonitor

    from .workers import tiny_test_config

    cfg = tiny_test_config()
    ctx = init_parallel(ParallelConfig(ep=2, timeout_s=60), cfg.n_routed_experts)
    layer = _ep2_layer(ctx, cfg)
    out = io.StringIO()
    with HangMonitor(ctx.rank, report_after_s, timeout_s=60, out=out, poll_s=0.05) as monitor:
        if ctx.rank == 1:
            time.sleep(late_s)
        with named_phase("forward (FSDP parameter all-gather or expert dispatch)"):
            y, _ = layer(torch.randn(1, 8, cfg.dim))
        time.sleep(4 * 0.05)  # one more look, to see the progress
    return {"reports": monitor.reports, "printed": out.getvalue()}
