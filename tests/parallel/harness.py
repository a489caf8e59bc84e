"""Run a function on N gloo ranks on the CPU (spawned processes) and collect each rank's return value.

The reference-vs-distributed pattern of OLMo-core: the same function runs once as a single process (no process
group) and once per rank under gloo; the tests compare what comes back.
"""

from __future__ import annotations

import os
import socket
import sys
import tempfile
import time
import traceback
from typing import Any, Callable

import torch
import torch.multiprocessing as mp


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _entry(rank: int, world: int, port: int, out_dir: str, fn: Callable, args: tuple) -> None:
    os.environ.update(RANK=str(rank), WORLD_SIZE=str(world), LOCAL_RANK=str(rank), LOCAL_WORLD_SIZE=str(world),
                      MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    torch.set_num_threads(1)
    try:
        result: Any = ("ok", fn(*args))
    except BaseException as e:  # noqa: BLE001 - shipped back to the test
        result = ("error", f"{type(e).__name__}: {e}\n{traceback.format_exc()}")
    finally:
        import torch.distributed as dist
        if dist.is_initialized():
            dist.destroy_process_group()
    torch.save(result, os.path.join(out_dir, f"rank{rank}.pt"))
    # The result is on disk: leave without interpreter finalisation. Tearing down torch's C++ state there (gloo
    # work objects holding tensors with Python references, pytorch/pytorch#179291) can abort a process that has
    # already finished its work -- a CI run saw "terminate called without an active exception" (SIGABRT) once in
    # several hundred spawns -- and the test would then fail on a rank whose result was already correct.
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)


def run_ranks(world: int, fn: Callable, *args: Any, timeout: float = 300) -> list[tuple[str, Any]]:
    """Spawn ``world`` processes running ``fn(*args)`` with torchrun-style environment variables.

    Returns one ("ok", value) or ("error", message) per rank. ``fn`` must be importable (module level).
    """
    with tempfile.TemporaryDirectory() as d:
        ctx = mp.start_processes(_entry, args=(world, _free_port(), d, fn, args), nprocs=world, join=False,
                                 start_method="spawn")
        # join() returns as soon as *one* process has ended cleanly: keep joining until all have, or time is up.
        deadline = time.monotonic() + timeout
        while not ctx.join(timeout=max(0.0, deadline - time.monotonic())):
            if time.monotonic() >= deadline:
                break
        for p in ctx.processes:
            if p.is_alive():
                p.kill()
        out = []
        for r in range(world):
            path = os.path.join(d, f"rank{r}.pt")
            out.append(torch.load(path, weights_only=False) if os.path.exists(path) else ("error", "no result"))
        return out


def run_single(fn: Callable, *args: Any) -> Any:
    """Run ``fn`` in this process as a plain single process (no torchrun variables)."""
    saved = {k: os.environ.pop(k) for k in ("RANK", "WORLD_SIZE", "LOCAL_RANK") if k in os.environ}
    try:
        return fn(*args)
    finally:
        os.environ.update(saved)


def ok_values(results: list[tuple[str, Any]]) -> list[Any]:
    """The values of :func:`run_ranks`' results, failing the test with the rank's error if any rank failed."""
    for status, value in results:
        assert status == "ok", value
    return [v for _, v in results]


def assert_ranks_match(reference: dict[str, Any], ranks: list[dict[str, Any]], what: Any,
                       series: tuple[str, ...] = ("losses",)) -> dict[str, list[torch.Tensor]]:
    """Every rank's ``series`` (lists of floats, e.g. the step losses) within 1e-5 relative of the single-process
    ``reference``'s, and every parameter any rank holds (``params``: name -> tensor, each name on one rank or more)
    equal to the reference's, the union of the ranks' names being exactly the reference's. Returns every
    parameter's copies over the ranks (name -> tensors), for checks of their own."""
    for r in ranks:
        for key in series:
            for got, want in zip(r[key], reference[key]):
                assert abs(got - want) <= 1e-5 * abs(want), (what, key, r[key], reference[key])
    merged: dict[str, list[torch.Tensor]] = {}
    for r in ranks:
        for k, v in r["params"].items():
            merged.setdefault(k, []).append(v)
    assert merged.keys() == reference["params"].keys(), what
    for name, want in reference["params"].items():
        for got in merged[name]:
            torch.testing.assert_close(got, want, msg=lambda m, n=name: f"{what} {n}: {m}")
    return merged
