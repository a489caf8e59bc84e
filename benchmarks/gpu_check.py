"""The prepared GPU check: ``python3 benchmarks/gpu_check.py [--quick] [--json PATH]`` (one NVIDIA GPU, < 8 min).

Runs on a GPU image as it comes (its own python3 and torch, nothing installed: the repository's ``src`` is put on
the path). Each check runs in a child process of its own, with a time limit, and its rows are printed the moment it
finishes and written to the JSON file (rewritten after every check, so a crash or a kill keeps what came before).
A check that fails or times out gives an ERROR / TIMEOUT row with the end of its output; the others still run.

Checks (``--only NAME[,NAME]`` runs a subset; ``--list`` prints these, one a line):

* ``env``: torch, CUDA, NCCL, GPU, Python.
* ``trainer``: ``moetrain train`` itself on one process over NCCL (gloo on CPU): EP 1 with the all-to-all
  dispatcher for 30 steps and a checkpoint, a resume for 10 more, then ``parallel.ep_overlap`` and FP8 dispatch
  for 10 steps each, from the metrics each run writes.
* ``mfu``: bf16 training-step MFU of the trainer's own path (meta build, FSDP2 with bf16 parameters, fused AdamW,
  ``train_step``) at world 1 for the tiny and small presets and the benchmarks' ``gpu-1x`` model, sized for one
  141 GB GPU (``benchmarks/peers.py``: DeepSeek-V3's architecture, 3.9 B parameters), each in a process of its own.
* ``grouped_gemm``: ``torch._grouped_mm`` (bf16) at DeepSeek-V3's expert shapes against one dense matmul of the same
  FLOPs.
* ``fp8_gemm``: the FP8 linear's fprop, dgrad and wgrad GEMMs (blockwise recipe) at DeepSeek-V3 shapes: rate
  against bf16 and error against the reference within Hopper's accumulation bound.
* ``fp8_experts``: the routed experts' FP8 grouped GEMMs against bf16 at DeepSeek-V3's shapes.
* ``layers``: one DeepSeek-V3 MoE layer (hidden 7168, 8 local experts of the 256, top-8, so each expert gets every
  token: the load of an EP-32 rank under balanced routing) and one dense layer, forward + backward, beside what
  ``moetrain plan --gpu h200`` predicts for the same layer.
* ``attention``: MLA's attention core at DeepSeek-V3's shapes, forward and backward time, and the kernel SDPA picks.
* ``metrics``: on a world-1 process group, the all-to-all timer from CUDA events (waited at once and hidden behind
  matmuls), the hang monitor while the host is blocked in a device read, and the host synchronisations left in one
  training step (``benchmarks/verify_gpu_metrics.py``).
* ``loss_gap``: FP8 (both recipes) against bf16, loss of the tiny model after ``--steps`` steps.

Without a GPU every check runs at a small size on CPU (``--quick`` is implied) or says why it is skipped, so the
test suite runs this script (tests/benchmarks/test_gpu_check.py). Exit status 1 when a check failed (ERROR,
TIMEOUT, or a fast path outside its bound).
"""

from __future__ import annotations

import argparse
import json
import os
import queue
import shutil
import signal
import socket
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from typing import Any, Callable, Iterator

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src"
sys.path.insert(0, str(SRC))

Row = dict[str, Any]

#: Seconds each check may take on a GPU: limits for a check that hangs, not what a healthy run takes (``--budget-s``
#: bounds the whole run).
GPU_LIMIT_S = {"env": 60, "trainer": 240, "mfu": 240, "grouped_gemm": 45, "fp8_gemm": 120, "fp8_experts": 120,
               "layers": 90, "attention": 45, "metrics": 60, "loss_gap": 180}
#: Default ``--budget-s`` on a GPU: the run stops starting checks after this, to stay within 8 minutes.
GPU_BUDGET_S = 470.0
#: No check is started with less of ``--budget-s`` left (nor a smaller budget accepted).
BUDGET_MIN_S = 15.0
#: On CPU (the test suite, two shared cores).
CPU_LIMIT_S = 240
#: One ``moetrain train`` run of the trainer check (start-up, data preparation, steps, checkpoint).
TRAIN_STAGE_LIMIT_S = 90
#: The line prefix a check's process prints each row with (JSON after it), for the parent to collect.
ROW_MARK = "@@gpu-check-row "
#: The line prefix of a file a check's subprocess writes its output to (the parent quotes its end on a timeout).
LOG_MARK = "@@gpu-check-log "


# ----------------------------------------------------------------------------------------------------------------
# helpers shared by the checks (child process)
# ----------------------------------------------------------------------------------------------------------------

def _device():
    import torch
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


def _sync(dev) -> None:
    import torch
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)


def _time(fn: Callable[[], Any], dev, iters: int, warmup: int = 1) -> float:
    """Median wall seconds of ``fn`` over ``iters`` calls after ``warmup`` calls, synchronised around each call."""
    for _ in range(warmup):
        fn()
    _sync(dev)
    ts = []
    for _ in range(iters):
        t = time.perf_counter()
        fn()
        _sync(dev)
        ts.append(time.perf_counter() - t)
    return statistics.median(ts)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _world_one_env() -> None:
    """The environment torchrun gives a single worker, so the trainer's code initialises a real process group."""
    os.environ.update(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", LOCAL_WORLD_SIZE="1", MASTER_ADDR="127.0.0.1",
                      MASTER_PORT=str(_free_port()))


