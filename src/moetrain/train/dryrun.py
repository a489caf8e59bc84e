"""``moetrain train --dry-run``: all the set-up of a run, no step, and what each rank will hold in memory.

Two forms:

* on this machine's processes (``--dry-run``): every worker builds the model on meta, parallelizes, materialises its
  shards (and reads ``--init-from``), then reports what it holds and its measured peak memory so far;
* for a layout that does not exist here (``--dry-run --world N``): one process joins torch's "fake" process group as
  rank 0 of N, builds the mesh, places the experts and FSDP-shards the meta model: the shard sizes are the real
  ones (rank 0 holds the largest FSDP shards), and nothing is allocated.

Beside the held bytes the report prints the performance model's memory prediction for the same plan
(:func:`moetrain.plan.model.predict`), so the two can be compared. ``dry_run.json`` carries the
:class:`~moetrain.layout.Layout` the run executes under the planner's names ("layout"); the ``--world`` form prints,
for every pipeline stage, the run's stage (items, parameters) beside the planner's prediction for the same stage,
then for every pipeline rank the state one of its ranks holds beside the planner's memory of that rank, and the
verdict on the GPU (:mod:`moetrain.train.fit`) -- for ``--plan``, the prediction of that plan, on its GPU unless
``--gpu`` names another.
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
from moetrain.layout import Layout
from moetrain.model.experts import GroupedExperts
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.mesh import ParallelContext
from moetrain.parallel.parallelize import cast_parameters_, local_tensor, parallelize
from moetrain.precision.apply import apply_precision
from moetrain.train.adamw import state_bytes_per_param
from moetrain.train.optim import STATE_DTYPES, held_param_dtype
from moetrain.train.fit import (DEFAULT_GPU, format_pipeline_ranks, pipeline_rank_rows, target_device, target_gpu,
                                verdict)

GiB = 2 ** 30


@dataclass
class RankMemory:
    """What one rank holds for training, bytes. Sharded between steps (FSDP2's shards): the parameters as held (fp32
    masters, or bf16 weights under the ``bf16`` optimizer states), gradients of the same dtype, and the optimizer's
    states (AdamW's two moments in the states' precision, plus the bf16 weights' 16-bit master remainders). At the
    step's peak also: ``gathered_bytes``, the weights all-gathered for the GEMMs (FSDP's ``param_dtype``, or one
    byte for FP8 primary weights), and ``accum_grad_bytes``, the unsharded gradients accumulated over the
    micro-batches before the reduce-scatter (FSDP2 accumulates in its reduce dtype, fp32); see
    :func:`rank_memory` for when each is whole. ``unsharded_params``: the parameters before FSDP sharding (the
    routed experts' EP share). ``peak_measured`` is the high-water mark so far (RSS on CPU, CUDA max allocated on
    GPU), None on meta.
    """

    rank: int
    params: int
    param_bytes: int
    grad_bytes: int
    optim_bytes: int
    peak_measured: int | None
    gathered_bytes: int = 0
    accum_grad_bytes: int = 0
    unsharded_params: int = 0

    @property
    def state_bytes(self) -> int:
        """The sharded state, held between steps."""
        return self.param_bytes + self.grad_bytes + self.optim_bytes

    @property
    def step_bytes(self) -> int:
        """The state at the step's peak: the sharded parameters and optimizer states, the gathered weights, and the
        gradients (the unsharded accumulators where they exist: the sharded gradients are made from them as they
        are freed, block by block)."""
        return (self.param_bytes + self.optim_bytes + self.gathered_bytes
                + max(self.grad_bytes, self.accum_grad_bytes))


def measured_peak(device: torch.device) -> int:
    """This process's memory high-water mark in bytes: CUDA max allocated on GPU, VmHWM (peak RSS) on CPU."""
    if device.type == "cuda":
        return torch.cuda.max_memory_allocated(device)
    for line in Path("/proc/self/status").read_text().splitlines():
        if line.startswith("VmHWM:"):
            return int(line.split()[1]) * 1024
    import resource
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss * 1024


