"""Throughput accounting (TFLOP/s per GPU, MFU), the metric names (:data:`TRAIN_METRICS`) and the metric sink
(console, JSONL, and the trackers of :mod:`moetrain.train.trackers`: TensorBoard, W&B).

TFLOP/s per GPU uses the Megatron-Core FLOPs formula (:mod:`moetrain.accounting`), the accounting of the published
DeepSeek-V3 record, so the numbers compare. MFU divides it by the device's dense peak: the datasheet rate from the
GPU catalogue of :mod:`moetrain.plan.hardware`; on a CPU, the rate of a matmul probe measured at start-up (labelled
``cpu-probe``), since CPUs have no meaningful datasheet peak for this purpose.
"""

from __future__ import annotations

import json
import math
import resource
import sys
import time
from dataclasses import asdict, dataclass, field
from enum import Enum
from pathlib import Path
from typing import Any

import torch

from moetrain.parallel.a2a_telemetry import A2AStep
from moetrain.parallel.imbalance import ImbalanceStep
from moetrain.train.trackers import TensorBoardTracker, Tracker, WandbTracker, tracker_scalars

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


class MemoryKind(str, Enum):
    """Which memory ``peak_mem_gb`` measures: on a GPU the caching allocator's peak of allocated tensors
    (``torch.cuda.max_memory_allocated``), on a CPU the process's peak resident set (``ru_maxrss``: tensors, the
    Python heap and libraries)."""

    GPU_PEAK_ALLOCATED = "gpu_peak_allocated"
    CPU_PEAK_RSS = "cpu_peak_rss"

    @property
    def label(self) -> str:
        """The console's words for it."""
        return "peak allocated" if self is MemoryKind.GPU_PEAK_ALLOCATED else "peak RSS"


