"""Small named autograd collectives used by the expert-parallel dispatcher, with timing and phase-named errors.

``all_to_all`` starts an uneven ``all_to_all_single`` asynchronously and returns the output buffer together with a
:class:`Pending` handle; the caller must ``wait()`` before touching the output. That split is what lets the MoE
layer compute while tokens are in flight. Backward runs the reverse all-to-all (splits swapped) synchronously.

Timing: a2a seconds = issue -> completion (stamped by a callback on the work's future), exposed seconds = time the
caller spent blocked in ``wait()``. With nothing to overlap the two are equal.
"""

from __future__ import annotations

import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, Callable, Iterator

import torch
import torch.distributed as dist

from moetrain.model.moe import DispatchStats


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
    A CollectiveError raised deeper (it already names its phase, e.g. dispatch) is kept as it is."""
    try:
        yield
    except CollectiveError:
        raise
    except RuntimeError as e:
        if distributed and any(w in str(e).lower() for w in ("timed out", "timeout", "connection", "gloo", "nccl")):
            raise name_collective_error(phase, e) from e
        raise


@dataclass
class Pending:
    """An in-flight collective. ``wait()`` blocks, then records a2a and exposed time into ``stats``."""

    work: Any
    phase: str
    stats: DispatchStats | None
    t_issue: float = field(default_factory=time.perf_counter)
    t_done: list[float] = field(default_factory=list)
    waited: bool = False

    def __post_init__(self) -> None:
        if self.work is not None:
            try:
                self.work.get_future().then(lambda _f: self.t_done.append(time.perf_counter()))
            except (RuntimeError, AttributeError):
                pass  # some backends offer no future; fall back to wait-time only

    def wait(self, exposed_from_issue: bool = False) -> None:
        """Block until done. ``exposed_from_issue``: the caller did no useful work since issuing (a synchronous
        use), so the whole duration counts as exposed."""
        if self.waited:
            return
        t0 = self.t_issue if exposed_from_issue else time.perf_counter()
        if self.work is not None:
            try:
                self.work.wait()
            except RuntimeError as e:
                raise name_collective_error(self.phase, e) from e
        t1 = time.perf_counter()
        if self.stats is not None:
            # If the work finished before we started waiting, its duration is issue -> completion callback;
            # otherwise it ended while we waited (t1 bounds it; the callback may run late). So exposed <= total.
            done = self.t_done[0] if self.t_done and self.t_done[0] < t0 else t1
            total = done - self.t_issue
            # A transfer done before the wait began costs only the wait call itself, which can exceed the
            # callback-stamped duration by microseconds: exposed never exceeds the transfer.
            self.stats.add(self.phase, total, min(t1 - t0, total))
        self.work, self.waited = None, True


class _AllToAll(torch.autograd.Function):
    """Differentiable uneven all-to-all: forward sends ``in_splits`` rows to each rank and receives ``out_splits``;
    backward sends the gradient back with the splits swapped."""

    @staticmethod
    def forward(ctx: Any, x: torch.Tensor, out_splits: list[int], in_splits: list[int], group: Any,
                box: list, phase: str, stats: DispatchStats | None) -> torch.Tensor:
        ctx.group, ctx.out_splits, ctx.in_splits, ctx.phase, ctx.stats = group, out_splits, in_splits, phase, stats
        x = x.contiguous()
        out = x.new_empty((sum(out_splits),) + tuple(x.shape[1:]))
        try:
            work = dist.all_to_all_single(out, x, out_splits, in_splits, group=group, async_op=True)
        except RuntimeError as e:
            raise name_collective_error(phase, e) from e
        box.append(Pending(work, phase, stats))
        return out

    @staticmethod
    def backward(ctx: Any, grad: torch.Tensor):  # type: ignore[override]
        grad = grad.contiguous()
        out = grad.new_empty((sum(ctx.in_splits),) + tuple(grad.shape[1:]))
        phase = f"{ctx.phase} backward"
        try:
            work = dist.all_to_all_single(out, grad, ctx.in_splits, ctx.out_splits, group=ctx.group, async_op=True)
        except RuntimeError as e:
            raise name_collective_error(phase, e) from e
        Pending(work, phase, ctx.stats).wait(exposed_from_issue=True)
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
    exchange is done; ``meanwhile`` (if given) runs while it is in flight, and only the wait after it counts as
    exposed."""
    out = torch.empty_like(counts)
    try:
        work = dist.all_to_all_single(out, counts.contiguous(), group=group, async_op=True)
    except RuntimeError as e:
        raise name_collective_error(phase, e) from e
    pending = Pending(work, phase, stats)
    if meanwhile is not None:
        meanwhile()
    pending.wait(exposed_from_issue=meanwhile is None)
    return out