def rank_memory(model: torch.nn.Module, ctx: ParallelContext, measured: bool = True,
                gather_dtype: torch.dtype | None = None, micro_batches: int = 1) -> RankMemory:
    """Count this rank's shards of every parameter (a DTensor's local part, else the whole tensor), with the
    optimizer states of ``ctx.pcfg.optimizer`` (:data:`moetrain.train.optim.STATE_DTYPES`), and what the step
    gathers at its peak.

    Gathered weights (each parameter unsharded over FSDP: the routed experts' EP share, everything else whole, in
    ``gather_dtype`` -- FSDP's ``param_dtype``, None for the parameter's own -- or one byte for FP8 primary
    weights): all of them where the parameters stay gathered through the step (``keeps_params_gathered``, and
    under PP, whose stages keep them from the first backward to the last); else (ZeRO-3 at PP 1) the root's own
    (embedding, head, final norm: never resharded) and the two largest blocks' (the one computing and the one
    prefetched). Gradient accumulators (fp32, FSDP2's reduce dtype): every parameter's where the step runs several
    backward passes before reducing (more than one micro-batch, PP, EP overlap, ``dp_overlap`` false), else none.

    Args:
        model: a stage, a whole model, or a ``ModuleList`` of this rank's stages, parallelized.
        ctx: the parallel context (its ``pcfg`` says the layout).
        measured: read this process's memory high-water mark.
        gather_dtype: FSDP's ``param_dtype`` (bf16 on a GPU), None where it keeps the parameters' own.
        micro_batches: micro-batches per step (``train.grad_accum``).
    """
    from moetrain.precision.primary_weights import Fp8MasterWeight

    pcfg = ctx.pcfg
    locals_ = [local_tensor(p) for p in model.parameters()]
    n = sum(t.numel() for t in locals_)
    pb = sum(t.numel() * t.element_size() for t in locals_)
    moment_dtype = STATE_DTYPES[pcfg.optimizer][1]
    ob = sum(t.numel() * state_bytes_per_param(t.dtype, moment_dtype) for t in locals_)

    def unsharded(p: torch.nn.Parameter, expert: bool) -> tuple[int, int]:
        """(elements, gathered bytes) of ``p`` unsharded over FSDP."""
        numel = math.prod(p.shape) // (pcfg.ep if expert else 1)
        held_fp8 = isinstance(local_tensor(p), Fp8MasterWeight)
        size = 1 if held_fp8 else (torch.finfo(gather_dtype).bits // 8 if gather_dtype else p.element_size())
        return numel, numel * size

    parts = list(model) if isinstance(model, torch.nn.ModuleList) else [model]
    all_gathered = pcfg.keeps_params_gathered or pcfg.pp > 1
    total_numel = gathered = 0
    for part in parts:
        in_blocks: set[int] = set()
        block_bytes = []
        for block in part.blocks():
            b = 0
            for mod in block.modules():
                for p in mod.parameters(recurse=False):
                    in_blocks.add(id(p))
                    numel, size = unsharded(p, isinstance(mod, GroupedExperts))
                    total_numel += numel
                    b += size
            block_bytes.append(b)
        root = 0
        for mod in part.modules():
            for p in mod.parameters(recurse=False):
                if id(p) not in in_blocks:
                    numel, size = unsharded(p, False)
                    total_numel += numel
                    root += size
        gathered += root + (sum(block_bytes) if all_gathered else sum(sorted(block_bytes)[-2:]))
    accumulates = micro_batches > 1 or pcfg.pp > 1 or pcfg.ep_overlap or not pcfg.dp_overlap
    return RankMemory(ctx.rank, n, pb, pb, ob, measured_peak(ctx.device) if measured else None,
                      gathered_bytes=gathered if ctx.distributed else 0,
                      accum_grad_bytes=4 * total_numel if accumulates and ctx.distributed else 0,
                      unsharded_params=total_numel)


def run_layout(job: JobConfig, pcfg: ParallelConfig, device_type: str) -> Layout:
    """The :class:`~moetrain.layout.Layout` a run of ``job`` executes on ``pcfg`` (resolved against the world) on
    ``device_type``: "auto" precision resolved, the pipeline split it makes, the model's MTP depth, and the
    per-assignment all-to-all that capacity mode always sends."""
    from moetrain.parallel.pipeline import default_layout

    pp_layout = (pcfg.pp_layout or default_layout(job.model, pcfg.n_stages)) if pcfg.pp > 1 else None
    return Layout(**pcfg.layout_fields()).replace(
        precision=pcfg.run_precision(device_type), mtp_depth=job.model.mtp_depth, pp_layout=pp_layout,
        dispatcher=pcfg.dispatch_rows)


def job_plan(job: JobConfig, layout: Layout) -> Any:
    """The planner's :class:`~moetrain.plan.plan.Plan` of a run of ``job`` with ``layout`` (framework moetrain)."""
    from moetrain.plan.local import trainer_plan

    return trainer_plan(job.model, layout, job.train.micro_batch_size, job.train.grad_accum, job.data.seq_len)


def predict_run(job: JobConfig, world: int, layout: Layout, plan: Any = None, gpu: str | None = None) -> Any:
    """The performance model's prediction for this run: of ``plan`` (a ``PlanFile``: its own plan) when the job came
    from one, else of the job's own plan; on ``gpu`` (a catalogue name), else the plan file's GPU, else an H100.
    Returns the Prediction, or the error's text."""
    from moetrain.plan.model import predict

    try:
        if plan is not None:
            return predict(plan.model or job.model, gpu or plan.gpu or DEFAULT_GPU, world, plan.plan,
                           _ignore_memory=True)
        return predict(job.model, gpu or DEFAULT_GPU, world, job_plan(job, layout), _ignore_memory=True)
    except Exception as e:  # noqa: BLE001 - the report says why instead of failing the dry run
        return str(e)


def predicted_memory(job: JobConfig, world: int, device_type: str, pred: Any = None,
                     pp_rank: int | None = None) -> dict[str, Any] | None:
    """The performance model's memory (GiB) of one rank of pipeline rank ``pp_rank`` (None: the heaviest, the one
    the planner's verdict reads) for the plan this run executes (``pred`` if given, else the job's own prediction);
    ``{"error": ...}`` if it cannot model it. ``"pp_rank"`` says which pipeline rank the numbers are."""
    if pred is None:
        pcfg = job.parallel.resolve(world, job.model.n_routed_experts)
        pred = predict_run(job, world, run_layout(job, pcfg, device_type))
    if isinstance(pred, str):
        return {"error": pred}
    per_rank = pred.details.get("memory_breakdown_per_device_gib")
    m = per_rank[pp_rank] if pp_rank is not None and per_rank else pred.memory.to_dict()
    return {"params": m["weights"] + m["fp8_weights"], "grads": m["gradients"], "optimizer": m["optimizer"],
            "activations": m["activations"], "pp_rank": pp_rank if pp_rank is not None else pred.memory.device}


def rank_params(module: torch.nn.Module, ep: int) -> int:
    """Parameters one rank of an EP group holds of ``module`` (unsharded by FSDP): the routed experts' 1/EP, the
    rest whole -- the planner's per-stage count."""
    n = 0
    for mod in module.modules():
        own = sum(math.prod(p.shape) for p in mod.parameters(recurse=False))
        n += own // ep if isinstance(mod, GroupedExperts) else own
    return n


def pipeline_rank_state(model: torch.nn.Module, ctx: ParallelContext, gather_dtype: torch.dtype | None = None,
                        micro_batches: int = 1) -> list[Any]:
    """What one rank of every pipeline rank holds (:class:`RankMemory`, ``rank`` the global
    rank of its first data-parallel member): each pipeline rank's stages are cut from the meta ``model`` and
    FSDP-sharded with rank 0's mesh, whose data-parallel group has the same size as theirs, so the shard sizes are
    those the ranks ``(pp, 0, 0)`` hold (the largest of their groups). Nothing is allocated. ``gather_dtype`` and
    ``micro_batches``: as :func:`rank_memory` takes them."""
    from moetrain.parallel.pipeline import build_stages

    pcfg = ctx.pcfg
    if pcfg.pp == 1:
        parallelize(model, ctx)
        return [rank_memory(model, ctx, False, gather_dtype, micro_batches)]
    out = []
    for r in range(pcfg.pp):
        parts = build_stages(model, pcfg, r)
        for part in parts:
            parallelize(part, ctx)
        row = rank_memory(torch.nn.ModuleList(parts), ctx, False, gather_dtype, micro_batches)
        row.rank = r * pcfg.dp
        out.append(row)
    return out


def stage_rows(job: JobConfig, pcfg: ParallelConfig, pred: Any) -> list[dict[str, Any]]:
    """Per pipeline stage: the run's items (Megatron letters, "d" a dense layer) and parameters per rank (routed
    experts split over EP, nothing FSDP-sharded) beside the planner's prediction for the same stage (None where it
    has none)."""
    from moetrain.model.transformer import build_model
    from moetrain.parallel.pipeline import build_stages, stage_specs, stage_to_rank

    cfg = job.model
    plan_stages = pred.details.get("stages") if not isinstance(pred, str) else None
    plan_params = pred.details.get("stage_params") if not isinstance(pred, str) else None
    model = build_model(cfg, device="meta")
    if pcfg.pp == 1:
        items = "E" + "".join("d" if i < cfg.n_dense_layers else "t" for i in range(cfg.n_layers)) \
            + "m" * cfg.mtp_depth + "L"
        counts = [rank_params(model, pcfg.ep)]
        specs_items = [items]
    else:
        specs = stage_specs(cfg, pcfg)
        specs_items = [("E" if s.embed else "") + "".join("d" if i < cfg.n_dense_layers else "t" for i in s.layers)
                       + "m" * len(s.mtp) + ("L" if s.head else "") for s in specs]
        counts = [0] * len(specs)
        for r in range(pcfg.pp):
            for part in build_stages(model, pcfg, r):
                counts[part.spec.index] = rank_params(part, pcfg.ep)
    rows = []
    for s, (items, n) in enumerate(zip(specs_items, counts)):
        rows.append({"stage": s, "pp_rank": stage_to_rank(pcfg, s) if pcfg.pp > 1 else 0, "items": items,
                     "params": n, "plan_items": plan_stages[s] if plan_stages and s < len(plan_stages) else None,
                     "plan_params": plan_params[s] if plan_params and s < len(plan_params) else None})
    return rows


def format_stages(rows: list[dict[str, Any]]) -> str:
    """The stage table of :func:`stage_rows`: the run's items and parameters beside the planner's, stage by stage."""
    lines = [f"{'stage':>5} {'pp rank':>7}  {'run items':<24} {'planned items':<24} {'run params':>15} "
             f"{'planned params':>15}"]
    for r in rows:
        plan_n = f"{r['plan_params']:>15,.0f}" if r["plan_params"] is not None else f"{'-':>15}"
        lines.append(f"{r['stage']:>5} {r['pp_rank']:>7}  {r['items']:<24} {r['plan_items'] or '-':<24} "
                     f"{r['params']:>15,} {plan_n}")
    return "\n".join(lines)


def format_report(rows: list[RankMemory], pred: dict[str, Any] | None, title: str, heaviest: str = "") -> str:
    """The per-rank table of held state beside the planner's row (``heaviest``: words after its pipeline rank)."""
    lines = [title,
             f"{'rank':>5} {'params held':>14} {'params GiB':>11} {'grads GiB':>10} {'optim GiB':>10} "
             f"{'state GiB':>10} {'gathered':>9} {'grad acc':>9} {'step GiB':>9} {'peak GiB':>9}"]
    for r in rows:
        peak = f"{r.peak_measured / GiB:9.3f}" if r.peak_measured is not None else f"{'(meta)':>9}"
        lines.append(f"{r.rank:>5} {r.params:>14,} {r.param_bytes / GiB:11.3f} {r.grad_bytes / GiB:10.3f} "
                     f"{r.optim_bytes / GiB:10.3f} {r.state_bytes / GiB:10.3f} {r.gathered_bytes / GiB:9.3f} "
                     f"{r.accum_grad_bytes / GiB:9.3f} {r.step_bytes / GiB:9.3f} {peak}")
    if pred and "error" not in pred:
        state = pred["params"] + pred["grads"] + pred["optimizer"]
        lines.append(f"{'model':>5} {'':>14} {pred['params']:11.3f} {pred['grads']:10.3f} {pred['optimizer']:10.3f} "
                     f"{'':>10} {'':>9} {'':>9} {state:9.3f} {'':>9}   <- performance model (moetrain plan), one "
                     f"rank of pipeline rank {pred['pp_rank']}{heaviest}; +{pred['activations']:.3f} GiB "
                     f"activations in a step")
    elif pred:
        lines.append(f"performance model: no prediction ({pred['error']})")
    lines.append("(state: the FSDP shards held between steps; step: at the step's peak, with the weights gathered "
                 "for the GEMMs and the gradients accumulated unsharded over the micro-batches -- what the planner's "
                 "weights, gradients and optimizer count)")
    return "\n".join(lines)


def layout_label(pcfg: Any) -> str:
    """E.g. "PP=2 (dualpipev, 4 stages) DP=2 EP=2", or "DP=2 EP=2" without pipelining (DP counts the EP ranks)."""
    pipe = f"PP={pcfg.pp} ({pcfg.schedule}, {pcfg.n_stages} stages) " if pcfg.pp > 1 else ""
    return f"{pipe}DP={pcfg.dp} EP={pcfg.ep}"


def report_dry_run(job: JobConfig, ctx: ParallelContext, model: torch.nn.Module) -> dict[str, Any]:
    """Gather every rank's :class:`RankMemory` on rank 0, print the table there, and write it to
    ``<out_dir>/dry_run.json``. Returns the summary (rank 0's view)."""
    amp = torch.bfloat16 if ctx.device.type == "cuda" and job.parallel.autocast_bf16("cuda") else None
    mine = rank_memory(model, ctx, gather_dtype=amp, micro_batches=job.train.grad_accum)
    rows: list[Any] = [mine]
    if ctx.distributed:
        rows = [None] * ctx.world_size
        dist.all_gather_object(rows, mine)
    summary: dict[str, Any] = {"dry_run": True, "world": ctx.world_size, "ranks": [asdict(r) for r in rows],
                               "layout": run_layout(job, ctx.pcfg, ctx.device.type).layout_dict()}
    if ctx.is_main:
        pred = predicted_memory(job, ctx.world_size, ctx.device.type)
        summary["predicted_gib"] = pred
        print(format_report(rows, pred, f"[moetrain] dry run: {job.preset} on {ctx.world_size} ranks "
                                        f"({layout_label(ctx.pcfg)}), {ctx.device.type}; no step run",
                            " (the heaviest)" if ctx.pcfg.pp > 1 else ""))
        out = Path(job.train.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "dry_run.json").write_text(json.dumps(summary, indent=2))
    return summary


def dry_run_world(job: JobConfig, world: int, plan: Any = None, gpu: str | None = None) -> dict[str, Any]:
    """Set up a ``world``-rank layout on the fake process group, entirely on meta, and print rank 0's memory, every
    pipeline stage beside the planner's prediction (of ``plan``, a ``PlanFile``, when the job came from one), every
    pipeline rank's memory beside the planner's (the heaviest marked) and the verdict on ``gpu`` (a GPU catalogue
    name; see :mod:`moetrain.train.fit`); write ``dry_run.json`` with the run's layout, the stages, the pipeline
    ranks and the verdict (``"fits"``: true, false, or null when there is none).

    Raises:
        ConfigError: the layout does not fit ``world`` or the model; an unknown ``gpu``, or one with ``--device cpu``.
    """
    from moetrain.model.transformer import build_model
    from moetrain.parallel.mesh import fake_parallel
    from moetrain.parallel.pipeline import check_pipeline, local_stages

    check_pipeline(job.model, job.parallel, job.train.grad_accum)
    device_type = target_device(job)
    target = target_gpu(gpu, plan, device_type)
    ctx = fake_parallel(job.parallel, world, job.model.n_routed_experts)
    try:
        model = cast_parameters_(build_model(job.model, device="meta"), held_param_dtype(job.parallel.optimizer))
        apply_precision(model, job.parallel.precision)  # as the run does: fp8_param then holds their weights
        total = sum(math.prod(p.shape) for p in model.parameters())
        gather = torch.bfloat16 if device_type == "cuda" and job.parallel.autocast_bf16("cuda") else None
        held = pipeline_rank_state(model, ctx, gather, job.train.grad_accum)
        layout = run_layout(job, ctx.pcfg, device_type)
        prediction = predict_run(job, world, layout, plan, target.name if target else None)
        pred = predicted_memory(job, world, "", prediction, pp_rank=0)
        print(format_report([held[0]], pred, f"[moetrain] dry run on meta: {job.preset} ({total:,} parameters) as "
                                              f"rank 0 of {world} ({layout_label(ctx.pcfg)}), {layout.precision} on "
                                              f"{'GPUs' if device_type == 'cuda' else 'CPUs'}; nothing allocated, no "
                                              f"process started"))
        stages = stage_rows(job, ctx.pcfg, prediction)
        print(format_stages(stages))
        ranks = pipeline_rank_rows(held, prediction, [local_stages(ctx.pcfg, r) if ctx.pcfg.pp > 1 else [0]
                                                      for r in range(ctx.pcfg.pp)],
                                   job.model.vocab_size * job.model.dim)
        fit = verdict(ranks, target, layout.precision)
        print(format_pipeline_ranks(ranks, fit))
        summary = {"dry_run": True, "world": world, "ranks": [asdict(held[0])], "predicted_gib": pred,
                   "total_params": total, "layout": layout.layout_dict(), "stages": stages,
                   "pipeline_ranks": ranks, "verdict": fit}
        out = Path(job.train.out_dir)
        out.mkdir(parents=True, exist_ok=True)
        (out / "dry_run.json").write_text(json.dumps(summary, indent=2))
        return summary
    finally:
        dist.destroy_process_group()
