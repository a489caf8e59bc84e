"""The import graph of src/moetrain: no cycles between modules, and no import running upward through the layers
declared in tools/import_graph.py (docs/architecture.md draws them)."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("import_graph", ROOT / "tools" / "import_graph.py")
ig = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ig)  # type: ignore[union-attr]


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return ig.imports(ROOT / "src")


def test_no_import_cycles(graph):
    assert ig.cycles(graph) == []


def test_no_upward_imports(graph):
    assert ig.upward(graph) == []


def test_every_module_has_a_layer(graph):
    for m in graph:
        ig.layer_of(m)  # raises KeyError naming the module


def test_the_checks_see_a_cycle_and_an_upward_import():
    g = {"moetrain.model.a": {"moetrain.train.b"}, "moetrain.train.b": {"moetrain.model.a"}}
    assert ig.cycles(g) == [["moetrain.model.a", "moetrain.train.b"]]
    assert ig.upward(g) == [("moetrain.model.a", "moetrain.train.b")]
    assert ig.layer_of("moetrain.precision.apply") > ig.layer_of("moetrain.model.moe") > ig.layer_of(
        "moetrain.precision.grouped")