def peak_memory_gb(device: torch.device) -> tuple[float, MemoryKind]:
    """(peak memory of this process in GB (1e9 bytes), which memory it is) on ``device``."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device) / 1e9, MemoryKind.GPU_PEAK_ALLOCATED
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1e6, MemoryKind.CPU_PEAK_RSS  # Linux: KiB


@dataclass(frozen=True)
class Metric:
    """One metric's name everywhere: ``key`` in the JSONL record, ``<kind>/<key>`` in TensorBoard and W&B
    (:func:`moetrain.train.trackers.tracker_scalars`), ``label`` on the console line."""

    key: str
    label: str
    doc: str


#: The metrics of a "train" record, in record order: the one table of their names (console, JSONL, TensorBoard,
#: W&B) and meanings. ``loss = lm_loss + mtp_term + balance_term``; validation is LM only, comparable with lm_loss.
TRAIN_METRICS: tuple[Metric, ...] = (
    Metric("step", "step", "optimizer steps done"),
    Metric("loss", "loss", "the step's objective, lm_loss + mtp_term + balance_term"),
    Metric("lm_loss", "lm", "next-token cross-entropy (what validation measures)"),
    Metric("mtp_loss", "mtp CE", "mean multi-token-prediction cross-entropy over the depths, before its weight"),
    Metric("balance_loss", "bal raw", "sequence-wise balance loss summed over MoE layers, before its coefficient"),
    Metric("grad_norm", "gnorm", "global gradient L2 norm before clipping"),
    Metric("lr", "lr", "learning rate of the step"),
    Metric("tokens_per_s_per_gpu", "tok/s/gpu", "training tokens per second per rank over the window"),
    Metric("tflops_per_gpu", "TFLOP/s/gpu", "model TFLOP/s per rank (Megatron-Core FLOPs formula)"),
    Metric("mfu", "MFU", "tflops_per_gpu / the device's dense peak"),
    Metric("step_time_s", "step time", "wall seconds per step over the window (evaluation, checkpoints excluded)"),
    Metric("a2a_s_per_step", "a2a", "expert all-to-all seconds per step (dispatch and combine, both passes), "
           "summed over the MoE layers; under PP over those of the pipeline rank with the most exposed seconds"),
    Metric("a2a_exposed_s_per_step", "a2a exposed", "all-to-all seconds per step the compute waited for (the same "
           "layers)"),
    Metric("a2a_exposed_share", "exposed", "a2a_exposed_s_per_step / a2a_s_per_step"),
    Metric("a2a_launch_s_per_step", "a2a launch", "host seconds per step in the all-to-alls' issue calls (their "
           "launch, not part of a2a_s_per_step; the same layers)"),
    Metric("a2a_share_of_step", "of step", "a2a_exposed_s_per_step / step_time_s: the step time lost to it"),
    Metric("a2a_s_per_layer", "a2a per layer", "all-to-all seconds per step per MoE layer (every stage's under PP, "
           "in global MoE order)"),
    Metric("a2a_exposed_s_per_layer", "a2a exposed per layer", "exposed all-to-all seconds per step per MoE layer"),
    Metric("a2a_s_per_layer_phase", "a2a per phase", "per MoE layer, {phase: [a2a s, exposed s]} per step"),
    Metric("dispatch_bytes_per_step", "dispatch bytes", "bytes of the dispatched token rows per step, summed over "
           "the MoE layers (of every stage under PP)"),
    Metric("dispatch_remote_bytes_per_step", "remote bytes", "dispatch_bytes_per_step sent to other ranks"),
    Metric("param_gather_bytes_per_step", "param gather bytes", "bytes this rank received per step for the "
           "parameters: FSDP2's all-gathers, and with fp8_param the FP8 weights' scale exchange"),
    Metric("pp_bubble_s_per_step", "bubble s", "measured pipeline bubble seconds per step"),
    Metric("pp_bubble_share", "bubble", "pp_bubble_s_per_step / step_time_s"),
    Metric("pp_bubble_formula", "formula", "the schedule's textbook bubble fraction"),
    Metric("load_imbalance_max", "load max/mean", "largest max/mean tokens per expert over the MoE layers"),
    Metric("load_imbalance", "load per layer", "max/mean tokens per expert per MoE layer"),
    Metric("dropped_tokens", "drop", "token-expert assignments dropped by a capacity limit in the step"),
    Metric("peak_mem_gb", "mem", "peak memory of this process in GB, of the kind peak_mem_kind says"),
    Metric("expert_load", "expert load", "(M, E) tokens per expert of the step, summed over ranks"),
    Metric("total_steps", "of", "the run's last step (train.steps)"),
    Metric("mtp_term", "mtp", "mtp_loss times model.mtp_loss_weight: the MTP part of loss"),
    Metric("balance_term", "bal", "balance_loss times model.balance_loss_alpha: the balance part of loss"),
    Metric("eta_s", "ETA", "estimated seconds to the last step at this run's pace (evaluation, checkpoints in)"),
    Metric("peak_mem_kind", "mem kind", "which memory peak_mem_gb is (MemoryKind)"),
    Metric("ep_rows_imbalance_max", "rows max/mean", "max / mean rows per EP rank (one row per token-expert "
           "assignment its experts computed), the largest over the MoE layers (of every stage) in the step"),
    Metric("ep_rows_imbalance", "rows max/mean per layer", "max / mean rows per EP rank, per MoE layer"),
    Metric("ep_rows_imbalance_step", "rows max/mean step", "max / mean rows per EP rank, rows summed over layers "
           "(under PP over each pipeline rank's layers, the largest)"),
    Metric("ep_rows_per_rank", "rows per rank", "rows each EP rank's experts computed, [layer][EP rank]"),
    Metric("imbalance_lost_ms", "lost ms", "ms per step lost to expert-load imbalance (expert time against the mean "
           "plus the combine wait it caused, measured, summed over the MoE layers; under PP over the layers of the "
           "pipeline rank that lost most)"),
    Metric("imbalance_lost_share", "lost", "share of the step time lost to expert-load imbalance"),
    Metric("imbalance_lost_share_per_layer", "lost per layer", "share of the step lost to imbalance, per MoE layer"),
    Metric("imbalance_expert_ms", "imb expert ms", "max - mean expert compute time over EP ranks, ms per step"),
    Metric("imbalance_combine_wait_ms", "imb wait ms", "largest combine wait beyond the least, ms per step"),
    Metric("imbalance_moe_layers", "imb layers", "global MoE index of each entry of the per-layer imbalance lists"),
)
#: The metrics of a "val" record (after its ``step``).
VAL_METRICS: tuple[Metric, ...] = (
    Metric("val_loss", "val lm loss", "next-token cross-entropy on the held-out split (LM only, as lm_loss)"),
    Metric("val_ppl", "val ppl", "exp(val_loss): the validation perplexity"),
)
#: The extra metric of a "val" record of a weighted mixture (``data.sources``; after the VAL_METRICS).
VAL_MIXTURE_METRICS: tuple[Metric, ...] = (
    Metric("val_loss_by_source", "val lm loss by source", "{source label: next-token cross-entropy on its own "
           "held-out split}; val_loss is their mean weighted by the mixture's normalised weights"),
)
METRICS: dict[str, Metric] = {m.key: m for m in TRAIN_METRICS + VAL_METRICS + VAL_MIXTURE_METRICS}


def val_record(step: int, val_loss: float, by_source: dict[str, float] | None = None) -> dict[str, Any]:
    """The JSONL record of one validation: ``{"kind": "val", "step": ..., <VAL_METRICS keys>}``, and for a mixture
    (``by_source`` given) ``val_loss_by_source``: {source label: its loss}."""
    rec = {"kind": "val", "step": step, "val_loss": val_loss, "val_ppl": math.exp(min(val_loss, 700.0))}
    if by_source:
        rec["val_loss_by_source"] = dict(by_source)
    return rec


def val_line(step: int, total_steps: int, val_loss: float) -> str:
    """The console line of one validation, labelled from :data:`VAL_METRICS`."""
    rec = val_record(step, val_loss)
    return " | ".join(map(str, [LogField.of("step", f"{step:>5}/{total_steps}"),
                                LogField.of("val_loss", f"{val_loss:.4f}"),
                                LogField.of("val_ppl", f"{rec['val_ppl']:.2f}")]))


@dataclass(frozen=True)
class LogField:
    """One labelled field of a console line: ``label value``."""

    label: str
    value: str

    @classmethod
    def of(cls, key: str, value: str) -> LogField:
        """The field of metric ``key``, labelled by :data:`TRAIN_METRICS`."""
        return cls(METRICS[key].label, value)

    def __str__(self) -> str:
        return f"{self.label} {self.value}"


def format_duration(seconds: float) -> str:
    """``3725.0`` -> ``"1h02m05s"``, ``65`` -> ``"1m05s"``, ``4.2`` -> ``"4s"``."""
    s = int(round(seconds))
    h, m = s // 3600, s % 3600 // 60
    return f"{h}h{m:02d}m{s % 60:02d}s" if h else f"{m}m{s % 60:02d}s" if m else f"{s}s"


def format_step_time(seconds: float) -> str:
    """Milliseconds below 10 s, else seconds: ``0.5123`` -> ``"512 ms"``, ``12.3`` -> ``"12.3 s"``."""
    return f"{1e3 * seconds:,.0f} ms" if seconds < 10 else f"{seconds:.1f} s"


@dataclass
class StepMetrics:
    """The one metrics record of training steps: figures of the optimizer step ``step`` and of the window of steps
    since the previous record (throughput, communication, bubble). Console, JSONL, TensorBoard and W&B read it
    (:meth:`MetricsSink.log_step`); the JSONL keys are the field names, in this order, after ``"kind": "train"``,
    each named and described in :data:`TRAIN_METRICS` (the tests hold the two equal)."""

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
    a2a_launch_s_per_step: float
    a2a_share_of_step: float
    a2a_s_per_layer: list[float]
    a2a_exposed_s_per_layer: list[float]
    a2a_s_per_layer_phase: list[dict[str, list[float]]]
    dispatch_bytes_per_step: float
    dispatch_remote_bytes_per_step: float
    param_gather_bytes_per_step: float
    pp_bubble_s_per_step: float
    pp_bubble_share: float
    pp_bubble_formula: float
    load_imbalance_max: float
    load_imbalance: list[float]
    dropped_tokens: int
    peak_mem_gb: float
    expert_load: list[list[int]]
    total_steps: int
    mtp_term: float
    balance_term: float
    eta_s: float
    peak_mem_kind: MemoryKind
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
        """The JSONL record: ``{"kind": "train", <field>: <value>, ...}`` (``peak_mem_kind`` as its string)."""
        return {"kind": "train", **asdict(self), "peak_mem_kind": self.peak_mem_kind.value}

    def console_fields(self, pipelined: bool, moves_tokens: bool = True) -> list[LogField]:
        """The console line's labelled fields, in order; ``pipelined`` adds the measured and the formula's bubble.
        Without ``moves_tokens`` (EP 1 with the local dispatcher, :attr:`ParallelConfig.moves_tokens`) the
        all-to-all and the time lost to imbalance are left out: no token leaves the rank, both are 0 by
        construction (the JSONL keeps them). A new figure is one more entry here (and its :data:`TRAIN_METRICS`
        row)."""
        f = LogField.of
        fields = [
            f("step", f"{self.step:>5}/{self.total_steps}"),
            f("loss", f"{self.loss:.4f} = {f('lm_loss', f'{self.lm_loss:.4f}')} + "
                      f"{f('mtp_term', f'{self.mtp_term:.4f}')} + {f('balance_term', f'{self.balance_term:.4f}')}"),
            f("grad_norm", f"{self.grad_norm:.2f}"),
            f("lr", f"{self.lr:.2e}"),
            f("step_time_s", format_step_time(self.step_time_s)),
            f("tokens_per_s_per_gpu", f"{self.tokens_per_s_per_gpu:,.0f}"),
            f("tflops_per_gpu", f"{self.tflops_per_gpu:.4f}"),
            f("mfu", f"{100 * self.mfu:.1f}%"),
            f("eta_s", format_duration(self.eta_s)),
            *([f("a2a_s_per_step", f"{1e3 * self.a2a_s_per_step:.1f} ms/step ({100 * self.a2a_exposed_share:.0f}% "
                                   f"exposed = {100 * self.a2a_share_of_step:.1f}% of step)")] if moves_tokens else []),
            f("load_imbalance_max", f"{self.load_imbalance_max:.2f}"),
            *([f("imbalance_lost_share", f"{100 * self.imbalance_lost_share:.0f}% (imb)")] if moves_tokens else []),
            f("dropped_tokens", f"{self.dropped_tokens}"),
            f("peak_mem_gb", f"{self.peak_mem_gb:.2f} GB {self.peak_mem_kind.label}"),
        ]
        if pipelined:
            fields.append(f("pp_bubble_share", f"{100 * self.pp_bubble_share:.0f}% "
                                                f"(formula {100 * self.pp_bubble_formula:.0f}%)"))
        return fields

    def console_line(self, pipelined: bool, moves_tokens: bool = True) -> str:
        """The console's line of the step: :meth:`console_fields` joined by `` | ``."""
        return " | ".join(map(str, self.console_fields(pipelined, moves_tokens)))


