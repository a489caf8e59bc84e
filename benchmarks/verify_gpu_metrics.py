"""Check on one GPU what the CPU suite cannot: device-time all-to-all timers, the hang monitor while the host is
blocked in a CUDA read, the host synchronisations left in a training step, and ``moetrain train --nproc 1`` with the
all-to-all dispatcher on NCCL (plus the one-line refusal of ``--nproc 2``).

    PYTHONUNBUFFERED=1 PYTHONPATH=src timeout 170 python3 benchmarks/verify_gpu_metrics.py [--full] [--cpu]

``--full`` adds a resume, ``parallel.ep_overlap`` and FP8 dispatch runs (about a minute more); ``--cpu`` runs the
parts a CPU can (gloo) to check this script. Prints one line per check ("ok" / "FAIL") and exits 1 if any failed.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import torch

FAILED: list[str] = []


def report(name: str, ok: bool, detail: str) -> None:
    print(f"{'ok  ' if ok else 'FAIL'} {name}: {detail}", flush=True)
    if not ok:
        FAILED.append(name)


def check_event_timer(dev: torch.device) -> None:
    """World-1 all-to-all through moetrain's issue/Pending: device time > 0 and read only at settle(); exposed is
    nearly all of it when waited at once, little of it behind ~30 ms of matmuls. A ~5 ms GPU sleep is queued first,
    so the host has queued the issue and the wait before the device reaches them (host launch time out of the
    picture). The host-clock time of the call is shown for contrast (NCCL returns at enqueue)."""
    import torch.distributed as dist

    from moetrain.model.moe import DispatchStats
    from moetrain.parallel.comm import issue

    gpu = dev.type == "cuda"
    x = torch.randn((64 if gpu else 1) << 20, device=dev, dtype=torch.bfloat16)  # 128 MiB on a GPU
    out = torch.empty_like(x)
    a = torch.randn(8192 if gpu else 1024, 8192 if gpu else 1024, device=dev, dtype=torch.bfloat16)
    for hide in (False, True):
        stats = DispatchStats(layer=0)
        torch.cuda.synchronize() if gpu else None
        if gpu:
            torch.cuda._sleep(int(1e7))  # ~5 ms at the H200's clock
        t0 = time.perf_counter()
        p = issue(lambda: dist.all_to_all_single(out, x, async_op=True), "dispatch", stats, dev, keep=(x, out))
        host_ms = 1e3 * (time.perf_counter() - t0)
        if hide:
            for _ in range(20):
                a = (a @ a).clamp_(-1, 1)
        p.wait()
        deferred = len(stats.unsettled)
        torch.cuda.synchronize() if gpu else None
        stats.settle()
        total, exposed = 1e3 * stats.a2a_seconds, 1e3 * stats.exposed_seconds
        ok = torch.equal(out, x) and total > 0 and (not gpu or deferred == 1)
        # (gloo at world 1 copies inside the issue call, which counts as exposed: nothing to hide on a CPU)
        ok = ok and (not gpu or (exposed < 0.5 * total if hide else exposed > 0.9 * total))
        report(f"event timer, {'behind matmuls' if hide else 'waited at once'}", ok,
               f"a2a {total:.3f} ms ({2 * x.nbytes / total / 1e6:.0f} GB/s read+write), exposed {exposed:.3f} ms, "
               f"host time of the issue {host_ms:.3f} ms, deferred readings {deferred}")


def check_monitor(dev: torch.device) -> None:
    """The monitor thread reports while the main thread is blocked in a CUDA read (needs the GIL released there)."""
    from moetrain.parallel.hang import HangMonitor, in_phase

    import io
    buf = io.StringIO()
    t = torch.ones(1, device=dev)
    with HangMonitor(0, report_after_s=0.5, timeout_s=1.0, out=buf, poll_s=0.05) as m:
        with in_phase("probe: host blocked in tolist()"):
            t0 = time.perf_counter()
            if dev.type == "cuda":
                torch.cuda._sleep(int(3e9))  # ~1.5-2 s of GPU clock cycles
            else:
                time.sleep(1.5)
            t.tolist()
            blocked = time.perf_counter() - t0
    stuck = [r for r in m.reports if "stuck in probe" in r]
    report("hang monitor during a blocked read", len(stuck) == 1 and blocked > 0.7,
           f"blocked {blocked:.2f} s; report: {stuck[0][:90] if stuck else None}")


def check_step_syncs(ctx, dev: torch.device) -> None:
    """Host synchronisations of one training step (tiny preset, all-to-all dispatcher, 2 micro-batches), counted by
    torch's sync debug mode, by source line. Expected: the normaliser read, one split-size read per MoE layer and
    micro-batch (forward; and again in activation recomputation, off here), the end-of-step reads."""
    from moetrain.model.config import tiny
    from moetrain.model.transformer import build_model
    from moetrain.parallel.parallelize import parallelize
    from moetrain.parallel.pipeline import build_stages
    from moetrain.train.optim import build_optimizer
    from moetrain.train.runners import single_stage_parts
    from moetrain.train.step import train_step

    cfg = tiny().replace(vocab_size=512, max_seq_len=128)
    stage = build_stages(build_model(cfg, device=dev, seed=0), ctx.pcfg, 0)[0]  # the trainer's one stage at PP = 1
    bf16 = torch.bfloat16 if dev.type == "cuda" else None
    parallelize(stage, ctx, param_dtype=bf16)
    opt = build_optimizer(stage, lr=1e-3)
    parts = single_stage_parts(stage, ctx)
    g = torch.Generator().manual_seed(0)
    mbs = [(lambda t: (t[:, :-1].to(dev), t[:, 1:].to(dev)))(torch.randint(0, 512, (4, 65), generator=g))
           for _ in range(2)]
    train_step(parts, opt, mbs, cfg, ctx, autocast_dtype=bf16)  # warm-up
    if dev.type != "cuda":
        report("host syncs per step", True, "skipped on CPU")
        return
    torch.cuda.synchronize()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        torch.cuda.set_sync_debug_mode("warn")
        try:
            r = train_step(parts, opt, mbs, cfg, ctx, autocast_dtype=bf16)
        finally:
            torch.cuda.set_sync_debug_mode("default")
    sites = Counter(f"{Path(w.filename).name}:{w.lineno}" for w in caught if "synchroniz" in str(w.message))
    n_moe = len(stage.moe_layers())
    report("host syncs per step", sum(sites.values()) <= 2 * n_moe + 6,
           f"{sum(sites.values())} for {n_moe} MoE layers x 2 micro-batches, loss {r.loss:.3f}: {dict(sites)}")
    for m in stage.moe_layers():
        m.dispatcher.stats.reset_timers()


def train(out: Path, env: dict, *extra: str, timeout: float = 240) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moetrain", "train", "--out", str(out), "--nproc", "1",
           "--set", 'parallel.dispatcher="alltoall"', "--set", "data.builtin_max_bytes=1000000",
           "--set", "data.vocab_size=512", "--set", "model.vocab_size=512", "--set", "data.seq_len=64",
           "--set", "train.micro_batch_size=8", "--set", "train.log_every=1", "--set", "train.eval_batches=2",
           "--set", "train.tensorboard=false", "--set", "train.warmup_steps=2", *extra]
    return subprocess.run(cmd, capture_output=True, text=True, timeout=timeout, env=env)


def records(out: Path, kind: str) -> list[dict]:
    p = out / "metrics.jsonl"
    rows = [json.loads(line) for line in p.read_text().splitlines() if line.strip()] if p.is_file() else []
    return [r for r in rows if r.get("kind") == kind]


def check_train(tmp: Path, env: dict, full: bool, device: str) -> None:
    cache = tmp / "cache"
    dev = ["--set", f'train.device="{device}"', "--set", f'data.cache_dir="{cache}"']
    out = tmp / "run"
    t0 = time.perf_counter()
    p = train(out, env, "--steps", "10", "--set", "train.ckpt_every=5", "--set", "train.eval_every=5", *dev)
    rec = records(out, "train")
    a2a = [1e3 * r["a2a_s_per_step"] for r in rec]
    exp = [100 * r["a2a_exposed_share"] for r in rec]
    ok = p.returncode == 0 and len(rec) == 10 and all(v > 0 for v in a2a)
    report("train --nproc 1 alltoall, 10 steps", ok,
           f"rc {p.returncode} in {time.perf_counter() - t0:.0f} s; a2a ms/step {[round(v, 3) for v in a2a]}; "
           f"exposed % {[round(v) for v in exp]}; mfu {[round(100 * r['mfu'], 2) for r in rec][-3:]}; "
           f"ckpt {sorted(x.name for x in (out / 'checkpoints').glob('step_*'))}"
           + ("" if p.returncode == 0 else f"\n{p.stdout[-1500:]}\n{p.stderr[-1500:]}"))
    if device == "cuda" and torch.cuda.device_count() == 1:
        p = train(tmp / "two", env, "--steps", "2", "--nproc", "2", *dev)
        err = [line for line in p.stderr.splitlines() if line.strip()]
        report("--nproc 2 on one GPU", p.returncode == 2 and len(err) == 1 and "--nproc 1" in err[0],
               f"rc {p.returncode}: {err[-1] if err else ''}")
    if not full:
        return
    before = {r["step"]: r["loss"] for r in rec}
    shutil.rmtree(out / "checkpoints" / "step_00000010", ignore_errors=True)
    p = train(out, env, "--steps", "10", "--set", "train.ckpt_every=5", "--set", "train.eval_every=5", "--resume",
              *dev)
    after = {r["step"]: r["loss"] for r in records(out, "train")}
    gap = max(abs(after[s] - before[s]) for s in range(6, 11)) if p.returncode == 0 else float("nan")
    report("resume from step 5", p.returncode == 0 and gap < 1e-2,
           f"rc {p.returncode}; largest loss difference over steps 6-10 {gap:.2e}"
           + ("" if p.returncode == 0 else f"\n{p.stderr[-1500:]}"))
    for name, extra in (("ep_overlap", ("--set", "parallel.ep_overlap=true")),
                        ("fp8 dispatch", ("--set", 'parallel.dispatch_dtype="fp8"'))):
        o = tmp / name.replace(" ", "_")
        p = train(o, env, "--steps", "4", "--set", "train.grad_accum=2", "--set", "train.eval_every=0", *extra, *dev)
        rec = records(o, "train")
        report(f"train --nproc 1 alltoall, {name}", p.returncode == 0 and len(rec) == 4,
               f"rc {p.returncode}; a2a ms/step {[round(1e3 * r['a2a_s_per_step'], 3) for r in rec]}; loss "
               f"{[round(r['loss'], 3) for r in rec]}" + ("" if p.returncode == 0 else f"\n{p.stderr[-1500:]}"))


def main() -> int:
    ap = argparse.ArgumentParser()
    ap.add_argument("--full", action="store_true")
    ap.add_argument("--cpu", action="store_true")
    args = ap.parse_args()
    device = "cpu" if args.cpu else "cuda"
    if device == "cuda" and not torch.cuda.is_available():
        print("no CUDA device; use --cpu")
        return 2
    from torch.cuda import nccl
    print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, NCCL "
          f"{'.'.join(map(str, nccl.version())) if device == 'cuda' else '-'}, "
          f"{torch.cuda.get_device_name(0) if device == 'cuda' else 'cpu'}", flush=True)
    tmp = Path(tempfile.mkdtemp(prefix="verify-metrics-"))
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(p for p in ("src", os.environ.get("PYTHONPATH")) if p))
    # Part A: in this process, a world-1 process group on NCCL (gloo with --cpu), as moetrain train builds it.
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(29400 + os.getpid() % 1000))
    from moetrain.parallel.config import ParallelConfig
    from moetrain.parallel.mesh import init_parallel, shutdown
    ctx = init_parallel(ParallelConfig(dispatcher="alltoall"), 16, device)
    report("init_parallel world 1", ctx.distributed and ctx.device.index == (0 if device == "cuda" else None),
           f"device {ctx.device}, backend {torch.distributed.get_backend()}")
    dev = ctx.device
    for name, check in (("event timer", lambda: check_event_timer(dev)), ("hang monitor", lambda: check_monitor(dev)),
                        ("host syncs per step", lambda: check_step_syncs(ctx, dev))):
        try:
            check()
        except Exception as e:  # noqa: BLE001 - each check reports on its own
            report(name, False, f"{type(e).__name__}: {e}")
    shutdown()
    for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK", "LOCAL_WORLD_SIZE"):
        os.environ.pop(k)
    # Part B: the real launcher.
    check_train(tmp, env, args.full, device)
    print(f"{'all ok' if not FAILED else 'FAILED: ' + ', '.join(FAILED)}; files in {tmp}", flush=True)
    return 1 if FAILED else 0


if __name__ == "__main__":
    sys.exit(main())
