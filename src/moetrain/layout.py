"""The parallel layout and recipe of a training run: one vocabulary for the planner and the trainer.

:class:`Layout` is the record both sides share: the planner's :class:`moetrain.plan.plan.Plan` is a Layout plus what
only a prediction needs (batch, routing statistics, framework), and the trainer's ``[parallel]`` section speaks the
same names (:mod:`moetrain.parallel.config`). Every closed set of values is an enum here whose members say what they
mean. The enums are ``str`` enums: a member *is* its name (``Schedule.ONE_F_ONE_B == "1f1b"``), so JSON and TOML
files keep plain strings and old code comparing with strings keeps working.

Sizes follow Megatron-Core (the published plans are Megatron plans): ``world = TP * CP * DP * PP``; EP is carved out
of the data-parallel ranks of a pipeline stage, so DP counts every rank of a stage that sees different data
(TP = CP = 1: DP = EP * EDP) and ``EDP = TP * CP * DP / EP`` ranks hold the same experts. There is one meaning of DP.

Older spellings (the trainer's first names) are translated once, when a job or plan is read, by
:data:`VALUE_ALIASES` and :data:`TRAINER_KEY_ALIASES` -- the one table of them -- applied by
:func:`translate_aliases`.

Imports only the standard library and :mod:`moetrain.errors` (the base layer).
"""

from __future__ import annotations

import dataclasses
import json
import re
from dataclasses import dataclass
from enum import Enum
from typing import Any, TypeVar

from moetrain.errors import ConfigError, PlanError

E = TypeVar("E", bound="Name")


class Name(str, Enum):
    """A closed set of names whose members are their own string (``str(m)``, ``f"{m}"``, ``repr`` and JSON give the
    plain value, as the files and messages always wrote it)."""

    def __str__(self) -> str:
        return self.value

    def __format__(self, spec: str) -> str:
        return format(self.value, spec)

    def __repr__(self) -> str:
        return repr(self.value)

    def __hash__(self) -> int:  # Enum hashes the member's Python name; a name must hash as its string
        return hash(self.value)

    @classmethod
    def values(cls) -> tuple[str, ...]:
        """Every member's value, in declaration order."""
        return tuple(m.value for m in cls)

    @classmethod
    def parse(cls: type[E], value: Any, field: str) -> E:
        """The member named ``value`` (older spellings of :data:`VALUE_ALIASES` accepted).

        Raises:
            ConfigError: naming ``field``, the value and the allowed ones.
        """
        if isinstance(value, cls):
            return value
        value = VALUE_ALIASES.get(cls.__name__, {}).get(value, value)
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"{field}={value!r}; allowed: {', '.join(map(repr, cls.values()))}") from None


class Schedule(Name):
    """Pipeline schedules."""

    #: one model chunk per rank; warm-up forwards, then one forward and one backward alternating (PipeDream-flush)
    ONE_F_ONE_B = "1f1b"
    #: Megatron's interleaved 1F1B: VPP > 1 chunks per rank, looped (torch ``ScheduleInterleaved1F1B``)
    INTERLEAVED = "interleaved"
    #: DeepSeek's bidirectional DualPipe: rank d holds stage d of one direction and PP-1-d of the other (two copies
    #: of the parameters), forward and backward chunks paired
    DUALPIPE = "dualpipe"
    #: DualPipeV: 2 chunks per rank in a V (rank d holds d and 2PP-1-d), one copy of the parameters, F&B pairs
    #: (torch ``ScheduleDualPipeV``)
    DUALPIPEV = "dualpipev"
    #: zero-bubble V: the same V, backward split into input and weight parts, no F&B pairing (``ScheduleZBVZeroBubble``)
    ZBV = "zbv"

    @property
    def is_v(self) -> bool:
        """Two chunks per rank in a V (DualPipeV, ZBV)."""
        return self in (Schedule.DUALPIPEV, Schedule.ZBV)


class Dispatcher(Name):
    """How routed tokens reach the experts of other EP ranks (docs/reference.md section 10). At EP = 1 every
    dispatcher is a local permutation: no tokens move, so no separate name is needed."""

    #: one row per (token, expert) pair over an all-to-all (Megatron ``alltoall``, TorchTitan's default)
    ALLTOALL = "alltoall"
    #: one row per (token, destination rank) -- per destination NVLink domain, forwarded there, across domains --
    #: with the gate weights, combined on the expert side (DeepEP, Megatron ``flex``; moetrain's dedup dispatcher)
    FLEX = "flex"
    #: every token of the EP group all-gathered, outputs reduce-scattered (Megatron ``allgather``)
    ALLGATHER = "allgather"


