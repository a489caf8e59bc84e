"""``parallelize(model, ctx)``: distribute a single-device model from outside, in one fixed order.

1. Expert parallelism: every MoE layer gets the configured dispatcher (local permutation, or the all-to-all one)
   with capacity, overlap and token deduplication settings, and its expert weights become DTensors of global shape
   (E, ...) sharded on the expert dim over the EP mesh (``Shard(0)``, as TorchTitan does): this rank stores El = E/EP
   experts, and the placement itself -- not a module attribute -- says which, so checkpoints save and reshard the
   experts without gathering them.
2. Chunked overlap: MoE layers split their tokens into ``n_chunks``.
3. Activation checkpointing of every block (main and MTP): full (the block from its input) or selective (the modules
   of ``parallel.recompute_modules``, :mod:`moetrain.model.recompute`), if asked.
4. FP8 primary weights (``parallel.fp8_param``): the weights of the FP8 GEMMs become FP8 masters
   (:mod:`moetrain.precision.primary_weights`), which FSDP2 all-gathers as FP8 bytes, quantised once per step.
5. FSDP2 ``fully_shard``: expert weights over the EDP mesh (ranks holding the same experts), then every block and the
   root over all ranks of the stage (the flattened edp x ep mesh: DP). Gradients are *summed*, not averaged (divide
   factor 1): the trainer normalises the loss by global token and sequence counts, so the summed gradient is the
   gradient of the global mean loss whatever the split over ranks and micro-batches. Expert weights receive every EP
   peer's tokens through the all-to-all backward, so summing over DP completes their sum over all tokens. On GPU a
   ``param_dtype`` (bf16) makes FSDP all-gather and compute in bf16 while reducing gradients in fp32.

The order matters: EP placement must precede sharding (FSDP shards what it is given), the FP8 masters must be in
place when FSDP2 shards (it looks for their all-gather extension then), and experts must be wrapped before their
block so their parameters leave the block's group.

``parallelize`` takes a materialised model (every rank built the same weights) or, for any model size, one built on
the meta device: then :func:`materialize` allocates only the local shards and initialises them with the
layout-independent init, so the weights equal a single process's.
"""

from __future__ import annotations

from typing import Any, Callable

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

from moetrain.errors import ConfigError
from moetrain.layout import Recompute
from moetrain.model.moe import CapacityConfig, LocalDispatcher
from moetrain.model.experts import GroupedExperts
from moetrain.model.recompute import set_recompute
from moetrain.model.transformer import Transformer, init_weights
from moetrain.parallel.comm import named_phase
from moetrain.parallel.dispatch import AllToAllDispatcher
from moetrain.parallel.mesh import ParallelContext
from moetrain.parallel.redundant import LayerReplicas
from moetrain.precision.primary_weights import ParamTraffic


