#!/usr/bin/env python
"""Any model size: peak memory per rank at each phase, divided by the rank's share.

    .venv/bin/python benchmarks/scale_memory.py                 # 3.08 GiB model, (DP, EP) = (1, 2) and (2, 1)
    .venv/bin/python benchmarks/scale_memory.py --layouts 1x2   # one layout
    .venv/bin/python benchmarks/scale_memory.py --experts 8 --preset tiny   # smoke run (figures not meaningful)

The model is ``--preset small --set model.n_routed_experts=104`` (828.0 M parameters incl. MTP = 3.08 GiB of fp32
weights: the issue's "at least 3 GiB"), sequences of 64 tokens, micro-batch 2, 2 worker processes (1 thread each).
``--experts 112`` (3.30 GiB, the size of the acceptance script's dry run) works the same, but its train step after
a resume at (2, 1) holds 2 x 8.2 GiB + the launcher = 16.6 GiB on a 2-rank machine, past the 16 GiB this shared
24 GiB machine allows a benchmark. For each layout it does, as a user would, with the real CLI (each command polled every 0.1 s: the VmHWM -- kernel high-water mark of resident
memory -- of every process of its tree):

1. ``moetrain train ... --ep EP --dry-run``              build on meta, parallelize, materialise the local shards;
2. ``moetrain train ... --ep EP --steps 2``              build, 2 steps, save (DCP, at step 2);
3. ``moetrain train ... --ep OTHER --steps 3 --resume``  the same run resumed at the other EP size, 1 step, save;
4. ``moetrain export RUN HF``                            one process, DCP -> HF safetensors (default 5e9-byte shards);
5. ``export_run(RUN, HF, max_shard_bytes=1e9)``          the same through the API with 1 GB shards (the CLI has no
                                                         shard-size flag), to see the peak follow the shard size.

A CLI process's peak is the maximum over all its phases. For the peak *of each phase* inside one process, an
instrumented driver (this file's ``_driver`` mode, 2 ranks started with torchrun's environment by ``_ranks``) calls the library
functions the trainer calls, in the same order, and resets the kernel's peak-RSS counter between phases
(``echo 5 > /proc/self/clear_refs`` sets VmHWM back to the current RSS):

    launch A, (DP, EP):   build (build_model_parts + build_optimizer) | 2 x train_step | save_checkpoint
    launch B, other EP:   build | load_checkpoint (the checkpoint of A) | 1 x train_step

The rank's share: its local parameter bytes P (sum of local shard numel x 4, fp32), and its training state
S = P + gradients + AdamW's two moments = 4 P. Budgets (the issue's): build <= 1.3 P + 0.75 GiB; save and load
<= 1.1 S + 0.75 GiB. A phase's peak is the absolute resident high-water mark during that phase (runtime included,
which the 0.75 GiB allows for). The train step has no budget in the issue; its peak is reported against S.

A watchdog kills a command whose process tree exceeds ``--mem-limit-gib`` of resident memory (default 16.5) or when
the machine's MemAvailable falls below 1.5 GiB (the machine is shared), and the run reports it as a failure, naming
the phase that was running.

Writes ``<out>/scale-memory-<date>.json`` and ``.md`` (default out: benchmarks/results) and prints the tables.
"""

from __future__ import annotations

import argparse
import datetime
import json
import os
import shlex
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
GiB = 2 ** 30
RUNTIME = 0.75 * GiB


def _bin(name: str) -> str:
    p = Path(sys.executable).parent / name
    return str(p) if p.exists() else name


# ----------------------------------------------------------------------------------------------------------------
# The job, identical for the CLI runs and the driver
# ----------------------------------------------------------------------------------------------------------------

def model_args(preset: str, experts: int, cache_dir: str) -> list[str]:
    """CLI flags of the benchmark's job (minus --ep, --steps, --out, --resume, --dry-run)."""
    return ["--preset", preset, "--set", f"model.n_routed_experts={experts}", "--set", "data.seq_len=64",
            "--set", "train.micro_batch_size=2", "--nproc", "2", "--device", "cpu",
            # constant LR: resuming a 2-step run for a 3rd step then changes no schedule (a decaying schedule
            # stretched from 2 to 3 steps is refused on resume unless train.allow_schedule_change)
            "--set", 'train.schedule="constant"',
            # evaluation and TensorBoard are not what is measured (an eval forward holds less than a train step)
            "--set", "train.eval_every=0", "--set", "train.tensorboard=false", "--set", "train.log_every=1",
            "--set", f"data.cache_dir={json.dumps(cache_dir)}"]


def job_sets(preset: str, experts: int, ep: int) -> list[str]:
    """The same job as ``section.field=value`` overrides, for :func:`moetrain.config.load_job_config`."""
    return [f"model.preset={json.dumps(preset)}", f"model.n_routed_experts={experts}", "data.seq_len=64",
            "train.micro_batch_size=2", f"parallel.ep={ep}", 'train.device="cpu"']


# ----------------------------------------------------------------------------------------------------------------
# /proc
# ----------------------------------------------------------------------------------------------------------------

def _proc_status(pid: int | str = "self") -> dict[str, int]:
    out = {}
    try:
        with open(f"/proc/{pid}/status") as f:
            for line in f:
                if line.startswith(("VmHWM:", "VmRSS:")):
                    out[line.split(":")[0]] = int(line.split()[1]) * 1024
    except OSError:
        pass
    return out


