"""Parallelism settings: the :class:`~moetrain.layout.Layout` the trainer runs plus its run-time knobs."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Literal

from moetrain.errors import ConfigError
from moetrain.layout import (ATTN_PRECISIONS, DEFAULT_RECOMPUTE_MODULES, DISPATCH_PRECISIONS, RECOMPUTE_MODULE_ALIASES,
                             CudaGraphs, Dispatcher, Layout, OptimizerStates, Precision, Recompute, RecomputeModule,
                             Schedule)

#: Pipeline schedules the trainer runs (``torch.distributed.pipelining``): all but the bidirectional DualPipe,
#: which keeps two copies of the parameters.
PP_SCHEDULES = (Schedule.ONE_F_ONE_B, Schedule.INTERLEAVED, Schedule.DUALPIPEV, Schedule.ZBV)
V_SCHEDULES = tuple(s for s in Schedule if s.is_v)
#: Schedules whose backward torch runs as separate input- and weight-gradient actions.
SPLIT_BACKWARD = (Schedule.DUALPIPEV, Schedule.ZBV)
#: Dispatchers the trainer has (``moetrain.parallel.dispatch.AllToAllDispatcher``; at EP = 1 either is a local
#: permutation).
DISPATCHERS = (Dispatcher.ALLTOALL, Dispatcher.FLEX)
#: Values of ``parallel.precision``: a :class:`~moetrain.layout.Precision`, or "auto" (bf16 on GPU, fp32 on CPU).
AUTO = "auto"


def more_ranks(multiple: int, dry_run_world: bool) -> str:
    """The fix for a rank count that is not a multiple of ``multiple``, naming the option that sets the count: the
    ``--world`` of a dry run's layout (``dry_run_world``), else the processes launched (``--nproc``)."""
    if dry_run_world:
        return f"give --world a multiple of {multiple}"
    return f"launch a multiple of {multiple} processes (--nproc)"


