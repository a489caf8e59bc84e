"""FP8 primary weights (``parallel.fp8_param``): the weights the FP8 GEMMs read are held in FP8, quantised once per
optimizer step, and FSDP2 all-gathers their FP8 bytes.

Without it every FP8 GEMM quantises its weight from the all-gathered high-precision copy (bf16 on a GPU), once per
call: the fprop and the dgrad of each micro-batch, and FSDP moves 2 bytes (bf16) or 4 (fp32) per weight element.
With it (Megatron-Core's ``--fp8-param-gather``, DeepSeek-V3 report sec. 3.3; TorchTitan's FP8 all-gather through
torchao's ``WeightWithDynamicFloat8CastTensor``):

1. :class:`Fp8MasterWeight` wraps the local shard of each FP8-eligible weight (the fp32 master, or the bf16 weight
   of the ``bf16`` optimizer states) that FSDP2 holds; the optimizer updates it as any tensor.
2. Before an all-gather, FSDP2 calls its ``fsdp_pre_all_gather`` (torch's documented extension point of
   ``fully_shard``): the shard is cast to FSDP's ``param_dtype`` (what the GEMMs would have quantised), the largest
   magnitude of each of the *full* weight's tiles over the shard's elements is taken, one MAX all-reduce over the
   shard's FSDP group gives every rank every tile's maximum (a tile may straddle two ranks' shards: the maximum is
   the whole tile's either way, exactly), and the shard is quantised with those scales -- bit for bit its part of
   the full weight quantised in one piece. The result is kept until the shard next changes (its version counter:
   an optimizer step, a checkpoint load), so a weight is quantised and its maxima reduced once per optimizer step
   however many times it is gathered. Only the FP8 bytes are gathered.
3. ``fsdp_post_all_gather`` gives the module a :class:`Fp8HeldWeight` of the full shape: the gathered FP8 data and
   the scales, which the FP8 GEMMs (``precision.linear``, ``precision.grouped``) read through
   :func:`weight_operand` instead of quantising. Its gradient is an ordinary tensor of ``param_dtype``, which FSDP2
   reduce-scatters as before.

Numerics: the held tile is the weight's fprop tile (``held_tile``). Where the backward's dgrad reads the weight in
the same tiles (the blockwise recipe's 128x128 linear weights) the losses equal FP8 without ``fp8_param`` bit for
bit. Where it reads the other orientation -- the mxfp8 recipe's 32x1 weight tiles, the blockwise recipe's routed
experts (one scale per weight column) -- the dgrad operand is quantised a second time from the held FP8 values
(the high-precision weight is not gathered), as an FP8 weight held in one orientation must be: a second rounding,
named in docs/fp8.md and measured against FP8 without ``fp8_param`` (tests/precision/test_primary_weights.py).

Without FSDP (one process, no process group) the master itself is the module's weight and :func:`weight_operand`
quantises it once per optimizer step (same cache), so one process computes what the sharded run computes.

Shape legend: N out-features (rows), K in-features, E experts of a stacked expert weight (E, N, K).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch
import torch.distributed as dist
from torch.utils import _pytree as pytree

from moetrain.precision.gemm import Operand, operand
from moetrain.precision.quant import (E8M0_BIAS, FP8_DTYPE, Quantized, ScaleFormat, block_tile_amax,
                                      quantise_block, scales_from_amax)


@dataclass
class ParamTraffic:
    """Bytes this rank received for the parameters since the last :meth:`reset`: ``gathered_bytes`` by FSDP2's
    all-gathers (counted by the trainer's all-gather, ``moetrain.parallel.parallelize``), ``scale_bytes`` by the FP8
    weights' exchange of tile maxima (the size of each reduced tensor)."""

    gathered_bytes: int = 0
    scale_bytes: int = 0

    def total(self) -> int:
        return self.gathered_bytes + self.scale_bytes

    def reset(self) -> None:
        self.gathered_bytes = self.scale_bytes = 0


@dataclass(frozen=True)
class HeldFormat:
    """How a weight is held: ``tile`` over its last two dims (the fprop tile of its GEMM) and the scale ``fmt``."""

    tile: tuple[int, int]
    fmt: ScaleFormat


#: Ops whose results stay FP8 master shards: what FSDP2 does to a shard when it pads, views, moves or copies it,
#: and ``materialize``'s allocation (the list torchao keeps for its FP8 all-gather tensor, plus ``alias``). Every other
#: op -- the optimizer's arithmetic, norms, collectives -- sees the plain tensor and returns plain results.
_KEEP = {
    torch.ops.aten.empty_like.default, torch.ops.aten.new_zeros.default, torch.ops.aten.new_empty.default,
    torch.ops.aten.slice.Tensor, torch.ops.aten.copy_.default, torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default, torch.ops.aten._to_copy.default, torch.ops.aten._pin_memory.default,
    torch.ops.aten.split.Tensor, torch.ops.aten.clone.default, torch.ops.aten.alias.default,
}


#: The ops of :data:`_KEEP` whose result shares the argument's storage.
_ALIASING = {
    torch.ops.aten.slice.Tensor, torch.ops.aten.copy_.default, torch.ops.aten.view.default,
    torch.ops.aten.as_strided.default, torch.ops.aten.split.Tensor, torch.ops.aten.alias.default,
}


class _ShardState:
    """Writes so far to one storage of an FP8 master shard (through any of its views), and where its scale
    exchange is counted."""

    def __init__(self, traffic: ParamTraffic | None = None) -> None:
        self.writes = 0
        self.traffic = traffic


class Fp8MasterWeight(torch.Tensor):
    """The local shard of a weight held in FP8 for its GEMMs: a wrapper of the shard ``inner`` (same shape, dtype
    and device) that FSDP2 all-gathers as FP8 (module docstring).

    Attributes:
        inner: the shard's own tensor (what the optimizer updates and checkpoints store).
        held: how the weight is quantised (:class:`HeldFormat`).
    """

    inner: torch.Tensor
    held: HeldFormat

    @staticmethod
    def __new__(cls, inner: torch.Tensor, held: HeldFormat, state: "_ShardState | None" = None
                ) -> "Fp8MasterWeight":
        return torch.Tensor._make_wrapper_subclass(
            cls, inner.size(), strides=inner.stride(), storage_offset=inner.storage_offset(), dtype=inner.dtype,
            layout=inner.layout, device=inner.device, requires_grad=inner.requires_grad)

    def __init__(self, inner: torch.Tensor, held: HeldFormat, state: "_ShardState | None" = None) -> None:
        self.inner = inner
        self.held = held
        # shared by every view of the same storage: a write through any of them makes the FP8 copy stale
        self._state = state if state is not None else _ShardState()
        self._cache: tuple[Any, ...] | None = None

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Fp8MasterWeight({self.inner!r}, tile={self.held.tile}, fmt={self.held.fmt})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        # Ops run here below autograd, so the inner tensor's version counter does not see the writes: count them
        # from the op's schema (every argument the op writes to).
        for i, a in enumerate(func._schema.arguments):
            if a.alias_info is not None and a.alias_info.is_write:
                v = kwargs.get(a.name, args[i] if i < len(args) and not a.kwarg_only else None)
                for t in pytree.tree_leaves(v):
                    if isinstance(t, Fp8MasterWeight):
                        t._state.writes += 1
        first = next(t for t in pytree.tree_leaves((args, kwargs)) if isinstance(t, Fp8MasterWeight))
        if func is torch.ops.aten.detach.default:
            return Fp8MasterWeight(first.inner.detach(), first.held, first._state)
        args, kwargs = pytree.tree_map_only(Fp8MasterWeight, lambda t: t.inner, (args, kwargs))
        out = func(*args, **kwargs)
        if func not in _KEEP:
            return out
        # views (and copy_'s result, its destination) share the storage and so the state; new tensors get their own
        state = first._state if func in _ALIASING else _ShardState(first._state.traffic)
        return pytree.tree_map_only(torch.Tensor, lambda t: Fp8MasterWeight(t, first.held, state), out)

    def __tensor_flatten__(self) -> tuple[list[str], HeldFormat]:
        return ["inner"], self.held

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], held: HeldFormat, outer_size: Any,
                             outer_stride: Any) -> "Fp8MasterWeight":
        return Fp8MasterWeight(inner["inner"], held)

    # -- quantisation, once per change of the shard ------------------------------------------------------------

    def _quantised(self, dtype: torch.dtype | None, full_shape: tuple[int, ...], offset: tuple[int, ...],
                   group: Any) -> tuple[torch.Tensor, torch.Tensor]:
        """(FP8 data of this shard, the full weight's scales), cached until the shard changes. ``group``: the
        process group whose shards make up the full weight (None: this shard is the whole weight)."""
        key = (self._state.writes, dtype, full_shape, offset)
        if self._cache is not None and self._cache[0] == key:
            return self._cache[1], self._cache[2]
        x = self.inner.detach()
        if dtype is not None and x.dtype != dtype:
            x = x.to(dtype)
        tile, fmt = self.held.tile, self.held.fmt
        amax = block_tile_amax(x, tile, full_shape, offset)
        scale = _exchange_scales(amax, fmt, group, self._state.traffic)
        data = quantise_block(x, tile, scale, full_shape, offset)
        self._cache = (key, data, scale)
        return data, scale

    def quantised(self) -> Quantized:
        """This (whole, unsharded) weight in FP8, quantised once per change (the one-process path)."""
        shape = tuple(self.shape)
        data, scale = self._quantised(None, shape, (0,) * len(shape), None)
        return Quantized(data, scale, self.held.tile, self.held.fmt)

    # -- FSDP2's all-gather extension (torch.distributed.fsdp.fully_shard) -------------------------------------------

    def fsdp_pre_all_gather(self, mesh: Any, outer_size: torch.Size, outer_stride: tuple[int, ...], module: Any,
                            mp_policy: Any) -> tuple[tuple[torch.Tensor, ...], Any]:
        """This shard's FP8 bytes (uint8, padded to FSDP's shard size on dim 0), and as metadata the full weight's
        scales (identical on every rank of ``mesh``) and shape. Torch's signature; called by FSDP2 before each
        all-gather of the weight."""
        full = tuple(outer_size)
        world, rank = mesh.size(), mesh.get_local_rank()
        dim = next((d for d in range(len(full)) if self.shape[d] != full[d]), 0)
        per = -(-full[dim] // world) if dim == 0 else full[dim] // world
        offset = tuple(min(rank * per, full[d]) if d == dim else 0 for d in range(len(full)))
        dtype = mp_policy.param_dtype if mp_policy is not None else None
        # a group of one has nothing to exchange (FSDP2 moves nothing for it either)
        data, scale = self._quantised(dtype, full, offset, mesh.get_group() if world > 1 else None)
        data = data.view(torch.uint8)
        if dim == 0 and data.shape[0] < per:  # FSDP2 gathers equal shards: pad the last ones' rows
            data = torch.cat([data, data.new_zeros(per - data.shape[0], *data.shape[1:])])
        return (data,), (scale, full)

    def fsdp_post_all_gather(self, all_gather_outputs: tuple[torch.Tensor, ...], metadata: Any,
                             param_dtype: torch.dtype, *, out: torch.Tensor | None = None
                             ) -> tuple[torch.Tensor, tuple[torch.Tensor, ...]] | None:
        """The full weight as a :class:`Fp8HeldWeight` over the gathered bytes (or, with ``out``, the one FSDP2
        made at the first all-gather, updated with this gather's scales). Torch's signature."""
        (gathered,) = all_gather_outputs
        scale, full = metadata
        numel = 1
        for s in full:
            numel *= s
        data = gathered.view(-1).narrow(0, 0, numel).view(full).view(FP8_DTYPE)
        if out is not None:
            held = _held(out)
            held.q.data, held.q.scale = data, scale
            return None
        q = Quantized(data, scale, self.held.tile, self.held.fmt)
        return Fp8HeldWeight(q, param_dtype, self.requires_grad), (gathered,)


def _exchange_scales(amax: torch.Tensor, fmt: ScaleFormat, group: Any, traffic: ParamTraffic | None) -> torch.Tensor:
    """The full weight's tile scales from this rank's partial tile maxima ``amax`` (zero where it holds nothing),
    reduced with MAX over ``group`` (None: no exchange). A scale is a non-decreasing function of its maximum, so
    E8M0 scales are exchanged as their one-byte exponents (a NaN tile as 255, E8M0's NaN), a quarter of the fp32
    maxima's bytes; fp32 scales (``amax / 448``, 1 for a zero tile) as the maxima themselves."""
    if group is None:
        return scales_from_amax(amax, fmt)
    if fmt == "e8m0":
        scale = scales_from_amax(amax, fmt)
        bits = torch.where(torch.isnan(scale), torch.full_like(scale, 255.0),
                           torch.frexp(scale)[1].float() - 1 + E8M0_BIAS).to(torch.uint8)
        dist.all_reduce(bits, op=dist.ReduceOp.MAX, group=group)
        if traffic is not None:
            traffic.scale_bytes += bits.numel()
        b = bits.to(torch.int32)
        return torch.where(b == 255, torch.full_like(scale, float("nan")),
                           torch.ldexp(torch.ones_like(scale), b - E8M0_BIAS))
    dist.all_reduce(amax, op=dist.ReduceOp.MAX, group=group)
    if traffic is not None:
        traffic.scale_bytes += amax.numel() * amax.element_size()
    return scales_from_amax(amax, fmt)


class Fp8HeldWeight(torch.Tensor):
    """A full weight held in FP8 for the GEMMs (FSDP2's unsharded parameter under ``fp8_param``): shape and
    ``dtype`` are the weight's (the dtype its gradient has, FSDP's ``param_dtype``); ``q`` the FP8 data and scales.

    Views of it share ``q`` (FSDP updates ``q`` in place at each all-gather). An op other than a view or detach sees
    the dequantised values (the FP8-rounded weight in ``dtype``), so code that reads a weight as a tensor still
    works; the FP8 GEMMs read ``q`` through :func:`weight_operand`.
    """

    q: Quantized

    @staticmethod
    def __new__(cls, q: Quantized, dtype: torch.dtype, requires_grad: bool = False) -> "Fp8HeldWeight":
        shape = q.data.shape
        return torch.Tensor._make_wrapper_subclass(cls, shape, dtype=dtype, device=q.data.device,
                                                   requires_grad=requires_grad)

    def __init__(self, q: Quantized, dtype: torch.dtype, requires_grad: bool = False) -> None:
        self.q = q

    def __repr__(self) -> str:  # type: ignore[override]
        return f"Fp8HeldWeight(shape={tuple(self.shape)}, dtype={self.dtype}, tile={self.q.tile}, fmt={self.q.fmt})"

    @classmethod
    def __torch_dispatch__(cls, func: Any, types: Any, args: tuple = (), kwargs: dict | None = None) -> Any:
        kwargs = kwargs or {}
        first = args[0]
        if func in _SAME_WEIGHT and isinstance(first, Fp8HeldWeight) and _same_shape(func, first, args, kwargs):
            return Fp8HeldWeight(first.q, first.dtype)
        args, kwargs = pytree.tree_map_only(Fp8HeldWeight, lambda t: t.q.dequantise(t.dtype), (args, kwargs))
        return func(*args, **kwargs)

    def __tensor_flatten__(self) -> tuple[list[str], Any]:
        return ["_data", "_scale"], (self.q.tile, self.q.fmt, self.dtype)

    @property
    def _data(self) -> torch.Tensor:
        return self.q.data

    @property
    def _scale(self) -> torch.Tensor:
        return self.q.scale

    @staticmethod
    def __tensor_unflatten__(inner: dict[str, torch.Tensor], meta: Any, outer_size: Any,
                             outer_stride: Any) -> "Fp8HeldWeight":
        tile, fmt, dtype = meta
        return Fp8HeldWeight(Quantized(inner["_data"], inner["_scale"], tile, fmt), dtype)


#: Ops that give the same weight back (FSDP2's ``as_strided`` to the parameter's shape, ``nn.Parameter``'s detach,
#: ``DTensor.to_local``'s view).
_SAME_WEIGHT = {torch.ops.aten.detach.default, torch.ops.aten.alias.default, torch.ops.aten.view.default,
                torch.ops.aten.as_strided.default, torch.ops.aten._unsafe_view.default}


def _same_shape(func: Any, t: torch.Tensor, args: tuple, kwargs: dict) -> bool:
    if func in (torch.ops.aten.detach.default, torch.ops.aten.alias.default):
        return True
    size = args[1] if len(args) > 1 else kwargs.get("size")
    if size is None or tuple(size) != tuple(t.shape):
        return False
    if func is torch.ops.aten.as_strided.default:
        offset = args[3] if len(args) > 3 else kwargs.get("storage_offset", 0)
        return not offset
    return True


def _held(t: torch.Tensor) -> Fp8HeldWeight:
    from torch.distributed.tensor import DTensor

    inner = t._local_tensor if isinstance(t, DTensor) else t
    if not isinstance(inner, Fp8HeldWeight):
        raise TypeError(f"expected FSDP's FP8 parameter, got {type(inner).__name__}")
    return inner


def held_quantised(w: torch.Tensor) -> Quantized | None:
    """The FP8 copy of the weight ``w`` the GEMMs read, if it is held in FP8 (an :class:`Fp8HeldWeight` under FSDP,
    an :class:`Fp8MasterWeight` on one process), else None."""
    if isinstance(w, Fp8HeldWeight):
        return w.q
    if isinstance(w, Fp8MasterWeight):
        return w.quantised()
    return None


def weight_operand(w: torch.Tensor, tile: tuple[int, int], fmt: ScaleFormat, kernel: bool) -> Operand:
    """The weight ``w`` as a GEMM operand in ``tile`` (``gemm.operand``'s contract: FP8 data and scales for a kernel,
    else their fp32 values). A weight held in FP8 in that tile is used as held (no quantisation); held in another
    tile, it is quantised from its held FP8 values (the second quantisation of the module docstring); otherwise
    ``gemm.operand`` quantises ``w``."""
    q = held_quantised(w)
    if q is None:
        return operand(w, tile, fmt, kernel)
    if tuple(q.tile) == tuple(tile) and q.fmt == fmt:
        return q if kernel else q.dequantise()
    return operand(q.dequantise(), tile, fmt, kernel)


def weight_source(w: torch.Tensor) -> torch.Tensor:
    """What a quantisation of ``w`` in another tile reads: the held FP8 values (fp32) of a weight held in FP8,
    else ``w``."""
    q = held_quantised(w)
    return w if q is None else q.dequantise()


def hold_in_fp8(t: torch.Tensor, held: HeldFormat, traffic: ParamTraffic | None = None) -> torch.Tensor:
    """``t`` (a plain tensor or a DTensor, e.g. an EP-sharded expert weight) with its local part wrapped as an
    :class:`Fp8MasterWeight`; the same storage. ``traffic`` counts its scale exchange. Raises TypeError if it is
    held already."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor):
        local = t.to_local()
        if isinstance(local, Fp8MasterWeight):
            raise TypeError("the weight is held in FP8 already")
        return DTensor.from_local(Fp8MasterWeight(local, held, _ShardState(traffic)), t.device_mesh, t.placements,
                                  run_check=False, shape=t.shape, stride=t.stride())
    if isinstance(t, Fp8MasterWeight):
        raise TypeError("the weight is held in FP8 already")
    return Fp8MasterWeight(t, held, _ShardState(traffic))


def unwrapped(t: Any) -> Any:
    """``t`` with an FP8 master's wrapper taken off (the same storage, as a plain tensor or a DTensor of plain local
    tensors), what checkpoints save and load in place; anything else as it is. A write into the result bypasses
    the wrapper: call :func:`note_written` on ``t`` after it."""
    from torch.distributed.tensor import DTensor

    if isinstance(t, DTensor) and isinstance(t._local_tensor, Fp8MasterWeight):
        return DTensor.from_local(t._local_tensor.inner, t.device_mesh, t.placements, run_check=False,
                                  shape=t.shape, stride=t.stride())
    return t.inner if isinstance(t, Fp8MasterWeight) else t


def note_written(t: Any) -> None:
    """Mark the FP8 copy of ``t`` (an FP8 master, or a DTensor of one) stale after a write that bypassed the
    wrapper (:func:`unwrapped`); a no-op for any other tensor."""
    from torch.distributed.tensor import DTensor

    local = t._local_tensor if isinstance(t, DTensor) else t
    if isinstance(local, Fp8MasterWeight):
        local._state.writes += 1
