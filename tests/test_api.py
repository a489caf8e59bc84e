"""The Python API: every public name of ``moetrain`` imports and is documented, ``import moetrain`` loads no torch,
the helpers refuse bad input by name, and the README's "Python API" example runs as written."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

import moetrain

ROOT = Path(__file__).resolve().parents[1]


def test_every_public_name_imports_and_has_a_docstring():
    assert moetrain.__all__ == sorted(moetrain.__all__)
    for name in moetrain.__all__:
        obj = getattr(moetrain, name)
        assert obj is not None, name
        if callable(obj):
            assert (obj.__doc__ or "").strip(), f"moetrain.{name} has no docstring"
    assert set(moetrain.__all__) <= set(dir(moetrain))
    # a public name must not be a submodule's: importing that module would replace the name by it
    import importlib.util
    shadowed = [n for n in moetrain.__all__ if importlib.util.find_spec(f"moetrain.{n}") is not None]
    assert not shadowed
    with pytest.raises(AttributeError, match="no attribute 'nope'"):
        moetrain.nope  # noqa: B018


def test_import_moetrain_is_cheap():
    code = "import sys, moetrain; print(sorted(m for m in ('torch', 'numpy', 'transformers') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True,
                         env={"PYTHONPATH": str(ROOT / "src"), "PATH": "/usr/bin:/bin"})
    assert out.stdout.strip() == "[]"


def test_build_model_from_a_preset_a_hf_config_and_bad_input(tmp_path):
    import torch

    from moetrain.model.config import TRAINING_FIELDS

    tiny = moetrain.build_model("tiny", seed=0)
    assert isinstance(tiny, moetrain.Transformer) and tiny.cfg == moetrain.model_config("tiny")
    again = moetrain.build_model(moetrain.model_config("tiny"), seed=0)  # name-seeded: the same weights
    assert all(torch.equal(a, b) for a, b in zip(tiny.state_dict().values(), again.state_dict().values()))
    moetrain.save_hf_checkpoint(tiny, tmp_path / "hf")
    arch = lambda cfg: {k: v for k, v in cfg.to_dict().items() if k not in TRAINING_FIELDS}  # noqa: E731
    for source in (tmp_path / "hf", tmp_path / "hf" / "config.json"):
        assert arch(moetrain.model_config(source)) == arch(tiny.cfg)
    with pytest.raises(moetrain.ConfigError, match="neither a preset"):
        moetrain.build_model(tmp_path / "nothing")
    with pytest.raises(moetrain.ConfigError, match="section.field"):
        moetrain.job_config({"steps": 3})
    with pytest.raises(moetrain.ConfigError):
        moetrain.job_config({"train.no_such_field": 3})
    job = moetrain.job_config({"train.steps": 3, "model.preset": "tiny", "train.out_dir": str(tmp_path / "r")})
    assert isinstance(job, moetrain.JobConfig) and job.train.steps == 3 and job.train.out_dir == str(tmp_path / "r")


def _readme_example() -> str:
    text = (ROOT / "README.md").read_text()
    section = text[text.index("## Python API"):]
    return re.search(r"```python\n(.*?)```", section, re.S).group(1)


@pytest.mark.dist
def test_the_readme_example_runs(tmp_path):
    (tmp_path / "example.py").write_text(_readme_example())
    p = subprocess.run([sys.executable, "example.py"], cwd=tmp_path, capture_output=True, text=True, timeout=900)
    assert p.returncode == 0, p.stdout[-3000:] + p.stderr[-3000:]
    assert "perplexity" in p.stdout
    assert (tmp_path / "runs/api/checkpoints/step_00000020/COMPLETE").is_file()
    assert (tmp_path / "hf-api/config.json").is_file()
