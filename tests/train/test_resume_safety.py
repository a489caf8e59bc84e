"""Resume safety: a damaged newest checkpoint is skipped for the newest one that verifies, a garbled trainer state
names its file, a full disk says so and keeps the previous checkpoint, and a resume that changes the schedule, the
tokenizer or the data is refused with what changed."""

from __future__ import annotations

import errno
import json
from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.distributed.checkpoint as dcp
from torch.distributed.checkpoint.api import CheckpointException

from moetrain.config import JobConfig
from moetrain.data.prepare import PreparedData
from moetrain.errors import CheckpointError
from moetrain.model import build_model, get_preset
from moetrain.model.config import ConfigError
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.mesh import init_parallel
from moetrain.train import checkpoint as ck
from moetrain.train.optim import build_optimizer
from moetrain.train.resume import check_same_data, check_schedule_unchanged, data_fingerprint


@pytest.fixture()
def run(tmp_path):
    cfg = get_preset("tiny").replace(vocab_size=256)
    ctx = init_parallel(ParallelConfig(), cfg.n_routed_experts, device="cpu")
    model = build_model(cfg, seed=0)
    opt = build_optimizer(model, lr=1e-3)
    for step in (5, 10):
        ck.save_checkpoint(tmp_path, step, model, opt, {"job": JobConfig().to_dict()}, ctx, keep=3)
    return tmp_path, model, opt, ctx


def _shard(p: Path) -> Path:
    return sorted(p.glob("*.distcp"))[0]


def test_truncated_or_missing_shard_falls_back_to_the_previous_checkpoint(run):
    out, *_ = run
    newest = out / "checkpoints" / "step_00000010"
    assert ck.resume_checkpoint(out) == (newest, [])
    f = _shard(newest)
    f.write_bytes(f.read_bytes()[: f.stat().st_size // 2])
    got, skipped = ck.resume_checkpoint(out)
    assert got == out / "checkpoints" / "step_00000005"
    assert skipped[0][0] == newest and "truncated" in skipped[0][1] and f.name in skipped[0][1]
    f.unlink()
    assert "missing" in ck.resume_checkpoint(out)[1][0][1]


def test_garbled_trainer_state_names_the_file(run):
    out, *_ = run
    newest = out / "checkpoints" / "step_00000010"
    (newest / "trainer_state.json").write_text('{"step": 10, "rng": [1, 2')
    with pytest.raises(CheckpointError, match=r"trainer_state\.json is damaged"):
        ck.read_trainer_state(newest)
    got, skipped = ck.resume_checkpoint(out)
    assert got.name == "step_00000005" and "trainer_state.json" in skipped[0][1]


def test_full_disk_says_so_and_keeps_the_previous_checkpoint(run, monkeypatch):
    out, model, opt, ctx = run

    def full(*a, **k):  # what DCP raises when a rank's write hits ENOSPC
        raise CheckpointException("save failed", {0: (OSError(errno.ENOSPC, "No space left on device"), None)})
    monkeypatch.setattr(dcp, "save", full)
    with pytest.raises(CheckpointError, match="disk is full") as e:
        ck.save_checkpoint(out, 15, model, opt, {}, ctx, keep=3)
    assert "step_00000010 is intact" in str(e.value) and "--resume" in str(e.value)
    assert not list((out / "checkpoints").glob(".tmp-*"))  # the partial write is removed
    assert ck.resume_checkpoint(out)[0].name == "step_00000010"


def _state(job: JobConfig, step: int = 10) -> dict:
    return {"step": step, "job": job.to_dict()}


def test_schedule_changes_are_refused_unless_allowed(tmp_path):
    job = JobConfig()
    job = replace(job, train=replace(job.train, steps=30))
    check_schedule_unchanged(tmp_path, _state(job), job)  # unchanged: fine
    for change, field in (({"lr": 1e-3}, "train.lr"), ({"steps": 60}, "train.steps"),
                          ({"schedule": "wsd"}, "train.schedule"), ({"warmup_steps": 3}, "train.warmup_steps")):
        new = replace(job, train=replace(job.train, **change))
        with pytest.raises(ConfigError, match=field) as e:
            check_schedule_unchanged(tmp_path, _state(job), new)
        assert "train.allow_schedule_change=true" in str(e.value) and "LR at step 10" in str(e.value)
        check_schedule_unchanged(tmp_path, _state(job), replace(new, train=replace(new.train,
                                                                                   allow_schedule_change=True)))
    const = replace(job, train=replace(job.train, schedule="constant"))
    check_schedule_unchanged(tmp_path, _state(const), replace(const, train=replace(const.train, steps=60)))


def _prep(tmp_path: Path, text: str, key: str) -> PreparedData:
    d = tmp_path / f"data-{key}"
    d.mkdir(exist_ok=True)
    (d / "tokenizer.json").write_text(text)
    return PreparedData(str(d / "tokenizer.json"), 300, 0, "", "", 0, 0, str(d))


def test_changed_tokenizer_or_data_is_refused(tmp_path):
    job = JobConfig()
    a = _prep(tmp_path, '{"a": 1}', "aaaa")
    state = {"data": data_fingerprint(a)}
    check_same_data(tmp_path, state, a, job)
    b = _prep(tmp_path, '{"a": 2}', "bbbb")  # same size, other ids: the silent case
    with pytest.raises(ConfigError, match="another tokenizer") as e:
        check_same_data(tmp_path, state, b, job)
    assert "--tokenizer" in str(e.value) and "--out" in str(e.value)
    c = _prep(tmp_path, '{"a": 1}', "cccc")
    with pytest.raises(ConfigError, match="other data"):
        check_same_data(tmp_path, state, c, job)
    check_same_data(tmp_path, {}, b, job)  # an older checkpoint without the record is not checked


def test_schedule_change_names_the_first_step_whose_lr_differs(tmp_path):
    # A 20-step run ends inside its 20-step warm-up (LR 4e-3 at step 20 either way); resumed to 30 steps the cosine
    # decays from there. The message said "goes from 0.004 to 0.004". Hand-computed: step 21 is 1/10 into the
    # cosine, min_lr + 0.5 (lr - min_lr)(1 + cos(pi / 10)) = 4e-4 + 1.8e-3 * 1.95106 = 3.912e-3.
    job = JobConfig()
    old = replace(job, train=replace(job.train, steps=20, warmup_steps=20, lr=4e-3, min_lr=4e-4))
    new = replace(old, train=replace(old.train, steps=30))
    with pytest.raises(ConfigError) as e:
        check_schedule_unchanged(tmp_path, _state(old, step=20), new)
    assert "the LR at step 20 stays 0.004, but at step 21 goes from 0.004 to 0.00391" in str(e.value), str(e.value)


def test_more_steps_that_keep_every_remaining_lr_resume(tmp_path):
    # A 4-step run with a 20-step warm-up, resumed to 6 steps: steps 4 and 5 are still warm-up, lr * (s + 1) / 20
    # under both schedules, so nothing the resumed run does changes; it was refused ("0.001 to 0.001").
    job = JobConfig()
    old = replace(job, train=replace(job.train, steps=4, warmup_steps=20, lr=4e-3))
    check_schedule_unchanged(tmp_path, _state(old, step=4), replace(old, train=replace(old.train, steps=6)))
    # extended past the warm-up, the new cosine decays from step 21 (step 20 is its peak, 4e-3, under both)
    with pytest.raises(ConfigError, match="stays 0.001, but at step 21 goes from 0.004 to 0.00391"):
        check_schedule_unchanged(tmp_path, _state(old, step=4), replace(old, train=replace(old.train, steps=30)))
