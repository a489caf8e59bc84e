"""Any model size: the model is built on meta and only each rank's shards are materialised, yet the initial
weights are those of one process for every layout; HF weights stream into the sharded model; every group of the
mesh carries the configured timeout."""

from __future__ import annotations

import pytest
import torch

from moetrain.model.transformer import build_model

from .harness import ok_values, run_ranks
from .workers import (hang_in_dispatch_run, meta_build_run, mesh_timeouts_run, mixed_precision_run,
                      tiny_test_config)

pytestmark = pytest.mark.dist


@pytest.fixture(scope="module")
def single():
    cfg = tiny_test_config()
    model = build_model(cfg, seed=0)
    return {n: t.detach().clone() for n, t in list(model.named_parameters()) + list(model.named_buffers())}


# DP = 3 divides no expert dim of the tiny model: its experts are sharded on dim 0 (strided under EP = 2)
@pytest.mark.parametrize("dp,ep", [(2, 1), (1, 2), (2, 2), (1, 4), (3, 1), (3, 2)])
def test_meta_build_equals_single_process_weights(single, dp, ep):
    ranks = ok_values(run_ranks(dp * ep, meta_build_run, {"ep": ep}))
    total = sum(t.numel() for n, t in single.items() if not n.endswith("expert_bias"))
    for r in ranks:
        assert r["params"].keys() == single.keys()
        for name, want in single.items():
            assert torch.equal(r["params"][name], want), name  # bit-identical, not merely close
        # each rank materialised a shard, not the model (uneven shards of 3 ranks hold up to one expert more)
        assert r["local_numel"] <= total / (dp * ep) * 1.05 + 4096 + total / 16, (r["local_numel"], total)
    assert sum(r["local_numel"] for r in ranks) == total


def test_init_seeds_depend_on_name_and_expert_not_on_order():
    """Different parameters and different experts get different numbers; the same one always the same."""
    cfg = tiny_test_config()
    a, b = build_model(cfg, seed=0), build_model(cfg, seed=0)
    w13 = a.moe_layers()[0].experts.w13_E2FD
    assert not torch.equal(w13[0], w13[1])
    assert torch.equal(w13, b.moe_layers()[0].experts.w13_E2FD)
    assert not torch.equal(a.layers[0].self_attn.o_proj.weight, a.layers[1].self_attn.o_proj.weight)
    c = build_model(cfg, seed=1)
    assert not torch.equal(a.embed_tokens.weight, c.embed_tokens.weight)
    std = a.embed_tokens.weight.std().item()
    assert abs(std - cfg.init_std) < 0.05 * cfg.init_std


def _hf_checkpoint(tmp_path):
    from transformers import DeepseekV3Config, DeepseekV3ForCausalLM

    torch.manual_seed(3)
    hc = DeepseekV3Config(vocab_size=256, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                          num_hidden_layers=3, first_k_dense_replace=1, num_attention_heads=4, num_key_value_heads=4,
                          kv_lora_rank=16, q_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                          n_routed_experts=8, n_shared_experts=1, num_experts_per_tok=2, n_group=2, topk_group=1,
                          max_position_embeddings=128, rope_scaling=None, num_nextn_predict_layers=0)
    hf = DeepseekV3ForCausalLM(hc).eval()
    with torch.no_grad():
        for mod in hf.modules():
            if hasattr(mod, "e_score_correction_bias"):
                mod.e_score_correction_bias.copy_(torch.randn(8) * 0.3)
    path = tmp_path / "hf"
    hf.save_pretrained(path, safe_serialization=True)
    return hf, path


def test_init_from_hf_at_ep2_gives_hf_logits(tmp_path):
    pytest.importorskip("transformers")
    hf, path = _hf_checkpoint(tmp_path)
    tokens = torch.randint(0, 256, (2, 24), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        want = hf(tokens).logits
    ranks = ok_values(run_ranks(2, meta_build_run, {"ep": 2}, str(path), tokens))
    for r in ranks:
        torch.testing.assert_close(r["logits"], want, atol=1e-4, rtol=0)


def test_every_mesh_group_carries_the_timeout():
    for r in ok_values(run_ranks(4, mesh_timeouts_run)):
        assert r == {"pp": 7.0, "dp": 7.0, "ep": 7.0, "dp_ep": 7.0}, r


def test_hang_at_dp2_ep2_ends_with_the_phase_named():
    results = run_ranks(4, hang_in_dispatch_run, timeout=90)
    status, msg = results[0]
    assert status == "error" and "dispatch" in msg and "CollectiveError" in msg, msg


def test_fsdp_mixed_precision_computes_in_bf16_and_keeps_fp32_masters():
    """What ``moetrain train`` asks of FSDP2 on GPU (bf16 all-gather and compute, fp32 gradient reduction), run on
    gloo: the stored shards and the gradients stay fp32."""
    for r in ok_values(run_ranks(2, mixed_precision_run)):
        assert r["compute"] == "torch.bfloat16"
        assert r["stored"] == r["grad"] == r["expert_stored"] == r["expert_grad"] == "torch.float32"