def layout_not_runnable(layout: Layout) -> list[tuple[str, str]]:
    """What of ``layout`` the trainer cannot run: ``(what, "field=value; what runs instead")`` per field, empty when
    all of it runs. The one list of the trainer's limits, for its own config and for plans (``moetrain.train.
    from_plan``); unset fields (a plan's framework defaults) are the caller's to resolve first.
    """
    out = []
    if layout.tp != 1:
        out.append(("tensor parallelism", f"tp={layout.tp}; use tp 1"))
    if layout.cp != 1:
        out.append(("context parallelism", f"cp={layout.cp}; use cp 1"))
    if layout.schedule is not None and layout.schedule not in PP_SCHEDULES:
        why = (": the bidirectional DualPipe keeps two copies of the parameters" if layout.schedule == Schedule.DUALPIPE
               else " is no schedule moetrain knows")
        out.append((f"the {layout.schedule} pipeline schedule",
                    f"schedule={layout.schedule!r}{why}; the trainer runs {', '.join(map(str, PP_SCHEDULES))}, "
                    f"dualpipev being DualPipe's one-copy V"))
    if layout.dispatcher is not None and layout.dispatcher not in DISPATCHERS:
        out.append((f"the {layout.dispatcher} dispatcher",
                    f"dispatcher={layout.dispatcher!r}; the trainer has {', '.join(map(str, DISPATCHERS))}"))
    if layout.attn_precision != Precision.BF16:
        out.append(("FP8 attention", f"attn_precision={layout.attn_precision!r}; use bf16"))
    if layout.recompute != Recompute.SELECTIVE and layout.recompute_modules is not None:
        out.append(("recompute modules", f"recompute_modules={list(layout.recompute_modules)}; only selective "
                    f"recompute takes them"))
    if layout.cuda_graphs is not None and layout.cuda_graphs != CudaGraphs.NONE:
        out.append(("CUDA graphs", f"cuda_graphs={layout.cuda_graphs!r}; the trainer launches eagerly (none)"))
    if layout.fused_mlp:
        out.append(("the fused grouped-MLP kernel", "fused_mlp=true; the trainer runs the unfused grouped MLP"))
    if not layout.dp_overlap and layout.pp > 1:
        out.append(("data-parallel communication without overlap under pipelining",
                    "dp_overlap=false with pp > 1; torch's pipeline schedules reduce each stage's gradients in its "
                    "last backward (the trainer runs dp_overlap=false at pp 1)"))
    if layout.fsdp and layout.ep_overlap:
        out.append(("resharding after every forward and backward",
                    "fsdp=true with ep_overlap: EP overlap runs one micro-batch's backward in pieces between another's "
                    "forward, so the trainer keeps the parameters gathered through the step; use fsdp false"))
    elif layout.fsdp and layout.pp > 1 and layout.schedule in SPLIT_BACKWARD:
        out.append(("resharding after every forward and backward",
                    f"fsdp=true with schedule={layout.schedule!r}: it computes the weight gradients in a pass of their "
                    f"own after the input gradients, which torch's pipeline stage does not keep gathered for a "
                    f"resharded stage (the losses move); use fsdp false, or the 1f1b or interleaved schedule"))
    if isinstance(layout, ParallelConfig) and layout.redundant_experts:
        why = [(f"capacity_factor={layout.capacity_factor}", layout.capacity_factor is not None,
                "dropping counts a capacity per expert, and copies would each get one"),
               (f"schedule={layout.schedule!r}", layout.pp > 1 and layout.schedule in SPLIT_BACKWARD
                and not layout.ep_overlap, "a schedule that splits the backward (torch's input and weight "
                "actions) computes the weight gradients of the stage's parameters only, and the copies are not "
                "parameters (use 1f1b or interleaved, or dualpipev with ep_overlap, whose paired backward is whole)"),
               (f"ep={layout.ep}", layout.ep == 1, "with one EP rank there is no other rank to copy an expert to")]
        for what, bad, reason in why:
            if bad:
                out.append(("redundant experts", f"redundant_experts={layout.redundant_experts} with {what}: "
                            f"{reason}; set parallel.redundant_experts=0 or change it"))
    if layout.mtp_depth is not None:
        out.append(("an MTP depth in the layout", f"mtp_depth={layout.mtp_depth}; the trainer's is model.mtp_depth"))
    return out


def ep_overlap_clashes(layout: Layout) -> list[str]:
    """The layout settings EP overlap (``ep_overlap``) does not run with, each as ``"field=value (why)"``: the zbv
    schedule under pipelining, and recompute of whole blocks (full) or of MoE layers (selective with ``moe``). The one
    list, for the trainer's config, ``--plan`` files and the planner's search for framework moetrain."""
    mods = ({RECOMPUTE_MODULE_ALIASES.get(m, m) for m in (layout.recompute_modules or ())}
            if layout.recompute == Recompute.SELECTIVE else set())
    again = "its all-to-alls would run again inside a paired backward step; selective recompute of other modules pairs"
    return [c for c, bad in (
        (f"schedule={layout.schedule!r} (zbv splits every backward, so nothing pairs)",
         layout.pp > 1 and layout.resolved_schedule == Schedule.ZBV),
        (f"recompute='full' ({again})", layout.recompute == Recompute.FULL),
        (f"recompute_modules=[..., 'moe'] ({again})", RecomputeModule.MOE in mods)) if bad]


