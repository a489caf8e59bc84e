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
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

import torch

from moetrain.parallel.imbalance import ImbalanceStep


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


@dataclass
class StepMetrics:
    """The one metrics record of training steps: figures of the optimizer step ``step`` and of the window of steps
    since the previous record (throughput, communication, bubble). Console, JSONL and TensorBoard read it
    (:meth:`MetricsSink.log_step`); the JSONL keys are the field names, in this order, after ``"kind": "train"``.

    Attributes:
        step: optimizer steps done.
        loss, lm_loss, mtp_loss, balance_loss, grad_norm: the step's objective and terms
            (``moetrain.train.step.StepResult``).
        lr: the step's learning rate.
        tokens_per_s_per_gpu, tflops_per_gpu, mfu: the window's throughput per rank (Megatron-Core FLOPs; MFU
            against the device peak).
        step_time_s: wall seconds per step in the window (evaluation and checkpoints excluded).
        a2a_s_per_step, a2a_exposed_s_per_step: all-to-all seconds per step, and those the compute waited for.
        a2a_exposed_share: exposed / total all-to-all time; a2a_share_of_step: exposed time / window time.
        a2a_s_per_layer, a2a_exposed_s_per_layer: the same per MoE layer of this rank, per step.
        a2a_s_per_layer_phase: per MoE layer, {phase: [a2a s, exposed s]} per step (``DispatchStats.PHASES``).
        dispatch_bytes_per_step, dispatch_remote_bytes_per_step: dispatched rows' bytes, all and to other ranks.
        pp_bubble_s_per_step, pp_bubble_share: measured pipeline bubble per step and as a share of the window.
        pp_bubble_formula: the schedule's textbook bubble fraction.
        load_imbalance_max, load_imbalance: max / mean tokens per expert, the largest and per MoE layer.
        dropped_tokens: token-expert assignments dropped by a capacity limit in the step.
        peak_mem_gb: peak memory of this process.
        expert_load: (M, E) tokens per expert of the step, summed over ranks.
        ep_rows_imbalance_max, ep_rows_imbalance: max / mean rows per EP rank (rows its experts computed: one per
            token-expert assignment, ``moetrain.parallel.imbalance``), the largest and per MoE layer of this
            rank's stage, in the step; ep_rows_imbalance_step: the same of the rows summed over those layers;
            ep_rows_per_rank: those rows, [layer][EP rank].
        imbalance_lost_ms, imbalance_lost_share: time per step lost to expert-load imbalance (expert time against
            the mean and the combine wait it caused, measured; summed over this rank's MoE layers), and as a share
            of the window's step time; imbalance_lost_share_per_layer: the same per MoE layer.
        imbalance_expert_ms, imbalance_combine_wait_ms: its two measurements per step, summed over layers: max -
            mean expert time over the EP ranks, and the largest combine wait beyond the least.
        imbalance_moe_layers: global MoE index of each entry of the per-layer imbalance lists.
    """

    step: int
    loss: float
    lm_loss: float
    mtp_loss: float
    balance_loss: float
    grad_norm: float
    lr: float
    tokens_per_s_per_gpu: float
    tflops_per_gpu: float
    mfu: float
    step_time_s: float
    a2a_s_per_step: float
    a2a_exposed_s_per_step: float
    a2a_exposed_share: float
    a2a_share_of_step: float
    a2a_s_per_layer: list[float]
    a2a_exposed_s_per_layer: list[float]
    a2a_s_per_layer_phase: list[dict[str, list[float]]]
    dispatch_bytes_per_step: float
    dispatch_remote_bytes_per_step: float
    pp_bubble_s_per_step: float
    pp_bubble_share: float
    pp_bubble_formula: float
    load_imbalance_max: float
    load_imbalance: list[float]
    dropped_tokens: int
    peak_mem_gb: float
    expert_load: list[list[int]]
    ep_rows_imbalance_max: float = 1.0
    ep_rows_imbalance: list[float] = field(default_factory=list)
    ep_rows_imbalance_step: float = 1.0
    ep_rows_per_rank: list[list[int]] = field(default_factory=list)
    imbalance_lost_ms: float = 0.0
    imbalance_lost_share: float = 0.0
    imbalance_lost_share_per_layer: list[float] = field(default_factory=list)
    imbalance_expert_ms: float = 0.0
    imbalance_combine_wait_ms: float = 0.0
    imbalance_moe_layers: list[int] = field(default_factory=list)

    def record(self) -> dict[str, Any]:
        """The JSONL record: ``{"kind": "train", <field>: <value>, ...}``."""
        return {"kind": "train", **asdict(self)}

    def console_line(self, pipelined: bool) -> str:
        """The console's line of the step; ``pipelined`` adds the measured and the formula's bubble."""
        return (f"step {self.step:>5} | loss {self.loss:.4f} (lm {self.lm_loss:.3f} mtp {self.mtp_loss:.3f} bal "
                f"{self.balance_loss:.3f}) | gnorm {self.grad_norm:.2f} | lr {self.lr:.2e} | "
                f"{self.tokens_per_s_per_gpu:,.0f} tok/s/gpu | {self.tflops_per_gpu:.4f} TFLOP/s/gpu | MFU "
                f"{100 * self.mfu:.1f}% | a2a {1e3 * self.a2a_s_per_step:.1f} ms/step "
                f"({100 * self.a2a_exposed_share:.0f}% exposed) | load max/mean {self.load_imbalance_max:.2f}"
                f" | lost {100 * self.imbalance_lost_share:.0f}% (imb)"
                f" | drop {self.dropped_tokens} | mem {self.peak_mem_gb:.2f} GB"
                + (f" | bubble {100 * self.pp_bubble_share:.0f}% (formula {100 * self.pp_bubble_formula:.0f}%)"
                   if pipelined else ""))


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
            layers = record.get("imbalance_moe_layers", [])
            for m, share, rows in zip(layers, record.get("imbalance_lost_share_per_layer", []),
                                      record.get("ep_rows_imbalance", [])):
                self.tb.add_scalar(f"imbalance/moe{m}/lost_share", share, step)
                self.tb.add_scalar(f"imbalance/moe{m}/ep_rows_max_over_mean", rows, step)

    def log_step(self, m: StepMetrics, pipelined: bool) -> None:
        """One step's metrics: the JSONL record, its TensorBoard scalars and the console line."""
        self.write(m.record())
        self.print(m.console_line(pipelined))

    def print(self, text: str) -> None:
        self.console.print(text, markup=False)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.jsonl.close()
        if self.tb is not None:
            self.tb.close()