class MetricsSink:
    """Writes metrics to ``out_dir/metrics.jsonl``, the trackers (TensorBoard, W&B: :mod:`moetrain.train.trackers`,
    optional) and the console. Rank 0 only."""

    def __init__(self, out_dir: str | Path, tensorboard: bool = True, resume_step: int = 0, wandb: str = "",
                 run_config: dict[str, Any] | None = None):
        """``resume_step > 0``: continue a run, dropping records logged after that step by the interrupted run (they
        are about to be logged again), so every step appears once. ``wandb``: a W&B project name ("" = no W&B run),
        ``run_config`` its config.

        Raises:
            ConfigError: ``wandb`` is given and the wandb package is missing.
        """
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
        self.trackers: list[Tracker] = []
        if tensorboard:
            self.trackers.append(TensorBoardTracker(self.dir, resume_step))
        from rich.console import Console
        self.console = Console(file=sys.stdout, highlight=False, soft_wrap=True)
        if wandb:
            tracker = WandbTracker(wandb, self.dir, run_config, resume=resume_step > 0)
            self.trackers.append(tracker)
            self.print(f"[moetrain] metrics: {tracker.where}")
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
        """One record to the JSONL file and its scalars (:func:`~moetrain.train.trackers.tracker_scalars`) to the
        trackers."""
        self.jsonl.write(json.dumps(record) + "\n")
        self.jsonl.flush()
        if self.trackers:
            scalars = tracker_scalars(record)
            for t in self.trackers:
                t.log(scalars, record.get("step", 0))

    def log_step(self, m: StepMetrics, pipelined: bool, moves_tokens: bool = True) -> None:
        """One step's metrics: the JSONL record, its TensorBoard scalars and the console line
        (:meth:`StepMetrics.console_fields`)."""
        self.write(m.record())
        self.print(m.console_line(pipelined, moves_tokens))

    def print(self, text: str) -> None:
        self.console.print(text, markup=False)

    def close(self) -> None:
        if self.progress is not None:
            self.progress.stop()
        self.jsonl.close()
        for t in self.trackers:
            t.close()


