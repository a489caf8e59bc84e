"""JSON / PNG outputs, HF config.json reading (DeepSeek and GQA MoE), user GPU entries, accounting additions."""

from __future__ import annotations

import json

import pytest

from moetrain.accounting import (
    count_params,
    flops_breakdown,
    flops_per_token,
)
from moetrain.model.config import PRESETS, Qwen3MoeConfig, get_preset
from moetrain.plan import Plan, predict
from moetrain.plan.cli import main as plan_main
from moetrain.plan.hardware import HardwareError, get_gpu, gpu_from_bench, load_gpu_file
from moetrain.plan.shape import ShapeError, load_shape, shape_from_hf

MIXTRAL_8X7B = {
    "model_type": "mixtral", "hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32,
    "num_attention_heads": 32, "num_key_value_heads": 8, "num_local_experts": 8, "num_experts_per_tok": 2,
    "vocab_size": 32000, "tie_word_embeddings": False, "max_position_embeddings": 32768,
}
QWEN2_57B_A14B = {
    "model_type": "qwen2_moe", "hidden_size": 3584, "intermediate_size": 18944, "moe_intermediate_size": 2560,
    "shared_expert_intermediate_size": 20480, "num_hidden_layers": 28, "num_attention_heads": 28,
    "num_key_value_heads": 4, "num_experts": 64, "num_experts_per_tok": 8, "vocab_size": 151936,
    "qkv_bias": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
}


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_flops_breakdown_sums_to_the_accounting(name):
    cfg = get_preset(name)
    for L in (128, 4096):
        assert flops_breakdown(cfg, L).total == pytest.approx(flops_per_token(cfg, L).megatron, rel=1e-12)


def test_gqa_accounting_mixtral():
    cfg = Qwen3MoeConfig(vocab_size=32000, dim=4096, n_layers=32, n_heads=32, n_kv_heads=8, head_dim=128,
                         expert_ffn_dim=14336, n_routed_experts=8, top_k=2, qk_norm=False)
    p = count_params(cfg)
    assert p.total == pytest.approx(46.70e9, rel=2e-3)  # Mixtral 8x7B: 46.7B total
    assert p.active == pytest.approx(12.88e9, rel=5e-3)  # ~12.9B active
    f = flops_per_token(cfg, 4096)
    h, L = 4096, 4096
    attn = 6 * (h * (4096 + 2 * 1024) + 4096 * h) + 6 * 4096 * L
    mlp = 6 * 3 * h * 14336 * 2
    assert f.megatron == pytest.approx(32 * (attn + mlp) + 6 * h * 32000)


def test_hf_configs_read():
    s = shape_from_hf(MIXTRAL_8X7B, name="mixtral")
    assert s.attention == "gqa" and s.n_kv_heads == 8 and s.expert_ffn == 14336 and s.n_dense_layers == 0
    q = shape_from_hf(QWEN2_57B_A14B, name="qwen2")
    assert q.shared_ffn == 20480 and q.n_experts == 64
    assert q.params.total == pytest.approx(57.4e9, rel=0.01)
    from moetrain.interop.hf import config_to_hf
    d = shape_from_hf(config_to_hf(get_preset("deepseek-v3-671b")))
    assert d.attention == "mla" and d.flops_per_token(4096) == pytest.approx(260.0e9, rel=1e-3)
    with pytest.raises(ShapeError, match="no routed experts"):
        shape_from_hf({"model_type": "llama", "hidden_size": 4096, "num_hidden_layers": 2,
                       "num_attention_heads": 32, "num_key_value_heads": 8, "vocab_size": 32000})


def test_predict_gqa_model_from_config_file(tmp_path):
    path = tmp_path / "config.json"
    path.write_text(json.dumps(MIXTRAL_8X7B))
    shape = load_shape(path)
    p = predict(shape, "h100", 64, Plan(tp=2, pp=2, ep=8, global_batch=256, seq_len=4096, precision="fp8",
                                        ep_overlap=True))
    assert p.fits and p.tflops_per_gpu > 0
    assert plan_main(["--model", str(path), "--gpu", "h100", "--gpus", "64", "--tp", "2", "--pp", "2", "--ep",
                      "8", "--gbs", "256", "--precision", "fp8", "--json"]) == 0


