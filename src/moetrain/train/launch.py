"""``moetrain train``: check everything, prepare the data once, then start the workers.

Run plainly, it starts ``nproc`` local workers itself through PyTorch's elastic launcher (the engine behind
``torchrun``): one per GPU, or 2 on a CPU. Run under ``torchrun`` (RANK in the environment), each process is a
worker already and trains directly -- that is how multi-node jobs run::

    torchrun --nnodes 2 --nproc-per-node 8 --rdzv-backend c10d --rdzv-endpoint HOST:29500 -m moetrain train \\
        --config job.toml

Everything that can be checked without the workers is checked first, so bad input fails in seconds with a message
naming the problem: the config, the data sources, the tokenizer's vocabulary against the model's, EP against the
experts and the world size, and a resumed checkpoint's model.
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import uuid
from pathlib import Path
from collections.abc import Callable
from typing import Any

import torch

from moetrain.config import JobConfig, job_config_from_dict
from moetrain.data import DataError, prepare_data
from moetrain.data.prepare import PreparedData
from moetrain.data.progress import PrepProgress
from moetrain.interop.hf import check_hf_checkpoint
from moetrain.model.config import ConfigError
from moetrain.parallel import mesh
from moetrain.parallel.hang import last_stall
from moetrain.parallel.mesh import join_process_group, shutdown
from moetrain.errors import CheckpointError
from moetrain.train.checkpoint import (checkpoint_dir, has_checksums, latest_checkpoint, read_trainer_state,
                                       resume_checkpoint)
from moetrain.train.stopping import StopRequest, clear_stop_file
from moetrain.train.resume import (check_same_data, check_same_stream, check_same_tokenizer_file,
                                   check_schedule_unchanged)
from moetrain.train.rank0 import ThisRankOnly, rank0_decides
from moetrain.train.runlock import RunLock
from moetrain.train.trainer import check_checkpoint_compatible, resolve_device, run


def default_nproc(job: JobConfig) -> int:
    if job.train.nproc:
        return job.train.nproc
    if resolve_device(job) == "cuda":
        return mesh.visible_gpus()
    return 2


def check_gpus(job: JobConfig, local_procs: int) -> None:
    """On CUDA every local worker takes the GPU of its local rank: refuse, before any worker starts, more local
    workers than visible GPUs (rank ``local_procs - 1`` would otherwise fail on ``cuda:<n>`` at start-up).

    Raises:
        ConfigError: no GPU visible, or fewer than ``local_procs``; names the count and the fixes.
    """
    if resolve_device(job) != "cuda":
        return
    n = mesh.visible_gpus()
    if n == 0:
        raise ConfigError("train.device='cuda' but no CUDA device is visible; use train.device='cpu' or 'auto'")
    if local_procs > n:
        shown = os.environ.get("CUDA_VISIBLE_DEVICES")
        where = f" (CUDA_VISIBLE_DEVICES={shown})" if shown is not None else ""
        raise ConfigError(f"{local_procs} worker processes on this machine need one GPU each, but {n} GPU"
                          f"{'s are' if n > 1 else ' is'} visible{where}; use --nproc {n} (or fewer), or "
                          f"train.device='cpu'")


#: Largest ``--dry-run --world``: the fake process group still builds an N-rank mesh here (about 1 GiB at 10^6).
MAX_DRY_RUN_WORLD = 131072


def available_memory_bytes(device: str) -> tuple[int, str]:
    """(bytes a process may use, what was read): the first GPU's total memory on CUDA, else MemAvailable for the whole
    machine (the local processes share it)."""
    if device == "cuda":
        return torch.cuda.get_device_properties(0).total_memory, "per GPU"
    try:
        for line in open("/proc/meminfo"):
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024, "available on this machine"
    except OSError:
        pass
    return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES"), "on this machine"


def check_memory(job: JobConfig, world_size: int, local_procs: int, dry_run: bool) -> None:
    """Refuse, before anything is allocated, a layout whose fp32 shards cannot fit: a dry run allocates each rank's
    weights, training also their gradients and AdamW's two moments (4x; activations come on top).

    Raises:
        ConfigError: naming the need, what the machine has, and the ways on (more processes, ``--dry-run --world``).
    """
    from moetrain.accounting import count_params

    per_rank = count_params(job.model).total_with_mtp * 4 / world_size * (1 if dry_run else 4)
    device = resolve_device(job)
    have, what = available_memory_bytes(device)
    need = per_rank if device == "cuda" else per_rank * local_procs
    if need > have:
        kind = "weights" if dry_run else "weights, gradients and AdamW states"
        raise ConfigError(f"{job.preset} needs about {per_rank / 2**30:.1f} GiB per process for its fp32 {kind} on "
                          f"{world_size} processes ({need / 2**30:.1f} GiB here), but {have / 2**30:.1f} GiB is "
                          f"{what}: use more processes or GPUs, or a smaller model; `moetrain train --dry-run --world "
                          f"N` shows a layout's memory without allocating it")


def preflight(job: JobConfig, world_size: int, dry_run: bool = False, torchrun: bool = False) -> PreparedData:
    """All checks that need no worker, then data preparation (cached). Returns the prepared data.

    ``torchrun``: this process is one of torchrun's workers, each of which runs the preflight. Global rank 0 alone
    verifies the checkpoints' bytes, sets damaged ones aside, prints, and prepares the data first
    (:func:`moetrain.train.rank0.rank0_decides`); the others wait, check that they see the checkpoint it chose, and
    reuse its prepared data; an error of rank 0 is raised on every rank with the same message (the CLI prints it on
    rank 0 only); one that another rank alone meets has :class:`moetrain.train.rank0.ThisRankOnly` as its cause.

    Raises:
        ConfigError, DataError, CheckpointError: naming the problem and the fix.
    """
    job.parallel.resolve(world_size, job.model.n_routed_experts)
    from moetrain.parallel.pipeline import check_pipeline
    check_pipeline(job.model, job.parallel, job.train.grad_accum)
    local_procs = int(os.environ.get("LOCAL_WORLD_SIZE", world_size))
    check_gpus(job, local_procs)
    check_memory(job, world_size, local_procs, dry_run)
    if not torchrun:  # moetrain's own launcher: this process runs the preflight once for its workers
        return _check_and_prepare(job, world_size, _choose_checkpoint(job), print)
    join_process_group(job.parallel.timeout_s, resolve_device(job))

    def on_rank0() -> tuple[PreparedData, str | None]:
        if not dry_run:  # the run's lock, held by global rank 0 until its process ends (moetrain.train.runlock)
            RunLock(job.train.out_dir).acquire()
        ckpt = _choose_checkpoint(job)
        return _check_and_prepare(job, world_size, ckpt, print), ckpt.name if ckpt else None

    prep, name = rank0_decides(on_rank0, "checking the checkpoints and preparing the data",
                               (ConfigError, DataError, CheckpointError))
    if prep is not None:  # rank 0
        return prep
    # Rank 0 moved the damaged checkpoints aside; the others read the same directory (DCP needs a file system that
    # every node shares: each rank reads the shards the metadata points it to), so the newest complete one it sees
    # by sizes alone is the one rank 0 chose -- unless this node does not see rank 0's out_dir.
    ckpt = checkpoint_dir(job.train.out_dir) / name if name else None
    seen = (resume_checkpoint(job.train.out_dir, checksums=False)[0] if job.train.resume
            else latest_checkpoint(job.train.out_dir))
    if seen != ckpt:
        raise CheckpointError(f"rank {os.environ['RANK']} sees {seen or 'no checkpoint'} where rank 0 chose "
                              f"{ckpt or 'none'}: {job.train.out_dir} must be one directory on a file system that "
                              f"every node shares (DCP reads the shards of every rank)") from ThisRankOnly()
    try:
        return _check_and_prepare(job, world_size, ckpt, _quiet, PrepProgress(enabled=False))
    except (ConfigError, DataError, CheckpointError) as e:  # rank 0 passed these checks: what this rank sees
        raise type(e)(f"rank {os.environ['RANK']}: {e}") from ThisRankOnly()


def _quiet(*args: Any, **kwargs: Any) -> None:
    """``print`` of the torchrun ranks other than 0: rank 0 prints the preflight's lines once for the job."""


