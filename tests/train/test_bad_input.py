"""`moetrain train` rejects bad input before any worker starts, with a message naming the problem and the fix."""

from __future__ import annotations

import json
import shutil
import time

import pytest

from moetrain.cli import main


def _train(capsys, *args: str) -> tuple[int, str, float]:
    t = time.perf_counter()
    code = main(["train", *args])
    return code, capsys.readouterr().err, time.perf_counter() - t


@pytest.fixture
def corpus(tmp_path):
    d = tmp_path / "corpus"
    d.mkdir()
    for i in range(6):
        (d / f"doc{i}.txt").write_text(("def f(x):\n    return x * %d\n" % i) * 200)
    return d


def test_missing_data(capsys, tmp_path):
    code, err, dt = _train(capsys, "--data", str(tmp_path / "nope/*.jsonl"), "--out", str(tmp_path / "run"))
    assert code == 2 and "nope" in err and dt < 30
    assert not (tmp_path / "run").exists()


def test_empty_data(capsys, tmp_path):
    (tmp_path / "empty.txt").write_text("")
    code, err, _ = _train(capsys, "--data", str(tmp_path / "empty.txt"), "--out", str(tmp_path / "run"))
    assert code == 2 and "empty" in err.lower()


def test_unknown_config_field(capsys, tmp_path):
    code, err, _ = _train(capsys, "--set", "train.learning_rate=1", "--out", str(tmp_path / "run"))
    assert code == 2 and "learning_rate" in err and "valid fields" in err


def test_ep_not_dividing_experts(capsys, tmp_path):
    code, err, _ = _train(capsys, "--ep", "3", "--nproc", "3", "--out", str(tmp_path / "run"))
    assert code == 2 and "parallel.ep=3" in err and "allowed ep values" in err


def test_tokenizer_larger_than_model_vocab(capsys, tmp_path):
    code, err, _ = _train(capsys, "--set", "data.builtin_max_bytes=200000", "--set", "data.vocab_size=1000",
                          "--set", "model.vocab_size=512", "--set", f'data.cache_dir="{tmp_path / "c"}"',
                          "--steps", "1", "--out", str(tmp_path / "run"))
    assert code == 2 and "model.vocab_size is 512" in err, err


def test_checkpoint_from_a_different_model(capsys, tmp_path):
    _real_checkpoint(tmp_path / "run", dim=64)
    code, err, _ = _train(capsys, "--resume", "--out", str(tmp_path / "run"))
    assert code == 2 and "different model" in err and "dim" in err
    assert "resume with the model options the run was started with (--preset, --set model.*)" in err, err


def test_checkpoint_from_a_different_model_names_the_runs_config(capsys, tmp_path):
    from moetrain.config import JobConfig, save_job_config

    run = tmp_path / "run"
    _real_checkpoint(run, dim=64)
    save_job_config(JobConfig(), run / "config.toml")  # as the trainer saves it beside checkpoints/
    code, err, _ = _train(capsys, "--resume", "--out", str(run))
    assert code == 2 and "dim: checkpoint 64 vs config " in err, err
    assert err.strip().endswith(f"resume with the run's options, e.g. --config {run / 'config.toml'}, or train "
                                f"into a fresh --out"), err
    assert len(err.strip().splitlines()) == 1


def test_unreadable_config_file(capsys, tmp_path):
    f = tmp_path / "job.toml"
    f.write_text("[train\nsteps = 3")
    code, err, _ = _train(capsys, "--config", str(f))
    assert code == 2 and "cannot parse" in err


def _fake_checkpoint(run, step=10, **model_changes):
    """A COMPLETE-marked directory holding only a trainer state (no DCP metadata or shards): a damaged checkpoint."""
    from moetrain.model.config import tiny
    ckpt = run / "checkpoints" / f"step_{step:08d}"
    ckpt.mkdir(parents=True)
    (ckpt / "trainer_state.json").write_text(json.dumps({"model_config": tiny().replace(**model_changes).to_dict(),
                                                         "step": step, "loader": {"seq_len": 64}}))
    (ckpt / "COMPLETE").write_text(f"{step}\n")
    return ckpt


def _real_checkpoint(run, step=10, **model_changes):
    """A complete checkpoint of the tiny model (with ``model_changes``) as moetrain train writes it."""
    from moetrain.config import JobConfig
    from moetrain.model import build_model
    from moetrain.model.config import tiny
    from moetrain.parallel.config import ParallelConfig
    from moetrain.parallel.mesh import init_parallel
    from moetrain.train.checkpoint import save_checkpoint
    from moetrain.train.optim import build_optimizer

    cfg = tiny().replace(**model_changes)
    ctx = init_parallel(ParallelConfig(), cfg.n_routed_experts, device="cpu")
    model = build_model(cfg, seed=0)
    state = {"model_config": cfg.to_dict(), "loader": {"seq_len": 64}, "job": JobConfig().to_dict()}
    return save_checkpoint(run, step, model, build_optimizer(model, 1e-3), state, ctx)


