"""Where moetrain adapts to differences between the torch versions it supports (2.11 to 2.13).

Each adapter names the versions and the behaviour it bridges, and reaches torch internals only where no public API
exists; the tests that exercise it run on every supported version (CI runs the suite on the oldest and the newest).
Differences that the model's own contract absorbs live with the contract instead: FSDP2 module outputs are tuples
and NamedTuples (``moetrain.model.transformer.ModelOutput``), and pipeline stages send only floating-point tensors
(``moetrain.model.stage``).
"""

from __future__ import annotations

import inspect
from typing import Any

import torch
import torch.distributed as dist


def fsdp_param_groups(state: Any) -> list[Any]:
    """The FSDP2 parameter groups of one ``FSDPState``.

    torch 2.13 keeps a list (``_fsdp_param_groups``: several with per-parameter meshes); torch 2.11 one group or
    None (``_fsdp_param_group``). Both attributes are private, and FSDP2 offers no public way to reduce and reshard
    the gradients of a backward split into many autograd calls (``moetrain.parallel.overlap``).
    """
    groups = getattr(state, "_fsdp_param_groups", None)
    if groups is not None:
        return list(groups)
    group = state._fsdp_param_group
    return [group] if group is not None else []


def without_self_p2p_warmup(stage_cls: type) -> type:
    """A ``PipelineStage`` subclass whose communicator warm-up leaves out the stage next to it on the same rank.

    torch 2.11's multi-stage schedules warm up the point-to-point links by exchanging a dummy tensor with the
    previous and next stage (``_get_init_p2p_neighbors_ops``), also where that stage sits on this very rank, as in
    the V schedules (ZB-V, DualPipeV: rank r holds stages r and 2 PP - 1 - r, so stages PP - 1 and PP share a rank).
    gloo has no send to oneself ("Pair is not connected"); those stages hand activations over in memory anyway, so
    the exchange with oneself is dropped. torch 2.13 warms up differently and no longer calls this method.
    """

    class NoSelfWarmup(stage_cls):  # type: ignore[misc, valid-type]
        def _get_init_p2p_neighbors_ops(self) -> list[dist.P2POp]:
            me = dist.get_rank()
            return [op for op in super()._get_init_p2p_neighbors_ops() if op.peer != me]

    NoSelfWarmup.__name__ = NoSelfWarmup.__qualname__ = stage_cls.__name__
    return NoSelfWarmup


def keep_split_backward_graph(stage_cls: type) -> type:
    """A ``PipelineStage`` subclass that keeps a micro-batch's autograd graph alive from its input backward to its
    weight backward (the zero-bubble schedules' split: ZB-V, DualPipeV).

    torch's input backward (``stage_backward_input``) detaches the stage output and keeps only the graph nodes where
    weight gradients join the input path, as Python node objects. The object of a custom ``autograd.Function`` node
    (moetrain's grouped expert GEMM, ``AttachLoss``, the all-to-alls) holds its node weakly, so on torch 2.11 nothing
    held the node any more and the weight backward failed ("Attribute '_input_metadata' is invalid for this instance
    of _C._FunctionBase"). A view of each stage output (no copy) holds the graph until the weight backward has run:
    only the few nodes between the output and those junctions (final norm, residual adds) stay alive meanwhile.
    """

    class KeepGraph(stage_cls):  # type: ignore[misc, valid-type]
        def __init__(self, *a: Any, **k: Any) -> None:
            super().__init__(*a, **k)
            self._graph_holders: dict[int, list[torch.Tensor]] = {}
            self._backward_chunk = -1

        def clear_runtime_states(self) -> None:
            super().clear_runtime_states()
            self._graph_holders.clear()

        def backward_one_chunk(self, bwd_chunk_id: int, *a: Any, **k: Any) -> Any:
            self._backward_chunk = bwd_chunk_id
            return super().backward_one_chunk(bwd_chunk_id, *a, **k)

        def backward_maybe_with_nosync(self, backward_type: str, bwd_kwargs: dict, last_backward: bool = False
                                       ) -> Any:
            if backward_type == "input":
                out = bwd_kwargs["stage_output"]
                outs = out if isinstance(out, (tuple, list)) else (out,)
                self._graph_holders[self._backward_chunk] = [
                    t.view_as(t) for t in outs if isinstance(t, torch.Tensor) and t.grad_fn is not None]
            return super().backward_maybe_with_nosync(backward_type, bwd_kwargs, last_backward)

        def backward_weight_one_chunk(self, bwd_chunk_id: int, *a: Any, **k: Any) -> Any:
            try:
                return super().backward_weight_one_chunk(bwd_chunk_id, *a, **k)
            finally:
                self._graph_holders.pop(bwd_chunk_id, None)

    KeepGraph.__name__ = KeepGraph.__qualname__ = stage_cls.__name__
    return KeepGraph


def recv_buffers_ready_for_backward(stage_cls: type) -> type:
    """A ``PipelineStage`` subclass whose activation receive buffers require grad even when the schedule's first
    call is forward-only.

    torch 2.11 prepares a stage's forward infrastructure once, on the schedule's first call, and gives the receive
    buffers ``requires_grad`` only if that call has a backward (``stage.has_backward``). A first call through
    ``eval()`` -- validation at step 0 -- left them without it, and the first training step then failed on the
    stage after the first ("for chunk 0 has gradients None and is expecting to send gradients to stage 0"). torch
    2.13 notices the switch between eval and training and prepares again (its ``_prepare_forward_infra`` takes
    ``has_backward``); there the class is returned unchanged. Evaluation runs under ``no_grad``, where a buffer's
    ``requires_grad`` changes nothing.
    """
    from torch.distributed.pipelining import PipelineStage

    if "has_backward" in inspect.signature(PipelineStage._prepare_forward_infra).parameters:  # torch's version
        return stage_cls

    class RecvForBackward(stage_cls):  # type: ignore[misc, valid-type]
        def _prepare_forward_infra(self, *args: Any, **kwargs: Any) -> Any:
            had = self.has_backward
            self.has_backward = True
            try:
                return super()._prepare_forward_infra(*args, **kwargs)
            finally:
                self.has_backward = had

    RecvForBackward.__name__ = RecvForBackward.__qualname__ = stage_cls.__name__
    return RecvForBackward