def _skip(check: str, why: str) -> Row:
    return {"check": check, "value": "skipped", "detail": why}


# ----------------------------------------------------------------------------------------------------------------
# checks
# ----------------------------------------------------------------------------------------------------------------

def check_env(quick: bool, args: argparse.Namespace) -> Iterator[Row]:
    import platform

    import torch
    import torch.distributed as dist

    yield {"check": "python / torch", "value": torch.__version__,
             "detail": f"Python {platform.python_version()}, CUDA {torch.version.cuda}, "
                       f"NCCL {'.'.join(map(str, torch.cuda.nccl.version())) if torch.cuda.is_available() else '-'}, "
                       f"gloo {dist.is_gloo_available()}, nccl {dist.is_nccl_available()}"}
    if torch.cuda.is_available():
        p = torch.cuda.get_device_properties(0)
        yield ({"check": "GPU", "value": p.name,
                     "detail": f"sm_{p.major}{p.minor}, {p.multi_processor_count} SMs, {p.total_memory / 2**30:.1f} "
                               f"GiB, {torch.cuda.device_count()} visible"})
    else:
        yield (_skip("GPU", "no CUDA device visible"))


def _train_cmd(out: Path, steps: int, quick: bool, extra: list[str]) -> list[str]:
    cmd = [sys.executable, "-m", "moetrain", "train", "--nproc", "1", "--ep", "1", "--steps", str(steps),
           "--out", str(out), "--set", "parallel.dispatcher=alltoall", "--set", "train.eval_every=0",
           "--set", "train.log_every=5", "--set", "train.ckpt_every=0", "--set", "train.tensorboard=false",
           # a resume may extend the run: a constant LR makes that no schedule change
           "--set", "train.schedule=constant"]
    # a smaller built-in corpus: its tokenizer is trained first, and the check is about the trainer, not the data
    cmd += ["--set", f"data.builtin_max_bytes={1_000_000 if quick else 2_000_000}"]
    if quick:
        cmd += ["--set", "train.micro_batch_size=4"]
    return cmd + extra


def _metrics(out: Path) -> list[dict]:
    path = out / "metrics.jsonl"
    return [json.loads(line) for line in path.read_text().splitlines()] if path.is_file() else []


def check_trainer(quick: bool, args: argparse.Namespace) -> Iterator[Row]:
    """``moetrain train`` as a user runs it, one process, NCCL on GPU: each stage a row; a failed stage ends the
    chain (the later ones need its checkpoint) with its output's end in the row. The runs' folder is removed when
    every stage passed, and kept (named in the rows) otherwise."""
    work = Path(tempfile.mkdtemp(prefix="moetrain-gpu-check-"))
    passed = True
    for row in _trainer_stages(quick, work):
        passed &= row["value"] == "ok"
        if row["value"] != "ok":
            row["detail"] += f" (runs kept in {work})"
        yield row
    if passed:
        shutil.rmtree(work, ignore_errors=True)


def _trainer_stages(quick: bool, work: Path) -> Iterator[Row]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(SRC), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep),
           "PYTHONUNBUFFERED": "1"}
    steps = 6 if quick else 30
    more = 2 if quick else 10
    backend = "NCCL" if _device().type == "cuda" else "gloo"
    stages = [
        (f"trainer: {steps} steps, EP 1, all-to-all dispatcher ({backend})", work / "a", steps, []),
        (f"trainer: resume to step {steps + more}", work / "a", steps + more, ["--resume"]),
        (f"trainer: ep_overlap, {more} steps", work / "b", more,
         ["--set", "parallel.ep_overlap=true", "--set", "train.grad_accum=2"]),
        (f"trainer: FP8 dispatch, {more} steps", work / "c", more, ["--set", "parallel.dispatch_dtype=fp8"]),
    ]
    for name, out, n, extra in stages:
        t = time.perf_counter()
        log = work / f"{out.name}-{n}.log"
        print(LOG_MARK + str(log), flush=True)  # the parent quotes its end if this check is killed
        with open(log, "w") as f:
            try:
                proc = subprocess.run(_train_cmd(out, n, quick, extra), cwd=work, env=env, stdout=f,
                                      stderr=subprocess.STDOUT, text=True, timeout=TRAIN_STAGE_LIMIT_S)
            except subprocess.TimeoutExpired:
                proc = None
        output = log.read_text(errors="replace")
        if proc is None:
            yield {"check": name, "value": "TIMEOUT", "detail": f"over {TRAIN_STAGE_LIMIT_S} s: {output[-1500:]}"}
            break
        wall = time.perf_counter() - t
        if proc.returncode != 0:
            tail = output[-1500:]
            yield {"check": name, "value": "ERROR", "detail": f"exit {proc.returncode} after {wall:.0f} s: {tail}"}
            break
        # a resumed run appends to the same metrics file: its own records are those past the resumed step
        ms = [m for m in _metrics(out) if m.get("kind") == "train" and ("--resume" not in extra or m["step"] > steps)]
        last = ms[-1] if ms else {}
        ckpts = sorted(p.name for p in (out / "checkpoints").glob("step_*")) if (out / "checkpoints").is_dir() else []
        resumed = f"resumed from step {steps}" in output
        detail = (f"loss {ms[0]['loss']:.3f} -> {last['loss']:.3f}, " if ms else "no train metrics, ") + (
            f"{last.get('tokens_per_s_per_gpu', 0):,.0f} tok/s, MFU {100 * last.get('mfu', 0):.2f}%, "
            f"a2a {1e3 * last.get('a2a_s_per_step', 0):.2f} ms/step ({100 * last.get('a2a_exposed_share', 0):.0f}% "
            f"exposed), checkpoints {ckpts}, {wall:.0f} s wall")
        ok = bool(ms) and ckpts and (resumed or "--resume" not in extra)
        yield {"check": name, "value": "ok" if ok else "FAIL", "detail": detail + ("" if ok else (
            " -- expected train metrics, a checkpoint" + (" and a resume" if "--resume" in extra else "")))}
    n_gpus = __import__("torch").cuda.device_count()
    if n_gpus >= 1:
        name = f"trainer: --nproc {n_gpus + 1} on {n_gpus} visible GPU(s) refused before launch"
        proc = subprocess.run(_train_cmd(work / "d", 2, quick, ["--nproc", str(n_gpus + 1)]), cwd=work, env=env,
                              capture_output=True, text=True, timeout=TRAIN_STAGE_LIMIT_S)
        err = [line for line in proc.stderr.splitlines() if line.strip()]
        ok = proc.returncode == 2 and len(err) == 1 and "visible" in err[0]
        yield {"check": name, "value": "ok" if ok else "FAIL", "detail": f"exit {proc.returncode}: {err[-1:]}"}


