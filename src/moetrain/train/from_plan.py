"""``moetrain train --plan FILE``: run what ``moetrain plan ... --json`` ranked.

The planner's :class:`~moetrain.plan.plan.Plan` and the trainer's job share their vocabulary; where a name
differs, this table is the one place that says so:

==========================  ===========================================================================
Plan field                  job setting
==========================  ===========================================================================
pp, vpp, ep, pp_layout      parallel.pp, parallel.vpp, parallel.ep, parallel.pp_layout
dp (EP carved out of it)    parallel.dp = dp / ep (the trainer's dp counts the ranks holding the same experts)
schedule                    parallel.pp_schedule ("interleaved" = "interleaved-1f1b", "dualpipe" =
                            "dualpipev"; the trainer's names are accepted by the planner too)
micro_batch                 train.micro_batch_size (sequences)
global_batch                train.grad_accum = global_batch / (dp x micro_batch) (micro-batches per step)
seq_len                     data.seq_len
recompute "full" / "none"   parallel.activation_checkpointing true / false
ep_overlap                  parallel.ep_overlap (PP = 1: micro-batch i+1's forward paired with i's backward;
                            pipelined: the schedule's forward-backward pairs, not zbv)
routing "real" / "balanced" model.routing "learned" / "balanced"
model (a preset name)       model.preset
pp x dp (x tp x cp)         the number of processes (train.nproc for a local launch)
==========================  ===========================================================================

What the trainer cannot run yet is refused, all of it in one message: tensor or context parallelism, FP8 GEMMs,
FP8 attention, selective recompute, expert all-to-all overlap with full recompute or under zbv, optimizer states
below fp32, FP8 primary weights.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any

from moetrain.model.config import ConfigError

SCHEDULE_NAMES = {"1f1b": "1f1b", "interleaved": "interleaved-1f1b", "interleaved-1f1b": "interleaved-1f1b",
                  "dualpipe": "dualpipev", "dualpipev": "dualpipev", "dualpipe-v": "dualpipev", "zbv": "zbv"}


def read_plan(path: str | Path) -> dict[str, Any]:
    """The plan dict of a ``moetrain plan --json`` output file (the whole output, or its "plan" object alone).

    Raises:
        ConfigError: the file is missing or not such JSON.
    """
    p = Path(path)
    if p.is_file() and not p.read_text(errors="replace").strip():
        raise ConfigError(f"--plan {path} is empty (did `moetrain plan` fail when it was written?)")
    try:
        text = p.read_text()
        data = json.loads(text[text.index("{"):])
    except (OSError, ValueError) as e:
        raise ConfigError(f"--plan {path}: not a readable `moetrain plan --json` output ({type(e).__name__}: {e}); "
                          f"write one with `moetrain plan ... --json > {p.name}`") from None
    plan = data.get("plan", data) if isinstance(data, dict) else None
    if not isinstance(plan, dict) or "pp" not in plan:
        raise ConfigError(f"--plan {path}: no plan in it (expected the output of `moetrain plan ... --json`)")
    if isinstance(data.get("model"), str):
        plan = dict(plan, model=data["model"])
    return plan


def plan_overrides(plan: dict[str, Any]) -> tuple[list[str], int]:
    """The ``--set`` overrides that make the job run ``plan``, and its number of processes.

    Raises:
        ConfigError: naming everything in the plan the trainer cannot run, and what would (the plan's own values
            changed, e.g. with ``moetrain plan --framework moetrain``).
    """
    missing = []
    g = plan.get
    if g("tp", 1) != 1:
        missing.append(f"tensor parallelism (tp={g('tp')}; use --tp 1)")
    if g("cp", 1) != 1:
        missing.append(f"context parallelism (cp={g('cp')}; use --cp 1)")
    if g("precision", "bf16") in ("fp8", "mxfp8"):
        from moetrain.train.config import TrainConfig
        if not hasattr(TrainConfig, "fp8"):
            missing.append(f"FP8 GEMMs (precision={g('precision')}; use --precision bf16)")
    if g("attn_precision", "bf16") != "bf16":
        missing.append(f"FP8 attention (attn_precision={g('attn_precision')})")
    if g("dispatch_precision", "bf16") != "bf16":
        from moetrain.parallel.config import ParallelConfig
        if not hasattr(ParallelConfig, "dispatch_dtype"):
            missing.append(f"FP8 dispatch (dispatch_precision={g('dispatch_precision')})")
    if g("recompute", "none") == "selective":
        missing.append(f"selective recompute ({g('recompute_modules')}); the trainer recomputes whole blocks "
                       f"(--recompute full) or nothing (--recompute none)")
    if g("ep_overlap") and g("ep", 1) > 1 and g("recompute", "none") == "full":
        missing.append("expert all-to-all overlap with full recompute (the trainer's paired schedule runs without "
                       "recomputation; use --recompute none or --no-ep-overlap)")
    if g("ep_overlap") and g("ep", 1) > 1 and g("pp", 1) > 1 and g("schedule") == "zbv":
        missing.append("expert all-to-all overlap under the zbv schedule (it splits every backward, so nothing "
                       "pairs; use --schedule dualpipev or --no-ep-overlap)")
    if g("optimizer", "fp32") != "fp32":
        missing.append(f"{g('optimizer')} optimizer states (the trainer keeps fp32; use --optimizer fp32)")
    if g("fp8_param"):
        missing.append("FP8 primary weights (fp8_param)")
    schedule = g("schedule") or ("interleaved" if g("vpp", 1) > 1 else "1f1b")
    if schedule not in SCHEDULE_NAMES:
        missing.append(f"the {schedule!r} pipeline schedule (the trainer runs {sorted(set(SCHEDULE_NAMES.values()))})")
    if missing:
        raise ConfigError("moetrain train cannot run this plan yet: " + "; ".join(missing))
    dp, mbs, pp, ep = g("dp"), g("micro_batch", 1), g("pp", 1), g("ep", 1)
    if not dp:
        raise ConfigError("the plan has no data-parallel size (dp); give `moetrain plan` the GPU count (--gpus)")
    if dp % ep:
        raise ConfigError(f"the plan's ep={ep} does not divide its dp={dp} (EP is carved out of the data-parallel "
                          f"ranks)")
    gbs = g("global_batch", dp * mbs)
    if gbs % (dp * mbs):
        raise ConfigError(f"the plan's global_batch={gbs} is not a multiple of dp x micro_batch = {dp * mbs}")
    sets = [f"parallel.pp={pp}", f"parallel.vpp={g('vpp', 1)}", f"parallel.ep={ep}", f"parallel.dp={dp // ep}",
            f"parallel.pp_schedule={json.dumps(SCHEDULE_NAMES[schedule])}",
            f"train.micro_batch_size={mbs}", f"train.grad_accum={gbs // (dp * mbs)}",
            f"parallel.activation_checkpointing={'true' if g('recompute') == 'full' else 'false'}",
            f"model.routing={json.dumps('balanced' if g('routing') == 'balanced' else 'learned')}"]
    if g("seq_len"):
        sets.append(f"data.seq_len={g('seq_len')}")
    if g("ep_overlap") and ep > 1:
        sets.append("parallel.ep_overlap=true")
    if g("pp_layout"):
        sets.append(f"parallel.pp_layout={json.dumps(g('pp_layout'))}")
    if g("precision") in ("fp8", "mxfp8"):
        sets.append(f"train.fp8={json.dumps('blockwise' if g('precision') == 'fp8' else 'mxfp8')}")
    if g("dispatch_precision", "bf16") == "fp8":
        sets.append('parallel.dispatch_dtype="fp8"')
    if isinstance(g("model"), str) and "/" not in g("model") and not g("model").endswith(".json"):
        sets.insert(0, f"model.preset={json.dumps(g('model'))}")
    return sets, pp * dp