@dataclass(frozen=True)
class ParallelConfig(Layout):
    """How the world is split and what the step runs in: the trainer's layout (moetrain.layout.Layout).

    World = PP x DP (TP = CP = 1). A pipeline stage is DP ranks, every one of which sees different data (the ranks of
    one pipeline, one per stage, see the same); EP is carved out of them, as in Megatron-Core and TorchTitan: EP
    consecutive ranks split the routed experts (E/EP per rank) and ``edp = DP / EP`` ranks hold the same experts.
    Every other weight of a stage is sharded with FSDP2 over the stage's DP ranks; expert weights over the ``edp``
    ranks holding the same experts.

    Older key names are translated once when a job is read (:data:`moetrain.layout.TRAINER_KEY_ALIASES`).

    Attributes:
        tp: tensor-parallel size (Megatron TP with sequence parallelism); the trainer runs 1 only.
        cp: context-parallel size (sequence split over ranks); the trainer runs 1 only.
        pp: pipeline stages (ranks per pipeline).
        vpp: model chunks per pipeline rank for the interleaved schedule (> 1 needs it); the V schedules hold 2 by
            themselves (1 here; 2 is accepted and means the same).
        ep: expert-parallel size; must divide the number of routed experts and DP.
        dp: data-parallel size in Megatron's meaning (EP included): unset = world size / pp.
        schedule: pipeline schedule, one of 1f1b, interleaved (needs vpp > 1), dualpipev, zbv (ignored when pp == 1;
            "interleaved-1f1b" is the older name of interleaved).
        pp_layout: Megatron pipeline layout (``E`` embedding, ``t`` layer, ``m`` MTP module, ``L`` head + loss, ``|``
            between virtual stages, ``*n`` repetition, e.g. "Ettt|tttmL"); None = the planner's cost-balanced split.
        dispatcher: "flex": a dropless token goes once to each EP rank holding any of its experts (with its gate
            weights and local expert ids) and one gate-weighted sum per (token, rank) comes back, as DeepEP and
            Megatron-Core's flex dispatcher do; "alltoall": one row per token-expert assignment. Capacity mode
            (capacity_factor set) always sends per assignment. Unset = flex, and at ep == 1 the local permutation
            (no token moves; a dispatcher named at ep == 1 runs its all-to-all over the one rank, which exercises
            the collective path). "allgather" is not implemented; the older "auto" means unset, "local" is refused
            (leave it unset).
        dispatch_precision: wire format of the dispatched token rows: "bf16" (the activations' dtype, BF16 under GPU
            mixed precision) or "fp8" (E4M3 with one fp32 scale per 1x128 tile, as DeepSeek-V3 dispatches; about
            half the bytes of BF16). The combine stays in high precision.
        precision: "auto" (bf16 autocast on GPU, fp32 on CPU), "bf16", "fp32", or FP8 GEMMs: "fp8" (DeepSeek-V3
            blockwise: E4M3, fp32 scales; linears 1x128 activation/gradient tiles and 128x128 weight blocks, routed
            experts one scale per token row and per weight row, as Hopper's grouped FP8 kernel takes them) or
            "mxfp8" (OCP MX: 32-element blocks, E8M0 scales), the rest of the step as under "auto". Dense,
            shared-expert and routed-expert FFNs, MLA projections run FP8; embedding, head, router, norms and
            attention stay high precision (docs/fp8.md). Where the GPU has no FP8 kernel for the recipe the
            quantised values are multiplied in higher precision (fp32 on CPU, TF32 or bf16 on a GPU, warned once).
        attn_precision: attention precision; the trainer runs bf16 (or fp32 under precision fp32) only.
        recompute: "none", "full" (each block recomputed in backward from its input) or "selective" (the modules of
            recompute_modules, ``moetrain.model.recompute``; bit-identical losses and gradients).
        recompute_modules: selective recompute's modules, Megatron-Core's ``--recompute-modules`` names
            (moetrain.layout.RecomputeModule: core_attn, mla_up_proj, layernorm, mlp, moe, moe_act,
            shared_experts; "norm" is accepted for layernorm); unset = the planner's default set (layernorm,
            mla_up_proj). Only with recompute "selective"; "moe" (its all-to-alls run again in the backward) not
            with ep_overlap.
        ep_overlap: pair micro-batch i+1's forward with micro-batch i's backward phase by phase, so every expert
            all-to-all (forward and backward) is in flight while the other micro-batch computes (Megatron-Core's
            combined 1F1B; ``moetrain.parallel.overlap``). Needs two or more micro-batches to pair; under pipelining
            the schedule's forward-backward pairs (1f1b, interleaved, dualpipev's OVERLAP_F_B; not zbv); not
            with recompute full, n_chunks > 1 or overlap = false.
        fsdp: true = parameters resharded after each forward and backward and all-gathered again (ZeRO-3; under
            pp > 1 after each micro-batch's forward, torch's pipeline stage keeping them gathered from a stage's
            first backward to its last: the 1f1b and interleaved schedules, as TorchTitan runs them); false =
            gathered once per step and kept through it (Megatron's distributed-optimizer memory); unset = true at
            pp == 1 without ep_overlap, else false (pipelining and EP overlap keep them gathered).
        dp_overlap: true = FSDP2 reduce-scatters each module's gradients behind the rest of the backward; false =
            all of them after the backward (Megatron without ``--overlap-grad-reduce``; pp == 1 only). The
            parameter all-gathers are FSDP2's either way.
        mtp_depth: must be unset: the model's depth is ``model.mtp_depth``.
        optimizer: optimizer state precision, sharded over the data-parallel ranks with the parameters: "fp32"
            (fp32 weights, gradients and moments; torch's fused AdamW), "bf16-moments" (DeepSeek-V3: fp32 weights and
            gradients, bf16 moments) or "bf16" (Megatron's precision-aware optimizer: bf16 weights, gradients and
            moments, the exact fp32 master kept as a 16-bit remainder; needs a process group, as moetrain train
            always has). A run resumes into another of them (the checkpoint keeps fp32 masters; moments converted).
        fp8_param: FP8 primary weights (needs precision fp8 or mxfp8): the FP8 GEMMs' weights are quantised once
            per optimizer step from their masters and FSDP2 all-gathers the FP8 bytes (Megatron's
            ``--fp8-param-gather``; ``moetrain.precision.primary_weights``). The fp32 masters stay sharded in the
            optimizer. Losses equal FP8 without it where the backward reads the weight in its forward tiles
            (the blockwise recipe's linears); elsewhere the dgrad's weight is quantised again from the held FP8.
        cuda_graphs: the trainer launches eagerly ("none").
        fused_mlp: the fused grouped-MLP kernel; not implemented (false).
        capacity_factor: None = dropless (default); else tokens beyond ceil(cf * T * K / E) per expert are dropped.
        drop_policy: "probs" drops the lowest gate weights first, "position" the latest tokens first.
        pad_to_capacity: pad every expert's rows to its capacity (static shapes; needs capacity_factor).
        overlap: run the shared experts while the dispatch all-to-all is in flight (asynchronous collective).
        n_chunks: split each micro-batch's tokens into this many chunks so one chunk's all-to-all overlaps another's
            expert GEMMs (1 = off).
        timeout_s: collective timeout; a hang ends with an error naming the phase.
        redundant_experts: R, extra expert slots per EP rank holding copies of the hottest experts of other ranks
            (``moetrain.parallel.redundant``); 0 = off. Training is the unreplicated training up to fp32 sum order.
        rebalance_every: N, steps between placements of the copies, each from the loads of the last N steps (no
            copies before the first).
        node_limit_m: M, node-limited routing (DeepSeek-V3's): each token's routed experts lie on at most M nodes,
            the nodes chosen by the sum of their top K / M selection scores (``moetrain.model.moe.node_limited``);
            a node holds the experts of ``gpus_per_node`` consecutive EP ranks. None = unlimited; with the EP group
            on one node it changes nothing.
        gpus_per_node: ranks per node (NVLink domain), for node_limit_m: EP must be a multiple of it or divide it.
    """

    schedule: Schedule = Schedule.ONE_F_ONE_B
    dispatcher: Dispatcher | None = None
    precision: Precision | Literal["auto"] = AUTO
    fsdp: bool | None = None
    optimizer: OptimizerStates = OptimizerStates.FP32
    cuda_graphs: CudaGraphs = CudaGraphs.NONE
    capacity_factor: float | None = None
    drop_policy: Literal["probs", "position"] = "probs"
    pad_to_capacity: bool = False
    overlap: bool = True
    n_chunks: int = 1
    timeout_s: float = 300.0
    redundant_experts: int = 0
    rebalance_every: int = 100
    node_limit_m: int | None = None
    gpus_per_node: int = 8

    def __post_init__(self) -> None:
        super().__post_init__()
        for name in ("tp", "pp", "vpp", "ep", "cp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"parallel.{name}={v!r} must be an integer >= 1")
        if self.dp == 0:  # the older "derive it" spelling
            object.__setattr__(self, "dp", None)
        if self.dp is not None and (not isinstance(self.dp, int) or isinstance(self.dp, bool) or self.dp < 1):
            raise ConfigError(f"parallel.dp={self.dp!r} must be an integer >= 1 (unset = world size / pp)")
        self._check_names()
        if self.pp > 1 and self.vpp > 1 and self.schedule == Schedule.ONE_F_ONE_B:
            raise ConfigError(f"parallel.vpp={self.vpp} needs parallel.schedule='interleaved' (1f1b holds one stage "
                              f"per rank)")
        if self.schedule.is_v:
            if self.vpp > 2:
                raise ConfigError(f"parallel.schedule={self.schedule!r} holds exactly 2 stages per rank; "
                                  f"parallel.vpp={self.vpp} (use 1 or 2)")
            object.__setattr__(self, "vpp", 1)  # the V holds its two chunks by itself: one meaning of vpp
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError(f"parallel.capacity_factor={self.capacity_factor} must be > 0 (or unset for dropless)")
        if self.drop_policy not in ("probs", "position"):
            raise ConfigError(f"parallel.drop_policy={self.drop_policy!r}; allowed: 'probs', 'position'")
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ConfigError("parallel.pad_to_capacity needs parallel.capacity_factor to be set")
        if not isinstance(self.n_chunks, int) or self.n_chunks < 1:
            raise ConfigError(f"parallel.n_chunks={self.n_chunks!r} must be an integer >= 1")
        for name in ("ep_overlap", "overlap", "fused_mlp", "fp8_param", "dp_overlap"):
            if not isinstance(getattr(self, name), bool):
                raise ConfigError(f"parallel.{name}={getattr(self, name)!r} must be true or false")
        if self.fp8_param and self.precision not in (Precision.FP8, Precision.MXFP8):
            raise ConfigError(f"parallel.fp8_param=true holds the weights of the FP8 GEMMs in FP8, and "
                              f"parallel.precision={str(self.precision)!r} runs none: set parallel.precision to fp8 "
                              f"or mxfp8, or fp8_param false")
        if self.fp8_param and self.redundant_experts:
            raise ConfigError("parallel.fp8_param=true with parallel.redundant_experts: the expert copies are made "
                              "from the high-precision weights, which fp8_param does not gather; set one of them "
                              "off")
        if self.fsdp is not None and not isinstance(self.fsdp, bool):
            raise ConfigError(f"parallel.fsdp={self.fsdp!r} must be true, false or unset")
        for name in ("redundant_experts", "rebalance_every"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < (0 if name == "redundant_experts" else 1):
                raise ConfigError(f"parallel.{name}={v!r} must be an integer >= "
                                  f"{0 if name == 'redundant_experts' else 1}")
        self._check_recompute_modules()
        for name, v in (("node_limit_m", self.node_limit_m), ("gpus_per_node", self.gpus_per_node)):
            if v is not None and (not isinstance(v, int) or isinstance(v, bool) or v < 1):
                raise ConfigError(f"parallel.{name}={v!r} must be an integer >= 1" + (" (or unset)" if name ==
                                                                                      "node_limit_m" else ""))
        if self.node_limit_m is not None and self.ep % self.gpus_per_node and self.gpus_per_node % self.ep:
            raise ConfigError(f"parallel.node_limit_m needs the EP group to fill whole nodes or sit in one: "
                              f"parallel.ep={self.ep} is neither a multiple nor a divisor of parallel.gpus_per_node="
                              f"{self.gpus_per_node}")
        missing = layout_not_runnable(self)
        if missing:
            raise ConfigError("moetrain train cannot run this layout: "
                              + "; ".join(f"{what} (parallel.{why})" for what, why in missing))
        if self.ep_overlap:
            clash = ep_overlap_clashes(self) + \
                [f"n_chunks={self.n_chunks} (the paired schedule runs whole micro-batches)"] * (self.n_chunks > 1) + \
                ["overlap=false (the paired schedule needs asynchronous all-to-alls)"] * (not self.overlap)
            if clash:
                raise ConfigError(f"parallel.ep_overlap=true does not combine with "
                                  f"{'; '.join('parallel.' + c for c in clash)}: change that or set "
                                  f"parallel.ep_overlap=false")
        if not self.timeout_s > 0:
            raise ConfigError(f"parallel.timeout_s={self.timeout_s} must be > 0")

    def _check_recompute_modules(self) -> None:
        mods = self.recompute_modules
        if mods is None:
            return
        if isinstance(mods, str):  # --set parallel.recompute_modules=layernorm,moe_act
            mods = [m.strip() for m in mods.split(",") if m.strip()]
        if not isinstance(mods, (list, tuple)) or not all(isinstance(m, str) for m in mods):
            raise ConfigError(f"parallel.recompute_modules={mods!r} must be a list of module names, e.g. "
                              f"['layernorm', 'moe_act']; allowed: {', '.join(RecomputeModule.values())}")
        if not mods:
            raise ConfigError("parallel.recompute_modules is empty, which would recompute nothing: leave it unset for "
                              "the default set (layernorm, mla_up_proj), name the modules, or set "
                              "parallel.recompute='none'")
        names = tuple(RECOMPUTE_MODULE_ALIASES.get(m, m) for m in mods)
        bad = [m for m in names if m not in RecomputeModule.values()]
        if bad:
            raise ConfigError(f"parallel.recompute_modules: unknown {', '.join(map(repr, bad))}; allowed: "
                              f"{', '.join(RecomputeModule.values())} (Megatron-Core's --recompute-modules names)")
        object.__setattr__(self, "recompute_modules", tuple(dict.fromkeys(names)))

    @property
    def ep_nodes(self) -> int:
        """Nodes the EP group spans (its ranks are consecutive, ``gpus_per_node`` to a node)."""
        return max(1, self.ep // self.gpus_per_node)

    @property
    def recomputed_modules(self) -> frozenset[RecomputeModule]:
        """The modules selective recompute covers (the default set when none are named); empty unless
        ``recompute`` is "selective" (full recompute is the whole block's, ``moetrain.model.transformer.Block``)."""
        if self.recompute != Recompute.SELECTIVE:
            return frozenset()
        names = self.recompute_modules if self.recompute_modules is not None else DEFAULT_RECOMPUTE_MODULES
        return frozenset(RecomputeModule(m) for m in names)

    def _check_names(self) -> None:
        if self.dispatcher == "local":
            raise ConfigError("parallel.dispatcher='local': at ep == 1 every dispatcher is the local permutation and "
                              "above it tokens must move; leave parallel.dispatcher unset (flex, local at ep == 1) or "
                              "name alltoall / flex")
        choices = {"schedule": Schedule.values(), "dispatcher": (None, *Dispatcher.values()),
                   "dispatch_precision": DISPATCH_PRECISIONS, "precision": (AUTO, *Precision.values()),
                   "attn_precision": ATTN_PRECISIONS, "recompute": Recompute.values(),
                   "optimizer": OptimizerStates.values(), "cuda_graphs": CudaGraphs.values()}
        for name, allowed in choices.items():
            if getattr(self, name) not in allowed:
                names = ", ".join(a for a in allowed if a is not None)
                raise ConfigError(f"parallel.{name}={getattr(self, name)!r}; allowed: {names}")

    @property
    def stages_per_rank(self) -> int:
        """Model chunks each pipeline rank holds: 2 for the V schedules, vpp otherwise (1 without pipelining)."""
        if self.pp == 1:
            return 1
        return 2 if self.schedule.is_v else self.vpp

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    @property
    def dedup(self) -> bool:
        """Whether the dispatcher sends one row per (token, destination rank): flex, dropless."""
        return self.run_dispatcher == Dispatcher.FLEX and self.capacity_factor is None

    @property
    def run_dispatcher(self) -> Dispatcher:
        """The dispatcher that runs: flex when unset."""
        return self.dispatcher or Dispatcher.FLEX

    @property
    def dispatch_rows(self) -> Dispatcher:
        """What the dispatcher sends, in the layout's terms: :attr:`run_dispatcher`, except that capacity mode
        (``capacity_factor`` set) drops and pads single assignments, so it always sends one row per (token, expert)
        pair (alltoall)."""
        return self.run_dispatcher if self.capacity_factor is None else Dispatcher.ALLTOALL

    @property
    def moves_tokens(self) -> bool:
        """Whether the all-to-all dispatcher runs: EP > 1, or a dispatcher named at EP = 1 (over the one rank)."""
        return self.ep > 1 or self.dispatcher is not None

    @property
    def keeps_params_gathered(self) -> bool:
        """Parameters gathered once per step and kept (fsdp false, or unset with pp > 1 or ep_overlap)."""
        return not self.fsdp if self.fsdp is not None else (self.pp > 1 or self.ep_overlap)

    def run_precision(self, device_type: str) -> Precision:
        """The GEMM precision on ``device_type`` ("auto" resolved: bf16 on cuda, fp32 elsewhere)."""
        if self.precision == AUTO:
            return Precision.BF16 if device_type == "cuda" else Precision.FP32
        return Precision(self.precision)

    def autocast_bf16(self, device_type: str) -> bool:
        """Whether the step runs under bf16 autocast: precision bf16, or auto / fp8 / mxfp8 on a GPU."""
        if self.precision in (Precision.BF16, Precision.FP32):
            return self.precision == Precision.BF16
        return device_type == "cuda"

    def resolve(self, world_size: int, n_routed_experts: int, dry_run_world: bool = False) -> "ParallelConfig":
        """Check the sizes against the world and the model; return a copy with dp and fsdp filled in.
        ``dry_run_world``: the world is a dry run's ``--world`` (the messages name that option).

        Raises:
            ConfigError: pp does not divide the world, ep does not divide the experts or a stage's ranks, or
                pp * dp != world.
        """
        if world_size % self.pp:
            raise ConfigError(f"world size {world_size} is not divisible by parallel.pp={self.pp}; "
                              f"{more_ranks(self.pp, dry_run_world)} or change pp")
        stage = world_size // self.pp
        if n_routed_experts % self.ep:
            ok = [d for d in range(1, n_routed_experts + 1) if n_routed_experts % d == 0 and stage % d == 0]
            raise ConfigError(f"parallel.ep={self.ep} must divide the number of routed experts ({n_routed_experts});"
                              f" with {stage} ranks per pipeline stage the allowed ep values are {ok}")
        if stage % self.ep:
            raise ConfigError(f"{stage} ranks per pipeline stage (world {world_size} / pp {self.pp}) are not "
                              f"divisible by parallel.ep={self.ep}; "
                              f"{more_ranks(self.pp * self.ep, dry_run_world)} (pp x ep) or change ep")
        dp = self.dp or stage
        if self.pp * dp != world_size:
            hint = (f"; before parallel.dp took Megatron's meaning it counted the expert replicas, and a dp of "
                    f"{dp} with ep={self.ep} is now written parallel.dp={dp * self.ep}"
                    if self.pp * dp * self.ep == world_size else "")
            world = f"--world {world_size}" if dry_run_world else f"world size {world_size}"
            raise ConfigError(f"parallel.pp={self.pp} x parallel.dp={dp} = {self.pp * dp} != {world} "
                              f"(dp counts every rank of a stage, the expert-parallel ones included{hint})")
        return dataclasses.replace(self, dp=dp, fsdp=not self.keeps_params_gathered)
