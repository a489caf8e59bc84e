"""Does a ``--dry-run --world N`` layout fit its GPU? Every pipeline rank's held state beside the planner's memory of
the same rank, and one verdict against the GPU's memory.

What each pipeline rank needs is the planner's memory of that rank (:func:`moetrain.plan.model.predict`: weights,
FP8 copies, gradients, optimizer states, the activations of its micro-batches in flight, the reserve), raised by
whatever state the run holds beyond the planner's count of it (e.g. the last stage's copy of the embedding, which
the planner does not count): ``need = planned total + max(0, run state - planned weights, FP8 copies, gradients
and optimizer)``. The run state is the dry run's count at the step's peak (:attr:`~moetrain.train.dryrun.
RankMemory.step_bytes`: the FSDP shards -- fp32 masters, gradients, AdamW moments -- the weights gathered for the
GEMMs and the unsharded gradient accumulators), from the shapes the run holds; the rest is the planner's, in the precision the target device trains in (bf16 on a GPU, also when the dry run itself
runs on a CPU host). The layout fits when the heaviest pipeline rank's need is at most the GPU's memory
(``GPUSpec.hbm_gb``, the limit ``moetrain plan`` checks too).

The GPU is ``--gpu NAME`` (the planner's table, :mod:`moetrain.plan.hardware`), else the ``--plan`` file's GPU,
else :data:`DEFAULT_GPU`, which the verdict then calls assumed. A ``--device cpu`` run gets no verdict: its memory
is the host's.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moetrain.config import JobConfig
from moetrain.errors import ConfigError
from moetrain.layout import Precision

GiB = 2 ** 30
#: The GPU a ``--dry-run --world`` layout is predicted and judged on when neither ``--gpu`` nor a ``--plan`` file
#: names one (the verdict says it was assumed).
DEFAULT_GPU = "h100"


@dataclass(frozen=True)
class TargetGPU:
    """The GPU a layout is judged against: its catalogue name, memory (GiB), and whether nobody named it."""

    name: str
    memory_gib: float
    assumed: bool


def target_device(job: JobConfig) -> str:
    """The device type a ``--world`` layout trains on: "cpu" only for an explicit ``--device cpu``; "auto" means the
    GPUs such a layout exists on, whatever this host has (its precision, and so its activations, are a GPU's)."""
    return "cpu" if job.train.device == "cpu" else "cuda"


def target_gpu(name: str | None, plan: Any, device_type: str) -> TargetGPU | None:
    """The GPU of the verdict: ``name`` (``--gpu``), else the ``--plan`` file's (when the planner's table has it),
    else :data:`DEFAULT_GPU` (assumed); None for a CPU run.

    Raises:
        ConfigError: ``--gpu`` with ``--device cpu``, or an unknown GPU (the message lists the catalogue).
    """
    from moetrain.plan.hardware import HardwareError, catalogue_names, get_gpu

    if device_type == "cpu":
        if name:
            raise ConfigError(f"--gpu {name} judges the layout against a GPU's memory, but --device cpu trains on "
                              f"CPUs; drop --gpu, or --device cpu")
        return None
    if name:
        try:
            spec = get_gpu(name)
        except HardwareError:
            raise ConfigError(f"--gpu {name}: no such GPU in the planner's table; use one of "
                              f"{', '.join(catalogue_names())}") from None
        return TargetGPU(spec.name, spec.hbm_gb, assumed=False)
    if plan is not None and plan.gpu:
        try:  # a plan of a measured machine (`moetrain plan --gpu local`) names no GPU of the table
            spec = get_gpu(plan.gpu)
            return TargetGPU(spec.name, spec.hbm_gb, assumed=False)
        except HardwareError:
            pass
    spec = get_gpu(DEFAULT_GPU)
    return TargetGPU(spec.name, spec.hbm_gb, assumed=True)


def pipeline_rank_rows(held: list[Any], pred: Any, stages_of: list[list[int]], embedding_params: int = 0
                       ) -> list[dict[str, Any]]:
    """Per pipeline rank (``held``: one :class:`~moetrain.train.dryrun.RankMemory` each, ``stages_of``: the stage
    indices each holds): its stages, the run's state (GiB: ``state_gib`` the shards held between steps, ``step_gib``
    at the step's peak, ``run_parts`` that peak in the planner's parts) and the planner's memory of the same rank
    (GiB; None where the planner cannot model the run), and what the rank needs (see the module docstring).
    ``embedding_params`` (vocabulary x model dim) lets :func:`state_difference` name an embedding copy."""
    per_rank = None if isinstance(pred, str) else pred.details.get("memory_breakdown_per_device_gib")
    stage_params = None if isinstance(pred, str) else pred.details.get("stage_params")
    rows = []
    for r, row in enumerate(held):
        m = per_rank[r] if per_rank and r < len(per_rank) else None
        state = row.step_bytes / GiB
        planned_params = (round(sum(stage_params[s] for s in stages_of[r]))
                          if stage_params and all(s < len(stage_params) for s in stages_of[r]) else None)
        out: dict[str, Any] = {"pp_rank": r, "rank": row.rank, "stages": stages_of[r], "params": row.params,
                               "state_gib": row.state_bytes / GiB, "step_gib": state, "planned": m,
                               "need_gib": None,
                               "unsharded_params": row.unsharded_params, "planned_params": planned_params,
                               "embedding_params": embedding_params,
                               # the run's state at the step's peak in the planner's three parts (GiB)
                               "run_parts": {"weights": row.gathered_bytes / GiB,
                                             "gradients": max(row.grad_bytes, row.accum_grad_bytes) / GiB,
                                             "optimizer": (row.param_bytes + row.optim_bytes) / GiB}}
        if m is not None:
            planned_state = m["weights"] + m["fp8_weights"] + m["gradients"] + m["optimizer"]
            out["need_gib"] = m["total"] + max(0.0, state - planned_state)
        rows.append(out)
    return rows


def verdict(rows: list[dict[str, Any]], gpu: TargetGPU | None, precision: Precision) -> dict[str, Any]:
    """Fit or not: the heaviest pipeline rank's need against ``gpu``'s memory (``precision``: the run's GEMM
    precision, which sized its activations). ``fits`` is None (and ``why`` says why) when there is no GPU (a CPU
    run) or the planner could not model the run."""
    base: dict[str, Any] = {"gpu": gpu.name if gpu else None, "gpu_assumed": gpu.assumed if gpu else None,
                            "memory_gib": gpu.memory_gib if gpu else None, "precision": str(precision)}
    needs = [r for r in rows if r["need_gib"] is not None]
    if gpu is None:
        return {**base, "fits": None, "why": "a --device cpu run: its memory is the host's"}
    if not needs:
        return {**base, "fits": None, "why": "the performance model cannot model this run"}
    worst = max(needs, key=lambda r: r["need_gib"])
    return {**base, "fits": worst["need_gib"] <= gpu.memory_gib, "heaviest_pp_rank": worst["pp_rank"],
            "need_gib": worst["need_gib"]}


def format_pipeline_ranks(rows: list[dict[str, Any]], v: dict[str, Any]) -> str:
    """The per-pipeline-rank table (heaviest marked) and the verdict line."""
    lines = [f"{'pp rank':>7} {'stages':<10} {'run state GiB':>13} {'planned state':>13} {'activations':>11} "
             f"{'reserve':>11} {'planned total':>13} {'needs GiB':>9}"]
    for r in rows:
        m = r["planned"]
        stages = ",".join(map(str, r["stages"]))
        if m is None:
            lines.append(f"{r['pp_rank']:>7} {stages:<10} {r['step_gib']:13.3f} {'-':>13} {'-':>11} {'-':>11} "
                         f"{'-':>13} {'-':>9}")
            continue
        mark = "  <- heaviest" if r["pp_rank"] == v.get("heaviest_pp_rank") and len(rows) > 1 else ""
        lines.append(f"{r['pp_rank']:>7} {stages:<10} {r['step_gib']:13.3f} "
                     f"{m['weights'] + m['fp8_weights'] + m['gradients'] + m['optimizer']:13.3f} "
                     f"{m['activations']:11.3f} {m['reserved']:11.3f} {m['total']:13.3f} {r['need_gib']:9.3f}{mark}")
    lines.append("(run state: what one rank holds at the step's peak, from the run's shapes; planned: the performance "
                 "model's weights, FP8 copies, gradients and optimizer, one rank of that pipeline "
                 f"rank, {v['precision']} activations; needs: planned total + any state the run holds beyond the "
                 f"planned)")
    lines += [f"pipeline rank {r['pp_rank']}: {why}" for r in rows if (why := state_difference(r))]
    lines.append(verdict_line(v))
    return "\n".join(lines)


#: Run and planned state closer than this share of the planned need no word.
STATE_AGREEMENT = 0.05


def state_difference(row: dict[str, Any]) -> str | None:
    """Why a pipeline rank's run state differs from the planner's by more than :data:`STATE_AGREEMENT`, or None.
    Named when the parameters differ by exactly one embedding (the last stage's copy for MTP, which the run holds
    and the planner's stage split leaves out); any other difference is reported as not explained."""
    m = row["planned"]
    if m is None:
        return None
    planned = m["weights"] + m["fp8_weights"] + m["gradients"] + m["optimizer"]
    if abs(row["step_gib"] - planned) <= STATE_AGREEMENT * planned:
        return None
    diff = f"the run holds {row['step_gib']:.1f} GiB of state at the step's peak, the planner {planned:.1f}"
    run_n, plan_n = row["unsharded_params"], row["planned_params"]
    if plan_n is not None and run_n - plan_n == row["embedding_params"] > 0:
        return (f"{diff}: its stages hold {run_n:,} parameters (per rank, before FSDP sharding), the planner's "
                f"{plan_n:,}; the {run_n - plan_n:,} more are the last stage's copy of the embedding for MTP, "
                f"which the planner leaves out")
    run = row["run_parts"]
    parts = [("weights gathered for the GEMMs", run["weights"], m["weights"] + m["fp8_weights"],
              "the planner adds FP8 copies of the weights, which the run quantises per GEMM" if m["fp8_weights"]
              and m["weights"] else ""),
             ("gradients", run["gradients"], m["gradients"],
              "the run accumulates the micro-batches' gradients unsharded in FSDP2's fp32 reduce dtype"
              if run["gradients"] > m["gradients"] else ""),
             ("masters and optimizer states", run["optimizer"], m["optimizer"],
              "the run keeps its weights' FSDP shards beside the gathered copy" if run["optimizer"] > m["optimizer"]
              else "")]
    named = [f"{what} {r:.1f} vs {p:.1f}" + (f" ({why})" if why else "") for what, r, p, why in parts
             if abs(r - p) > STATE_AGREEMENT * planned / 2]
    return f"{diff}, for the same parameters: " + "; ".join(named or ["spread over the parts"])


def verdict_line(v: dict[str, Any]) -> str:
    """One line: FITS / DOES NOT FIT on the GPU, the heaviest pipeline rank's need, and whether the GPU was assumed."""
    if v["fits"] is None:
        return f"verdict: none ({v['why']})"
    gpu = f"{v['gpu'].upper()} ({v['memory_gib']:g} GiB"
    gpu += ", assumed: --gpu NAME judges another)" if v["gpu_assumed"] else ")"
    words = "FITS" if v["fits"] else "DOES NOT FIT"
    fix = "" if v["fits"] else "; try parallel.recompute, a smaller micro-batch, more PP/EP, or a larger GPU"
    return (f"verdict: {words} on {gpu}: the heaviest pipeline rank ({v['heaviest_pp_rank']}) needs "
            f"{v['need_gib']:.1f} GiB per GPU{fix}")
