"""Plan search (``moetrain plan --search``) and GPU-count scaling (``--scale``).

The search enumerates parallel layouts (TP, PP, VPP, EP, micro-batch) around a base plan that fixes everything
else (model, global batch, sequence length, precisions, routing, optimizer), predicts each, and ranks the plans
that fit in memory by predicted TFLOP/s per GPU. Recomputation is tried from least to most (none, MLA
up-projections, + norms and SwiGLU, full) and the first level that fits is kept: for a given layout, less
recomputation is never slower. Expert-parallel overlap is switched on for every EP > 1 (it is never slower in the
model) unless the base plan forbids it with ``allow_overlap=False``.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Iterable, Sequence

from moetrain.layout import Framework
from moetrain.parallel.config import ep_overlap_clashes, layout_not_runnable
from moetrain.plan.hardware import GPUSpec, get_gpu
from moetrain.plan.model import Prediction, predict
from moetrain.plan.plan import Plan, PlanError, default_items
from moetrain.plan.shape import ModelShape, load_shape

#: Share of GPU memory a searched plan must leave free: the caching allocator fragments (5-10% is common) and the
#: activation tally of the model is an estimate.
MEMORY_HEADROOM = 0.05

#: What each framework runs, for ``--search`` (by default a search keeps to the plan's framework):
#: tensor / context parallel sizes, GEMM precisions, pipeline schedules, whether its EP overlap exists, FSDP.
#: moetrain: what its trainer runs -- data x expert parallel with FSDP2, pipeline parallel with the 1f1b /
#: interleaved / dualpipev / zbv schedules (moetrain.parallel.config.PP_SCHEDULES), no TP, no CP; BF16 and the
#: FP8 recipes (blockwise "fp8", "mxfp8"), FP8 primary weights included (what they reach on a GPU against the
#: planner's FP8 rates is the GPU issue's to measure); FSDP "trainer": resharded after every pass at PP 1 without
#: EP overlap, else kept gathered through the step (``ParallelConfig.keeps_params_gathered``). Megatron-Core:
#: TP, CP, FP8, 1F1B and interleaved 1F1B (combined 1F1B with EP overlap), no DualPipe. DeepSeek-V3's framework:
#: DualPipe, no TP (report sec. 3.2). TorchTitan: TP, CP, FP8, 1F1B / interleaved / ZBV, no EP overlap.
#: ``overlap_recompute`` False: EP overlap does not run with recompute of whole layers or of the MoE layer
#: (``moetrain.parallel.config.ep_overlap_clashes``): Megatron-Core asserts ``recompute_granularity != 'full'``
#: and no ``moe`` recompute module with ``overlap_moe_expert_parallel_comm`` (TransformerConfig.__post_init__),
#: and moetrain's trainer refuses the same pairs; a search then costs such a plan without the overlap.
FRAMEWORK_PLANS: dict[str, dict[str, Any]] = {
    "moetrain": {"tp": (1,), "cp": (1,), "precisions": ("bf16", "fp32", "fp8", "mxfp8"),
                 "schedules": ("1f1b", "interleaved", "dualpipev", "zbv"), "ep_overlap": True, "fsdp": "trainer",
                 "overlap_recompute": False},
    "megatron": {"tp": None, "cp": None, "precisions": None, "schedules": ("1f1b", "interleaved"),
                 "ep_overlap": True, "fsdp": None, "overlap_recompute": False},
    "deepseek": {"tp": (1,), "cp": (1,), "precisions": None, "schedules": ("dualpipe", "1f1b"),
                 "ep_overlap": True, "fsdp": None, "overlap_recompute": True},
    "torchtitan": {"tp": None, "cp": None, "precisions": None, "schedules": ("1f1b", "interleaved", "zbv"),
                   "ep_overlap": False, "fsdp": True, "overlap_recompute": True},
}

def framework_conflicts(plan: Plan, framework: str) -> list[str]:
    """What in ``plan`` the named framework does not run (FRAMEWORK_PLANS); empty when it runs the plan.

    Returns phrases such as ``"precision mxfp8 (it runs bf16, fp32)"``, for an error message. An unknown
    framework has no rules and no conflicts."""
    rules = FRAMEWORK_PLANS.get(framework)
    if not rules:
        return []
    out = []
    for name, v in (("tp", plan.tp), ("cp", plan.cp)):
        if rules[name] and v not in rules[name]:
            out.append(f"{name.upper()}={v} (it runs {name.upper()} {'/'.join(map(str, rules[name]))})")
    if rules["precisions"] and plan.precision not in rules["precisions"]:
        out.append(f"precision {plan.precision} (it runs {', '.join(rules['precisions'])})")
    if plan.pp > 1 and plan.resolved_schedule not in rules["schedules"]:
        out.append(f"the {plan.resolved_schedule} schedule (it runs {', '.join(rules['schedules'])})")
    if plan.ep_overlap and not rules["ep_overlap"]:
        out.append("EP overlap (it has none)")
    elif plan.ep_overlap and plan.ep > 1 and not rules["overlap_recompute"] and framework != Framework.MOETRAIN:
        out += [f"EP overlap with {c}" for c in ep_overlap_clashes(plan.layout())]
    if framework == Framework.MOETRAIN:
        # a schedule the rules refused above is not named twice
        refused_schedule = plan.pp > 1 and plan.resolved_schedule not in rules["schedules"]
        out += trainer_conflicts(plan.replace(schedule=None) if refused_schedule else plan)
    return out


def trainer_conflicts(plan: Plan) -> list[str]:
    """What of ``plan`` ``moetrain train`` refuses (``moetrain.parallel.config.layout_not_runnable`` and
    ``ep_overlap_clashes``), as phrases; TP and CP, which :data:`FRAMEWORK_PLANS` rules, aside."""
    lay = plan.layout().replace(tp=1, cp=1, mtp_depth=None)
    out = [f"{what} ({why})" for what, why in layout_not_runnable(lay)]
    if plan.ep_overlap and plan.ep > 1:
        out += [f"EP overlap with {c}" for c in ep_overlap_clashes(lay)]
    return out


#: Fields compared when reporting what a searched plan changed.
DIFF_FIELDS = ("tp", "pp", "vpp", "ep", "cp", "dp", "micro_batch", "recompute", "recompute_modules", "ep_overlap",
               "schedule", "pp_layout", "precision", "fsdp", "framework")


def recompute_ladder(shape: ModelShape) -> list[tuple[str, tuple[str, ...] | None]]:
    """Recompute settings from cheapest to most memory-saving."""
    if shape.attention == "mla":
        return [("none", None), ("selective", ("mla_up_proj",)), ("selective", ("layernorm", "mla_up_proj", "moe_act")),
                ("full", None)]
    return [("none", None), ("selective", ("layernorm", "moe_act")), ("full", None)]


def plan_changes(base: Plan, new: Plan) -> list[str]:
    """Human-readable list of the fields ``new`` changes relative to ``base`` ("PP 2 -> 4", ...)."""
    out = []
    for f in DIFF_FIELDS:
        a, b = getattr(base, f), getattr(new, f)
        if f == "schedule":
            a, b = base.resolved_schedule, new.resolved_schedule
        if f == "recompute_modules":
            a = tuple(sorted(base.recomputed)) if base.recompute == "selective" else None
            b = tuple(sorted(new.recomputed)) if new.recompute == "selective" else None
        if a != b:
            def fmt(v: Any) -> str:
                if v is None:
                    return "auto" if f == "pp_layout" else "-"
                if isinstance(v, tuple):
                    return "+".join(v)
                return str(v)
            out.append(f"{f}: {fmt(a)} -> {fmt(b)}")
    return out


@dataclass
class SearchResult:
    """Outcome of :func:`search`.

    Attributes:
        ranked: predictions of the plans that fit, best TFLOP/s per GPU first.
        baseline: the prediction of the base plan (None if it is invalid); it may not fit.
        evaluated / invalid / not_fitting: how many candidates were predicted, rejected by validation, too big.
    """

    ranked: list[Prediction]
    baseline: Prediction | None
    evaluated: int = 0
    invalid: int = 0
    not_fitting: int = 0
    baseline_error: str = ""
    framework: str = ""
    restriction: str = ""

    @property
    def best(self) -> Prediction | None:
        return self.ranked[0] if self.ranked else None

    def changes(self) -> list[str]:
        if self.best is None or self.baseline is None:
            return []
        return plan_changes(self.baseline.plan, self.best.plan)

    def gain(self) -> float | None:
        """best / baseline predicted TFLOP/s per GPU (None when either is missing or the baseline does not fit)."""
        if self.best is None or self.baseline is None or not self.baseline.tflops_per_gpu:
            return None
        return self.best.tflops_per_gpu / self.baseline.tflops_per_gpu

    def to_dict(self) -> dict[str, Any]:
        return {
            "best": self.best.to_dict() if self.best else None,
            "baseline": self.baseline.to_dict() if self.baseline else None,
            "baseline_error": self.baseline_error,
            "changes": self.changes(), "gain": self.gain(),
            "top": [{"plan": p.plan.short(), "tflops_per_gpu": p.tflops_per_gpu,
                     "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu, "memory_gib": p.memory.total,
                     "step_s": p.step.to_dict() if p.step else None}
                    for p in self.ranked[:20]],
            "evaluated": self.evaluated, "invalid": self.invalid, "not_fitting": self.not_fitting,
            "framework": self.framework, "restriction": self.restriction,
        }


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def search(model: Any, gpu: GPUSpec | str, n_gpus: int, base: Plan, *,
           tp: Sequence[int] | None = None, pp: Sequence[int] | None = None, vpp: Sequence[int] | None = None,
           ep: Sequence[int] | None = None, cp: Sequence[int] | None = None,
           micro_batch: Sequence[int] | None = None, allow_overlap: bool = True,
           schedules: Sequence[str] | None = None, top: int | None = None,
           headroom: float = MEMORY_HEADROOM, framework: str | None = "plan") -> SearchResult:
    """Enumerate plans around ``base`` for ``n_gpus`` GPUs and rank the ones that fit by TFLOP/s per GPU.

    Args:
        model, gpu, n_gpus: as for :func:`~moetrain.plan.model.predict`.
        base: fixes global batch, sequence length, precisions, routing, optimizer; it is also the baseline the
            best plan is compared with.
        tp, pp, vpp, ep, cp, micro_batch: candidate values (None = a sensible default range).
        allow_overlap: consider expert-parallel overlap (on for every EP > 1).
        schedules: pipeline schedules to try (plan.SCHEDULES; None: 1F1B and interleaved,
            plus DualPipe when the base plan uses it).
        top: keep only this many ranked plans.
        headroom: rank only plans that leave this fraction of the GPU memory free (allocator fragmentation and
            the model's own uncertainty); 0 accepts anything that fits.
        framework: keep to the plans this framework runs (FRAMEWORK_PLANS): "plan" = the base plan's framework
            (the default), None = any plan the model can cost.

    Raises:
        HardwareError / ShapeError: unknown GPU or model.
    """
    shape = load_shape(model)
    spec = gpu if isinstance(gpu, GPUSpec) else get_gpu(gpu)
    baseline, base_err = None, ""
    try:
        baseline = predict(shape, spec, n_gpus, base.replace(dp=None))
    except PlanError as e:
        base_err = str(e)
    n_items = len(default_items(shape))
    fw = base.framework if framework == "plan" else framework
    rules = FRAMEWORK_PLANS.get(fw) if fw else None
    tps = list(tp) if tp else [t for t in (1, 2, 4, 8) if t <= spec.nvlink_domain and shape.n_heads % t == 0]
    cps = list(cp) if cp else [base.cp]
    mbs = list(micro_batch) if micro_batch else sorted({1, 2, base.micro_batch})
    scheds = list(schedules) if schedules else (["1f1b", "interleaved"]
                                                  + (["dualpipe"] if base.resolved_schedule == "dualpipe" else []))
    restriction = "any plan"
    if rules:
        if rules["tp"]:
            tps = [t for t in tps if t in rules["tp"]] or list(rules["tp"])
        if rules["cp"]:
            cps = [c for c in cps if c in rules["cp"]] or list(rules["cp"])
        if not schedules:
            scheds = list(rules["schedules"])
        else:
            scheds = [x for x in scheds if x in rules["schedules"]]
        if not rules["ep_overlap"]:
            allow_overlap = False
        if rules["precisions"] and base.precision not in rules["precisions"]:
            base = base.replace(precision="bf16", attn_precision="bf16", dispatch_precision="bf16",
                                fp8_param=False)
        if rules["fsdp"] is not None:
            base = base.replace(fsdp=bool(rules["fsdp"]))
        if fw == Framework.MOETRAIN:
            # the GPU mechanisms the trainer does not run yet are costed off rather than ruling every plan out
            base = base.replace(attn_precision="bf16", cuda_graphs="none", fused_mlp=False)
        base = base.for_framework(fw)
        restriction = (f"TP {'/'.join(map(str, tps))}, CP {'/'.join(map(str, cps))}, schedules "
                       f"{', '.join(scheds)}, precision {base.precision}, EP overlap "
                       f"{'where the schedule pairs micro-batches' if allow_overlap else 'none'}"
                       + (", FSDP" if base.fsdp else ""))
    ladder = recompute_ladder(shape)
    if base.recompute == "selective" and base.recompute_modules is not None:
        rung = ("selective", tuple(base.recompute_modules))
        if rung not in ladder:
            ladder.insert(1, rung)
    ranked: list[Prediction] = []
    evaluated = invalid = not_fit = 0
    for t in tps:
        for c in cps:
            if n_gpus % (t * c):
                continue
            rest = n_gpus // (t * c)
            pps = list(pp) if pp else [p for p in _divisors(rest) if p <= min(n_items, 64)]
            for p in pps:
                if rest % p:
                    continue
                dp = rest // p
                stage = t * c * dp
                eps = list(ep) if ep else [e for e in _divisors(shape.n_experts) if stage % e == 0]
                for sched in scheds:
                    if sched == "interleaved":
                        vpps = [v for v in (vpp or (2, 4, 8)) if v > 1 and p > 1 and p * v <= n_items]
                    elif sched == "dualpipe":
                        vpps = [1] if p >= 2 and p % 2 == 0 else []
                    elif sched in ("zbv", "dualpipev"):
                        vpps = [1] if p >= 2 and 2 * p <= n_items else []
                    else:
                        vpps = [1]
                    for v in vpps:
                        for e in eps:
                            for mb in mbs:
                                for rc, mods in ladder:
                                    cand = base.replace(tp=t, pp=p, vpp=v, ep=e, cp=c, dp=None, micro_batch=mb,
                                                        recompute=rc, recompute_modules=mods, schedule=sched,
                                                        ep_overlap=allow_overlap and e > 1 or
                                                        (sched in ("dualpipe", "dualpipev")), pp_layout=None,
                                                        dispatcher=base.dispatcher)
                                    if rules and rules["fsdp"] == "trainer":
                                        cand = cand.replace(fsdp=not (p > 1 or cand.ep_overlap))
                                    if (cand.ep_overlap and rules and not rules["overlap_recompute"]
                                            and ep_overlap_clashes(cand.layout())):
                                        # EP overlap does not recompute whole layers: the rung without it
                                        cand = cand.replace(ep_overlap=False)
                                    if fw == Framework.MOETRAIN and trainer_conflicts(cand):
                                        invalid += 1  # the trainer would refuse it: not recommended
                                        continue
                                    try:
                                        pr = predict(shape, spec, n_gpus, cand)
                                    except PlanError:
                                        invalid += 1
                                        break
                                    evaluated += 1
                                    if pr.fits and pr.memory.total <= (1 - headroom) * pr.memory_limit_gib:
                                        ranked.append(pr)
                                        break
                                    not_fit += 1
    ranked.sort(key=lambda r: -(r.tflops_per_gpu or 0.0))
    if top:
        ranked = ranked[:top]
    return SearchResult(ranked=ranked, baseline=baseline, evaluated=evaluated, invalid=invalid,
                        not_fitting=not_fit, baseline_error=base_err, framework=fw or "", restriction=restriction)


def best_fitting(model: Any, gpu: GPUSpec | str, n_gpus: int, base: Plan,
                 kept: Iterable[str] = ()) -> tuple[Prediction | None, SearchResult]:
    """The best plan for ``n_gpus`` that fits (``moetrain plan`` without ``--ep``): :func:`search` over EP, PP, VPP
    and the schedule (recompute from none upwards, as the search does), with TP, CP and the micro-batch of ``base``
    kept, then the first ranked plan that, with the ``kept`` fields (Plan field names the user gave) set back to
    ``base``'s values, still fits. Returns ``(prediction or None, the search)``.

    Raises:
        HardwareError / ShapeError: unknown GPU or model.
    """
    kept = set(kept)
    res = search(model, gpu, n_gpus, base, tp=[base.tp], cp=[base.cp], micro_batch=[base.micro_batch],
                 pp=[base.pp] if "pp" in kept else None, vpp=[base.vpp] if "vpp" in kept else None,
                 schedules=[base.resolved_schedule] if "schedule" in kept else None)
    for pred in res.ranked:
        back = {f: getattr(base, f) for f in kept if getattr(pred.plan, f) != getattr(base, f)}
        if not back:
            return pred, res
        try:
            again = predict(model, gpu, n_gpus, pred.plan.replace(**back))
        except PlanError:
            continue
        if again.fits:
            return again, res
    return None, res


# ---- scaling -------------------------------------------------------------------------------------------------

@dataclass
class ScalePoint:
    """One GPU count of a scaling study."""

    n_gpus: int
    prediction: Prediction | None
    note: str = ""
    searched: bool = False

    def days(self, tokens: float) -> float | None:
        if self.prediction is None:
            return None
        t = self.prediction.time_to_train(tokens)
        return None if t is None else t / 86400

    def to_dict(self, tokens: float) -> dict[str, Any]:
        p = self.prediction
        return {"n_gpus": self.n_gpus, "note": self.note, "searched": self.searched,
                "plan": p.plan.short() if p else None,
                "tflops_per_gpu": p.tflops_per_gpu if p else None,
                "tokens_per_s_per_gpu": p.tokens_per_s_per_gpu if p else None,
                "days_to_train": self.days(tokens), "tokens": tokens}


def scale(model: Any, gpu: GPUSpec | str, counts: Iterable[int], base: Plan, *, mode: str = "search",
          batch: str = "fixed", base_gpus: int | None = None) -> list[ScalePoint]:
    """Predict ``base`` (or the best plan near it) at each GPU count.

    Args:
        mode: "keep" = the base plan's TP/PP/VPP/EP/CP/micro-batch with DP grown to fill the GPUs;
            "search" = the best plan found by :func:`search` at each count (a narrower grid, for speed).
        batch: "fixed" = the base plan's global batch at every count; "per-gpu" = sequences per GPU held at the
            base plan's value on ``base_gpus`` GPUs.
        base_gpus: the GPU count the base plan was made for (needed for batch="per-gpu").

    Returns:
        One :class:`ScalePoint` per count; ``prediction`` is None (with a note) when no valid plan fits.
    """
    if mode not in ("keep", "search"):
        raise ValueError(f"mode={mode!r}; allowed: 'keep', 'search'")
    if batch not in ("fixed", "per-gpu"):
        raise ValueError(f"batch={batch!r}; allowed: 'fixed', 'per-gpu'")
    if batch == "per-gpu" and not base_gpus:
        raise ValueError("batch='per-gpu' needs base_gpus")
    shape = load_shape(model)
    spec = gpu if isinstance(gpu, GPUSpec) else get_gpu(gpu)
    out: list[ScalePoint] = []
    for n in counts:
        plan = base.replace(dp=None)
        if batch == "per-gpu":
            gbs = max(1, round(base.global_batch * n / base_gpus))
            plan = plan.replace(global_batch=gbs)
        if mode == "keep":
            try:
                pr = predict(shape, spec, n, plan)
                out.append(ScalePoint(n, pr if pr.fits else None, "" if pr.fits else pr.message))
            except PlanError as e:
                out.append(ScalePoint(n, None, str(e)))
            continue
        res = search(shape, spec, n, plan, tp=(1, 2) if spec.nvlink_domain >= 2 else (1,),
                     vpp=(2, 4, 8), micro_batch=(plan.micro_batch,), top=1,
                     ep=None)
        if res.best is None:
            out.append(ScalePoint(n, None, f"no valid plan fits on {n} x {spec.name} with global batch "
                                           f"{plan.global_batch}", searched=True))
        else:
            out.append(ScalePoint(n, res.best, "", searched=True))
    return out


def parse_counts(text: str) -> list[int]:
    """Parse ``--scale``: "64,128,256" or a doubling range "64-8192" / "64..8192" (64, 128, ..., 8192; an end that
    is not reached by doubling is kept as the last count). Returns the counts ascending, each once.

    Raises:
        ValueError: not counts or a range of positive integers.
    """
    text = text.strip()
    bad = ValueError(f"--scale {text!r}: expected GPU counts like 64,128,256 or a range like 64-8192 "
                     f"(positive integers)")
    for sep in ("..", "-"):
        if sep in text and "," not in text:
            try:
                a, b = (int(x) for x in text.split(sep, 1))
            except ValueError:
                raise bad from None
            if a < 1 or b < a:
                raise bad
            out, x = [], a
            while x <= b:
                out.append(x)
                x *= 2
            if out[-1] != b:
                out.append(b)
            return out
    try:
        vals = [int(x) for x in text.replace(" ", "").split(",") if x]
    except ValueError:
        raise bad from None
    if not vals or min(vals) < 1:
        raise bad
    return sorted(set(vals))
