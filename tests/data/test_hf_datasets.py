"""Hugging Face ``datasets`` as a source: ``save_to_disk`` folders, folders of data files (streamed), datasets in the
local hub cache by name (offline). Every dataset is built here with ``datasets`` itself in a tmp dir."""

from __future__ import annotations

import shutil
import sys
from pathlib import Path

import numpy as np
import pytest

datasets = pytest.importorskip("datasets")

from moetrain.data import DataConfig, DataError, DataSource, load_tokenizer, prepare_data  # noqa: E402
from moetrain.data.progress import PrepProgress  # noqa: E402
from moetrain.data.sources import open_sources  # noqa: E402

QUIET = PrepProgress(enabled=False)


def _docs(tag: str, n: int) -> list[str]:
    return [f"{tag} document {i}: " + "alpha beta gamma delta " * (3 + i % 5) for i in range(n)]


@pytest.fixture(autouse=True)
def offline(monkeypatch):
    monkeypatch.setattr(datasets.config, "HF_HUB_OFFLINE", True)  # whatever the environment, never the network


@pytest.fixture
def hub_cache(tmp_path) -> Path:
    """A datasets cache holding 'tinyhub' (train 30 docs, test 5), as ``load_dataset`` leaves a hub dataset there;
    built from a local repository folder of that name, which is then deleted."""
    repo = tmp_path / "repo" / "tinyhub"
    (repo / "data").mkdir(parents=True)
    datasets.Dataset.from_dict({"text": _docs("hub", 30)}).to_parquet(str(repo / "data/train-00000-of-00001.parquet"))
    datasets.Dataset.from_dict({"text": _docs("hubtest", 5)}).to_parquet(str(repo / "data/test-00000-of-00001.parquet"))
    cache = tmp_path / "hfcache"
    datasets.load_dataset(str(repo), cache_dir=str(cache))
    shutil.rmtree(tmp_path / "repo")
    return cache


def _read(cfg: DataConfig) -> list[list[str]]:
    return [list(o.documents()) for o in open_sources(cfg.validate())]


def test_save_to_disk_folder_and_its_splits(tmp_path):
    ds = datasets.Dataset.from_dict({"text": _docs("a", 12), "n": list(range(12))})
    ds.save_to_disk(str(tmp_path / "one"))
    datasets.DatasetDict({"train": ds, "test": datasets.Dataset.from_dict({"text": _docs("t", 3)})}) \
        .save_to_disk(str(tmp_path / "dict"))
    assert _read(DataConfig(sources=[{"path": str(tmp_path / "one")}])) == [_docs("a", 12)]
    assert _read(DataConfig(sources=[{"path": str(tmp_path / "dict"), "split": "test"}])) == [_docs("t", 3)]
    with pytest.raises(DataError, match=r"data.sources\[0\] .*no split 'validation' \(splits: 'train', 'test'\)"):
        _read(DataConfig(sources=[{"path": str(tmp_path / "dict"), "split": "validation"}]))


def test_parquet_folder_is_streamed_with_its_own_text_column(tmp_path):
    d = tmp_path / "pq" / "data"
    d.mkdir(parents=True)
    datasets.Dataset.from_dict({"body": _docs("tr", 20)}).to_parquet(str(d / "train-00000-of-00001.parquet"))
    datasets.Dataset.from_dict({"body": _docs("te", 4)}).to_parquet(str(d / "test-00000-of-00001.parquet"))
    cache = tmp_path / "hfcache"
    cfg = DataConfig(sources=[{"path": str(tmp_path / "pq"), "text_field": "body"}], hf_cache_dir=str(cache))
    assert _read(cfg) == [_docs("tr", 20)]
    cfg.sources[0].split = "test"
    assert _read(cfg) == [_docs("te", 4)]
    assert not list(cache.rglob("*.arrow")), "a streamed folder must not be copied into the datasets cache"
    with pytest.raises(DataError, match=r"no column 'text' \(columns: 'body'\).*text_field"):
        _read(DataConfig(sources=[{"path": str(tmp_path / "pq")}], hf_cache_dir=str(cache)))


