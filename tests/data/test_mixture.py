"""Weighted mixtures of sources: the schedule's shares, the loader's windows, determinism, resume exactly, the
prepared shards, and the configuration forms (tables, compact strings, errors naming the source)."""

from __future__ import annotations

import json

import numpy as np
import pytest
import torch

from moetrain.data import (DataConfig, DataError, DataSource, MixtureLoader, TokenLoader, mixture_counts,
                           mixture_report, mixture_schedule, parse_source_spec, prepare_data, train_loader)
from moetrain.data.progress import PrepProgress
from moetrain.errors import ConfigError

L = 8
BASE = 100_000  # source s's token i is s * BASE + i: a window names its source and its index


def _sources(*n_windows: int) -> list[np.ndarray]:
    return [s * BASE + np.arange(n * L + 1, dtype=np.int64) for s, n in enumerate(n_windows)]


def _ident(x: torch.Tensor) -> list[tuple[int, int]]:
    """(source, window) of each row, from its first input token."""
    first = x[:, 0].tolist()
    return [(t // BASE, (t % BASE) // L) for t in first]


def test_schedule_realises_the_weights_exactly_per_rank_and_deterministically():
    w = [3.0, 1.0, 0.5]
    n = 9000
    counts = mixture_counts(n, w, seed=0)
    want = np.array(w) / sum(w) * n
    assert counts.sum() == n and np.abs(counts - want).max() <= 3  # a low-discrepancy sequence, not a coin toss
    src = mixture_schedule(np.arange(n), w, seed=0)
    for dp in (2, 3, 8):  # each rank's positions r, r + dp, ... get the weights too
        for r in range(dp):
            mine = np.bincount(src[r::dp], minlength=3)
            assert np.abs(mine - np.array(w) / sum(w) * len(src[r::dp])).max() <= 4, (dp, r)
    assert np.array_equal(src, mixture_schedule(np.arange(n), w, seed=0))
    other = mixture_schedule(np.arange(n), w, seed=1)
    assert not np.array_equal(src, other) and np.abs(np.bincount(other, minlength=3) - want).max() <= 3
    # the chunked count is the schedule's count
    assert np.array_equal(mixture_counts(n, w, 0, chunk=1000), np.bincount(src, minlength=3))


def test_batches_are_windows_of_the_scheduled_source():
    toks = _sources(40, 25)
    ld = MixtureLoader(toks, [2.0, 1.0], L, 6, seed=3)
    src_expected = mixture_schedule(np.arange(60), [2.0, 1.0], seed=3)
    seen = []
    for b in range(10):
        x, y = ld.next_batch()
        assert x.shape == y.shape == (6, L) and x.dtype == torch.int64
        assert torch.equal(y[:, :-1], x[:, 1:]) and torch.equal(y[:, -1], x[:, -1] + 1)
        seen += _ident(x)
    assert [s for s, _ in seen] == src_expected.tolist()
    for s, n in ((0, 40), (1, 25)):
        drawn = [w for t, w in seen if t == s]
        first_epoch = drawn[:n]
        assert len(set(first_epoch)) == len(first_epoch) and all(0 <= w < n for w in drawn)  # no repeat in an epoch
        order = ld.window_order(s, 0)
        assert first_epoch == order[:len(first_epoch)].tolist()
    assert ld.state_dict()["taken"] == np.bincount(src_expected, minlength=2).tolist()
    same, other = MixtureLoader(toks, [2.0, 1.0], L, 6, seed=3), MixtureLoader(toks, [2.0, 1.0], L, 6, seed=4)
    first = [(same.next_batch()[0], other.next_batch()[0]) for _ in range(10)]
    assert [_ident(a) for a, _ in first] == [seen[6 * b: 6 * b + 6] for b in range(10)]  # same seed, same stream
    assert [_ident(b) for _, b in first] != [_ident(a) for a, _ in first]


def test_a_small_source_repeats_reshuffled_each_epoch():
    ld = MixtureLoader(_sources(50, 3), [1.0, 1.0], L, 4)
    seen = [w for _ in range(10) for s, w in _ident(ld.next_batch()[0]) if s == 1]
    assert len(seen) >= 15
    for e in range(len(seen) // 3):
        assert sorted(seen[3 * e: 3 * e + 3]) == [0, 1, 2]
        assert seen[3 * e: 3 * e + 3] == ld.window_order(1, e).tolist()


def test_ranks_split_the_one_global_stream():
    toks, w, dp, b = _sources(30, 20, 10), [1.0, 2.0, 0.5], 3, 2
    whole = MixtureLoader(toks, w, L, b * dp, seed=5)
    ranks = [MixtureLoader(toks, w, L, b, dp_rank=r, dp_size=dp, seed=5) for r in range(dp)]
    for _ in range(12):
        x = whole.next_batch()[0]
        for r, ld in enumerate(ranks):
            assert torch.equal(ld.next_batch()[0], x[r::dp])


@pytest.mark.parametrize("dp_after,b_after", [(1, 4), (2, 2)])
def test_resume_continues_exactly_as_an_uninterrupted_run(dp_after, b_after):
    toks, w = _sources(30, 12), [1.0, 3.0]
    run = MixtureLoader(toks, w, L, 4, seed=9)
    for _ in range(7):
        run.next_batch()
    state = json.loads(json.dumps(run.state_dict()))  # as a checkpoint stores it
    after = [run.next_batch()[0] for _ in range(6)]  # the uninterrupted run's next 24 sequences
    resumed = [MixtureLoader(toks, w, L, b_after, dp_rank=r, dp_size=dp_after, seed=9) for r in range(dp_after)]
    for ld in resumed:
        ld.load_state_dict(state)
    got = []
    for _ in range(6 * 4 // (b_after * dp_after)):
        batches = [ld.next_batch()[0] for ld in resumed]
        step = torch.empty(b_after * dp_after, L, dtype=torch.int64)
        for r, x in enumerate(batches):
            step[r::dp_after] = x
        got.append(step)
    assert torch.equal(torch.cat(got), torch.cat(after))


def test_resume_refuses_another_stream():
    toks = _sources(30, 12)
    ld = MixtureLoader(toks, [1.0, 3.0], L, 4, seed=9)
    ld.next_batch()
    state = ld.state_dict()
    with pytest.raises(ValueError, match=r"weights=\[1.0, 3.0\] but this run has weights=\[1.0, 2.0\]"):
        MixtureLoader(toks, [1.0, 2.0], L, 4, seed=9).load_state_dict(state)
    with pytest.raises(ValueError, match="seed=9"):
        MixtureLoader(toks, [1.0, 3.0], L, 4, seed=1).load_state_dict(state)
    with pytest.raises(ValueError, match="3 sources"):
        MixtureLoader(_sources(30, 12, 5), [1.0, 3.0, 1.0], L, 4, seed=9).load_state_dict(state)
    with pytest.raises(ValueError, match="data.paths"):
        MixtureLoader(toks, [1.0, 3.0], L, 4).load_state_dict(TokenLoader(toks[0], L, 4).state_dict())
    with pytest.raises(ValueError):
        TokenLoader(toks[0], L, 4).load_state_dict(state)


def test_a_source_without_one_window_is_named():
    with pytest.raises(DataError, match="source tiny has 5 training tokens"):
        MixtureLoader([np.arange(100), np.arange(5)], [1, 1], L, 2, labels=["big", "tiny"])


# ------------------------------------------------------------------------------------------------ configuration
def test_compact_specs_and_tables():
    assert parse_source_spec("web/*.jsonl") == DataSource(path="web/*.jsonl")
    assert parse_source_spec("hub:wikitext, config=wikitext-2-raw-v1, weight=2.5, streaming=true") == DataSource(
        name="wikitext", config="wikitext-2-raw-v1", weight=2.5, streaming=True)
    cfg = DataConfig(sources=["a.txt,weight=3,split=test,text_field=body", {"name": "x", "weight": 1}])
    assert cfg.sources == [DataSource(path="a.txt", weight=3.0, split="test", text_field="body"),
                           DataSource(name="x")]
    assert [s.label for s in cfg.sources] == ["a.txt", "hub:x"]
    for bad, match in (("a.txt,weight=heavy", "weight='heavy' is not a number"),
                       ("a.txt,colour=red", "'colour=red' is not KEY=VALUE with KEY one of config, split"),
                       ("a.txt,streaming=maybe", "streaming='maybe' must be true or false"),
                       (",weight=1", "name a path or hub:NAME first")):
        with pytest.raises(ConfigError, match=match):
            DataConfig(sources=[bad])
    with pytest.raises(ConfigError, match=r"data.sources\[0\] has unknown key\(s\) 'wieght'; valid keys: path"):
        DataConfig(sources=[{"path": "a", "wieght": 2}])


@pytest.mark.parametrize("source,match", [
    (DataSource(path="a", weight=0), r"data.sources\[0\] \(a\): weight must be a positive number.*got 0"),
    (DataSource(path="a", weight=-1.5), "weight must be a positive number"),
    (DataSource(path="a", weight=float("nan")), "weight must be a positive number"),
    (DataSource(path="a", weight="2"), "weight must be a positive number"),
    (DataSource(path="a", weight=True), "weight must be a positive number"),
    (DataSource(), "must name exactly one of path .* and name"),
    (DataSource(path="a", name="b"), "must name exactly one of path"),
    (DataSource(path="a", split=""), "split must be a non-empty split name"),
    (DataSource(name="b", streaming="yes"), "streaming must be true or false"),
])
def test_bad_sources_are_refused_by_name(source, match):
    with pytest.raises(ValueError, match=match):
        DataConfig(sources=[source]).validate()


def test_paths_and_sources_together_are_refused():
    with pytest.raises(ValueError, match="data.paths=.*and data.sources .* are both given"):
        DataConfig(paths=["a.txt"], sources=["b.txt"]).validate()


def test_job_file_tables_cli_form_and_saved_job_round_trip(tmp_path):
    from moetrain.cli import build_parser, job_from_args
    from moetrain.config import load_job_config, save_job_config

    f = tmp_path / "job.toml"
    f.write_text('[data]\nseq_len = 64\n\n[[data.sources]]\npath = "web/*.jsonl"\nweight = 3\n\n'
                 '[[data.sources]]\nname = "wikitext"\nconfig = "wikitext-2-raw-v1"\n')
    job = load_job_config(f)
    assert job.data.sources == [DataSource(path="web/*.jsonl", weight=3.0),
                                DataSource(name="wikitext", config="wikitext-2-raw-v1")]
    for suffix in (".toml", ".json"):
        again = load_job_config(save_job_config(job, tmp_path / f"saved{suffix}"))
        assert again.data == job.data
    cli = job_from_args(build_parser().parse_args(
        ["prepare", "--source", "web/*.jsonl,weight=3", "--source", "hub:wikitext,config=wikitext-2-raw-v1"]),
        fit_world=False)
    assert cli.data.sources == job.data.sources
    sets = job_from_args(build_parser().parse_args(
        ["prepare", "--set", 'data.sources=[{path="web/*.jsonl", weight=3}, "hub:wikitext,config=wikitext-2-raw-v1"]']),
        fit_world=False)
    assert sets.data.sources == job.data.sources


# ----------------------------------------------------------------------------------------------- preparation
QUIET = PrepProgress(enabled=False)


def _write_jsonl(path, tag: str, n: int) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps({"text": f"{tag} {i}: " + "lorem ipsum dolor " * (4 + i % 6)}) + "\n"
                            for i in range(n)))


def test_prepare_mixture_shards_per_source_and_weights_do_not_retokenise(tmp_path):
    _write_jsonl(tmp_path / "a" / "a.jsonl", "alpha", 40)
    _write_jsonl(tmp_path / "b" / "b.jsonl", "beta", 15)
    srcs = [f"{tmp_path}/a/*.jsonl,weight=3", f"{tmp_path}/b/b.jsonl"]
    cfg = DataConfig(sources=srcs, vocab_size=300, seq_len=16, cache_dir=str(tmp_path / "cache"), val_fraction=0.1)
    prep = prepare_data(cfg, QUIET)
    assert not prep.reused and [s.label for s in prep.sources] == [f"{tmp_path}/a/*.jsonl", f"{tmp_path}/b/b.jsonl"]
    assert [s.n_docs for s in prep.sources] == [40, 15] and [s.weight for s in prep.sources] == [3.0, 1.0]
    for s in prep.sources:
        assert len(np.fromfile(s.train_path, dtype=np.uint16)) == s.n_train_tokens > 0
    assert prep.n_train_tokens == sum(s.n_train_tokens for s in prep.sources)
    assert len(np.fromfile(prep.val_path, dtype=np.uint16)) == prep.n_val_tokens == sum(
        s.n_val_tokens for s in prep.sources)
    ld = train_loader(prep, 16, 4, seed=0)
    assert isinstance(ld, MixtureLoader) and ld.weights == [3.0, 1.0]
    cfg.sources[0].weight = 1.0  # another mixture of the same shards
    again = prepare_data(cfg, QUIET)
    assert again.reused and again.data_dir == prep.data_dir and [s.weight for s in again.sources] == [1.0, 1.0]
    rows = mixture_report(again, 16, 1000, seed=0)
    assert [r["drawn"] for r in rows] == mixture_counts(1000, [1.0, 1.0], 0).tolist()
    assert rows[0]["share"] == pytest.approx(0.5, abs=0.003) and rows[0]["weight"] == 0.5
    windows_b = (prep.sources[1].n_train_tokens - 1) // 16
    assert rows[1]["epochs"] == pytest.approx(rows[1]["drawn"] / windows_b)


def test_a_missing_source_is_named(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", "alpha", 5)
    cfg = DataConfig(sources=[str(tmp_path / "a.jsonl"), f"{tmp_path}/nowhere/*.jsonl,weight=2"],
                     cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError) as e:
        prepare_data(cfg, QUIET)
    assert str(e.value).startswith(f"data.sources[1] ({tmp_path}/nowhere/*.jsonl): data pattern")
    assert "matched no files" in str(e.value) and not (tmp_path / "cache").exists()  # refused before any work


def test_prepare_command_prints_each_source_and_the_realised_mixture(tmp_path, capsys):
    from moetrain.cli import main

    _write_jsonl(tmp_path / "a.jsonl", "alpha", 40)
    _write_jsonl(tmp_path / "b.jsonl", "beta", 20)
    args = ["prepare", "--source", f"{tmp_path}/a.jsonl,weight=3", "--source", f"{tmp_path}/b.jsonl",
            "--set", "data.vocab_size=300", "--set", "data.seq_len=16", "--set", f'data.cache_dir="{tmp_path}/c"',
            "--set", "train.steps=10", "--set", "train.micro_batch_size=4", "--set", "train.grad_accum=1"]
    assert main(args) == 0
    out = capsys.readouterr().out
    lines = {line.split()[0]: line.split() for line in out.splitlines() if line.startswith(str(tmp_path))}
    a, b = lines[f"{tmp_path}/a.jsonl"], lines[f"{tmp_path}/b.jsonl"]
    counts = mixture_counts(40, [3.0, 1.0], 0)
    assert a[1] == "40" and b[1] == "20" and a[5] == "75.0%" and b[5] == "25.0%"
    assert a[6] == f"{counts[0] / 40:.1%}" and b[6] == f"{counts[1] / 40:.1%}"
    assert "first 40 training sequences" in out
    assert main(["prepare", "--source", f"{tmp_path}/a.jsonl,weight=-1"]) == 2
    assert "data.sources[0]" in capsys.readouterr().err


def test_a_source_without_text_is_named(tmp_path):
    _write_jsonl(tmp_path / "a.jsonl", "alpha", 10)
    (tmp_path / "b.jsonl").write_text('{"text": ""}\n{"text": null}\n')
    cfg = DataConfig(sources=[str(tmp_path / "a.jsonl"), str(tmp_path / "b.jsonl")], vocab_size=300,
                     cache_dir=str(tmp_path / "cache"))
    with pytest.raises(DataError, match=r"^data.sources\[1\] \(.*b.jsonl\): the corpus has no non-empty documents"):
        prepare_data(cfg, QUIET)
    assert not list((tmp_path / "cache").glob("mix-*/"))  # no half-built preparation is left