def test_fresh_run_into_a_directory_with_checkpoints(capsys, tmp_path):
    _fake_checkpoint(tmp_path / "run")
    code, err, _ = _train(capsys, "--out", str(tmp_path / "run"))
    assert code == 2 and "already holds checkpoints" in err and "--resume" in err


def test_damaged_checkpoint(capsys, tmp_path):
    ckpt = _fake_checkpoint(tmp_path / "run")
    code, err, _ = _train(capsys, "--resume", "--out", str(tmp_path / "run"))
    assert code == 2 and "damaged" in err and ckpt.name in err


def test_resume_past_the_last_step(capsys, tmp_path):
    _real_checkpoint(tmp_path / "run", step=10)
    code, err, _ = _train(capsys, "--resume", "--steps", "8", "--out", str(tmp_path / "run"))
    assert code == 2 and "nothing to do" in err


def test_local_dispatcher_with_ep2(capsys, tmp_path):
    code, err, _ = _train(capsys, "--set", 'parallel.dispatcher="local"', "--out", str(tmp_path / "run"))
    assert code == 2 and "dispatcher='local'" in err


def test_wrong_value_types(capsys, tmp_path):
    code, err, _ = _train(capsys, "--set", "train.resume=False", "--out", str(tmp_path / "run"))
    assert code == 2 and "train.resume" in err and "true or false" in err


@pytest.mark.parametrize("cmd", [["sample", "--prompt", "def "], ["eval", "--data", "x.jsonl"]])
def test_device_cuda_without_a_gpu_is_one_line(capsys, tmp_path, monkeypatch, cmd):
    # Was an AssertionError traceback from torch's lazy CUDA init (exit 1); train.device=cuda is refused the same way.
    import torch
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert main([cmd[0], str(tmp_path), *cmd[1:], "--device", "cuda"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "--device cuda but no CUDA device is visible" in err, err


@pytest.mark.parametrize("flag", ["--max-batches", "--micro-batch-size"])
def test_eval_zero_batches_is_refused(capsys, tmp_path, flag):
    # --max-batches 0 printed loss 0.0000 / perplexity 1.000 over 0 tokens (exit 0); --micro-batch-size 0 meant the
    # run's size, silently.
    assert main(["eval", str(tmp_path), "--data", "x.jsonl", flag, "0"]) == 2
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and f"{flag} 0 must be >= 1" in err, err


def test_eval_json_on_stdout_is_json_alone(capsys, monkeypatch):
    # `moetrain eval ... --json` printed the table and the JSON both on stdout: `| jq` could not parse it.
    from moetrain.train import evaluate
    report = evaluate.EvalReport("r", "r/checkpoints/step_00000002", 2, 64, "one process on cpu",
                                 [evaluate.SourceLoss("a.jsonl", 128, 2.0)])
    monkeypatch.setattr(evaluate, "evaluate_run", lambda *a, **k: report)
    assert main(["eval", "r", "--data", "a.jsonl", "--json"]) == 0
    out, err = capsys.readouterr()
    assert json.loads(out)["total"]["tokens"] == 128 and "a.jsonl" in err


def test_preset_typo_guesses_the_preset(capsys, tmp_path):
    code, err, _ = _train(capsys, "--preset", "qwen3-tiyn", "--out", str(tmp_path / "run"))
    assert code == 2 and "unknown model preset 'qwen3-tiyn' (did you mean 'qwen3-tiny'?)" in err, err


def test_eval_text_field_reaches_the_reader(capsys, monkeypatch, tmp_path):
    # The missing-field error told eval users to `--set data.text_field=NAME`, an option eval does not have; eval now
    # takes --text-field (default: the run's data.text_field) and the message names it.
    from moetrain.data.corpus import DataError, iter_documents
    from moetrain.train import evaluate
    seen = {}

    def fake(run_dir, data, **kw):
        seen.update(kw)
        return evaluate.EvalReport("r", "c", 1, 64, "one process on cpu", [evaluate.SourceLoss("a", 1, 1.0)])
    monkeypatch.setattr(evaluate, "evaluate_run", fake)
    assert main(["eval", "r", "--data", "a.jsonl", "--text-field", "content"]) == 0
    assert seen["text_field"] == "content"
    f = tmp_path / "c.jsonl"
    f.write_text(json.dumps({"content": "x = 1"}) + "\n")
    with pytest.raises(DataError, match="moetrain eval: --text-field NAME"):
        list(iter_documents([f], "text"))
    assert list(iter_documents([f], "content")) == ["x = 1"]
