"""One process per torchrun job does what must happen once -- verify the checkpoints' bytes, set damaged ones
aside, prepare the data -- and every other rank takes its result, or fails with its error.

Under torchrun every worker runs ``moetrain train``'s preflight (there is no launcher process to run it once, as the
local launcher does). N workers verifying every byte would read the checkpoints N times, and N workers moving a
damaged checkpoint aside race: one renames a directory another is reading. :func:`rank0_decides` runs the work on
global rank 0 only and broadcasts the outcome over a gloo group of its own, whose timeout is not the collectives'
(``parallel.timeout_s``): verifying hundreds of GB or tokenising a corpus takes far longer than one collective.
"""

from __future__ import annotations

import contextlib
import datetime
import os
import time
from collections.abc import Callable
from typing import Any, TypeVar

import torch.distributed as dist

T = TypeVar("T")


def is_rank0() -> bool:
    """True on global rank 0 of a torchrun job, and in a process that torchrun did not start (no ``RANK``): the
    process that prints a job's notes and errors once."""
    return os.environ.get("RANK", "0") == "0"


class ThisRankOnly(Exception):
    """The ``__cause__`` of an error that a torchrun rank other than 0 raised on its own (what it alone sees, e.g. a
    checkpoint rank 0 chose that it cannot see): the CLI prints that rank's line, where it leaves the errors that
    rank 0 also raised (the same config, or rank 0's own passed on) to rank 0."""


#: How long the other ranks wait for rank 0 (seconds). A rank 0 that fails sends its error, and one that dies ends
#: the job through torchrun (or closes the connection): this bounds only a rank 0 that is stuck.
RANK0_TIMEOUT_S = 6 * 3600.0


def rank0_decides(fn: Callable[[], tuple[T, Any]], what: str, passed_on: tuple[type[Exception], ...],
                  timeout_s: float = RANK0_TIMEOUT_S) -> tuple[T | None, Any]:
    """Run ``fn`` on global rank 0 of the (joined) default process group while the other ranks wait.
    ``fn()`` returns (a value for rank 0 only, a picklable value for every rank). Returns, on rank 0, what ``fn``
    returned; on the other ranks (None, the value for every rank).

    ``what`` names the work in the messages ("checking the checkpoints"). An exception of ``fn`` is raised on rank 0
    and sent to the others: one of the ``passed_on`` classes is raised there again with the same message (the CLI
    prints it once, on rank 0), any other as a RuntimeError naming its type.

    Raises:
        whatever ``fn`` raises (rank 0), its ``passed_on`` class or RuntimeError (other ranks); RuntimeError on the
        other ranks when rank 0 ended without an answer or sent none within ``timeout_s`` seconds.
    """
    if dist.get_rank() == 0:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        try:
            box: list[Any] = [None]
            try:
                mine, everyone = fn()
            except Exception as e:
                known = type(e) if type(e) in passed_on else None
                box[0] = ("error", known.__name__ if known else None,
                          str(e) if known else f"rank 0 failed {what}: {type(e).__name__}: {e}")
                dist.broadcast_object_list(box, src=0, group=group)
                raise
            box[0] = ("ok", everyone)
            dist.broadcast_object_list(box, src=0, group=group)
            return mine, everyone
        finally:
            dist.destroy_process_group(group)
    status, *rest = _answer_of_rank0(what, timeout_s)
    if status == "ok":
        return None, rest[0]
    name, msg = rest
    cls = next((c for c in passed_on if c.__name__ == name), RuntimeError)
    raise cls(msg)


def _answer_of_rank0(what: str, timeout_s: float) -> tuple[Any, ...]:
    """On a rank other than 0: the tuple rank 0 broadcast (status first).

    Raises:
        RuntimeError: rank 0 ended without an answer, or sent none within ``timeout_s`` seconds (a rank 0 that
            died takes the job's TCPStore with it, so even joining the group can fail: ``DistNetworkError``).
    """
    t0 = time.monotonic()
    group = None
    try:
        group = dist.new_group(backend="gloo", timeout=datetime.timedelta(seconds=timeout_s))
        box: list[Any] = [None]
        dist.broadcast_object_list(box, src=0, group=group)
        return box[0]
    except RuntimeError:  # gloo's errors and torch.distributed.DistError both
        waited = time.monotonic() - t0
        if waited >= 0.9 * timeout_s:
            raise RuntimeError(f"rank {dist.get_rank()} waited {waited:.0f} s for rank 0 {what} (rank 0 alone "
                               f"does it for the job): rank 0 is stuck; see its output") from None
        raise RuntimeError(f"rank {dist.get_rank()}: rank 0 ended while {what}, without a result; see its "
                           f"output") from None
    finally:
        if group is not None:
            with contextlib.suppress(RuntimeError):  # rank 0 may be gone, and its store with it
                dist.destroy_process_group(group)
