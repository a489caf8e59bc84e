"""``moetrain train --dry-run``: all the set-up of a run, no step, and what each rank will hold in memory.

Two forms:

* on this machine's processes (``--dry-run``): every worker builds the model on meta, parallelizes, materialises its
  shards (and reads ``--init-from``), then reports what it holds and its measured peak memory so far;
* for a layout that does not exist here (``--dry-run --world N``): one process joins torch's "fake" process group as
  rank 0 of N, builds the mesh, places the experts and FSDP-shards the meta model: the shard sizes are the real
  ones (rank 0 holds the largest FSDP shards), and nothing is allocated.

Beside the held bytes the report prints the performance model's memory prediction for the same plan
(:func:`moetrain.plan.model.predict`), so the two can be compared.
"""

from __future__ import annotations

import json
import math
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
import torch.distributed as dist

from moetrain.config import JobConfig
from moetrain.parallel.mesh import ParallelContext
from moetrain.parallel.parallelize import local_tensor

GiB = 2 ** 30


@dataclass
class RankMemory:
    """What one rank holds for training, bytes (params fp32 masters, gradients of the same dtype, AdamW's two
    moments); ``peak_measured`` is the high-water mark so far (RSS on CPU, CUDA max allocated on GPU), None on meta.
    """

    rank: int
    params: int
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    peak_measured: int | None

    @property
    def state_bytes(self) -> int:
        return self.param_bytes + self.grad_bytes + self.optim_bytes


def measured_peak(device: torch.device) -> int:
    """This process's memory high-water mark in bytes: CUDA max allocated on GPU, VmHWM (peak RSS) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rank_memory(model: torch.nn.Module, ctx: ParallelContext, measured: bool = True) -> RankMemory:
    """Count this rank's shards of every parameter (a DTensor's local part, else the whole tensor)."""
    locals_ = [local_tensor(p) for p in model.parameters()]
    n = sum(t.numel() for t in locals_)
    pb = sum(t.numel() * t.element_size() for t in locals_)
    return RankMemory(ctx.rank, n, pb, pb, 2 * pb, measured_peak(ctx.device) if measured else None)


def predicted_memory(job: JobConfig, world: int, device_type: str) -> dict[str, float] | None:
    """The performance model's per-rank memory (GiB) for the plan this run executes; None if it cannot model it."""
    from moetrain.plan.local import local_plan
    from moetrain.plan.model import predict

    precision = "bf16" if device_type == "cuda" and job.train.dtype != "fp32" else "fp32"
    plan = local_plan(job.model, job.data.seq_len, job.train.micro_batch_size, job.train.grad_accum, world=world,
                      ep=job.parallel.ep, activation_checkpointing=job.parallel.activation_checkpointing,
                      precision=precision, pp=job.parallel.pp, vpp=job.parallel.vpp,
                      schedule=job.parallel.pp_schedule, pp_layout=job.parallel.pp_layout)
    try:
        pred = predict(job.model, "H100", world, plan, _ignore_memory=True)
    except Exception as e:  # noqa: BLE001 - the report says why instead of failing the dry run
        return {"error": str(e)}  # type: ignore[dict-item]
    m = pred.memory
    return {"params": m.weights + m.fp8_weights, "grads": m.gradients, "optimizer": m.optimizer,
            "activations": m.activations}


