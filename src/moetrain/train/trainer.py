"""The training loop run by every worker process (one per GPU, or a few on a CPU).

Launched by :mod:`moetrain.train.launch` (``moetrain train``) or directly by ``torchrun -m moetrain train``.
"""

from __future__ import annotations

import math
import os
import signal
import shutil
import time
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moetrain.accounting import flops_per_token
from moetrain.config import JobConfig, save_job_config
from moetrain.data import TokenLoader, iter_eval_batches
from moetrain.data.prepare import PreparedData
from moetrain.interop.hf import load_hf_checkpoint
from moetrain.model.config import TRAINING_FIELDS
from moetrain.model.transformer import Transformer, build_model
from moetrain.parallel.comm import named_phase
from moetrain.parallel.hang import hang_monitor, in_phase
from moetrain.parallel.mesh import ParallelContext, check_same_config, init_parallel, shutdown
from moetrain.parallel.parallelize import local_numel, materialize, parallelize
from moetrain.precision.cpu_bf16 import cpu_bf16_gemms
from moetrain.precision.recipe import PLAN_PRECISION_TO_FP8
from moetrain.train.checkpoint import (CheckpointError, load_checkpoint, read_trainer_state, resume_checkpoint,
                                       save_checkpoint)
from moetrain.train.metrics import MetricsSink, device_peak, load_imbalance, peak_memory_gb
from moetrain.train.optim import build_optimizers, lr_at, set_lr
from moetrain.train.resume import data_fingerprint
from moetrain.train.stopping import StopRequest, clear_stop_file, record_failure, resume_command, stop_line
from moetrain.train.step import ModelParts, Objective, train_step


class NonFiniteLossError(RuntimeError):
    """The loss became NaN or infinite; the message names the step and the last good checkpoint."""


def resolve_device(job: JobConfig) -> str:
    if job.train.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return job.train.device


def autocast_dtype(job: JobConfig, device: torch.device) -> torch.dtype | None:
    if job.parallel.autocast_bf16(device.type):
        return torch.bfloat16
    return None


def check_checkpoint_compatible(ckpt: Path, job: JobConfig) -> dict[str, Any]:
    """Raise CheckpointError if ``ckpt`` was written for a different model architecture."""
    state = read_trainer_state(ckpt)
    saved = state.get("model_config", {})
    arch_fields = [f for f in job.model.to_dict() if f not in TRAINING_FIELDS]
    diff = {f: (saved.get(f), getattr(job.model, f)) for f in arch_fields if saved.get(f) != getattr(job.model, f)}
    if diff:
        shown = ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in list(diff.items())[:6])
        raise CheckpointError(f"checkpoint {ckpt} is from a different model ({shown}); use the same model config or "
                              f"a fresh train.out_dir")
    return state


def keep_tokenizer(prep: PreparedData, out_dir: str) -> Path:
    """Copy the run's tokenizer to ``out_dir/tokenizer.json`` (atomically), so exports and users find it there rather
    than in a hashed cache folder."""
    dst = Path(out_dir) / "tokenizer.json"
    tmp = dst.with_name(f".tokenizer.json.tmp-{os.getpid()}")
    shutil.copyfile(prep.tokenizer_path, tmp)
    os.replace(tmp, dst)
    return dst