def _children(pid: int) -> list[int]:
    out: list[int] = []
    try:
        for t in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{t}/children") as f:
                out += [int(c) for c in f.read().split()]
    except OSError:
        pass
    return out


def _cmdline(pid: int) -> str:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return " ".join(a.decode(errors="replace") for a in f.read().split(b"\0") if a)
    except OSError:
        return ""


def _env_rank(pid: int) -> int | None:
    try:
        with open(f"/proc/{pid}/environ", "rb") as f:
            for kv in f.read().split(b"\0"):
                if kv.startswith(b"RANK="):
                    return int(kv[5:])
    except (OSError, ValueError):
        pass
    return None


def _mem_available() -> int:
    with open("/proc/meminfo") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return 0


def reset_peak() -> bool:
    """Set this process's VmHWM back to its current RSS (Linux >= 4.0). Returns whether it worked."""
    try:
        with open("/proc/self/clear_refs", "w") as f:
            f.write("5")
        return True
    except OSError:
        return False


def run_monitored(cmd: list[str], cwd: Path, log: Path, timeout: float, mem_limit: float,
                  min_available: float = 1.5 * GiB, env: dict[str, str] | None = None) -> dict[str, Any]:
    """Run ``cmd``; every 0.1 s read VmHWM / VmRSS of every process of its tree. Kill the tree on timeout, when its
    summed RSS passes ``mem_limit`` bytes or the machine's MemAvailable drops below ``min_available``.

    Returns rc, seconds, killed (reason or None), and per process: role (launcher / worker / helper), rank (from its
    environment), command, peak (last VmHWM seen: VmHWM only grows, so this misses at most 0.1 s before exit).
    """
    t0 = time.time()
    with open(log, "w") as out:
        p = subprocess.Popen(cmd, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True, env=env)
        procs: dict[int, dict[str, Any]] = {}
        tree_max, killed, avail_min = 0, None, _mem_available()
        while p.poll() is None:
            todo, seen, total = [p.pid], set(), 0
            while todo:
                q = todo.pop()
                if q in seen:
                    continue
                seen.add(q)
                st = _proc_status(q)
                if st:
                    info = procs.get(q)
                    cmdl = _cmdline(q)[:300]
                    if info is None or info["cmd"] != cmdl:
                        # new, or it exec'd since the last poll (a child seen between fork and exec still has its
                        # parent's command line and memory image): start its record afresh
                        role = ("launcher" if q == p.pid else
                                "helper" if ("resource_tracker" in cmdl or "forkserver" in cmdl) else "worker")
                        info = procs[q] = {"pid": q, "role": role, "rank": _env_rank(q) if role == "worker" else None,
                                           "cmd": cmdl, "peak": 0, "rss_max": 0}
                    if info["role"] == "worker" and info["rank"] is None:
                        info["rank"] = _env_rank(q)
                    info["peak"] = max(info["peak"], st.get("VmHWM", 0))
                    info["rss_max"] = max(info["rss_max"], st.get("VmRSS", 0))
                    total += st.get("VmRSS", 0)
                todo += _children(q)
            tree_max = max(tree_max, total)
            avail = _mem_available()
            avail_min = min(avail_min, avail)
            if killed is None:
                if time.time() - t0 > timeout:
                    killed = f"timeout after {timeout:.0f} s"
                elif total > mem_limit:
                    killed = f"process tree RSS {total / GiB:.2f} GiB > limit {mem_limit / GiB:.1f} GiB"
                elif avail < min_available:
                    killed = f"machine MemAvailable {avail / GiB:.2f} GiB < {min_available / GiB:.1f} GiB"
                if killed:
                    try:
                        os.killpg(p.pid, 9)
                    except ProcessLookupError:
                        pass
            time.sleep(0.1)
        rc = p.wait()
    return {"cmd": shlex.join(cmd), "rc": rc, "seconds": round(time.time() - t0, 1), "killed": killed,
            "tree_rss_max": tree_max, "mem_available_min": avail_min,
            "processes": sorted(procs.values(), key=lambda d: (d["role"] != "worker", d["rank"] or 0, d["pid"])),
            "log_tail": log.read_text(errors="replace")[-3000:]}


def wait_for_memory(need: float, max_wait_s: float, log=print, poll_s: float = 10.0) -> dict[str, Any]:
    """Wait until the machine's MemAvailable is at least ``need`` bytes (others share this machine's memory)."""
    t0, said = time.time(), False
    while True:
        avail = _mem_available()
        if avail >= need:
            return {"mem_available_at_start": avail, "waited_s": round(time.time() - t0)}
        if time.time() - t0 > max_wait_s:
            log(f"    MemAvailable {avail / GiB:.1f} GiB still < {need / GiB:.1f} GiB after {max_wait_s:.0f} s; "
                f"running anyway")
            return {"mem_available_at_start": avail, "waited_s": round(time.time() - t0), "gave_up_waiting": True}
        if not said:
            log(f"    waiting for {need / GiB:.1f} GiB of available memory (now {avail / GiB:.1f} GiB) ...")
            said = True
        time.sleep(poll_s)


