"""A non-finite loss stops the run, naming the step and the last good checkpoint; the worker's failure reaches the
user as one line (type, message, rank, step) with the full traceback in the run's log."""

from __future__ import annotations

import math

import torch

import pytest

import moetrain.train.trainer as trainer
from moetrain.config import load_job_config
from moetrain.data import prepare_data
from moetrain.train.stopping import WorkerFailure


def _six_steps(tmp_path):
    """A one-process run of 6 steps with a checkpoint every 2, and its prepared data."""
    job = load_job_config(None, [
        "parallel.ep=1", "data.builtin_max_bytes=200000", "data.vocab_size=512", "model.vocab_size=512",
        f'data.cache_dir="{tmp_path / "cache"}"', f'train.out_dir="{tmp_path / "run"}"', "train.steps=6",
        "train.ckpt_every=2", "train.eval_every=0", "train.micro_batch_size=2", "train.tensorboard=false"])
    return job, prepare_data(job.data)


def test_nan_loss_stops_with_step_and_checkpoint(tmp_path, monkeypatch):
    job, prep = _six_steps(tmp_path)
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


def test_a_nan_gradient_is_never_applied_and_the_advice_points_to_a_finite_checkpoint(tmp_path, monkeypatch):
    """A NaN gradient norm at step 3 (``train.lr=1e3`` gives one at step 2 on the tiny model): the optimizer step,
    the expert-bias update and every state they change are skipped, the run stops naming the step, and the
    checkpoint it points to holds finite values."""
    import moetrain.train.step as step_mod
    from moetrain.train.checkpoint import latest_checkpoint

    job, prep = _six_steps(tmp_path)
    real = step_mod.grad_norm_and_clip
    seen: dict[str, list] = {"params": [], "before": []}

    def nan_at_third(params, *args, **kwargs):
        params = list(params)
        norm = real(params, *args, **kwargs)
        seen["params"] = params
        seen["before"] = [p.detach().clone() for p in params]
        seen["calls"] = seen.get("calls", 0) + 1
        return norm * math.nan if seen["calls"] == 3 else norm

    monkeypatch.setattr(step_mod, "grad_norm_and_clip", nan_at_third)
    monkeypatch.delenv("RANK", raising=False)
    with pytest.raises(WorkerFailure) as e:
        trainer.run(job, prep)
    msg = str(e.value)
    assert "NonFiniteLossError: gradient norm became nan at step 3 (its update was not applied" in msg
    assert "step_00000002" in msg
    for p, before in zip(seen["params"], seen["before"]):
        assert torch.equal(p.detach(), before)  # the skipped step changed no weight
    import torch.distributed.checkpoint as dcp

    ckpt = latest_checkpoint(tmp_path / "run")
    assert ckpt is not None and ckpt.name == "step_00000002"
    state = {}
    for name, meta in dcp.FileSystemReader(str(ckpt)).read_metadata().state_dict_metadata.items():
        if hasattr(meta, "size"):
            state[name] = torch.empty(meta.size, dtype=meta.properties.dtype)
    dcp.load(state, checkpoint_id=str(ckpt))
    assert state and all(torch.isfinite(t).all() for t in state.values() if t.is_floating_point())


def test_non_finite_values_are_never_saved(tmp_path):
    from moetrain.errors import CheckpointError
    from moetrain.train.checkpoint import save_checkpoint

    from .checkpoint_harness import tiny_checkpointable

    model, opt, ctx, state = tiny_checkpointable()
    save_checkpoint(tmp_path, 1, model, opt, state, ctx)
    with torch.no_grad():
        model.layers[1].mlp.experts.w2_EDF[0, 0, :3] = torch.tensor([math.nan, math.inf, -math.inf])
    with pytest.raises(CheckpointError, match=r"refusing to save step 2: 3 non-finite values .*w2_EDF"):
        save_checkpoint(tmp_path, 2, model, opt, state, ctx)
    assert sorted(p.name for p in (tmp_path / "checkpoints").iterdir()) == ["step_00000001"]


@pytest.mark.parametrize("lr", ["inf", "nan"])
def test_a_non_finite_learning_rate_is_refused(lr):
    from moetrain.errors import ConfigError

    with pytest.raises(ConfigError, match=f"train.lr={lr} must be finite and > 0"):
        load_job_config(None, [f"train.lr={lr}"])