def _choose_checkpoint(job: JobConfig) -> Path | None:
    """The checkpoint a run resumes from: with ``train.resume``, the newest that verifies (every byte read against
    its checksums), the newer ones that do not moved aside as ``damaged-step_<N>`` and named on stdout; without it,
    the newest complete one (which :func:`_check_and_prepare` refuses to overwrite); None when there is none.

    Raises:
        CheckpointError: with ``train.resume``, checkpoints exist but none verifies (each with its reason).
    """
    ckpt = latest_checkpoint(job.train.out_dir)
    if not (job.train.resume and ckpt is not None):
        return ckpt
    ckpt, skipped = resume_checkpoint(job.train.out_dir)
    for bad, why in skipped:
        if ckpt is not None:  # set aside, not deleted: rotation would otherwise keep it over the good ones
            kept, n = bad.with_name(f"damaged-{bad.name}"), 1
            while kept.exists():  # the same step damaged before: keep both
                kept, n = bad.with_name(f"damaged-{bad.name}.{n}"), n + 1
            os.replace(bad, kept)
            print(f"[moetrain] skipping checkpoint {bad.name}: {why}; moved to {kept.name}")
        else:
            print(f"[moetrain] skipping checkpoint {bad.name}: {why}")
    if ckpt is None:
        why = "; ".join(f"{bad.name}: {reason}" for bad, reason in skipped)
        raise CheckpointError(f"no checkpoint in {job.train.out_dir}/checkpoints verifies ({why}); delete the "
                              f"damaged ones to start over, or choose a new --out")
    return ckpt


