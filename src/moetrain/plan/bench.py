"""``moetrain bench``: measure this machine so the performance model can predict a local ``moetrain train`` run.

Measured (each with the number of threads one training worker gets, ``cores // procs``):

* matmul TFLOP/s of an n x n x n fp32 matmul at several n (and bf16 at one size; the curve too if it is fast);
* memory bandwidth of a large tensor copy (bytes read + written per second);
* per-operator overhead: the time of a tiny autograd op (forward + its backward), i.e. what eager PyTorch costs per
  kernel when the tensors are too small to matter;
* all-to-all between ``procs`` local gloo processes (``dist.all_to_all_single``) at several message sizes, fitted
  as ``time = latency + bytes_sent_to_others / bandwidth``.

The results go to a JSON file (default ``.cache/moetrain/bench.json``) that :func:`moetrain.plan.hardware.gpu_from_bench`
turns into a "local" GPUSpec.
"""

from __future__ import annotations

import json
import os
import platform
import socket
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from moetrain.plan.hardware import DEFAULT_BENCH_PATH


def _timeit(fn, min_time: float, min_iters: int = 3) -> float:
    """Fastest seconds per call of ``fn`` over calls lasting at least ``min_time`` in all (the minimum is the
    machine's rate; slower samples are interference from other processes)."""
    fn()  # warm-up
    samples: list[float] = []
    t_end = time.perf_counter() + min_time
    while len(samples) < min_iters or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
        if len(samples) > 10_000:
            break
    return min(samples)


def bench_matmul(sizes: list[int], dtype: torch.dtype, min_time: float) -> list[dict[str, float]]:
    out = []
    for n in sizes:
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        t = _timeit(lambda: torch.mm(a, b), min_time)
        out.append({"n": n, "seconds": t, "tflops": 2 * n ** 3 / t / 1e12})
    return out


def bench_memory(nbytes: int, min_time: float) -> float:
    """GB/s of a large copy (read + write)."""
    x = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    y = torch.empty_like(x)
    t = _timeit(lambda: y.copy_(x), min_time)
    return 2 * nbytes / t / 1e9


def bench_op_overhead(min_time: float) -> tuple[float, float]:
    """(eager µs per tiny op, autograd µs per tiny op counting its backward as one more op)."""
    x = torch.ones(16)
    n = 200

    def eager() -> None:
        y = x
        for _ in range(n):
            y = y + 1.0

    t_eager = _timeit(eager, min_time) / n
    w = torch.ones(16, requires_grad=True)

    def autograd() -> None:
        y = w
        for _ in range(n):
            y = y * 1.0001
        y.sum().backward()

    t_ag = _timeit(autograd, min_time) / (2 * n)
    return t_eager * 1e6, t_ag * 1e6


