"""``moetrain train --plan FILE``: run exactly what ``moetrain plan ... --json`` ranked, or refuse it by name.

The planner's :class:`~moetrain.plan.plan.Plan` is a :class:`~moetrain.layout.Layout` plus what only a prediction
needs, and the trainer's ``[parallel]`` section is the same Layout (:class:`~moetrain.parallel.config.ParallelConfig`):
:func:`plan_job` carries the Layout over field for field, typed, never through ``--set`` strings. Every plan field is
either run or refused, all refusals in one message, before anything starts:

==========================  ===========================================================================
Plan field                  job setting
==========================  ===========================================================================
the Layout fields           parallel.<the same name> (dp in Megatron's meaning on both sides; schedule,
                            dispatcher and cuda_graphs as the plan resolved them); what the trainer cannot
                            run is refused by name (:func:`moetrain.parallel.config.layout_not_runnable`)
pp_layout unset             parallel.pp_layout = the stages the planner predicted (its cost-balanced split)
mtp_depth                   model.mtp_depth (unset: the model's own)
micro_batch                 train.micro_batch_size (sequences)
global_batch                train.grad_accum = global_batch / (dp x micro_batch) (micro-batches per step)
seq_len                     data.seq_len
routing "real" / "balanced" model.routing "learned" / "balanced"
node_limit_m                refused unless it is the model's group-limited routing (n_limited_groups)
imbalance, framework        prediction-only: reported, not run (the run measures its own imbalance)
model (a preset name)       model.preset
tp x cp x dp x pp           the number of processes (train.nproc for a local launch)
==========================  ===========================================================================
"""

from __future__ import annotations

import dataclasses
import json
import sys
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from moetrain.errors import ConfigError
from moetrain.layout import Routing
from moetrain.parallel.config import ep_overlap_clashes, layout_not_runnable
from moetrain.plan.hardware import get_gpu
from moetrain.plan.plan import Plan


@dataclass(frozen=True)
class PlanFile:
    """A ``moetrain plan --json`` output: the plan, and what it was predicted for.

    Attributes:
        plan: the plan (its JSON values as enums).
        model: the model it was predicted for (a preset name or a HF config path), None if the file does not say.
        gpu: the GPU it was predicted on (None: not said).
        stages: the pipeline stages the planner predicted, Megatron items per stage ("Eddt", "ttmL"), None if
            the file has no prediction details.
        given: the plan fields the file wrote (None: all of them); a field it leaves out takes the job's value
            where the job has one (the sequence length), else the Plan default.
    """

    plan: Plan
    model: str | None = None
    gpu: str | None = None
    stages: tuple[str, ...] | None = None
    given: frozenset[str] | None = None


def read_plan(path: str | Path) -> PlanFile:
    """The plan of a ``moetrain plan --json`` output file (the whole output, or its "plan" object alone; of a
    ``--search`` output, its best plan); "-" reads it from standard input (``moetrain plan ... --json | moetrain
    train --plan -``).

    Raises:
        ConfigError: the file is missing or not such JSON, or names a field a plan does not have.
    """
    p = Path(path)
    try:
        text = sys.stdin.read() if str(path) == "-" else p.read_text(errors="replace")
    except OSError as e:
        raise ConfigError(f"--plan {path}: cannot read it ({e}); write one with `moetrain plan ... --json > "
                          f"{p.name}`") from None
    if not text.strip():
        raise ConfigError(f"--plan {path} is empty (did `moetrain plan` fail when it was written?)")
    try:
        data = json.loads(text[text.index("{"):])
    except (OSError, ValueError) as e:
        raise ConfigError(f"--plan {path}: not a readable `moetrain plan --json` output ({type(e).__name__}: {e}); "
                          f"write one with `moetrain plan ... --json > {p.name}`") from None
    if isinstance(data, dict) and isinstance(data.get("best"), dict) and "plan" not in data:
        data = data["best"]  # `moetrain plan --search --json`: the best plan it found, as one prediction
    raw = data.get("plan", data) if isinstance(data, dict) else None
    if not isinstance(raw, dict) or "pp" not in raw:
        raise ConfigError(f"--plan {path}: no plan in it (expected the output of `moetrain plan ... --json`)")
    stages = (data.get("details") or {}).get("stages") if isinstance(data.get("details"), dict) else None
    model = data.get("model") if isinstance(data.get("model"), str) else raw.get("model")
    return PlanFile(plan_from_dict(raw), model, data.get("gpu"), tuple(stages) if stages else None, frozenset(raw))