def parallelize(model: Transformer, ctx: ParallelContext, param_dtype: torch.dtype | None = None) -> Transformer:
    """Apply expert parallelism, chunking, activation checkpointing and FSDP2 to ``model`` in place; returns it.

    Args:
        model: a whole model or one pipeline stage (``moetrain.model.stage.TransformerStage``: FSDP2 then shards
            over the stage's DP x EP ranks), on the meta device or materialised (identically on every rank).
        ctx: the parallel context.
        param_dtype: FSDP2 mixed precision (e.g. torch.bfloat16 on GPU): parameters are all-gathered and used in
            this dtype, gradients reduced in fp32; None keeps fp32 throughout (the CPU default).

    Raises:
        ValueError: the all-to-all dispatcher without a process group.
    """
    pcfg = ctx.pcfg
    capacity = CapacityConfig(pcfg.capacity_factor, pcfg.drop_policy, pcfg.pad_to_capacity)
    # At EP = 1 no token leaves the rank: an unset dispatcher is the local permutation there.
    kind = "alltoall" if pcfg.moves_tokens else "local"
    # 1. expert parallelism
    for m_idx, moe in zip(model.moe_indices(), model.moe_layers()):
        E = moe.gate.n_experts
        if kind == "alltoall":
            if not ctx.distributed:
                raise ValueError(f"dispatcher {pcfg.run_dispatcher!r} (the all-to-all) needs a process group; "
                                 f"launch with torchrun")
            moe.dispatcher = AllToAllDispatcher(E, pcfg.ep, ctx.ep_rank, ctx.ep_group, capacity, pcfg.overlap,
                                                pcfg.dedup, dispatch_dtype=pcfg.dispatch_precision.value)
            moe.dispatcher.layer = m_idx
            if pcfg.redundant_experts:
                edp = ctx.edp_mesh.get_group() if ctx.edp_mesh is not None else None
                moe.experts.replicas = moe.dispatcher.replicas = LayerReplicas(
                    E, pcfg.ep, ctx.ep_rank, pcfg.redundant_experts, pcfg.rebalance_every, ctx.ep_group, edp, m_idx)
        else:
            moe.dispatcher = LocalDispatcher(E, capacity)
        if ctx.distributed:
            place_experts(moe.experts, ctx)
        if ctx.distributed:
            moe.reduce_balance_counts = _stage_sum(ctx)
        if pcfg.node_limit_m is not None and pcfg.node_limit_m < pcfg.ep_nodes:
            moe.gate.node_limit = _node_limit(E, moe.gate.top_k, pcfg.ep_nodes, pcfg.node_limit_m)
        # 2. chunked overlap
        moe.n_chunks = pcfg.n_chunks
    # 3. activation checkpointing
    blocks = model.blocks()
    for block in blocks:
        block.recompute = pcfg.recompute == Recompute.FULL
        set_recompute(block, pcfg.recomputed_modules)
    # 4. FP8 primary weights: the FP8 GEMMs' weights wrapped as FP8 masters, so that FSDP2 gathers their FP8 bytes
    if pcfg.fp8_param:
        from moetrain.precision.apply import hold_weights_in_fp8
        hold_weights_in_fp8(model, ctx.param_traffic)
    # 5. FSDP2
    if ctx.distributed:
        from torch.distributed.fsdp import MixedPrecisionPolicy, fully_shard
        mp = MixedPrecisionPolicy(param_dtype=param_dtype, reduce_dtype=torch.float32) if param_dtype else None
        kw: dict[str, Any] = {"mp_policy": mp} if mp is not None else {}
        edp = ctx.edp_mesh.size()
        # Pipelined, a stage runs forward and backward of several micro-batches interleaved, and the zero-bubble
        # schedules compute weight gradients after the input gradients: parameters stay gathered from the first
        # forward to the end of the step (as TorchTitan does under PP), one all-gather per stage and step instead
        # of one per micro-batch and pass.
        # The same holds for EP overlap, whose backward is many autograd calls interleaved with another
        # micro-batch's forward (moetrain.parallel.overlap).
        # parallel.fsdp=false asks for the same at PP = 1 (Megatron's distributed-optimizer memory; the plain step
        # then also skips the reshard after each micro-batch's backward, moetrain.train.step).
        keep = pcfg.keeps_params_gathered
        for moe in model.moe_layers():
            # Several expert calls per forward when chunked: keep the experts gathered through the forward.
            fully_shard(moe.experts, mesh=ctx.edp_mesh, reshard_after_forward=pcfg.n_chunks == 1 and not keep,
                        shard_placement_fn=lambda p: expert_shard_dim(p.shape, edp), **kw)
        for block in blocks:
            fully_shard(block, mesh=ctx.fsdp_mesh, reshard_after_forward=not keep, **kw)
        # The root (embedding, final norm, output head, the MTP modules' own weights) stays gathered after forward,
        # as FSDP2 does for a root by default and TorchTitan does for its norm and output: the backward starts with
        # the output head and the loss, which would all-gather the same weights again at once.
        fully_shard(model, mesh=ctx.fsdp_mesh, reshard_after_forward=False, **kw)
        gather = CountingAllGather(ctx.param_traffic)
        for mod in model.modules():
            if hasattr(mod, "set_gradient_divide_factor"):
                mod.set_gradient_divide_factor(1.0)
                # Plain SUM collectives: gloo has no PREMUL_SUM, and a factor of 1 needs no scaling anyway.
                mod.set_force_sum_reduction_for_comms(True)
                mod.set_custom_all_gather(gather)
    return model


#: The single-tensor all-gather FSDP2's default uses: ``all_gather_single`` (torch 2.13, which deprecates the older
#: name), ``all_gather_into_tensor`` (torch 2.11, which has only it).
_ALL_GATHER = getattr(dist, "all_gather_single", dist.all_gather_into_tensor)


class CountingAllGather:
    """FSDP2's parameter all-gather (the contract of ``FSDPModule.set_custom_all_gather``: ``allocate`` and the
    call), the plain ``all_gather_into_tensor`` of its default, counting the bytes each call brings this rank into
    ``traffic.gathered_bytes`` (the metrics' ``param_gather_bytes_per_step``)."""

    def __init__(self, traffic: ParamTraffic) -> None:
        self.traffic = traffic

    def allocate(self, size: Any, *, dtype: torch.dtype, device: torch.device) -> torch.Tensor:
        return torch.empty(*size, dtype=dtype, device=device)

    def __call__(self, output_tensor: torch.Tensor, input_tensor: torch.Tensor, group: dist.ProcessGroup,
                 async_op: bool = False) -> Any:
        self.traffic.gathered_bytes += output_tensor.numel() * output_tensor.element_size()
        return _ALL_GATHER(output_tensor, input_tensor, group=group, async_op=async_op)


