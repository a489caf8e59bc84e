"""The published validation points live in a data file (moetrain/plan/data/validation.json) with their sources;
a malformed file is refused with one message that names the entry and the problem."""

from __future__ import annotations

import copy
import json
from pathlib import Path

import pytest

from moetrain.plan import validation
from moetrain.plan.validation import DATA_FILE, ValidationDataError, even_layout, load


def _data() -> dict:
    return json.loads(DATA_FILE.read_text(encoding="utf-8"))


def _write(tmp_path: Path, data: dict) -> Path:
    p = tmp_path / "validation.json"
    p.write_text(json.dumps(data), encoding="utf-8")
    return p


def _first_point(data: dict) -> dict:
    return data["groups"][0]["points"][0]


def test_every_point_model_layout_and_recipe_carries_its_source():
    data = _data()
    points = [p for g in data["groups"] for p in g["points"]]
    assert len(points) == len(validation.POINTS) and [p["key"] for p in points] == [p.key for p in validation.POINTS]
    for p in points:
        assert data["sources"][p["source"].split()[0]].strip(), p["key"]
    for section in ("models", "layouts", "recipes"):
        assert data[section]
        for name, entry in data[section].items():
            assert entry["source"].strip(), (section, name)


def test_layout_forms_resolve_to_the_layout_strings(tmp_path):
    data = _data()
    named = next(iter(data["layouts"]))
    pts = data["groups"][0]["points"]
    pts[0]["plan"]["pp_layout"] = {"named": named}
    pts[1]["plan"]["pp_layout"] = {"even": [94, 8, 3]}
    pts[2]["plan"]["pp_layout"] = "Et*4|(t*4|)*14tmL"
    _, points = load(_write(tmp_path, data))
    assert points[0].plan.pp_layout == data["layouts"][named]["layout"]
    assert points[1].plan.pp_layout == even_layout(94, 8, 3)
    assert points[2].plan.pp_layout == "Et*4|(t*4|)*14tmL"


def test_the_shipped_file_loads_to_the_module_points():
    configs, points = load()
    assert points == validation.POINTS and configs == validation.MODEL_CONFIGS


def _broken(mutate):
    data = _data()
    mutate(data)
    return data


@pytest.mark.parametrize("mutate, message", [
    (lambda d: _first_point(d).pop("source"), r"point 'dsv3-b200-gbs4096' lacks \['source'\]"),
    (lambda d: _first_point(d).update(colour="red"), r"point 'dsv3-b200-gbs4096' has unknown field\(s\) \['colour'\]"),
    (lambda d: _first_point(d)["plan"].update(pipeline=4), r"unknown plan field\(s\) \['pipeline'\]"),
    (lambda d: _first_point(d).update(source="Blog B200"), r"source 'Blog B200' starts with no tag of \"sources\""),
    (lambda d: _first_point(d)["plan"].update(pp_layout={"named": "nope"}), r"pp_layout names 'nope'"),
    (lambda d: _first_point(d)["plan"].update(pp_layout={"even": [94, 5, 1]}), r"do not split evenly"),
    (lambda d: _first_point(d)["plan"].update(pp_layout=16), r"pp_layout must be a layout string"),
    (lambda d: _first_point(d).update(tokens_per_s_per_gpu=1000), r"exactly one published figure"),
    (lambda d: _first_point(d).update(tflops_per_gpu="699"), r"exactly one published figure"),
    (lambda d: _first_point(d).update(recipe="nemo-9"), r"recipe 'nemo-9' is not one of"),
    (lambda d: _first_point(d).update(model="gpt-5"), r"model 'gpt-5' is neither in \"models\" nor a moetrain preset"),
    (lambda d: _first_point(d).update(gpu="a100"), r"gpu 'a100' is not in the catalogue"),
    (lambda d: _first_point(d).update(n_gpus="256"), r"n_gpus a positive integer"),
    (lambda d: d["groups"][0]["points"].append(copy.deepcopy(_first_point(d))), r"the key is used twice"),
    (lambda d: d["recipes"][next(iter(d["recipes"]))].update(source=""), r"needs a non-empty \"source\""),
    (lambda d: d.pop("sources"), r"the top level lacks \['sources'\]"),
])
def test_a_malformed_entry_is_refused_by_name(tmp_path, mutate, message):
    path = _write(tmp_path, _broken(mutate))
    with pytest.raises(ValidationDataError, match=message) as e:
        load(path)
    assert str(path) in str(e.value)


def test_a_file_that_is_not_json_or_is_missing_is_refused(tmp_path):
    p = tmp_path / "validation.json"
    p.write_text('{"sources": ', encoding="utf-8")
    with pytest.raises(ValidationDataError, match="is not valid JSON"):
        load(p)
    with pytest.raises(ValidationDataError, match="cannot be read .* package data: reinstall moetrain"):
        load(tmp_path / "absent.json")


def test_the_data_file_is_package_data():
    pyproject = Path(__file__).resolve().parents[2] / "pyproject.toml"
    if not pyproject.exists():
        pytest.skip("not a source checkout")
    text = pyproject.read_text(encoding="utf-8")
    assert '"moetrain.plan" = ["data/*.json"]' in text
    assert DATA_FILE.relative_to(Path(validation.__file__).parent).as_posix() == "data/validation.json"
