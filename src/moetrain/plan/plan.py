"""A training plan (parallel layout, batch, precision, overlap, routing) and its validation.

Megatron conventions (the published plans of docs/reference.md section 4 are Megatron plans):

* Dense layers: ``world = TP * CP * DP * PP`` (PP outermost: a pipeline stage is ``TP*CP*DP`` consecutive ranks).
* MoE layers re-partition the same ``TP * CP * DP`` ranks of a stage as ``ETP * EP * EDP`` with ETP = 1 here:
  EP is carved out of the data-parallel ranks, EP consecutive ranks form an expert-parallel group, and
  ``EDP = TP*CP*DP / EP`` replicas of each expert are kept in sync by the data-parallel gradient reduction.
  The published TP1/PP2/EP32 plan on 256 GPUs therefore has DP = 128 and EDP = 4.
* Sequence parallelism is on whenever TP > 1 (Megatron requires it for MoE).
* ``micro_batch`` is in sequences; ``global_batch`` in sequences; micro-batches per step per pipeline
  ``m = global_batch / (DP * micro_batch)``.
"""

from __future__ import annotations

import dataclasses
import math
from dataclasses import asdict, dataclass
from typing import Any

from moetrain.errors import PlanError  # noqa: F401 - the planner's error, raised and caught as moetrain.plan.plan.PlanError
from moetrain.layout import ATTN_PRECISIONS as _ATTN_PRECISIONS
from moetrain.layout import DISPATCH_PRECISIONS as _DISPATCH_PRECISIONS
from moetrain.layout import parse_layout
from moetrain.layout import (DEFAULT_RECOMPUTE_MODULES, LAYOUT_FIELDS, RECOMPUTE_MODULE_ALIASES, VALUE_ALIASES,
                             CudaGraphs, Dispatcher, Framework, Layout, OptimizerStates, Precision, Recompute,
                             RecomputeModule, Routing, Schedule, coerce_names)
from moetrain.plan.hardware import GPUSpec
from moetrain.plan.shape import ModelShape

#: The planner's closed sets are the enums of :mod:`moetrain.layout` (one table, shared with the trainer); these
#: tuples are their values, for argparse choices and messages.
PRECISIONS = Precision.values()
ATTN_PRECISIONS = tuple(p.value for p in _ATTN_PRECISIONS)
DISPATCH_PRECISIONS = tuple(p.value for p in _DISPATCH_PRECISIONS)
RECOMPUTE = Recompute.values()
#: Modules a selective recompute can cover: :class:`moetrain.layout.RecomputeModule` (what each means), as
#: Megatron-Core's ``--recompute-modules`` names them.
RECOMPUTE_MODULES = RecomputeModule.values()
RECOMPUTE_ALIASES = RECOMPUTE_MODULE_ALIASES
DEFAULT_SELECTIVE = tuple(m.value for m in DEFAULT_RECOMPUTE_MODULES)
ROUTING = Routing.values()
#: Pipeline schedules: :class:`moetrain.layout.Schedule` (what each means); older names in SCHEDULE_ALIASES.
SCHEDULES = Schedule.values()
SCHEDULE_ALIASES = VALUE_ALIASES["Schedule"]
#: Schedules that hold two chunks per rank in a V.
V_SCHEDULES = tuple(s.value for s in Schedule if s.is_v)
#: Token dispatchers: :class:`moetrain.layout.Dispatcher` (docs/reference.md section 10).
DISPATCHERS = Dispatcher.values()
#: Frameworks whose recipe defaults and runnable plans the model knows (see FRAMEWORK_DEFAULTS).
FRAMEWORKS = Framework.values()
#: CUDA graph coverage: :class:`moetrain.layout.CudaGraphs`.
CUDA_GRAPHS = CudaGraphs.values()
#: What each framework does when the plan does not say: its default dispatcher and CUDA-graph use.
#: Megatron-Core: ``moe_token_dispatcher_type`` is set by every published recipe (alltoall or flex), its default
#: ``cuda_graph_impl`` is "none". DeepSeek-V3: DeepEP-style kernels (report sec. 3.2.2: one copy per node, then
#: NVLink forwarding) -- CUDA graph use is not published; "none" is assumed. TorchTitan: all-to-all of
#: (token, expert) rows, eager (its default). moetrain: its dispatcher sends one row per (token, destination
#: rank) (``moetrain.parallel.dispatch``), eager PyTorch.
FRAMEWORK_DEFAULTS = {
    Framework.MEGATRON: {"dispatcher": Dispatcher.ALLTOALL, "cuda_graphs": CudaGraphs.NONE},
    Framework.DEEPSEEK: {"dispatcher": Dispatcher.FLEX, "cuda_graphs": CudaGraphs.NONE},
    Framework.TORCHTITAN: {"dispatcher": Dispatcher.ALLTOALL, "cuda_graphs": CudaGraphs.NONE},
    Framework.MOETRAIN: {"dispatcher": Dispatcher.FLEX, "cuda_graphs": CudaGraphs.NONE},
}
OPTIMIZERS = OptimizerStates.values()