def _one_gpu_model() -> tuple[str, dict]:
    """The model sized for one 141 GB GPU: the benchmarks' ``gpu-1x`` (``benchmarks/peers.py``: DeepSeek-V3's
    architecture at 3.9 B total / 0.6 B active parameters), as the ``small`` preset plus the fields it changes."""
    import dataclasses

    import peers  # beside this script, so on sys.path

    from moetrain.model.config import get_preset

    base, big = get_preset("small"), peers.gpu_1x()
    return "small", {f.name: getattr(big, f.name) for f in dataclasses.fields(big)
                     if getattr(big, f.name) != getattr(base, f.name)}


def _trainer_path_step(preset: str, overrides: dict, B: int, L: int, steps: int) -> dict[str, float]:
    """Seconds per optimizer step of the trainer's own path at world 1: ``build_model_parts`` (meta build,
    parallelize: FSDP2 with bf16 parameters on GPU, materialise), ``build_optimizers`` (fused AdamW), ``train_step``
    on synthetic batches. Returns the median step time, its Megatron TFLOP/s and MFU."""
    import torch

    from moetrain.accounting import flops_per_token
    from moetrain.config import build_job_config
    from moetrain.data.synthetic import synthetic_batches
    from moetrain.model.config import get_preset
    from moetrain.parallel.mesh import init_parallel, shutdown
    from moetrain.precision.cpu_bf16 import cpu_bf16_gemms
    from moetrain.train.metrics import device_peak, peak_memory_gb
    from moetrain.train.optim import build_optimizers
    from moetrain.train.step import train_step
    from moetrain.train.trainer import autocast_dtype, build_model_parts

    dev = _device()
    vocab = get_preset(preset).vocab_size
    _world_one_env()
    job = build_job_config({"model": {"preset": preset, "vocab_size": vocab, **overrides},
                            "parallel": {"ep": 1}, "data": {"seq_len": L},
                            "train": {"micro_batch_size": B, "device": dev.type}}, world=1)
    ctx = init_parallel(job.parallel, job.model.n_routed_experts, dev.type)
    try:
        amp = autocast_dtype(job, ctx.device)
        with cpu_bf16_gemms(ctx.device, amp):
            parts = build_model_parts(job, ctx, amp)
            tc = job.train
            opt = build_optimizers(parts.parts, tc.lr, tc.weight_decay, (tc.beta1, tc.beta2), tc.eps)
            batches = synthetic_batches(job.model.vocab_size, 1, B, L, ctx.device)

            def step() -> None:
                train_step(parts, opt, batches, job.model, ctx, tc.max_grad_norm, autocast_dtype=amp)

            t = _time(step, ctx.device, iters=steps, warmup=2)
        peak, label = device_peak(ctx.device, amp)
        tflops = flops_per_token(job.model, L).megatron * B * L / t / 1e12
        return {"step_s": t, "tflops": tflops, "peak": peak, "label": label, "mem_gb": peak_memory_gb(ctx.device)[0]}
    finally:
        shutdown()


def _mfu_cases(quick: bool) -> list[tuple[str, dict, int, int]]:
    return [("tiny", {}, 4, 64)] if quick else [("tiny", {}, 32, 256), ("small", {}, 8, 1024),
                                                (*_one_gpu_model(), 4, 2048)]


