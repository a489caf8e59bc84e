"""Throughput accounting (TFLOP/s per GPU, MFU) and metric sinks (console, JSONL, TensorBoard).

TFLOP/s per GPU uses the Megatron-Core FLOPs formula (:mod:`moetrain.accounting`), the accounting of the published
DeepSeek-V3 record, so the numbers compare. MFU divides it by the device's dense peak: the datasheet rate from the
GPU catalogue of :mod:`moetrain.plan.hardware`; on a CPU, the rate of a matmul probe measured at start-up (labelled
``cpu-probe``), since CPUs have no meaningful datasheet peak for this purpose.
"""

from __future__ import annotations

import json
import resource
import sys
import time
from pathlib import Path
from typing import Any

import torch

def matmul_probe_tflops(device: torch.device, dtype: torch.dtype = torch.float32, n: int = 1024,
                        repeats: int = 5) -> float:
    """Measured dense matmul rate of this process (TFLOP/s), the CPU's practical peak for MFU."""
    a = torch.randn(n, n, device=device, dtype=dtype)
    b = torch.randn(n, n, device=device, dtype=dtype)
    a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    t = time.perf_counter()
    for _ in range(repeats):
        a @ b
    if device.type == "cuda":
        torch.cuda.synchronize()
    return 2 * n ** 3 * repeats / (time.perf_counter() - t) / 1e12


def device_peak(device: torch.device, dtype: torch.dtype | None) -> tuple[float, str]:
    """(peak TFLOP/s, label) used for MFU on ``device``: the datasheet dense rate of the performance model's GPU
    catalogue (:mod:`moetrain.plan.hardware`, the one table of GPU peaks), bf16 under bf16 autocast else the FP32
    (non-tensor-core) rate; GPUs the catalogue lacks, and CPUs, get a measured matmul probe."""
    if device.type == "cuda":
        from moetrain.plan.hardware import gpu_for_device_name

        name = torch.cuda.get_device_name(device)
        spec = gpu_for_device_name(name)
        if spec is not None:
            precision = "bf16" if dtype == torch.bfloat16 else "fp32"
            return spec.peak(precision) / 1e12, f"{spec.name.upper()} datasheet {precision}"
        return matmul_probe_tflops(device, dtype or torch.float32, 8192), f"{name} matmul probe"
    return matmul_probe_tflops(device), "cpu-probe"


def peak_memory_gb(device: torch.device) -> float:
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6  # Linux reports KiB


class MetricsSink:
    """Writes metrics to ``out_dir/metrics.jsonl``, TensorBoard (optional) and the console. Rank 0 only."""

    def __init__(self, out_dir: str | Path, tensorboard: bool = True, resume_step: int = 0):
        """``resume_step > 0``: continue a run, dropping records logged after that step by the interrupted run (they
        are about to be logged again), so every step appears once."""
        self.dir = Path(out_dir)
        self.dir.mkdir(parents=True, exist_ok=True)
        path = self.dir / "metrics.jsonl"
        if resume_step and path.is_file():
            kept = [line for line in path.read_text().splitlines()
                    if line.strip() and json.loads(line).get("step", 0) <= resume_step]
            tmp = path.with_suffix(".jsonl.tmp")
            tmp.write_text("".join(line + "\n" for line in kept))
            tmp.replace(path)
        self.jsonl = open(path, "a" if resume_step else "w")
        self.tb = None
        if tensorboard:
            from torch.utils.tensorboard import SummaryWriter
            self.tb = SummaryWriter(str(self.dir / "tensorboard"), purge_step=resume_step + 1 if resume_step else None)
        from rich.console import Console
        self.console = Console(file=sys.stdout, highlight=False, soft_wrap=True)
        self.progress = None
        self._task = None

    def start_progress(self, total: int, completed: int) -> None:
        """A live progress bar (steps, elapsed, remaining) when the console is a terminal; log lines scroll above."""
        if not self.console.is_terminal:
            return
        from rich.progress import BarColumn, MofNCompleteColumn, Progress, TextColumn, TimeElapsedColumn, \
            TimeRemainingColumn
        self.progress = Progress(TextColumn("training"), BarColumn(), MofNCompleteColumn(), TimeElapsedColumn(),
                                 TimeRemainingColumn(), TextColumn("{task.fields[status]}"), console=self.console)
        self._task = self.progress.add_task("train", total=total, completed=completed, status="")
        self.progress.start()

    def advance(self, status: str = "") -> None:
        if self.progress is not None:
            self.progress.update(self._task, advance=1, status=status)

    def write(self, record: dict[str, Any]) -> None:
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.tb is not None:
            step = record.get("step", 0)
            for k, v in record.items():
                if isinstance(v, (int, float)) and k != "step":
                    self.tb.add_scalar(f"{record.get('kind', 'train')}/{k}", v, step)
            for m, phases in enumerate(record.get("a2a_s_per_layer_phase", [])):
                for phase, (total, exposed) in phases.items():
                    self.tb.add_scalar(f"a2a/moe{m}/{phase}/total_s", total, step)
                    self.tb.add_scalar(f"a2a/moe{m}/{phase}/exposed_s", exposed, step)

    def print(self, text: str) -> None:
        self.console.print(text, markup=False)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


def load_imbalance(tokens_per_expert_ME: torch.Tensor) -> list[float]:
    """max / mean tokens per expert, per MoE layer (1.0 = perfectly balanced)."""
    loads = tokens_per_expert_ME.float()
    return (loads.max(dim=1).values / loads.mean(dim=1).clamp(min=1e-9)).tolist()
