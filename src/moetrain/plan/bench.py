"""``moetrain bench``: measure this machine so the performance model can predict a local ``moetrain train`` run.

Everything is measured the way a training run meets it: in ``procs`` processes at once (each with the threads one
training worker gets, ``cores // procs``), so the processes share caches, memory bandwidth and cores as they do in
training, and collectives are timed in lock-step with compute between calls, so each call pays the skew between
processes and the gloo threads' contention with the compute threads (an idle ping-pong loop is 3-10x faster than
the same call inside a training step on a 2-core machine).

* matmul TFLOP/s of an n x n x n fp32 matmul at several n (and bf16 at one size; the curve too if it is fast),
  the median sample while the other processes run the same measurement;
* memory bandwidth of a large tensor copy (bytes read + written per second);
* per-operator overhead: the time of a tiny autograd op (forward + its backward), i.e. what eager PyTorch costs per
  kernel when the tensors are too small to matter;
* cross-entropy: logits per second through ``F.cross_entropy`` forward + backward (its exponentials and logs, not
  memory, bound it on a CPU);
* all-to-all (``dist.all_to_all_single``) at several message sizes, each call after a ~2 ms compute burst, mean
  time of the slower process, fitted as ``time = latency + bytes_sent_to_others / bandwidth``; the same fit of an
  idle loop (no compute between calls) is kept for reference;
* FSDP2: one ``fully_shard`` unit's forward + backward (parameter all-gather in forward and again in backward,
  gradient reduce-scatter, hooks and copies) measured as the difference between a sharded and an unsharded stack
  of linear layers run in lock-step, at two unit sizes, fitted as ``latency + unit_parameter_bytes / bandwidth``.

The results go to a JSON file (default ``.cache/moetrain/bench.json``) that :func:`moetrain.plan.hardware.gpu_from_bench`
turns into a "local" GPUSpec.
"""

from __future__ import annotations

import copy
import gc
import json
import os
import platform
import socket
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any, Callable

import torch

from moetrain.plan.hardware import BENCH_VERSION, DEFAULT_BENCH_PATH

#: Compute between two timed collectives in the lock-step loops (seconds): a training step issues a collective
#: every few milliseconds (per layer: dispatch, combine, FSDP all-gathers).
LOCKSTEP_BURST_S = 2e-3


def _timeit(fn: Callable[[], Any], min_time: float, min_iters: int = 3, stat: str = "min") -> float:
    """Seconds per call of ``fn`` over calls lasting at least ``min_time`` in all: the fastest sample
    (``stat="min"``) or the median (``"median"``: the sustained rate while other processes run too)."""
    fn()  # warm-up
    samples: list[float] = []
    t_end = time.perf_counter() + min_time
    while len(samples) < min_iters or time.perf_counter() < t_end:
        t0 = time.perf_counter()
        fn()
        samples.append(time.perf_counter() - t0)
        if len(samples) > 10_000:
            break
    return min(samples) if stat == "min" else statistics.median(samples)


def bench_matmul(sizes: list[int], dtype: torch.dtype, min_time: float, stat: str = "min") -> list[dict[str, float]]:
    out = []
    for n in sizes:
        a = torch.randn(n, n).to(dtype)
        b = torch.randn(n, n).to(dtype)
        t = _timeit(lambda: torch.mm(a, b), min_time, stat=stat)
        out.append({"n": n, "seconds": t, "tflops": 2 * n ** 3 / t / 1e12})
    return out


