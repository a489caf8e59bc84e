"""`moetrain plan` refuses contradictory or impossible input with one line and exit 2, before any search; a
record override is what differs from the record, and the record's published figure travels with the JSON."""

from __future__ import annotations

import json

import pytest

from moetrain.plan.cli import main as plan_main
from moetrain.plan.hardware import HardwareError, load_gpu_file
from moetrain.plan.search import parse_counts
from moetrain.plan.shape import ShapeError, shape_from_hf


@pytest.mark.parametrize("argv, message", [
    (["--gpus", "0"], "--gpus 0: must be >= 1"),
    (["--records", "--validate"], "separate modes"),
    (["--record", "gb300", "--search", "--scale", "64,128"], "separate modes"),
    (["--validate", "--top", "3"], "would ignore --top"),
    (["--compare", "gb300", "gb200", "--any-framework"], "would ignore --any-framework"),
    (["--nic-gbit", "-5"], "--nic-gbit -5: must be > 0"),
    (["--imbalance", "2"], "set routing 'real'"),
    (["--recompute", "full", "--recompute-modules", "core_attn"], "drop --recompute-modules"),
    (["--record", "gb300", "--png", "out.xyz"], "unknown image type '.xyz'"),
    (["--record", "gb300", "--framework", "moetrain"], "--framework moetrain does not run this plan: FP8 attention"),
    (["--record", "gb300", "--framework", "torchtitan"], "EP overlap (it has none)"),
    (["--record", "gb300", "--scale", "abc"], "expected GPU counts"),
])
def test_bad_input_is_one_line_and_exit_2(argv, message, capsys):
    assert plan_main(argv) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and message in err[0], err


def test_on_and_off_flags_exclude_each_other(capsys):
    with pytest.raises(SystemExit) as e:
        plan_main(["--ep-overlap", "--no-ep-overlap"])
    assert e.value.code == 2 and "not allowed with" in capsys.readouterr().err


def test_an_invalid_plan_is_refused_before_the_search(capsys):
    # before: the search ran 2,080 plans, dropped the baseline and said "changed: nothing"
    assert plan_main(["--record", "gb300", "--search", "--ep", "7"]) == 2
    captured = capsys.readouterr()
    assert "EP=7 must divide" in captured.err and captured.out == ""
    assert plan_main(["--record", "gb300", "--scale", "64-256", "--gbs", "7"]) == 2
    assert "global_batch=7" in capsys.readouterr().err


def test_record_overrides_are_values_that_differ_and_json_keeps_the_published_figure(capsys):
    # the record's own values are not overrides: the within-band verdict stays
    assert plan_main(["--record", "gb300", "--pp", "2", "--vpp", "8", "--ep", "32", "--gpus", "256", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["record"]["published_tflops_per_gpu"] == 1648 and d["record"]["overrides"] == []
    assert d["record"]["in_band"] is True
    assert d["record"]["error"] == pytest.approx(d["tflops_per_gpu"] / 1648 - 1)
    assert plan_main(["--record", "gb300", "--pp", "4", "--vpp", "4", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["record"]["overrides"] == ["--pp 4", "--vpp 4"] and d["record"]["in_band"] is None


def test_search_for_another_framework_keeps_the_record_as_baseline(capsys):
    assert plan_main(["--record", "gb300", "--search", "--framework", "moetrain", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["baseline"]["plan"]["framework"] == "megatron" and d["baseline"]["plan"]["precision"] == "mxfp8"
    assert d["framework"] == "moetrain" and d["top"]
    # the record's MXFP8 kept; its FP8 attention, CUDA graphs and fused MLP, which the trainer does not run yet,
    # costed off
    assert all("framework-moetrain" in p["plan"] and " mxfp8 " in p["plan"] and "attn-fp8" not in p["plan"]
               and "graphs-none" in p["plan"] and "fused-mlp" not in p["plan"] for p in d["top"])
    assert d["gain"] < 1  # slower than the record with them


def test_chart_path_without_suffix_gets_png(tmp_path, capsys):
    out = tmp_path / "step"
    assert plan_main(["--record", "gb300", "--png", str(out)]) == 0
    assert f"chart: {out}.png" in capsys.readouterr().out and (tmp_path / "step.png").exists()
    assert plan_main(["--record", "gb300", "--png", str(tmp_path)]) == 2
    assert "is a directory" in capsys.readouterr().err


def test_scale_counts():
    assert parse_counts("64-100") == [64, 100]
    assert parse_counts("128,64,64") == [64, 128]
    assert parse_counts("64..256") == [64, 128, 256]
    for bad in ("abc", "0-4", "8-4", "", "64,-1"):
        with pytest.raises(ValueError, match="expected GPU counts"):
            parse_counts(bad)


def test_gpu_file_entries_that_are_not_tables(tmp_path):
    for text, msg in (('{"gpu": {"x": 5}}', "expected a table"), ("[1, 2]", "expected a table"),
                      ('{"gpu": {"x": {"generation": "hopper", "peak_tflops": {"bf16": "fast"}, "hbm_gb": 80, '
                       '"hbm_tbps": 3, "nvlink_gbps": 450, "nvlink_domain": 8, "nic_gbps": 50}}}', "must be numbers")):
        f = tmp_path / "g.json"
        f.write_text(text)
        with pytest.raises(HardwareError, match=msg):
            load_gpu_file(f)


_GQA = {"hidden_size": 4096, "num_hidden_layers": 32, "num_attention_heads": 32, "num_key_value_heads": 8,
        "vocab_size": 128000, "intermediate_size": 14336}


def test_hf_configs_with_other_key_names():
    # Hunyuan: per-layer lists that agree are read as one value; lists that differ are refused
    hy = shape_from_hf({**_GQA, "model_type": "hunyuan_v1_moe", "num_experts": 64, "moe_topk": [8] * 32,
                        "moe_intermediate_size": [3072] * 32})
    assert (hy.n_experts, hy.top_k, hy.expert_ffn) == (64, 8, 3072)
    with pytest.raises(ShapeError, match="layers with different values"):
        shape_from_hf({**_GQA, "model_type": "hunyuan_v1_moe", "num_experts": 64, "moe_topk": [8, 4] * 16})
    # ERNIE 4.5: moe_num_experts / moe_k, the first MoE layer index, shared experts
    er = shape_from_hf({**_GQA, "model_type": "ernie4_5_moe", "moe_num_experts": 64, "moe_k": 8,
                        "moe_intermediate_size": 3584, "moe_layer_start_index": 1, "moe_num_shared_experts": 2})
    assert (er.n_experts, er.top_k, er.n_dense_layers, er.shared_ffn) == (64, 8, 1, 2 * 3584)
    # Llama 4: MoE every second layer, a shared expert of the routed width, dense layers of intermediate_size_mlp
    ll = shape_from_hf({**_GQA, "model_type": "llama4_text", "num_local_experts": 128, "num_experts_per_tok": 1,
                        "intermediate_size": 8192, "intermediate_size_mlp": 16384, "interleave_moe_layer_step": 2})
    assert (ll.n_dense_layers, ll.shared_ffn, ll.expert_ffn, ll.dense_ffn) == (16, 8192, 8192, 16384)
