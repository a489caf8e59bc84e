"""Name the phase a rank is stuck in before a collective timeout ends the process.

Under gloo a timed-out collective raises in the caller, and :func:`moetrain.parallel.comm.named_phase` turns it into
a :class:`~moetrain.parallel.comm.CollectiveError` naming the phase. Under NCCL nothing raises in the caller: the
collectives are asynchronous, the host blocks at its next synchronisation with the device (the dispatcher's split
sizes, the end-of-step loss read), and when the process group's timeout (``parallel.timeout_s``) passes, torch's
NCCL watchdog thread aborts the process (SIGABRT) with a message about a sequence number and an op type, not about
which part of the step it was.

:class:`HangMonitor` is a thread that knows the phases in flight: code marks them with :func:`in_phase` (every
:func:`~moetrain.parallel.comm.named_phase`, the dispatcher's collective waits and its count exchange), and when no
phase has been entered or left for ``report_after_s`` while one is open, it prints and logs one line::

    [moetrain] rank 0 stuck in forward (FSDP parameter all-gather or expert dispatch) > dispatch (counts), MoE
    layer 3 for 150 s; ...

(the open phases, outermost first, over all threads: the autograd engine runs CUDA backward on threads of its own).
The trainer starts it with ``report_after_s = parallel.timeout_s / 2``, so the line is written well before the
watchdog's abort; the launcher quotes it when a worker dies of a signal (:func:`last_stall`).

What the phase means on NCCL: the host waits at the first synchronisation after the collective that hangs, so the
innermost phase is where the host stopped (e.g. a dispatch's count exchange), and the outer ones say which part
of the step it was in; the hanging collective is this one or one issued before it in the same phase.

A long stretch of host work without any phase change inside an open phase (a large dense forward on a CPU) is
reported too; the line then says only that no progress was seen. Cost on the hot path: a lock and a clock read per
phase entry and exit, nothing when no monitor runs (single process).
"""

from __future__ import annotations

import os
import sys
import threading
import time
from contextlib import AbstractContextManager, contextmanager, nullcontext
from pathlib import Path
from typing import Any, Callable, Iterator, TextIO

STUCK = "stuck in"

_monitor: "HangMonitor | None" = None


def _test_stall(spec: str | None) -> tuple[str, int] | None:
    """TEST-ONLY fault injection, for the end-to-end hang test (tests/parallel/test_hang_e2e.py); never set it in a
    real run. ``MOETRAIN_TEST_STALL="<phase prefix>:<rank>"``: that rank, on first entering a monitored phase whose
    name starts with the prefix, stands still in it for twice ``parallel.timeout_s`` (a collective that never
    completes), so its peers' collectives time out."""
    if not spec:
        return None
    phase, sep, rank = spec.rpartition(":")
    if not sep or not phase or not rank.isdigit():
        raise ValueError(f"MOETRAIN_TEST_STALL={spec!r}: expected '<phase prefix>:<rank>' (a test-only setting)")
    return phase, int(rank)


_TEST_STALL = _test_stall(os.environ.get("MOETRAIN_TEST_STALL"))


@contextmanager
def in_phase(name: str) -> Iterator[None]:
    """Mark ``name`` as in flight on this thread while the block runs (a no-op without a running monitor)."""
    global _TEST_STALL
    m = _monitor
    if m is None:
        yield
        return
    entry = m.enter(name)
    try:
        if _TEST_STALL is not None and m.rank == _TEST_STALL[1] and name.startswith(_TEST_STALL[0]):
            _TEST_STALL = None
            time.sleep(2 * (m.timeout_s or m.report_after_s))
        yield
    finally:
        m.exit(entry)


