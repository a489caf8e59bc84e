import fcntl
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

from moetrain.data import DataConfig, DataError, PreparedData, TokenLoader, load_tokenizer, load_tokens, prepare_data


def _cfg(tmp_path, corpus, **kw) -> DataConfig:
    kw.setdefault("vocab_size", 300)
    kw.setdefault("val_fraction", 0.2)
    return DataConfig(paths=[str(corpus / "*.txt")], cache_dir=str(tmp_path / "cache"), **kw)


def test_prepare_and_reuse(tmp_path, text_corpus):
    cfg = _cfg(tmp_path, text_corpus)
    a = prepare_data(cfg)
    assert all(Path(x).is_absolute() for x in (a.tokenizer_path, a.train_path, a.val_path, a.data_dir))
    assert isinstance(a, PreparedData) and not a.reused
    tok = load_tokenizer(a.tokenizer_path)
    assert a.vocab_size == tok.vocab_size <= 300 and a.eos_id == tok.eos_id
    assert a.n_train_tokens == len(load_tokens(a.train_path)) > 0
    assert a.n_val_tokens == len(load_tokens(a.val_path)) > 0
    assert not list(Path(a.data_dir).glob("*.tmp*"))
    mtimes = {p.name: p.stat().st_mtime_ns for p in Path(a.data_dir).iterdir()}
    b = prepare_data(cfg)
    assert b.reused and b.train_path == a.train_path and b.n_train_tokens == a.n_train_tokens
    assert {p.name: p.stat().st_mtime_ns for p in Path(b.data_dir).iterdir()} == mtimes
    # the stream is documents separated by eos and decodes back to the corpus text
    train = load_tokens(a.train_path)
    assert train[-1] == a.eos_id


def test_cache_key_changes(tmp_path, text_corpus):
    base = prepare_data(_cfg(tmp_path, text_corpus))
    other_vocab = prepare_data(_cfg(tmp_path, text_corpus, vocab_size=320))
    assert other_vocab.data_dir != base.data_dir and not other_vocab.reused
    other_seed = prepare_data(_cfg(tmp_path, text_corpus, seed=1))
    assert other_seed.data_dir != base.data_dir
    # seq_len does not matter for the shards
    assert prepare_data(_cfg(tmp_path, text_corpus, seq_len=64)).reused
    # editing a source file invalidates the cache
    f = text_corpus / "doc0.txt"
    f.write_text(f.read_text() + "more text")
    assert prepare_data(_cfg(tmp_path, text_corpus)).data_dir != base.data_dir


def test_incomplete_cache_is_rebuilt(tmp_path, text_corpus):
    cfg = _cfg(tmp_path, text_corpus)
    a = prepare_data(cfg)
    with open(a.train_path, "ab") as f:  # simulate a crash / corruption
        f.write(b"\1\2")
    b = prepare_data(cfg)
    assert not b.reused and b.data_dir == a.data_dir
    assert (Path(b.train_path).stat().st_size == 2 * b.n_train_tokens)


def test_existing_tokenizer(tmp_path, text_corpus):
    first = prepare_data(_cfg(tmp_path, text_corpus))
    cfg = _cfg(tmp_path, text_corpus, tokenizer=first.tokenizer_path, vocab_size=5000)  # vocab_size is ignored
    b = prepare_data(cfg)
    assert b.data_dir != first.data_dir and b.vocab_size == first.vocab_size
    assert np.array_equal(load_tokens(b.train_path), load_tokens(first.train_path))
    assert prepare_data(_cfg(tmp_path, text_corpus, tokenizer=first.tokenizer_path, vocab_size=6000)).reused


def test_jsonl_and_parquet_sources(tmp_path, sample_docs):
    import pyarrow as pa
    import pyarrow.parquet as pq

    d = tmp_path / "mixed"
    d.mkdir()
    (d / "a.jsonl").write_text("".join(json.dumps({"body": t}) + "\n" for t in sample_docs[:3]))
    pq.write_table(pa.table({"body": sample_docs[3:]}), d / "b.parquet")
    cfg = DataConfig(paths=[str(d / "*")], text_field="body", vocab_size=300, val_fraction=0.2,
                     cache_dir=str(tmp_path / "cache"))
    p = prepare_data(cfg)
    tok = load_tokenizer(p.tokenizer_path)
    stream = np.concatenate([load_tokens(p.train_path), load_tokens(p.val_path)])
    assert int((stream == p.eos_id).sum()) == len(sample_docs)
    text = tok.decode(stream)
    assert all(doc in text for doc in sample_docs)


