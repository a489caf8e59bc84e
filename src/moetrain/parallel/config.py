"""Parallelism settings: how the world is split and how tokens move between expert-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moetrain.model.config import ConfigError

DispatcherName = Literal["auto", "local", "alltoall"]
#: Pipeline schedules of ``torch.distributed.pipelining`` the trainer runs, by their name in moetrain: "1f1b"
#: (one stage per rank), "interleaved-1f1b" (``vpp`` stages per rank, looped), "dualpipev" and "zbv" (two stages per
#: rank in a V: rank r holds stages r and 2 PP - 1 - r; backward split into input and weight parts).
PP_SCHEDULES = ("1f1b", "interleaved-1f1b", "dualpipev", "zbv")
V_SCHEDULES = ("dualpipev", "zbv")


@dataclass
class ParallelConfig:
    """World = PP x DP x EP (room for TP later).

    A pipeline stage is DP x EP ranks; every rank of a stage sees different data (the ranks of one pipeline, one per
    stage, see the same): EP is carved out of the stage's data-parallel ranks, as in Megatron-Core and TorchTitan.
    Routed experts are split over the EP group (E/EP experts per rank); every other weight of a stage is sharded with
    FSDP2 over the stage's ranks; expert weights are sharded with FSDP2 over the DP ranks that hold the same experts.

    Attributes:
        pp: pipeline stages (ranks per pipeline).
        vpp: virtual stages (model chunks) per pipeline rank: > 1 needs "interleaved-1f1b"; the V schedules always
            hold 2 (1 or 2 accepted).
        pp_schedule: one of PP_SCHEDULES (ignored when pp == 1).
        pp_layout: Megatron pipeline layout (``E`` embedding, ``t`` layer, ``m`` MTP module, ``L`` head + loss, ``|``
            between virtual stages, ``*n`` repetition, e.g. "Ettt|tttmL"); None = layers split evenly, the
            embedding first, MTP and head last.
        ep: expert-parallel size; must divide the number of routed experts and DP x EP.
        dp: data-parallel size; 0 = world // (pp * ep).
        dispatcher: "auto" (local when ep == 1, else alltoall), "local", or "alltoall".
        capacity_factor: None = dropless (default); else tokens beyond ceil(cf * T * K / E) per expert are dropped.
        drop_policy: "probs" drops the lowest gate weights first, "position" the latest tokens first.
        pad_to_capacity: pad every expert's rows to its capacity (static shapes; needs capacity_factor).
        overlap: run the shared experts while the dispatch all-to-all is in flight (asynchronous collective).
        dedup: dropless all-to-all sends a token once to each EP rank holding any of its experts (with its gate
            weights and local expert ids), and gets back one gate-weighted sum per (token, rank), as DeepEP and
            Megatron-Core's flex dispatcher do; False sends one row per token-expert assignment. Capacity mode
            (capacity_factor set) always sends per assignment.
        dispatch_dtype: wire format of the dispatched token rows: "bf16" (the activations' dtype, BF16 under GPU
            mixed precision) or "fp8" (E4M3 with one fp32 scale per 1x128 tile, as DeepSeek-V3 dispatches; about
            half the bytes of BF16). The combine stays in high precision. Used by the alltoall dispatcher.
        n_chunks: split each micro-batch's tokens into this many chunks so one chunk's all-to-all overlaps another's
            expert GEMMs (1 = off).
        ep_overlap: pair micro-batch i+1's forward with micro-batch i's backward phase by phase, so every expert
            all-to-all (forward and backward) is in flight while the other micro-batch computes (Megatron-Core's
            combined 1F1B; ``moetrain.parallel.overlap``). Needs two or more micro-batches to pair; under pipelining
            the schedule's forward-backward pairs (1f1b, interleaved-1f1b, dualpipev's OVERLAP_F_B; not zbv); not
            with activation_checkpointing, n_chunks > 1 or overlap = false.
        activation_checkpointing: recompute each block in backward.
        timeout_s: collective timeout; a hang ends with an error naming the phase.
    """

    pp: int = 1
    vpp: int = 1
    pp_schedule: str = "1f1b"
    pp_layout: str | None = None
    ep: int = 1
    dp: int = 0
    dispatcher: DispatcherName = "auto"
    capacity_factor: float | None = None
    drop_policy: Literal["probs", "position"] = "probs"
    pad_to_capacity: bool = False
    overlap: bool = True
    dedup: bool = True
    dispatch_dtype: Literal["bf16", "fp8"] = "bf16"
    n_chunks: int = 1
    ep_overlap: bool = False
    activation_checkpointing: bool = False
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
        for name in ("pp", "vpp"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 1:
                raise ConfigError(f"parallel.{name}={v!r} must be an integer >= 1")
        if self.pp_schedule not in PP_SCHEDULES:
            raise ConfigError(f"parallel.pp_schedule={self.pp_schedule!r}; allowed: {', '.join(PP_SCHEDULES)}")
        if self.pp > 1 and self.vpp > 1 and self.pp_schedule == "1f1b":
            raise ConfigError(f"parallel.vpp={self.vpp} needs parallel.pp_schedule='interleaved-1f1b' (1f1b holds "
                              f"one stage per rank)")
        if self.pp_schedule in V_SCHEDULES and self.vpp > 2:
            raise ConfigError(f"parallel.pp_schedule={self.pp_schedule!r} holds exactly 2 stages per rank; "
                              f"parallel.vpp={self.vpp} (use 1 or 2)")
        if not isinstance(self.ep, int) or self.ep < 1:
            raise ConfigError(f"parallel.ep={self.ep!r} must be an integer >= 1")
        if not isinstance(self.dp, int) or self.dp < 0:
            raise ConfigError(f"parallel.dp={self.dp!r} must be an integer >= 0 (0 = world size / ep)")
        if self.dispatcher not in ("auto", "local", "alltoall"):
            raise ConfigError(f"parallel.dispatcher={self.dispatcher!r}; allowed: 'auto', 'local', 'alltoall'")
        if self.capacity_factor is not None and not self.capacity_factor > 0:
            raise ConfigError(f"parallel.capacity_factor={self.capacity_factor} must be > 0 (or unset for dropless)")
        if self.drop_policy not in ("probs", "position"):
            raise ConfigError(f"parallel.drop_policy={self.drop_policy!r}; allowed: 'probs', 'position'")
        if self.pad_to_capacity and self.capacity_factor is None:
            raise ConfigError("parallel.pad_to_capacity needs parallel.capacity_factor to be set")
        if not isinstance(self.dedup, bool):
            raise ConfigError(f"parallel.dedup={self.dedup!r} must be true or false")
        if self.dispatch_dtype not in ("bf16", "fp8"):
            raise ConfigError(f"parallel.dispatch_dtype={self.dispatch_dtype!r}; allowed: 'bf16', 'fp8'")
        if not isinstance(self.n_chunks, int) or self.n_chunks < 1:
            raise ConfigError(f"parallel.n_chunks={self.n_chunks!r} must be an integer >= 1")
        if not isinstance(self.ep_overlap, bool):
            raise ConfigError(f"parallel.ep_overlap={self.ep_overlap!r} must be true or false")
        if self.ep_overlap:
            clash = [f"parallel.{k}={v}" for k, v, bad in (
                ("pp_schedule", repr(self.pp_schedule), self.pp > 1 and self.pp_schedule == "zbv"),
                ("activation_checkpointing", "true", self.activation_checkpointing),
                ("n_chunks", self.n_chunks, self.n_chunks > 1), ("overlap", "false", not self.overlap)) if bad]
            if clash:
                raise ConfigError(
                    f"parallel.ep_overlap=true does not combine with {', '.join(clash)}: the paired schedule runs "
                    f"without recomputation or token chunks, with asynchronous all-to-alls (parallel.overlap=true), "
                    f"and under pipelining pairs the full backwards of 1f1b, interleaved-1f1b or dualpipev (zbv "
                    f"splits every backward); drop those settings or set parallel.ep_overlap=false")
        if not self.timeout_s > 0:
            raise ConfigError(f"parallel.timeout_s={self.timeout_s} must be > 0")

    @property
    def stages_per_rank(self) -> int:
        """Model chunks each pipeline rank holds: 2 for the V schedules, vpp otherwise (1 without pipelining)."""
        if self.pp == 1:
            return 1
        return 2 if self.pp_schedule in V_SCHEDULES else self.vpp

    @property
    def n_stages(self) -> int:
        return self.pp * self.stages_per_rank

    def resolve(self, world_size: int, n_routed_experts: int) -> "ParallelConfig":
        """Check the sizes against the world and the model; return a copy with dp filled in.

        Raises:
            ConfigError: pp does not divide the world, ep does not divide the experts or a stage's ranks, or
                pp * dp * ep != world.
        """
        if world_size % self.pp:
            raise ConfigError(f"world size {world_size} is not divisible by parallel.pp={self.pp}; launch a multiple "
                              f"of {self.pp} processes (--nproc) or change pp")
        stage = world_size // self.pp
        if n_routed_experts % self.ep:
            ok = [d for d in range(1, n_routed_experts + 1) if n_routed_experts % d == 0 and stage % d == 0]
            raise ConfigError(f"parallel.ep={self.ep} must divide the number of routed experts ({n_routed_experts});"
                              f" with {stage} ranks per pipeline stage the allowed ep values are {ok}")
        if stage % self.ep:
            raise ConfigError(f"{stage} ranks per pipeline stage (world {world_size} / pp {self.pp}) are not "
                              f"divisible by parallel.ep={self.ep}; launch a multiple of pp x ep = "
                              f"{self.pp * self.ep} processes or change ep")
        if self.dispatcher == "local" and self.ep > 1:
            raise ConfigError(f"parallel.dispatcher='local' cannot move tokens between parallel.ep={self.ep} ranks; "
                              f"use 'alltoall' or 'auto'")
        dp = self.dp or stage // self.ep
        if self.pp * dp * self.ep != world_size:
            raise ConfigError(f"parallel.pp={self.pp} x parallel.dp={dp} x parallel.ep={self.ep} = "
                              f"{self.pp * dp * self.ep} != world size {world_size}")
        from dataclasses import replace
        return replace(self, dp=dp)

    @property
    def dispatcher_kind(self) -> str:
        if self.dispatcher == "auto":
            return "local" if self.ep == 1 else "alltoall"
        return self.dispatcher
