"""``moetrain eval`` takes the sources training takes: a run trained on a 2-source mixture (a ``datasets``
``save_to_disk`` folder and a JSON-lines file with its own text key) is scored on its own validation split, one row
per source, equal to the file-based eval of exactly those held-out documents, and over both to the validation loss
the trainer logged; ``--data`` with a datasets folder, a hub name from the local cache and a plain file of the same
text gives the same numbers; bad sources are one line naming ``--data``, exit 2. The trainer's validation (EP 2)
scored each source on its own windows, as eval does with ``--max-batches`` its share, and logged their
weight-averaged mean."""

from __future__ import annotations

import dataclasses
import json
import math
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch

datasets = pytest.importorskip("datasets")

from moetrain.cli import main  # noqa: E402
from moetrain.data import DataError, load_tokens, prepared_data  # noqa: E402
from moetrain.train.evaluate import evaluate_run, run_validation  # noqa: E402
from moetrain.train.load import open_run  # noqa: E402
from moetrain.train.trackers import tracker_scalars  # noqa: E402
from moetrain.train.validation import split_eval_batches  # noqa: E402

pytestmark = pytest.mark.dist

SEQ, MBS, EVAL_BATCHES, WEIGHTS = 32, 2, 3, (2, 1)


def _prose(n: int) -> list[str]:
    return [f"Paragraph {i}. The experts route tokens; the router balances load across {i % 7 + 2} groups. " * 2
            for i in range(n)]


def _code(n: int) -> list[str]:
    return [f"def f{i}(x):\n    return x * {i} + {i % 5}\n\n" * 3 for i in range(n)]


def _jsonl(path: Path, docs: list[str], key: str = "text") -> str:
    path.write_text("".join(json.dumps({key: d}) + "\n" for d in docs))
    return str(path)


@pytest.fixture(scope="module")
def mix(tmp_path_factory) -> dict[str, Path | str]:
    """The corpus (prose as a save_to_disk folder, as a .jsonl and in a hub cache as 'tinyprose'; code as a .jsonl
    with key 'body') and a 2-step EP-2 run on the mixture of the saved folder and the code file."""
    d = tmp_path_factory.mktemp("evalsrc")
    prose, code = _prose(100), _code(100)
    saved = d / "prose_saved"
    datasets.Dataset.from_dict({"text": prose}).save_to_disk(str(saved))
    repo = d / "repo" / "tinyprose"
    (repo / "data").mkdir(parents=True)
    datasets.Dataset.from_dict({"text": prose}).to_parquet(str(repo / "data/train-00000-of-00001.parquet"))
    datasets.load_dataset(str(repo), cache_dir=str(d / "hfcache"))
    shutil.rmtree(d / "repo")
    (d / "emptydir").mkdir()
    files = {"saved": str(saved), "prose": _jsonl(d / "prose.jsonl", prose),
             "code": _jsonl(d / "code.jsonl", code, "body"), "hfcache": str(d / "hfcache")}
    _train_mixture(d, d / "run", str(saved), files["code"], "--ep", "2", "--steps", "2")
    return {**files, "run": d / "run", "dir": d, "prose_docs": prose, "code_docs": code}


