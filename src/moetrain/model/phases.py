"""Phase tape: one micro-batch's forward cut at its communication points, so that its backward can run one phase at
a time, interleaved with another micro-batch's forward (expert-parallel overlap across micro-batches).

Why: within one micro-batch an MoE layer's all-to-all has little to hide behind -- the dispatch feeds the experts,
the combine feeds the next layer. Megatron-Core's combined 1F1B (``--overlap-moe-expert-parallel-comm``) and
DeepSeek's DualPipe pair the forward of one micro-batch with the backward of another, phase by phase, so that each
one's all-to-all is in flight while the other computes. Autograd runs a backward as one call; to interleave it, the
graph is cut into *segments* at the points where a forward all-to-all is issued, and each segment's backward is a
call of its own.

How the graph is cut (single-device code: the model only marks what crosses a cut; ``moetrain.parallel`` issues the
collectives):

* A communication boundary (:meth:`Tape.boundary`) ends a segment. The dispatcher calls it after issuing the
  count exchange, the token rows (dispatch) and the expert outputs (combine) of each MoE layer: three segments per
  layer. Each differentiable all-to-all it issued is recorded (:meth:`Tape.comm`) with its input (a tensor of the
  segment's graph), its output (a new leaf, read only in later segments) and the function that sends the output's
  gradient back (the reverse all-to-all, asynchronous); the count exchange has none.
* A tensor produced in one segment and read in a later one (the residual stream around an MoE FFN, the shared
  experts' output, the balance loss, the embedding read again by MTP) is marked with :func:`carry`, which returns a
  getter: read in the same segment it gives the tensor itself, read after a boundary a leaf cut from it.
* Backward step ``s`` (:meth:`Tape.backward_step`, last segment first): wait for the gradients of the segment's
  all-to-all inputs (sent back by the previous step), run ``torch.autograd.backward`` from the segment's loss, its
  all-to-all inputs and its carried tensors with the gradients their leaves collected, then issue the reverse
  all-to-alls of the communication that fed segment ``s`` and return -- they are waited for at the next step, after
  the partner's forward has computed a segment meanwhile. The routed experts' weight gradients of the step are
  deferred (:func:`weight_grad`) and computed after that issue, so the reverse all-to-all has them to hide
  behind even when no partner forward runs (the last micro-batch of a step).

Pairing (:class:`Tape` ``partner``): the partner tape (the micro-batch before) runs two backward steps before the
forward starts and one at each of its boundaries (``moetrain.parallel.overlap.LEAD_STEPS``). Both run the same
model on same-shaped micro-batches, so their segments pair one to one, and the two lead steps align the small ones
with the small transfer::

    B: loss, combine-bwd issue; experts bwd, dispatch-bwd issue | F: attn+router, counts issue |
    B: shared experts + permutation bwd | F: shared experts, dispatch issue | B: attn bwd, combine-bwd issue |
    F: experts, combine issue | B: experts bwd, dispatch-bwd issue | F: next layer's attn+router ...

Every all-to-all, forward or backward, is then in flight while the other micro-batch computes. Gradients are the
same as one backward call's (sums in another order: fp32 round-off). Without an active tape, :func:`carry` is the
identity and nothing is recorded.
"""

from __future__ import annotations

from contextlib import contextmanager, nullcontext
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
from torch.profiler import record_function

#: The reverse all-to-all of a recorded forward all-to-all: gradient of its output -> (gradient of its input as a
#: buffer filled when the handle's ``wait()`` returns, handle).
Reverse = Callable[[torch.Tensor], tuple[torch.Tensor, Any]]


@dataclass
class _Comm:
    src: torch.Tensor   # the all-to-all's input, in the graph of the segment that issued it
    out: torch.Tensor   # its output: a leaf, read by later segments only
    reverse: Reverse
    phase: str


@dataclass
class _Segment:
    comms: list[_Comm] = field(default_factory=list)
    cuts: list[tuple[torch.Tensor, torch.Tensor]] = field(default_factory=list)  # (tensor, its leaf)
    grads: list[tuple[torch.Tensor, torch.Tensor, Any]] = field(default_factory=list)  # (src, grad buffer, handle)
    label: str = ""


_ACTIVE: list["Tape"] = []
_WGRAD: list[list[Callable[[], None]]] = []


def weight_grad(weight: torch.Tensor, compute: Callable[[], torch.Tensor]) -> torch.Tensor | None:
    """The gradient of ``weight`` (an input of the calling autograd Function) for its backward to return: ``compute()``
    now, or -- inside a tape's backward step -- None, with ``compute()`` queued to run after the step's all-to-all is
    issued (delayed weight gradient, Megatron-Core's ``--delay-wgrad-compute``).

    The queued gradient enters autograd through ``weight``'s own graph (e.g. a DTensor's ``to_local``), so it lands
    in the parameter's ``.grad`` exactly as if it had been returned."""
    if not _WGRAD:
        return compute()
    _WGRAD[-1].append(lambda: torch.autograd.backward(weight, compute()))
    return None