def evaluate(model: ModelParts, prep: PreparedData, job: JobConfig, ctx: ParallelContext,
             amp: torch.dtype | None) -> float:
    """Mean next-token cross-entropy on the validation split (all ranks take part; global token-weighted mean).

    Pipelined, the validation micro-batches run through the schedule's forward in groups of ``train.grad_accum``
    (the last group padded with sequences whose labels are all ignored) and only the last stage counts."""
    from moetrain.model.transformer import IGNORE_INDEX

    model.train(False)
    dispatch_stats = [m.dispatcher.stats for _, m in model.moe_layers()]
    for st in dispatch_stats:  # validation's all-to-alls are not the training step's
        st.recording = False
    total = torch.zeros(2, dtype=torch.float64, device=ctx.device)
    batches = [(x.to(ctx.device), y.to(ctx.device)) for x, y in
               iter_eval_batches(prep.val_path, job.data.seq_len, job.train.micro_batch_size, ctx.data_rank,
                                 ctx.stage_size, job.train.eval_batches)]
    with torch.no_grad(), named_phase("evaluation forward", ctx.distributed), \
            torch.autocast(ctx.device.type, dtype=amp, enabled=amp is not None):
        if model.schedule is None:
            for x, y in batches:
                out = model.parts[0](x, y)
                total += torch.stack([out.lm_loss_sum.double(), out.n_loss_tokens.double()])
        else:
            n = job.train.grad_accum
            while len(batches) % n:
                x, y = batches[-1]
                batches.append((torch.zeros_like(x), torch.full_like(y, IGNORE_INDEX)))
            obj = model.objective
            # torch's zero-bubble V schedules cannot run forward-only (their eval() asserts on the split backward
            # actions), so there the step runs as a training step with a zero loss and no balance term, and the
            # (zero) gradients are dropped.
            v = ctx.pcfg.schedule.is_v
            for g in range(0, len(batches), n):
                x = torch.cat([b[0] for b in batches[g:g + n]])
                y = torch.cat([b[1] for b in batches[g:g + n]])
                obj.start(torch.ones((), device=ctx.device), torch.ones(job.model.mtp_depth, device=ctx.device))
                kw = {"tokens_BL": x, "labels_BL": y, **({"target": y} if model.last else {})}
                if v:
                    for p in model.parts:
                        p.balance_scale = 0.0
                    obj.weight = 0.0
                    try:
                        with torch.enable_grad():
                            model.schedule.step(return_outputs=False, **kw)
                    finally:
                        obj.weight = 1.0
                        for p in model.parts:
                            p.zero_grad(set_to_none=True)
                else:
                    model.schedule.eval(**kw)
                if model.last:
                    total += torch.stack([obj.lm_sum, (y != IGNORE_INDEX).sum().double()])
    if ctx.distributed:
        dist.all_reduce(total)
    model.train(True)
    for st in dispatch_stats:
        st.recording = True
    return float(total[0] / total[1].clamp(min=1))


def run(job: JobConfig, prep: PreparedData, dry_run: bool = False, report_stop: bool = True) -> dict[str, Any]:
    """Train ``job`` on prepared data; returns the summary (rank 0's view). Called on every worker. ``dry_run`` does
    all set-up (mesh, meta build, parallelize, materialise, ``train.init_from``), reports memory, runs no step.

    A first SIGINT/SIGTERM stops the run after the current step with a checkpoint (:mod:`moetrain.train.stopping`;
    the summary's "stopped" says where); rank 0 prints the line that says how to continue when ``report_stop``
    (moetrain's own launcher prints it itself).

    Raises:
        WorkerFailure: any error of this worker, in one line (type, message, rank, step); the traceback goes to
            ``out_dir/logs/rank-<rank>.log``.
    """
    tc = job.train
    if tc.threads_per_proc:
        torch.set_num_threads(tc.threads_per_proc)
    stop = StopRequest().install()
    progress: dict[str, Any] = {"step": None}
    rank = int(os.environ.get("RANK", "0"))
    try:
        ctx = init_parallel(job.parallel, job.model.n_routed_experts, resolve_device(job))
        try:
            # CPU "bf16": bf16 GEMM numerics computed by fp32 kernels, as torch's CPU bf16 GEMM kernels are a slow
            # fallback on CPUs without bf16 instructions (moetrain.precision.cpu_bf16, docs/fp8.md).
            with hang_monitor(ctx, Path(tc.out_dir) / "logs" / f"rank-{rank}.log"), \
                    cpu_bf16_gemms(ctx.device, autocast_dtype(job, ctx.device)):
                return _run(job, prep, ctx, dry_run, stop, progress, report_stop)
        finally:
            shutdown()
    except Exception as e:  # noqa: BLE001 - every failure reaches the user in one line, with its log
        raise record_failure(e, tc.out_dir, rank, progress["step"]) from None
    finally:
        stop.uninstall()