def check_mfu(quick: bool, args: argparse.Namespace) -> Iterator[Row]:
    """Each model in a process of its own: a process group is initialised once per process (a second NCCL
    initialisation in one process after a teardown is not something the trainer ever does), and one model running
    out of memory or crashing leaves the others' rows."""
    if args.mfu_case is not None:
        preset, over, B, L = _mfu_cases(quick)[args.mfu_case]
        label = "gpu-1x" if over else preset
        name = f"train step MFU, trainer path ({label}, {B}x{L})"
        r = _trainer_path_step(preset, over, B, L, steps=2 if quick else 5)
        yield {"check": name, "value": f"{r['tflops'] / r['peak']:.1%}",
               "detail": f"{r['step_s'] * 1e3:.1f} ms/step, {r['tflops']:.2f} TFLOP/s of {r['peak']:.1f} "
                         f"({r['label']}), peak memory {r['mem_gb']:.1f} GB"}
        return
    for i, (preset, over, B, L) in enumerate(_mfu_cases(quick)):
        preset = "gpu-1x" if over else preset
        cmd = [sys.executable, "-X", "faulthandler", str(Path(__file__).resolve()), "--child", "mfu", "--mfu-case",
               str(i)] + (
            ["--quick"] if quick else [])
        proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "PYTHONUNBUFFERED": "1"})
        rows = [json.loads(line[len(ROW_MARK):]) for line in proc.stdout.splitlines() if line.startswith(ROW_MARK)]
        yield from rows
        if proc.returncode != 0 or not rows:
            yield {"check": f"train step MFU, trainer path ({preset}, {B}x{L})", "value": "ERROR",
                   "detail": f"exit {proc.returncode}: {(proc.stdout + proc.stderr)[-1200:]}"}


def check_grouped_gemm(quick: bool, args: argparse.Namespace) -> Iterator[Row]:
    """``torch._grouped_mm`` (bf16) over 8 equal groups, DeepSeek-V3's gate+up (K 7168 -> 2x2048) and down (K 2048 ->
    7168) expert GEMMs, against one matmul of the same FLOPs."""
    import torch

    dev = _device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    E, rows_e = 8, (64 if quick else 4096)
    shapes = [(128, 64), (64, 128)] if quick else [(7168, 4096), (2048, 7168)]
    for K, N in shapes:
        name = f"grouped GEMM vs matmul (E={E}, {rows_e}x{K}x{N} per expert, {str(dtype)[6:]})"
        x = torch.randn(E * rows_e, K, device=dev, dtype=dtype)
        w = torch.randn(E, N, K, device=dev, dtype=dtype)
        offs = torch.arange(1, E + 1, device=dev, dtype=torch.int32) * rows_e
        t_g = _time(lambda: torch._grouped_mm(x, w.transpose(-2, -1), offs=offs), dev, 3 if quick else 20)
        w2 = torch.randn(K, N, device=dev, dtype=dtype)
        t_m = _time(lambda: x @ w2, dev, 3 if quick else 20)
        fl = 2 * E * rows_e * K * N
        yield {"check": name, "value": f"{t_m / t_g:.2f}x matmul rate",
               "detail": f"grouped {fl / t_g / 1e12:.1f} TFLOP/s, matmul {fl / t_m / 1e12:.1f} TFLOP/s"}


def _fp8_verify_rows(v: Any, calls: list[Callable[[], None]]) -> Iterator[Row]:
    """Run checks of ``benchmarks/fp8_gpu_verify.py`` (module ``v``: the FP8 fast paths against the reference, and
    timed against bf16) and yield each result as a row as it ends."""
    for call in calls:
        start = len(v.RESULTS)
        call()
        for r in v.RESULTS[start:]:
            yield {"check": f"FP8 {r['check']}", "value": "ok" if r["ok"] else "FAIL", "detail": r["detail"]}


def _fp8_cpu_rows(quick: bool) -> Iterator[Row]:
    """On CPU: the one FP8 kernel a CPU build has (row-wise ``scaled_mm``, torch 2.13) against the reference, or why
    there is none; the blockwise and grouped kernels are CUDA's (their operands are checked on fake CUDA tensors in
    tests/precision/test_fake_cuda.py)."""
    import torch

    from moetrain.precision.gemm import fp32_sum_rtol, fp8_mm_reference, scaled_mm_fast
    from moetrain.precision.quant import quantise

    name = "FP8 GEMM row-wise on CPU (256x128x256)"
    a, b = quantise(torch.randn(256, 128), (1, 128)), quantise(torch.randn(256, 128), (1, 128))
    fast = scaled_mm_fast(a, b)
    if fast is None:
        yield _skip(name, f"torch {torch.__version__} has no CPU scaled_mm kernel")
        return
    err = ((fast - fp8_mm_reference(a, b)).abs().max() / fp8_mm_reference(a, b).abs().max()).item()
    lim = fp32_sum_rtol(128)
    yield {"check": name, "value": f"error {err:.1e}", "detail": f"limit {lim:.1e}: {'ok' if err <= lim else 'FAIL'}"}


def check_fp8_gemm(quick: bool, args: argparse.Namespace) -> Iterator[Row]:
    """The FP8 linear's three GEMMs (fprop, dgrad, wgrad operands as ``Fp8LinearFunction`` builds them) against the
    reference at the tiny, small and DeepSeek-V3 shapes, the linear's forward + backward, and its speed against bf16
    at a DeepSeek-V3 shape."""
    if _device().type != "cuda":
        yield from _fp8_cpu_rows(quick)
        return
    import fp8_gpu_verify as v  # beside this script, so on sys.path

    calls = [lambda: v.check("compiled quantisers equal the definitions", v.quantiser_agreement)]
    for preset in v.LINEARS:
        calls += [lambda p=preset: v.gemm_checks(p), lambda p=preset: v.linear_check(p)]
    calls.append(lambda: v.check("time linear", v.time_linear))
    yield from _fp8_verify_rows(v, calls)