def test_json_and_png_outputs(tmp_path, capsys):
    out = tmp_path / "pred.json"
    png = tmp_path / "pred.png"
    assert plan_main(["--record", "gb300", "--json", "--json-out", str(out), "--png", str(png)]) == 0
    d = json.loads(capsys.readouterr().out)
    assert d["fits"] and d["tflops_per_gpu"] > 1000 and set(d["step_s"]) >= {
        "compute", "exposed_a2a", "other_comm", "bubble", "optimizer", "step"}
    assert json.loads(out.read_text())["memory_gib"]["total"] > 0
    assert png.stat().st_size > 10_000 and png.read_bytes()[:4] == b"\x89PNG"
    # table output + records chart
    assert plan_main(["--records", "--png", str(tmp_path / "records.png")]) == 0
    assert "GB300" in capsys.readouterr().out
    assert (tmp_path / "records.png").stat().st_size > 10_000


def test_search_and_scale_cli(tmp_path, capsys):
    assert plan_main(["--record", "gb300", "--search", "--top", "3", "--png", str(tmp_path / "s.png")]) == 0
    txt = capsys.readouterr().out
    assert "best:" in txt and "changed:" in txt
    assert (tmp_path / "s.png").stat().st_size > 10_000
    assert plan_main(["--record", "gb300", "--scale", "256,512", "--scale-mode", "keep", "--png",
                      str(tmp_path / "scale.png"), "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert [p["n_gpus"] for p in d["points"]] == [256, 512] and d["points"][0]["days_to_train"] > 0
    assert (tmp_path / "scale.png").stat().st_size > 10_000


def test_user_gpu_file(tmp_path):
    f = tmp_path / "gpus.toml"
    f.write_text('[gpu.mygpu]\ngeneration = "hopper"\npeak_tflops = {bf16 = 1000, fp8 = 2000}\nhbm_gb = 96\n'
                 'hbm_tbps = 4.0\nnvlink_gbps_bidir = 900\nnvlink_domain = 8\nnic_gbit = 400\n')
    (g,) = load_gpu_file(f)
    assert g.nvlink_gbps == 450 and g.nic_gbps == 50 and get_gpu("MyGPU") is g
    bad = tmp_path / "bad.toml"
    bad.write_text('[gpu.x]\ngeneration = "hopper"\n')
    with pytest.raises(HardwareError, match="lacks"):
        load_gpu_file(bad)


def test_gpu_from_bench_dict():
    bench = {"bench_version": 2, "matmul": {"fp32": [{"n": 256, "tflops": 0.05}, {"n": 1024, "tflops": 0.1}],
                                            "bf16": []},
             "memory_bandwidth_gbps": 20.0, "op_overhead_us": 5.0, "cross_entropy_gelem_s": 0.5,
             "all_to_all": {"bandwidth_gbps": 1.0, "latency_us": 100.0},
             "fsdp_unit": {"bandwidth_gbps": 0.3, "latency_us": 3000.0}, "memory_gb": 16}
    g = gpu_from_bench(bench, name="local-test")
    assert g.generation == "cpu" and g.peak_tflops["fp32"] == 0.1 and g.matmul_curve[0] == (256, 0.05)
    assert (g.a2a_latency_us, g.fsdp_unit_latency_us, g.fsdp_unit_gbps, g.softmax_gelem_s) == (100.0, 3000.0, 0.3, 0.5)
    with pytest.raises(HardwareError, match="malformed"):
        gpu_from_bench({k: v for k, v in bench.items() if k != "fsdp_unit"})
    with pytest.raises(HardwareError, match="moetrain bench"):
        gpu_from_bench("/nonexistent/bench.json")
