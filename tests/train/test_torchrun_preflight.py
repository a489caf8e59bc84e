"""Under torchrun every worker runs the preflight, but one process per job (global rank 0) verifies the checkpoints'
bytes and sets damaged ones aside; the other ranks resume from the checkpoint it chose, or fail with its error.
Rank 0 alone prints the config notes and an error every rank meets; torchrun decides the world (train.nproc)."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest

pytestmark = pytest.mark.dist

WORKER = Path(__file__).with_name("torchrun_worker.py")
BASE = [
    "--set", "data.builtin_max_bytes=100000", "--set", "data.vocab_size=512", "--set", "model.vocab_size=512",
    "--set", "data.seq_len=16", "--set", "train.micro_batch_size=2", "--set", "train.log_every=1",
    "--set", "train.eval_every=0", "--set", "train.tensorboard=false", "--set", "train.warmup_steps=1",
    "--set", "train.ckpt_every=1", "--set", "train.keep_ckpts=5", "--set", "train.threads_per_proc=1",
]


def _torchrun(out: Path, cache: Path, record: Path, *extra: str) -> tuple[subprocess.CompletedProcess, list[dict],
                                                                          list[str]]:
    """Two workers under torchrun; (the torchrun process, each rank's record, each rank's output)."""
    record.mkdir(parents=True)
    cmd = [sys.executable, "-m", "torch.distributed.run", "--standalone", "--nproc-per-node", "2",
           str(WORKER), str(record), "--out", str(out), "--set", f'data.cache_dir="{cache}"', *BASE, *extra]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=300)
    recs = [json.loads((record / f"rank-{r}.json").read_text()) if (record / f"rank-{r}.json").is_file() else {}
            for r in range(2)]
    outs = [(record / f"rank-{r}.out").read_text() for r in range(2)]
    return p, recs, outs


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """A run of 2 steps under torchrun, a checkpoint after each."""
    root = tmp_path_factory.mktemp("torchrun")
    out, cache = root / "run", root / "cache"
    p, recs, outs = _torchrun(out, cache, root / "first", "--steps", "2")
    assert p.returncode == 0, p.stdout + p.stderr + "".join(outs)
    assert [c.name for c in sorted((out / "checkpoints").iterdir())] == ["step_00000001", "step_00000002"]
    # the saved config records the world torchrun started, not the local launcher's default (0: one per GPU)
    from moetrain.config import read_config_file
    assert read_config_file(out / "config.toml")["train"]["nproc"] == 2
    return out, cache


def _damage(ckpt: Path) -> str:
    """4 KiB XOR-ed inside the biggest file, its size unchanged: only the checksums see it. Returns its name."""
    big = max((f for f in ckpt.iterdir() if f.is_file()), key=lambda f: f.stat().st_size)
    data = bytearray(big.read_bytes())
    at = len(data) // 3
    data[at:at + 4096] = bytes(b ^ 0x5A for b in data[at:at + 4096])
    big.write_bytes(bytes(data))
    return big.name


def test_a_damaged_newest_checkpoint_is_verified_and_moved_once_and_every_rank_resumes_the_previous(trained,
                                                                                                     tmp_path):
    src, cache = trained
    out = tmp_path / "run"
    shutil.copytree(src, out)
    ckpts = out / "checkpoints"
    shard = _damage(ckpts / "step_00000002")
    p, recs, outs = _torchrun(out, cache, tmp_path / "record", "--steps", "2", "--resume")
    assert p.returncode == 0, p.stdout + p.stderr + "".join(outs)
    assert [r["rc"] for r in recs] == [0, 0]
    # rank 0 alone read the bytes: the damaged newest one, then the one it resumes from
    assert recs[0]["verified"] == ["step_00000002", "step_00000001"]
    assert recs[1]["verified"] == []
    skip = [line for o in outs for line in o.splitlines() if "skipping checkpoint step_00000002" in line]
    assert len(skip) == 1 and shard in skip[0] and "does not match its checksum" in skip[0], outs
    assert skip[0].endswith("moved to damaged-step_00000002")
    assert "skipping checkpoint" not in outs[1]
    # set aside once (no damaged-step_00000002.1), and the run trained step 2 again from step 1
    assert sorted(c.name for c in ckpts.iterdir()) == ["damaged-step_00000002", "step_00000001", "step_00000002"]
    assert "resumed from step 1 of" in outs[0]
    assert json.loads((ckpts / "step_00000002" / "trainer_state.json").read_text())["step"] == 2
    for line in (l for o in outs for l in o.splitlines()):
        assert "Traceback" not in line and "FileNotFoundError" not in line, outs


def test_every_checkpoint_damaged_ends_every_rank_with_rank_0s_error(trained, tmp_path):
    src, cache = trained
    out = tmp_path / "run"
    shutil.copytree(src, out)
    for ckpt in (out / "checkpoints").iterdir():
        _damage(ckpt)
    t0 = time.monotonic()
    p, recs, outs = _torchrun(out, cache, tmp_path / "record", "--steps", "2", "--resume")
    took = time.monotonic() - t0
    assert p.returncode != 0
    assert [r["rc"] for r in recs] == [2, 2], outs
    errors = [[l for l in o.splitlines() if l.startswith("moetrain train: error:")] for o in outs]
    assert len(errors[0]) == 1 and errors[1] == [], outs  # rank 0's error, printed by rank 0 alone
    assert "no checkpoint in" in errors[0][0] and "verifies" in errors[0][0]
    assert "step_00000001" in errors[0][0] and "step_00000002" in errors[0][0]
    assert recs[1]["verified"] == []
    # nothing set aside when there is nothing to resume from, and no rank waited for a timeout
    assert sorted(c.name for c in (out / "checkpoints").iterdir()) == ["step_00000001", "step_00000002"]
    assert took < 60, took


def test_an_nproc_other_than_torchruns_world_is_refused_on_every_rank(tmp_path):
    out = tmp_path / "run"
    p, recs, outs = _torchrun(out, tmp_path / "cache", tmp_path / "record", "--steps", "2", "--set", "train.nproc=4")
    assert [r["rc"] for r in recs] == [2, 2], outs
    errors = [l for l in outs[0].splitlines() if l.startswith("moetrain train: error:")]
    assert errors == ["moetrain train: error: train.nproc=4 (--nproc) but torchrun started 2 processes "
                      "(WORLD_SIZE=2): under torchrun, torchrun decides the world (--nnodes x --nproc-per-node); "
                      "drop --nproc / train.nproc, or start 4 processes"], outs
    assert not (out / "checkpoints").exists()


def test_rank_0_alone_prints_the_config_notes_and_the_error_every_rank_meets(tmp_path):
    p, recs, outs = _torchrun(tmp_path / "run", tmp_path / "cache", tmp_path / "record", "--steps", "2",
                              "--set", "train.profile_steps=[99]", "--set", "train.nproc=4")
    assert [r["rc"] for r in recs] == [2, 2], outs
    assert [l for l in outs[0].splitlines() if l.startswith("[moetrain] note:")] == [
        "[moetrain] note: train.profile_steps [99] lie past train.steps=2: no trace is written for them"], outs
    assert len([l for l in outs[0].splitlines() if l.startswith("moetrain train: error: train.nproc=4")]) == 1
    assert outs[1] == "", outs  # the same job, the same error: nothing more from rank 1


def test_a_rank_prints_an_error_of_its_own(monkeypatch, capsys):
    """Outside torchrun (no RANK) and on rank 0 every error is printed; on another rank only what it alone met."""
    from moetrain import cli
    from moetrain.errors import CheckpointError
    from moetrain.train.rank0 import ThisRankOnly

    def own(args):
        raise CheckpointError("rank 1 sees no checkpoint where rank 0 chose step_2") from ThisRankOnly()

    def shared(args):
        raise CheckpointError("no checkpoint in out/checkpoints verifies")

    for rank, fn, printed in ((None, shared, True), ("0", shared, True), ("1", shared, False), ("1", own, True)):
        if rank is None:
            monkeypatch.delenv("RANK", raising=False)
        else:
            monkeypatch.setenv("RANK", rank)
        monkeypatch.setattr(cli, "cmd_train", fn)
        assert cli.main(["train"]) == 2
        err = capsys.readouterr().err
        assert err.count("moetrain train: error: ") == (1 if printed else 0), (rank, fn, err)
    monkeypatch.setenv("RANK", "1")
    assert cli.main(["count", "nope"]) == 2  # only train runs under torchrun
    assert "moetrain count: error: 'nope' is neither a preset" in capsys.readouterr().err


# ------------------------------------------------------------------ rank0_decides on its own, on 2 gloo ranks
def _decide(case: str) -> tuple[str, object]:
    """rank0_decides in one of the cases below; (what this rank got or raised, what rank 0's fn saw)."""
    import os
    import torch.distributed as dist
    from moetrain.errors import CheckpointError
    from moetrain.train.rank0 import rank0_decides

    dist.init_process_group("gloo")
    calls = []

    def fn():
        calls.append(dist.get_rank())
        if case == "checkpoint error":
            raise CheckpointError("no checkpoint in out/checkpoints verifies (step_2: damaged)")
        if case == "other error":
            raise PermissionError("cannot move step_2")
        if case == "dies":
            os._exit(0)  # no result written, as a killed rank 0
        if case == "stuck":
            time.sleep(4)
        return f"rank {dist.get_rank()} only", {"chosen": "step_00000001"}

    try:
        got = rank0_decides(fn, "checking the checkpoints", (CheckpointError,),
                            timeout_s=1.5 if case == "stuck" else 60)
        return f"ok {got}", calls
    except Exception as e:  # noqa: BLE001 - the test compares them
        return f"{type(e).__name__}: {e}", calls


@pytest.mark.parametrize("case", ["ok", "checkpoint error", "other error"])
def test_rank0_decides_runs_once_and_every_rank_gets_its_result_or_its_error(case):
    from tests.parallel.harness import ok_values, run_ranks

    (got0, calls0), (got1, calls1) = ok_values(run_ranks(2, _decide, case, timeout=120))
    assert calls0 == [0] and calls1 == []  # fn ran on rank 0 alone
    if case == "ok":
        assert got0 == "ok ('rank 0 only', {'chosen': 'step_00000001'})"
        assert got1 == "ok (None, {'chosen': 'step_00000001'})"
    elif case == "checkpoint error":  # the same class and line on every rank
        assert got0 == got1 == "CheckpointError: no checkpoint in out/checkpoints verifies (step_2: damaged)"
    else:
        assert got0 == "PermissionError: cannot move step_2"
        assert got1 == ("RuntimeError: rank 0 failed checking the checkpoints: PermissionError: cannot move "
                        "step_2")


@pytest.mark.parametrize("case", ["dies", "stuck"])
def test_rank0_decides_names_a_rank_0_that_died_or_is_stuck(case):
    from tests.parallel.harness import run_ranks

    t0 = time.monotonic()
    results = run_ranks(2, _decide, case, timeout=60)
    assert time.monotonic() - t0 < 30
    status, (got1, _) = results[1]
    assert status == "ok"
    if case == "dies":
        assert results[0] == ("error", "no result")  # os._exit: no result written
        assert got1 == "RuntimeError: rank 1: rank 0 ended while checking the checkpoints, without a result; see " \
                       "its output"
    else:
        assert got1.startswith("RuntimeError: rank 1 waited ") and got1.endswith(
            " s for rank 0 checking the checkpoints (rank 0 alone does it for the job): rank 0 is stuck; see its "
            "output"), got1
