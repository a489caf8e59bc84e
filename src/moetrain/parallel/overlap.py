"""Expert-parallel overlap across micro-batches (``parallel.ep_overlap``): micro-batch i+1's forward paired with
micro-batch i's backward, phase by phase, so every all-to-all is in flight while the other micro-batch computes.

The mechanism is :mod:`moetrain.model.phases` (the forward cut at its all-to-alls, the backward run one segment at a
time); this module runs the micro-batches of one optimizer step through it and keeps FSDP2 correct when a
backward is many autograd calls::

    F(0)                     forward of micro-batch 0, recorded on its tape
    B(0) step | F(1) ...     at every all-to-all of F(1), one backward step of micro-batch 0
    ...
    B(n-1)                   the last backward, alone

This is Megatron-Core's combined 1F1B (``--overlap-moe-expert-parallel-comm``) for PP = 1: one micro-batch's
activations beside another's, as in 1F1B.

FSDP2 reduces gradients in a post-backward hook and at the end of each autograd call; with the backward split into
many calls, gradient reduction and resharding are switched off during the step and run once at its end, the way
``torch.distributed.pipelining`` drives FSDP2 stages (``PipelineStage.perform_reduce_grad``).
"""

from __future__ import annotations

from contextlib import contextmanager
from typing import Any, Callable, Iterator

import torch

from moetrain.model.phases import Tape


def _fsdp_modules(module: torch.nn.Module) -> list[Any]:
    from torch.distributed.fsdp import FSDPModule
    return [m for m in module.modules() if isinstance(m, FSDPModule)]


def defer_fsdp_reduction(module: torch.nn.Module) -> None:
    """Keep gradients unsharded and accumulating, and parameters gathered, across the many backward calls of a
    step (no-op for a module without FSDP)."""
    from torch.distributed.fsdp import FSDPModule
    if isinstance(module, FSDPModule):
        module.set_is_last_backward(False)
        module.set_reshard_after_backward(False)
        module.set_requires_gradient_sync(False)


def finish_fsdp_reduction(module: torch.nn.Module) -> None:
    """Reduce-scatter the accumulated gradients of every FSDP group of ``module`` and reshard, as FSDP2 does at the
    end of a normal last backward."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    if not isinstance(module, FSDPModule):
        return
    module.set_is_last_backward(True)
    module.set_reshard_after_backward(True)
    module.set_requires_gradient_sync(True)
    state = fully_shard.state(module)  # type: ignore[attr-defined]
    for s in state._state_ctx.all_states:
        for group in s._fsdp_param_groups:
            group.post_backward()
    state._root_post_backward_final_callback()


@contextmanager
def keep_fsdp_forward_state(module: torch.nn.Module) -> Iterator[None]:
    """Run a backward step inside the forward of FSDP modules without ending their forward.

    At the end of every autograd call FSDP2's root callback marks every parameter group idle; a group whose forward
    the call interrupted would then take its post-forward for one after the backward and free its gathered
    parameters (whatever ``reshard_after_forward`` says) while the forward still needs them. The training states
    of the interrupted groups and states (and the root's iteration marker) are put back afterwards."""
    from torch.distributed.fsdp import FSDPModule, fully_shard
    from torch.distributed.fsdp._fully_shard._fsdp_common import TrainingState
    if not isinstance(module, FSDPModule):
        yield
        return
    root = fully_shard.state(module)  # type: ignore[attr-defined]
    ctx = root._state_ctx
    states = [(s, s._training_state) for s in ctx.all_states if s._training_state == TrainingState.FORWARD]
    groups = [(g, g._training_state) for s in ctx.all_states for g in s._fsdp_param_groups
              if g._training_state == TrainingState.FORWARD]
    forward_root = ctx.iter_forward_root
    try:
        yield
    finally:
        for obj, st in states + groups:
            obj._training_state = st
        ctx.iter_forward_root = forward_root


def run_paired(forward: Callable[[int], torch.Tensor], n_micro: int, device_type: str,
               events: list | None = None, module: torch.nn.Module | None = None) -> None:
    """Forward and backward ``n_micro`` micro-batches with micro-batch i+1's forward paired with micro-batch i's
    backward (see module docstring).

    Args:
        forward: runs micro-batch i's forward (under the caller's autocast) and returns its scalar loss.
        n_micro: micro-batches in the step.
        device_type: the autocast device type switched off during backward steps.
        events: optional list receiving the tapes' ``(micro-batch, kind, detail)`` records in execution order.
        module: the (possibly FSDP-wrapped) model the forward runs, whose FSDP state the backward steps keep.
    """
    around = (lambda: keep_fsdp_forward_state(module)) if module is not None else None
    prev: Tape | None = None
    for i in range(n_micro):
        tape = Tape(f"mb{i}", partner=prev, events=events, no_autocast=device_type, around_backward=around)
        if prev is not None:
            prev.backward_step()  # the loss and the last segment: its combine backward is then in flight
        with tape.recording():
            loss = forward(i)
        tape.finish(loss.float())
        if prev is not None:
            prev.drain()
        prev = tape
    if prev is not None:
        prev.drain()
