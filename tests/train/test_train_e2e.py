"""End to end through the real launcher: training lowers the loss; a SIGKILLed run resumes exactly."""

from __future__ import annotations

import json
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

STEPS = 30
BASE = [
    "--set", "data.builtin_max_bytes=400000", "--set", "data.vocab_size=1024", "--set", "model.vocab_size=1024",
    "--set", "data.seq_len=64", "--set", "train.micro_batch_size=16", "--set", "train.log_every=1",
    "--set", "train.eval_every=15", "--set", "train.eval_batches=2", "--set", "train.ckpt_every=5",
    "--set", "train.tensorboard=false", "--set", "train.warmup_steps=5", "--set", "train.keep_ckpts=3",
    "--steps", str(STEPS),
]


def _cmd(out: Path, cache: Path, *extra: str) -> list[str]:
    return [sys.executable, "-m", "moetrain", "train", "--out", str(out), "--set", f'data.cache_dir="{cache}"',
            *BASE, *extra]


def _losses(out: Path) -> dict[int, float]:
    """Last logged loss per step (a resumed run appends; later records win)."""
    rec = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines() if l.strip()]
    return {r["step"]: r["loss"] for r in rec if r.get("kind") == "train"}


@pytest.fixture(scope="module")
def cache(tmp_path_factory):
    return tmp_path_factory.mktemp("cache")


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cache):
    out = tmp_path_factory.mktemp("run") / "full"
    p = subprocess.run(_cmd(out, cache), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    return out, p.stdout


def test_training_lowers_the_loss_with_ep2(uninterrupted):
    out, stdout = uninterrupted
    rec = [json.loads(l) for l in (out / "metrics.jsonl").read_text().splitlines()]
    run = next(r for r in rec if r["kind"] == "run")
    assert run["ep"] == 2 and run["dispatcher"] == "flex" and run["world"] == 2  # the dedup all-to-all
    val = [r["val_loss"] for r in rec if r["kind"] == "val"]
    assert len(val) >= 2 and val[-1] < 0.85 * val[0], val
    train = [r for r in rec if r["kind"] == "train"]
    for key in ("tflops_per_gpu", "mfu", "tokens_per_s_per_gpu", "load_imbalance_max", "a2a_s_per_step",
                "a2a_exposed_share", "peak_mem_gb", "grad_norm", "lr"):
        assert all(key in r for r in train), key
    assert all(r["tflops_per_gpu"] > 0 and r["a2a_s_per_step"] > 0 for r in train)
    assert "TFLOP/s/gpu" in stdout and "EP=2" in stdout


def _worker_pids(parent: int) -> list[int]:
    out = subprocess.run(["pgrep", "-P", str(parent)], capture_output=True, text=True).stdout.split()
    pids = []
    for pid in map(int, out):
        try:
            cmd = Path(f"/proc/{pid}/cmdline").read_bytes().replace(b"\0", b" ").decode()
        except OSError:
            continue
        if "resource_tracker" not in cmd:
            pids.append(pid)
    return pids


def test_sigkill_then_resume_reproduces_the_loss_curve(uninterrupted, cache, tmp_path):
    full_out, _ = uninterrupted
    out = tmp_path / "killed"
    proc = subprocess.Popen(_cmd(out, cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    deadline = time.time() + 300
    target = out / "checkpoints" / "step_00000010" / "COMPLETE"
    while not target.exists():
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, "no checkpoint at step 10 in time"
        time.sleep(0.05)
    workers = _worker_pids(proc.pid)
    assert workers, "found no worker process to kill"
    os.kill(workers[-1], signal.SIGKILL)
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode != 0, log
    assert "a training worker failed" in log and "rerun with --resume" in log, log[-2000:]
    # Every checkpoint left behind is complete (in-progress saves live in .tmp-* and are never read).
    ckpts = sorted((out / "checkpoints").glob("step_*"))
    assert ckpts and all((c / "COMPLETE").is_file() and (c / ".metadata").is_file() for c in ckpts)
    resumed_from = int(ckpts[-1].name.split("_")[1])
    assert 10 <= resumed_from < STEPS

    p = subprocess.run(_cmd(out, cache, "--resume"), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    steps_logged = [json.loads(l)["step"] for l in (out / "metrics.jsonl").read_text().splitlines()
                    if json.loads(l).get("kind") == "train"]
    assert steps_logged == list(range(1, STEPS + 1))  # each step once: the killed run's extra records are dropped
    got, want = _losses(out), _losses(full_out)
    later = [s for s in range(resumed_from + 1, STEPS + 1)]
    assert all(s in got for s in later)
    assert [got[s] for s in later] == [want[s] for s in later]  # exactly the uninterrupted curve


def test_resume_with_a_different_ep_size(uninterrupted, cache, tmp_path):
    full_out, _ = uninterrupted
    out = tmp_path / "reshard"
    src = sorted((full_out / "checkpoints").glob("step_*"))[0]  # the oldest kept one, saved with EP = 2
    start = int(src.name.split("_")[1])
    assert start < STEPS
    shutil.copytree(src, out / "checkpoints" / src.name)
    p = subprocess.run(_cmd(out, cache, "--resume", "--ep", "1"), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert "EP=1" in p.stdout
    got, want = _losses(out), _losses(full_out)
    assert min(got) == start + 1
    for s in range(start + 1, STEPS + 1):
        assert got[s] == pytest.approx(want[s], rel=1e-4), s


def test_damaged_newest_checkpoint_falls_back_to_the_previous_one(uninterrupted, cache, tmp_path):
    full_out, _ = uninterrupted
    out = tmp_path / "damaged"
    shutil.copytree(full_out, out)
    ckpts = sorted((out / "checkpoints").glob("step_*"))
    newest, previous = ckpts[-1], ckpts[-2]
    shard = sorted(newest.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])
    # resuming the finished run is "nothing to do" unless its newest checkpoint is skipped
    p = subprocess.run(_cmd(out, cache, "--resume"), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    assert f"skipping checkpoint {newest.name}" in p.stdout and "truncated" in p.stdout, p.stdout
    start = int(previous.name.split("_")[1])
    assert f"resumed from step {start} of {out}" in p.stdout, p.stdout
    got, want = _losses(out), _losses(full_out)
    assert [got[s] for s in range(start + 1, STEPS + 1)] == [want[s] for s in range(start + 1, STEPS + 1)]
    # the damaged one is set aside, not rotated in over the good one the run resumed from
    assert (out / "checkpoints" / f"damaged-{newest.name}").is_dir() and (previous / "COMPLETE").is_file()


def test_same_size_corruption_of_the_newest_checkpoint_is_skipped(uninterrupted, cache, tmp_path):
    """4 KiB XOR-ed inside the biggest file (the size stays): the checksums catch it before DCP reads garbage."""
    full_out, _ = uninterrupted
    out = tmp_path / "flipped"
    shutil.copytree(full_out, out)
    ckpts = sorted((out / "checkpoints").glob("step_*"))
    newest, previous = ckpts[-1], ckpts[-2]
    big = max(newest.iterdir(), key=lambda f: f.stat().st_size)
    data = bytearray(big.read_bytes())
    at = len(data) // 3
    data[at:at + 4096] = bytes(b ^ 0x5A for b in data[at:at + 4096])
    big.write_bytes(bytes(data))
    p = subprocess.run(_cmd(out, cache, "--resume"), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    line = next(l for l in p.stdout.splitlines() if f"skipping checkpoint {newest.name}" in l)
    assert big.name in line and "does not match its checksum" in line, line
    assert "Traceback" not in p.stdout + p.stderr
    start = int(previous.name.split("_")[1])
    assert f"resumed from step {start} of {out}" in p.stdout, p.stdout
    got, want = _losses(out), _losses(full_out)
    assert [got[s] for s in range(start + 1, STEPS + 1)] == [want[s] for s in range(start + 1, STEPS + 1)]


def _wait_for_step(out: Path, step: int, proc: subprocess.Popen) -> None:
    deadline = time.time() + 300
    while True:
        m = out / "metrics.jsonl"
        if m.is_file() and any(json.loads(l).get("step", 0) >= step for l in m.read_text().splitlines() if l.strip()):
            return
        assert proc.poll() is None, proc.stdout.read()
        assert time.time() < deadline, f"step {step} not reached in time"
        time.sleep(0.1)


def test_sigterm_checkpoints_says_how_to_resume_and_resumes_exactly(uninterrupted, cache, tmp_path):
    full_out, _ = uninterrupted
    out = tmp_path / "pre-empted"
    proc = subprocess.Popen(_cmd(out, cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_for_step(out, 12, proc)
    proc.send_signal(signal.SIGTERM)  # to the launcher only, as a scheduler's pre-emption does
    log = proc.communicate(timeout=120)[0]
    assert proc.returncode == 143, log[-2000:]
    assert "Traceback" not in log, log[-3000:]
    line = next(l for l in log.splitlines() if "stopped by SIGTERM" in l)
    stopped = int(line.split("after step ")[1].split(";")[0])
    assert 12 <= stopped < STEPS and f"step_{stopped:08d}" in line
    assert "continue with: " in line and line.rstrip().endswith("--resume") and str(out) in line
    assert (out / "checkpoints" / f"step_{stopped:08d}" / "COMPLETE").is_file()
    p = subprocess.run(_cmd(out, cache, "--resume"), capture_output=True, text=True, timeout=600)
    assert p.returncode == 0, p.stdout + p.stderr
    got, want = _losses(out), _losses(full_out)
    assert [got[s] for s in range(stopped + 1, STEPS + 1)] == [want[s] for s in range(stopped + 1, STEPS + 1)]


def test_second_signal_exits_at_once(cache, tmp_path):
    out = tmp_path / "impatient"
    proc = subprocess.Popen(_cmd(out, cache), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                            start_new_session=True)
    _wait_for_step(out, 3, proc)
    os.killpg(proc.pid, signal.SIGINT)  # Ctrl-C reaches the launcher and its workers
    os.killpg(proc.pid, signal.SIGINT)
    log = proc.communicate(timeout=60)[0]
    assert proc.returncode == 130, log[-2000:]
    time.sleep(1)
    assert not _worker_pids(proc.pid)  # no worker outlives the launcher


def test_a_worker_failure_is_one_line_with_the_traceback_in_the_log(cache, tmp_path):
    out = tmp_path / "diverges"
    p = subprocess.run(_cmd(out, cache, "--set", "train.lr=1e5", "--set", "train.min_lr=0", "--set",
                            "train.warmup_steps=0", "--set", "train.max_grad_norm=0"),
                       capture_output=True, text=True, timeout=300)
    assert p.returncode == 1, p.stdout + p.stderr
    err = [l for l in p.stderr.splitlines() if not l.startswith("[moetrain] data:")]  # progress goes to stderr
    assert len(err) == 1 and "Traceback" not in p.stderr and "py_callstack" not in p.stderr, p.stderr
    assert err[0].startswith("moetrain train: error: a training worker failed: rank ")
    assert " at step " in err[0] and "NonFiniteLossError: " in err[0] and "became nan" in err[0]
    assert "lower train.lr" in err[0]
    rank = err[0].split("failed: rank ")[1].split()[0]
    log = out / "logs" / f"rank-{rank}.log"
    assert str(log) in err[0] and "Traceback (most recent call last)" in log.read_text()