class HangMonitor:
    """A daemon thread that reports "rank R stuck in <phases> for N s" when no phase changed for ``report_after_s``.

    Args:
        rank: this process's global rank, for the message.
        report_after_s: seconds without a phase change (with a phase open) before the report.
        timeout_s: the collective timeout, quoted in the message.
        log_path: a file the report is appended to as well (the rank's log, ``out_dir/logs/rank-R.log``).
        out: where the report is printed (stderr by default), flushed at once.
        clock: monotonic seconds (tests pass a fake).
        poll_s: how often the thread looks (default: a quarter of ``report_after_s``, at most 5 s).

    Use as a context manager (or :meth:`start` / :meth:`stop`); one runs per process at a time. ``reports`` keeps
    every line written.
    """

    def __init__(self, rank: int, report_after_s: float, timeout_s: float | None = None,
                 log_path: str | Path | None = None, out: TextIO | None = None,
                 clock: Callable[[], float] = time.monotonic, poll_s: float | None = None):
        if not report_after_s > 0:
            raise ValueError(f"report_after_s={report_after_s} must be > 0")
        self.rank, self.report_after_s, self.timeout_s = rank, report_after_s, timeout_s
        self.log_path = Path(log_path) if log_path is not None else None
        self.out, self.clock = out, clock
        self.poll_s = poll_s if poll_s is not None else min(5.0, report_after_s / 4)
        self.reports: list[str] = []
        self._lock = threading.Lock()
        self._open: dict[int, list[tuple[str, float]]] = {}  # thread id -> stack of (phase, entered at)
        self._last_change = clock()
        self._reported: tuple[float, str] | None = None  # (last change reported, phases) of the current stall
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None

    # -- hot path --------------------------------------------------------------------------------------------------
    def enter(self, name: str) -> Any:
        tid = threading.get_ident()
        with self._lock:
            now = self.clock()
            self._open.setdefault(tid, []).append((name, now))
            self._last_change = now
        return tid

    def exit(self, tid: Any) -> None:
        with self._lock:
            stack = self._open.get(tid)
            if stack:
                stack.pop()
                if not stack:
                    del self._open[tid]
            self._last_change = self.clock()

    # -- the thread ------------------------------------------------------------------------------------------------
    def open_phases(self) -> list[str]:
        """The phases in flight on every thread, oldest first."""
        with self._lock:
            entries = [e for stack in self._open.values() for e in stack]
        return [name for name, _ in sorted(entries, key=lambda e: e[1])]

    def check(self) -> str | None:
        """Look once: write and return the report if a phase has been open without change for ``report_after_s``
        (once per stall), or the "progress again" line when a reported stall ended; else None."""
        with self._lock:
            now, last = self.clock(), self._last_change
            entries = sorted((e for stack in self._open.values() for e in stack), key=lambda e: e[1])
            reported = self._reported
        if reported is not None and last != reported[0]:
            self._reported = None
            return self._write(f"[moetrain] rank {self.rank}: progress again after {last - reported[0]:.0f} s in "
                               f"{reported[1]}")
        if reported is not None or not entries or now - last < self.report_after_s:
            return None
        names: list[str] = []
        for name, _ in entries:
            if not names or names[-1] != name:  # a phase marked by a caller and by the wait inside it
                names.append(name)
        phases = " > ".join(names)
        self._reported = (last, phases)
        limit = (f"; the collective timeout (parallel.timeout_s = {self.timeout_s:g} s) ends the run if it does not "
                 f"finish" if self.timeout_s else "")
        return self._write(f"[moetrain] rank {self.rank} {STUCK} {phases} for {now - last:.0f} s{limit}. A peer "
                           f"rank may have crashed, diverged or be stuck elsewhere: compare the ranks' phases "
                           f"(out_dir/logs/rank-*.log)")

    def _write(self, line: str) -> str:
        self.reports.append(line)
        out = self.out if self.out is not None else sys.stderr
        try:
            print(line, file=out, flush=True)
        except (OSError, ValueError):
            pass
        if self.log_path is not None:
            try:
                self.log_path.parent.mkdir(parents=True, exist_ok=True)
                with open(self.log_path, "a") as f:
                    f.write(line + "\n")
            except OSError:
                pass
        return line

    def _loop(self) -> None:
        while not self._stop.wait(self.poll_s):
            self.check()

    def start(self) -> "HangMonitor":
        """Start the thread and make this the process's monitor (:func:`in_phase` reports to it)."""
        global _monitor
        if _monitor is not None and _monitor is not self:
            raise RuntimeError("a HangMonitor is already running in this process")
        _monitor = self
        self._stop.clear()
        self._thread = threading.Thread(target=self._loop, name="moetrain-hang-monitor", daemon=True)
        self._thread.start()
        return self

    def stop(self) -> None:
        global _monitor
        self._stop.set()
        if self._thread is not None:
            self._thread.join()
            self._thread = None
        if _monitor is self:
            _monitor = None

    def __enter__(self) -> "HangMonitor":
        return self.start()

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def last_stall(log_path: str | Path, since_bytes: int = 0) -> str | None:
    """The last "stuck in" line a rank's log gained after its first ``since_bytes`` bytes (its size when this run
    started: rank logs are appended over runs and resumes), without the "[moetrain] " prefix; None if there is
    none, or if a "progress again" line of the same rank follows it (that stall ended: a slow checkpoint save,
    say, not what killed the process)."""
    try:
        with open(log_path, "rb") as f:
            f.seek(since_bytes)
            lines = f.read().decode(errors="replace").splitlines()
    except OSError:
        return None
    for line in reversed(lines):
        if not line.startswith("[moetrain] rank "):
            continue
        if ": progress again after " in line:
            return None
        if f" {STUCK} " in line:
            return line.removeprefix("[moetrain] ")
    return None


def hang_monitor(ctx: Any, log_path: str | Path) -> AbstractContextManager:
    """The monitor of a training worker: for a distributed ``ctx`` (a ``ParallelContext``), a :class:`HangMonitor`
    reporting after half the collective timeout (``parallel.timeout_s``) into ``log_path``; a single process has
    no collective to hang in, and gets a no-op."""
    if not ctx.distributed:
        return nullcontext()
    return HangMonitor(ctx.rank, ctx.pcfg.timeout_s / 2, ctx.pcfg.timeout_s, log_path)