def check_fp8_experts(quick: bool, args: argparse.Namespace) -> Iterator[Row]:
    """The routed experts' FP8 grouped GEMMs (row-wise ``torch._scaled_grouped_mm``) forward + backward against the
    reference with uneven and empty groups, and their speed against the bf16 grouped GEMM at DeepSeek-V3's shapes."""
    if _device().type != "cuda":
        yield _skip("FP8 grouped experts", "torch._scaled_grouped_mm is CUDA's (Hopper and later); its operands are "
                                           "checked on fake CUDA tensors in tests/precision/test_fake_cuda.py")
        return
    import fp8_gpu_verify as v  # beside this script, so on sys.path

    calls = [lambda p=preset: v.expert_check(p) for preset in v.EXPERTS]
    calls += [lambda: v.check("raw 2d-2d empty group", v.raw_empty_group),
              lambda: v.check("time experts", v.time_experts),
              lambda: v.check("time expert fprop: grouped row-wise vs per-expert blockwise", v.time_expert_tilings)]
    yield from _fp8_verify_rows(v, calls)


def _layer_config(quick: bool):
    """DeepSeek-V3's layer with 8 routed experts, each token to all 8 (top-8, one group): what one EP-32 rank computes
    for its 8 of the 256 experts under balanced routing. ``quick``: the tiny preset's layer instead."""
    from moetrain.model.config import get_preset

    if quick:
        return get_preset("tiny").replace(n_routed_experts=4, top_k=4, n_expert_groups=1, n_limited_groups=1)
    return get_preset("deepseek-v3-671b").replace(n_routed_experts=8, top_k=8, n_expert_groups=1, n_limited_groups=1)


def _planned_layer_s(kind: str, tokens: int, quick: bool) -> dict[str, float] | None:
    """The performance model's forward + backward time of one layer (``kind``: "t" MoE, "d" dense) for one micro-batch
    of ``tokens`` tokens on one H200 of an EP-32 plan (balanced routing, bf16, no recompute): its compute (the
    all-to-all apart), and the parts of it. None on CPU (the catalogue's GPU is not this machine)."""
    if quick:
        return None
    from moetrain.plan.model import predict
    from moetrain.plan.plan import Plan

    plan = Plan(ep=32, micro_batch=1, seq_len=tokens, global_batch=32 * 8, precision="bf16", routing="balanced",
                recompute="none", mtp_depth=0)
    pred = predict("deepseek-v3-671b", "h200", 32, plan)
    return pred.details["item_cost_s"][kind]


def check_layers(quick: bool, args: argparse.Namespace) -> Iterator[Row]:
    import torch

    from moetrain.model.layers import rope_cos_sin
    from moetrain.model.transformer import Block

    dev = _device()
    cfg = _layer_config(quick)
    L = 64 if quick else 4096
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    for kind, moe in (("t", True), ("d", False)):
        name = f"{'MoE' if moe else 'dense'} layer fwd+bwd ({'tiny' if quick else 'DeepSeek-V3'}, 1x{L} tokens" + (
            f", {cfg.n_routed_experts} local experts, top-{cfg.top_k})" if moe else f", FFN {cfg.dense_ffn_dim})")
        torch.manual_seed(0)
        block = Block(cfg, moe=moe).to(device=dev, dtype=dtype)
        with torch.no_grad():
            for p in block.parameters():
                p.normal_(0, cfg.init_std) if p.dim() > 1 else p.fill_(1.0)
        cos, sin = rope_cos_sin(cfg, L, dev)
        x = torch.randn(1, L, cfg.dim, device=dev, dtype=dtype, requires_grad=True)

        def fwd_bwd() -> None:
            y, _ = block(x, cos, sin)
            y.backward(torch.ones_like(y))

        t = _time(fwd_bwd, dev, 3 if quick else 10, warmup=2)
        plan = _planned_layer_s(kind, L, quick)
        if plan is None:
            detail = "no prediction on CPU (the planner's catalogue GPU is not this machine)"
            value = f"{t * 1e3:.2f} ms"
        else:
            p = plan["compute"]
            parts = ", ".join(f"{k} {1e3 * plan[k]:.2f}" for k in ("gemm", "grouped", "attention", "memory_bound",
                                                                    "overhead", "host_launch") if plan[k] > 0)
            value = f"{t * 1e3:.2f} ms"
            detail = (f"moetrain plan --gpu h200 predicts {p * 1e3:.2f} ms (measured / predicted = {t / p:.2f}; "
                      f"predicted parts ms: {parts})")
        yield ({"check": name, "value": value, "detail": detail, "measured_s": t,
                     "predicted_s": plan["compute"] if plan else None})


