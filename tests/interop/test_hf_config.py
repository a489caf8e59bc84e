"""A bad ``config.json`` (wrong value types, invalid JSON, a missing architecture key) is refused naming the file,
the key and the expected type -- by the library and by ``moetrain train --init-from`` (exit 2, one line)."""

from __future__ import annotations

import json

import pytest

from moetrain.cli import main
from moetrain.errors import ConfigError
from moetrain.interop.hf import config_from_hf, config_to_hf, load_hf_config
from moetrain.model.hf_config import HFConfigReader, read_config_json
from moetrain.model import get_preset


@pytest.fixture
def hf_config():
    return config_to_hf(get_preset("tiny"))


def _write(tmp_path, d) -> object:
    (tmp_path / "config.json").write_text(json.dumps(d, indent=1))
    return tmp_path / "config.json"


@pytest.mark.parametrize("key, value, want", [
    ("num_hidden_layers", "four", "must be an integer"),
    ("num_hidden_layers", 4.5, "must be an integer"),
    ("hidden_size", True, "must be an integer"),  # JSON true is not 1
    ("rms_norm_eps", "1e-6", "must be a number"),
    ("norm_topk_prob", "yes", "must be true or false"),
    ("hidden_act", 3, "must be a string"),
    ("moetrain", [1], "must be a JSON object"),
])
def test_a_value_of_the_wrong_type_names_file_key_and_type(tmp_path, hf_config, key, value, want):
    p = _write(tmp_path, hf_config | {key: value})
    with pytest.raises(ConfigError) as e:
        load_hf_config(tmp_path)
    msg = str(e.value)
    assert str(p) in msg and f"{key}={value!r}" in msg and want in msg, msg


def test_a_nested_value_is_named_by_its_block(hf_config):
    d = hf_config | {"rope_parameters": {"rope_type": "yarn", "factor": "forty", "rope_theta": 10000.0}}
    with pytest.raises(ConfigError, match=r"rope_parameters\.factor='forty' must be a number"):
        config_from_hf(d)


def test_a_missing_architecture_key_is_named_not_defaulted(tmp_path, hf_config):
    # transformers (and moetrain before) would read a config without hidden_size as DeepSeek-V3's 7168
    p = _write(tmp_path, {k: v for k, v in hf_config.items() if k not in ("hidden_size", "v_head_dim")})
    with pytest.raises(ConfigError, match="missing required key") as e:
        load_hf_config(p)
    assert "hidden_size" in str(e.value) and "v_head_dim" in str(e.value) and str(p) in str(e.value)
    # null is absent, as transformers reads it
    with pytest.raises(ConfigError, match="hidden_size"):
        config_from_hf(hf_config | {"hidden_size": None})


def test_invalid_json_names_file_line_and_column(tmp_path, hf_config):
    p = tmp_path / "config.json"
    p.write_text('{\n  "hidden_size": 64,\n  "num_hidden_layers": 2,,\n}')
    with pytest.raises(ConfigError, match=r"config\.json is not valid JSON: .* at line 3 column 26"):
        load_hf_config(tmp_path)
    p.write_text("[1, 2]")
    with pytest.raises(ConfigError, match="holds a JSON list, not an object"):
        read_config_json(p)
    with pytest.raises(FileNotFoundError):
        read_config_json(tmp_path / "nope.json")


def test_the_reader_keeps_good_values_and_types(hf_config):
    r = HFConfigReader({"a": 3, "b": 2, "c": None, "d": {"e": 1}})
    assert r.get("a", int) == 3 and r.get("b", float) == 2.0 and isinstance(r.get("b", float), float)
    assert r.get("c", int, 7) == 7 and r.get("zz", str, None) is None
    assert r.block("d").get("e", int) == 1 and r.block("zz").d == {}
    assert config_from_hf(hf_config) == get_preset("tiny")  # a good config reads as before


def test_init_from_a_wrong_typed_config_exits_2_naming_the_key(capsys, tmp_path, hf_config):
    hf = tmp_path / "hf"
    hf.mkdir()
    _write(hf, hf_config | {"num_hidden_layers": "four"})
    code = main(["train", "--init-from", str(hf), "--steps", "1", "--out", str(tmp_path / "run")])
    err = capsys.readouterr().err
    assert code == 2 and "num_hidden_layers='four' must be an integer" in err and str(hf) in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