@dataclass(frozen=True)
class Plan(Layout):
    """How one training run is laid out: its :class:`~moetrain.layout.Layout` plus what only a prediction needs
    (batch, routing statistics, node limit, framework, name).

    Attributes:
        tp, pp, vpp, ep, cp: tensor, pipeline, virtual-pipeline (model chunks per pipeline rank), expert and
            context parallel sizes. dp: data parallel size; None = derived from the GPU count.
        micro_batch, global_batch: sequences per micro-batch and per optimizer step. seq_len: tokens per sequence.
        precision: GEMM precision "bf16", "fp8" (Hopper-style block or tensor scaling), "mxfp8" (Blackwell) or
            "fp32" (CPU runs).
            The output head stays BF16 and the router FP32 in every precision, as in Megatron and DeepSeek-V3.
        attn_precision: precision of the fused attention kernel ("bf16", or "fp8" = FP8 dot-product attention).
        dispatch_precision: "fp8" sends the dispatched tokens (and, in the backward, the gradients sent to the
            experts) in FP8, as DeepSeek-V3; combine is BF16 always.
        recompute: "none"; "selective" = the modules of ``recompute_modules`` recomputed in the backward (default:
            norms and MLA up-projections, as DeepSeek-V3 and Megatron ``mla_up_proj``); "full" = each layer
            recomputed from its input (all-to-alls included).
        recompute_modules: for "selective": a subset of RECOMPUTE_MODULES (None = DEFAULT_SELECTIVE).
        ep_overlap: hide the expert all-to-all behind the compute of another micro-batch (Megatron
            ``moe_a2a_overlap`` / DeepSeek's F&B chunk pairs). Always on with the DualPipe schedule.
        routing: "balanced" (forced perfect balance, as the benchmark records) or "real" (learned routing).
        imbalance: max/mean tokens per EP rank for real routing. None = the factor that makes this plan's step
            ``constants.REAL_ROUTING_SLOWDOWN`` times the forced-balanced step (the published 8-20%), solved by
            :func:`moetrain.plan.model.predict`; the prediction's plan carries the solved value.
        node_limit_m: node-limited routing: each token goes to experts on at most M NVLink domains (DeepSeek-V3:
            4 nodes). None = derived from group-limited routing when groups align with domains, else no limit.
        schedule: "1f1b", "interleaved" (needs vpp > 1), "dualpipe", "dualpipev" or "zbv" (SCHEDULES; the V
            schedules take VPP 1 or the trainer's 2). None = interleaved when
            vpp > 1 else 1f1b.
        pp_layout: Megatron ``pipeline_model_parallel_layout`` ("Et*4|(t*4|)*14tmL": E embedding, t layer,
            m MTP module, L output head + loss, | stage boundary). None = balanced automatically.
        optimizer: state precision: "fp32" (fp32 grads, master, moments), "bf16-moments" (DeepSeek-V3: fp32 grads
            and master, bf16 moments), "bf16" (Megatron precision-aware: bf16 grads and moments, 16-bit master
            remainder). Optimizer states are sharded over data-parallel ranks (distributed optimizer / ZeRO-1).
        fp8_param: FP8 primary weights (Megatron ``--fp8-param-gather``, DeepSeek-V3): no BF16 copy of the weights
            is kept, only the FP8 working copy (the FP32 master stays in the sharded optimizer state).
        fsdp: parameters sharded over the data-parallel ranks and all-gathered for every micro-batch's forward and
            backward (FSDP2 / ZeRO-3, as ``moetrain train`` does); gradients reduce-scattered once per step.
        dp_overlap: overlap the data-parallel gradient reduce-scatter / parameter all-gather with compute.
        dispatcher: token dispatcher, one of DISPATCHERS; None = the framework's default (FRAMEWORK_DEFAULTS).
        framework: the training framework whose recipe this is (FRAMEWORKS): sets the defaults above and, for
            ``--search``, which plans can run at all (``moetrain.plan.search.FRAMEWORK_PLANS``).
        cuda_graphs: CUDA graph coverage, one of CUDA_GRAPHS; None = the framework's default. Decides the host
            launch cost (``moetrain.plan.model``: a layer cannot run faster than its kernels can be launched).
        mtp_depth: multi-token-prediction modules trained (None = the model's own; 0 = MTP off).
        fused_mlp: the routed experts run as one fused grouped-MLP kernel per direction (Megatron-Bridge
            ``cutedsl_fused_grouped_mlp``: grouped GEMM, SwiGLU and the quantisation of its output in one kernel,
            the record recipes' setting): the SwiGLU's activations never round-trip through HBM and the experts
            launch no per-expert kernels. False = the unfused grouped MLP (every framework's default).
        name: label for reports.

    The hidden share of the expert all-to-all is not a switch: ``ep_overlap`` is the recipe's request (Megatron
    ``moe_a2a_overlap``), and what it hides follows from the schedule (:attr:`overlap_schedule`).
    """

    micro_batch: int = 1
    global_batch: int = 1024
    seq_len: int = 4096
    routing: Routing = Routing.BALANCED
    imbalance: float | None = None
    node_limit_m: int | None = None
    framework: Framework = Framework.MEGATRON
    name: str = ""

    def __post_init__(self) -> None:
        super().__post_init__()
        coerce_names(self, {"routing": Routing, "framework": Framework})

    # ---- derived ---------------------------------------------------------------------------------------------
    @property
    def n_microbatches(self) -> int:
        return self.global_batch // ((self.dp or 1) * self.micro_batch)

    @property
    def resolved_dispatcher(self) -> str:
        return self.dispatcher or FRAMEWORK_DEFAULTS.get(self.framework, FRAMEWORK_DEFAULTS["megatron"])["dispatcher"]

    @property
    def resolved_cuda_graphs(self) -> str:
        return self.cuda_graphs or FRAMEWORK_DEFAULTS.get(self.framework, FRAMEWORK_DEFAULTS["megatron"])[
            "cuda_graphs"]

    @property
    def overlap_schedule(self) -> str | None:
        """How the expert all-to-all is hidden, from the schedule; None = not at all.

        * "dualpipe" / "dualpipev": DualPipe's F&B chunk pairs (always, it is what the schedule is for).
        * "combined-1f1b": ``ep_overlap`` under interleaved 1F1B (Megatron's combined 1F1B merges one chunk's
          forward with another's backward; Megatron asserts VPP when PP > 1).
        * "paired-microbatch": ``ep_overlap`` with PP = 1 and at least 2 micro-batches: the forward of micro-batch
          i+1 runs with the backward of micro-batch i (Megatron's combined 1F1B at PP = 1; what moetrain's trainer
          overlap builds).
        * None: plain 1F1B with PP > 1, ZBV, one micro-batch, EP = 1 or no ``ep_overlap``: nothing pairs a
          forward with a backward, so nothing hides the all-to-all.

        Framework "moetrain" is its trainer's ``parallel.ep_overlap`` exactly: DualPipeV pairs only with it
        (without, torch's runtime runs each F&B pair one after the other), and 1F1B with PP > 1 pairs too
        ("combined-1f1b": each steady-state backward merged with the next forward,
        ``moetrain.parallel.schedules.pair_actions``).
        """
        if self.ep <= 1:
            return None
        sched = self.resolved_schedule
        trainer = self.framework == "moetrain"
        if sched in ("dualpipe", "dualpipev") and (self.ep_overlap or not trainer):
            return sched
        if not self.ep_overlap:
            return None
        if sched == "interleaved" or (trainer and sched == "1f1b" and self.pp > 1):
            return "combined-1f1b"
        if sched == "1f1b" and self.pp == 1 and self.n_microbatches >= 2:
            return "paired-microbatch"
        return None

    @property
    def recomputed(self) -> frozenset[str]:
        """Modules recomputed under selective recompute (empty for "none"; everything for "full")."""
        if self.recompute == "none":
            return frozenset()
        if self.recompute == "full":
            return frozenset(RECOMPUTE_MODULES)
        mods = self.recompute_modules if self.recompute_modules is not None else DEFAULT_SELECTIVE
        return frozenset(RECOMPUTE_ALIASES.get(m, m) for m in mods)

    @property
    def load_imbalance(self) -> float:
        """max/mean tokens per EP rank. Real routing without a factor is resolved by the cost model
        (``predict`` solves it from ``constants.REAL_ROUTING_SLOWDOWN``) before any cost is computed."""
        if self.routing == "balanced":
            return 1.0
        if self.imbalance is None:
            raise ValueError("real routing without an imbalance factor: moetrain.plan.model.predict solves it "
                             "from constants.REAL_ROUTING_SLOWDOWN; pass imbalance= to cost the plan directly")
        return float(self.imbalance)

    @property
    def overlapped(self) -> bool:
        """True when the schedule hides (part of) the expert all-to-all (:attr:`overlap_schedule`)."""
        return self.overlap_schedule is not None

    @property
    def tokens_per_step(self) -> int:
        return self.global_batch * self.seq_len

    def replace(self, **changes: Any) -> "Plan":
        return dataclasses.replace(self, **changes)

    def layout(self) -> Layout:
        """The plan's :class:`~moetrain.layout.Layout` alone, with the schedule, dispatcher and CUDA graphs the
        plan resolves (what a run of it must execute)."""
        return Layout(**{f: getattr(self, f) for f in LAYOUT_FIELDS}).replace(
            schedule=self.resolved_schedule, dispatcher=self.resolved_dispatcher, cuda_graphs=self.resolved_cuda_graphs)

    def for_framework(self, framework: str) -> "Plan":
        """This plan as another framework's recipe: that framework's dispatcher and CUDA-graph defaults, and none
        of this recipe's kernels (the fused grouped MLP). The same plan when ``framework`` is its own."""
        if framework == self.framework:
            return self
        return self.replace(framework=framework, dispatcher=None, cuda_graphs=None, fused_mlp=False)

    def to_dict(self) -> dict[str, Any]:
        d = asdict(self)
        d = {k: d[k] for k in _JSON_ORDER}  # the keys in the order the plan files always had
        d["schedule"] = self.resolved_schedule
        # the framework's defaults where the plan leaves them unset, so a reader sees what was costed
        d["dispatcher"] = self.resolved_dispatcher
        d["cuda_graphs"] = self.resolved_cuda_graphs
        d["edp"] = self.edp if self.dp else None
        d["n_microbatches"] = self.n_microbatches if self.dp else None
        return d

    def short(self) -> str:
        """One-line description: TP/PP/VPP/EP/CP/DP, batch, precision, recompute, overlap."""
        s = (f"TP{self.tp}/PP{self.pp}/VPP{self.vpp}/EP{self.ep}/CP{self.cp}/DP{self.dp} mbs{self.micro_batch} "
             f"gbs{self.global_batch} {self.precision}")
        if self.attn_precision != "bf16":
            s += f" attn-{self.attn_precision}"
        if self.dispatch_precision != "bf16":
            s += f" dispatch-{self.dispatch_precision}"
        s += f" recompute-{self.recompute}"
        if self.recompute == "selective" and self.recompute_modules is not None:
            s += "(" + "+".join(self.recompute_modules) + ")"
        s += f" {self.resolved_schedule}"
        s += f" ep-overlap({self.overlap_schedule})" if self.overlapped else ""
        s += f" {self.resolved_dispatcher}"
        s += f" graphs-{self.resolved_cuda_graphs}"
        if self.fused_mlp:
            s += " fused-mlp"
        if self.framework != "megatron":
            s += f" framework-{self.framework}"
        if self.fsdp:
            s += " fsdp"
        if self.fp8_param:
            s += " fp8-param"
        if self.mtp_depth is not None:
            s += f" mtp{self.mtp_depth}"
        s += f" routing-{self.routing}"
        if self.routing == "real" and self.imbalance is not None:
            s += f"x{self.imbalance:.3g}"
        if self.node_limit_m:
            s += f" M{self.node_limit_m}"
        return s