def _check_and_prepare(job: JobConfig, world_size: int, ckpt: Path | None, say: Callable[[str], None],
                       progress: PrepProgress | None = None) -> PreparedData:
    """The preflight's checks of the chosen checkpoint ``ckpt`` (see :func:`_choose_checkpoint`) against the job, of
    ``train.init_from``, then data preparation (``progress``: its reporter, None for the default) and the checks of
    the data. ``say`` prints the notes. Returns the prepared data.

    Raises:
        ConfigError, DataError, CheckpointError: naming the problem and the fix.
    """
    state = None
    if job.train.resume and ckpt is not None:
        if not has_checksums(ckpt):
            say(f"[moetrain] checkpoint {ckpt.name} has no checksums (written by an earlier moetrain): verified by "
                f"file sizes only")
        state = read_trainer_state(ckpt)
        if job.data.tokenizer:
            check_same_tokenizer_file(ckpt, state, job)  # first: another tokenizer also changes the vocabulary
        state = check_checkpoint_compatible(ckpt, job)
        saved = state.get("loader", {})
        if saved.get("seq_len") not in (None, job.data.seq_len):
            raise ConfigError(f"checkpoint {ckpt} was trained with data.seq_len={saved['seq_len']}; resume with "
                              f"the same data.seq_len (got {job.data.seq_len})")
        if state.get("step", 0) >= job.train.steps:
            raise ConfigError(f"checkpoint {ckpt} is at step {state['step']} >= train.steps={job.train.steps}: "
                              f"nothing to do; raise --steps to train further (a decaying schedule then changes: "
                              f"add --set train.allow_schedule_change=true)")
        check_schedule_unchanged(ckpt, state, job)
    if job.train.init_from and not (job.train.resume and ckpt is not None):
        # names and shapes, from the file headers only
        res = check_hf_checkpoint(job.model, job.train.init_from, mtp_optional=True)
        if res.mtp_missing:
            say(f"[moetrain] note: {job.train.init_from} has no MTP weights (transformers saves DeepseekV3 "
                f"without them); the {job.model.mtp_depth} MTP module(s) start from the usual initialisation")
    if not job.train.resume and ckpt is not None:
        raise ConfigError(f"{job.train.out_dir} already holds checkpoints (newest {ckpt.name}); pass --resume to "
                          f"continue that run, or choose a new --out")
    prep = prepare_data(job.data, progress)
    if state is not None:
        check_same_data(ckpt, state, prep, job)
        check_same_stream(ckpt, state, prep, job)
    if prep.vocab_size > job.model.vocab_size:
        raise ConfigError(f"the tokenizer has {prep.vocab_size} tokens but model.vocab_size is "
                          f"{job.model.vocab_size}; set model.vocab_size >= {prep.vocab_size} or use a smaller "
                          f"tokenizer (data.vocab_size)")
    need = (job.data.seq_len + 1) * world_size * job.train.micro_batch_size
    for split, n in (("training", prep.n_train_tokens), ("validation", prep.n_val_tokens)):
        if split == "validation" and not job.train.eval_every:
            continue
        if n < (job.data.seq_len + 1) * world_size:
            raise ConfigError(f"the {split} split has {n} tokens, fewer than one {job.data.seq_len + 1}-token window "
                              f"per rank ({world_size} ranks); add data or lower data.seq_len")
    if prep.n_train_tokens < need:
        say(f"[moetrain] note: {prep.n_train_tokens} training tokens < one global batch ({need}); the data "
            f"will repeat within a step")
    return prep


