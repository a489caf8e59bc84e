"""``moetrain train --nproc 1`` with the all-to-all dispatcher (EP = 1): the path a one-GPU machine runs on NCCL, here
on gloo. Trains, checkpoints, resumes exactly, and runs with EP overlap and FP8 dispatch; the all-to-all timers
count training steps only (validation's all-to-alls are left out)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

BASE = [
    "--nproc", "1", "--set", 'parallel.dispatcher="alltoall"',
    "--set", "data.builtin_max_bytes=200000", "--set", "data.vocab_size=512", "--set", "model.vocab_size=512",
    "--set", "data.seq_len=32", "--set", "train.micro_batch_size=4", "--set", "train.log_every=1",
    "--set", "train.eval_batches=2", "--set", "train.tensorboard=false", "--set", "train.warmup_steps=2",
    # one thread: CPU kernels with several threads sum in a varying order, and the resumed losses are compared exactly
    "--set", "train.threads_per_proc=1",
]


def _train(out: Path, cache: Path, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "moetrain", "train", "--out", str(out), "--set", f'data.cache_dir="{cache}"',
           *BASE, *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return p


def _records(out: Path, kind: str) -> list[dict]:
    rec = [json.loads(line) for line in (out / "metrics.jsonl").read_text().splitlines() if line.strip()]
    return [r for r in rec if r.get("kind") == kind]


def test_world_one_alltoall_trains_checkpoints_and_resumes(tmp_path):
    cache, out = tmp_path / "cache", tmp_path / "run"
    _train(out, cache, "--steps", "6", "--set", "train.ckpt_every=3", "--set", "train.eval_every=3")
    run = _records(out, "run")[0]
    assert run["world"] == 1 and run["ep"] == 1 and run["dispatcher"] == "alltoall"
    train = {r["step"]: r for r in _records(out, "train")}
    assert sorted(train) == list(range(1, 7))
    assert all(r["a2a_s_per_step"] > 0 and 0 <= r["a2a_exposed_share"] <= 1 for r in train.values())
    # the same bytes every step: validation (at steps 3 and 6) adds none of its all-to-alls to the next step's
    assert len({r["dispatch_bytes_per_step"] for r in train.values()}) == 1
    # Resume from step 3: steps 4-6 again, the same losses.
    shutil.rmtree(out / "checkpoints" / "step_00000006")
    _train(out, cache, "--steps", "6", "--set", "train.ckpt_every=3", "--set", "train.eval_every=3", "--resume")
    again = {r["step"]: r for r in _records(out, "train")}
    for s in (4, 5, 6):
        assert again[s]["loss"] == train[s]["loss"], s


@pytest.mark.parametrize("extra", [("--set", "parallel.ep_overlap=true"), ("--set", 'parallel.dispatch_precision="fp8"')],
                         ids=["ep_overlap", "fp8_dispatch"])
def test_world_one_alltoall_variants(tmp_path, extra):
    out = tmp_path / "run"
    _train(out, tmp_path / "cache", "--steps", "2", "--set", "train.grad_accum=2", "--set", "train.eval_every=0",
           *extra)
    train = _records(out, "train")
    assert len(train) == 2 and all(r["a2a_s_per_step"] > 0 for r in train)
    assert (out / "checkpoints" / "step_00000002" / "COMPLETE").is_file()
