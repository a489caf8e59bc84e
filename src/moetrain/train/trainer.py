"""The training loop run by every worker process (one per GPU, or a few on a CPU).

Launched by :mod:`moetrain.train.launch` (``moetrain train``) or directly by ``torchrun -m moetrain train``.
"""

from __future__ import annotations

import os
import shutil
import time
from contextlib import ExitStack
from pathlib import Path
from typing import Any

import torch
from torch.distributed.checkpoint.api import CheckpointException

from moetrain.accounting import flops_per_token
from moetrain.config import JobConfig, save_job_config
from moetrain.data import Loader, train_loader
from moetrain.data.prepare import PreparedData
from moetrain.interop.hf import load_hf_checkpoint
from moetrain.model.config import DEFAULT_FAMILY, TRAINING_FIELDS
from moetrain.model.transformer import Transformer, build_model
from moetrain.parallel.hang import hang_monitor
from moetrain.parallel.mesh import ParallelContext, check_same_config, init_parallel, shutdown
from moetrain.parallel.parallelize import cast_parameters_, local_numel, materialize, parallelize
from moetrain.parallel.schedules import bubble_formula
from moetrain.precision.cpu_bf16 import cpu_bf16_gemms
from moetrain.precision.apply import apply_precision
from moetrain.precision.recipe import PLAN_PRECISION_TO_FP8
from moetrain.train.callbacks import (Callback, Checkpointing, Evaluation, FiniteLoss, LoopState, Profiler,
                                      StepMetricsLogger, StopOnSignal)
from moetrain.train.callbacks import NonFiniteLossError  # noqa: F401 - what a run raises, importable from here
from moetrain.train.checkpoint import CheckpointError, load_checkpoint, read_trainer_state, resume_checkpoint
from moetrain.train.metrics import LogField, MetricsSink, NullSink, device_peak, format_duration
from moetrain.train.optim import STATE_DTYPES, build_optimizers, held_param_dtype, lr_at, set_lr
from moetrain.train.resume import data_fingerprint
from moetrain.train.runners import ModelParts, Objective, build_runner
from moetrain.train.stopping import StopRequest, clear_stop_file, record_failure
from moetrain.train.step import train_step
from moetrain.train.validation import validate


def resolve_device(job: JobConfig) -> str:
    if job.train.device == "auto":
        return "cuda" if torch.cuda.is_available() else "cpu"
    return job.train.device


def autocast_dtype(job: JobConfig, device: torch.device) -> torch.dtype | None:
    if job.parallel.autocast_bf16(device.type):
        return torch.bfloat16
    return None


def check_checkpoint_compatible(ckpt: Path, job: JobConfig) -> dict[str, Any]:
    """Raise CheckpointError if ``ckpt`` was written for a different model architecture; the message names the
    run's saved ``config.toml`` (beside ``checkpoints/``) as the way to resume. Returns the checkpoint's trainer
    state."""
    state = read_trainer_state(ckpt)
    # a run saved before there were families holds a DeepSeek-V3 model without the key
    saved = {"family": DEFAULT_FAMILY.value, **state.get("model_config", {})}
    now = job.model.to_dict()
    diff = {f: (saved.get(f), v) for f, v in now.items() if f not in TRAINING_FIELDS and saved.get(f) != v}
    if diff:
        shown = ", ".join(f"{k}: checkpoint {a!r} vs config {b!r}" for k, (a, b) in list(diff.items())[:6])
        run = ckpt.parent.parent if ckpt.parent.name == "checkpoints" else None
        way = (f"resume with the run's options, e.g. --config {run / 'config.toml'}"
               if run is not None and (run / "config.toml").is_file()
               else "resume with the model options the run was started with (--preset, --set model.*)")
        raise CheckpointError(f"checkpoint {ckpt} is from a different model ({shown}); {way}, or train into a "
                              f"fresh --out")
    return state


def keep_tokenizer(prep: PreparedData, out_dir: str) -> Path:
    """Copy the run's tokenizer to ``out_dir/tokenizer.json`` (atomically), so exports and users find it there rather
    than in a hashed cache folder."""
    dst = Path(out_dir) / "tokenizer.json"
    tmp = dst.with_name(f".tokenizer.json.tmp-{os.getpid()}")
    shutil.copyfile(prep.tokenizer_path, tmp)
    os.replace(tmp, dst)
    return dst


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
    except (Exception, CheckpointException) as e:  # noqa: BLE001 - DCP's exception derives from BaseException
        # every failure reaches the user in one line, with its log
        raise record_failure(e, tc.out_dir, rank, progress["step"]) from None
    finally:
        stop.uninstall()