def run_gated(cmd: list[str], cwd: Path, log_path: Path, a: argparse.Namespace, need: float, log=print,
              before_retry=None) -> dict[str, Any]:
    """:func:`run_monitored` after waiting for ``need`` bytes of available memory; a run that the watchdog stopped
    because *the machine* ran low (another tenant's peak, not this command's own limit) is run again, up to
    ``a.retries`` times (``before_retry()`` first, e.g. to remove what the stopped run left)."""
    attempts = []
    for attempt in range(a.retries + 1):
        gate = wait_for_memory(need, a.max_wait)
        res = run_monitored(cmd, cwd, log_path, a.timeout, a.mem_limit_gib * GiB)
        res["memory_gate"] = gate
        attempts.append({"killed": res["killed"], "rc": res["rc"], "seconds": res["seconds"],
                         "tree_rss_max": res["tree_rss_max"]})
        if not (res["killed"] or "").startswith("machine MemAvailable") or attempt == a.retries:
            break
        log(f"    stopped: {res['killed']} (another process's peak); again ({attempt + 1}/{a.retries})")
        if before_retry:
            before_retry()
    res["attempts"] = attempts
    return res


def worker_peaks(res: dict[str, Any]) -> dict[int, int]:
    """{rank: peak bytes} of the worker processes of a monitored run (ranks from their environment)."""
    out: dict[int, int] = {}
    workers = [x for x in res["processes"] if x["role"] == "worker"]
    if any(x["rank"] is None for x in workers):
        # `moetrain train` spawns its workers through torch's elastic launcher, which sets RANK inside the child
        # (not in its initial environment): they are started in local-rank order, so take the pid order.
        workers = sorted(workers, key=lambda x: x["pid"])
        for i, x in enumerate(workers):
            x["rank"], x["rank_from"] = i, "spawn order"
    for x in workers:
        out[x["rank"]] = max(out.get(x["rank"], 0), x["peak"])
    return out


# ----------------------------------------------------------------------------------------------------------------
# The instrumented driver (one process per rank, torchrun's environment)
# ----------------------------------------------------------------------------------------------------------------

def driver_main(a: argparse.Namespace) -> int:
    import torch
    import torch.distributed as dist

    torch.set_num_threads(1)  # what `moetrain train` gives each of 2 workers on 2 cores
    from moetrain.config import load_job_config
    from moetrain.parallel.mesh import init_parallel, shutdown
    from moetrain.parallel.parallelize import local_tensor
    from moetrain.train.checkpoint import latest_checkpoint, load_checkpoint, save_checkpoint
    from moetrain.train.optim import build_optimizer
    from moetrain.train.step import train_step
    from moetrain.train.trainer import build_model_parts

    job = load_job_config(None, job_sets(a.preset, a.experts, a.ep))
    ctx = init_parallel(job.parallel, job.model.n_routed_experts, "cpu")
    tc, cfg = job.train, job.model
    rec: dict[str, Any] = {"rank": ctx.rank, "dp": ctx.pcfg.edp, "ep": ctx.pcfg.ep, "mode": a.mode,
                           "rss_after_imports_and_init": _proc_status()["VmRSS"], "phases": []}
    g = torch.Generator().manual_seed(1000 + ctx.rank)
    held: dict[str, Any] = {}

    def dump() -> None:
        Path(a.json_dir).mkdir(parents=True, exist_ok=True)
        (Path(a.json_dir) / f"{a.mode}-rank{ctx.rank}.json").write_text(json.dumps(rec, indent=1))

    def phase(name: str, fn) -> Any:
        dist.barrier()
        rec["in_progress"] = name  # left in the file if the watchdog kills this phase
        dump()
        ok = reset_peak()
        before = _proc_status()["VmRSS"]
        t0 = time.perf_counter()
        out = fn()
        dt = time.perf_counter() - t0
        st = _proc_status()
        rec["phases"].append({"phase": name, "peak": st["VmHWM"], "rss_before": before, "rss_after": st["VmRSS"],
                              "seconds": round(dt, 2), "hwm_reset": ok})
        rec.pop("in_progress", None)
        dump()
        dist.barrier()
        return out

    def build():
        held["parts"] = build_model_parts(job, ctx, None)
        held["model"] = held["parts"].parts[0]  # PP = 1: the whole model is the one stage
        held["opt"] = build_optimizer(held["model"], tc.lr, tc.weight_decay, (tc.beta1, tc.beta2), tc.eps)

    def steps(n: int):
        losses = []
        for _ in range(n):
            data = torch.randint(0, cfg.vocab_size, (tc.micro_batch_size, job.data.seq_len + 1), generator=g)
            x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
            losses.append(train_step(held["parts"], held["opt"], [(x, y)], cfg, ctx, tc.max_grad_norm, None).loss)
        return losses

    try:
        phase("build", build)
        model, opt = held["model"], held["opt"]
        locals_ = [local_tensor(p) for p in model.parameters()]
        rec["param_bytes"] = sum(t.numel() * t.element_size() for t in locals_)
        rec["params"] = sum(t.numel() for t in locals_)
        rec["state_bytes"] = 4 * rec["param_bytes"]
        if a.mode == "train":
            rec["losses"] = phase("step", lambda: steps(2))
            ckpt = phase("save", lambda: save_checkpoint(a.ckpt_root, 2, model, opt,
                                                         {"loader": {}, "model_config": cfg.to_dict(),
                                                          "job": job.to_dict()}, ctx, keep=1))
            rec["checkpoint"] = str(ckpt)
        else:
            ckpt = latest_checkpoint(a.ckpt_root)
            if ckpt is None:
                raise RuntimeError(f"no complete checkpoint under {a.ckpt_root}")
            state = phase("load", lambda: load_checkpoint(ckpt, model, opt, ctx))
            rec["loaded_step"] = state["step"]
            rec["losses"] = phase("step", lambda: steps(1))
        rec["optim_state_bytes"] = sum(local_tensor(v).numel() * local_tensor(v).element_size()
                                       for st in opt.state.values() for v in st.values()
                                       if isinstance(v, torch.Tensor) and v.dim() > 0)
    except BaseException as e:  # noqa: BLE001 - recorded for the parent
        import traceback
        rec["error"] = f"{type(e).__name__}: {e}"[:1500]
        rec["traceback"] = traceback.format_exc()[-3000:]
    finally:
        dump()
        shutdown()
    return 1 if "error" in rec else 0