class Recompute(Name):
    """What the backward recomputes instead of keeping activations."""

    #: nothing: every activation the backward needs is kept
    NONE = "none"
    #: the modules of ``recompute_modules`` (Megatron ``--recompute-modules``)
    SELECTIVE = "selective"
    #: each layer from its input (its all-to-alls included)
    FULL = "full"


class RecomputeModule(Name):
    """What a selective recompute can cover, named and meant as Megatron-Core's ``--recompute-modules``
    (megatron/core/transformer/transformer_config.py ``recompute_modules``)."""

    #: the attention kernel: its inputs (q, k, v) are kept, its output and softmax statistics recomputed
    CORE_ATTN = "core_attn"
    #: MLA's up-projections and RoPE, and the per-head q, k, v built from them (MLA only: GQA has none)
    MLA_UP_PROJ = "mla_up_proj"
    #: the RMSNorms before attention and FFN: their outputs, which the next projections keep, are recomputed
    LAYERNORM = "layernorm"
    #: the dense SwiGLU FFN of the dense layers
    MLP = "mlp"
    #: the whole MoE FFN from its input: router, dispatch, experts, combine (its all-to-alls run again)
    MOE = "moe"
    #: the routed experts' SwiGLU: its input is kept and its output recomputed
    MOE_ACT = "moe_act"
    #: the shared experts' FFN
    SHARED_EXPERTS = "shared_experts"


#: Selective recompute with no module list: the planner's default set.
DEFAULT_RECOMPUTE_MODULES = (RecomputeModule.LAYERNORM, RecomputeModule.MLA_UP_PROJ)
#: Older spellings of recompute modules (this package's first names): "norm" = "layernorm".
RECOMPUTE_MODULE_ALIASES = {"norm": RecomputeModule.LAYERNORM.value}


class Precision(Name):
    """GEMM (and, for the narrower fields, attention and dispatch) precision. The output head stays BF16 and the
    router FP32 in every precision, as in Megatron and DeepSeek-V3."""

    #: BF16 operands, FP32 accumulation
    BF16 = "bf16"
    #: DeepSeek-V3 blockwise FP8: E4M3, fp32 scales, 1x128 activation/gradient tiles, 128x128 weight blocks
    FP8 = "fp8"
    #: OCP MX FP8: 32-element blocks with E8M0 scales (Blackwell)
    MXFP8 = "mxfp8"
    #: FP32 throughout (CPU runs)
    FP32 = "fp32"


#: The precisions attention and the dispatched token rows can take.
ATTN_PRECISIONS = (Precision.BF16, Precision.FP8)
DISPATCH_PRECISIONS = (Precision.BF16, Precision.FP8)


class OptimizerStates(Name):
    """Precision of the optimizer's states (sharded over the data-parallel ranks: distributed optimizer / ZeRO-1)."""

    #: fp32 gradients, master weights and moments
    FP32 = "fp32"
    #: DeepSeek-V3: fp32 gradients and master weights, bf16 moments
    BF16_MOMENTS = "bf16-moments"
    #: Megatron precision-aware: bf16 gradients and moments, 16-bit master remainder
    BF16 = "bf16"


class CudaGraphs(Name):
    """CUDA graph coverage, which sets the host launch cost."""

    #: whole-iteration graphs: no host launch cost
    FULL = "full"
    #: the static parts graphed (Megatron ``cuda_graph_scope`` attn / moe_router / moe_preprocess); the dropless
    #: experts and the dispatch stay eager
    PARTIAL = "partial"
    #: eager launches
    NONE = "none"


class Routing(Name):
    """Expert load a prediction assumes (a prediction-only setting)."""

    #: forced perfect balance, as the benchmark records run
    BALANCED = "balanced"
    #: learned routing, with its measured or solved imbalance
    REAL = "real"


class Framework(Name):
    """Training frameworks whose recipe defaults and runnable plans the planner knows (a prediction-only setting)."""

    #: NVIDIA Megatron-Core (the published records): alltoall dispatcher, eager unless graphs are set
    MEGATRON = "megatron"
    #: DeepSeek-V3's own framework (report sec. 3.2): DeepEP-style flex dispatch, DualPipe
    DEEPSEEK = "deepseek"
    #: PyTorch TorchTitan: all-to-all of (token, expert) rows, eager
    TORCHTITAN = "torchtitan"
    #: this package's trainer: the flex (dedup) dispatcher, eager PyTorch
    MOETRAIN = "moetrain"


