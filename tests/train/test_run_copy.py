"""A copied run directory's config.toml still names the original's train.out_dir: training from it without --out
is refused (it would write into the original), naming both --out choices; the original is left untouched."""

from __future__ import annotations

import os
import shutil
from dataclasses import replace
from pathlib import Path

import pytest

from moetrain.cli import main
from moetrain.config import JobConfig, save_job_config
from moetrain.model.config import ConfigError
from moetrain.train.resume import check_run_config_copy


def _saved_run(run: Path, out_dir: str | None = None) -> Path:
    """A run directory as the trainer leaves it: config.toml (its out_dir), metrics.jsonl, one checkpoint folder."""
    job = JobConfig()
    job = replace(job, train=replace(job.train, out_dir=out_dir or str(run)))
    (run / "checkpoints" / "step_00000010").mkdir(parents=True)
    (run / "checkpoints" / "step_00000010" / "COMPLETE").write_text("10\n")
    (run / "metrics.jsonl").write_text('{"kind": "train", "step": 10}\n')
    return save_job_config(job, run / "config.toml")


def _listing(d: Path) -> dict[str, tuple[int, int]]:
    return {str(f.relative_to(d)): (f.stat().st_size, f.stat().st_mtime_ns) for f in sorted(d.rglob("*"))}


def test_resuming_a_copy_from_its_config_is_refused_and_the_original_is_untouched(tmp_path, capsys):
    orig, copy = tmp_path / "orig", tmp_path / "copy"
    _saved_run(orig)
    shutil.copytree(orig, copy)
    before = _listing(orig)
    code = main(["train", "--config", str(copy / "config.toml"), "--resume"])
    out, err = capsys.readouterr()
    assert code == 2 and out == ""
    assert err == (f"moetrain train: error: {copy / 'config.toml'} was saved by the run in {orig} (train.out_dir); "
                   f"this folder is a copy: add --out {copy} to resume the copy, or --out {orig} to continue the "
                   f"original\n")
    assert _listing(orig) == before


def test_with_out_the_copy_is_the_run(tmp_path, capsys):
    orig, copy = tmp_path / "orig", tmp_path / "copy"
    _saved_run(orig)
    shutil.copytree(orig, copy)
    before = _listing(orig)
    code = main(["train", "--config", str(copy / "config.toml"), "--resume", "--out", str(copy)])
    err = capsys.readouterr().err
    # the copy's (fake, unverifiable) checkpoint is the one looked at, not the original's
    assert code == 2 and f"no checkpoint in {copy}/checkpoints verifies" in err, err
    assert _listing(orig) == before
    check_run_config_copy(copy / "config.toml", out_given=True, resume=True)  # --set train.out_dir= too


def test_a_runs_own_config_and_other_job_files_are_not_concerned(tmp_path, monkeypatch):
    run = tmp_path / "runs" / "a"
    _saved_run(run)
    check_run_config_copy(run / "config.toml", out_given=False, resume=True)
    # a relative out_dir is read from the working directory, as the trainer reads it
    _saved_run(tmp_path / "runs" / "b", out_dir="runs/b")
    monkeypatch.chdir(tmp_path)
    check_run_config_copy(Path("runs/b/config.toml"), out_given=False, resume=True)
    monkeypatch.chdir(tmp_path / "runs")  # from here runs/b is another folder
    with pytest.raises(ConfigError, match=r"was saved by the run in .*runs/runs/b \(train.out_dir\), which does not "
                                          r"exist: this folder was copied or moved; add --out b to resume it in this folder"):
        check_run_config_copy(Path("b/config.toml"), out_given=False, resume=True)
    # a job file that is not a run's saved config, or a config.toml outside a run directory
    job = tmp_path / "jobs"
    job.mkdir()
    save_job_config(JobConfig(), job / "config.toml")
    check_run_config_copy(job / "config.toml", out_given=False, resume=False)
    os.rename(job / "config.toml", run / "job.toml")
    check_run_config_copy(run / "job.toml", out_given=False, resume=False)


def test_a_moved_run_is_refused_naming_its_folder(tmp_path):
    orig, moved = tmp_path / "orig", tmp_path / "moved"
    _saved_run(orig)
    orig.rename(moved)
    with pytest.raises(ConfigError) as e:
        check_run_config_copy(moved / "config.toml", out_given=False, resume=False)
    assert str(e.value) == (f"{moved / 'config.toml'} was saved by the run in {orig} (train.out_dir), which does "
                            f"not exist: this folder was copied or moved; add --out {moved} to train in this folder")