def format_report(rows: list[RankMemory], pred: dict[str, Any] | None, title: str) -> str:
    lines = [title,
             f"{'rank':>5} {'params held':>14} {'params GiB':>11} {'grads GiB':>10} {'optim GiB':>10} "
             f"{'state GiB':>10} {'peak GiB':>9}"]
    for r in rows:
        peak = f"{r.peak_measured / GiB:9.3f}" if r.peak_measured is not None else f"{'(meta)':>9}"
        lines.append(f"{r.rank:>5} {r.params:>14,} {r.param_bytes / GiB:11.3f} {r.grad_bytes / GiB:10.3f} "
                     f"{r.optim_bytes / GiB:10.3f} {r.state_bytes / GiB:10.3f} {peak}")
    if pred and "error" not in pred:
        state = pred["params"] + pred["grads"] + pred["optimizer"]
        lines.append(f"{'model':>5} {'':>14} {pred['params']:11.3f} {pred['grads']:10.3f} {pred['optimizer']:10.3f} "
                     f"{state:10.3f} {'':>9}   <- performance model (moetrain plan), per rank; "
                     f"+{pred['activations']:.3f} GiB activations in a step")
    elif pred:
        lines.append(f"performance model: no prediction ({pred['error']})")
    return "\n".join(lines)


def layout_label(pcfg: Any) -> str:
    """E.g. "PP=2 (dualpipev, 4 stages) DP=1 EP=2", or "DP=2 EP=2" without pipelining."""
    pipe = f"PP={pcfg.pp} ({pcfg.pp_schedule}, {pcfg.n_stages} stages) " if pcfg.pp > 1 else ""
    return f"{pipe}DP={pcfg.dp} EP={pcfg.ep}"


def report_dry_run(job: JobConfig, ctx: ParallelContext, model: torch.nn.Module) -> dict[str, Any]:
    """Gather every rank's :class:`RankMemory` on rank 0, print the table there, and write it to
    ``<out_dir>/dry_run.json``. Returns the summary (rank 0's view)."""
    mine = rank_memory(model, ctx)
    rows: list[Any] = [mine]
    if ctx.distributed:
        rows = [None] * ctx.world_size
        dist.all_gather_object(rows, mine)
    summary: dict[str, Any] = {"dry_run": True, "world": ctx.world_size, "ranks": [asdict(r) for r in rows]}
    if ctx.is_main:
        pred = predicted_memory(job, ctx.world_size, ctx.device.type)
        summary["predicted_gib"] = pred
        print(format_report(rows, pred, f"[moetrain] dry run: {job.preset} on {ctx.world_size} ranks "
                                        f"({layout_label(ctx.pcfg)}), {ctx.device.type}; no step run"))
        out = Path(job.train.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "dry_run.json").write_text(json.dumps(summary, indent=2))
    return summary


def dry_run_world(job: JobConfig, world: int) -> dict[str, Any]:
    """Set up rank 0 of a ``world``-rank layout on the fake process group, entirely on meta, and print its memory.

    Raises:
        ConfigError: the layout does not fit ``world`` or the model.
    """
    from moetrain.model.transformer import build_model
    from moetrain.parallel.mesh import fake_parallel
    from moetrain.parallel.parallelize import parallelize

    from moetrain.parallel.pipeline import build_stages, check_pipeline

    check_pipeline(job.model, job.parallel, job.train.grad_accum)
    ctx = fake_parallel(job.parallel, world, job.model.n_routed_experts)
    try:
        model = build_model(job.model, device="meta")
        total = sum(math.prod(p.shape) for p in model.parameters())
        if ctx.pcfg.pp > 1:  # rank 0 holds the first pipeline rank's stages
            parts = build_stages(model, ctx.pcfg, 0)
            for part in parts:
                parallelize(part, ctx)
            model = torch.nn.ModuleList(parts)
        else:
            parallelize(model, ctx)
        row = rank_memory(model, ctx, measured=False)
        pred = predicted_memory(job, world, "cuda" if job.train.device == "cuda" else "cpu")
        print(format_report([row], pred, f"[moetrain] dry run on meta: {job.preset} ({total:,} parameters) as rank "
                                         f"0 of {world} ({layout_label(ctx.pcfg)}); nothing allocated, no "
                                         f"process started"))
        summary = {"dry_run": True, "world": world, "ranks": [asdict(row)], "predicted_gib": pred,
                   "total_params": total}
        out = Path(job.train.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "dry_run.json").write_text(json.dumps(summary, indent=2))
        return summary
    finally:
        dist.destroy_process_group()