def current_tape() -> "Tape | None":
    """The tape recording the forward running now, or None (normal forward)."""
    return _ACTIVE[-1] if _ACTIVE else None


_REPLAYING: list[bool] = []


def tape_recording() -> bool:
    """Whether the forward running now is recorded by a tape -- or, inside a recomputation (:func:`replaying`),
    whether the forward it recomputes was. Modules whose saved tensors depend on it (:class:`moetrain.model.layers.
    Linear`'s deferrable weight gradient) ask this, so that a recomputation saves what the forward saved."""
    return _REPLAYING[-1] if _REPLAYING else current_tape() is not None


class replaying:  # noqa: N801 - used like a contextmanager function
    """Run a recomputation (``moetrain.model.recompute``) as the forward it replays ran: ``recorded`` = whether a
    tape recorded that forward. A recomputation runs inside a backward step, where another micro-batch's tape may
    be recording, or none. Re-enterable: torch's checkpoint enters the same one again when a split backward (input,
    then weight gradients) recomputes twice."""

    def __init__(self, recorded: bool):
        self.recorded = recorded

    def __enter__(self) -> None:
        _REPLAYING.append(self.recorded)

    def __exit__(self, *exc: Any) -> None:
        _REPLAYING.pop()


def carry(t: torch.Tensor) -> Callable[[], torch.Tensor]:
    """Mark ``t`` as read again later in this forward, possibly after a communication boundary; returns a getter.

    The getter gives ``t`` while no boundary has passed (or nothing is recorded, or ``t`` needs no gradient), else a
    leaf detached from ``t`` whose gradient the tape feeds back into ``t``'s segment."""
    tape = current_tape()
    if tape is None or not t.requires_grad:
        return lambda: t
    return tape.carry(t)


def boundary(phase: str) -> None:
    """End the current segment after the all-to-alls of ``phase`` were issued (no-op without a tape)."""
    tape = current_tape()
    if tape is not None:
        tape.boundary(phase)