#: Older spellings of enum values, by enum: the trainer's first schedule name and a planner alias.
VALUE_ALIASES: dict[str, dict[str, str]] = {
    "Schedule": {"interleaved-1f1b": "interleaved", "dualpipe-v": "dualpipev"},
}

#: The trainer's first config keys and what they are now, ``(section, key) -> (section, key, value map)``; the value
#: map translates the old value (None: the value is kept). ``parallel.dedup`` picks the dispatcher, the two train
#: keys become ``parallel.precision`` (:func:`translate_aliases` applies the table once when a job is read).
TRAINER_KEY_ALIASES: dict[tuple[str, str], tuple[str, str, dict[Any, Any] | None]] = {
    ("parallel", "pp_schedule"): ("parallel", "schedule", None),
    ("parallel", "dispatch_dtype"): ("parallel", "dispatch_precision", None),
    ("parallel", "activation_checkpointing"): ("parallel", "recompute", {True: "full", False: "none"}),
    ("parallel", "dedup"): ("parallel", "dispatcher", {True: "flex", False: "alltoall"}),
    ("train", "fp8"): ("parallel", "precision", {"blockwise": "fp8", "mxfp8": "mxfp8", "none": None}),
    ("train", "dtype"): ("parallel", "precision", {"auto": "auto", "bf16": "bf16", "fp32": "fp32"}),
}


#: Older values of a trainer key that meant "the default" (the trainer picks the local permutation at EP = 1 by
#: itself): dropped when read. (The older "local" is refused by name: at EP = 1 every dispatcher is local.)
#: The keys every [parallel] section saved by the trainer of the older vocabulary holds (its config.toml).
SAVED_OLDER_PARALLEL_KEYS = frozenset({"pp_schedule", "dedup", "dispatch_dtype", "activation_checkpointing"})

TRAINER_DEFAULT_VALUES: dict[tuple[str, str], tuple[Any, ...]] = {("parallel", "dispatcher"): ("auto",)}


def translate_aliases(sections: dict[str, dict[str, Any]]) -> dict[str, dict[str, Any]]:
    """The trainer's older key names and values (:data:`TRAINER_KEY_ALIASES`) rewritten to today's,
    once, when a job is read: ``parallel.pp_schedule`` -> ``parallel.schedule``, ``dispatch_dtype`` ->
    ``dispatch_precision``, ``activation_checkpointing`` -> ``recompute``, ``dedup`` -> ``dispatcher`` (flex /
    alltoall; the older dispatcher value "auto" means unset, "local" is left for the config to refuse by name),
    ``train.fp8`` and ``train.dtype`` -> ``parallel.precision``. A [parallel] section saved by the older trainer
    (all of :data:`SAVED_OLDER_PARALLEL_KEYS` present) counted ``parallel.dp`` per expert replica (ranks holding the
    same experts): it is multiplied by ``ep`` into today's DP, EP included; elsewhere ``dp`` is read as written.

    Raises:
        ConfigError: an older key beside its new one, or an older value that has no translation.
    """
    out = {k: dict(v) for k, v in sections.items()}
    par = out.get("parallel", {})
    # A [parallel] section that a trainer of the older vocabulary saved (config.toml of a run) holds every one of
    # its keys; only there is ``dp`` known to be the older per-replica count. A hand-written ``dp`` is never
    # guessed at: a count that fits only the older meaning is refused naming the new one (ParallelConfig.resolve).
    if SAVED_OLDER_PARALLEL_KEYS <= set(par) and par.get("dp"):
        par["dp"] = par["dp"] * par.get("ep", 1)
    fp8, dtype = out.get("train", {}).get("fp8"), out.get("train", {}).get("dtype")
    # An FP8 recipe beside train.dtype=bf16 meant "FP8 GEMMs, the rest in bf16": what parallel.precision fp8 / mxfp8
    # runs on a GPU (on a CPU the rest now runs in fp32), so older job files and scripts keep working. Beside fp32
    # it has no equivalent (the FP8 precisions keep no fp32 step on a GPU) and is refused.
    if fp8 not in (None, "none") and dtype not in (None, "auto", "bf16"):
        raise ConfigError(f"train.fp8={fp8!r} with train.dtype={dtype!r}: both are older names of parallel.precision, "
                          f"whose fp8 / mxfp8 run the rest of the step in bf16 on a GPU and fp32 on a CPU; set only "
                          f"parallel.precision")
    if "dedup" in par:
        dedup, values = par.pop("dedup"), TRAINER_KEY_ALIASES[("parallel", "dedup")][2]
        if not isinstance(dedup, bool):
            raise ConfigError(f"parallel.dedup={dedup!r} (the older spelling of parallel.dispatcher flex / alltoall) "
                              f"must be true or false")
        old = par.get("dispatcher", "auto")
        if old == "auto" and dedup:
            par.pop("dispatcher", None)  # the default: flex, the local permutation at EP 1
        elif old in ("auto", "alltoall"):  # the older dispatcher values beside dedup: both were the all-to-all
            par["dispatcher"] = values[dedup]
        elif old != "local":
            raise ConfigError(f"parallel.dedup is the older name of parallel.dispatcher (true = flex, false = "
                              f"alltoall); set only parallel.dispatcher")
    for (section, key), (new_section, new_key, values) in TRAINER_KEY_ALIASES.items():
        if key not in out.get(section, {}):
            continue
        value = out[section].pop(key)
        if (section, key) == ("train", "dtype") and fp8 not in (None, "none"):
            continue  # "auto" or "bf16" beside FP8 GEMMs (checked above): the precision is the FP8 one
        if values is not None:
            if value not in values or isinstance(value, bool) != any(isinstance(v, bool) for v in values):
                allowed = ", ".join(json.dumps(v) for v in values)
                raise ConfigError(f"{section}.{key}={value!r} (the older name of {new_section}.{new_key}) must be "
                                  f"one of {allowed}")
            value = values[value]
            if value is None:
                continue
        target = out.setdefault(new_section, {})
        if new_key in target and (new_section, new_key) != (section, key):
            raise ConfigError(f"{section}.{key} is the older name of {new_section}.{new_key}; set only "
                              f"{new_section}.{new_key}")
        target[new_key] = value
    for (section, key), defaults in TRAINER_DEFAULT_VALUES.items():
        if out.get(section, {}).get(key) in defaults:
            del out[section][key]
    return out


