"""Expert-parallel dispatcher overhead: the same MoE-layer work on 2 processes at EP = 2 (all-to-all dispatcher)
vs 2 processes at EP = 1 (each process holds all experts, local permutation, no communication).

Each process owns its own tokens (batch x seq_len) and runs MoE-layer forward + backward, exactly as in a training
step of the preset (one layer; weights identical on every process, seed 0). At EP = 2 each process keeps E/2
experts and exchanges tokens with the all-to-all dispatcher; per-process FLOPs are the same as at EP = 1 because
routing is perfectly balanced (``routing="balanced"``, the published records' benchmark convention). Gradient
synchronisation is left out on both sides (it is the same data-parallel all-reduce for both layouts and not part
of the dispatcher). Each process uses 1 thread, so both layouts use the same 2 cores.

Overhead per token = t(EP=2) / t(EP=1) - 1, with t the median over steps of the slower process's step time. All
layouts (and their patched twins) are built once in the same 2 processes and timed round-robin, one step of each
per round, so that load from other processes on the shared cores hits every layout alike.
Reported for overlap on/off and n_chunks 1 and 2; the dispatcher's own counters give the all-to-all time and the
part of it that was exposed (not hidden behind compute), and the rows each process sent to the other (the
all-to-all dispatcher sends a token once per destination rank unless a config says ``"dedup": False``).
"""

from __future__ import annotations

import os
import socket
import statistics
import tempfile
import time
import traceback
from typing import Any

from common import Settings, run_isolated

CONFIGS = [
    {"name": "EP=1 (dp=2, local)", "ep": 1, "overlap": True, "n_chunks": 1},
    {"name": "EP=2 overlap on, 1 chunk", "ep": 2, "overlap": True, "n_chunks": 1},
    {"name": "EP=2 overlap off, 1 chunk", "ep": 2, "overlap": False, "n_chunks": 1},
    {"name": "EP=2 overlap on, 2 chunks", "ep": 2, "overlap": True, "n_chunks": 2},
    {"name": "EP=2 overlap off, 2 chunks", "ep": 2, "overlap": False, "n_chunks": 2},
]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _rank_entry(rank: int, world: int, port: int, out_dir: str, sd: dict, configs: list, patches: list) -> None:
    import torch
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    try:
        res: Any = ("ok", _rank_work(rank, Settings.from_dict(sd), configs, patches))
    except BaseException as e:  # noqa: BLE001
        res = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()[-2000:]}")
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(res, os.path.join(out_dir, f"rank{rank}.pt"))


def _rank_work(rank: int, s: Settings, configs: list, patches: list) -> list[dict]:
    import torch
    import torch.distributed as dist

    import patches as P
    from moetrain.model.moe import CapacityConfig, LocalDispatcher, MoE
    from moetrain.parallel.config import ParallelConfig
    from moetrain.parallel.dispatch import AllToAllDispatcher
    from moetrain.parallel.mesh import init_parallel
    from peers import bench_config, copy_moe_weights, init_moe_reference

    torch.set_num_threads(1)
    cfg = bench_config(s.preset).replace(routing="balanced")
    dev = torch.device(s.device, rank) if s.device == "cuda" else torch.device("cpu")
    amp = s.device == "cuda" and s.dtype == "bf16"
    g = torch.Generator().manual_seed(100 + rank)
    x = torch.randn(s.batch, s.seq_len, cfg.dim, generator=g).to(dev).requires_grad_(True)
    gy = torch.randn(s.batch, s.seq_len, cfg.dim, generator=g).to(dev)
    runs = []
    for label, pn in (("baseline", []), ("patched", patches)):
        if label == "patched" and not patches:
            continue
        for c in configs:
            ctx = init_parallel(ParallelConfig(ep=c["ep"], overlap=c["overlap"], n_chunks=c["n_chunks"]),
                                cfg.n_routed_experts, device=s.device)
            ref = init_moe_reference(cfg, str(dev))
            with P.patched(pn), torch.device(dev):
                moe = MoE(cfg)  # the (possibly patched) class, holding the reference weights
                copy_moe_weights(moe, ref)
                if c["ep"] > 1:
                    moe.dispatcher = AllToAllDispatcher(cfg.n_routed_experts, c["ep"], ctx.ep_rank, ctx.ep_group,
                                                        CapacityConfig(), c["overlap"], c.get("dedup", True))
                else:
                    moe.dispatcher = LocalDispatcher(cfg.n_routed_experts)
                _keep_local_experts(moe.experts, moe.dispatcher.local_expert_offset, moe.dispatcher.n_local_experts)
            moe.n_chunks = c["n_chunks"]
            runs.append({"label": label, "patches": pn, "cfg": c, "moe": moe, "times": []})

    def step(run) -> None:
        moe = run["moe"]
        x.grad = None
        for p in moe.parameters():
            p.grad = None
        with torch.autocast(s.device, dtype=torch.bfloat16, enabled=amp):
            y, _ = moe(x)
        y.backward(gy)
        if s.device == "cuda":
            torch.cuda.synchronize()
        moe.dispatcher.stats.settle()  # CUDA-event timings are read once the step has run

    n_warm, n_rounds = (1, 4) if s.quick else (2, 24)
    for run in runs:
        with P.patched(run["patches"]):
            for _ in range(n_warm):
                step(run)
        st = run["moe"].dispatcher.stats
        st.reset_timers()
        st.rows_sent = st.remote_rows_sent = 0
    # Round-robin: one step of every layout per round, so that load from other processes hits all layouts alike.
    for _ in range(n_rounds):
        for run in runs:
            with P.patched(run["patches"]):
                dist.barrier()
                t0 = time.perf_counter()
                step(run)
                t = torch.tensor([time.perf_counter() - t0], dtype=torch.float64,
                                 device=dev if s.device == "cuda" else "cpu")
                dist.all_reduce(t, op=dist.ReduceOp.MAX)  # a step ends when the slower process ends
                run["times"].append(float(t))
    out = []
    for run in runs:
        st = run["moe"].dispatcher.stats
        out.append({**run["cfg"], "variant": run["label"], "median_s": statistics.median(run["times"]),
                    "times_s": run["times"], "a2a_s_per_step": st.a2a_seconds / n_rounds,
                    "exposed_s_per_step": st.exposed_seconds / n_rounds, "tokens_per_rank": s.batch * s.seq_len,
                    "remote_rows_per_step": st.remote_rows_sent / n_rounds})
    return out


