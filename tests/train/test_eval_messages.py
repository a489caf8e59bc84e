"""``moetrain eval`` / ``export`` refuse bad input with one line naming the way on, exit 2, before any evaluation:
a damaged newest checkpoint names the ``--step`` that verifies; a checkpoint directory or a file given as the run
names the run directory and step; a missing data cache names where the run was trained; empty ``--data`` files and
folders name ``--data`` and the fix; an unwritable ``--json`` and ``--nproc 0`` are refused up front."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moetrain.cli import main
from moetrain.train import evaluate

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def trained(tmp_path_factory) -> Path:
    """The directory a 4-step run was trained in, with a relative ``--out runs/r`` and ``data.cache_dir``
    ``cache``; checkpoints at steps 2 and 4."""
    d = tmp_path_factory.mktemp("evalmsg")
    cmd = [sys.executable, "-m", "moetrain", "train", "--out", "runs/r", "--nproc", "1", "--steps", "4",
           "--set", 'data.cache_dir="cache"', "--set", "data.builtin_max_bytes=100000", "--set", "data.vocab_size=512",
           "--set", "model.vocab_size=512", "--set", "data.seq_len=32", "--set", "train.micro_batch_size=2",
           "--set", "train.eval_every=4", "--set", "train.eval_batches=1", "--set", "train.ckpt_every=2",
           "--set", "train.tensorboard=false", "--set", "train.threads_per_proc=1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=600, cwd=d)
    assert p.returncode == 0, p.stdout + p.stderr
    return d


def _damage(run: Path, step: int) -> None:
    shard = sorted((run / "checkpoints" / f"step_{step:08d}").glob("*.distcp"))[0]
    with open(shard, "r+b") as f:
        f.seek(100)
        f.write(b"XXXX")


def _one_line(capsys) -> str:
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1, err
    return err


@pytest.mark.parametrize("command", ["eval", "export"])
def test_a_damaged_newest_checkpoint_names_the_step_that_verifies(trained, tmp_path, capsys, command):
    run = tmp_path / "r"
    shutil.copytree(trained / "runs/r", run)
    _damage(run, 4)
    argv = [command, str(run)] + ([str(tmp_path / "hf")] if command == "export" else ["--data", str(tmp_path)])
    assert main(argv) == 2
    err = _one_line(capsys)
    assert "does not match its checksum" in err and "use --step 2 " in err, err
    assert not (tmp_path / "hf").exists()
    _damage(run, 2)
    assert main(argv) == 2
    err = _one_line(capsys)
    assert "none of the other 1 checkpoint(s)" in err and "--step" not in err, err


@pytest.mark.parametrize("given", ["runs/r/checkpoints/step_00000004", "runs/r/checkpoints/step_00000004/COMPLETE"])
def test_a_checkpoint_directory_given_as_the_run_names_the_run_and_step(trained, capsys, given):
    assert main(["eval", str(trained / given)]) == 2
    err = _one_line(capsys)
    assert f"pass the run directory {trained / 'runs/r'} and --step 4" in err, err


def test_a_file_given_as_the_run_names_its_folder(trained, capsys):
    assert main(["sample", str(trained / "runs/r/config.toml"), "--prompt", "x"]) == 2
    err = _one_line(capsys)
    assert f"is a file, not a run directory; pass the run directory {trained / 'runs/r'} " in err, err


def test_a_missing_cache_names_the_directory_the_run_was_trained_in(trained, tmp_path, capsys, monkeypatch):
    monkeypatch.chdir(tmp_path)
    assert main(["eval", str(trained / "runs/r")]) == 2
    err = _one_line(capsys)
    assert f"the run was trained in {trained}, whose cache holds it ({trained / 'cache' / 'data-'}" in err, err
    assert f"cd {trained} and run moetrain eval there" in err, err
    # the same run moved elsewhere: where it was trained can no longer be told; the message says which folder
    moved = tmp_path / "moved"
    shutil.copytree(trained / "runs/r", moved)
    assert main(["eval", str(moved)]) == 2
    assert "data.cache_dir 'cache', relative to the directory it was trained in" in _one_line(capsys)
    # run from where it was trained, the same run directory evaluates (the hint is right)
    monkeypatch.chdir(trained)
    assert main(["eval", "runs/r", "--max-batches", "1"]) == 0


def test_empty_data_names_data_and_the_fix(trained, tmp_path, capsys):
    (tmp_path / "empty.txt").write_text("")
    (tmp_path / "emptydir").mkdir()
    assert main(["eval", str(trained / "runs/r"), "--data", str(tmp_path / "empty.txt")]) == 2
    err = _one_line(capsys)
    assert "are empty" in err and "point --data at files with text" in err and "to train" not in err, err
    assert main(["eval", str(trained / "runs/r"), "--data", str(tmp_path / "emptydir")]) == 2
    err = _one_line(capsys)
    assert err.startswith(f"moetrain eval: error: --data {tmp_path / 'emptydir'}: the folder holds no data file")
    assert "save_to_disk" in err, err


@pytest.mark.parametrize("argv,needle", [
    (["--json", "/nonexistent/x.json"], "the folder /nonexistent does not exist"),
    (["--json", "{tmp}"], "is a directory"),
    (["--nproc", "0"], "--nproc 0 must be >= 1"),
    (["--ep", "0"], "--ep 0 must be >= 1"),
], ids=["json_folder", "json_dir", "nproc", "ep"])
def test_bad_options_are_refused_before_evaluating(trained, tmp_path, capsys, monkeypatch, argv, needle):
    def no_eval(*a, **k):
        raise AssertionError("evaluated before the options were checked")
    monkeypatch.setattr(evaluate, "model_loss_sums", no_eval)
    monkeypatch.setattr(evaluate, "load_run_model", no_eval)
    base = ["eval", str(trained / "runs/r"), "--data", str(trained / "runs/r/config.toml")]
    assert main(base + [a.format(tmp=tmp_path) for a in argv]) == 2
    err = _one_line(capsys)
    assert needle in err, err