@dataclass(frozen=True)
class Layout:
    """The parallel layout and recipe of a run, one meaning per name (the planner's; the trainer's ``[parallel]``).

    Attributes:
        tp, pp, vpp, ep, cp: tensor, pipeline, virtual-pipeline (model chunks per pipeline rank for the interleaved
            schedule; the V schedules hold 2 by themselves and say 1), expert and context parallel sizes.
        dp: data-parallel size in Megatron's meaning: ``world = TP * CP * DP * PP``, EP carved out of DP (the ranks
            holding the same experts are ``edp = TP * CP * DP / EP``); None = derived from the world size.
        schedule: a :class:`Schedule`; None = interleaved when vpp > 1, else 1f1b.
        pp_layout: Megatron ``pipeline_model_parallel_layout`` ("Et*4|(t*4|)*14tmL": E embedding, t layer, m MTP
            module, L output head + loss, | stage boundary); None = the cost-balanced split.
        dispatcher: a :class:`Dispatcher`; None = the framework's default (a Plan) or moetrain's (flex).
        dispatch_precision: wire format of the dispatched rows, bf16 or fp8 (E4M3, 1x128 tiles, as DeepSeek-V3);
            the combine stays BF16.
        precision: GEMM :class:`Precision`.
        attn_precision: the attention kernel's precision, bf16 or fp8.
        recompute: a :class:`Recompute`.
        recompute_modules: for selective recompute, the modules (None = the default set).
        ep_overlap: hide the expert all-to-all behind another micro-batch's compute (Megatron ``moe_a2a_overlap``,
            DualPipe's F&B pairs).
        fsdp: parameters resharded after every forward and backward and all-gathered again for the next (ZeRO-3);
            False = gathered once per step and kept through it (Megatron's distributed optimizer).
        dp_overlap: the data-parallel reduce-scatter / all-gather overlap compute.
        mtp_depth: multi-token-prediction modules trained (None = the model's own; 0 = off).
        optimizer: :class:`OptimizerStates`.
        fp8_param: FP8 primary weights (no BF16 copy; Megatron ``--fp8-param-gather``).
        cuda_graphs: :class:`CudaGraphs`; None = the framework's default.
        fused_mlp: the routed experts as one fused grouped-MLP kernel per direction (Megatron-Bridge, Blackwell).
    """

    tp: int = 1
    pp: int = 1
    vpp: int = 1
    ep: int = 1
    cp: int = 1
    dp: int | None = None
    schedule: Schedule | None = None
    pp_layout: str | None = None
    dispatcher: Dispatcher | None = None
    dispatch_precision: Precision = Precision.BF16
    precision: Precision = Precision.BF16
    attn_precision: Precision = Precision.BF16
    recompute: Recompute = Recompute.NONE
    recompute_modules: tuple[str, ...] | None = None
    ep_overlap: bool = False
    fsdp: bool = False
    dp_overlap: bool = True
    mtp_depth: int | None = None
    optimizer: OptimizerStates = OptimizerStates.BF16_MOMENTS
    fp8_param: bool = False
    cuda_graphs: CudaGraphs | None = None
    fused_mlp: bool = False

    def __post_init__(self) -> None:
        coerce_names(self, _ENUM_FIELDS)

    @property
    def world(self) -> int:
        """Ranks of the whole run: TP * PP * CP * DP."""
        return self.tp * self.pp * self.cp * (self.dp or 1)

    @property
    def stage_size(self) -> int:
        """Ranks per pipeline stage (TP * CP * DP)."""
        return self.tp * self.cp * (self.dp or 1)

    @property
    def edp(self) -> int:
        """Expert data-parallel size: ranks of a stage holding the same experts (TP * CP * DP / EP)."""
        return self.stage_size // self.ep

    @property
    def resolved_schedule(self) -> Schedule:
        """The schedule, with the default (interleaved when vpp > 1, else 1f1b) filled in."""
        if self.schedule:
            # an unknown name is returned as given, for the owner's check to refuse by name
            name = VALUE_ALIASES["Schedule"].get(self.schedule, self.schedule)
            return Schedule(name) if name in Schedule.values() else name
        return Schedule.INTERLEAVED if self.vpp > 1 else Schedule.ONE_F_ONE_B

    def layout_dict(self) -> dict[str, Any]:
        """The layout's fields as JSON values (enum members as their names), in declaration order."""
        out = {}
        for f in dataclasses.fields(Layout):
            v = getattr(self, f.name)
            out[f.name] = list(v) if isinstance(v, tuple) else v.value if isinstance(v, Name) else v
        return out

    def layout_fields(self) -> dict[str, Any]:
        """The :class:`Layout` fields alone, as they are (of a ``Plan`` or a ``ParallelConfig`` too), to build
        another record of the same layout from."""
        return {f: getattr(self, f) for f in LAYOUT_FIELDS}

    def replace(self, **changes: Any) -> Any:
        """A copy with ``changes`` (the same class)."""
        return dataclasses.replace(self, **changes)


