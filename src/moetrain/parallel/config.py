"""Parallelism settings: how the world is split and how tokens move between expert-parallel ranks."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal

from moetrain.model.config import ConfigError

DispatcherName = Literal["auto", "local", "alltoall"]


@dataclass
class ParallelConfig:
    """World = DP x EP (room for PP and TP later).

    Every rank sees different data: EP is carved out of the data-parallel ranks, as in Megatron-Core and TorchTitan.
    Routed experts are split over the EP group (E/EP experts per rank); every other weight is sharded with FSDP2
    over all ranks; expert weights are sharded with FSDP2 over the DP ranks that hold the same experts.

    Attributes:
        ep: expert-parallel size; must divide the number of routed experts and the world size.
        dp: data-parallel size; 0 = world // ep.
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
        activation_checkpointing: recompute each block in backward.
        timeout_s: collective timeout; a hang ends with an error naming the phase.
    """

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
    activation_checkpointing: bool = False
    timeout_s: float = 300.0

    def __post_init__(self) -> None:
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
        if not self.timeout_s > 0:
            raise ConfigError(f"parallel.timeout_s={self.timeout_s} must be > 0")

    def resolve(self, world_size: int, n_routed_experts: int) -> "ParallelConfig":
        """Check the sizes against the world and the model; return a copy with dp filled in.

        Raises:
            ConfigError: ep does not divide the experts or the world, or dp * ep != world.
        """
        if n_routed_experts % self.ep:
            ok = [d for d in range(1, n_routed_experts + 1) if n_routed_experts % d == 0 and world_size % d == 0]
            raise ConfigError(f"parallel.ep={self.ep} must divide the number of routed experts ({n_routed_experts});"
                              f" with world size {world_size} the allowed ep values are {ok}")
        if world_size % self.ep:
            raise ConfigError(f"world size {world_size} is not divisible by parallel.ep={self.ep}; launch a multiple "
                              f"of {self.ep} processes or change ep")
        if self.dispatcher == "local" and self.ep > 1:
            raise ConfigError(f"parallel.dispatcher='local' cannot move tokens between parallel.ep={self.ep} ranks; "
                              f"use 'alltoall' or 'auto'")
        dp = self.dp or world_size // self.ep
        if dp * self.ep != world_size:
            raise ConfigError(f"parallel.dp={dp} x parallel.ep={self.ep} = {dp * self.ep} != world size {world_size}")
        from dataclasses import replace
        return replace(self, dp=dp)

    @property
    def dispatcher_kind(self) -> str:
        if self.dispatcher == "auto":
            return "local" if self.ep == 1 else "alltoall"
        return self.dispatcher
