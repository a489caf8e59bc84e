"""moetrain's TOML writer: every value kind a job config holds reads back equal through the standard TOML reader
(``tomllib``; ``tomli`` before Python 3.11), which nobody on this project wrote."""

from __future__ import annotations

import dataclasses
import enum
import math
import sys
import typing

import pytest

from moetrain.config import SECTION_CLASSES, load_job_config, save_job_config
from moetrain.toml_write import dumps

if sys.version_info >= (3, 11):
    import tomllib
else:  # pragma: no cover
    import tomli as tomllib

NASTY_STRINGS = [
    "", "plain", 'say "hi"', "back\\slash", "C:\\path\\to\\file", "tab\there", "line\nbreak\r\n", "bell\x07",
    "nul\x00", "del\x7f", "\x1b[31mred", "unicode é ß 中文 🚀", "'single'", "#not a comment", "a = b", "[not.a.table]",
    '"""', "\\u0041 stays literal", "trailing space ",
]
FLOATS = [0.0, -0.0, 1.0, 0.1, 1e-8, 3e-3, 1.5e300, -2.5e-300, 5e-324, 1 / 3, 123456789.123, math.inf, -math.inf]


def _same(a, b) -> bool:
    """Equality in which nan equals nan and tuples equal lists (TOML arrays come back as lists)."""
    if isinstance(a, float) and isinstance(b, float):
        return (math.isnan(a) and math.isnan(b)) or (a == b and math.copysign(1, a) == math.copysign(1, b))
    if isinstance(a, (list, tuple)) and isinstance(b, (list, tuple)):
        return len(a) == len(b) and all(_same(x, y) for x, y in zip(a, b))
    if isinstance(a, dict) and isinstance(b, dict):
        return a.keys() == b.keys() and all(_same(a[k], b[k]) for k in a)
    return type(a) is type(b) and a == b


def _round_trip(data: dict) -> dict:
    back = tomllib.loads(dumps(data))
    assert _same(data, back), (data, back)
    return back


def test_scalars_strings_and_floats_read_back_equal():
    _round_trip({"s": {f"k{i}": s for i, s in enumerate(NASTY_STRINGS)}})
    _round_trip({"f": {f"k{i}": x for i, x in enumerate(FLOATS)}, "nan": math.nan})
    _round_trip({"i": [0, 1, -1, 2 ** 63 - 1, -(2 ** 63)], "b": [True, False], "t": (1, 2, 3), "empty": []})


def test_nested_tables_arrays_and_quoted_keys():
    data = {
        "top": 1,
        "model": {"dim": 96, "name": "tiny", "inner": {"deep": {"x": 1.5}, "y": [1, 2]}},
        "only_sub": {"child": {"v": "w"}},
        "empty": {},
        "arrays": {"nested": [[1, 2], [3.5], []], "mixed_tables": [{"a": 1}, {"b": "c"}], "strs": NASTY_STRINGS},
        "quoted keys": {"with space": 1, "dotted.key": 2, "é": 3, "": 4, 'quo"te': 5},
    }
    _round_trip(data)


def _adversarial(tp: typing.Any, i: int) -> typing.Any:
    """A value of the declared field type that stresses the writer (the i-th variant)."""
    origin, args = typing.get_origin(tp), typing.get_args(tp)
    if origin is typing.Union or type(tp).__name__ == "UnionType":
        return _adversarial(next(a for a in args if a is not type(None)), i)
    if origin is typing.Literal:
        return args[i % len(args)]
    if tp is bool:
        return i % 2 == 0
    if tp is int:
        return [2 ** 63 - 1, -(2 ** 63), 0, 7][i % 4]
    if tp is float:
        return FLOATS[i % len(FLOATS)]
    if tp is str:
        return NASTY_STRINGS[i % len(NASTY_STRINGS)]
    if origin in (list, tuple):
        return [_adversarial(args[0], i + j) for j in range(3)]
    if dataclasses.is_dataclass(tp):  # the tables of a list (data.sources)
        hints = typing.get_type_hints(tp)
        return {f.name: _adversarial(hints[f.name], i + k) for k, f in enumerate(dataclasses.fields(tp))}
    if isinstance(tp, type) and issubclass(tp, enum.Enum):  # a closed set of names (moetrain.layout): plain strings
        return list(tp)[i % len(tp)].value
    raise AssertionError(f"config field type {tp!r} has no test value: extend the writer's test")


@pytest.mark.parametrize("section", sorted(SECTION_CLASSES))
def test_every_config_field_type_reads_back_equal(section):
    cls = SECTION_CLASSES[section]
    hints = typing.get_type_hints(cls)
    for variant in range(4):
        values = {f.name: _adversarial(hints[f.name], variant + k) for k, f in enumerate(dataclasses.fields(cls))}
        _round_trip({section: values})


def test_job_config_saved_as_toml_loads_back_equal(tmp_path):
    job = load_job_config(None, ["model.dim=96", "parallel.capacity_factor=1.5", "train.lr=1e-8", "train.min_lr=0",
                                 'data.paths=["dir with space/*.txt", "quo\\"te\\\\back/é.jsonl"]',
                                 "train.profile_steps=[3, 5]"])
    assert job.data.paths == ["dir with space/*.txt", 'quo"te\\back/é.jsonl'] and job.train.lr == 1e-8
    path = save_job_config(job, tmp_path / "job.toml")
    assert load_job_config(path).to_dict() == job.to_dict()


@pytest.mark.parametrize("data,error,words", [
    ({"a": {"b": None}}, TypeError, ["a.b", "None", "leave the key out"]),
    ({"a": [1, None]}, TypeError, ["a.[1]", "None"]),
    ({"a": {1: 2}}, TypeError, ["keys are strings", "1"]),
    ({"a": object()}, TypeError, ["a has type object"]),
    ({"a": 2 ** 63}, ValueError, ["a = 9223372036854775808", "64-bit"]),
])
def test_what_toml_cannot_hold_is_named(data, error, words):
    with pytest.raises(error) as e:
        dumps(data)
    for w in words:
        assert w in str(e.value)