def coerce_names(obj: Any, fields: dict[str, type[Name]]) -> None:
    """Turn each valid name among ``fields`` of the frozen dataclass ``obj`` into its enum member, in place.

    An invalid name is left as given, for the owner's check (the planner's ``validate``, the trainer's config) to
    refuse in its own terms.
    """
    for f, enum in fields.items():
        v = getattr(obj, f)
        if isinstance(v, str) and not isinstance(v, enum):
            v = VALUE_ALIASES.get(enum.__name__, {}).get(v, v)
            if v in enum.values():
                object.__setattr__(obj, f, enum(v))


_ENUM_FIELDS: dict[str, type[Name]] = {
    "schedule": Schedule, "dispatcher": Dispatcher, "dispatch_precision": Precision, "precision": Precision,
    "attn_precision": Precision, "recompute": Recompute, "optimizer": OptimizerStates, "cuda_graphs": CudaGraphs,
}
LAYOUT_FIELDS = tuple(f.name for f in dataclasses.fields(Layout))


# ---- pipeline layout: Megatron's ``pipeline_model_parallel_layout`` grammar, read by the planner and the trainer --

def _expand(s: str) -> str:
    """Expand Megatron layout repetitions: ``(t*4|)*2`` -> ``t*4|t*4|`` -> ``tttt|tttt|``."""
    out: list[str] = []
    i = 0

    def read_count(j: int) -> tuple[int, int]:
        m = re.match(r"\*(\d+)", s[j:])
        if not m:
            return 1, j
        return int(m.group(1)), j + m.end()

    while i < len(s):
        c = s[i]
        if c == "(":
            depth, j = 1, i + 1
            while j < len(s) and depth:
                depth += {"(": 1, ")": -1}.get(s[j], 0)
                j += 1
            if depth:
                raise PlanError(f"pp_layout {s!r}: unbalanced parentheses")
            inner = _expand(s[i + 1:j - 1])
            n, i = read_count(j)
            out.append(inner * n)
        elif c in "EtmL|":
            n, i = read_count(i + 1)
            out.append(c * n)
        elif c.isspace() or c == ",":
            i += 1
        else:
            raise PlanError(f"pp_layout {s!r}: unexpected character {c!r}; allowed: E t m L | ( ) *N")
    return "".join(out)


def parse_layout(layout: str) -> list[str]:
    """Split a Megatron pipeline layout into per-virtual-stage item strings (e.g. ``["Etttt", "tttt", ...]``)."""
    stages = _expand(layout).split("|")
    return stages
