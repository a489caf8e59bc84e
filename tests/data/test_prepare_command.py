"""``moetrain prepare`` and the progress report of data preparation (also inside ``moetrain train``)."""

from __future__ import annotations

import io
import re
from pathlib import Path

import pytest

from moetrain.cli import main
from moetrain.data import DataConfig, prepare_data, write_shards

FAST = ["--set", "data.builtin_max_bytes=400000", "--set", "data.vocab_size=1024"]


def test_prepare_prints_the_cache_that_train_reuses(capsys, tmp_path):
    cache = tmp_path / "cache"
    args = [*FAST, "--set", f'data.cache_dir="{cache}"']
    assert main(["prepare", *args]) == 0
    out = capsys.readouterr().out
    data_dir = Path(re.search(r"^data cache: (.+)$", out, re.M).group(1))
    assert data_dir.parent == cache and (data_dir / "meta.json").is_file() and "prepared:" in out

    # moetrain train's preflight (same options) finds it and prepares nothing
    from moetrain.cli import build_parser, job_from_args
    from moetrain.train.launch import preflight

    job = job_from_args(build_parser().parse_args(["train", *args, "--out", str(tmp_path / "run")]))
    prep = preflight(job, 2)
    assert prep.reused and Path(prep.data_dir) == data_dir
    assert main(["prepare", *args]) == 0
    assert "reused:" in capsys.readouterr().out


def test_prepare_bad_input_exits_2(capsys, tmp_path):
    assert main(["prepare", "--data", str(tmp_path / "none/*.jsonl")]) == 2
    assert "matched no files" in capsys.readouterr().err


def test_prepare_data_reports_progress_by_default(capsys, tmp_path, text_corpus):
    cfg = DataConfig(paths=[str(text_corpus / "*.txt")], vocab_size=300, val_fraction=0.2,
                     cache_dir=str(tmp_path / "cache"))
    prepare_data(cfg)
    err = capsys.readouterr().err  # pytest's capture is no terminal: plain lines
    assert "[moetrain] data: preparing 6 file(s)" in err
    assert "training a 300-token BPE" in err and "tokenising" in err and "done in" in err
    assert "training + " in err
    prepare_data(cfg)
    assert "[moetrain] data: reusing" in capsys.readouterr().err


def test_prepare_data_is_quiet_off_local_rank_0(capsys, monkeypatch, tmp_path, text_corpus):
    monkeypatch.setenv("LOCAL_RANK", "1")
    prepare_data(DataConfig(paths=[str(text_corpus / "*.txt")], vocab_size=300, cache_dir=str(tmp_path / "c")))
    assert capsys.readouterr().err == ""


def test_live_bar_and_plain_lines():
    from moetrain.data.progress import PrepProgress

    buf = io.StringIO()
    rep = PrepProgress(file=buf, live=True)
    with rep.phase("tokenising", total=4e6) as update:
        update(2e6)
    assert "[moetrain] data: tokenising" in buf.getvalue() and "4/4 MB" in buf.getvalue()
    buf = io.StringIO()
    with PrepProgress(file=buf, live=False).phase("tokenising", total=4e6) as update:
        update(2e6)
    assert buf.getvalue().startswith("[moetrain] data: tokenising (4.0 MB) ...\n") and "done in" in buf.getvalue()
    buf = io.StringIO()
    with PrepProgress(enabled=False, file=buf).phase("x", total=1) as update:
        update(1)
    assert buf.getvalue() == ""


def test_write_shards_reports_the_text_it_tokenised(tmp_path, char_tok, monkeypatch):
    import moetrain.data.shards as shards

    monkeypatch.setattr(shards, "BATCH_CHARS", 1000)
    docs = [f"document {i}: " + "some text. " * (20 + 10 * i) for i in range(8)]
    seen: list[int] = []
    write_shards(iter(docs), char_tok, tmp_path / "s", val_fraction=0.2, on_progress=seen.append)
    assert len(seen) > 2 and seen == sorted(seen) and seen[-1] == sum(len(d) for d in docs)


@pytest.mark.parametrize("preset", ["tiny", "small"])
def test_prepare_and_train_agree_on_the_bpe_size(preset):
    """The cache key holds data.vocab_size, which defaults to the preset's vocabulary: the same --preset gives
    prepare and train the same data section."""
    from moetrain.cli import build_parser, job_from_args

    p = build_parser()
    a = job_from_args(p.parse_args(["prepare", "--preset", preset]), fit_world=False)
    b = job_from_args(p.parse_args(["train", "--preset", preset]), fit_world=False)
    assert a.data == b.data
