"""``parallelize(model, ctx)``: distribute a single-device model from outside, in one fixed order.

1. Expert parallelism: every GroupedExperts keeps only its EP rank's slice of El = E/EP experts, and every MoE layer
   gets the configured dispatcher (local permutation, or the all-to-all one) with capacity, overlap and token
   deduplication settings.
2. Chunked overlap: MoE layers split their tokens into ``n_chunks``.
3. Activation checkpointing of every block (main and MTP), if asked.
4. FSDP2 ``fully_shard``: expert weights over the DP group (ranks holding the same experts), then every block and the
   root over all ranks. Gradients are *summed*, not averaged (divide factor 1): the trainer normalises the loss by
   global token and sequence counts, so the summed gradient is the gradient of the global mean loss whatever the
   split over ranks and micro-batches. Expert weights receive every EP peer's tokens through the all-to-all backward,
   so summing over DP completes their sum over all tokens.

The order matters: slicing must precede sharding (FSDP shards what it is given), and experts must be wrapped before
their block so their parameters leave the block's (world-sharded) group.
"""

from __future__ import annotations

from typing import Any

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor

from moetrain.model.moe import CapacityConfig, GroupedExperts, LocalDispatcher
from moetrain.model.transformer import Transformer
from moetrain.parallel.dispatch import AllToAllDispatcher
from moetrain.parallel.mesh import ParallelContext


def parallelize(model: Transformer, ctx: ParallelContext) -> Transformer:
    """Apply expert parallelism, chunking, activation checkpointing and FSDP2 to ``model`` in place; returns it.

    Raises:
        ValueError: the "local" dispatcher asked for with EP > 1.
    """
    pcfg = ctx.pcfg
    capacity = CapacityConfig(pcfg.capacity_factor, pcfg.drop_policy, pcfg.pad_to_capacity)
    kind = pcfg.dispatcher_kind
    if kind == "local" and pcfg.ep > 1:
        raise ValueError(f"dispatcher 'local' cannot move tokens between EP={pcfg.ep} ranks; use 'alltoall'")
    # 1. expert parallelism
    for moe in model.moe_layers():
        E = moe.gate.n_experts
        if kind == "alltoall":
            if not ctx.distributed:
                raise ValueError("dispatcher 'alltoall' needs a process group; launch with torchrun")
            moe.dispatcher = AllToAllDispatcher(E, pcfg.ep, ctx.ep_rank, ctx.ep_group, capacity, pcfg.overlap,
                                                pcfg.dedup)
        else:
            moe.dispatcher = LocalDispatcher(E, capacity)
        _keep_local_experts(moe.experts, moe.dispatcher.local_expert_offset, moe.dispatcher.n_local_experts)
        # 2. chunked overlap
        moe.n_chunks = pcfg.n_chunks
    # 3. activation checkpointing
    blocks = list(model.layers) + [m.block for m in model.mtp]
    for block in blocks:
        block.recompute = pcfg.activation_checkpointing
    # 4. FSDP2
    if ctx.distributed:
        from torch.distributed.fsdp import fully_shard
        dp_mesh = ctx.ep_mesh["dp"]
        for moe in model.moe_layers():
            # Several calls per forward when chunked: keep the experts gathered through the forward.
            fully_shard(moe.experts, mesh=dp_mesh, reshard_after_forward=pcfg.n_chunks == 1)
        for block in blocks:
            fully_shard(block, mesh=ctx.world_mesh)
        fully_shard(model, mesh=ctx.world_mesh)
        for mod in model.modules():
            if hasattr(mod, "set_gradient_divide_factor"):
                mod.set_gradient_divide_factor(1.0)
                # Plain SUM collectives: gloo has no PREMUL_SUM, and a factor of 1 needs no scaling anyway.
                mod.set_force_sum_reduction_for_comms(True)
    return model


def _keep_local_experts(experts: GroupedExperts, offset: int, n_local: int) -> None:
    if n_local == experts.n_experts:
        return
    for name, full in list(experts.named_parameters(recurse=False)):
        setattr(experts, name, nn.Parameter(full.detach()[offset:offset + n_local].clone()))
    experts.n_experts = n_local


def is_expert_param(name: str) -> bool:
    return ".experts.w" in name


def full_state_dict(model: Transformer, ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """Gather every parameter and buffer to its full, unsharded single-process form (on every rank, CPU).

    FSDP shards are all-gathered; expert slices are concatenated over the EP group in expert order.
    Meant for tests, exports and small models: it materialises the whole model on each rank.
    """
    out: dict[str, torch.Tensor] = {}
    items = list(model.named_parameters()) + list(model.named_buffers())
    for name, t in items:
        t = t.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        if is_expert_param(name) and ctx.distributed and ctx.pcfg.ep > 1:
            parts = [torch.empty_like(t) for _ in range(ctx.pcfg.ep)]
            dist.all_gather(parts, t.contiguous(), group=ctx.ep_group)
            t = torch.cat(parts, dim=0)
        out[name] = t.cpu().clone()
    return out


def local_tensor(t: Any) -> torch.Tensor:
    """The part of ``t`` stored on this rank (the local shard of a DTensor, else ``t``)."""
    return t.to_local() if isinstance(t, DTensor) else t