def _a2a_worker(rank: int, world: int, port: int, sizes: list[int], min_time: float, threads: int,
                out_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(threads)
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        rows = []
        for nbytes in sizes:
            n = max(world, nbytes // 4 // world * world)
            inp = torch.randn(n)
            outp = torch.empty(n)
            t0 = time.perf_counter()
            for _ in range(3):
                dist.all_to_all_single(outp, inp)
            # every rank must make the same number of calls: rank 0 decides from its warm-up time
            iters = torch.tensor([max(5, min(2000, int(min_time / max((time.perf_counter() - t0) / 3, 1e-6))))])
            dist.broadcast(iters, src=0)
            dist.barrier()
            ts = []
            for _ in range(int(iters)):
                t0 = time.perf_counter()
                dist.all_to_all_single(outp, inp)
                ts.append(time.perf_counter() - t0)
            # the fastest call of the slower rank: the link's rate, not other processes' interference
            med = torch.tensor([min(ts)])
            dist.all_reduce(med, op=dist.ReduceOp.MAX)
            rows.append({"bytes_per_rank": n * 4, "bytes_to_others": n * 4 * (world - 1) / world,
                         "seconds": float(med)})
        if rank == 0:
            Path(out_path).write_text(json.dumps(rows))
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def bench_all_to_all(procs: int, sizes: list[int], min_time: float, threads: int) -> dict[str, Any]:
    """Spawn ``procs`` gloo processes, time all_to_all_single, fit latency + bandwidth."""
    import torch.multiprocessing as mp

    with tempfile.TemporaryDirectory() as d:
        out = os.path.join(d, "a2a.json")
        mp.spawn(_a2a_worker, args=(procs, _free_port(), sizes, min_time, threads, out), nprocs=procs, join=True)
        rows = json.loads(Path(out).read_text())
    xs = [r["bytes_to_others"] for r in rows]
    ys = [r["seconds"] for r in rows]
    # least squares t = a + x / bw
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    lat = max(my - slope * mx, min(ys))
    lat = min(lat, min(ys))
    bw = 1 / slope if slope > 0 else xs[-1] / ys[-1]
    return {"procs": procs, "latency_us": lat * 1e6, "bandwidth_gbps": bw / 1e9, "points": rows}


def _mem_gb() -> float:
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) / (1 << 20)
    except OSError:
        pass
    return 16.0


def run_bench(out: str | os.PathLike | None = None, procs: int = 2, quick: bool = False,
              threads: int | None = None, verbose: bool = True) -> dict[str, Any]:
    """Measure this machine; write and return the results.

    Args:
        out: JSON path (default ``.cache/moetrain/bench.json``); None writes the default.
        procs: local processes of the all-to-all test (and of the training run to predict).
        quick: fewer sizes and shorter timing (a few seconds; for tests).
        threads: threads per process (default: cores // procs, as ``moetrain train`` sets them).
    """
    cores = os.cpu_count() or 1
    threads = threads or max(1, cores // procs)
    prev = torch.get_num_threads()
    torch.set_num_threads(threads)
    mt = 0.05 if quick else 0.25

    def log(msg: str) -> None:
        if verbose:
            print(msg, flush=True)

    try:
        sizes = [64, 256, 1024] if quick else [32, 64, 128, 256, 512, 1024, 2048]
        log(f"matmul fp32 ({threads} thread(s)) at n = {sizes} ...")
        fp32 = bench_matmul(sizes, torch.float32, mt)
        ref = min(sizes, key=lambda n: abs(n - 512))
        bf16 = bench_matmul([ref], torch.bfloat16, mt)
        if bf16[0]["tflops"] > 0.5 * next(r["tflops"] for r in fp32 if r["n"] == ref):
            bf16 = bench_matmul(sizes, torch.bfloat16, mt)
        log("memory bandwidth ...")
        mem = bench_memory((64 if quick else 256) << 20, mt)
        log("operator overhead ...")
        eager_us, ag_us = bench_op_overhead(mt)
    finally:
        torch.set_num_threads(prev)
    a2a_sizes = [4 << 10, 256 << 10, 4 << 20] if quick else [1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20, 16 << 20]
    log(f"all-to-all between {procs} gloo processes ...")
    a2a = bench_all_to_all(procs, a2a_sizes, mt, threads)
    res = {
        "host": platform.node(), "machine": platform.machine(), "processor": platform.processor(),
        "torch": torch.__version__, "cores": cores, "procs": procs, "threads_per_proc": threads,
        "memory_gb": _mem_gb(),
        "matmul": {"fp32": fp32, "bf16": bf16},
        "memory_bandwidth_gbps": mem,
        "op_overhead_us": ag_us, "op_overhead_eager_us": eager_us,
        "all_to_all": a2a,
        "time": time.strftime("%Y-%m-%d %H:%M:%S"),
    }
    path = Path(out) if out else DEFAULT_BENCH_PATH
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(res, indent=2))
    res["path"] = str(path)
    return res


def summary(res: dict[str, Any]) -> str:
    fp32 = res["matmul"]["fp32"]
    lines = [f"moetrain bench: {res['cores']} cores, {res['procs']} processes x {res['threads_per_proc']} thread(s), "
             f"torch {res['torch']}"]
    lines.append("  matmul fp32 TFLOP/s: " + ", ".join(f"n={r['n']}: {r['tflops']:.3f}" for r in fp32))
    lines.append("  matmul bf16 TFLOP/s: " + ", ".join(f"n={r['n']}: {r['tflops']:.3f}" for r in res["matmul"]["bf16"]))
    lines.append(f"  memory copy: {res['memory_bandwidth_gbps']:.1f} GB/s")
    lines.append(f"  per-op overhead: {res['op_overhead_us']:.1f} us (autograd), {res['op_overhead_eager_us']:.1f} us "
                 "(eager)")
    a = res["all_to_all"]
    lines.append(f"  all-to-all ({a['procs']} gloo processes): {a['bandwidth_gbps']:.2f} GB/s, latency "
                 f"{a['latency_us']:.0f} us")
    if "path" in res:
        lines.append(f"  written to {res['path']}")
    return "\n".join(lines)