def test_jsonl_folder(tmp_path):
    d = tmp_path / "js"
    d.mkdir()
    datasets.Dataset.from_dict({"text": _docs("j", 7)}).to_json(str(d / "train.jsonl"))
    assert _read(DataConfig(sources=[{"path": str(d)}], hf_cache_dir=str(tmp_path / "c"))) == [_docs("j", 7)]


def test_folder_of_arrow_files(tmp_path):
    datasets.Dataset.from_dict({"text": _docs("ar", 9)}).save_to_disk(str(tmp_path / "saved"))
    (tmp_path / "ar").mkdir()
    for f in (tmp_path / "saved").glob("*.arrow"):  # the Arrow files alone, without save_to_disk's state.json
        shutil.copy(f, tmp_path / "ar" / "train.arrow")
    assert _read(DataConfig(sources=[{"path": str(tmp_path / "ar")}], hf_cache_dir=str(tmp_path / "c"))) == [
        _docs("ar", 9)]


def test_hub_cache_by_name_offline_loaded_or_streamed(hub_cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # no folder 'tinyhub' here: the name can only come from the cache
    for streaming in (False, True):
        cfg = DataConfig(sources=[DataSource(name="tinyhub", streaming=streaming)], hf_cache_dir=str(hub_cache))
        assert _read(cfg) == [_docs("hub", 30)]
    cfg = DataConfig(sources=["hub:tinyhub,split=test"], hf_cache_dir=str(hub_cache))
    assert _read(cfg) == [_docs("hubtest", 5)]


def test_hub_name_not_cached_says_where_it_looked_and_how_to_fetch(hub_cache, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = DataConfig(sources=["web/*.jsonl,weight=2", "hub:nosuchset"], hf_cache_dir=str(hub_cache))
    (tmp_path / "web").mkdir()
    (tmp_path / "web" / "a.jsonl").write_text('{"text": "hello"}\n')
    with pytest.raises(DataError) as e:
        _read(cfg)
    msg = str(e.value)
    assert msg.startswith("data.sources[1] (hub:nosuchset): not in the local Hugging Face datasets cache")
    assert str(hub_cache) in msg and "HF_DATASETS_OFFLINE=0" in msg and "data.hf_cache_dir" in msg
    with pytest.raises(DataError, match=r"data.sources\[0\] \(hub:tinyhub/nocfg\): datasets cannot read it .*nocfg"):
        _read(DataConfig(sources=["hub:tinyhub,config=nocfg"], hf_cache_dir=str(hub_cache)))


def test_missing_datasets_package_names_the_install(monkeypatch, tmp_path):
    monkeypatch.setitem(sys.modules, "datasets", None)  # import datasets -> ImportError
    (tmp_path / "d").mkdir()
    with pytest.raises(DataError, match=r"pip install datasets"):
        _read(DataConfig(sources=[{"path": str(tmp_path / "d")}]))


def test_prepare_tokenises_a_datasets_source_losslessly(tmp_path, hub_cache, monkeypatch):
    monkeypatch.chdir(tmp_path)
    cfg = DataConfig(sources=["hub:tinyhub,streaming=true"], hf_cache_dir=str(hub_cache), vocab_size=300,
                     val_fraction=0.1, cache_dir=str(tmp_path / "cache"), seq_len=8)
    prep = prepare_data(cfg, QUIET)
    (src,) = prep.sources
    tok = load_tokenizer(prep.tokenizer_path)
    ids = np.concatenate([np.fromfile(src.train_path, dtype=np.uint16), np.fromfile(src.val_path, dtype=np.uint16)])
    docs = [d for d in tok.decode(ids).split("<|endoftext|>") if d]
    assert sorted(docs) == sorted(_docs("hub", 30)) and src.n_docs == 30
    assert src.n_train_tokens + src.n_val_tokens == len(ids) and src.n_val_tokens > 0
    assert np.array_equal(np.fromfile(prep.val_path, dtype=np.uint16), np.fromfile(src.val_path, dtype=np.uint16))