def check_attention(quick: bool, args: argparse.Namespace) -> Iterator[Row]:
    """MLA's attention core as moetrain calls it (q, k, v padded to one head dim, causal, explicit scale): the kernel
    SDPA picks, and forward / backward time at DeepSeek-V3's shapes (tiny's on CPU)."""
    import torch
    import torch.nn.functional as F
    from torch.nn.attention import SDPBackend

    from moetrain.model.config import get_preset

    dev = _device()
    dtype = torch.bfloat16 if dev.type == "cuda" else torch.float32
    cases = [("tiny", 4, 64)] if quick else [("tiny", 32, 256), ("deepseek-v3-671b", 1, 4096)]
    for preset, B, L in cases:
        cfg = get_preset(preset)
        P = -(-max(cfg.qk_head_dim, cfg.v_head_dim) // 8) * 8
        H = cfg.n_heads
        q, k, v = (torch.randn(B, H, L, P, device=dev, dtype=dtype, requires_grad=True) for _ in range(3))
        choice = SDPBackend(torch._fused_sdp_choice(q, k, v, None, 0.0, True, scale=cfg.softmax_scale)).name
        fwd = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=cfg.softmax_scale)  # noqa: E731
        t_f = _time(fwd, dev, 3 if quick else 10)
        y = fwd()
        g = torch.ones_like(y)
        t_b = _time(lambda: torch.autograd.grad(y, (q, k, v), g, retain_graph=True), dev, 3 if quick else 10)
        # causal: half of the 4 B H L^2 P forward FLOPs (QK^T and PV), backward 2.5x (Megatron-Core's accounting)
        fl = 4 * B * H * L * L * P / 2
        yield ({"check": f"attention core, MLA {preset} (B={B}, H={H}, L={L}, head dim {cfg.qk_head_dim}/"
                              f"{cfg.v_head_dim} -> {P})", "value": choice,
                     "detail": f"forward {t_f * 1e3:.2f} ms ({fl / t_f / 1e12:.1f} TFLOP/s), backward "
                               f"{t_b * 1e3:.2f} ms ({2.5 * fl / t_b / 1e12:.1f} TFLOP/s), {str(dtype)[6:]}"})


def check_metrics(quick: bool, args: argparse.Namespace) -> Iterator[Row]:
    """The trainer's device-time metrics on a world-1 process group (NCCL on GPU): the all-to-all event timer waited at
    once and hidden behind matmuls, the hang monitor reporting while the host is blocked in a device read, and the host
    synchronisations left in one training step (the checks of ``benchmarks/verify_gpu_metrics.py``)."""
    import verify_gpu_metrics as v  # beside this script, so on sys.path

    from moetrain.parallel.config import ParallelConfig
    from moetrain.parallel.mesh import init_parallel, shutdown

    got: list[Row] = []

    def report(name: str, ok: bool, detail: str) -> None:
        got.append({"check": name, "value": "ok" if ok else "FAIL", "detail": detail})

    v.report = report
    dev = _device()
    _world_one_env()
    ctx = init_parallel(ParallelConfig(dispatcher="alltoall"), 16, dev.type)
    try:
        yield {"check": "process group, world 1", "value": "ok" if ctx.distributed else "FAIL",
               "detail": f"device {ctx.device}, backend {__import__('torch').distributed.get_backend()}"}
        for name, run in (("event timer", lambda: v.check_event_timer(ctx.device)),
                          ("hang monitor", lambda: v.check_monitor(ctx.device)),
                          ("host syncs per step", lambda: v.check_step_syncs(ctx, ctx.device))):
            try:
                run()
            except Exception as e:  # noqa: BLE001 - each reports on its own
                report(name, False, f"{type(e).__name__}: {str(e)[:800]}")
            yield from got
            got.clear()
    finally:
        shutdown()


def check_loss_gap(quick: bool, args: argparse.Namespace) -> Iterator[Row]:
    """FP8 (both recipes) against BF16 autocast (fp32 on CPU): mean LM loss of the last 5 steps, same data, same
    initial weights, one process."""
    import copy

    import torch

    from moetrain.data.synthetic import synthetic_batches
    from moetrain.model.config import get_preset
    from moetrain.model.transformer import build_model
    from moetrain.precision.apply import apply_fp8

    dev = _device()
    steps = min(args.steps, 6) if quick else args.steps
    B, L = (4, 64) if quick else (16, 64)
    cfg = get_preset("tiny")
    cfg.vocab_size = 256
    amp = torch.bfloat16 if dev.type == "cuda" else None
    base = build_model(cfg, device=dev)
    batches = synthetic_batches(cfg.vocab_size, steps, B, L, dev)

    def train(model: torch.nn.Module) -> list[float]:
        opt = torch.optim.AdamW(model.parameters(), lr=3e-3, betas=(0.9, 0.95), weight_decay=0.0)
        losses = []
        for tok, lab in batches:
            with torch.autocast(dev.type, dtype=amp or torch.float32, enabled=amp is not None):
                out = model(tok, lab)
            out.loss(cfg).backward()
            torch.nn.utils.clip_grad_norm_(model.parameters(), 1.0)
            opt.step()
            opt.zero_grad(set_to_none=True)
            losses.append((out.lm_loss_sum / out.n_loss_tokens).item())
        return losses

    ref = train(copy.deepcopy(base))
    tail = min(5, steps)
    ref_tail = sum(ref[-tail:]) / tail
    for recipe in ("blockwise", "mxfp8"):
        name = f"FP8 {recipe} vs {'bf16' if amp else 'fp32'} loss after {steps} steps (tiny)"
        m = copy.deepcopy(base)
        apply_fp8(m, recipe)
        try:
            got = train(m)
        except Exception as e:  # noqa: BLE001 - the other recipe still runs
            yield ({"check": name, "value": "ERROR", "detail": f"{type(e).__name__}: {str(e)[:800]}"})
            continue
        gap = sum(got[-tail:]) / tail / ref_tail - 1
        yield ({"check": name, "value": f"{gap:+.2%}",
                     "detail": f"{sum(got[-tail:]) / tail:.4f} vs {ref_tail:.4f} (mean of last {tail}; start "
                               f"{ref[0]:.3f})"})


