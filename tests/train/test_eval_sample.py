"""``moetrain eval`` and ``moetrain sample`` on a run trained at EP 2: the checkpoint read into one process gives
the trainer's own validation loss at that step; one process, EP 2 and PP 2 agree per source; the total is
token-weighted; sampling is deterministic per seed; bad input is one line and exit 2."""

from __future__ import annotations

import json
import math
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from moetrain.cli import main
from moetrain.data import iter_eval_batches, load_tokens, prepare_data
from moetrain.model.transformer import build_model
from moetrain.train.evaluate import evaluate_run, model_loss_sums, rank_batches
from moetrain.train.load import load_run_model, open_run
from moetrain.train.sample import sample_run

pytestmark = pytest.mark.dist

SEQ, MBS, EVAL_BATCHES = 32, 4, 2


@pytest.fixture(scope="module")
def run(tmp_path_factory) -> Path:
    d = tmp_path_factory.mktemp("evalrun")
    cmd = [sys.executable, "-m", "moetrain", "train", "--out", str(d / "run"), "--nproc", "2", "--ep", "2",
           "--steps", "2", "--set", f'data.cache_dir="{d / "cache"}"', "--set", "data.builtin_max_bytes=200000",
           "--set", "data.vocab_size=512", "--set", "model.vocab_size=512", "--set", f"data.seq_len={SEQ}",
           "--set", f"train.micro_batch_size={MBS}", "--set", f"train.eval_batches={EVAL_BATCHES}",
           "--set", "train.eval_every=2", "--set", "train.ckpt_every=2", "--set", "train.tensorboard=false",
           "--set", "train.threads_per_proc=1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr
    return d / "run"


@pytest.fixture(scope="module")
def sources(run) -> list[str]:
    a, b = run.parent / "a.jsonl", run.parent / "b.txt"
    a.write_text("".join(json.dumps({"text": f"def add_{i}(a, b):\n    return a + b * {i}\n"}) + "\n"
                         for i in range(60)))
    b.write_text("import os\n\nclass Thing:\n    pass\n" * 40)
    return [str(a), str(b)]


def test_the_one_process_model_gives_the_trainers_validation_loss(run):
    """The EP-2 checkpoint, read whole into one process, scores the trainer's validation windows (rank r's windows
    r, r+2, ...; eval_batches batches each) to the val loss the EP-2 trainer logged at that step."""
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val_loss"] for r in logged if r.get("kind") == "val"}[2]
    ckpt = open_run(run)
    assert ckpt.step == 2
    tokens = load_tokens(prepare_data(ckpt.job.data).val_path)
    model = load_run_model(ckpt)
    batches = [b for r in (0, 1) for b in iter_eval_batches(tokens, SEQ, MBS, r, 2, EVAL_BATCHES)]
    ce, n = model_loss_sums(model, batches)
    assert n == 2 * EVAL_BATCHES * MBS * SEQ
    assert math.isclose(ce / n, val, rel_tol=1e-5), (ce / n, val)
    init = build_model(ckpt.job.model, seed=ckpt.job.train.seed)  # what the trained weights started from
    assert not torch.equal(init.layers[1].mlp.experts.w13_E2FD, model.layers[1].mlp.experts.w13_E2FD)


def test_without_data_the_runs_own_validation_split_gives_the_logged_loss(run):
    """No ``--data``: the run's validation file, read from the preparation its checkpoint records; its first
    2 x EVAL_BATCHES x MBS windows are the ones the EP-2 trainer scored (rank r: windows r, r+2, ...)."""
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    val = {r["step"]: r["val_loss"] for r in logged if r.get("kind") == "val"}[2]
    rep = evaluate_run(run, max_batches=2 * EVAL_BATCHES)
    assert [s.name for s in rep.sources] == ["built-in corpus (validation)"]
    assert rep.sources[0].tokens == 2 * EVAL_BATCHES * MBS * SEQ
    assert math.isclose(rep.sources[0].loss, val, rel_tol=1e-5), (rep.sources[0], val)


@pytest.mark.parametrize("layout", [{"ep": 2}, pytest.param({"pp": 2}, marks=pytest.mark.slow)], ids=["ep2", "pp2"])
def test_one_process_and_a_parallel_layout_agree_per_source(run, sources, layout):
    one = evaluate_run(run, sources, max_batches=3)
    par = evaluate_run(run, sources, max_batches=3, nproc=2, **layout)
    assert [s.tokens for s in one.sources] == [s.tokens for s in par.sources]
    for s1, s2 in zip(one.sources, par.sources):
        assert math.isclose(s1.loss, s2.loss, rel_tol=1e-6), (s1, s2)
    # the scored tokens: full windows only, at most 3 batches of MBS windows
    assert one.sources[0].tokens == 3 * MBS * SEQ
    windows_b = (len(open_run(run).tokenizer().encode(Path(sources[1]).read_text())) + 1 - 1) // SEQ
    assert one.sources[1].tokens == min(windows_b, 3 * MBS) * SEQ


def test_eval_cli_table_json_and_the_weighted_total(run, sources, tmp_path, capsys):
    out = tmp_path / "eval.json"
    assert main(["eval", str(run), "--data", sources[0], "--data", sources[1], "--max-batches", "2",
                 "--json", str(out)]) == 0
    table = capsys.readouterr().out
    assert "perplexity" in table and "step 2" in table
    rep = json.loads(out.read_text())
    (a, b), total = rep["sources"], rep["total"]
    assert a["name"] == sources[0] and b["name"] == sources[1] and total["name"] == "all"
    assert total["tokens"] == a["tokens"] + b["tokens"]
    assert math.isclose(total["loss"], (a["loss"] * a["tokens"] + b["loss"] * b["tokens"]) / total["tokens"])
    for row in (a, b, total):
        assert math.isclose(row["perplexity"], math.exp(row["loss"]))
        assert f"{row['perplexity']:.3f}" in table
    assert a["loss"] != b["loss"]


def test_sample_is_deterministic_per_seed(run, capsys):
    assert main(["sample", str(run), "--prompt", "def ", "--max-new-tokens", "12"]) == 0
    printed = capsys.readouterr().out
    greedy = sample_run(run, "def ", max_new_tokens=12)
    assert printed == "def " + greedy + "\n"
    assert len(greedy.strip()) > 0
    kw = dict(max_new_tokens=12, temperature=1.0, top_p=0.9)
    assert sample_run(run, "def ", seed=1, **kw) == sample_run(run, "def ", seed=1, **kw)


@pytest.mark.parametrize("argv,needle", [
    (["eval", "{tmp}", "--data", "x.jsonl"], "no complete checkpoint"),
    (["eval", "{run}", "--data", "{tmp}/missing.jsonl"], "does not exist"),
    (["eval", "{run}", "--data", "{tmp}/short.txt"], "fewer than one"),
    (["eval", "{run}", "--data", "{tmp}/ok.txt", "--ep", "3"], "parallel.ep=3"),  # --nproc: ep x pp
    (["sample", "{run}", "--prompt", "def ", "--top-p", "0"], "--top-p"),
    (["sample", "{run}", "--prompt", "def ", "--max-new-tokens", "5000"], "max_seq_len"),
], ids=["no_checkpoint", "missing_data", "short_data", "bad_ep", "top_p", "too_long"])
def test_bad_input_is_one_line_and_exit_2(run, tmp_path, capsys, argv, needle):
    (tmp_path / "short.txt").write_text("x = 1\n")
    (tmp_path / "ok.txt").write_text("import os\n" * 200)
    argv = [a.format(tmp=tmp_path, run=run) for a in argv]
    assert main(argv) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and needle in err, err
