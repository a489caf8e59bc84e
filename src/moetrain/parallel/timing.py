"""Timing for the training metrics that is true on the device: CUDA events on a GPU, the host clock on a CPU.

On a GPU, kernels and NCCL collectives return to the host when they are enqueued, so host wall clock around them
measures launch cost, not execution. There, every interval is a pair of CUDA events recorded on a stream; the
events are read (``elapsed_time``) once per step, after the step's own host synchronisation (the loss and
gradient-norm reads at its end), never per call: reading an event that has not completed would block the host.

On a CPU (gloo) compute runs synchronously on the host and a gloo collective runs on gloo's worker threads, so host
time is the execution time and is read at once.

Two measurements use this module:

* :class:`Clock` -- intervals on the compute stream (a pipeline stage's forward and backward chunks, a schedule
  step): ``mark()`` twice, then ``seconds(a, b)`` at the step's end.
* :class:`EventCommTimer` / :class:`WallCommTimer` -- one collective's duration and the part of it the compute
  waited for ("exposed"); the definitions are in their docstrings.

Tests replace ``torch.cuda`` by a stand-in with the same methods (``Event``, ``Stream``, ``current_stream``,
``stream``) through :func:`install_device_api`, which exercises the event code paths on a CPU.
"""

from __future__ import annotations

import time
from typing import Any, Callable

import torch

#: One reading of a collective: () -> (seconds from issue to completion, seconds the compute waited for it).
Reading = Callable[[], tuple[float, float]]

# device type -> the module-like object with Event / Stream / current_stream / stream (torch.cuda for "cuda")
_API: dict[str, Any] = {}


def device_api(device: torch.device) -> Any | None:
    """The event API of ``device``'s type: ``torch.cuda`` for CUDA, an installed stand-in, or None (host clock)."""
    if device.type in _API:
        return _API[device.type]
    return torch.cuda if device.type == "cuda" else None


def install_device_api(device_type: str, api: Any | None) -> Any | None:
    """Use ``api`` (an object with ``Event(enable_timing=True)``, ``Stream(device)``, ``current_stream(device)`` and
    ``stream(s)``, like ``torch.cuda``) for ``device_type``; None removes it. Returns the previous one. For tests:
    it lets the event paths run on a CPU."""
    prev = _API.pop(device_type, None)
    if api is not None:
        _API[device_type] = api
    _CLOCKS.pop(device_type, None)
    _COMM.pop(device_type, None)
    return prev


class Clock:
    """Intervals on ``device``'s current stream: ``mark()`` returns a point (an event recorded on the stream, or a
    host time on a CPU), ``seconds(a, b)`` the time between two points. On the device, ``seconds`` may only be called
    once both points have executed (after a host synchronisation); it then returns the events to a pool."""

    def __init__(self, device: torch.device, api: Any | None):
        self.device, self.api = device, api
        self._free: list[Any] = []

    @property
    def on_device(self) -> bool:
        return self.api is not None

    def event(self) -> Any:
        return self._free.pop() if self._free else self.api.Event(enable_timing=True)

    def release(self, *events: Any) -> None:
        self._free.extend(events)

    def mark(self) -> Any:
        if self.api is None:
            return time.perf_counter()
        e = self.event()
        e.record(self.api.current_stream(self.device))
        return e

    def seconds(self, a: Any, b: Any) -> float:
        """Seconds from point ``a`` to point ``b`` (both from :meth:`mark`)."""
        if self.api is None:
            return b - a
        s = a.elapsed_time(b) / 1e3
        self.release(a, b)
        return s


_CLOCKS: dict[str, Clock] = {}


def clock_for(device: torch.device) -> Clock:
    """The :class:`Clock` of ``device`` (one per device type and process)."""
    c = _CLOCKS.get(device.type)
    if c is None:
        c = _CLOCKS[device.type] = Clock(device, device_api(device))
    return c