def _apply_precision(model: Transformer, job: JobConfig) -> None:
    """FP8 GEMMs (``parallel.precision`` fp8 / mxfp8) swapped in on the single-device (meta) model, before it is
    parallelized."""
    recipe = PLAN_PRECISION_TO_FP8.get(job.parallel.precision, "none")  # "auto": no FP8
    if recipe != "none":
        from moetrain.precision import apply_fp8
        apply_fp8(model, recipe)


def build_sharded_model(job: JobConfig, ctx: ParallelContext, amp: torch.dtype | None,
                        init_from: str | None = None) -> Transformer:
    """The model of ``job`` on ``ctx``'s layout at any size: built on the meta device, parallelized, then only this
    rank's shards are allocated and initialised (name-seeded, so the weights equal a single process's), and, with
    ``init_from`` (a HF checkpoint directory), overwritten from it, each rank reading only its own boxes."""
    model = build_model(job.model, device="meta")
    _apply_precision(model, job)
    parallelize(model, ctx, param_dtype=amp if ctx.device.type == "cuda" else None)
    materialize(model, ctx, seed=job.train.seed)
    if init_from:
        load_hf_checkpoint(model, init_from, mtp_optional=True)
    return model


def build_model_parts(job: JobConfig, ctx: ParallelContext, amp: torch.dtype | None,
                      init_from: str | None = None) -> ModelParts:
    """What this rank trains. Without pipelining: the whole model (:func:`build_sharded_model`). With
    ``parallel.pp > 1``: the model is built on meta and split into this rank's stages
    (``moetrain.parallel.pipeline``), each parallelized, materialised and initialised by name like a whole model,
    then driven by the configured ``torch.distributed.pipelining`` schedule.

    Raises:
        ConfigError: a layout or schedule that does not fit the model, or an ``init_from`` checkpoint without a
            stage's tensors.
    """
    from moetrain.model.config import ConfigError
    from moetrain.parallel.pipeline import build_schedule, build_stages, embedding_groups

    pcfg = ctx.pcfg
    if pcfg.pp == 1:
        return ModelParts([build_sharded_model(job, ctx, amp, init_from)])
    model = build_model(job.model, device="meta")
    _apply_precision(model, job)
    parts = build_stages(model, pcfg, ctx.pp_rank)
    param_dtype = amp if ctx.device.type == "cuda" else None
    for part in parts:
        part.act_dtype = param_dtype or torch.float32
        parallelize(part, ctx, param_dtype=param_dtype)
        materialize(part, ctx, seed=job.train.seed)
        if init_from:
            # the checkpoint holds every stage: this stage reads its own tensors (and boxes), and must find them all
            res = load_hf_checkpoint(part, init_from, strict=False, mtp_optional=True)
            if res.missing:
                raise ConfigError(f"{init_from} lacks {len(res.missing)} tensor(s) of pipeline stage "
                                  f"{part.spec.index}, e.g. {res.missing[:3]}")
    objective = Objective(job.model)
    schedule, stages = build_schedule(parts, ctx, job.train.grad_accum, job.train.micro_batch_size,
                                      job.data.seq_len, objective)
    sync = job.model.mtp_depth > 0
    group = embedding_groups(ctx) if sync else None
    return ModelParts(parts, schedule, stages, objective, group, sync)


def _profiled_step(path: Path, ctx: ParallelContext, step: Any) -> Any:
    """Run ``step()`` under ``torch.profiler`` (CPU, and CUDA where present) and write its Chrome trace."""
    from torch.profiler import ProfilerActivity, profile
    acts = [ProfilerActivity.CPU] + ([ProfilerActivity.CUDA] if ctx.device.type == "cuda" else [])
    with profile(activities=acts) as prof:
        result = step()
    path.parent.mkdir(parents=True, exist_ok=True)
    prof.export_chrome_trace(str(path))
    return result


