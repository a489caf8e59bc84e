"""Small named autograd collectives used by the expert-parallel dispatcher, with timing and phase-named errors.

``all_to_all`` starts an uneven ``all_to_all_single`` asynchronously and returns the output buffer together with a
:class:`Pending` handle; the caller must ``wait()`` before touching the output. That split is what lets the MoE
layer compute while tokens are in flight. Backward runs the reverse all-to-all (splits swapped) and waits for it at
once.

Timing (``moetrain.parallel.timing``): a2a seconds = issued -> completion, exposed seconds = the part of it the
compute waited for, launch seconds = the host time of the issue call itself (kept apart, as on a GPU). On a GPU both come from CUDA events -- the collective is bracketed on a communication stream of
its own, the wait on the compute stream -- and are read once per step (:meth:`DispatchStats.settle`); on a CPU
(gloo) from the host clock, at once. With nothing to overlap the two are equal.

A hang: every wait is a phase of :mod:`moetrain.parallel.hang`'s monitor, which names it if it does not end.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from moetrain.model.moe import DispatchStats
from moetrain.parallel.hang import in_phase
from moetrain.parallel.timing import EventCommTimer, WallCommTimer, comm_timer


class CollectiveError(RuntimeError):
    """A collective failed or timed out; the message names the phase (dispatch, combine, gradient sync...)."""


def _looks_like_timeout(e: BaseException) -> bool:
    s = str(e).lower()
    return any(w in s for w in ("timed out", "timeout", "connection closed", "connection reset", "broken pipe"))


def name_collective_error(phase: str, e: BaseException) -> CollectiveError:
    kind = "timed out" if _looks_like_timeout(e) else "failed"
    rank = dist.get_rank() if dist.is_initialized() else 0
    return CollectiveError(f"rank {rank}: collective during {phase} {kind} ({type(e).__name__}: {e}). A peer rank may"
                           f" have crashed or diverged; check the other ranks' logs.")


@contextmanager
def named_phase(phase: str, distributed: bool = True) -> Iterator[None]:
    """Re-raise a collective failure inside the block (FSDP's all-gathers and reduce-scatters, any torch.distributed
    call) as a :class:`CollectiveError` naming ``phase``; errors that are not communication failures pass through.
    A CollectiveError raised deeper (it already names its phase, e.g. dispatch) is kept as it is. The block is also
    a phase of the hang monitor (:func:`moetrain.parallel.hang.in_phase`)."""
    try:
        with in_phase(phase):
            yield
    except CollectiveError:
        raise
    except RuntimeError as e:
        if distributed and any(w in str(e).lower() for w in ("timed out", "timeout", "connection", "gloo", "nccl")):
            raise name_collective_error(phase, e) from e
        raise


@dataclass
class Pending:
    """An in-flight collective. ``wait()`` makes the caller's compute wait for it (on a GPU without blocking the
    host), then records its a2a and exposed time into ``stats``.

    ``keep``: tensors the collective reads or writes, held until the compute has waited for it. NCCL may release its
    own references at the (communication-stream) wait of issue time (``TORCH_NCCL_AVOID_RECORD_STREAMS``), and a
    send buffer freed then could be reused by compute while the transfer still reads it. ``label``: appended to the
    phase in hang reports (", MoE layer L"). ``launch_s``: host seconds of the issue call (the collective's
    launch), recorded with its times at the wait."""

    timer: WallCommTimer | EventCommTimer
    token: Any
    phase: str
    stats: DispatchStats | None
    keep: tuple = ()
    label: str = ""
    waited: bool = False
    launch_s: float = 0.0

    def wait(self, exposed_from_issue: bool = False) -> None:
        """Wait for the collective. ``exposed_from_issue``: the caller did no useful work since issuing (a
        synchronous use), so the whole duration counts as exposed."""
        if self.waited:
            return
        with in_phase(f"{self.phase}{self.label}"):
            try:
                read = self.timer.wait(self.token, exposed_from_issue)
            except RuntimeError as e:
                raise name_collective_error(self.phase, e) from e
        stats = self.stats
        if stats is not None and stats.recording:
            stats.launch_seconds += self.launch_s
            if self.timer.deferred:
                stats.add_later(self.phase, read)
            else:
                stats.add(self.phase, *read())
        self.token, self.keep, self.waited = None, (), True


def issue(launch: Callable[[], Any], phase: str, stats: DispatchStats | None, device: torch.device,
          keep: tuple = ()) -> Pending:
    """Start the collective ``launch()`` (an ``async_op=True`` torch.distributed call returning its work) with the
    timer of ``device``, where its tensors live (:func:`moetrain.parallel.timing.comm_timer`: CUDA events on a GPU).

    Args:
        phase: its name in timers (a ``DispatchStats.PHASES`` key, see ``phase_key``), errors and hang reports.
        stats: where ``wait()`` records its seconds (None: not recorded).
        keep: the tensors it reads and writes, held until the compute has waited for it.

    Raises:
        CollectiveError: the launch failed; names ``phase``.
    """
    timer = comm_timer(device)
    t0 = time.perf_counter()
    try:
        token = timer.issue(launch)
    except RuntimeError as e:
        raise name_collective_error(phase, e) from e
    launch_s = time.perf_counter() - t0
    label = f", MoE layer {stats.layer}" if stats is not None and stats.layer is not None else ""
    return Pending(timer, token, phase, stats, keep, label, launch_s=launch_s)


class _AllToAll(torch.autograd.Function):
    """Differentiable uneven all-to-all: forward sends ``in_splits`` rows to each rank and receives ``out_splits``;
    backward sends the gradient back with the splits swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any,
                box: list, phase: str, stats: DispatchStats | None) -> torch.Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits, ctx.phase, ctx.stats = group, out_splits, in_splits, phase, stats
        x = x.contiguous()
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        box.append(issue(lambda: dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True),
                         phase, stats, x.device, keep=(x, out)))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous()
        out = grad.new_empty((sum(ctx.in_splits),) + tuple(grad.shape[1:]))
        issue(lambda: dist.all_to_all_single(out, grad, ctx.in_splits, ctx.out_splits, group=ctx.group,
                                             async_op=True),
              f"{ctx.phase} backward", ctx.stats, grad.device, keep=(grad, out)).wait(exposed_from_issue=True)
        return out, None, None, None, None, None, None


def all_to_all(x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any, phase: str,
               stats: DispatchStats | None = None) -> tuple[torch.Tensor, Pending]:
    """Start an uneven all-to-all of the rows of ``x``. Returns (output, pending); read output only after
    ``pending.wait()``. Differentiable. Raises CollectiveError naming ``phase`` on failure or timeout."""
    box: list[Pending] = []
    out = _AllToAll.apply(x, out_splits, in_splits, group, box, phase, stats)
    return out, box[0]


def all_to_all_counts(counts: torch.Tensor, group: Any, phase: str, stats: DispatchStats | None,
                      meanwhile: Callable[[], Any] | None = None) -> torch.Tensor:
    """Exchange per-destination counts (equal splits, not differentiable). counts: (EP, ...). Returns when the
    exchange is done (on a GPU: the compute stream waits for it); ``meanwhile`` (if given) runs while it is in
    flight, and only the wait after it counts as exposed."""
    out = torch.empty_like(counts)
    src = counts.contiguous()
    pending = issue(lambda: dist.all_to_all_single(out, src, group=group, async_op=True), phase, stats,
                    counts.device, keep=(src, out))
    if meanwhile is not None:
        meanwhile()
    pending.wait(exposed_from_issue=meanwhile is None)
    return out