def ranks_main(a: argparse.Namespace) -> int:
    """Start ``a.nproc`` driver ranks with the torchrun environment (RANK, WORLD_SIZE, MASTER_ADDR/PORT, ...) and wait.

    Used instead of torchrun so that the launcher holds no torch runtime (~0.25 GiB) beside the ranks; stdlib only.
    If a rank fails, the others are given 60 s, then killed.
    """
    import socket
    with socket.socket() as sk:
        sk.bind(("127.0.0.1", 0))
        port = sk.getsockname()[1]
    procs = []
    for r in range(a.nproc):
        env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(a.nproc),
                   LOCAL_WORLD_SIZE=str(a.nproc), MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port),
                   OMP_NUM_THREADS="1")
        procs.append(subprocess.Popen([sys.executable, "-u", str(Path(__file__).resolve()), "_driver", *a.rest],
                                      env=env))
    rcs: dict[int, int] = {}
    failed_at = None
    while len(rcs) < len(procs):
        for i, p in enumerate(procs):
            if i not in rcs and p.poll() is not None:
                rcs[i] = p.returncode
                if p.returncode and failed_at is None:
                    failed_at = time.time()
        if failed_at is not None and time.time() - failed_at > 60:
            for i, p in enumerate(procs):
                if i not in rcs:
                    p.kill()
        time.sleep(0.2)
    return max(rcs.values(), default=0)


def _ckpt_stats_main(a: argparse.Namespace) -> int:
    print(json.dumps(checkpoint_chunk_stats(Path(a.path))))
    return 0


def count_model(preset: str, experts: int) -> tuple[int, str]:
    """(parameters incl. MTP of the benchmark's model, the moetrain package file the children import), from a child
    process (the parent keeps torch out of its own memory, which the machine's budget counts too)."""
    code = ("import sys, moetrain; from moetrain.model.config import get_preset; "
            "from moetrain.accounting import count_params; "
            "print(count_params(get_preset(sys.argv[1]).replace(n_routed_experts=int(sys.argv[2]))).total_with_mtp); "
            "print(moetrain.__file__)")
    out = subprocess.run([sys.executable, "-c", code, preset, str(experts)], capture_output=True, text=True,
                         check=True).stdout.split()
    return int(out[0]), out[1]


# ----------------------------------------------------------------------------------------------------------------
# The benchmark
# ----------------------------------------------------------------------------------------------------------------

def _ratio_row(name: str, peak: int, share: int, budget: int | None) -> dict[str, Any]:
    return {"phase": name, "peak_gib": peak / GiB, "share_gib": share / GiB, "ratio": peak / share,
            "budget_gib": None if budget is None else budget / GiB,
            "budget_ratio": None if budget is None else budget / share,
            "pass": None if budget is None else peak <= budget,
            "over_gib": None if budget is None else max(0.0, (peak - budget) / GiB)}


def checkpoint_chunk_stats(ckpt: Path) -> dict[str, Any]:
    """Bytes of the checkpoint's model entries, and of its largest saved chunk (one rank's box of one tensor)."""
    from torch.distributed.checkpoint import FileSystemReader
    from torch.distributed.checkpoint.metadata import TensorStorageMetadata

    md = FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata
    largest, model_bytes = 0, 0
    for k, m in md.items():
        if not isinstance(m, TensorStorageMetadata):
            continue
        item = m.properties.dtype.itemsize
        if k.startswith("model."):
            n = 1
            for s in m.size:
                n *= int(s)
            model_bytes += n * item
        for c in m.chunks:
            n = 1
            for s in c.sizes:
                n *= int(s)
            largest = max(largest, n * item)
    return {"largest_saved_chunk": largest, "model_bytes_in_ckpt": model_bytes,
            "ckpt_bytes_on_disk": sum(f.stat().st_size for f in ckpt.iterdir() if f.is_file())}


def _fail(res: dict[str, Any]) -> str | None:
    if res.get("killed"):
        return res["killed"]
    if res.get("rc"):
        return f"exit code {res['rc']}: " + " ".join(res.get("log_tail", "").strip().splitlines()[-3:])[-400:]
    return None