def _worker(job_dict: dict[str, Any], prep_dict: dict[str, Any], dry_run: bool = False,
            report_stop: bool = True) -> dict[str, Any]:
    job = job_config_from_dict(job_dict)
    if not job.train.threads_per_proc and job.train.device != "cuda":
        local = int(os.environ.get("LOCAL_WORLD_SIZE", "1"))
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // local))
    return run(job, PreparedData(**prep_dict), dry_run=dry_run, report_stop=report_stop)


def _kill_workers() -> None:
    """A second signal to the launcher: end the workers at once (they would outlive it otherwise)."""
    import multiprocessing
    import sys

    print("[moetrain] second signal: stopping at once; the newest complete checkpoint is kept", file=sys.stderr)
    for p in multiprocessing.active_children():
        p.kill()


def _rank_log(job: JobConfig, rank: int) -> Path:
    return Path(job.train.out_dir) / "logs" / f"rank-{rank}.log"


def _rank_log_sizes(job: JobConfig, nproc: int) -> dict[int, int]:
    """Bytes in each local rank's log before this run: what a failure report reads starts after them."""
    return {r: (_rank_log(job, r).stat().st_size if _rank_log(job, r).is_file() else 0) for r in range(nproc)}


def _first_failure(e: Any) -> tuple[int, Any, str]:
    """(rank, failure record, its message stripped) of the worker that failed first in torch's ``ChildFailedError``
    ``e``: the root cause fails first, the others follow it."""
    rank, first = min(e.failures.items(), key=lambda kv: kv[1].timestamp)
    msg = first.message
    if isinstance(msg, dict):
        msg = msg.get("message", json.dumps(msg))
    return rank, first, (msg or "").strip()


