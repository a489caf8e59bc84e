"""Selective recompute: the activations of chosen modules are dropped after the forward and recomputed in the
backward (Megatron-Core ``--recompute-granularity selective --recompute-modules``; the names and meanings of
:class:`moetrain.layout.RecomputeModule`).

Two mechanisms, both torch's own:

* :func:`checkpointed` -- ``torch.utils.checkpoint`` (non-reentrant) around a module's forward: the module keeps its
  inputs and recomputes everything inside it (``core_attn``, ``mlp``, ``shared_experts``, ``moe``; the insides of
  the norms and of the expert SwiGLU).
* :class:`DroppedOutputs` -- for a module whose *output* is what costs memory because the next module saves it (an
  RMSNorm's output saved by the projections after it; MLA's up-projected q / k / v saved by RoPE and the attention
  kernel; the expert SwiGLU's output saved by the down projection): ``torch.autograd.graph.saved_tensors_hooks``
  around producer and consumers replace every saved view of those outputs by a token, and the backward's first
  read recomputes them once from the producer's inputs (Megatron-Core's ``CheckpointWithoutOutput`` does the same
  with storage tricks). ``layernorm``, ``mla_up_proj`` and ``moe_act`` use it. A checkpoint's own inputs are saved
  through the same hooks, so a checkpointed consumer of a dropped output does not keep it either.

Recomputation replays the same operations on the same inputs under the forward's autocast state and phase-tape
state (:func:`moetrain.model.phases.replaying`), so losses and gradients are bit-identical to keeping the activations
(tested at EP 2 with EP overlap and under every pipeline schedule). The model code stays single-device:
``moetrain.parallel.parallelize`` hands each block the set of modules through :func:`set_recompute`.
"""

from __future__ import annotations

from contextlib import nullcontext
from typing import Any, Callable

import torch
import torch.utils.checkpoint
from torch import nn

from moetrain.layout import RecomputeModule
from moetrain.model.phases import replaying, tape_recording


def checkpointed(fn: Callable[..., Any], *args: Any) -> Any:
    """``fn(*args)``, recomputed in the backward when gradients are recorded (non-reentrant ``torch.utils.
    checkpoint``: RNG and autocast state restored, outputs of any structure); plain ``fn(*args)`` otherwise. The
    recomputation runs as the forward did under a phase tape (:func:`moetrain.model.phases.replaying`)."""
    if not torch.is_grad_enabled():
        return fn(*args)
    recorded = tape_recording()
    return torch.utils.checkpoint.checkpoint(fn, *args, use_reentrant=False,
                                             context_fn=lambda: (nullcontext(), replaying(recorded)))


class DroppedOutputs:
    """Outputs whose saved copies are dropped and recomputed in the backward (Megatron's ``CheckpointWithoutOutput``,
    on ``torch.autograd.graph.saved_tensors_hooks``).

    Use as a context manager around the producer and its consumers; :meth:`add` each output as it is produced.
    While the block runs, a tensor saved for backward that is a view of an added output's storage is replaced by a
    token; the backward's first read of any of them calls ``recompute()`` once (under the autocast state the block
    started in, without gradients) and reads the same view of its result. The producer must keep what ``recompute``
    needs (its inputs), and ``recompute()`` returns the added outputs again, in the order added, with the same
    shapes, strides and values. Outside gradient recording (or on the meta device) nothing is dropped.

    Args:
        recompute: returns a tuple of tensors equal to the outputs added, in order.
    """

    def __init__(self, recompute: Callable[[], tuple[torch.Tensor, ...]]):
        self.recompute = recompute
        self.storages: list[tuple[str, int, int]] = []  # (device type, data_ptr, nbytes) of each added output
        # The added outputs, alive until the block ends: once their saved views are tokens, nothing else may hold
        # them, and a freed storage's address could be reused by another tensor of the block and mistaken for one.
        self.held: list[torch.Tensor] = []
        self.cell: list[tuple[torch.Tensor, ...]] = []
        self._hooks: Any = None
        self._autocast: dict[str, tuple[bool, torch.dtype]] = {}
        self._recorded = False

    def add(self, out: torch.Tensor) -> torch.Tensor:
        """Register ``out`` (returned as is); views of it saved from now on in the block are dropped."""
        if self._hooks is not None and out.device.type != "meta":
            st = out.untyped_storage()
            self.storages.append((out.device.type, st.data_ptr(), st.nbytes()))
            self.held.append(out)
            self._autocast.setdefault(out.device.type, (torch.is_autocast_enabled(out.device.type),
                                                        torch.get_autocast_dtype(out.device.type)))
        return out

    def _pack(self, t: torch.Tensor) -> Any:
        # plain tensors only: parameters (and tensor subclasses) are never an output
        if type(t) is not torch.Tensor or not self.storages:
            return t
        st = t.untyped_storage()
        key = (t.device.type, st.data_ptr(), st.nbytes())
        if key not in self.storages:
            return t
        return (self.storages.index(key), tuple(t.shape), t.stride(), t.storage_offset(), t.dtype)

    def _unpack(self, packed: Any) -> torch.Tensor:
        if isinstance(packed, torch.Tensor):
            return packed
        i, shape, stride, offset, dtype = packed
        if not self.cell:
            device = self.storages[i][0]
            enabled, dtype_ac = self._autocast[device]
            with torch.no_grad(), torch.autocast(device, dtype=dtype_ac, enabled=enabled), replaying(self._recorded):
                self.cell.append(tuple(t.detach() for t in self.recompute()))
        base = self.cell[0][i]
        return base.as_strided(shape, stride, offset) if base.dtype == dtype else base.view(dtype).as_strided(
            shape, stride, offset)

    def __enter__(self) -> "DroppedOutputs":
        if torch.is_grad_enabled():
            self._recorded = tape_recording()
            self._hooks = torch.autograd.graph.saved_tensors_hooks(self._pack, self._unpack)
            self._hooks.__enter__()
        return self

    def __exit__(self, *exc: Any) -> None:
        if self._hooks is not None:
            self._hooks.__exit__(*exc)
        self.held = []


def set_recompute(module: nn.Module, modules: frozenset[RecomputeModule]) -> None:
    """Switch selective recompute of ``modules`` on (or, with an empty set, off) in every submodule of ``module``
    that has a part of it: each holds the set in its ``recompute_modules`` attribute and reads what concerns it."""
    for m in module.modules():
        if isinstance(m, Recomputable):
            m.recompute_modules = modules


class Recomputable:
    """Mixin of the modules selective recompute reaches into (blocks, attention, MoE, experts): the set of
    :class:`~moetrain.layout.RecomputeModule` to recompute, empty by default."""

    recompute_modules: frozenset[RecomputeModule] = frozenset()