class NullSink:
    """The sink of the ranks that write nothing (all but rank 0): every method of :class:`MetricsSink`, doing
    nothing."""

    def start_progress(self, total: int, completed: int) -> None:
        pass

    def advance(self, status: str = "") -> None:
        pass

    def write(self, record: dict[str, Any]) -> None:
        pass

    def log_step(self, m: StepMetrics, pipelined: bool, moves_tokens: bool = True) -> None:
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
        self.lost_s = self.expert_s = self.wait_s = 0.0
        self.last: ImbalanceStep | None = None

    def reset(self) -> None:
        self.lost_s_M, self.lost_s, self.expert_s, self.wait_s, self.last = [], 0.0, 0.0, 0.0, None

    def add(self, step: ImbalanceStep | None) -> None:
        if step is None:
            return
        lost = step.lost_s()
        if len(lost) != len(self.lost_s_M):
            self.lost_s_M = [0.0] * len(lost)
        self.lost_s_M = [a + b for a, b in zip(self.lost_s_M, lost)]
        # the step's totals: all layers at PP 1, the pipeline rank that lost most under PP
        lost_s, expert_s, wait_s = step.step_totals()
        self.lost_s += lost_s
        self.expert_s += expert_s
        self.wait_s += wait_s
        self.last = step

    def fields(self, n_steps: int, window_s: float) -> dict[str, Any]:
        """The imbalance fields of :class:`StepMetrics` for a window of ``n_steps`` steps lasting ``window_s``
        seconds, then start a new window."""
        if self.last is None:
            return {}
        rows = self.last.rows_max_over_mean()
        lost = self.lost_s
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