#: The plan's JSON keys in the order ``moetrain plan --json`` has always written them.
_JSON_ORDER = ("tp", "pp", "vpp", "ep", "cp", "dp", "micro_batch", "global_batch", "seq_len", "precision",
               "attn_precision", "dispatch_precision", "recompute", "recompute_modules", "ep_overlap", "routing",
               "imbalance", "node_limit_m", "schedule", "pp_layout", "optimizer", "fp8_param", "fsdp", "dp_overlap",
               "dispatcher", "framework", "cuda_graphs", "mtp_depth", "fused_mlp", "name")


# ---- pipeline layout -------------------------------------------------------------------------------------------

def default_items(shape: ModelShape) -> list[str]:
    """The item sequence of a model: E, its layers ("d" dense, "t" MoE), MTP modules "m", head "L"."""
    return (["E"] + ["d"] * shape.n_dense_layers + ["t"] * shape.n_moe_layers + ["m"] * shape.mtp_depth + ["L"])


def layout_items(layout: str, shape: ModelShape, n_stages: int) -> list[list[str]]:
    """Per-stage item lists from a Megatron layout; "t" becomes "d" for the model's leading dense layers.

    Raises:
        PlanError: wrong stage count, wrong number of layers / MTP modules, E not first or L not last.
    """
    stages = parse_layout(layout)
    if len(stages) != n_stages:
        raise PlanError(f"pp_layout {layout!r} has {len(stages)} stages; PP*VPP = {n_stages} (DualPipe: PP)")
    flat = "".join(stages)
    if flat.count("t") != shape.n_layers:
        raise PlanError(f"pp_layout {layout!r} places {flat.count('t')} layers; the model has {shape.n_layers}")
    if flat.count("m") != shape.mtp_depth:
        raise PlanError(f"pp_layout {layout!r} places {flat.count('m')} MTP modules; the model has {shape.mtp_depth}")
    if flat.count("E") != 1 or not stages[0].startswith("E"):
        raise PlanError(f"pp_layout {layout!r}: the embedding E must open the first stage, once")
    if flat.count("L") != 1 or not stages[-1].endswith("L"):
        raise PlanError(f"pp_layout {layout!r}: the head L must close the last stage, once")
    out: list[list[str]] = []
    seen = 0
    for st in stages:
        items = []
        for c in st:
            if c == "t":
                items.append("d" if seen < shape.n_dense_layers else "t")
                seen += 1
            else:
                items.append(c)
        out.append(items)
    return out


