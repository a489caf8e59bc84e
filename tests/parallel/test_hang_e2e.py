"""The hang monitor wired end to end: ``moetrain train --nproc 2`` with one rank standing still inside a named phase
(the test-only ``MOETRAIN_TEST_STALL`` of :mod:`moetrain.parallel.hang`). Every rank's monitor reports after half
``parallel.timeout_s`` into its ``logs/rank-N.log``; the peer's collective times out (gloo raises in the caller)
and the launcher prints one line naming that rank and its phase."""

from __future__ import annotations

import os
import re
import subprocess
import sys
import time

import pytest

pytestmark = pytest.mark.dist

TIMEOUT_S = 8  # parallel.timeout_s: the monitors report after 4 s, looking every 1 s
PHASE = "forward (FSDP parameter all-gather or expert dispatch)"


def _stuck_seconds(line: str) -> int:
    return int(re.search(r" for (\d+) s; the collective timeout", line).group(1))


def test_a_rank_stalled_in_a_phase_is_named_by_every_monitor_and_the_launcher(tmp_path):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "moetrain", "train", "--out", str(out), "--nproc", "2", "--steps", "2",
           "--set", f'data.cache_dir="{tmp_path / "cache"}"', "--set", "data.builtin_max_bytes=200000",
           "--set", "data.vocab_size=512", "--set", "model.vocab_size=512", "--set", "data.seq_len=32",
           "--set", "train.micro_batch_size=2", "--set", "train.tensorboard=false",
           "--set", "train.threads_per_proc=1", "--set", f"parallel.timeout_s={TIMEOUT_S}"]
    env = dict(os.environ, MOETRAIN_TEST_STALL="forward:1")
    t0 = time.monotonic()
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=180, env=env)
    elapsed = time.monotonic() - t0
    assert p.returncode != 0, p.stdout + p.stderr
    assert elapsed < 90, elapsed  # startup + the timeout + the stalled rank's wake-up, no watchdog-length waits

    # the stalled rank's monitor: its own phase, after half the timeout (before the peers' collectives time out)
    log1 = (out / "logs" / "rank-1.log").read_text()
    stuck1 = [line for line in log1.splitlines() if " stuck in " in line]
    assert len(stuck1) == 1, log1
    assert stuck1[0].startswith(f"[moetrain] rank 1 stuck in {PHASE} for "), stuck1
    assert f"parallel.timeout_s = {TIMEOUT_S} s" in stuck1[0]
    assert TIMEOUT_S / 2 <= _stuck_seconds(stuck1[0]) < TIMEOUT_S
    # the waiting peer's monitor: the same step's forward, inside its collective
    log0 = (out / "logs" / "rank-0.log").read_text()
    stuck0 = [line for line in log0.splitlines() if " stuck in " in line]
    assert len(stuck0) == 1, log0
    assert stuck0[0].startswith(f"[moetrain] rank 0 stuck in {PHASE}"), stuck0
    assert TIMEOUT_S / 2 <= _stuck_seconds(stuck0[0]) < TIMEOUT_S

    # the launcher: one line (beside the monitors' own), naming the rank whose collective timed out and its phase
    lines = [line for line in p.stderr.splitlines() if line.strip() and not line.startswith("[moetrain] ")]
    assert len(lines) == 1, p.stderr
    assert lines[0].startswith("moetrain train: error: a training worker failed: rank 0 at step 1: CollectiveError: "
                               f"rank 0: collective during {PHASE} timed out"), lines
    assert lines[0].endswith("logs/rank-0.log; no checkpoint was written"), lines