def bench_memory(nbytes: int, min_time: float, stat: str = "min") -> float:
    """GB/s of a large copy (read + write)."""
    x = torch.empty(nbytes // 4, dtype=torch.float32).uniform_()
    y = torch.empty_like(x)
    t = _timeit(lambda: y.copy_(x), min_time, stat=stat)
    return 2 * nbytes / t / 1e9


def bench_op_overhead(min_time: float, stat: str = "min") -> tuple[float, float]:
    """(eager µs per tiny op, autograd µs per tiny op counting its backward as one more op)."""
    x = torch.ones(16)
    n = 200

    def eager() -> None:
        y = x
        for _ in range(n):
            y = y + 1.0

    t_eager = _timeit(eager, min_time, stat=stat) / n
    w = torch.ones(16, requires_grad=True)

    def autograd() -> None:
        y = w
        for _ in range(n):
            y = y * 1.0001
        y.sum().backward()

    t_ag = _timeit(autograd, min_time, stat=stat) / (2 * n)
    return t_eager * 1e6, t_ag * 1e6


def bench_cross_entropy(min_time: float, stat: str = "min", rows: int = 512, vocab: int = 4096) -> float:
    """1e9 logits per second through cross-entropy forward + backward (log-softmax, NLL, their gradients)."""
    import torch.nn.functional as F

    logits = torch.randn(rows, vocab, requires_grad=True)
    target = torch.randint(0, vocab, (rows,))

    def run() -> None:
        F.cross_entropy(logits, target).backward()
        logits.grad = None

    return rows * vocab / _timeit(run, min_time, stat=stat) / 1e9


def fit_latency_bandwidth(xs: list[float], ys: list[float]) -> tuple[float, float]:
    """Least-squares ``y = latency + x / bandwidth`` (seconds, bytes/s); latency is kept within [0, min(ys)] and a
    non-positive slope falls back to the largest point's average rate."""
    mx, my = sum(xs) / len(xs), sum(ys) / len(ys)
    sxx = sum((x - mx) ** 2 for x in xs)
    slope = sum((x - mx) * (y - my) for x, y in zip(xs, ys)) / sxx if sxx else 0.0
    if slope <= 0:
        i = max(range(len(xs)), key=lambda j: xs[j])
        return min(ys), xs[i] / ys[i]
    lat = min(max(my - slope * mx, 0.0), min(ys))
    return lat, 1 / slope


def _fit_rows(rows: list[dict[str, float]], x_key: str) -> dict[str, Any]:
    lat, bw = fit_latency_bandwidth([r[x_key] for r in rows], [r["seconds"] for r in rows])
    return {"latency_us": lat * 1e6, "bandwidth_gbps": bw / 1e9, "points": rows}


class _Burst:
    """A fixed amount of matmul work lasting about :data:`LOCKSTEP_BURST_S` on this process (calibrated once)."""

    def __init__(self) -> None:
        self.a = torch.randn(128, 128)
        t = _timeit(lambda: torch.mm(self.a, self.a), 0.02)
        self.reps = max(1, int(LOCKSTEP_BURST_S / max(t, 1e-7)))

    def __call__(self) -> None:
        for _ in range(self.reps):
            torch.mm(self.a, self.a)


def _lockstep_mean(op: Callable[[], Any], burst: Callable[[], None] | None, iters: int) -> float:
    """Mean seconds of ``op`` over ``iters`` calls, each after ``burst`` (none: back to back), on the slower rank
    (in a training step the slower rank sets the pace)."""
    import torch.distributed as dist

    for _ in range(3):
        op()
    dist.barrier()
    total = 0.0
    for _ in range(iters):
        if burst is not None:
            burst()
        t0 = time.perf_counter()
        op()
        total += time.perf_counter() - t0
    t = torch.tensor([total / iters])
    dist.all_reduce(t, op=dist.ReduceOp.MAX)
    return float(t)


def _fsdp_unit_rows(world: int, dims: list[int], iters: int) -> list[dict[str, float]]:
    """Seconds one FSDP2 unit adds to a forward + backward (all-gathers, reduce-scatter, hooks, copies): a stack of
    ``units`` square linear layers, each ``fully_shard``-ed over all processes, minus the same stack unsharded, both
    run in lock-step on every process."""
    from torch import nn
    from torch.distributed.device_mesh import init_device_mesh
    from torch.distributed.fsdp import fully_shard

    mesh = init_device_mesh("cpu", (world,))
    units, rows_out = 6, []
    for d in dims:
        torch.manual_seed(0)
        plain = nn.Sequential(*[nn.Linear(d, d, bias=False) for _ in range(units)])
        sharded = copy.deepcopy(plain)
        for layer in sharded:
            fully_shard(layer, mesh=mesh)
        fully_shard(sharded, mesh=mesh)
        x = torch.randn(64, d)

        def fwd_bwd(model: nn.Module) -> Callable[[], None]:
            def run() -> None:
                model(x).sum().backward()
                for p in model.parameters():
                    p.grad = None
            return run

        t_plain = _lockstep_mean(fwd_bwd(plain), None, iters)
        t_sharded = _lockstep_mean(fwd_bwd(sharded), None, iters)
        rows_out.append({"unit_param_bytes": float(d * d * 4), "seconds": max(t_sharded - t_plain, 1e-7) / units,
                         "plain_s": t_plain, "sharded_s": t_sharded, "units": units})
    return rows_out


def _all_gather(out: torch.Tensor, shard: torch.Tensor) -> None:
    import torch.distributed as dist

    # the single-tensor collectives FSDP2 uses (renamed *_single in recent PyTorch; the old names warn)
    (getattr(dist, "all_gather_single", None) or dist.all_gather_into_tensor)(out, shard)


def _reduce_scatter(out: torch.Tensor, full: torch.Tensor) -> None:
    import torch.distributed as dist

    (getattr(dist, "reduce_scatter_single", None) or dist.reduce_scatter_tensor)(out, full)


def _worker(rank: int, world: int, port: int, opts: dict[str, Any], out_path: str) -> None:
    import torch.distributed as dist

    torch.set_num_threads(opts["threads"])
    os.environ["MASTER_ADDR"] = "127.0.0.1"
    os.environ["MASTER_PORT"] = str(port)
    dist.init_process_group("gloo", rank=rank, world_size=world)
    log = print if (rank == 0 and opts["verbose"]) else (lambda *a, **k: None)
    try:
        mt = opts["min_time"]
        res: dict[str, Any] = {}
        # 1. compute, measured by every process at once (a training run keeps all of them busy)
        dist.barrier()
        log(f"matmul fp32 ({opts['threads']} thread(s) x {world} processes) at n = {opts['sizes']} ...", flush=True)
        fp32 = bench_matmul(opts["sizes"], torch.float32, mt, stat="median")
        ref = min(opts["sizes"], key=lambda n: abs(n - 512))
        bf16 = bench_matmul([ref], torch.bfloat16, mt, stat="median")
        if bf16[0]["tflops"] > 0.5 * next(r["tflops"] for r in fp32 if r["n"] == ref):
            bf16 = bench_matmul(opts["sizes"], torch.bfloat16, mt, stat="median")
        dist.barrier()
        log("memory bandwidth, operator overhead ...", flush=True)
        res["matmul"] = {"fp32": fp32, "bf16": bf16}
        res["memory_bandwidth_gbps"] = bench_memory(opts["mem_bytes"], mt, stat="median")
        res["op_overhead_eager_us"], res["op_overhead_us"] = bench_op_overhead(mt, stat="median")
        res["cross_entropy_gelem_s"] = bench_cross_entropy(mt, stat="median")
        # 2. collectives, in lock-step with compute between calls (as in a training step) and, for reference, idle
        log(f"collectives between {world} gloo processes ...", flush=True)
        burst = _Burst()
        iters = opts["iters"]
        rows: dict[str, list[dict[str, float]]] = {k: [] for k in
                                                   ("all_to_all", "all_to_all_idle", "all_gather", "reduce_scatter")}
        for nbytes in opts["coll_sizes"]:
            n = max(world, nbytes // 4 // world * world)
            inp, outp = torch.randn(n), torch.empty(n)
            shard = torch.randn(n // world)
            # (table, the call, compute between calls, name of the size field)
            cases = (("all_to_all", lambda: dist.all_to_all_single(outp, inp), burst, "bytes_per_rank"),
                     ("all_to_all_idle", lambda: dist.all_to_all_single(outp, inp), None, "bytes_per_rank"),
                     ("all_gather", lambda: _all_gather(outp, shard), burst, "bytes_gathered"),
                     ("reduce_scatter", lambda: _reduce_scatter(shard, inp), burst, "bytes_reduced"))
            for key, op, between, size_key in cases:
                rows[key].append({size_key: n * 4, "bytes_to_others": n * 4 * (world - 1) / world,
                                  "seconds": _lockstep_mean(op, between, iters)})
        for key, pts in rows.items():
            res[key] = {"procs": world, **_fit_rows(pts, "bytes_to_others")}
        # 3. one FSDP2 unit (what moetrain train wraps every block in)
        log("FSDP2 unit ...", flush=True)
        res["fsdp_unit"] = _fit_rows(_fsdp_unit_rows(world, opts["fsdp_dims"], iters), "unit_param_bytes")
        if rank == 0:
            Path(out_path).write_text(json.dumps(res))
        # FSDP2's module state is cyclic: collect it (and the gloo work it holds) while the process group is alive,
        # not during interpreter shutdown, where freeing it aborted the process in ~5% of runs; and no process may
        # tear gloo down while its peer still has a collective in flight
        gc.collect()
        dist.barrier()
    finally:
        dist.destroy_process_group()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


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
    """Measure this machine with ``procs`` processes at once; write and return the results.

    Args:
        out: JSON path (default ``.cache/moetrain/bench.json``); None writes the default.
        procs: local processes (those of the training run to predict); at least 2.
        quick: fewer sizes and shorter timing (a few seconds; for tests).
        threads: threads per process (default: cores // procs, as ``moetrain train`` sets them).

    Raises:
        ValueError: procs < 2 (collectives need two processes).
    """
    import torch.multiprocessing as mp

    if procs < 2:
        raise ValueError(f"procs={procs}: the bench times collectives between processes; use procs >= 2")
    cores = os.cpu_count() or 1
    threads = threads or max(1, cores // procs)
    opts = {
        "threads": threads, "verbose": verbose, "min_time": 0.05 if quick else 0.25,
        "sizes": [64, 256, 1024] if quick else [32, 64, 128, 256, 512, 1024, 2048],
        "mem_bytes": (64 if quick else 256) << 20,
        "coll_sizes": [4 << 10, 256 << 10, 4 << 20] if quick else [1 << 10, 16 << 10, 256 << 10, 1 << 20, 4 << 20],
        "iters": 10 if quick else 40,
        "fsdp_dims": [64, 512],
    }
    with tempfile.TemporaryDirectory() as d:
        tmp = os.path.join(d, "bench.json")
        mp.spawn(_worker, args=(procs, _free_port(), opts, tmp), nprocs=procs, join=True)
        measured = json.loads(Path(tmp).read_text())
    res = {
        "bench_version": BENCH_VERSION,
        "host": platform.node(), "machine": platform.machine(), "processor": platform.processor(),
        "torch": torch.__version__, "cores": cores, "procs": procs, "threads_per_proc": threads,
        "memory_gb": _mem_gb(), **measured,
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
    if "cross_entropy_gelem_s" in res:
        lines.append(f"  cross-entropy forward + backward: {res['cross_entropy_gelem_s']:.2f} G logits/s")
    for key, label in (("all_to_all", "all-to-all, in a compute loop"), ("all_to_all_idle", "all-to-all, idle loop"),
                       ("all_gather", "all-gather, in a compute loop"),
                       ("reduce_scatter", "reduce-scatter, in a compute loop")):
        if key in res:
            a = res[key]
            lines.append(f"  {label} ({res['procs']} gloo processes): latency {a['latency_us']:.0f} us + "
                         f"{a['bandwidth_gbps']:.2f} GB/s")
    if "fsdp_unit" in res:
        f = res["fsdp_unit"]
        lines.append(f"  FSDP2 unit (forward + backward): {f['latency_us']:.0f} us + parameter bytes at "
                     f"{f['bandwidth_gbps']:.2f} GB/s")
    if "path" in res:
        lines.append(f"  written to {res['path']}")
    return "\n".join(lines)