def _train_mixture(d: Path, out: Path, prose: str, code: str, *layout: str) -> None:
    """Train on 2 processes at ``layout`` (and its steps) on the mixture prose:code = WEIGHTS, validating
    EVAL_BATCHES batches and checkpointing at the last step."""
    cmd = [sys.executable, "-m", "moetrain", "train", "--out", str(out), "--nproc", "2", *layout,
           "--source", f"{prose},weight={WEIGHTS[0]}", "--source", f"{code},weight={WEIGHTS[1]},text_field=body",
           "--set", f'data.cache_dir="{d / "cache"}"', "--set", f'data.hf_cache_dir="{d / "hfcache"}"',
           "--set", "data.val_fraction=0.2", "--set", "data.vocab_size=512", "--set", "model.vocab_size=512",
           "--set", f"data.seq_len={SEQ}", "--set", f"train.micro_batch_size={MBS}",
           "--set", f"train.eval_batches={EVAL_BATCHES}", "--set", "train.eval_every=2",
           "--set", "train.ckpt_every=2",
           "--set", "train.tensorboard=false", "--set", "train.threads_per_proc=1"]
    p = subprocess.run(cmd, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout + p.stderr


def _held_out_docs(mix, index: int, docs: list[str]) -> list[str]:
    """The documents of source ``index`` in the run's validation split, in order: its val tokens cut at each
    end-of-document token, each matched to the one source document that tokenises to it."""
    run = open_run(mix["run"])
    tok = run.tokenizer()
    by_ids = {tuple(tok.encode(doc)): doc for doc in docs}
    ids = np.asarray(load_tokens(prepared_data(run.job.data, run.data["data_key"]).sources[index].val_path))
    cuts = np.flatnonzero(ids == tok.eos_id)
    pieces = [tuple(int(t) for t in ids[lo + 1 if k else 0:hi]) for k, (lo, hi) in
              enumerate(zip([-1, *cuts[:-1]], cuts))]
    assert len(pieces) >= 5 and cuts[-1] == len(ids) - 1
    return [by_ids[p] for p in pieces]


def test_own_validation_split_per_source_equals_the_file_eval_of_its_documents_and_the_logged_loss(mix):
    own = evaluate_run(mix["run"])
    assert [s.name for s in own.sources] == [f"{mix['saved']} (validation)", f"{mix['code']} (validation)"]
    held = [_held_out_docs(mix, 0, mix["prose_docs"]), _held_out_docs(mix, 1, mix["code_docs"])]
    assert len(held[0]) < len(mix["prose_docs"]) and len(held[1]) < len(mix["code_docs"])
    files = [_jsonl(mix["dir"] / f"held{i}.jsonl", docs) for i, docs in enumerate(held)]
    by_file = evaluate_run(mix["run"], files)
    for s_own, s_file in zip(own.sources, by_file.sources):
        assert s_own.tokens == s_file.tokens > 0
        assert math.isclose(s_own.loss, s_file.loss, rel_tol=1e-6), (s_own, s_file)
    assert own.sources[0].loss != own.sources[1].loss
    assert own.total.tokens == sum(s.tokens for s in own.sources)


@pytest.mark.parametrize("layout", ["ep2", pytest.param("pp2", marks=pytest.mark.slow)])
def test_the_trainers_validation_scores_every_source_and_logs_the_weighted_mean(mix, layout):
    """The trainer gave source i n_i of eval_batches=3 batches per data rank (weights 2:1 -> 2 and 1), so it
    scored the first D x n_i x MBS windows of that source's own validation split (D data ranks: 2 at EP 2, 1 at
    PP 2): eval's row with --max-batches D x n_i. It logged each source's loss and val_loss = (2 a + b) / 3. (It
    scored the first source's windows only, of the file holding the sources' validation tokens one after the
    other.)"""
    run, dp = mix["run"], 2
    if layout == "pp2":
        run, dp = mix["dir"] / "run_pp2", 1
        if not run.exists():
            _train_mixture(mix["dir"], run, mix["saved"], mix["code"], "--pp", "2", "--steps", "2")
    par = open_run(run).job.parallel
    assert (par.ep, par.pp) == ((2, 1) if layout == "ep2" else (1, 2)), par
    logged = [json.loads(line) for line in (run / "metrics.jsonl").read_text().splitlines()]
    rec = {r["step"]: r for r in logged if r.get("kind") == "val"}[2]
    counts = split_eval_batches(WEIGHTS, EVAL_BATCHES)
    assert counts == [2, 1]
    labels = [mix["saved"], mix["code"]]
    assert list(rec["val_loss_by_source"]) == labels
    whole = evaluate_run(run).sources
    for i, (label, n, row) in enumerate(zip(labels, counts, whole)):
        assert row.tokens > dp * n * MBS * SEQ  # the trainer's share is a strict prefix of the split
        part = evaluate_run(run, max_batches=dp * n).sources[i]
        assert part.tokens == dp * n * MBS * SEQ
        assert math.isclose(rec["val_loss_by_source"][label], part.loss, rel_tol=1e-5), (label, part, rec)
        assert not math.isclose(part.loss, row.loss, rel_tol=1e-5)
    a, b = (rec["val_loss_by_source"][k] for k in labels)
    assert a != b
    assert math.isclose(rec["val_loss"], (WEIGHTS[0] * a + WEIGHTS[1] * b) / sum(WEIGHTS), rel_tol=1e-12), rec
    assert math.isclose(rec["val_ppl"], math.exp(rec["val_loss"]), rel_tol=1e-12)
    summary = logged[-1]
    assert summary["kind"] == "summary" and summary["val_loss_by_source"] == rec["val_loss_by_source"]
    assert {f"val/val_loss_by_source/{k.lstrip('/')}" for k in labels} <= set(tracker_scalars(rec))


def test_datasets_folder_hub_name_and_file_of_the_same_text_agree(mix, monkeypatch, tmp_path):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    monkeypatch.chdir(tmp_path)  # no folder 'tinyprose' here: the name can only come from the run's hf_cache_dir
    specs = [mix["saved"], "hub:tinyprose", f"{mix['saved']},split=train,weight=5", mix["prose"],
             f"{mix['code']},text_field=body"]
    rep = evaluate_run(mix["run"], specs, max_batches=3)
    assert [s.name for s in rep.sources] == specs
    first = rep.sources[0]
    assert first.tokens == 3 * MBS * SEQ
    for s in rep.sources[1:4]:
        assert (s.tokens, s.loss) == (first.tokens, first.loss), s
    assert rep.sources[4].loss != first.loss


def test_eval_cli_without_data_prints_a_row_per_source(mix, capsys):
    assert main(["eval", str(mix["run"]), "--json"]) == 0
    rep = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rep["sources"]] == [f"{mix['saved']} (validation)", f"{mix['code']} (validation)"]
    assert rep["total"]["name"] == "all"
    assert rep["total"]["tokens"] == sum(r["tokens"] for r in rep["sources"])