def build_sharded_model(job: JobConfig, ctx: ParallelContext, amp: torch.dtype | None,
                        init_from: str | None = None) -> Transformer:
    """The whole single-device reference :class:`~moetrain.model.transformer.Transformer` of ``job`` on ``ctx``'s
    layout at any size (logits, export; the trainer runs :func:`build_model_parts`): built on the meta device,
    parallelized, then only this rank's shards are allocated and initialised (name-seeded, so the weights equal a
    single process's), and, with ``init_from`` (a HF checkpoint directory), overwritten from it, each rank reading
    only its own boxes."""
    model = build_model(job.model, device="meta")
    apply_precision(model, job.parallel.precision)
    parallelize(model, ctx, param_dtype=amp if ctx.device.type == "cuda" else None)
    materialize(model, ctx, seed=job.train.seed)
    if init_from:
        load_hf_checkpoint(model, init_from, mtp_optional=True)
    return model


def build_model_parts(job: JobConfig, ctx: ParallelContext, amp: torch.dtype | None,
                      init_from: str | None = None) -> ModelParts:
    """What this rank trains: the model is built on meta and split into this rank's stages
    (``moetrain.parallel.pipeline``; without pipelining one stage holds the whole model), each parallelized,
    materialised and initialised by name like a whole model, then driven by the job's step runner
    (``moetrain.train.runners``: sequential, paired EP overlap, or the configured ``torch.distributed.pipelining``
    schedule).

    Raises:
        ConfigError: a layout or schedule that does not fit the model, or an ``init_from`` checkpoint without a
            stage's tensors.
    """
    from moetrain.model.config import ConfigError
    from moetrain.parallel.pipeline import build_stages, embedding_groups

    pcfg = ctx.pcfg
    model = build_model(job.model, device="meta")
    apply_precision(model, job.parallel.precision)
    held = held_param_dtype(pcfg.optimizer)
    if held != torch.float32:
        if not ctx.distributed:
            raise ConfigError(f"parallel.optimizer={pcfg.optimizer!r} holds {held} weights that FSDP2 casts to the "
                              f"compute dtype, and a process without a process group has no FSDP (as Megatron's "
                              f"precision-aware optimizer needs its distributed optimizer): launch through moetrain "
                              f"train / torchrun, or use parallel.optimizer 'bf16-moments'")
        cast_parameters_(model, held)
    param_dtype = amp if ctx.device.type == "cuda" else None
    if param_dtype is None and held != torch.float32:
        param_dtype = torch.float32  # FSDP2 casts the held shards up for the CPU's fp32 compute
    parts = build_stages(model, pcfg, ctx.pp_rank)
    for part in parts:
        part.act_dtype = param_dtype or torch.float32
        parallelize(part, ctx, param_dtype=param_dtype)
        materialize(part, ctx, seed=job.train.seed)
        if init_from:
            # the checkpoint holds every stage: this stage reads its own tensors (and boxes), and must find them all;
            # a stage holding the whole model must match it exactly
            whole = part.spec.embed and part.spec.head
            res = load_hf_checkpoint(part, init_from, strict=whole, mtp_optional=True)
            if res.missing:
                raise ConfigError(f"{init_from} lacks {len(res.missing)} tensor(s) of pipeline stage "
                                  f"{part.spec.index}, e.g. {res.missing[:3]}")
    objective = Objective(job.model)
    runner = build_runner(parts, objective, ctx, job.train.grad_accum, job.train.micro_batch_size,
                          job.data.seq_len)
    # an embedding copy exists when the last stage, holding the MTP modules, is not the first
    sync = job.model.mtp_depth > 0 and pcfg.n_stages > 1
    group = embedding_groups(ctx) if sync else None
    return ModelParts(parts, objective, runner, group, sync)


def _resume(job: JobConfig, ctx: ParallelContext, model: ModelParts, optimizer: Any, loader: Loader,
            resume_from: Path | None) -> tuple[int, Path | None]:
    """With ``train.resume``: load ``resume_from`` (the newest complete checkpoint, or None: start fresh) into the
    parts, optimizer and loader. Returns (steps done, the checkpoint)."""
    if not job.train.resume:
        return 0, None
    if resume_from is None:
        if ctx.is_main:
            print(f"[moetrain] --resume: no complete checkpoint in {job.train.out_dir}/checkpoints; starting fresh")
        return 0, None
    check_checkpoint_compatible(resume_from, job)
    state = load_checkpoint(resume_from, model, optimizer, ctx)
    loader.load_state_dict(state["loader"])
    if ctx.is_main:
        print(f"[moetrain] resumed from step {state['step']} of {job.train.out_dir} ({resume_from.name})")
        saved = state.get("job", {}).get("parallel", {}).get("optimizer", "fp32")
        if saved != job.parallel.optimizer:
            print(f"[moetrain] note: the checkpoint's optimizer states were {saved}, this run keeps "
                  f"{job.parallel.optimizer}: the fp32 master weights are loaded exactly, the Adam moments converted "
                  f"to {STATE_DTYPES[job.parallel.optimizer][1] or torch.float32} (rounded where narrower)")
    return state["step"], resume_from


