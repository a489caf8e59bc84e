"""Shared plumbing of the benchmark suite: settings, machine description, load gate, timing, isolated runs.

Every measured system runs in its own fresh Python process (``run_isolated``) so that its peak memory is its own:
on CPU the figure is the kernel's high-water mark of resident memory (``ru_maxrss``) minus the resident memory just
before the model was built (imports excluded); on CUDA it is ``torch.cuda.max_memory_allocated``. The child writes
one JSON result; failures come back as ``{"error": ...}`` instead of stopping the suite.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import os
import platform
import resource
import socket
import statistics
import subprocess
import sys
import tempfile
import time
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

BENCH_DIR = Path(__file__).resolve().parent
REPO = BENCH_DIR.parent
#: TorchTitan's MoE module imports ``triton`` unconditionally; the suite keeps triton (and nothing else) out of the
#: project's venv, in this directory, added to sys.path only in the TorchTitan peer's process.
PEER_SITE = REPO / ".cache" / "bench-peers"


# ----------------------------------------------------------------------------------------------------------------
# Settings shared by every case
# ----------------------------------------------------------------------------------------------------------------

@dataclass
class Settings:
    """What every system is given: same preset, batch, sequence, dtype, threads, device.

    ``dtype`` is the parameter/compute dtype on CPU ("fp32"); on CUDA parameters stay fp32 and compute runs under
    bf16 autocast ("bf16"), the usual mixed-precision recipe, for every system alike.
    """

    preset: str = "small"
    batch: int = 2
    seq_len: int = 256
    threads: int = 2
    device: str = "cpu"
    dtype: str = "fp32"
    warmup: int = 1
    iters: int = 6
    quick: bool = False
    lr: float = 1e-4

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Settings":
        return cls(**{k: v for k, v in d.items() if k in {f.name for f in dataclasses.fields(cls)}})


def setup_process(s: Settings) -> None:
    """Thread count and determinism knobs, identical in every process of the suite."""
    import torch
    torch.set_num_threads(s.threads)
    torch.manual_seed(0)


def torch_dtype(s: Settings):
    import torch
    return {"fp32": torch.float32, "bf16": torch.bfloat16}[s.dtype]


def autocast(s: Settings):
    """bf16 autocast on CUDA (mixed precision, fp32 master weights); a no-op context on CPU fp32."""
    import torch
    enabled = s.device == "cuda" and s.dtype == "bf16"
    return torch.autocast(s.device, dtype=torch.bfloat16, enabled=enabled)


def sync(s: Settings) -> None:
    if s.device == "cuda":
        import torch
        torch.cuda.synchronize()


# ----------------------------------------------------------------------------------------------------------------
# Timing
# ----------------------------------------------------------------------------------------------------------------

def time_fn(fn: Callable[[], Any], s: Settings, warmup: int | None = None, iters: int | None = None,
            min_time: float = 0.0, max_time: float = 30.0) -> dict[str, Any]:
    """Run ``fn`` ``warmup`` times, then ``iters`` timed times (more while their sum is below ``min_time``; fewer,
    but at least 2, once their sum passes ``max_time``, so that a slow peer cannot stretch the suite).

    Returns {"median_s", "min_s", "times_s"}. ``min_s`` (best of N) is the figure every throughput and ratio uses:
    on a machine whose cores are shared, another process's load only ever adds time to a sample, and the
    run-to-run spread of the median measured here (3 samples of a 3 s step) reached 30%.
    """
    warmup = s.warmup if warmup is None else warmup
    iters = s.iters if iters is None else iters
    for _ in range(warmup):
        fn()
    sync(s)
    times: list[float] = []
    while len(times) < iters or (sum(times) < min_time and len(times) < 50):
        if len(times) >= 2 and sum(times) > max_time:
            break
        t0 = time.perf_counter()
        fn()
        sync(s)
        times.append(time.perf_counter() - t0)
    return {"median_s": statistics.median(times), "min_s": min(times), "times_s": [round(t, 6) for t in times]}


# ----------------------------------------------------------------------------------------------------------------
# Memory
# ----------------------------------------------------------------------------------------------------------------

def rss_mb() -> float:
    """Current resident set size of this process, MiB."""
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def peak_rss_mb() -> float:
    """High-water mark of resident memory of this process, MiB (Linux reports KiB)."""
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024


class MemoryProbe:
    """Peak memory of what happens after ``start()``: CUDA max allocated, or CPU peak RSS above the start RSS."""

    def __init__(self, s: Settings):
        self.s = s
        self.base = 0.0

    def start(self) -> None:
        if self.s.device == "cuda":
            import torch
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated() / 2**20
        else:
            self.base = rss_mb()

    def peak_mb(self) -> dict[str, Any]:
        if self.s.device == "cuda":
            import torch
            return {"peak_mem_mb": torch.cuda.max_memory_allocated() / 2**20 - self.base,
                    "peak_mem_kind": "cuda max_memory_allocated above start"}
        return {"peak_mem_mb": peak_rss_mb() - self.base, "peak_mem_kind": "peak RSS above RSS before build"}


# ----------------------------------------------------------------------------------------------------------------
# Machine and load
# ----------------------------------------------------------------------------------------------------------------

def load1() -> float:
    with open("/proc/loadavg") as f:
        return float(f.read().split()[0])


def wait_for_quiet(threshold: float, max_wait_s: float, poll_s: float = 20.0, log: Callable[[str], None] = print
                   ) -> dict[str, Any]:
    """Wait until the 1-minute load average is below ``threshold`` (others share this machine's cores).

    Returns {"load_at_start", "waited_s", "quiet"}; after ``max_wait_s`` it measures anyway and says so.
    """
    t0 = time.time()
    first = load1()
    while True:
        cur = load1()
        if cur < threshold:
            return {"load_at_start": cur, "load_when_called": first, "waited_s": round(time.time() - t0), "quiet": True}
        if time.time() - t0 >= max_wait_s:
            log(f"  load {cur:.2f} still >= {threshold} after {max_wait_s:.0f} s; measuring anyway (flagged)")
            return {"load_at_start": cur, "load_when_called": first, "waited_s": round(time.time() - t0),
                    "quiet": False}
        log(f"  waiting for a quiet machine: 1-min load {cur:.2f} >= {threshold} ...")
        time.sleep(poll_s)


class Gate:
    """Called before every measured system: waits for a quiet machine (unless disabled) and returns the load."""

    def __init__(self, threshold: float = 0.7, max_wait_s: float = 300, enabled: bool = True,
                 log: Callable[[str], None] = print):
        self.threshold, self.max_wait_s, self.enabled, self.log = threshold, max_wait_s, enabled, log

    def __call__(self) -> dict[str, Any]:
        if not self.enabled:
            cur = load1()
            return {"load_at_start": cur, "waited_s": 0, "quiet": cur < self.threshold}
        return wait_for_quiet(self.threshold, self.max_wait_s, log=self.log)


def no_gate() -> dict[str, Any]:
    return {"load_at_start": load1(), "waited_s": 0, "quiet": None}


def machine_info(s: Settings) -> dict[str, Any]:
    import torch
    cpu = "unknown"
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    cpu = line.split(":", 1)[1].strip()
                    break
    except OSError:
        pass
    flags = ""
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    fl = line.split(":", 1)[1].split()
                    flags = " ".join(sorted(x for x in fl if x.startswith(("avx512f", "avx512_bf16", "amx", "avx2"))))
                    break
    except OSError:
        pass
    mem_gb = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2**30
    info: dict[str, Any] = {
        "hostname": socket.gethostname(),
        "cpu": cpu,
        "cpu_flags": flags,
        "cores_visible": len(os.sched_getaffinity(0)),
        "mem_gb": round(mem_gb, 1),
        "python": platform.python_version(),
        "torch": torch.__version__,
        "threads": s.threads,
        "date": datetime.datetime.now().astimezone().isoformat(timespec="seconds"),
    }
    for mod in ("transformers", "torchtitan"):
        try:
            info[mod] = __import__(mod).__version__
        except Exception as e:  # noqa: BLE001 - recorded, not fatal
            info[mod] = f"unavailable ({type(e).__name__})"
    if torch.cuda.is_available():
        info["gpu"] = torch.cuda.get_device_name(0)
        info["gpu_count"] = torch.cuda.device_count()
        info["cuda"] = torch.version.cuda
    try:
        rev = subprocess.run(["git", "rev-parse", "--short", "HEAD"], cwd=REPO, capture_output=True, text=True,
                             timeout=10).stdout.strip()
        dirty = subprocess.run(["git", "status", "--porcelain", "--", "src"], cwd=REPO, capture_output=True,
                               text=True, timeout=10).stdout.strip()
        info["git"] = rev + ("+dirty(src)" if dirty else "")
    except Exception:  # noqa: BLE001
        info["git"] = "unknown"
    return info


def machine_tag(info: dict[str, Any]) -> str:
    if "gpu" in info:
        name = info["gpu"].replace("NVIDIA ", "")
    else:
        name = f"{info['cpu']}-{info['cores_visible']}c"
    return "".join(c if c.isalnum() or c in "-_." else "-" for c in name).strip("-").lower()


# ----------------------------------------------------------------------------------------------------------------
# Isolated runs
# ----------------------------------------------------------------------------------------------------------------

def run_isolated(target: str, spec: dict[str, Any], timeout: float = 600, extra_path: list[str] | None = None
                 ) -> dict[str, Any]:
    """Run ``module:function(spec)`` in a fresh Python process; return its JSON-able dict result.

    The child prints nothing we need; its result (or ``{"error": ...}``) comes back through a temporary file.
    ``extra_path`` entries are prepended to the child's sys.path (e.g. ``PEER_SITE`` for TorchTitan).
    """
    with tempfile.TemporaryDirectory(prefix="moetrain-bench-") as d:
        spec_path, out_path = Path(d) / "spec.json", Path(d) / "out.json"
        spec_path.write_text(json.dumps(spec))
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(BENCH_DIR), *(extra_path or []), env.get("PYTHONPATH", "")])
        threads = str(spec.get("settings", {}).get("threads", 2))
        env.setdefault("OMP_NUM_THREADS", threads)
        cmd = [sys.executable, str(BENCH_DIR / "common.py"), "--child", target, str(spec_path), str(out_path)]
        t0 = time.time()
        try:
            proc = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=timeout)
        except subprocess.TimeoutExpired:
            return {"error": f"timed out after {timeout:.0f} s"}
        if out_path.exists():
            res = json.loads(out_path.read_text())
        else:
            tail = (proc.stderr or proc.stdout or "")[-2000:]
            res = {"error": f"child exited with {proc.returncode} and no result: {tail}"}
        res.setdefault("process_s", round(time.time() - t0, 1))
        return res


def _child_main(target: str, spec_path: str, out_path: str) -> None:
    import importlib
    import warnings
    warnings.filterwarnings("ignore")
    spec = json.loads(Path(spec_path).read_text())
    mod_name, fn_name = target.split(":")
    try:
        mod = importlib.import_module(mod_name)
        res = getattr(mod, fn_name)(spec)
    except BaseException as e:  # noqa: BLE001 - returned to the parent, recorded in the results
        msg = f"{type(e).__name__}: {e}"
        res = {"error": msg[:1500], "traceback": traceback.format_exc()[-3000:]}
    Path(out_path).write_text(json.dumps(res, default=_json_default))


def _json_default(o: Any) -> Any:
    try:
        import torch
        if isinstance(o, torch.Tensor):
            return o.tolist()
    except ImportError:
        pass
    return str(o)


# ----------------------------------------------------------------------------------------------------------------
# Data
# ----------------------------------------------------------------------------------------------------------------

def batch_tokens(s: Settings, vocab: int, seed: int = 1234):
    """Deterministic (inputs, next-token labels) of shape (batch, seq_len), on the settings' device."""
    import torch
    g = torch.Generator().manual_seed(seed)
    data = torch.randint(0, vocab, (s.batch, s.seq_len + 1), generator=g)
    x, y = data[:, :-1].contiguous(), data[:, 1:].contiguous()
    return x.to(s.device), y.to(s.device)


def fmt_rate(x: float | None, unit: str = "") -> str:
    if x is None:
        return "-"
    for div, suf in ((1e12, "T"), (1e9, "G"), (1e6, "M"), (1e3, "k")):
        if abs(x) >= div:
            return f"{x / div:.2f} {suf}{unit}"
    return f"{x:.2f} {unit}"


if __name__ == "__main__":
    if len(sys.argv) == 5 and sys.argv[1] == "--child":
        _child_main(sys.argv[2], sys.argv[3], sys.argv[4])
    else:
        print("internal entry point of the benchmark suite; run benchmarks/run_all.py", file=sys.stderr)
        sys.exit(2)