def run_layout(dp: int, ep: int, a: argparse.Namespace, work: Path, log=print) -> dict[str, Any]:
    other = 2 // ep  # world 2: EP 2 <-> EP 1
    out: dict[str, Any] = {"dp": dp, "ep": ep, "resume_ep": other, "cli": {}, "driver": {}}
    margs = model_args(a.preset, a.experts, str(work / "cache"))
    mt = _bin("moetrain")
    lim = a.mem_limit_gib * GiB
    floor = 1.5 * GiB  # the watchdog's MemAvailable floor
    P = a.model_bytes / 2  # per rank, 2 ranks
    need_train = min(lim, 2 * (1.3 * 4 * P + RUNTIME)) + floor
    need_build = min(lim, 2 * (1.3 * P + RUNTIME)) + floor
    need_export = min(lim, 2 * a.model_bytes + RUNTIME) + floor
    run_dir = work / f"run-dp{dp}-ep{ep}"
    shutil.rmtree(run_dir, ignore_errors=True)

    # ---- driver first: it gives the shares (and per-phase peaks) the CLI figures are compared with
    if not a.skip_driver:
        ckpt_root = work / f"driver-dp{dp}-ep{ep}"
        shutil.rmtree(ckpt_root, ignore_errors=True)
        jdir = work / f"driver-json-dp{dp}-ep{ep}"
        shutil.rmtree(jdir, ignore_errors=True)
        for mode, e in (("train", ep), ("resume", other)):
            cmd = [sys.executable, str(BENCH_DIR / "scale_memory.py"), "_ranks", "--nproc", "2", "--",
                   "--mode", mode, "--ep", str(e), "--preset", a.preset, "--experts", str(a.experts),
                   "--ckpt-root", str(ckpt_root), "--json-dir", str(jdir)]
            log(f"  driver {mode} at EP={e}: {shlex.join(cmd)}")
            if mode == "train":
                shutil.rmtree(ckpt_root, ignore_errors=True)
            res = run_gated(cmd, work, work / f"driver-{mode}-dp{dp}-ep{ep}.log", a, need_train, log,
                            before_retry=lambda: shutil.rmtree(jdir, ignore_errors=True))
            ranks = []
            for r in range(2):
                f = jdir / f"{mode}-rank{r}.json"
                ranks.append(json.loads(f.read_text()) if f.exists() else {"rank": r, "error": "no result"})
            res["ranks"] = ranks
            out["driver"][mode] = res
            err = _fail(res) or next((r.get("error") for r in ranks if r.get("error")), None)
            running = sorted({r["in_progress"] for r in ranks if r.get("in_progress")})
            if err and running:
                err += f" (during phase {', '.join(running)})"
            log(f"    {res['seconds']:.0f} s" + (f"  FAILED: {err}" if err else ""))
            if mode == "train" and not err:
                try:
                    out["checkpoint"] = json.loads(subprocess.run(
                        [sys.executable, str(BENCH_DIR / "scale_memory.py"), "_ckpt_stats", ranks[0]["checkpoint"]],
                        capture_output=True, text=True, check=True).stdout)
                except Exception as ex:  # noqa: BLE001
                    out["checkpoint"] = {"error": str(ex)}
            if err:
                res["error"] = err
                break
        shutil.rmtree(ckpt_root, ignore_errors=True)

    # ---- the CLI, as a user would run it
    if not a.skip_cli:
        steps = [
            ("dry-run", [mt, "train", *margs, "--ep", str(ep), "--out", str(run_dir), "--dry-run"]),
            ("train 2 steps + save", [mt, "train", *margs, "--ep", str(ep), "--steps", "2", "--out", str(run_dir)]),
            (f"resume at EP={other}, 1 step + save",
             [mt, "train", *margs, "--ep", str(other), "--steps", "3", "--resume", "--out", str(run_dir)]),
            ("export (CLI, default 5e9-byte shards)", [mt, "export", str(run_dir), str(run_dir / "hf")]),
            ("export (API, max_shard_bytes=1e9)",
             [sys.executable, "-c", "import sys; from moetrain.train.export import export_run; "
              "export_run(sys.argv[1], sys.argv[2], max_shard_bytes=1e9)", str(run_dir), str(run_dir / "hf-1gb")]),
        ]
        def cleanup(name: str):
            def f():
                if name.startswith("train"):
                    shutil.rmtree(run_dir / "checkpoints", ignore_errors=True)
                    (run_dir / "metrics.jsonl").unlink(missing_ok=True)
                elif name.startswith("resume"):  # keep step 2, drop whatever the stopped resume wrote
                    for q in (run_dir / "checkpoints").glob("*"):
                        if q.name != "step_00000002":
                            shutil.rmtree(q, ignore_errors=True)
                elif name.startswith("export"):
                    for q in run_dir.glob(".hf*"):
                        shutil.rmtree(q, ignore_errors=True)
            return f

        for i, (name, cmd) in enumerate(steps):
            log(f"  {name}: {shlex.join(cmd)}")
            need = need_export if name.startswith("export") else need_build if name.startswith("dry") else need_train
            res = run_gated(cmd, work, work / f"cli-{i}-dp{dp}-ep{ep}.log", a, need, log, before_retry=cleanup(name))
            res["name"] = name
            err = _fail(res)
            if err:
                res["error"] = err
            if name.startswith("dry-run") and (run_dir / "dry_run.json").exists():
                res["dry_run_json"] = json.loads((run_dir / "dry_run.json").read_text())
            if name.startswith("export") and not err:
                hf = run_dir / ("hf" if "CLI" in name else "hf-1gb")
                files = sorted(hf.glob("*.safetensors"))
                res["shards"] = [f.stat().st_size for f in files]
                idx = hf / "model.safetensors.index.json"
                res["total_size"] = json.loads(idx.read_text())["metadata"]["total_size"] if idx.exists() else None
                shutil.rmtree(hf, ignore_errors=True)
            if name.startswith("resume") and not err:
                rows = [json.loads(x) for x in (run_dir / "metrics.jsonl").read_text().splitlines() if x.strip()]
                runs = [r for r in rows if r.get("kind") == "run"]
                trains = [r for r in rows if r.get("kind") == "train"]
                res["resumed"] = {"run_records": [{"step": r["step"], "dp": r["dp"] // r["ep"], "ep": r["ep"]}
                                                  for r in runs]  # this benchmark's DP: ranks per expert replica,
                                  "train_steps": [(r["step"], round(r["loss"], 4)) for r in trains]}
            out["cli"][name] = res
            peaks = worker_peaks(res)
            launcher = max((p["peak"] for p in res["processes"] if p["role"] == "launcher"), default=0)
            log(f"    {res['seconds']:.0f} s; peak per worker: "
                + (", ".join(f"rank {r} {v / GiB:.2f} GiB" for r, v in sorted(peaks.items())) or "-")
                + f"; launcher {launcher / GiB:.2f} GiB" + (f"  FAILED: {err}" if err else ""))
            if err:
                break
        if not a.keep:
            shutil.rmtree(run_dir, ignore_errors=True)
    return out


# ----------------------------------------------------------------------------------------------------------------
# Tables
# ----------------------------------------------------------------------------------------------------------------

def tables(layouts: list[dict[str, Any]], model_bytes: int) -> tuple[list[dict], list[dict], list[str]]:
    """(per-phase rows of the driver, per-command rows of the CLI, failures)."""
    phase_rows, cli_rows, failures = [], [], []
    shares: dict[tuple[int, int], list[dict]] = {}
    for L in layouts:
        for mode, res in L["driver"].items():
            for r in res.get("ranks", []):
                if "param_bytes" in r:
                    shares[(r["dp"], r["ep"])] = shares.get((r["dp"], r["ep"]), []) + [r]
    for L in layouts:
        for mode, res in L["driver"].items():
            if res.get("error"):
                failures.append(f"driver {mode} (DP={L['dp']}, EP={L['ep']} -> EP={L['resume_ep']}): {res['error']}")
            for r in res.get("ranks", []):
                if "param_bytes" not in r:
                    continue
                P, S = r["param_bytes"], r["state_bytes"]
                for ph in r["phases"]:
                    name = ph["phase"]
                    if name == "build":
                        row = _ratio_row(name, ph["peak"], P, int(1.3 * P + RUNTIME))
                        row["share_kind"] = "params P"
                    elif name in ("save", "load"):
                        row = _ratio_row(name, ph["peak"], S, int(1.1 * S + RUNTIME))
                        row["share_kind"] = "state S = 4P"
                    else:
                        row = _ratio_row("train step" + (" (after resume)" if mode == "resume" else " x2"),
                                         ph["peak"], S, None)
                        row["share_kind"] = "state S = 4P"
                    seq = f"({L['dp']}, {L['ep']}) -> ({2 // L['resume_ep']}, {L['resume_ep']})"
                    row.update(layout=f"({r['dp']}, {r['ep']})", sequence=seq,
                               launch="A (train)" if mode == "train" else "B (resume)",
                               rank=r["rank"], seconds=ph["seconds"], rss_before_gib=ph["rss_before"] / GiB)
                    phase_rows.append(row)
                    if row["pass"] is False:
                        failures.append(f"driver phase {name} at ({r['dp']}, {r['ep']}) rank {r['rank']}: peak "
                                        f"{row['peak_gib']:.2f} GiB > budget {row['budget_gib']:.2f} GiB "
                                        f"(+{row['over_gib']:.2f} GiB)")
        for name, res in L["cli"].items():
            if res.get("error"):
                failures.append(f"CLI '{name}' at (DP={L['dp']}, EP={L['ep']}): {res['error']}")
            layout = (L["dp"], L["ep"]) if not name.startswith("resume") else (2 // L["resume_ep"], L["resume_ep"])
            peaks = worker_peaks(res)
            if name.startswith("export"):
                peak = max((p["peak"] for p in res["processes"]), default=0)
                row = _ratio_row(name, peak, model_bytes, None)
                row.update(layout=f"from ({L['dp']}, {L['ep']}) -> ({2 // L['resume_ep']}, {L['resume_ep']})",
                           rank="1 process", share_kind="whole model (fp32)",
                           largest_shard_gib=max(res.get("shards") or [0]) / GiB,
                           n_shards=len(res.get("shards") or []), seconds=res["seconds"])
                row["peak_over_largest_shard"] = (peak / max(res["shards"]) if res.get("shards") else None)
                cli_rows.append(row)
                continue
            ref = {x["rank"]: x for x in shares.get(layout, [])}
            dj = res.get("dry_run_json", {}).get("ranks") if name.startswith("dry-run") else None
            for rank, peak in sorted(peaks.items()):
                base = ref.get(rank) or (next((d for d in dj if d["rank"] == rank), None) if dj else None)
                if base is None:
                    continue
                P = base["param_bytes"]
                S = base.get("state_bytes", 4 * P)
                if name.startswith("dry-run"):
                    row = _ratio_row(name, peak, P, int(1.3 * P + RUNTIME))
                    row["share_kind"] = "params P"
                    if dj:
                        self_rep = next((d for d in dj if d["rank"] == rank), {}).get("peak_measured")
                        row["self_reported_peak_gib"] = self_rep / GiB if self_rep else None
                else:
                    # the whole process: build + train step(s) + save (+ load); the step has no budget in the issue,
                    # so this row is the envelope, not a budget check (the driver's rows check each phase)
                    row = _ratio_row(name, peak, S, None)
                    row["share_kind"] = "state S = 4P"
                row.update(layout=f"({layout[0]}, {layout[1]})", rank=rank, seconds=res["seconds"])
                cli_rows.append(row)
                if row["pass"] is False:
                    failures.append(f"CLI '{name}' at {row['layout']} rank {rank}: whole-process peak "
                                    f"{row['peak_gib']:.2f} GiB > budget {row['budget_gib']:.2f} GiB")
    return phase_rows, cli_rows, failures


def _f(x: Any, fmt: str = "{:.2f}") -> str:
    return "-" if x is None else fmt.format(x)


def render(phase_rows: list[dict], cli_rows: list[dict], failures: list[str]) -> str:
    L = ["Per phase (instrumented driver, VmHWM reset between phases):", "",
         "| sequence | launch | layout (DP, EP) | rank | phase | peak GiB | share | share GiB | peak / share | "
         "budget GiB | budget / share | pass | s |",
         "|---|---|---|---:|---|---:|---|---:|---:|---:|---:|---|---:|"]
    for r in phase_rows:
        L.append(f"| {r['sequence']} | {r['launch']} | {r['layout']} | {r['rank']} | {r['phase']} | {r['peak_gib']:.2f} | "
                 f"{r['share_kind']} | {r['share_gib']:.2f} | **{r['ratio']:.2f}** | {_f(r['budget_gib'])} | "
                 f"{_f(r['budget_ratio'])} | {'-' if r['pass'] is None else ('yes' if r['pass'] else '**NO**')} | "
                 f"{r['seconds']:.0f} |")
    L += ["", "Whole commands (CLI, peak VmHWM of each process over the whole command, polled every 0.1 s):", "",
          "| command | layout (DP, EP) | process | peak GiB | share | share GiB | peak / share | budget GiB | "
          "budget / share | pass | s |",
          "|---|---|---|---:|---|---:|---:|---:|---:|---|---:|"]
    for r in cli_rows:
        extra = ""
        if r.get("self_reported_peak_gib") is not None:
            extra = f" (self-reported {r['self_reported_peak_gib']:.2f})"
        if r.get("peak_over_largest_shard") is not None:
            extra = (f"; {r['n_shards']} shard(s), largest {r['largest_shard_gib']:.2f} GiB: peak / largest shard "
                     f"**{r['peak_over_largest_shard']:.2f}**")
        L.append(f"| {r['phase']} | {r['layout']} | {'rank ' + str(r['rank']) if isinstance(r['rank'], int) else r['rank']}"
                 f" | {r['peak_gib']:.2f}{extra} | {r['share_kind']} | {r['share_gib']:.2f} | **{r['ratio']:.2f}** | "
                 f"{_f(r['budget_gib'])} | {_f(r['budget_ratio'])} | "
                 f"{'-' if r['pass'] is None else ('yes' if r['pass'] else '**NO**')} | {r['seconds']:.0f} |")
    L += ["", "Failures: " + ("none" if not failures else "")]
    L += [f"- {f}" for f in failures]
    return "\n".join(L)


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = ap.add_subparsers(dest="mode_cmd")
    d = sub.add_parser("_driver", help="internal: one rank of the instrumented driver")
    d.add_argument("--mode", choices=["train", "resume"], required=True)
    d.add_argument("--ep", type=int, required=True)
    d.add_argument("--preset", default="small")
    d.add_argument("--experts", type=int, default=104)
    d.add_argument("--ckpt-root", required=True)
    d.add_argument("--json-dir", required=True)
    rk = sub.add_parser("_ranks", help="internal: start the driver's ranks (a torch-free torchrun)")
    rk.add_argument("--nproc", type=int, default=2)
    rk.add_argument("rest", nargs=argparse.REMAINDER)
    cs = sub.add_parser("_ckpt_stats", help="internal: saved-chunk sizes of a DCP checkpoint")
    cs.add_argument("path")
    ap.add_argument("--preset", default="small")
    ap.add_argument("--experts", type=int, default=104, help="model.n_routed_experts (104: 3.08 GiB fp32; "
                    "112: 3.30 GiB)")
    ap.add_argument("--layouts", default="1x2,2x1", help="comma-separated DPxEP layouts of 2 ranks")
    ap.add_argument("--work", help="working directory (default: a temporary one, removed at the end)")
    ap.add_argument("--out", default=str(BENCH_DIR / "results"))
    ap.add_argument("--timeout", type=float, default=1800, help="seconds per command")
    ap.add_argument("--mem-limit-gib", type=float, default=16.5, help="kill a command whose tree RSS exceeds this")
    ap.add_argument("--retries", type=int, default=2, help="reruns of a command stopped because the machine (not "
                    "the command) ran low on memory")
    ap.add_argument("--max-wait", type=float, default=1800, help="seconds to wait for free memory before a command")
    ap.add_argument("--skip-cli", action="store_true")
    ap.add_argument("--skip-driver", action="store_true")
    ap.add_argument("--keep", action="store_true", help="keep the run directories")
    ap.add_argument("--src", help="run every command against this source tree (prepended to PYTHONPATH), e.g. a "
                    "`git archive HEAD src` snapshot while the working tree is being edited")
    ap.add_argument("--src-label", default="", help="what --src is, for the results (e.g. 'git archive ad9330f')")
    a = ap.parse_args(argv)
    if a.mode_cmd == "_driver":
        return driver_main(a)
    if a.mode_cmd == "_ranks":
        a.rest = [x for x in a.rest if x != "--"]
        return ranks_main(a)
    if a.mode_cmd == "_ckpt_stats":
        return _ckpt_stats_main(a)

    sys.path.insert(0, str(BENCH_DIR))
    from common import load1  # noqa: E402 - stdlib only; torch is imported (machine_info) after the runs

    if a.src:
        src = str(Path(a.src).resolve())
        os.environ["PYTHONPATH"] = os.pathsep.join([src, *filter(None, [os.environ.get("PYTHONPATH")])])
    n_params, pkg = count_model(a.preset, a.experts)
    a.model_bytes = 4 * n_params
    print(f"moetrain imported from {pkg}")
    model_bytes = 4 * n_params
    layouts = [tuple(int(x) for x in s.split("x")) for s in a.layouts.split(",") if s]
    for dp, ep in layouts:
        if dp * ep != 2:
            ap.error(f"layout {dp}x{ep}: this benchmark runs 2 ranks (DP x EP = 2)")
    tmp = None
    if a.work:
        work = Path(a.work)
        work.mkdir(parents=True, exist_ok=True)
    else:
        tmp = tempfile.mkdtemp(prefix="moetrain-scale-memory-")
        work = Path(tmp)
    print(f"model: --preset {a.preset} --set model.n_routed_experts={a.experts}: {n_params:,} parameters incl. MTP = "
          f"{model_bytes / GiB:.2f} GiB fp32; work dir {work}")
    t0 = time.time()
    load_start = load1()
    results = []
    try:
        for dp, ep in layouts:
            print(f"layout (DP, EP) = ({dp}, {ep}):")
            results.append(run_layout(dp, ep, a, work))
    finally:
        if tmp:
            shutil.rmtree(tmp, ignore_errors=True)
    phase_rows, cli_rows, failures = tables(results, model_bytes)
    table = render(phase_rows, cli_rows, failures)
    print()
    print(table)

    from common import Settings, machine_info  # noqa: E402
    info = machine_info(Settings())
    stamp = datetime.datetime.now().strftime("%Y%m%d-%H%M%S")
    outdir = Path(a.out)
    outdir.mkdir(parents=True, exist_ok=True)
    cmdline = shlex.join([".venv/bin/python", "benchmarks/scale_memory.py", *(argv if argv is not None else sys.argv[1:])])
    doc = {"command": cmdline, "moetrain_imported_from": pkg, "src_label": a.src_label or None, "machine": info,
           "model": {"preset": a.preset, "n_routed_experts": a.experts,
                                                          "params_incl_mtp": n_params, "fp32_bytes": model_bytes},
           "load_at_start": load_start, "load_at_end": load1(), "total_s": round(time.time() - t0),
           "phase_rows": phase_rows, "cli_rows": cli_rows, "failures": failures, "layouts": results}
    jpath = outdir / f"scale-memory-{stamp}.json"
    jpath.write_text(json.dumps(doc, indent=1, default=str))
    cmds = []
    for L in results:
        for mode, res in L["driver"].items():
            cmds.append(res["cmd"])
        for name, res in L["cli"].items():
            cmds.append(res["cmd"])
    md = [f"# Any model size: memory per phase ({stamp})", "",
          f"Command: `{cmdline}` ({doc['total_s']} s; load average {load_start:.2f} at start, "
          f"{doc['load_at_end']:.2f} at end)", "",
          f"Machine: {info['cpu']}, {info['cores_visible']} cores, {info['mem_gb']} GB, torch {info['torch']}, "
          f"git {info['git']} (of the working tree); moetrain imported from `{pkg}`"
          + (f" ({a.src_label})" if a.src_label else ""), "",
          f"Model: `--preset {a.preset} --set model.n_routed_experts={a.experts}`, {n_params:,} parameters incl. MTP "
          f"= {model_bytes / GiB:.2f} GiB fp32; seq_len 64, micro-batch 2, 2 ranks x 1 thread, CPU (gloo).", "",
          "Share: P = the rank's local parameter bytes, S = 4P (params + grads + 2 AdamW moments). Budgets: build "
          "1.3 P + 0.75 GiB; save and load 1.1 S + 0.75 GiB. Peaks are absolute resident high-water marks (VmHWM).",
          "", table, "", "Commands run (in this order, per layout):", "", "```"] + cmds + ["```", ""]
    (outdir / f"scale-memory-{stamp}.md").write_text("\n".join(md))
    print(f"\nwrote {jpath} and {jpath.with_suffix('.md')}")
    return 1 if failures else 0


if __name__ == "__main__":
    sys.exit(main())