def test_bad_input_fails_before_work(tmp_path, text_corpus):
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match="does not exist"):
        prepare_data(DataConfig(paths=[str(tmp_path / "nope.txt")], cache_dir=str(cache)))
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"content": "x"}\n')
    with pytest.raises(DataError, match="no field 'text'"):
        prepare_data(DataConfig(paths=[str(bad)], cache_dir=str(cache)))
    with pytest.raises(DataError, match="tokenizer file"):
        prepare_data(_cfg(tmp_path, text_corpus, tokenizer=str(tmp_path / "missing.json")))
    with pytest.raises(ValueError, match="data.seq_len"):
        prepare_data(_cfg(tmp_path, text_corpus, seq_len=1))
    assert not cache.exists() or not [p for p in cache.iterdir() if p.is_dir()]


def test_failed_build_leaves_no_directory(tmp_path):
    f = tmp_path / "late.jsonl"
    f.write_text('{"text": "fine"}\n' * 5 + "{broken\n")
    cache = tmp_path / "cache"
    with pytest.raises(DataError, match=r"late.jsonl:6: invalid JSON"):
        prepare_data(DataConfig(paths=[str(f)], vocab_size=300, cache_dir=str(cache)))
    assert not [p for p in cache.iterdir() if p.is_dir()]


def test_builtin_corpus_small(tmp_path):
    cfg = DataConfig(builtin_max_bytes=300_000, cache_dir=str(tmp_path / "cache"))
    t0 = time.perf_counter()
    p = prepare_data(cfg)
    first = time.perf_counter() - t0
    assert p.n_train_tokens > p.n_val_tokens > 0
    assert p.n_train_tokens + p.n_val_tokens > 50_000  # ~300 kB of Python source
    assert p.vocab_size <= 4096 and p.eos_id == 0
    meta = json.loads((Path(p.data_dir) / "meta.json").read_text())
    assert meta["builtin_corpus"] is True and all(s["path"].endswith(".py") for s in meta["sources"])
    t0 = time.perf_counter()
    assert prepare_data(cfg).reused
    assert time.perf_counter() - t0 < max(first / 2, 0.5)
    x, y = TokenLoader(p.train_path, 128, 2).next_batch()
    assert x.shape == (2, 128) and int(x.max()) < p.vocab_size


_CHILD = """
import json, sys
from moetrain.data import DataConfig, prepare_data
cfg = DataConfig(**json.loads(sys.argv[1]))
print("start", flush=True)
p = prepare_data(cfg)
print(json.dumps({"dir": p.data_dir, "reused": p.reused, "n": p.n_train_tokens}), flush=True)
"""


def _spawn(cfg: DataConfig, src_path: Path) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(src_path) + os.pathsep + os.environ.get("PYTHONPATH", ""))
    return subprocess.Popen([sys.executable, "-c", _CHILD, json.dumps(cfg.__dict__)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env)


def _result(proc: subprocess.Popen) -> dict:
    out, err = proc.communicate(timeout=120)
    assert proc.returncode == 0, err
    return json.loads(out.strip().splitlines()[-1])


def test_concurrent_processes_build_once(tmp_path, text_corpus, src_path):
    cfg = _cfg(tmp_path, text_corpus)
    procs = [_spawn(cfg, src_path) for _ in range(2)]
    results = [_result(p) for p in procs]
    assert results[0]["dir"] == results[1]["dir"] and results[0]["n"] == results[1]["n"]
    assert sorted(r["reused"] for r in results) == [False, True]


def test_waits_for_lock(tmp_path, text_corpus, src_path):
    cfg = _cfg(tmp_path, text_corpus)
    first = prepare_data(cfg)
    os.unlink(Path(first.data_dir) / "meta.json")  # force a rebuild
    fd = os.open(first.data_dir + ".lock", os.O_RDWR)
    fcntl.flock(fd, fcntl.LOCK_EX)
    try:
        proc = _spawn(cfg, src_path)
        assert proc.stdout.readline().strip() == "start"
        time.sleep(0.5)
        assert proc.poll() is None, "prepare_data did not wait for the lock"
    finally:
        os.close(fd)
    res = _result(proc)
    assert res["dir"] == first.data_dir and res["reused"] is False
    assert (Path(first.data_dir) / "meta.json").is_file()
