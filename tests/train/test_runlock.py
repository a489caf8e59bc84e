"""One training run per run directory (``moetrain.train.runlock``): a second ``moetrain train`` on a directory a
live run holds is refused in one line naming the holder, before it reads or writes anything there; a lock left by a
process that no longer runs is taken over with a note; the lock goes when the run ends; ``--out`` naming a file is
one line too."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from moetrain.cli import main
from moetrain.errors import ConfigError
from moetrain.train.runlock import LOCK_NAME, RunLock


def test_a_second_run_on_a_held_directory_is_refused_naming_the_holder(tmp_path, capsys):
    run = tmp_path / "run"
    with RunLock(run).acquire():
        (run / "metrics.jsonl").write_text("kept\n")
        assert main(["train", "--out", str(run), "--steps", "1"]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and f"--out {run} is in use by another training run (process {os.getpid()}" in err[0]
        assert (run / "metrics.jsonl").read_text() == "kept\n" and not (run / "checkpoints").exists()
        with pytest.raises(ConfigError, match="in use by another training run"):
            RunLock(run).acquire()
    assert not (run / LOCK_NAME).exists()  # released when its holder is done


def test_a_stale_lock_of_a_dead_process_is_taken_over_with_a_note(tmp_path):
    dead = subprocess.Popen([sys.executable, "-c", "pass"])
    dead.wait()
    run = tmp_path / "run"
    run.mkdir()
    import socket
    (run / LOCK_NAME).write_text(json.dumps({"pid": dead.pid, "host": socket.gethostname(), "started": "then"}))
    notes: list[str] = []
    lock = RunLock(run).acquire(notes.append)
    assert len(notes) == 1 and f"took over the lock of process {dead.pid}" in notes[0]
    assert json.loads((run / LOCK_NAME).read_text())["pid"] == os.getpid()
    lock.release()
    # another host's lock cannot be checked from here: refused, saying how to clear it
    (run / LOCK_NAME).write_text(json.dumps({"pid": 1, "host": "elsewhere", "started": "then"}))
    with pytest.raises(ConfigError, match=f"remove {run / LOCK_NAME}"):
        RunLock(run).acquire()


def test_out_naming_a_file_is_one_line(tmp_path, capsys):
    f = tmp_path / "file"
    f.write_text("x")
    assert main(["train", "--out", str(f), "--steps", "1"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and "is a file, not a run directory" in err[0] and f.read_text() == "x"


def test_a_run_refused_for_bad_input_leaves_no_directory(tmp_path, capsys):
    run = tmp_path / "new" / "run"
    assert main(["train", "--out", str(run), "--steps", "1", "--data", str(tmp_path / "nope.txt")]) == 2
    assert "nope" in capsys.readouterr().err and not (tmp_path / "new").exists()