def a2a_fields(a2a: A2AStep, n_steps: int, window_s: float) -> dict[str, Any]:
    """The all-to-all fields of :class:`StepMetrics` for a window of ``n_steps`` steps lasting ``window_s`` seconds,
    from the dispatchers' figures accumulated over it (the window's last ``StepResult.a2a``). Per-layer figures are
    per layer (every stage's under PP); the step's seconds those of one pipeline rank, its bytes the sum over every
    layer (``moetrain.parallel.a2a_telemetry``)."""
    n = n_steps
    total, exposed = a2a.step_totals()
    sent, remote = a2a.bytes_totals()
    return dict(a2a_s_per_step=total / n, a2a_exposed_s_per_step=exposed / n,
                a2a_exposed_share=exposed / total if total > 0 else 0.0,
                a2a_launch_s_per_step=a2a.launch_total() / n,
                a2a_share_of_step=exposed / window_s if window_s > 0 else 0.0,
                a2a_s_per_layer=[v / n for v in a2a.a2a_s_M], a2a_exposed_s_per_layer=[v / n for v in a2a.exposed_s_M],
                a2a_s_per_layer_phase=[{k: [v[0] / n, v[1] / n] for k, v in p.items()} for p in a2a.by_phase_M],
                dispatch_bytes_per_step=sent / n, dispatch_remote_bytes_per_step=remote / n)
