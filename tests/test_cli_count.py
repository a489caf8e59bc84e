"""`moetrain count` through the CLI, against docs/reference.md section 2 and 3."""

from __future__ import annotations

import json

import pytest

from moetrain.cli import main


def test_count_671b_json(capsys):
    assert main(["count", "deepseek-v3-671b", "--seq-len", "4096", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    p, f = d["params"], d["flops_per_token"]
    assert p["total"] == pytest.approx(671.03e9, rel=5e-4)
    assert p["active"] == pytest.approx(37.55e9, rel=5e-4)
    assert p["active_nonembedding"] == pytest.approx(36.63e9, rel=5e-4)
    assert p["mtp"] == pytest.approx(11.61e9, rel=5e-4)
    assert f["megatron"] == pytest.approx(260.0e9, rel=2e-3)
    assert f["six_n"] > f["megatron"]


def test_count_text_names_both_formulas(capsys):
    assert main(["count", "deepseek-v2-lite-16b"]) == 0
    out = capsys.readouterr().out
    assert "15.706 B" in out and "Megatron-Core" in out and "6N + attention" in out


def test_count_bad_input(capsys, tmp_path):
    assert main(["count", "no-such-preset"]) == 2
    assert "preset" in capsys.readouterr().err
    bad = tmp_path / "config.json"
    bad.write_text("{not json")
    assert main(["count", str(bad)]) == 2