class NullSink:
    """The sink of the ranks that write nothing (all but rank 0): every method of :class:`MetricsSink`, doing
    nothing."""

    def start_progress(self, total: int, completed: int) -> None:
        pass

    def advance(self, status: str = "") -> None:
        pass

    def write(self, record: dict[str, Any]) -> None:
        pass

    def log_step(self, m: StepMetrics, pipelined: bool) -> None:
        pass

    def print(self, text: str) -> None:
        pass

    def close(self) -> None:
        pass


def load_imbalance(tokens_per_expert_ME: torch.Tensor) -> list[float]:
    """max / mean tokens per expert, per MoE layer (1.0 = perfectly balanced)."""
    loads = tokens_per_expert_ME.float()
    return (loads.max(dim=1).values / loads.mean(dim=1).clamp(min=1e-9)).tolist()


class ImbalanceWindow:
    """Time lost to expert-load imbalance over the steps of one metrics window (sums of each step's
    :class:`~moetrain.parallel.imbalance.ImbalanceStep`), and the latest step's rows per EP rank."""

    def __init__(self) -> None:
        self.lost_s_M: list[float] = []
        self.expert_s = self.wait_s = 0.0
        self.last: ImbalanceStep | None = None

    def reset(self) -> None:
        self.lost_s_M, self.expert_s, self.wait_s, self.last = [], 0.0, 0.0, None

    def add(self, step: ImbalanceStep | None) -> None:
        if step is None:
            return
        lost = step.lost_s()
        if len(lost) != len(self.lost_s_M):
            self.lost_s_M = [0.0] * len(lost)
        self.lost_s_M = [a + b for a, b in zip(self.lost_s_M, lost)]
        self.expert_s += sum(step.expert_gap_s())
        self.wait_s += sum(step.wait_caused_s())
        self.last = step

    def fields(self, n_steps: int, window_s: float) -> dict[str, Any]:
        """The imbalance fields of :class:`StepMetrics` for a window of ``n_steps`` steps lasting ``window_s``
        seconds, then start a new window."""
        if self.last is None:
            return {}
        rows = self.last.rows_max_over_mean()
        lost = sum(self.lost_s_M)
        out = dict(ep_rows_imbalance_max=max(rows) if rows else 1.0, ep_rows_imbalance=rows,
                   ep_rows_imbalance_step=self.last.rows_step_max_over_mean(),
                   ep_rows_per_rank=self.last.rows_MR, imbalance_lost_ms=1e3 * lost / n_steps,
                   imbalance_lost_share=lost / window_s if window_s > 0 else 0.0,
                   imbalance_lost_share_per_layer=[v / window_s if window_s > 0 else 0.0 for v in self.lost_s_M],
                   imbalance_expert_ms=1e3 * self.expert_s / n_steps,
                   imbalance_combine_wait_ms=1e3 * self.wait_s / n_steps,
                   imbalance_moe_layers=self.last.moe_layers)
        self.reset()
        return out
