"""Job configuration (files, overrides, errors) and the learning-rate schedules."""

from __future__ import annotations

import json

import pytest

from moetrain.config import build_job_config, job_config_from_dict, load_job_config, parse_overrides
from moetrain.model.config import ConfigError
from moetrain.train.optim import lr_at


def test_defaults_are_the_builtin_demo():
    job = load_job_config()
    assert job.preset == "tiny" and job.parallel.ep == 2 and job.data.paths == []


def test_toml_file_and_overrides(tmp_path):
    f = tmp_path / "job.toml"
    f.write_text('[model]\npreset = "tiny"\ndim = 64\n[parallel]\nep = 4\n[train]\nsteps = 7\n')
    job = load_job_config(f, ["train.lr=1e-3", "model.top_k=2", 'data.paths=["a.txt"]'])
    assert (job.model.dim, job.parallel.ep, job.train.steps, job.train.lr, job.model.top_k) == (64, 4, 7, 1e-3, 2)
    assert job.data.paths == ["a.txt"]
    again = job_config_from_dict(json.loads(json.dumps(job.to_dict())))
    assert again.to_dict() == job.to_dict()


@pytest.mark.parametrize("suffix", [".toml", ".json"])
def test_save_and_reload(tmp_path, suffix):
    from moetrain.config import save_job_config
    job = load_job_config(None, ["model.dim=96", "parallel.capacity_factor=1.5", "train.steps=9"])
    path = save_job_config(job, tmp_path / f"job{suffix}")
    assert load_job_config(path).to_dict() == job.to_dict()


def test_json_file(tmp_path):
    f = tmp_path / "job.json"
    f.write_text(json.dumps({"model": {"preset": "small"}, "train": {"steps": 3}}))
    job = load_job_config(f)
    assert job.model.dim == 768 and job.train.steps == 3


@pytest.mark.parametrize("override, words", [
    (["train.lerning_rate=1"], ["lerning_rate", "valid fields"]),
    (["model.top_k=99"], ["top_k=99"]),
    (["model.n_limited_groups=9"], ["n_limited_groups"]),
    (["model.n_expert_groups=3"], ["n_expert_groups=3", "allowed"]),
    (["optimizer.lr=1"], ["unknown config section 'optimizer'"]),
    (["train.steps"], ["section.field=value"]),
    (["data.seq_len=100000"], ["seq_len"]),
    (["parallel.ep=0"], ["parallel.ep"]),
    (["train.schedule=\"linear\""], ["schedule", "cosine"]),
])
def test_bad_config_names_the_field(override, words):
    with pytest.raises((ConfigError, ValueError)) as e:
        load_job_config(None, override)
    for w in words:
        assert w in str(e.value)


def test_unknown_section_in_file(tmp_path):
    f = tmp_path / "job.toml"
    f.write_text("[optimiser]\nlr = 1\n")
    with pytest.raises(ConfigError, match="unknown section"):
        load_job_config(f)


def test_parse_overrides_types():
    o = parse_overrides(["train.lr=3e-4", "train.resume=true", 'train.out_dir="x"', "train.out_dir2=bare"])
    assert o["train"] == {"lr": 3e-4, "resume": True, "out_dir": "x", "out_dir2": "bare"}


def test_lr_schedules():
    kw = dict(lr=1.0, min_lr=0.1, warmup_steps=10, total_steps=110)
    assert lr_at(0, **kw) == pytest.approx(0.1)
    assert lr_at(9, **kw) == pytest.approx(1.0)
    assert lr_at(60, **kw) == pytest.approx(0.55)  # cosine midpoint
    assert lr_at(110, **kw) == pytest.approx(0.1)
    assert lr_at(50, schedule="wsd", **kw) == pytest.approx(1.0)
    assert lr_at(110, schedule="wsd", **kw) == pytest.approx(0.1)
    assert lr_at(100, schedule="wsd", **kw) == pytest.approx(1.0 + (0.1 - 1.0) * 0.5)
    assert lr_at(80, schedule="constant", **kw) == 1.0
    with pytest.raises(ValueError, match="schedule"):
        lr_at(50, schedule="bogus", **kw)
