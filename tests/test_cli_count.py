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


@pytest.mark.parametrize("name,total,active,key", [
    ("qwen3-235b-a22b", 235e9, 22e9, "active"),
    ("qwen3-30b-a3b", 30.5e9, 3.3e9, "active_without_router"),  # 3.353B with the routers: 1.6% over
    ("kimi-k2-1t", 1.04e12, 32.6e9, "active"),
])
def test_count_released_families_match_published_sizes(capsys, name, total, active, key):
    """docs/reference.md section 15: the published totals and active counts, within 1.5%."""
    assert main(["count", name, "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["params"]["total"] == pytest.approx(total, rel=0.015)
    assert d["params"][key] == pytest.approx(active, rel=0.015)
    assert d["family"] == ("deepseek_v3" if name.startswith("kimi") else "qwen3_moe")


def test_count_gqa_flops_by_hand(capsys):
    """Megatron's standard self-attention term for GQA (docs/reference.md section 3), Qwen3-30B-A3B at 4096."""
    assert main(["count", "qwen3-30b-a3b", "--seq-len", "4096", "--json"]) == 0
    f = json.loads(capsys.readouterr().out)["flops_per_token"]
    h, L, n_layers, H, G, d = 2048, 4096, 48, 32, 4, 128
    attn = 6 * (h * (H * d + 2 * G * d) + H * d * h) + 6 * L * H * d
    moe = 6 * 3 * h * 768 * 8
    assert f["megatron"] == pytest.approx(n_layers * (attn + moe) + 6 * h * 151_936, rel=1e-12)
    assert f["megatron_attention"] == pytest.approx(n_layers * 6 * L * H * d, rel=1e-12)
