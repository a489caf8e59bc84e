"""A non-finite loss stops the run, naming the step and the last good checkpoint; the worker's failure reaches the
user as one line (type, message, rank, step) with the full traceback in the run's log."""

from __future__ import annotations

import math

import pytest

import moetrain.train.trainer as trainer
from moetrain.config import load_job_config
from moetrain.data import prepare_data
from moetrain.train.stopping import WorkerFailure


def test_nan_loss_stops_with_step_and_checkpoint(tmp_path, monkeypatch):
    job = load_job_config(None, [
        "parallel.ep=1", "data.builtin_max_bytes=200000", "data.vocab_size=512", "model.vocab_size=512",
        f'data.cache_dir="{tmp_path / "cache"}"', f'train.out_dir="{tmp_path / "run"}"', "train.steps=6",
        "train.ckpt_every=2", "train.eval_every=0", "train.micro_batch_size=2", "train.tensorboard=false"])
    prep = prepare_data(job.data)
    real_step = trainer.train_step
    calls = {"n": 0}

    def flaky_step(*args, **kwargs):
        r = real_step(*args, **kwargs)
        calls["n"] += 1
        if calls["n"] == 3:
            r.loss = math.nan
        return r

    monkeypatch.setattr(trainer, "train_step", flaky_step)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(WorkerFailure) as e:
        trainer.run(job, prep)
    assert isinstance(e.value.original, trainer.NonFiniteLossError)
    msg = str(e.value)
    assert msg.startswith("rank 0 at step 3: NonFiniteLossError: loss became nan at step 3")
    assert "step_00000002" in msg and "lower train.lr" in msg
    log = tmp_path / "run" / "logs" / "rank-0.log"
    assert str(log) in msg and "Traceback" in log.read_text() and "in _run" in log.read_text()