def _tokens_per_step(job: JobConfig, ctx: ParallelContext) -> int:
    """Tokens of one optimizer step over all ranks (the ranks of one pipeline read the same ones)."""
    tc = job.train
    return tc.micro_batch_size * tc.grad_accum * ctx.stage_size * job.data.seq_len


def _recipe_fields(job: JobConfig, ctx: ParallelContext) -> list[LogField]:
    """The start-up line's account of every recipe choice of the run: layout, dispatcher, precision and FP8
    recipe, overlap, pipeline schedule, recompute, FSDP, the learning-rate schedule and what the loss adds up."""
    pcfg, tc, m = ctx.pcfg, job.train, job.model
    dispatcher = pcfg.dispatch_rows if pcfg.moves_tokens else "local"  # at EP 1 a permutation, no all-to-all
    fp8 = PLAN_PRECISION_TO_FP8.get(pcfg.precision, "none")
    on = {True: "on", False: "off"}
    return [
        LogField(f"{ctx.world_size} ranks on", ctx.device.type),
        LogField("layout", f"DP={pcfg.dp} EP={pcfg.ep} PP={pcfg.pp}" + (f" VPP={pcfg.stages_per_rank}"
                                                                        if pcfg.stages_per_rank > 1 else "")),
        LogField("dispatcher", f"{dispatcher} ({pcfg.dispatch_precision} rows)"),
        LogField("precision", f"{pcfg.run_precision(ctx.device.type)} (FP8 {'off' if fp8 == 'none' else fp8}"
                 f"{', FP8 primary weights' if pcfg.fp8_param else ''})"),
        LogField("overlap", f"shared experts {on[pcfg.overlap]}, EP overlap {on[pcfg.ep_overlap]}, "
                            f"chunks {pcfg.n_chunks}"),
        LogField("schedule", f"{pcfg.schedule} ({pcfg.n_stages} stages)" if pcfg.pp > 1 else "none (PP=1)"),
        LogField("recompute", str(pcfg.recompute) + (
            f" ({', '.join(sorted(pcfg.recomputed_modules))})" if pcfg.recomputed_modules else "")),
        LogField("fsdp", on[bool(pcfg.fsdp)]),
        LogField("optimizer states", str(pcfg.optimizer)),
        *([LogField("node-limited routing", f"M={pcfg.node_limit_m} of {pcfg.ep_nodes} node(s)" + (
            "" if pcfg.node_limit_m < pcfg.ep_nodes else " (no limit: the EP group spans no more nodes)"))]
          if pcfg.node_limit_m is not None else []),
        LogField("lr", f"{tc.schedule} {tc.lr:g} -> {tc.min_lr:g}, warm-up {tc.warmup_steps}"
                       if tc.schedule != "constant" else f"constant {tc.lr:g}, warm-up {tc.warmup_steps}"),
        LogField("loss", (f"lm + mtp ({m.mtp_loss_weight:g} x MTP CE)" if m.mtp_depth
                          else "lm + mtp (none: mtp_depth 0)")
                 + f" + bal ({m.balance_loss_alpha:g} x balance); val is lm"),
    ]


def _announce(job: JobConfig, ctx: ParallelContext, model: ModelParts, sink: MetricsSink | NullSink,
              start_step: int, peak: tuple[float, str]) -> None:
    """The run's first console line and its "run" record."""
    pcfg = ctx.pcfg
    fpt = flops_per_token(job.model, job.data.seq_len)
    dispatcher = pcfg.dispatch_rows if pcfg.moves_tokens else "local"  # at EP 1 a permutation, no all-to-all
    fields = [*_recipe_fields(job, ctx),
              LogField(f"model {job.preset}:", f"{local_numel(model):,} params on rank 0"),
              LogField("tokens/step", f"{_tokens_per_step(job, ctx):,}"),
              LogField("GFLOP/token", f"{fpt.megatron / 1e9:.3f} (Megatron-Core)"),
              LogField("peak", f"{peak[0]:.3f} TFLOP/s ({peak[1]})")]
    sink.print("[moetrain] " + " | ".join(map(str, fields)))
    sink.write({"kind": "run", "step": start_step, "world": ctx.world_size, "dp": pcfg.dp, "ep": pcfg.ep,
                "pp": pcfg.pp, "vpp": pcfg.stages_per_rank, "pp_schedule": pcfg.schedule,
                "dispatcher": dispatcher, "preset": job.preset, "flops_per_token_megatron": fpt.megatron,
                "flops_per_token_6n": fpt.six_n, "peak_tflops": peak[0], "peak_label": peak[1],
                "precision": pcfg.run_precision(ctx.device.type),
                "fp8_recipe": PLAN_PRECISION_TO_FP8.get(pcfg.precision, "none"), "config": job.to_dict()})