class WallCommTimer:
    """A collective timed on the host (gloo on a CPU, where the transfer runs on gloo's threads while the caller's
    compute runs on its own, so host time is the execution time).

    Duration: from the return of the issue call to completion, the completion stamped by a callback on the work's
    future (when a backend has no future: when the wait returns). Exposed: the time the caller spent blocked in
    ``wait()``; with nothing done between issue and wait (``exposed_from_issue``), the whole duration. The issue
    call itself (gloo enqueues the work for its own threads there: tens to hundreds of microseconds of host time,
    no transfer) is the collective's *launch*, timed by its caller (:func:`moetrain.parallel.comm.issue`) and
    reported apart, as a GPU's event timing leaves a kernel launch out of a collective's device time."""

    deferred = False

    def issue(self, launch: Callable[[], Any]) -> Any:
        work = launch()
        t_issued = time.perf_counter()
        t_done: list[float] = []
        if work is not None:
            try:
                work.get_future().then(lambda _f: t_done.append(time.perf_counter()))
            except (RuntimeError, AttributeError):
                pass  # some backends offer no future; fall back to wait-time only
        return work, t_issued, t_done

    def wait(self, token: Any, exposed_from_issue: bool) -> Reading:
        work, t_issued, t_done = token
        t0 = t_issued if exposed_from_issue else time.perf_counter()
        if work is not None:
            work.wait()
        t1 = time.perf_counter()
        # If the work finished before the wait began, its duration is issue -> completion callback; otherwise it
        # ended while we waited (t1 bounds it; the callback may run late). A transfer done before the wait began
        # costs only the wait call itself, which can exceed the callback-stamped duration by microseconds: exposed
        # never exceeds the transfer.
        done = t_done[0] if t_done and t_done[0] < t0 else t1
        total = done - t_issued
        exposed = min(t1 - t0, total)
        return lambda: (total, exposed)


class EventCommTimer:
    """A collective timed with CUDA events, on a communication stream of its own.

    At issue, on the communication stream C (which first waits for the compute stream, so nothing starts before
    the compute that produced the input): event ``start``, the collective (NCCL runs it on its internal stream,
    which waits for C), then ``work.wait()`` -- which makes C, not the compute stream, wait for the transfer -- and
    event ``end``. C carries nothing else, so ``end`` completes when the transfer does and ``end - start`` is the
    collective's device time from the moment the compute reached the issue point to its completion (time queued
    behind an earlier collective of the same communicator included, as on the host clock).

    At the caller's wait, on the compute stream S: event ``w0``, S waits for ``end``, event ``w1``. ``w0`` completes
    when S has run everything issued before the wait, ``w1`` when in addition the transfer is done, so
    ``w1 - w0 = max(0, end - w0)`` is the time S stood still for this collective -- its **exposed** time; 0 when
    the compute issued between issue and wait outlasted the transfer. With ``exposed_from_issue`` (nothing was
    issued in between) it is the whole duration. Exposed is clamped to the duration (the two differences come from
    different events, each resolved to about 0.5 us).

    Events are read by the returned :data:`Reading`, which must run only after the host synchronised with S past
    ``w1`` (the trainer's end-of-step reads do); it returns the events to the pool.
    """

    deferred = True

    def __init__(self, device: torch.device, api: Any):
        self.device, self.api = device, api
        self.stream = api.Stream(device)
        self.clock = Clock(device, api)

    def issue(self, launch: Callable[[], Any]) -> Any:
        api, comm = self.api, self.stream
        compute = api.current_stream(self.device)
        start, end = self.clock.event(), self.clock.event()
        with api.stream(comm):
            comm.wait_stream(compute)
            start.record(comm)
            work = launch()
            if work is not None:
                work.wait()  # the current stream, C, waits for the transfer
            end.record(comm)
        return start, end

    def wait(self, token: Any, exposed_from_issue: bool) -> Reading:
        start, end = token
        compute = self.api.current_stream(self.device)
        w0, w1 = self.clock.event(), self.clock.event()
        w0.record(compute)
        compute.wait_event(end)
        w1.record(compute)

        def read() -> tuple[float, float]:
            total = start.elapsed_time(end) / 1e3
            exposed = total if exposed_from_issue else min(w0.elapsed_time(w1) / 1e3, total)
            self.clock.release(start, end, w0, w1)
            return total, exposed
        return read


_COMM: dict[str, WallCommTimer | EventCommTimer] = {}


def comm_timer(device: torch.device) -> WallCommTimer | EventCommTimer:
    """The collective timer for tensors on ``device``: CUDA events on a GPU (or an installed stand-in), the host
    clock otherwise. One per device type and process."""
    t = _COMM.get(device.type)
    if t is None:
        api = device_api(device)
        t = _COMM[device.type] = WallCommTimer() if api is None else EventCommTimer(device, api)
    return t