def _local_launcher(nproc: int, entry: Any, signals_to_handle: str | None = None) -> Any:
    """torch's elastic launcher of ``nproc`` local workers running ``entry`` (rendezvous on a free local port, no
    restarts), with torch's own launcher logging silenced: the callers report a failure in one line.
    ``signals_to_handle``: the signals the launcher turns into an exception (None: torch's default)."""
    from torch.distributed.launcher.api import LaunchConfig, elastic_launch

    extra = {} if signals_to_handle is None else {"signals_to_handle": signals_to_handle}
    config = LaunchConfig(min_nodes=1, max_nodes=1, nproc_per_node=nproc, run_id=f"moetrain-{uuid.uuid4().hex[:8]}",
                          rdzv_backend="c10d", rdzv_endpoint="127.0.0.1:0", max_restarts=0, monitor_interval=0.2,
                          start_method="spawn", **extra)
    for name in ("torch.distributed.elastic", "torch.distributed.launcher", "torch.multiprocessing"):
        logging.getLogger(name).setLevel(logging.CRITICAL)
    return elastic_launch(config, entry)


def _failure_message(e: Any, job: JobConfig, log_sizes: dict[int, int] | None = None) -> str:
    """One line for a failed worker: the first failure's own one-line message (rank, step, exception, where its
    traceback is) -- or how it died, with the phase its hang monitor reported stuck in this run (``log_sizes``: the
    rank logs' sizes when it started) -- and how to continue."""
    ckpt = latest_checkpoint(job.train.out_dir)
    hint = f"rerun with --resume to continue from {ckpt}" if ckpt else "no checkpoint was written"
    rank, first, msg = _first_failure(e)
    if msg.startswith("WorkerFailure: "):
        reason = msg.removeprefix("WorkerFailure: ").splitlines()[0]
    elif first.exitcode < 0:
        reason = f"rank {rank} was killed by signal {-first.exitcode}"
        # NCCL's watchdog aborts (SIGABRT) a process whose collective timed out; the hang monitor named the phase
        stall = last_stall(_rank_log(job, rank), (log_sizes or {}).get(rank, 0))
        if stall is not None:
            reason += f", after: {stall}"
    else:
        reason = f"rank {rank} exited with code {first.exitcode}" + (f": {msg.splitlines()[-1]}" if msg else "")
    if "checkpoint" in reason:  # the worker's own message already says where to go on from
        return f"a training worker failed: {reason}"
    return f"a training worker failed: {reason}; {hint}"


def torchrun_world(job: JobConfig, world: int) -> JobConfig:
    """``job`` with ``train.nproc`` = ``world``, torchrun's WORLD_SIZE: torchrun decides the world, and the run's saved
    config records the world it trained on.

    Raises:
        ConfigError: ``train.nproc`` (``--nproc``, or a ``--plan``'s process count) is set to another count.
    """
    if job.train.nproc and job.train.nproc != world:
        raise ConfigError(f"train.nproc={job.train.nproc} (--nproc) but torchrun started {world} processes "
                          f"(WORLD_SIZE={world}): under torchrun, torchrun decides the world (--nnodes x "
                          f"--nproc-per-node); drop --nproc / train.nproc, or start {job.train.nproc} processes")
    return dataclasses.replace(job, train=dataclasses.replace(job.train, nproc=world))