def _run(job: JobConfig, prep: PreparedData, ctx: ParallelContext, dry_run: bool, stop: StopRequest,
         progress: dict[str, Any], report_stop: bool) -> dict[str, Any]:
    tc, cfg = job.train, job.model
    if ctx.is_main and "RANK" in os.environ and report_stop:
        clear_stop_file(tc.out_dir)  # a stale request of an earlier run; the config check below orders it first
    check_same_config(ctx, job.to_dict())
    amp = autocast_dtype(job, ctx.device)
    # A resumed checkpoint supersedes the initial weights, so they are not read at all then.
    resume_from = resume_checkpoint(tc.out_dir)[0] if tc.resume else None
    resuming = resume_from is not None
    model = build_model_parts(job, ctx, amp, init_from=None if resuming else tc.init_from)
    optimizer = build_optimizers(model.parts, tc.lr, tc.weight_decay, (tc.beta1, tc.beta2), tc.eps)
    if dry_run:
        from moetrain.train.dryrun import report_dry_run
        return report_dry_run(job, ctx, model.parts[0] if len(model.parts) == 1 else torch.nn.ModuleList(model.parts))
    # The ranks of one pipeline (one per stage) read the same data; the stage's DP x EP ranks read different data.
    loader = TokenLoader(prep.train_path, job.data.seq_len, tc.micro_batch_size, ctx.data_rank, ctx.stage_size,
                         seed=job.data.seed)
    start_step, last_ckpt = 0, None
    if tc.resume:
        if resume_from is None:
            if ctx.is_main:
                print(f"[moetrain] --resume: no complete checkpoint in {tc.out_dir}/checkpoints; starting fresh")
        else:
            check_checkpoint_compatible(resume_from, job)
            state = load_checkpoint(resume_from, model, optimizer, ctx)
            loader.load_state_dict(state["loader"])
            start_step, last_ckpt = state["step"], resume_from
            if ctx.is_main:
                print(f"[moetrain] resumed from step {start_step} of {tc.out_dir} ({resume_from.name})")
    sink = MetricsSink(tc.out_dir, tc.tensorboard, resume_step=start_step) if ctx.is_main else None
    if sink:
        save_job_config(job, Path(tc.out_dir) / "config.toml")
        keep_tokenizer(prep, tc.out_dir)

    fpt = flops_per_token(cfg, job.data.seq_len)
    peak_tflops, peak_label = device_peak(ctx.device, amp)
    tokens_per_step = tc.micro_batch_size * tc.grad_accum * ctx.stage_size * job.data.seq_len
    pcfg = ctx.pcfg
    pipe = (f"PP={pcfg.pp} ({pcfg.schedule}, {pcfg.n_stages} stages) " if pcfg.pp > 1 else "")
    if sink:
        sink.print(f"[moetrain] {ctx.world_size} ranks on {ctx.device.type} | {pipe}DP={ctx.pcfg.dp} EP={ctx.pcfg.ep} "
                   f"dispatcher={ctx.pcfg.run_dispatcher if ctx.pcfg.moves_tokens else 'local'} | model {job.preset}: "
                   f"{local_numel(model):,} params on rank 0 | {tokens_per_step:,} tokens/step "
                   f"| {fpt.megatron / 1e9:.3f} GFLOP/token (Megatron-Core) | peak {peak_tflops:.3f} TFLOP/s "
                   f"({peak_label})")
        sink.write({"kind": "run", "step": start_step, "world": ctx.world_size, "dp": ctx.pcfg.dp,
                    "ep": ctx.pcfg.ep, "pp": pcfg.pp, "vpp": pcfg.stages_per_rank, "pp_schedule": pcfg.schedule,
                    "dispatcher": pcfg.run_dispatcher if pcfg.moves_tokens else "local", "preset": job.preset,
                    "flops_per_token_megatron": fpt.megatron, "flops_per_token_6n": fpt.six_n,
                    "peak_tflops": peak_tflops, "peak_label": peak_label, "config": job.to_dict()})

    history: dict[str, Any] = {"val": [], "train": []}
    if start_step == 0 and tc.eval_every:
        v = evaluate(model, prep, job, ctx, amp)
        history["val"].append((0, v))
        if sink:
            sink.write({"kind": "val", "step": 0, "val_loss": v})
            sink.print(f"step {0:>5} | val loss {v:.4f}")

    moe_layers = [m for _, m in model.moe_layers()]
    fingerprint = data_fingerprint(prep)
    if sink:
        sink.start_progress(tc.steps, start_step)
    window_t, window_tokens, window_steps = time.perf_counter(), 0, 0
    window_bubble = 0.0
    from moetrain.parallel.pipeline import bubble_formula
    bubble_expected = bubble_formula(pcfg, tc.grad_accum)
    result = None
    stopped: dict[str, Any] | None = None
    for step in range(start_step, tc.steps):
        progress["step"] = step + 1
        lr = lr_at(step, lr=tc.lr, min_lr=tc.min_lr, warmup_steps=tc.warmup_steps, total_steps=tc.steps,
                   schedule=tc.schedule)
        set_lr(optimizer, lr)
        batches = [loader.next_batch() for _ in range(tc.grad_accum)]
        batches = [(x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)) for x, y in batches]
        if step + 1 in tc.profile_steps:
            result = _profiled_step(Path(tc.out_dir) / "profile" / f"step{step + 1}-rank{ctx.rank}.json", ctx,
                                    lambda: train_step(model, optimizer, batches, cfg, ctx, tc.max_grad_norm, amp))
        else:
            result = train_step(model, optimizer, batches, cfg, ctx, tc.max_grad_norm, amp)
        if not math.isfinite(result.loss):
            fix = (f"resume from the last good checkpoint {last_ckpt} with a lower train.lr (--resume --set "
                   f"train.lr=... --set train.allow_schedule_change=true)" if last_ckpt else
                   "no checkpoint was written yet: lower train.lr and start again")
            raise NonFiniteLossError(f"loss became {result.loss} at step {step + 1}; {fix}")
        window_tokens += tokens_per_step
        window_steps += 1
        window_bubble += result.bubble_s
        done = step + 1
        if sink:
            sink.advance(f"loss {result.loss:.3f}")
        if done % tc.log_every == 0 or done == tc.steps:
            if ctx.device.type == "cuda":
                torch.cuda.synchronize()
            dt = time.perf_counter() - window_t
            tok_s_gpu = window_tokens / dt / ctx.world_size
            tflops = tok_s_gpu * fpt.megatron / 1e12
            a2a = sum(m.dispatcher.stats.a2a_seconds for m in moe_layers)
            exposed = sum(m.dispatcher.stats.exposed_seconds for m in moe_layers)
            imb = load_imbalance(result.tokens_per_expert_ME)
            rec = {"kind": "train", "step": done, "loss": result.loss, "lm_loss": result.lm_loss,
                   "mtp_loss": result.mtp_loss, "balance_loss": result.balance_loss, "grad_norm": result.grad_norm,
                   "lr": lr, "tokens_per_s_per_gpu": tok_s_gpu, "tflops_per_gpu": tflops,
                   "mfu": tflops / peak_tflops, "step_time_s": dt / window_steps,
                   "a2a_s_per_step": a2a / window_steps, "a2a_exposed_s_per_step": exposed / window_steps,
                   "a2a_exposed_share": exposed / a2a if a2a > 0 else 0.0,
                   "a2a_share_of_step": exposed / dt if dt > 0 else 0.0,
                   "a2a_s_per_layer": [m.dispatcher.stats.a2a_seconds / window_steps for m in moe_layers],
                   "a2a_exposed_s_per_layer": [m.dispatcher.stats.exposed_seconds / window_steps for m in moe_layers],
                   # Per MoE layer and phase (DispatchStats.PHASES): [a2a s, exposed s] per step.
                   "a2a_s_per_layer_phase": [{k: [v[0] / window_steps, v[1] / window_steps]
                                              for k, v in m.dispatcher.stats.by_phase.items()} for m in moe_layers],
                   "dispatch_bytes_per_step": sum(getattr(m.dispatcher.stats, "bytes_sent", 0)
                                                  for m in moe_layers) / window_steps,
                   "dispatch_remote_bytes_per_step": sum(getattr(m.dispatcher.stats, "remote_bytes_sent", 0)
                                                         for m in moe_layers) / window_steps,
                   "pp_bubble_s_per_step": window_bubble / window_steps,
                   "pp_bubble_share": window_bubble / dt if dt > 0 else 0.0,
                   "pp_bubble_formula": bubble_expected,
                   "load_imbalance_max": max(imb) if imb else 1.0, "load_imbalance": imb,
                   "dropped_tokens": result.dropped_tokens, "peak_mem_gb": peak_memory_gb(ctx.device),
                   "expert_load": result.tokens_per_expert_ME.tolist()}
            history["train"].append((done, result.loss))
            if sink:
                sink.write(rec)
                sink.print(f"step {done:>5} | loss {result.loss:.4f} (lm {result.lm_loss:.3f} mtp "
                           f"{result.mtp_loss:.3f} bal {result.balance_loss:.3f}) | gnorm {result.grad_norm:.2f} | "
                           f"lr {lr:.2e} | {tok_s_gpu:,.0f} tok/s/gpu | {tflops:.4f} TFLOP/s/gpu | MFU "
                           f"{100 * tflops / peak_tflops:.1f}% | a2a {1e3 * a2a / window_steps:.1f} ms/step "
                           f"({100 * rec['a2a_exposed_share']:.0f}% exposed) | load max/mean {rec['load_imbalance_max']:.2f}"
                           f" | drop {result.dropped_tokens} | mem {rec['peak_mem_gb']:.2f} GB"
                           + (f" | bubble {100 * rec['pp_bubble_share']:.0f}% (formula "
                              f"{100 * bubble_expected:.0f}%)" if pcfg.pp > 1 else ""))
            for m in moe_layers:
                m.dispatcher.stats.reset_timers()
                if hasattr(m.dispatcher.stats, "bytes_sent"):
                    m.dispatcher.stats.bytes_sent = m.dispatcher.stats.remote_bytes_sent = 0
            window_t, window_tokens, window_steps = time.perf_counter(), 0, 0
            window_bubble = 0.0
        # Evaluation and checkpointing are not training throughput: shift the window's start by their duration (a
        # reset would divide the steps already in the window by a shorter time and inflate tokens/s and MFU).
        t_pause = time.perf_counter()
        if tc.eval_every and (done % tc.eval_every == 0 or done == tc.steps):
            v = evaluate(model, prep, job, ctx, amp)
            history["val"].append((done, v))
            if sink:
                sink.write({"kind": "val", "step": done, "val_loss": v})
                sink.print(f"step {done:>5} | val loss {v:.4f}")
        signum = stop.agreed(tc.out_dir, ctx) if done < tc.steps else 0
        if (tc.ckpt_every and done % tc.ckpt_every == 0) or done == tc.steps or signum:
            with in_phase("checkpoint save"):
                last_ckpt = save_checkpoint(tc.out_dir, done, model, optimizer,
                                            {"loader": loader.state_dict(), "model_config": cfg.to_dict(),
                                             "job": job.to_dict(), "data": fingerprint}, ctx, tc.keep_ckpts)
        window_t += time.perf_counter() - t_pause
        if signum:
            stopped = {"signal": signal.Signals(signum).name, "exit_code": 128 + signum, "step": done,
                       "checkpoint": str(last_ckpt), "resume": resume_command()}
            if sink and report_stop:
                sink.print(stop_line(stopped))
            break
    summary = {"steps": tc.steps, "start_step": start_step, "val": history["val"], "train": history["train"],
               "world": ctx.world_size, "ep": ctx.pcfg.ep, "out_dir": tc.out_dir,
               "checkpoint": str(last_ckpt) if last_ckpt else None, "stopped": stopped}
    if sink:
        vals = history["val"]
        if len(vals) >= 2 and not stopped:
            sink.print(f"[moetrain] done: val loss {vals[0][1]:.4f} (step {vals[0][0]}) -> {vals[-1][1]:.4f} "
                       f"(step {vals[-1][0]}); metrics in {tc.out_dir}/metrics.jsonl; checkpoint {last_ckpt}")
        sink.write({"kind": "summary", "step": tc.steps, **{k: v for k, v in summary.items() if k != "train"}})
        sink.close()
    return summary