def child(spec: dict[str, Any]) -> dict[str, Any]:
    """Runs in an isolated process: spawns the 2 ranks and collects their results."""
    import torch
    import torch.multiprocessing as mp
    s = Settings.from_dict(spec["settings"])
    world = 2
    if s.device == "cuda" and torch.cuda.device_count() < world:
        return {"skipped": f"EP=2 with NCCL needs {world} GPUs; this machine has {torch.cuda.device_count()}"}
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(_rank_entry, args=(world, _free_port(), d, s.to_dict(), spec["configs"],
                                                    spec.get("patches", [])),
                                 nprocs=world, join=False, start_method="spawn")
        ctx.join(timeout=spec.get("timeout", 400))
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        results = []
        for r in range(world):
            path = os.path.join(d, f"rank{r}.pt")
            results.append(torch.load(path, weights_only=False) if os.path.exists(path) else ("error", "no result"))
    errors = [m for k, m in results if k != "ok"]
    if errors:
        return {"error": errors[0][:2000]}
    out: dict[str, Any] = {}
    for variant in ("baseline", "patched"):
        rows = [r for r in results[0][1] if r["variant"] == variant]
        if not rows:
            continue
        base = next((r for r in rows if r["ep"] == 1), None)
        for r in rows:
            if base is not None:
                r["overhead_vs_ep1"] = r["median_s"] / base["median_s"] - 1
        out[variant] = {"rows": rows, "backend": "nccl" if s.device == "cuda" else "gloo", "world": world,
                        "method": "round-robin over layouts (one step each per round), median of rounds"}
    return out


def run(s: Settings, patches: list[str], log=print) -> dict[str, Any]:
    r = run_isolated("dispatcher:child", {"settings": s.to_dict(), "configs": CONFIGS, "patches": patches},
                     timeout=600)
    if "error" in r or "skipped" in r:
        log(f"    {r.get('error', r.get('skipped'))[:400]}")
        return {"baseline": r}
    for label in ("baseline", "patched"):
        if label not in r:
            continue
        if label == "patched":
            log("    with proposed patches:")
        for row in r[label]["rows"]:
            ov = f"overhead {row['overhead_vs_ep1'] * 100:+6.1f}%" if row["ep"] > 1 else "(reference)"
            log(f"    {row['name']:<28} {row['median_s'] * 1e3:8.1f} ms/step  {ov}   a2a "
                f"{row['a2a_s_per_step'] * 1e3:6.1f} ms, exposed {row['exposed_s_per_step'] * 1e3:6.1f} ms, "
                f"{row.get('remote_rows_per_step', 0):7.0f} rows/step to the other rank")
    return r


def _keep_local_experts(experts, offset: int, n_local: int) -> None:
    """This EP rank's experts as plain parameters (no FSDP here, so no DTensor placement is needed)."""
    import torch
    for name, full in list(experts.named_parameters(recurse=False)):
        setattr(experts, name, torch.nn.Parameter(full.detach()[offset:offset + n_local].clone()))
