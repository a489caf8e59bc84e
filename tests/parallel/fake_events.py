"""A stand-in for ``torch.cuda``'s stream and event API on a CPU, for the event-timing code paths
(``moetrain.parallel.timing.install_device_api``).

Model of a stream: a timeline. Work queued on it cannot run before the host queued it (the host clock) nor before
whatever it was told to wait for (``wait_stream`` / ``wait_event``); an event recorded on it completes at the
stream's position then. That is the property of CUDA streams the timers rely on, with the kernels themselves
taking no time (on a CPU they already ran, synchronously, before the host got here).
"""

from __future__ import annotations

import threading
import time
from contextlib import contextmanager
from typing import Any, Callable, Iterator


class FakeStream:
    def __init__(self, api: "FakeApi", name: str):
        self.api, self.name, self.ready = api, name, float("-inf")

    def position(self) -> float:
        return max(self.api.clock(), self.ready)

    def wait_stream(self, other: "FakeStream") -> None:
        self.api.log.append(("wait_stream", self.name, other.name))
        self.ready = max(self.ready, other.position())

    def wait_event(self, event: "FakeEvent") -> None:
        assert event.time is not None, "waiting for an event that was never recorded"
        self.api.log.append(("wait_event", self.name, event.id))
        self.ready = max(self.ready, event.time)


class FakeEvent:
    def __init__(self, api: "FakeApi"):
        self.api, self.time, self.stream = api, None, None
        self.id = api.events_made
        api.events_made += 1

    def record(self, stream: FakeStream | None = None) -> None:
        s = stream if stream is not None else self.api.current_stream()
        self.time, self.stream = s.position(), s.name
        self.api.log.append(("record", s.name, self.id))

    def elapsed_time(self, end: "FakeEvent") -> float:
        assert self.time is not None and end.time is not None, "elapsed_time of an unrecorded event"
        self.api.elapsed_reads += 1
        return (end.time - self.time) * 1e3

    def query(self) -> bool:
        return True

    def synchronize(self) -> None:
        pass


class FakeApi:
    """``Event``, ``Stream``, ``current_stream`` and ``stream`` like ``torch.cuda``; counts events made and
    ``elapsed_time`` reads, and logs every record and wait as (op, stream, event id or stream)."""

    def __init__(self, clock: Callable[[], float] = time.perf_counter):
        self.clock = clock
        self.events_made = 0
        self.elapsed_reads = 0
        self.log: list[tuple[str, str, Any]] = []
        self.compute = FakeStream(self, "compute")
        self._tls = threading.local()
        self._streams = 0

    def Event(self, enable_timing: bool = False) -> FakeEvent:  # noqa: N802 - torch.cuda's name
        assert enable_timing
        return FakeEvent(self)

    def Stream(self, device: Any = None) -> FakeStream:  # noqa: N802 - torch.cuda's name
        self._streams += 1
        return FakeStream(self, f"side{self._streams}")

    def current_stream(self, device: Any = None) -> FakeStream:
        return getattr(self._tls, "stream", None) or self.compute

    @contextmanager
    def stream(self, s: FakeStream) -> Iterator[None]:
        prev = getattr(self._tls, "stream", None)
        self._tls.stream = s
        try:
            yield
        finally:
            self._tls.stream = prev


class FakeWork:
    """An NCCL-like work: ``wait()`` makes the *current* stream wait until the transfer is done at ``done_at``."""

    def __init__(self, api: FakeApi, done_at: float):
        self.api, self.done_at = api, done_at

    def wait(self) -> bool:
        s = self.api.current_stream()
        self.api.log.append(("work.wait", s.name, None))
        s.ready = max(s.ready, self.done_at)
        return True
