"""The training loop's extensions as callbacks: step metrics, evaluation, stop signals, checkpoints, profiling and
the non-finite-loss check. The loop (``moetrain.train.trainer``) only reads batches and runs steps; everything else
happens in the hooks of its callback list, in list order (the shape of OLMo-core's trainer callbacks).

A callback sees the loop's state (:class:`LoopState`) and each step's :class:`~moetrain.train.step.StepResult`.
"""

from __future__ import annotations

import math
import os
import signal
import sys
import time
import warnings
from contextlib import AbstractContextManager, contextmanager, nullcontext
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

import torch

from moetrain.model.moe import MoE
from moetrain.parallel.hang import in_phase
from moetrain.parallel.mesh import ParallelContext
from moetrain.train.checkpoint import save_checkpoint
from moetrain.train.metrics import (ImbalanceWindow, MetricsSink, NullSink, StepMetrics, a2a_fields, load_imbalance,
                                    peak_memory_gb, val_line, val_record)
from moetrain.train.runners import ModelParts
from moetrain.train.step import StepResult
from moetrain.train.stopping import StopRequest, resume_command, stop_line
from moetrain.train.validation import Validation


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; the message names the step and the last good checkpoint."""


@dataclass
class LoopState:
    """What the training loop and its callbacks share.

    Attributes:
        steps: the run's last optimizer step (``train.steps``).
        start_step: steps done before this run (a resumed checkpoint's step, else 0).
        sink: rank 0's metrics sink (a :class:`~moetrain.train.metrics.NullSink` on the other ranks).
        step: optimizer steps done (updated before the post-step hooks).
        lr: the learning rate of the last step.
        last_checkpoint: the newest complete checkpoint of the run (a resumed one counts).
        stop_signal: the signal every rank agreed to stop for after this step (0: go on).
        stopped: where and how the run stopped on a signal (the summary's "stopped"), set after the loop.
        val: (step, validation loss) of every evaluation.
        train: (step, loss) of every logged step.
        train_lm: (step, LM loss) of every logged step (what validation is compared with).
        train_s: seconds this run spent in training steps (batches read, step run; evaluation and checkpoints not).
        wall_start: ``time.perf_counter()`` when this run's loop began (before the first evaluation).
        val_by_source: a mixture's per-source validation losses of the last evaluation ({} for one stream).
    """

    steps: int
    start_step: int
    sink: MetricsSink | NullSink
    step: int = 0
    lr: float = 0.0
    last_checkpoint: Path | None = None
    stop_signal: int = 0
    stopped: dict[str, Any] | None = None
    val: list[tuple[int, float]] = field(default_factory=list)
    train: list[tuple[int, float]] = field(default_factory=list)
    train_lm: list[tuple[int, float]] = field(default_factory=list)
    train_s: float = 0.0
    wall_start: float = field(default_factory=time.perf_counter)
    val_by_source: dict[str, float] = field(default_factory=dict)

    @property
    def last(self) -> bool:
        """The step just done is the run's last one."""
        return self.step == self.steps


class Callback:
    """Hooks of the training loop; each default does nothing."""

    def pre_train(self, loop: LoopState) -> None:
        """Before the first step of this run."""

    def pre_step(self, loop: LoopState) -> None:
        """Before a step's learning rate is set and its batches are read (``loop.step`` steps are done)."""

    def around_step(self, loop: LoopState) -> AbstractContextManager:
        """A context entered around the training step itself (forward, backward, optimizer)."""
        return nullcontext()

    def post_step(self, loop: LoopState, result: StepResult) -> None:
        """After optimizer step ``loop.step``."""

    def post_train(self, loop: LoopState) -> None:
        """After the last step, or the step a stop signal ended the run at."""


class FiniteLoss(Callback):
    """Stops the run at the first non-finite loss or gradient norm, naming the step and what to do. A non-finite
    gradient norm was never applied (``StepResult.applied``); every checkpoint holds finite values only (checked
    when it is saved), so the one it points to is good."""

    def post_step(self, loop: LoopState, result: StepResult) -> None:
        if math.isfinite(result.loss) and result.applied:
            return
        fix = (f"resume from the last good checkpoint {loop.last_checkpoint} with a lower train.lr (--resume --set "
               f"train.lr=... --set train.allow_schedule_change=true)" if loop.last_checkpoint else
               "no checkpoint was written yet: lower train.lr and start again")
        what = f"loss became {result.loss}" if not math.isfinite(result.loss) else \
            f"gradient norm became {result.grad_norm}"
        kept = "" if result.applied else " (its update was not applied: the weights are step " \
                                         f"{loop.step - 1}'s, and nothing non-finite is saved)"
        raise NonFiniteLossError(f"{what} at step {loop.step}{kept}; {fix}")


class StepMetricsLogger(Callback):
    """Every ``log_every`` steps (and at the last): one :class:`~moetrain.train.metrics.StepMetrics` over the steps
    since the previous record, to the sink; the progress bar every step. Evaluation and checkpoints are not
    training throughput: the window's start is shifted by the time between this callback's post-step hook and the
    next step (a reset would divide the steps already in the window by a shorter time and inflate tokens/s)."""

    def __init__(self, ctx: ParallelContext, moe_layers: list[MoE], log_every: int, tokens_per_step: int,
                 flops_per_token: float, peak_tflops: float, bubble_formula: float, pipelined: bool,
                 moves_tokens: bool = True):
        self.ctx, self.moe_layers, self.log_every = ctx, moe_layers, log_every
        self.tokens_per_step, self.flops_per_token, self.peak_tflops = tokens_per_step, flops_per_token, peak_tflops
        self.bubble_formula, self.pipelined = bubble_formula, pipelined
        self.moves_tokens = moves_tokens  # ParallelConfig.moves_tokens: the console shows a2a and imbalance
        self.window_t: float | None = None
        self.paused_at: float | None = None
        self.step_t = 0.0
        self.loop_t = 0.0
        self.window_steps, self.window_bubble = 0, 0.0
        # the parameters' bytes received inside steps (evaluation's all-gathers are not the step's)
        self.window_param_bytes = self.param_bytes_at_step = 0
        self.imbalance = ImbalanceWindow()

    def pre_step(self, loop: LoopState) -> None:
        now = time.perf_counter()
        if self.window_t is None:
            self.window_t = self.loop_t = now
            loop.sink.start_progress(loop.steps, loop.start_step)
        elif self.paused_at is not None:
            self.window_t += now - self.paused_at
        self.paused_at = None
        self.step_t = now
        self.param_bytes_at_step = self.ctx.param_traffic.total()

    def post_step(self, loop: LoopState, result: StepResult) -> None:
        loop.train_s += time.perf_counter() - self.step_t
        self.window_steps += 1
        self.window_bubble += result.bubble_s
        self.window_param_bytes += self.ctx.param_traffic.total() - self.param_bytes_at_step
        self.imbalance.add(result.imbalance)
        loop.sink.advance(f"loss {result.loss:.3f}")
        if loop.step % self.log_every == 0 or loop.last:
            m = self._metrics(loop, result)
            loop.train.append((loop.step, result.loss))
            loop.train_lm.append((loop.step, result.lm_loss))
            loop.sink.log_step(m, self.pipelined, self.moves_tokens)
            # every rank resets at the same step: under PP the next record's figures of all stages cover one window
            for layer in self.moe_layers:
                stats = layer.dispatcher.stats
                stats.reset_timers()
                stats.bytes_sent = stats.remote_bytes_sent = 0
            self.window_t, self.window_steps, self.window_bubble = time.perf_counter(), 0, 0.0
            self.window_param_bytes = 0
        self.paused_at = time.perf_counter()

    def _metrics(self, loop: LoopState, result: StepResult) -> StepMetrics:
        if self.ctx.device.type == "cuda":
            torch.cuda.synchronize()
        dt = time.perf_counter() - self.window_t
        n = self.window_steps
        tok_s_gpu = n * self.tokens_per_step / dt / self.ctx.world_size
        tflops = tok_s_gpu * self.flops_per_token / 1e12
        imb = load_imbalance(result.tokens_per_expert_ME)
        mem_gb, mem_kind = peak_memory_gb(self.ctx.device)
        # the ETA at this run's whole pace so far, evaluation and checkpoints included (they recur)
        done = loop.step - loop.start_step
        eta = (time.perf_counter() - self.loop_t) / done * (loop.steps - loop.step)
        return StepMetrics(
            step=loop.step, loss=result.loss, lm_loss=result.lm_loss, mtp_loss=result.mtp_loss,
            balance_loss=result.balance_loss, grad_norm=result.grad_norm, lr=loop.lr,
            tokens_per_s_per_gpu=tok_s_gpu, tflops_per_gpu=tflops, mfu=tflops / self.peak_tflops,
            step_time_s=dt / n, **a2a_fields(result.a2a, n, dt),
            param_gather_bytes_per_step=self.window_param_bytes / n,
            pp_bubble_s_per_step=self.window_bubble / n, pp_bubble_share=self.window_bubble / dt if dt > 0 else 0.0,
            pp_bubble_formula=self.bubble_formula, load_imbalance_max=max(imb) if imb else 1.0, load_imbalance=imb,
            dropped_tokens=result.dropped_tokens, peak_mem_gb=mem_gb,
            expert_load=result.tokens_per_expert_ME.tolist(), total_steps=loop.steps, mtp_term=result.mtp_term,
            balance_term=result.balance_term, eta_s=eta, peak_mem_kind=mem_kind, **self.imbalance.fields(n, dt))


class Evaluation(Callback):
    """Validation loss before the first step of a fresh run, every ``every`` steps and after the last (0: never)."""

    def __init__(self, evaluate: Callable[[], Validation], every: int):
        self.evaluate, self.every = evaluate, every

    def _run(self, loop: LoopState, step: int) -> None:
        v = self.evaluate()
        loop.val.append((step, v.loss))
        loop.val_by_source = v.by_source
        loop.sink.write(val_record(step, v.loss, v.by_source))
        # LM cross-entropy only, as the train line's "lm" (its loss adds the MTP and balance terms)
        loop.sink.print(val_line(step, loop.steps, v.loss))

    def pre_train(self, loop: LoopState) -> None:
        if self.every and loop.start_step == 0:
            self._run(loop, 0)

    def post_step(self, loop: LoopState, result: StepResult) -> None:
        if self.every and (loop.step % self.every == 0 or loop.last):
            self._run(loop, loop.step)


class StopOnSignal(Callback):
    """A first SIGINT/SIGTERM stops the run after the current step, every rank after the same one
    (:mod:`moetrain.train.stopping`); the checkpoint callback then saves. After the loop it records where the run
    stopped and (``report``) prints how to continue."""

    def __init__(self, stop: StopRequest, out_dir: str, ctx: ParallelContext, report: bool):
        self.stop, self.out_dir, self.ctx, self.report = stop, out_dir, ctx, report

    def post_step(self, loop: LoopState, result: StepResult) -> None:
        loop.stop_signal = 0 if loop.last else self.stop.agreed(self.out_dir, self.ctx)

    def post_train(self, loop: LoopState) -> None:
        if not loop.stop_signal:
            return
        signum = loop.stop_signal
        loop.stopped = {"signal": signal.Signals(signum).name, "exit_code": 128 + signum, "step": loop.step,
                        "checkpoint": str(loop.last_checkpoint), "resume": resume_command()}
        if self.report:
            loop.sink.print(stop_line(loop.stopped))


class Checkpointing(Callback):
    """A checkpoint every ``every`` steps (0: only at the end), after the last step and at a stop signal, keeping
    the newest ``keep``; ``trainer_state()`` gives the JSON part (loader position, configs, data fingerprint)."""

    def __init__(self, out_dir: str, every: int, keep: int, model: ModelParts, optimizer: Any, ctx: ParallelContext,
                 trainer_state: Callable[[], dict[str, Any]]):
        self.out_dir, self.every, self.keep = out_dir, every, keep
        self.model, self.optimizer, self.ctx, self.trainer_state = model, optimizer, ctx, trainer_state

    def post_step(self, loop: LoopState, result: StepResult) -> None:
        if (self.every and loop.step % self.every == 0) or loop.last or loop.stop_signal:
            with in_phase("checkpoint save"):
                loop.last_checkpoint = save_checkpoint(self.out_dir, loop.step, self.model, self.optimizer,
                                                       self.trainer_state(), self.ctx, self.keep)


class Profiler(Callback):
    """``torch.profiler`` around the given optimizer steps (1-based; CPU, and CUDA where present), each written
    as a Chrome trace ``out_dir/profile/step<N>-rank<r>.json``; rank 0 prints where the traces went. The
    profiler's own start/stop chatter (kineto's lines on stderr, a warning) is silenced around its start, stop
    and export only, so the step's own errors still show."""

    def __init__(self, steps: tuple[int, ...], out_dir: str, ctx: ParallelContext):
        self.steps, self.out_dir, self.ctx = set(steps), out_dir, ctx

    def around_step(self, loop: LoopState) -> AbstractContextManager:
        return self._profile(loop, loop.step + 1) if loop.step + 1 in self.steps else nullcontext()

    @contextmanager
    def _profile(self, loop: LoopState, step: int) -> Iterator[None]:
        from torch.profiler import ProfilerActivity, profile
        acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if self.ctx.device.type == "cuda" else [])
        with quiet_stderr():
            prof = profile(activities=acts)
            prof.__enter__()
        try:
            yield
        finally:
            with quiet_stderr():
                prof.__exit__(None, None, None)
        path = Path(self.out_dir) / "profile" / f"step{step}-rank{self.ctx.rank}.json"
        path.parent.mkdir(parents=True, exist_ok=True)
        with quiet_stderr():
            prof.export_chrome_trace(str(path))
        where = path.parent / f"step{step}-rank*.json" if self.ctx.world_size > 1 else path
        loop.sink.print(f"[moetrain] profile of step {step}: trace {where} (open in https://ui.perfetto.dev or "
                        f"chrome://tracing)")


@contextmanager
def quiet_stderr() -> Iterator[None]:
    """File descriptor 2 to /dev/null, and Python warnings off, for the duration (C++ libraries write there
    directly, past ``sys.stderr``)."""
    sys.stderr.flush()
    saved = os.dup(2)
    try:
        with open(os.devnull, "w") as null, warnings.catch_warnings():
            warnings.simplefilter("ignore")
            os.dup2(null.fileno(), 2)
            yield
    finally:
        os.dup2(saved, 2)
        os.close(saved)