def _node_limit(n_experts: int, top_k: int, n_nodes: int, m: int) -> tuple[int, int]:
    """(nodes, M) of node-limited routing for the router: the EP placement puts E / nodes consecutive experts on
    each node.

    Raises:
        ConfigError: M nodes hold fewer than top_k experts.
    """
    if m * (n_experts // n_nodes) < top_k:
        raise ConfigError(f"parallel.node_limit_m={m}: {m} node(s) of {n_experts // n_nodes} experts each cannot "
                          f"hold a token's {top_k} experts; raise it to at least "
                          f"{-(-top_k // (n_experts // n_nodes))}")
    return n_nodes, m


def _stage_sum(ctx: ParallelContext) -> Callable[[torch.Tensor], torch.Tensor]:
    """Sum of a small detached tensor over this rank's pipeline stage (the data-parallel group: every rank that reads
    other tokens): the global-batch balance loss's expert counts (``moetrain.model.moe.batch_balance_loss``)."""
    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        with named_phase("global-batch balance-loss counts all-reduce"):
            dist.all_reduce(t, group=ctx.stage_group)
        return t
    return reduce


def expert_shard_dim(shape: tuple[int, ...], edp: int) -> Shard:
    """The dim FSDP2 shards a stacked expert weight (E, N, K) on over the EDP ranks holding the same experts: the
    first of dim 1 (2F or D) and dim 2 that EDP divides -- dim 0 is already split over EP, and FSDP2 refuses uneven
    shards of any dim but 0 -- else dim 0 (a strided split of the EP shard when EP > 1; uneven is allowed there,
    e.g. EDP = 3)."""
    for d in (1, 2):
        if shape[d] % edp == 0:
            return Shard(d)
    return Shard(0)


def place_experts(experts: GroupedExperts, ctx: ParallelContext) -> None:
    """Turn the expert weights into DTensors of global shape (E, ...) with ``Shard(0)`` over the EP mesh, keeping
    this rank's El experts (a slice of the given values, or meta storage when the model is on meta)."""
    place = ctx.expert_placement(experts.n_experts)
    for name, full in list(experts.named_parameters(recurse=False)):
        if isinstance(full, DTensor):
            raise ValueError(f"experts.{name} is already distributed; parallelize a model once")
        part = full.detach()[place.offset:place.offset + place.n_local]
        local = part if full.is_meta else part.clone()
        dt = DTensor.from_local(local, ctx.ep_mesh, [Shard(0)], run_check=False, shape=full.shape,
                                stride=full.stride())
        setattr(experts, name, nn.Parameter(dt, requires_grad=full.requires_grad))


def shard_box(t: torch.Tensor) -> tuple[tuple[int, ...], tuple[int, ...], torch.Tensor]:
    """(global shape, offsets of the local part in it, local part) of a DTensor or a plain tensor.

    Every placement moetrain uses (FSDP ``Shard``, EP ``Shard(0)``, their 2-D combination) keeps a rank's part a
    contiguous box of the global tensor.
    """
    if isinstance(t, DTensor):
        shape, offsets = compute_local_shape_and_global_offset(t.shape, t.device_mesh, t.placements)
        local = t.to_local()
        if tuple(local.shape) != tuple(shape):
            raise RuntimeError(f"local shard {tuple(local.shape)} != expected {tuple(shape)} for placements "
                               f"{t.placements}")
        return tuple(t.shape), tuple(offsets), local
    return tuple(t.shape), (0,) * t.dim(), t


def cast_parameters_(model: nn.Module, dtype: torch.dtype) -> nn.Module:
    """Hold every floating-point parameter of ``model`` in ``dtype`` (buffers, such as the expert biases, keep
    theirs), in place, before :func:`parallelize`: FSDP2 shards and all-gathers what it is given, so the held shards
    are then of ``dtype`` and its mixed-precision policy casts them to the compute dtype. Meant for a meta-device
    model (the trainer's ``bf16`` optimizer states); the name-seeded init then rounds its fp32 values into them.
    Shared parameters stay shared. Returns ``model``."""
    done: dict[int, nn.Parameter] = {}
    for mod in model.modules():
        for name, p in list(mod.named_parameters(recurse=False)):
            if not p.is_floating_point() or p.dtype == dtype:
                continue
            if id(p) not in done:
                done[id(p)] = nn.Parameter(p.detach().to(dtype), requires_grad=p.requires_grad)
            setattr(mod, name, done[id(p)])
    return model


def materialize(model: Transformer, ctx: ParallelContext, seed: int = 0) -> Transformer:
    """Allocate the local shards of a parallelized meta-device model on ``ctx.device`` and initialise them (name-
    seeded: the same values as :func:`~moetrain.model.transformer.build_model` in one process). Returns ``model``."""
    model.to_empty(device=ctx.device)
    init_weights(model, seed=seed, shard_box=shard_box)
    model.rope.clear()
    return model


def full_state_dict(model: Transformer, ctx: ParallelContext) -> dict[str, torch.Tensor]:
    """Gather every parameter and buffer to its full, unsharded single-process form (on every rank, CPU).

    Meant for tests and small models: it materialises the whole model on each rank (checkpoints and exports never
    call it).
    """
    out: dict[str, torch.Tensor] = {}
    for name, t in list(model.named_parameters()) + list(model.named_buffers()):
        t = t.detach()
        if isinstance(t, DTensor):
            t = t.full_tensor()
        out[name] = t.cpu().clone()
    return out


def local_tensor(t: Any) -> torch.Tensor:
    """The part of ``t`` stored on this rank (the local shard of a DTensor, else ``t``)."""
    return t.to_local() if isinstance(t, DTensor) else t


def local_numel(model: nn.Module) -> int:
    """Parameter elements stored on this rank."""
    return sum(local_tensor(p).numel() for p in model.parameters())