@pytest.mark.parametrize("data,needles", [
    ("{d}/missing.jsonl", ["--data {d}/missing.jsonl: data file", "does not exist", "check the path given to --data"]),
    ("{d}/nodir/", ["--data {d}/nodir/", "does not exist"]),
    ("hub:nosuchset", ["--data hub:nosuchset: not in the local Hugging Face datasets cache", "HF_DATASETS_OFFLINE=0"]),
    ("{d}/emptydir", ["--data {d}/emptydir: the folder holds no data file", "save_to_disk"]),
    ("{d}/prose.jsonl,colour=red", ["--data=", "'colour=red' is not KEY=VALUE"]),
    ("{d}/prose.jsonl,weight=-1", ["--data", "weight must be a positive number"]),
], ids=["missing_file", "missing_dir", "hub_not_cached", "not_a_dataset", "bad_key", "bad_weight"])
def test_bad_sources_are_one_line_naming_data_and_exit_2(mix, capsys, monkeypatch, data, needles):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)
    d = mix["dir"]
    assert main(["eval", str(mix["run"]), "--data", data.format(d=d), "--max-batches", "1"]) == 2
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "data.paths" not in err, err
    for needle in needles:
        assert needle.format(d=d) in err, err


def test_no_recorded_validation_data_names_data(mix, capsys):
    run = open_run(mix["run"])
    with pytest.raises(DataError, match="records no validation data.*--data"):
        run_validation(dataclasses.replace(run, data={}))
    cache = Path(run.job.data.cache_dir)
    cache.rename(cache.with_name("moved"))
    try:
        assert main(["eval", str(mix["run"])]) == 2
    finally:
        cache.with_name("moved").rename(cache)
    err = capsys.readouterr().err
    assert len(err.strip().splitlines()) == 1 and "is not in data.cache_dir" in err and "--data" in err, err