#: In the order they run: what no earlier session could check on hardware first, so a run cut short keeps those.
CHECKS: dict[str, Callable[[bool, argparse.Namespace], Iterator[Row]]] = {
    "env": check_env, "fp8_gemm": check_fp8_gemm, "fp8_experts": check_fp8_experts, "trainer": check_trainer,
    "layers": check_layers, "mfu": check_mfu, "metrics": check_metrics, "attention": check_attention,
    "grouped_gemm": check_grouped_gemm, "loss_gap": check_loss_gap,
}


def check_descriptions() -> dict[str, str]:
    """Each check's description for ``--list``: its bullet of the module docstring, joined onto one line."""
    import re

    bullets = re.findall(r"^\* ``(\w+)``: (.*?)(?=^\* |^$)", __doc__, re.M | re.S)
    text = {name: " ".join(body.replace("``", "").split()) for name, body in bullets}
    return {name: text.get(name, "") for name in CHECKS}


def _at_least(low: float, kind: type, strict: bool, why: str = "") -> Callable[[str], Any]:
    """An argparse type: ``kind(value)`` that is >= ``low`` (> ``low`` when ``strict``); ``why`` ends the error."""
    def parse(value: str) -> Any:
        try:
            v = kind(value)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{value!r} is not a{'n integer' if kind is int else ' number'}") from None
        if v < low or (strict and v == low):
            raise argparse.ArgumentTypeError(f"{value} must be {'>' if strict else '>='} {low:g}{why}")
        return v
    return parse


def _json_path_problem(path: Path) -> str | None:
    """Why ``--json path`` could not be written (its folder missing or not writable, or it is a directory), checked
    before any check runs, so that no result is lost to it; None when it can."""
    p = path.expanduser().absolute()
    if p.is_dir():
        return f"--json {path} is a directory; name a file in it, e.g. --json {path / 'gpu_check.json'}"
    if not p.parent.is_dir():
        return f"--json {path}: the folder {p.parent} does not exist; create it (mkdir -p) or name another file"
    if not os.access(p.parent, os.W_OK):
        return f"--json {path}: the folder {p.parent} is not writable; name a file in a folder you can write"
    return None


# ----------------------------------------------------------------------------------------------------------------
# the parent: one child per check, rows printed as they come
# ----------------------------------------------------------------------------------------------------------------

def _run_child(name: str, args: argparse.Namespace, limit: float,
               show: Callable[[Row], None]) -> tuple[list[Row], float]:
    """Run check ``name`` in a process of its own (its own session, so a timeout kills its whole tree, the trainer's
    workers too), passing each row to ``show`` the moment the check prints it. Returns the rows (plus an ERROR or
    TIMEOUT row when the check failed) and the wall seconds."""
    # -X faulthandler: a check that dies of a signal (the H200 saw a segfault) leaves the Python stack in its output
    cmd = [sys.executable, "-X", "faulthandler", str(Path(__file__).resolve()), "--child", name, "--steps",
           str(args.steps)] + (["--quick"] if args.quick else [])
    t = time.perf_counter()
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, bufsize=1,
                            env={**os.environ, "PYTHONUNBUFFERED": "1"}, start_new_session=True)
    lines: queue.Queue[str | None] = queue.Queue()

    def pump() -> None:
        for line in proc.stdout:  # type: ignore[union-attr]
            lines.put(line)
        lines.put(None)

    threading.Thread(target=pump, daemon=True).start()
    rows: list[Row] = []
    other: list[str] = []
    sub_log: Path | None = None  # where the check's own subprocess writes (the trainer's runs)
    deadline = t + limit
    timed_out = False
    while True:
        try:
            line = lines.get(timeout=max(0.0, deadline - time.perf_counter()))
        except queue.Empty:
            timed_out = True
            os.killpg(proc.pid, signal.SIGKILL)
            break
        if line is None:
            break
        if line.startswith(ROW_MARK):
            row = json.loads(line[len(ROW_MARK):])
            rows.append(row)
            show(row)
        elif line.startswith(LOG_MARK):
            sub_log = Path(line[len(LOG_MARK):].strip())
        else:
            other.append(line)
    proc.wait()
    wall = time.perf_counter() - t
    tail = "".join(other)[-1500:]
    if sub_log is not None and sub_log.is_file():
        tail = (tail + f"\n[{sub_log}:]\n" + sub_log.read_text(errors="replace"))[-1500:]
    if timed_out:
        rows.append({"check": name, "value": "TIMEOUT", "detail": f"over {limit:.0f} s; output: {tail[-1000:]}"})
        show(rows[-1])
    elif proc.returncode != 0:
        rows.append({"check": name, "value": "ERROR", "detail": f"exit {proc.returncode}: {tail}"})
        show(rows[-1])
    return rows, wall