def train_main(job: JobConfig, dry_run: bool = False, world: int | None = None,
               plan: Any = None, gpu: str | None = None) -> dict[str, Any] | None:
    """Entry point of ``moetrain train``. Returns rank 0's summary (None on other torchrun ranks).

    ``dry_run``: all set-up, no step, a memory report per rank. ``world`` (with ``dry_run``): the report for rank 0 of
    a ``world``-rank layout, built on meta in this process (no data preparation, no workers). ``plan`` (a
    :class:`moetrain.train.from_plan.PlanFile`, with ``world``): the plan the job came from, whose prediction the
    report sets beside the run, stage by stage. ``gpu`` (with ``world``): the GPU catalogue name the layout is
    predicted on and judged against (:mod:`moetrain.train.fit`).

    Raises:
        ConfigError: ``world`` without ``dry_run``, or a layout that does not fit.
    """
    if gpu is not None and world is None:
        raise ConfigError(f"--gpu {gpu} judges a --dry-run --world N layout against that GPU's memory; add "
                          f"--dry-run --world N, or drop --gpu")
    if world is not None:
        if not dry_run:
            raise ConfigError("--world N describes a layout that does not exist here; it needs --dry-run")
        if not 1 <= world <= MAX_DRY_RUN_WORLD:
            raise ConfigError(f"--world {world} must be between 1 and {MAX_DRY_RUN_WORLD:,} (the device mesh of the "
                              f"layout is built in this process)")
        from moetrain.train.dryrun import dry_run_world
        return dry_run_world(job, world, plan, gpu)
    if "RANK" in os.environ:  # under torchrun: this process is one worker
        world = int(os.environ["WORLD_SIZE"])
        job = torchrun_world(job, world)
        try:
            prep = preflight(job, world, dry_run, torchrun=True)
        except BaseException:
            shutdown()  # the process group preflight joined; the worker's run() ends it otherwise
            raise
        summary = _worker(job.to_dict(), dataclasses.asdict(prep), dry_run)
        return summary if int(os.environ["RANK"]) == 0 else None
    nproc = default_nproc(job)
    # one training run per directory (moetrain.train.runlock), taken before the preflight reads or moves anything
    lock = RunLock(job.train.out_dir).acquire() if not dry_run else None
    try:
        return _launch(job, nproc, dry_run)
    finally:
        if lock is not None:
            lock.release()


def _launch(job: JobConfig, nproc: int, dry_run: bool) -> dict[str, Any] | None:
    """The preflight, then ``nproc`` local workers under torch's elastic launcher; rank 0's summary."""
    prep = preflight(job, nproc, dry_run)
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    # SIGINT/SIGTERM are moetrain's (moetrain.train.stopping): torch's launcher would turn them into an exception
    # and kill the workers mid-step
    launch = _local_launcher(nproc, _worker, signals_to_handle="SIGHUP,SIGQUIT")
    clear_stop_file(job.train.out_dir)
    stop = StopRequest(out_dir=job.train.out_dir, on_second=_kill_workers).install()
    log_sizes = _rank_log_sizes(job, nproc)
    try:
        results = launch(job.to_dict(), dataclasses.asdict(prep), dry_run, False)
    except ChildFailedError as e:
        if stop.signum:  # interrupted before the workers could install their own handlers (start-up)
            raise KeyboardInterrupt from None
        raise RuntimeError(_failure_message(e, job, log_sizes)) from None
    finally:
        stop.uninstall()
        clear_stop_file(job.train.out_dir)
    return results[0]


def _local_worker(fn: Any, nproc: int, *args: Any) -> Any:
    if torch.get_num_threads() > 1 and not torch.cuda.is_available():
        torch.set_num_threads(max(1, (os.cpu_count() or 1) // nproc))
    return fn(*args)


def launch_local(job: JobConfig, fn: Any, *args: Any) -> Any:
    """Run ``fn(*args)`` (a module-level function) on ``job.train.nproc`` local worker processes, started as
    :func:`train_main` starts the trainer's (torch's elastic launcher, ``RANK``/``WORLD_SIZE`` set), and return rank
    0's result. Used by ``moetrain eval`` at a chosen layout.

    Raises:
        ConfigError: more CUDA workers than GPUs. RuntimeError: a worker failed (its message, in one line).
    """
    from torch.distributed.elastic.multiprocessing.errors import ChildFailedError

    nproc = job.train.nproc or default_nproc(job)
    check_gpus(job, nproc)
    try:
        return _local_launcher(nproc, _local_worker)(fn, nproc, *args)[0]
    except ChildFailedError as e:
        rank, first, msg = _first_failure(e)
        last = msg.splitlines()[-1] if msg else f"exit code {first.exitcode}"
        raise RuntimeError(f"worker rank {rank} failed: {last}") from None