def _callbacks(job: JobConfig, prep: PreparedData, ctx: ParallelContext, model: ModelParts, optimizer: Any,
               loader: Loader, stop: StopRequest, report_stop: bool, amp: torch.dtype | None,
               peak_tflops: float) -> list[Callback]:
    """The loop's callbacks, in the order they run: the loss check, step metrics, evaluation, stop signals,
    checkpoints, profiling."""
    tc, pcfg = job.train, ctx.pcfg
    fingerprint = data_fingerprint(prep)
    return [
        FiniteLoss(),
        StepMetricsLogger(ctx, [m for _, m in model.moe_layers()], tc.log_every, _tokens_per_step(job, ctx),
                          flops_per_token(job.model, job.data.seq_len).megatron, peak_tflops,
                          bubble_formula(pcfg, tc.grad_accum), pcfg.pp > 1, pcfg.moves_tokens),
        Evaluation(lambda: validate(model, prep, job, ctx, amp), tc.eval_every),
        StopOnSignal(stop, tc.out_dir, ctx, report_stop),
        Checkpointing(tc.out_dir, tc.ckpt_every, tc.keep_ckpts, model, optimizer, ctx,
                      lambda: {"loader": loader.state_dict(), "model_config": job.model.to_dict(),
                               "job": job.to_dict(), "data": fingerprint}),
        Profiler(tuple(tc.profile_steps), tc.out_dir, ctx),
    ]


def _fit(job: JobConfig, ctx: ParallelContext, model: ModelParts, optimizer: Any, loader: Loader,
         amp: torch.dtype | None, loop: LoopState, callbacks: list[Callback], progress: dict[str, Any]) -> None:
    """The training loop: learning rate, batches and one step each iteration; the rest is the callbacks'."""
    tc = job.train
    for cb in callbacks:
        cb.pre_train(loop)
    for step in range(loop.start_step, tc.steps):
        progress["step"] = step + 1
        for cb in callbacks:
            cb.pre_step(loop)
        loop.lr = lr_at(step, lr=tc.lr, min_lr=tc.min_lr, warmup_steps=tc.warmup_steps, total_steps=tc.steps,
                        schedule=tc.schedule)
        set_lr(optimizer, loop.lr)
        # The ranks of one pipeline (one per stage) read the same data; the stage's DP x EP ranks different data.
        batches = [loader.next_batch() for _ in range(tc.grad_accum)]
        batches = [(x.to(ctx.device, non_blocking=True), y.to(ctx.device, non_blocking=True)) for x, y in batches]
        with ExitStack() as around:
            for cb in callbacks:
                around.enter_context(cb.around_step(loop))
            result = train_step(model, optimizer, batches, job.model, ctx, tc.max_grad_norm, amp)
        loop.step = step + 1
        for cb in callbacks:
            cb.post_step(loop, result)
        if loop.stop_signal:
            break
    for cb in callbacks:
        cb.post_train(loop)