def balanced_partition(costs: list[float], n_parts: int) -> list[tuple[int, int]]:
    """Split ``costs`` into ``n_parts`` contiguous non-empty ranges minimising the largest sum (binary search on
    the bound with a greedy fill, then splitting ranges until there are exactly ``n_parts``).

    The sums are exact: every float is an integer multiple of a power of two, so the costs are scaled to integers
    on their common denominator. The result therefore does not depend on the order or method of float summation
    (Python 3.12's ``sum()`` of floats is compensated and no longer equals a running sum; a bound taken from one
    and checked against the other had split a single stage in two).

    Args:
        costs: seconds (or any non-negative, finite unit) per pipeline item, in model order.
        n_parts: number of stages.

    Returns:
        [start, end) index pairs, one per stage, covering ``costs`` in order.

    Raises:
        PlanError: fewer items than stages, fewer than one stage, or a negative or non-finite cost.
    """
    n = len(costs)
    if not 1 <= n_parts <= n:
        raise PlanError(f"cannot split {n} pipeline items into {n_parts} stages")
    bad = [c for c in costs if not (c >= 0 and math.isfinite(c))]
    if bad:
        raise PlanError(f"pipeline item costs must be finite and non-negative; got {bad[:3]}")
    ratios = [float(c).as_integer_ratio() for c in costs]
    den = max(d for _, d in ratios)  # every denominator is a power of two, so each divides the largest
    w = [num * (den // d) for num, d in ratios]

    def greedy(bound: int) -> list[tuple[int, int]] | None:
        parts, start, acc = [], 0, 0
        for i, c in enumerate(w):
            if c > bound:
                return None
            if acc + c > bound:
                parts.append((start, i))
                start, acc = i, 0
            acc += c
        parts.append((start, n))
        return parts if len(parts) <= n_parts else None

    lo, hi = max(w), sum(w)  # hi: one range holds everything
    while lo < hi:  # the smallest bound the greedy fill meets
        mid = (lo + hi) // 2
        if greedy(mid) is None:
            lo = mid + 1
        else:
            hi = mid
    best = greedy(hi)
    assert best is not None
    while len(best) < n_parts:  # every stage needs an item: split the costliest multi-item range
        idx = max((i for i, (a, b) in enumerate(best) if b - a > 1), key=lambda i: sum(w[best[i][0]:best[i][1]]))
        a, b = best[idx]
        acc, cut = 0, a + 1
        total = sum(w[a:b])
        for j in range(a, b - 1):
            acc += w[j]
            cut = j + 1
            if 2 * acc >= total:
                break
        best[idx:idx + 1] = [(a, cut), (cut, b)]
    return best


# ---- validation ------------------------------------------------------------------------------------------------

def n_pipeline_stages(plan: Plan) -> int:
    """Model chunks of the whole pipeline: PP x VPP (1F1B, interleaved), PP (DualPipe: each rank holds stage d of
    one direction and PP-1-d of the other), 2 PP (ZBV: rank d holds chunks d and 2PP-1-d of a V)."""
    sched = plan.resolved_schedule
    if sched == "dualpipe":
        return plan.pp
    if sched in V_SCHEDULES:
        return 2 * plan.pp
    return plan.pp * plan.vpp


def _divisors(n: int) -> list[int]:
    return [d for d in range(1, n + 1) if n % d == 0]


def validate(plan: Plan, shape: ModelShape, gpu: GPUSpec, n_gpus: int) -> Plan:
    """Check ``plan`` against the model and the cluster; return it with ``dp`` and ``schedule`` filled in.

    Raises:
        PlanError: the first problem found, with the allowed values. (Whether it fits in memory is decided by
            the cost model, which reports a plan that does not fit as such.)
    """
    def pos_int(name: str, v: Any) -> None:
        if not isinstance(v, int) or isinstance(v, bool) or v < 1:
            raise PlanError(f"{name}={v!r} must be an integer >= 1")

    pos_int("GPU count", n_gpus)
    if gpu.host_procs is not None and n_gpus != gpu.host_procs:
        # a bench's rates are those of its processes sharing the machine's cores, memory bandwidth and caches
        raise PlanError(f"the bench measured {gpu.host_procs} processes at once on this machine, and its rates hold "
                        f"for a run of {gpu.host_procs}; to predict {n_gpus}, rerun `moetrain bench --procs "
                        f"{n_gpus}` (or predict a run of {gpu.host_procs} processes)")
    for f in ("tp", "pp", "vpp", "ep", "cp", "micro_batch", "global_batch", "seq_len"):
        pos_int(f, getattr(plan, f))
    if plan.dp is not None:
        pos_int("dp", plan.dp)
    choices = {"precision": PRECISIONS, "attn_precision": ATTN_PRECISIONS,
               "dispatch_precision": DISPATCH_PRECISIONS, "recompute": RECOMPUTE, "routing": ROUTING,
               "optimizer": OPTIMIZERS}
    for f, allowed in choices.items():
        if getattr(plan, f) not in allowed:
            raise PlanError(f"{f}={getattr(plan, f)!r}; allowed: {list(allowed)}")
    if plan.recompute_modules is not None:
        bad = sorted(set(plan.recompute_modules) - set(RECOMPUTE_MODULES) - set(RECOMPUTE_ALIASES))
        if bad or isinstance(plan.recompute_modules, str):
            raise PlanError(f"recompute_modules={plan.recompute_modules!r}; allowed: a tuple of "
                            f"{list(RECOMPUTE_MODULES)}")
    if plan.schedule is not None and plan.schedule not in SCHEDULES and plan.schedule not in SCHEDULE_ALIASES:
        raise PlanError(f"schedule={plan.schedule!r}; allowed: {list(SCHEDULES) + list(SCHEDULE_ALIASES)}")
    if plan.dispatcher is not None and plan.dispatcher not in DISPATCHERS:
        raise PlanError(f"dispatcher={plan.dispatcher!r}; allowed: {list(DISPATCHERS)}")
    if plan.framework not in FRAMEWORKS:
        raise PlanError(f"framework={plan.framework!r}; allowed: {list(FRAMEWORKS)}")
    if plan.cuda_graphs is not None and plan.cuda_graphs not in CUDA_GRAPHS:
        raise PlanError(f"cuda_graphs={plan.cuda_graphs!r}; allowed: {list(CUDA_GRAPHS)}")
    if plan.fused_mlp and (plan.framework != "megatron" or gpu.generation != "blackwell"):
        raise PlanError(f"fused_mlp: the fused grouped-MLP kernel (Megatron-Bridge cutedsl_fused_grouped_mlp) is a "
                        f"Megatron kernel for Blackwell GPUs; this plan is framework {plan.framework!r} on "
                        f"{gpu.name} ({gpu.generation}); drop --fused-mlp (a --record plan that has it: --no-fused-mlp)")
    if plan.mtp_depth is not None:
        if not isinstance(plan.mtp_depth, int) or isinstance(plan.mtp_depth, bool) or plan.mtp_depth < 0:
            raise PlanError(f"mtp_depth={plan.mtp_depth!r} must be an integer >= 0")
        if plan.mtp_depth and shape.attention != "mla":
            raise PlanError("mtp_depth > 0 needs a DeepSeek-V3-style (MLA) model; this model has no MTP modules")
        if shape.attention == "mla":
            from moetrain.plan.shape import with_mtp_depth

            shape = with_mtp_depth(shape, plan.mtp_depth)

    model_par = plan.tp * plan.pp * plan.cp
    if plan.dp is None:
        if n_gpus % model_par:
            raise PlanError(f"TP*PP*CP = {plan.tp}*{plan.pp}*{plan.cp} = {model_par} does not divide the "
                            f"{n_gpus} GPUs; choose sizes whose product divides {n_gpus}")
        dp = n_gpus // model_par
    else:
        dp = plan.dp
        if model_par * dp != n_gpus:
            raise PlanError(f"TP*PP*CP*DP = {plan.tp}*{plan.pp}*{plan.cp}*{dp} = {model_par * dp} != {n_gpus} GPUs; "
                            "the parallel sizes must multiply to the GPU count (or leave DP out to derive it)")
    plan = plan.replace(dp=dp)

    if shape.n_experts % plan.ep:
        raise PlanError(f"EP={plan.ep} must divide the {shape.n_experts} routed experts; allowed EP: "
                        f"{_divisors(shape.n_experts)}")
    if plan.stage_size % plan.ep:
        raise PlanError(f"EP={plan.ep} must divide TP*CP*DP = {plan.stage_size} (EP is carved out of the "
                        f"data-parallel ranks of a pipeline stage); allowed EP: "
                        f"{[d for d in _divisors(plan.stage_size) if shape.n_experts % d == 0]}")
    if plan.global_batch % (dp * plan.micro_batch):
        raise PlanError(f"global_batch={plan.global_batch} must be a multiple of DP*micro_batch = "
                        f"{dp}*{plan.micro_batch} = {dp * plan.micro_batch}")
    if shape.n_heads % plan.tp:
        raise PlanError(f"TP={plan.tp} must divide the {shape.n_heads} attention heads; allowed: "
                        f"{_divisors(shape.n_heads)}")
    if shape.attention == "gqa" and shape.n_kv_heads % plan.tp and plan.tp % shape.n_kv_heads:
        raise PlanError(f"TP={plan.tp} and the {shape.n_kv_heads} key/value heads must divide one another")
    if plan.seq_len % (plan.tp * plan.cp):
        raise PlanError(f"seq_len={plan.seq_len} must be a multiple of TP*CP = {plan.tp * plan.cp} (sequence "
                        "parallelism splits the sequence over TP, context parallelism over CP)")
    if plan.cp > 1 and plan.seq_len % (2 * plan.cp):
        raise PlanError(f"seq_len={plan.seq_len} must be a multiple of 2*CP = {2 * plan.cp} (load-balanced CP)")
    if plan.fp8_param and plan.precision not in ("fp8", "mxfp8"):
        raise PlanError("fp8_param (FP8 primary weights) needs precision 'fp8' or 'mxfp8'")
    if plan.imbalance is not None and not plan.imbalance >= 1.0:
        raise PlanError(f"imbalance={plan.imbalance} must be >= 1 (max/mean tokens per EP rank)")
    if plan.imbalance is not None and plan.routing != "real":
        raise PlanError(f"imbalance={plan.imbalance} is the load of real routing; routing={plan.routing!r} is "
                        f"forced-balanced (imbalance 1): set routing 'real' (--routing real) or drop the imbalance")
    if plan.node_limit_m is not None:
        pos_int("node_limit_m", plan.node_limit_m)
    if plan.precision == "mxfp8" and gpu.generation != "blackwell":
        raise PlanError(f"precision='mxfp8' needs a Blackwell GPU; {gpu.name} is {gpu.generation} (use 'fp8')")
    for f in ("precision", "attn_precision"):
        p = getattr(plan, f)
        if p not in gpu.peak_tflops and not (p == "bf16" and "fp32" in gpu.peak_tflops):
            raise PlanError(f"{f}={p!r}: {gpu.name} has no {p} rate (has {sorted(gpu.peak_tflops)})")

    m = plan.n_microbatches
    sched = plan.resolved_schedule
    if sched == "interleaved":
        if plan.vpp < 2 or plan.pp < 2:
            raise PlanError(f"the interleaved schedule needs PP >= 2 and VPP >= 2 (got PP={plan.pp}, VPP={plan.vpp})")
        if m % plan.pp:
            raise PlanError(f"the interleaved schedule needs the micro-batches per step ({m}) to be a multiple "
                            f"of PP={plan.pp}")
    elif sched == "dualpipe":
        if plan.vpp != 1:
            raise PlanError("DualPipe holds two stages per rank by itself; set VPP=1")
        if plan.pp < 2 or plan.pp % 2:
            raise PlanError(f"DualPipe needs an even PP >= 2 (got {plan.pp})")
        if m % 2 or m < 2 * plan.pp:
            raise PlanError(f"DualPipe needs an even number of micro-batches >= 2*PP = {2 * plan.pp} (got {m})")
    elif sched in V_SCHEDULES:
        name = {"zbv": "ZBV", "dualpipev": "DualPipeV"}[sched]
        if plan.vpp not in (1, 2):
            raise PlanError(f"{name} holds two chunks per rank by itself (a V); set VPP=1 (or 2, the trainer's "
                            "count)")
        if plan.pp < 2:
            raise PlanError(f"{name} needs PP >= 2 (got {plan.pp})")
        if m < plan.pp:
            raise PlanError(f"{name} needs >= PP = {plan.pp} micro-batches to fill the V (got {m})")
    elif plan.vpp != 1:
        raise PlanError(f"VPP={plan.vpp} needs the interleaved schedule (schedule={plan.schedule!r})")
    n_stages = n_pipeline_stages(plan.replace(schedule=sched))
    n_items = len(default_items(shape))
    if plan.pp_layout is not None:
        layout_items(plan.pp_layout, shape, n_stages)
    elif n_stages > n_items:
        raise PlanError(f"PP*VPP = {n_stages} pipeline stages but the model has only {n_items} pipeline items "
                        f"(embedding, {shape.n_layers} layers, {shape.mtp_depth} MTP, head)")
    if plan.pp > 1 and m < plan.pp:
        raise PlanError(f"{m} micro-batches per step cannot fill a pipeline of PP={plan.pp}; raise global_batch "
                        "or lower DP/PP")
    return plan.replace(schedule=sched, vpp=1 if sched in V_SCHEDULES else plan.vpp)