def _failed(r: Row) -> bool:
    return r["value"] in ("ERROR", "TIMEOUT", "FAIL", "not run") or str(r.get("detail", "")).endswith("FAIL")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--steps", type=_at_least(1, int, strict=False), default=50,
                    help="training steps of the FP8 loss-gap check (>= 1)")
    ap.add_argument("--quick", action="store_true", help="small sizes (implied without a GPU)")
    ap.add_argument("--json", type=Path, default=None, help="also write the rows here as JSON (after every check)")
    ap.add_argument("--only", default="", help="comma-separated checks to run (default: all; see --list)")
    ap.add_argument("--list", action="store_true", help="print each check, one a line: its name, two spaces, what it "
                    "measures; then exit")
    budget_why = f" (no check starts with under {BUDGET_MIN_S:g} s left)"
    ap.add_argument("--budget-s", type=_at_least(BUDGET_MIN_S, float, False, budget_why),
                    default=None,
                    help="stop starting checks after this many seconds, each check's limit cut to what is left "
                         f"(default on a GPU {GPU_BUDGET_S:g}, so the run stays within 8 minutes; none on CPU)")
    ap.add_argument("--child", default=None, help=argparse.SUPPRESS)
    ap.add_argument("--mfu-case", type=int, default=None, help=argparse.SUPPRESS)
    args = ap.parse_args(argv)
    if args.list:
        width = max(map(len, CHECKS))
        print("\n".join(f"{name:<{width}}  {text}" for name, text in check_descriptions().items()))
        return 0
    problem = args.json is not None and not args.child and _json_path_problem(args.json)
    if problem:
        print(f"gpu_check.py: error: {problem}", file=sys.stderr)
        return 2
    try:
        import torch
    except ImportError:
        print(f"{sys.executable} has no torch: run the check with the Python that holds the GPU's PyTorch",
              file=sys.stderr)
        return 2

    gpu = torch.cuda.is_available()
    args.quick = args.quick or not gpu
    if args.budget_s is None and gpu and not args.child:
        args.budget_s = GPU_BUDGET_S
    if args.child:
        if not gpu:
            torch.set_num_threads(1)  # small ops on a possibly shared CPU
        inject = os.environ.get("MOETRAIN_GPU_CHECK_INJECT", "")  # the harness's own test: "check:raise|hang"
        if inject.startswith(f"{args.child}:"):
            if inject.endswith(":hang"):
                time.sleep(3600)
            raise RuntimeError(f"injected failure in {args.child}")
        for row in CHECKS[args.child](args.quick, args):
            print(ROW_MARK + json.dumps(row), flush=True)
        return 0
    only = list(dict.fromkeys(s.strip() for s in args.only.split(",") if s.strip()))
    unknown = [s for s in only if s not in CHECKS]
    if unknown:
        ap.error(f"unknown check(s) {unknown}; choose from {', '.join(CHECKS)}")
    names = only or list(CHECKS)
    device = torch.cuda.get_device_name(0) if gpu else "CPU"
    print(f"moetrain GPU check on {device} (torch {torch.__version__}{', quick' if args.quick else ''}): "
          f"{', '.join(names)}", flush=True)
    rows: list[Row] = []
    t0 = time.perf_counter()
    for name in names:
        limit = GPU_LIMIT_S[name] if gpu else float(os.environ.get("MOETRAIN_GPU_CHECK_CPU_LIMIT_S", CPU_LIMIT_S))

        def show(r: Row, group: str = name) -> None:
            r.setdefault("group", group)
            rows.append(r)
            print(f"{r['check']:<72}  {r['value']:>18}  {r['detail']}", flush=True)
            if args.json:
                _write_json(args.json, device, args, rows)

        if args.budget_s is not None:
            left = args.budget_s - (time.perf_counter() - t0)
            if left < BUDGET_MIN_S:
                show({"check": name, "value": "not run", "detail": f"--budget-s {args.budget_s:g} spent"})
                continue
            limit = min(limit, left)

        _, wall = _run_child(name, args, limit, show)
        print(f"  [{name}: {wall:.1f} s, {time.perf_counter() - t0:.0f} s so far]", flush=True)
    skipped = [f"{r['check']}: {r['detail']}" for r in rows if r["value"] == "skipped"]
    if skipped:
        print("skipped:\n" + "\n".join(f"  - {s}" for s in skipped))
    failed = [r["check"] for r in rows if _failed(r)]
    print(f"{len(rows)} rows in {time.perf_counter() - t0:.0f} s; " + (f"FAILED: {failed}" if failed else "no failures"))
    return 1 if failed else 0


def _write_json(path: Path, device: str, args: argparse.Namespace, rows: list[Row]) -> None:
    doc = {"device": device, "quick": args.quick, "rows": rows,
           "skipped": [f"{r['check']}: {r['detail']}" for r in rows if r["value"] == "skipped"],
           "failed": [r["check"] for r in rows if _failed(r)]}
    tmp = path.with_name(path.name + ".tmp")
    tmp.write_text(json.dumps(doc, indent=2))
    os.replace(tmp, path)


if __name__ == "__main__":
    sys.exit(main())