def _summary(job: JobConfig, ctx: ParallelContext, loop: LoopState, peak_tflops: float) -> dict[str, Any]:
    """The run's summary: returned, its "summary" record, and the console's last line, printed however the run
    ended (finished, resumed, stopped by a signal or the stop file): steps and tokens of this run, wall time, mean
    training throughput (evaluation and checkpoints excluded) and MFU, the final train LM and validation losses,
    where the checkpoint and the metrics are."""
    tc = job.train
    ckpt = loop.last_checkpoint
    steps_run = loop.step - loop.start_step
    tokens = steps_run * _tokens_per_step(job, ctx)
    wall = time.perf_counter() - loop.wall_start
    tok_s_gpu = tokens / loop.train_s / ctx.world_size if loop.train_s > 0 else 0.0
    mfu = tok_s_gpu * flops_per_token(job.model, job.data.seq_len).megatron / 1e12 / peak_tflops
    metrics = str(Path(tc.out_dir) / "metrics.jsonl")
    summary = {"steps": tc.steps, "start_step": loop.start_step, "val": loop.val, "train": loop.train,
               "world": ctx.world_size, "ep": ctx.pcfg.ep, "out_dir": tc.out_dir,
               "checkpoint": str(ckpt) if ckpt else None, "stopped": loop.stopped, "end_step": loop.step,
               "tokens": tokens, "wall_s": wall, "train_s": loop.train_s, "tokens_per_s_per_gpu": tok_s_gpu,
               "mfu": mfu, "train_lm": loop.train_lm[-1][1] if loop.train_lm else None,
               "val_loss": loop.val[-1][1] if loop.val else None, "metrics": metrics}
    if loop.val_by_source:  # a mixture's (one stream's summary stays as it was)
        summary["val_loss_by_source"] = loop.val_by_source
    how = (f"stopped ({loop.stopped['signal']}) at step {loop.step} of {tc.steps}" if loop.stopped
           else f"done: step {loop.step} of {tc.steps}")
    fields = [f"{steps_run} steps ({loop.start_step} -> {loop.step}) in {format_duration(wall)}",
              f"{tokens:,} tokens", f"mean {tok_s_gpu:,.0f} tok/s/gpu, MFU {100 * mfu:.1f}%"]
    if loop.train_lm:
        fields.append(f"train lm {loop.train_lm[-1][1]:.4f} (step {loop.train_lm[-1][0]})")
    if loop.val:
        first = (f"{loop.val[0][1]:.4f} (step {loop.val[0][0]}) -> " if len(loop.val) > 1 else "")
        fields.append(f"val lm loss {first}{loop.val[-1][1]:.4f} (step {loop.val[-1][0]})")
        if loop.val_by_source:  # a mixture's: val_loss is the weights' mean of these
            fields.append("by source " + ", ".join(f"{k} {v:.4f}" for k, v in loop.val_by_source.items()))
    fields += [f"checkpoint {ckpt if ckpt else 'none written'}", f"metrics {metrics}"]
    loop.sink.print(f"[moetrain] {how} | " + " | ".join(fields))
    loop.sink.write({"kind": "summary", "step": loop.step, **{k: v for k, v in summary.items() if k != "train"}})
    loop.sink.close()
    return summary


def _run(job: JobConfig, prep: PreparedData, ctx: ParallelContext, dry_run: bool, stop: StopRequest,
         progress: dict[str, Any], report_stop: bool) -> dict[str, Any]:
    tc = job.train
    if ctx.is_main and "RANK" in os.environ and report_stop:
        clear_stop_file(tc.out_dir)  # a stale request of an earlier run; the config check below orders it first
    check_same_config(ctx, job.to_dict())
    amp = autocast_dtype(job, ctx.device)
    # A resumed checkpoint supersedes the initial weights, so they are not read at all then.
    # Sizes only: the launcher's preflight read every byte against the checksums and set damaged ones aside.
    resume_from = resume_checkpoint(tc.out_dir, checksums=False)[0] if tc.resume else None
    model = build_model_parts(job, ctx, amp, init_from=None if resume_from is not None else tc.init_from)
    optimizer = build_optimizers(model.parts, tc.lr, tc.weight_decay, (tc.beta1, tc.beta2), tc.eps,
                                 job.parallel.optimizer)
    if dry_run:
        from moetrain.train.dryrun import report_dry_run
        return report_dry_run(job, ctx, model.parts[0] if len(model.parts) == 1 else torch.nn.ModuleList(model.parts))
    loader = train_loader(prep, job.data.seq_len, tc.micro_batch_size, ctx.data_rank, ctx.stage_size,
                          seed=job.data.seed)  # a MixtureLoader for data.sources
    start_step, last_ckpt = _resume(job, ctx, model, optimizer, loader, resume_from)
    sink = (MetricsSink(tc.out_dir, tc.tensorboard, resume_step=start_step, wandb=tc.wandb, run_config=job.to_dict())
            if ctx.is_main else NullSink())
    if ctx.is_main:
        save_job_config(job, Path(tc.out_dir) / "config.toml")
        keep_tokenizer(prep, tc.out_dir)
    peak = device_peak(ctx.device, amp)
    _announce(job, ctx, model, sink, start_step, peak)
    loop = LoopState(tc.steps, start_step, sink, step=start_step, last_checkpoint=last_ckpt)
    callbacks = _callbacks(job, prep, ctx, model, optimizer, loader, stop, report_stop, amp, peak[0])
    _fit(job, ctx, model, optimizer, loader, amp, loop, callbacks, progress)
    return _summary(job, ctx, loop, peak[0])