def plan_from_dict(d: dict[str, Any]) -> Plan:
    """A :class:`Plan` from its ``to_dict`` form (derived keys such as ``edp`` and ``n_microbatches`` ignored). A
    partial plan (a hand-written file) takes one micro-batch per step and fp32 optimizer states where it is silent.

    Raises:
        ConfigError: a key that is no plan field.
    """
    names = {f.name for f in dataclasses.fields(Plan)}
    derived = {"edp", "n_microbatches", "model"}
    unknown = sorted(set(d) - names - derived)
    if unknown:
        raise ConfigError(f"the plan has field(s) {unknown} that moetrain's Plan does not know (fields: "
                          f"{', '.join(sorted(names))}); write it with this version's `moetrain plan --json`")
    kw = {k: v for k, v in d.items() if k in names}
    # a partial plan: one micro-batch per step, and the optimizer states the trainer keeps
    if "global_batch" not in kw and kw.get("dp"):
        kw["global_batch"] = kw["dp"] * kw.get("micro_batch", 1)
    kw.setdefault("optimizer", "fp32")
    if isinstance(kw.get("recompute_modules"), list):
        kw["recompute_modules"] = tuple(kw["recompute_modules"])
    return Plan(**kw)


def megatron_layout(stages: tuple[str, ...] | list[str]) -> str:
    """The planner's stage items ("Eddt", "ttmL": d = dense layer, t = MoE layer) as a Megatron pipeline layout
    ("Ettt|ttmL": every layer is a ``t`` there)."""
    return "|".join(s.replace("d", "t") for s in stages)


@dataclass(frozen=True)
class PlanJob:
    """What a plan becomes: the job sections it sets (typed values), its process count, and what of it is only a
    prediction's input (reported, not run)."""

    sections: dict[str, dict[str, Any]]
    world: int
    prediction_only: tuple[str, ...]


def plan_job(pf: PlanFile) -> PlanJob:
    """The job sections that run ``pf.plan`` exactly, and its number of processes.

    Raises:
        ConfigError: naming every plan field the trainer cannot run (all of them, in one message) and what would
            run; or a plan without DP / with a global batch that does not split into micro-batches.
    """
    plan = pf.plan
    layout = plan.layout()  # schedule, dispatcher and CUDA graphs as the plan resolved (and costed) them
    missing = [f"{what} ({why})" for what, why in layout_not_runnable(layout.replace(mtp_depth=None))]
    if plan.ep_overlap and plan.ep > 1:
        missing += [f"expert all-to-all overlap with {c}; change it or use --no-ep-overlap"
                    for c in ep_overlap_clashes(layout)]
    if missing:
        raise ConfigError("moetrain train cannot run this plan yet: " + "; ".join(missing))
    if not plan.dp:
        raise ConfigError("the plan has no data-parallel size (dp); give `moetrain plan` the GPU count (--gpus)")
    if plan.dp % plan.ep:
        raise ConfigError(f"the plan's ep={plan.ep} does not divide its dp={plan.dp} (EP is carved out of the "
                          f"data-parallel ranks)")
    mbs = plan.micro_batch
    if plan.global_batch % (plan.dp * mbs):
        raise ConfigError(f"the plan's global_batch={plan.global_batch} is not a multiple of dp x micro_batch = "
                          f"{plan.dp * mbs}")
    parallel = layout.layout_fields()
    del parallel["mtp_depth"]  # the model's setting (model.mtp_depth)
    if plan.node_limit_m is not None:
        # the planner's node is the GPU's NVLink domain (plan/model/routing.py)
        parallel["node_limit_m"] = plan.node_limit_m
        parallel["gpus_per_node"] = _domain(pf.gpu)
    if plan.pp > 1 and plan.pp_layout is None and pf.stages:
        parallel["pp_layout"] = megatron_layout(pf.stages)  # the split the planner costed
    sections: dict[str, dict[str, Any]] = {
        "parallel": parallel,
        "train": {"micro_batch_size": mbs, "grad_accum": plan.global_batch // (plan.dp * mbs)},
        "data": {"seq_len": plan.seq_len} if pf.given is None or "seq_len" in pf.given else {},
        "model": {"routing": "balanced" if plan.routing == Routing.BALANCED else "learned"},
    }
    if plan.mtp_depth is not None:
        sections["model"]["mtp_depth"] = plan.mtp_depth
    if pf.model and "/" not in pf.model and not pf.model.endswith(".json"):
        sections["model"]["preset"] = pf.model
    reported = [f"framework={plan.framework!r} (the recipe whose defaults the prediction used)",
                f"routing={plan.routing!r} (run as model.routing="
                f"{sections['model']['routing']!r})"]
    reported.append(f"imbalance={plan.imbalance:.3g} (the prediction's; the run measures its own)"
                    if plan.imbalance is not None else "imbalance unset (the run measures its own)")
    return PlanJob(sections, plan.world, tuple(reported))


def _domain(gpu: str | None) -> int:
    """GPUs per NVLink domain of the plan's GPU (the catalogue's), 8 (an HGX board) when the plan names none."""
    return get_gpu(gpu).nvlink_domain if gpu else 8
