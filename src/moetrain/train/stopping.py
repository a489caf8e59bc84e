"""Stopping a run on a signal without losing steps, and reporting a worker's failure in one line.

Protocol (``moetrain train`` and ``torchrun -m moetrain train`` alike):

* The first SIGINT (Ctrl-C) or SIGTERM (a cluster pre-emption) a worker receives only raises a flag; so does the
  launcher process, which also drops a ``RUN_DIR/.stop`` file (a ``kill -TERM`` of the launcher reaches no
  worker). At the end of every step the ranks agree on "stop" with one all-reduce (MAX) of their flags, so all of
  them stop after the same step; they write a checkpoint (atomically, as always) and exit cleanly.
* The launcher then prints one line -- the step, the checkpoint, the exact command that continues the run -- and
  exits with 128 + the signal number (130 for SIGINT, 143 for SIGTERM), the shell's convention for "ended by a
  signal", so a job script can tell a clean stop from a finished run (0) or a failure (1) or bad input (2).
* A second signal exits at once (the same codes), without a checkpoint: the previous complete one is kept.

Under torchrun, torchrun forwards SIGTERM to the workers and kills them 30 s later; a checkpoint that takes longer
is not written, and the previous complete one stays (the write is atomic).
"""

from __future__ import annotations

import os
import shlex
import signal
import sys
import threading
import traceback
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

import torch
import torch.distributed as dist
from torch.distributed.checkpoint.api import CheckpointException

from moetrain.parallel.hang import in_phase

STOP_FILE = ".stop"
#: ``moetrain train``'s exit code after a clean stop on signal ``s`` is 128 + s.
SIGNALS = (signal.SIGINT, signal.SIGTERM)


@dataclass
class StopRequest:
    """Set by the first SIGINT/SIGTERM of this process; a second one exits the process at once."""

    signum: int = 0
    out_dir: str | None = None  # the launcher drops the stop file there for the workers
    on_second: Callable[[], None] | None = None  # the launcher ends its workers before it exits
    _previous: dict[int, Any] = field(default_factory=dict)

    def install(self) -> "StopRequest":
        """Take SIGINT and SIGTERM (only the main thread may; elsewhere the process's own handling stays)."""
        if threading.current_thread() is threading.main_thread():
            for s in SIGNALS:
                self._previous[s] = signal.signal(s, self._handle)
        return self

    def uninstall(self) -> None:
        for s, h in self._previous.items():
            signal.signal(s, h)
        self._previous.clear()

    def _handle(self, signum: int, frame: Any) -> None:
        if self.signum:  # second signal: at once, nothing more is written
            if self.on_second:
                self.on_second()
            os._exit(128 + signum)
        self.signum = signum
        if self.out_dir:
            Path(self.out_dir).mkdir(parents=True, exist_ok=True)
            (Path(self.out_dir) / STOP_FILE).write_text(f"{signal.Signals(signum).name}\n")

    def agreed(self, out_dir: str, ctx: Any) -> int:
        """The signal every rank stops for after this step (0 = go on): the MAX over ranks of this rank's flag or
        the launcher's stop file. One scalar all-reduce per step."""
        mine = self.signum
        if not mine:
            f = Path(out_dir) / STOP_FILE
            if f.is_file():
                name = f.read_text().strip()
                mine = int(getattr(signal.Signals, name, signal.SIGTERM)) if name else int(signal.SIGTERM)
        if ctx.distributed:
            with in_phase("stop-signal agreement (all-reduce)"):
                t = torch.tensor([mine], dtype=torch.int64, device=ctx.device)
                dist.all_reduce(t, op=dist.ReduceOp.MAX)
                mine = int(t.item())
        return mine


def clear_stop_file(out_dir: str) -> None:
    (Path(out_dir) / STOP_FILE).unlink(missing_ok=True)


def resume_command(argv: list[str] | None = None) -> str:
    """The command line that continues this run: the user's own, with ``--resume`` added once."""
    argv = list(sys.argv if argv is None else argv)
    prog = Path(argv[0]).name if argv else "moetrain"
    head = ["python", "-m", "moetrain"] if prog in ("__main__.py", "-m") else ["moetrain"]
    if "RANK" in os.environ:  # a torchrun worker: torchrun's own options are not ours to know
        head = ["torchrun", "<your torchrun options>", "-m", "moetrain"]
    rest = argv[1:]
    if "--resume" not in rest:
        rest.append("--resume")
    return shlex.join(head + rest).replace("'<your torchrun options>'", "<your torchrun options>")


def stop_line(stopped: dict[str, Any]) -> str:
    """The one line a clean stop prints."""
    return (f"[moetrain] stopped by {stopped['signal']} after step {stopped['step']}; checkpoint "
            f"{stopped['checkpoint']}; continue with: {stopped['resume']}")


class WorkerFailure(RuntimeError):
    """A worker's exception in one line: type, message, rank and step; the traceback is in the rank's log.
    ``original`` is the exception itself."""

    original: BaseException | None = None


def record_failure(e: BaseException, out_dir: str, rank: int, step: int | None) -> WorkerFailure:
    """Write ``e``'s full traceback to ``out_dir/logs/rank-<rank>.log`` and return its one-line form."""
    log = Path(out_dir) / "logs" / f"rank-{rank}.log"
    try:
        log.parent.mkdir(parents=True, exist_ok=True)
        with open(log, "a") as f:
            f.write("".join(traceback.format_exception(e)))
        where = f"; traceback in {log}"
    except OSError:
        where = ""
    at = f" at step {step}" if step is not None else " during set-up"
    shown = e
    if isinstance(e, CheckpointException) and e.failures:  # its own first line names only the failed ranks
        first = next(iter(e.failures.values()))
        shown = first[0] if isinstance(first, tuple) else first
    msg = str(shown).strip().splitlines()[0] if str(shown).strip() else ""
    failure = WorkerFailure(f"rank {rank}{at}: {type(shown).__name__}: {msg}{where}")
    failure.original = e
    return failure