class Tape:
    """The segments of one micro-batch's forward and the state of their piecewise backward.

    Args:
        name: label of the micro-batch in events and profiler ranges (e.g. "mb1").
        partner: the tape whose backward steps run at this forward's boundaries (or None).
        events: a list the tape appends ``(name, kind, detail)`` records to, in execution order: kind "issue"
            (a forward boundary, detail = phase), "backward" (a backward step, detail = segment index), "bwd-issue"
            (reverse all-to-alls sent, detail = the phase they reverse), "wgrad" (the step's delayed weight
            gradients ran, detail = segment index). Tests read the interleaving from it.
        no_autocast: device type whose autocast is switched off during backward steps (a backward runs outside the
            forward's autocast, as ``loss.backward()`` after an autocast forward does).
        around_backward: context-manager factory wrapped around every backward step (the scheduler keeps FSDP's
            state of the modules whose forward the step interrupts).
    """

    def __init__(self, name: str, partner: "Tape | None" = None, events: list | None = None,
                 no_autocast: str | None = None, around_backward: Callable[[], Any] | None = None):
        self.name, self.partner, self.events, self.no_autocast = name, partner, events, no_autocast
        self.around_backward = around_backward
        self.segments: list[_Segment] = [_Segment()]
        self.seeds: list[tuple[torch.Tensor, torch.Tensor | None]] = []  # (output, its gradient or None: a loss)
        #: when a list, the delayed weight gradients of every step go there instead of running (the split backward
        #: of a pipeline schedule's BACKWARD_INPUT runs them at its BACKWARD_WEIGHT).
        self.hold_wgrad: list[Callable[[], None]] | None = None
        self._next: int | None = None  # segment whose backward runs next; None until the forward finished
        self._range: Any = None

    # -- forward ---------------------------------------------------------------------------------------------
    @contextmanager
    def recording(self) -> Iterator["Tape"]:
        """Record the forward run inside the block (and run the partner's backward steps at its boundaries)."""
        _ACTIVE.append(self)
        self._open_range()
        try:
            yield self
        finally:
            self._close_range()
            _ACTIVE.pop()

    def carry(self, t: torch.Tensor) -> Callable[[], torch.Tensor]:
        seg = len(self.segments) - 1
        cell: list[torch.Tensor] = []

        def get() -> torch.Tensor:
            if len(self.segments) - 1 == seg:
                return t
            if not cell:
                leaf = t.detach().requires_grad_()
                self.segments[seg].cuts.append((t, leaf))
                cell.append(leaf)
            return cell[0]
        return get

    def comm(self, src: torch.Tensor, out: torch.Tensor, reverse: Reverse, phase: str) -> torch.Tensor:
        """Record an all-to-all issued in the current segment; returns ``out`` made a leaf needing a gradient.
        ``src`` must need one (the caller records only those)."""
        out.requires_grad_()
        self.segments[-1].comms.append(_Comm(src, out, reverse, phase))
        return out

    def boundary(self, phase: str) -> None:
        """End the current segment (``phase``'s all-to-alls are in flight); the partner runs one backward step."""
        self.segments[-1].label = phase
        self.segments.append(_Segment())
        self._log("issue", phase)
        self._close_range()
        if self.partner is not None:
            self.partner.backward_step()
        self._open_range()

    def finish(self, outputs: torch.Tensor | tuple, grads: Any = None) -> None:
        """The forward is done; its backward starts from ``outputs`` (tensors of the last segment) with ``grads``.

        ``outputs`` is a scalar loss (``grads`` None), or a pipeline stage's output tuple with the gradients received
        from the next stage (entries that need no gradient, or get None, are skipped; ``grads`` None: the outputs
        are losses)."""
        if isinstance(outputs, torch.Tensor):
            outputs, grads = (outputs,), (None if grads is None else (grads,))
        if grads is None:  # losses
            self.seeds = [(t, None) for t in outputs if isinstance(t, torch.Tensor) and t.requires_grad]
        else:
            self.seeds = [(t, g) for t, g in zip(outputs, grads) if isinstance(t, torch.Tensor) and t.requires_grad
                          and g is not None]
        self._next = len(self.segments) - 1

    # -- backward --------------------------------------------------------------------------------------------
    @property
    def done(self) -> bool:
        return self._next is not None and self._next < 0

    def backward_step(self) -> bool:
        """Run the backward of the next segment (last first). Returns False when none is left (or the forward has
        not finished)."""
        if self._next is None or self._next < 0:
            return False
        s = self._next
        seg = self.segments[s]
        outs: list[torch.Tensor] = []
        grads: list[torch.Tensor | None] = []
        if s == len(self.segments) - 1:
            for t, g in self.seeds:
                outs.append(t)
                grads.append(g)
        for src, g, handle in seg.grads:
            handle.wait()
            outs.append(src)
            grads.append(g)
        for t, leaf in seg.cuts:
            if leaf.grad is not None:
                outs.append(t)
                grads.append(leaf.grad)
        around = self.around_backward() if self.around_backward is not None else nullcontext()
        wgrads: list[Callable[[], None]] = []
        _WGRAD.append(wgrads)
        try:
            with record_function(f"{self.name} backward seg{s}"), self._autocast_off(), around:
                if outs:
                    torch.autograd.backward(outs, grads)
        finally:
            _WGRAD.pop()
        self._log("backward", s)
        seg.grads, seg.cuts = [], []
        self.segments[s] = _Segment(label=seg.label)  # drop the references: activations free as they would
        if s > 0:
            prev = self.segments[s - 1]
            for c in prev.comms:
                g_out = c.out.grad if c.out.grad is not None else torch.zeros_like(c.out)
                g_src, handle = c.reverse(g_out)
                prev.grads.append((c.src, g_src, handle))
            if prev.comms:
                self._log("bwd-issue", prev.label)
            prev.comms = []
        if wgrads and self.hold_wgrad is not None:
            self.hold_wgrad.extend(wgrads)
        elif wgrads:
            # The weight gradients this step deferred, while its reverse all-to-alls are in flight.
            around = self.around_backward() if self.around_backward is not None else nullcontext()
            with record_function(f"{self.name} wgrad seg{s}"), self._autocast_off(), around:
                for run in wgrads:
                    run()
            self._log("wgrad", s)
        if s == len(self.segments) - 1:
            self.seeds = []
        self._next = s - 1
        return True

    def drain(self) -> None:
        """Run every backward step left."""
        while self.backward_step():
            pass

    # -- helpers ---------------------------------------------------------------------------------------------
    def _log(self, kind: str, detail: Any) -> None:
        if self.events is not None:
            self.events.append((self.name, kind, detail))

    def _autocast_off(self) -> Any:
        if self.no_autocast is None:
            return nullcontext()
        return torch.autocast(self.no_autocast, enabled=False)

    def _open_range(self) -> None:
        self._range = record_function(f"{self.name} forward seg{len(self.segments) - 1}")
        self._range.__enter__()

    def _close_range(self) -> None:
        if self._range is not None:
            self._range.__exit__(None, None, None)
            self._range = None
