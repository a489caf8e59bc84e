"""Checkpoints verify their bytes: every file's SHA-256, hashed while DCP writes it, is kept in checksums.json; a
same-size corruption makes resume fall back to the previous checkpoint and export refuse, naming the file; a
checkpoint of an earlier moetrain (no checksums) still resumes by size; a checkpoint DCP cannot read fails in one
line that does not send the user back to it."""

from __future__ import annotations

import hashlib
import io
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from moetrain.config import JobConfig
from moetrain.errors import CheckpointError
from moetrain.parallel.config import ParallelConfig
from moetrain.train import checkpoint as ck
from moetrain.train import checksums as cs
from moetrain.train.export import export_run
from moetrain.train.stopping import record_failure

from .checkpoint_harness import tiny_checkpointable


@pytest.fixture()
def run(tmp_path):
    model, opt, ctx, state = tiny_checkpointable()
    for step in (5, 10):
        ck.save_checkpoint(tmp_path, step, model, opt, state, ctx, keep=3)
    return tmp_path, model, opt, ctx


def _biggest(ckpt: Path) -> Path:
    return max((f for f in ckpt.iterdir() if f.is_file()), key=lambda f: f.stat().st_size)


def _xor_4k_in_the_middle(f: Path) -> None:
    """What the acceptance script does: 4 KiB XOR-ed at a third of the file, size unchanged."""
    n = f.stat().st_size
    with open(f, "r+b") as h:
        h.seek(n // 3)
        chunk = h.read(4096)
        h.seek(n // 3)
        h.write(bytes(b ^ 0x5A for b in chunk))
    assert f.stat().st_size == n


def test_the_manifest_holds_every_file_hashed_while_written(run):
    out, model, opt, _ = run
    ckpt = out / "checkpoints" / "step_00000010"
    manifest = json.loads((ckpt / "checksums.json").read_text())
    assert manifest["algorithm"] == "sha256"
    on_disk = {f.name for f in ckpt.iterdir()} - {"checksums.json", "COMPLETE"}
    assert set(manifest["files"]) == on_disk and {".metadata", "trainer_state.json"} <= on_disk
    for name, e in manifest["files"].items():
        data = (ckpt / name).read_bytes()
        assert e == {"bytes": len(data), "sha256": hashlib.sha256(data).hexdigest()}, name
    # the DCP files' digests come from the write streams themselves, not from reading the files back
    flat = ck._flat_state(model, opt)[0]
    writer = cs.ChecksumWriter(out / "again")
    dcp.save(flat, storage_writer=writer)
    assert writer.sums and all(s is not None for s in writer.sums.values())
    for name, s in writer.sums.items():
        assert s == cs.file_sum(out / "again" / name), name


def test_a_stream_that_seeks_is_hashed_again_from_disk(tmp_path):
    raw = io.BytesIO()
    s = cs._HashingStream(raw)
    s.write(b"abcdef")
    s.seek(0)
    s.write(b"X")
    assert s.digest() is None  # its hash would not be the file's
    (tmp_path / "f").write_bytes(raw.getvalue())
    manifest = cs.manifest_of(tmp_path, {"f": None}, [])
    assert manifest["files"]["f"] == {"bytes": 6, "sha256": hashlib.sha256(b"Xbcdef").hexdigest()}


def test_a_same_size_corruption_falls_back_to_the_previous_checkpoint(run):
    out, *_ = run
    newest = out / "checkpoints" / "step_00000010"
    big = _biggest(newest)
    _xor_4k_in_the_middle(big)
    got, skipped = ck.resume_checkpoint(out)
    assert got == out / "checkpoints" / "step_00000005"
    assert skipped[0][0] == newest and big.name in skipped[0][1] and "checksum" in skipped[0][1]
    # the workers, after the launcher's full check, look at sizes only
    assert ck.resume_checkpoint(out, checksums=False) == (newest, [])


def test_export_refuses_a_damaged_checkpoint_naming_the_file(run, tmp_path):
    out, *_ = run
    big = _biggest(out / "checkpoints" / "step_00000010")
    _xor_4k_in_the_middle(big)
    with pytest.raises(CheckpointError, match=f"{big.name} does not match its checksum"):
        export_run(out, tmp_path / "hf")
    assert not (tmp_path / "hf").exists()


def test_a_changed_trainer_state_or_a_removed_manifest_is_caught(run):
    out, *_ = run
    newest = out / "checkpoints" / "step_00000010"
    state = json.loads((newest / "trainer_state.json").read_text())
    (newest / "trainer_state.json").write_text(json.dumps(state | {"step": 11}))  # valid JSON, other content
    with pytest.raises(CheckpointError, match="trainer_state.json"):
        ck.verify_checkpoint(newest)
    (newest / "trainer_state.json").write_text(json.dumps(state))
    (newest / "checksums.json").unlink()  # the trainer state says the save wrote it
    with pytest.raises(CheckpointError, match="checksums.json is missing"):
        ck.verify_checkpoint(newest)


def test_a_tampered_manifest_is_named_as_a_possible_cause(run):
    """An edited digest in checksums.json reads like a damaged file: the message names both possibilities."""
    out, *_ = run
    newest = out / "checkpoints" / "step_00000010"
    manifest = json.loads((newest / "checksums.json").read_text())
    manifest["files"][".metadata"]["sha256"] = "0" * 64
    (newest / "checksums.json").write_text(json.dumps(manifest))
    with pytest.raises(CheckpointError) as e:
        ck.verify_checkpoint(newest)
    assert ".metadata does not match its checksum (sha256 " in str(e.value)
    assert str(e.value).endswith("written as 000000000000...): damaged on disk after the save, or checksums.json "
                                 "itself was changed")


def test_a_checkpoint_without_checksums_still_resumes_and_exports_by_size(run, tmp_path, capsys):
    out, *_ = run
    newest = out / "checkpoints" / "step_00000010"
    state = json.loads((newest / "trainer_state.json").read_text())
    del state["checksums"]  # as an earlier moetrain wrote it
    (newest / "trainer_state.json").write_text(json.dumps(state))
    (newest / "checksums.json").unlink()
    assert ck.resume_checkpoint(out) == (newest, []) and not ck.has_checksums(newest)
    export_run(out, tmp_path / "hf")
    assert "step_00000010 has no checksums" in capsys.readouterr().out
    shard = sorted(newest.glob("*.distcp"))[0]
    shard.write_bytes(shard.read_bytes()[:100])  # sizes are still checked
    assert "truncated" in ck.resume_checkpoint(out)[1][0][1]


def test_a_checkpoint_dcp_cannot_read_fails_in_one_line_without_sending_the_user_back(run):
    out, model, opt, ctx = run
    newest = out / "checkpoints" / "step_00000010"
    shard = sorted(newest.glob("*.distcp"))[0]
    with open(shard, "r+b") as f:  # the zip headers of the first saved tensor: DCP's reader fails
        f.write(bytes(4096))
    with pytest.raises(CheckpointError) as e:
        ck.load_checkpoint(newest, model, opt, ctx)
    msg = str(e.value)
    assert msg.startswith(f"checkpoint {newest} cannot be read (") and "\n" not in msg
    assert "move it aside" in msg and "the checkpoint before it" in msg
    assert f"continue from {newest}" not in msg


def test_dcp_exceptions_are_recorded_like_any_failure(tmp_path):
    err = CheckpointException("load failed", {0: (RuntimeError("PytorchStreamReader failed reading zip archive: "
                                                               "failed finding central directory\nmore"), None)})
    assert not isinstance(err, Exception)  # why the trainer names it in its except clause
    failure = record_failure(err, str(tmp_path), 0, None)
    assert str(failure).startswith("rank 0 during set-up: RuntimeError: PytorchStreamReader failed reading zip")
    assert "\n" not in str(failure) and (tmp_path / "logs" / "rank-0.log").is_file()


def test_the_trainer_reports_a_dcp_exception_as_a_worker_failure(tmp_path, monkeypatch):
    from moetrain.train import trainer
    from moetrain.train.stopping import WorkerFailure

    def fails(*a, **k):
        raise CheckpointException("load failed", {0: (RuntimeError("PytorchStreamReader failed\nmore"), None)})
    monkeypatch.setattr(trainer, "_run", fails)
    job = replace(JobConfig(), parallel=ParallelConfig(ep=1))
    job.train.out_dir = str(tmp_path)
    with pytest.raises(WorkerFailure, match="rank 0 during set-up: RuntimeError: PytorchStreamReader failed; "
                                            "traceback in"):
        trainer.run(job, None)
    assert "CheckpointException" in (tmp_path / "logs" / "rank-0.log").read_text()
