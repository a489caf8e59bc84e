"""Qwen3-MoE against transformers' ``Qwen3MoeForCausalLM`` (fp32, tiny random models saved locally): the config
both ways, logits to 1e-5 relative and one backward's gradients, at EP 1 here and at EP 2 through the parallel test
harness; the v4 per-expert and the v5 stacked layouts both load; save/export reload in transformers; the balance loss
equals transformers' ``load_balancing_loss_func`` (one layer) and the global-batch one the single-process loss."""

from __future__ import annotations

import json

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import Qwen3MoeConfig as HFQwen3MoeConfig  # noqa: E402
from transformers import Qwen3MoeForCausalLM  # noqa: E402
from transformers.models.qwen3_moe.modeling_qwen3_moe import load_balancing_loss_func  # noqa: E402

from moetrain.errors import ConfigError  # noqa: E402
from moetrain.interop.hf import (  # noqa: E402
    config_from_hf, config_to_hf, load_hf_checkpoint, load_hf_config, save_hf_checkpoint)
from moetrain.model import IGNORE_INDEX, Qwen3MoeConfig, build_model, get_preset  # noqa: E402
from moetrain.model.moe import batch_balance_loss  # noqa: E402
from tests.parallel.harness import ok_values, run_ranks  # noqa: E402
from tests.parallel.qwen3_workers import global_balance_loss_run, hf_forward_backward_run  # noqa: E402

B, L = 2, 24
REL = 1e-5

# One dense first layer (mlp_only_layers=[0]), 8 experts top-3, 4 query / 2 key-value heads with head_dim != D/H.
HF_KW = dict(vocab_size=160, hidden_size=48, intermediate_size=80, moe_intermediate_size=24, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=3,
             norm_topk_prob=True, decoder_sparse_step=1, mlp_only_layers=[0], max_position_embeddings=64,
             tie_word_embeddings=False, rope_theta=10000.0, rms_norm_eps=1e-6, initializer_range=0.1)


def _hf_name(ours: str) -> str:
    """Our parameter name -> transformers-v5's in-memory name (stacked experts)."""
    name = ours.replace("mlp.experts.w13_E2FD", "mlp.experts.gate_up_proj").replace("mlp.experts.w2_EDF",
                                                                                     "mlp.experts.down_proj")
    for a, b in (("w1", "gate_proj"), ("w3", "up_proj"), ("w2", "down_proj")):
        name = name.replace(f"mlp.{a}.weight", f"mlp.{b}.weight")
    return name if name == "lm_head.weight" else "model." + name


@pytest.fixture(scope="module")
def hf_dir(tmp_path_factory):
    """A random HF model (routers widened so the top-k choice has clear margins) saved by transformers itself."""
    torch.manual_seed(7)
    model = Qwen3MoeForCausalLM(HFQwen3MoeConfig(**HF_KW)).eval()
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("mlp.gate.weight"):
                p.normal_(0, 1.0)
            elif name.endswith("norm.weight"):
                p.uniform_(0.5, 1.5)  # not all ones: a swapped or missing q/k norm shows
    out = tmp_path_factory.mktemp("qwen3") / "hf"
    model.save_pretrained(out, safe_serialization=True)
    return out


@pytest.fixture(scope="module")
def tokens():
    return torch.randint(0, HF_KW["vocab_size"], (B, L + 1), generator=torch.Generator().manual_seed(3))


@pytest.fixture(scope="module")
def hf_reference(hf_dir, tokens):
    """transformers' logits and the gradients of the mean next-token CE over the batch."""
    model = Qwen3MoeForCausalLM.from_pretrained(hf_dir).float().train()
    logits = model(tokens[:, :-1]).logits
    loss = torch.nn.functional.cross_entropy(logits.flatten(0, 1), tokens[:, 1:].flatten())
    loss.backward()
    return {"logits": logits.detach(), "grads": {n: p.grad.clone() for n, p in model.named_parameters()}}


def _rel(a: torch.Tensor, b: torch.Tensor) -> float:
    return ((a - b).abs().max() / b.abs().max()).item()


def test_config_read_from_transformers(hf_dir):
    cfg = load_hf_config(hf_dir)
    assert isinstance(cfg, Qwen3MoeConfig)
    assert (cfg.dim, cfg.n_layers, cfg.n_dense_layers, cfg.dense_ffn_dim, cfg.expert_ffn_dim) == (48, 3, 1, 80, 24)
    assert (cfg.n_heads, cfg.n_kv_heads, cfg.head_dim, cfg.n_routed_experts, cfg.top_k) == (4, 2, 16, 8, 3)
    assert (cfg.score_func, cfg.route_scale, cfg.n_shared_experts, cfg.mtp_depth, cfg.bias_update_rate) == (
        "softmax", 1.0, 0, 0, 0.0)
    assert cfg.balance_loss_alpha == 0.001 and cfg.balance_loss.value == "global_batch"


def test_logits_and_gradients_match_at_ep1(hf_dir, tokens, hf_reference):
    model = build_model(load_hf_config(hf_dir), seed=None)
    res = load_hf_checkpoint(model, hf_dir)
    assert res.missing == [] and res.unexpected == []
    x, y = tokens[:, :-1], tokens[:, 1:]
    out = model(x, y, return_logits=True)
    assert _rel(out.logits_BLV.detach(), hf_reference["logits"]) <= REL
    (out.lm_loss_sum / y.numel()).backward()
    names = [n for n, _ in model.named_parameters()]
    assert len(names) == len(hf_reference["grads"])
    for name, p in model.named_parameters():
        want = hf_reference["grads"][_hf_name(name)]
        assert want.abs().max() > 0, name
        assert _rel(p.grad, want) <= REL, name


@pytest.mark.dist
def test_logits_and_gradients_match_at_ep2(hf_dir, tokens, hf_reference):
    ranks = ok_values(run_ranks(2, hf_forward_backward_run, str(hf_dir), tokens, 2))
    for r, got in enumerate(ranks):
        assert _rel(got["logits"], hf_reference["logits"][r:r + 1]) <= REL
    for name, g in ranks[0]["grads"].items():
        assert _rel(g, hf_reference["grads"][_hf_name(name)]) <= REL, name


def test_stacked_v5_layout_loads_and_save_reloads_in_transformers(hf_dir, tokens, hf_reference, tmp_path):
    from safetensors.torch import load_file, save_file

    hf = Qwen3MoeForCausalLM.from_pretrained(hf_dir)
    stacked = tmp_path / "stacked"
    stacked.mkdir()
    save_file({n: p.detach().contiguous() for n, p in hf.state_dict().items()}, stacked / "model.safetensors")
    (stacked / "config.json").write_text((hf_dir / "config.json").read_text())
    assert any(k.endswith("mlp.experts.gate_up_proj") for k in load_file(stacked / "model.safetensors"))
    model = build_model(load_hf_config(stacked), seed=None)
    assert load_hf_checkpoint(model, stacked).missing == []
    x = tokens[:, :-1]
    with torch.no_grad():
        ours = model(x, return_logits=True).logits_BLV
    assert _rel(ours, hf_reference["logits"]) <= REL
    out = save_hf_checkpoint(model, tmp_path / "saved")
    a, b = load_file(hf_dir / "model.safetensors"), load_file(out / "model-00001-of-00001.safetensors")
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    back = Qwen3MoeForCausalLM.from_pretrained(out).eval()
    with torch.no_grad():
        assert torch.equal(back(x).logits, Qwen3MoeForCausalLM.from_pretrained(hf_dir).eval()(x).logits)


@pytest.mark.parametrize("name", ["qwen3-30b-a3b", "qwen3-235b-a22b", "qwen3-tiny"])
def test_config_round_trip_every_qwen3_preset(name):
    cfg = get_preset(name)
    d = json.loads(json.dumps(config_to_hf(cfg)))
    assert d["model_type"] == "qwen3_moe" and d["num_key_value_heads"] == cfg.n_kv_heads
    assert config_from_hf(d) == cfg
    hf = HFQwen3MoeConfig(**{k: v for k, v in d.items() if k != "moetrain"})
    assert (hf.num_experts, hf.head_dim, hf.moe_intermediate_size) == (cfg.n_routed_experts, cfg.head_dim,
                                                                      cfg.expert_ffn_dim)


@pytest.mark.parametrize("change,match", [
    ({"use_sliding_window": True}, "use_sliding_window"),
    ({"decoder_sparse_step": 2}, "decoder_sparse_step=2"),
    ({"mlp_only_layers": [1]}, r"mlp_only_layers=\[1\]"),
    ({"attention_bias": True}, "attention_bias"),
    ({"rope_scaling": {"rope_type": "yarn", "factor": 4.0}}, "rope type 'yarn'"),
    ({"num_key_value_heads": 3}, "n_kv_heads=3 must divide n_heads=4"),
])
def test_unsupported_hf_configs_are_refused_by_name(change, match):
    d = config_to_hf(get_preset("qwen3-tiny")) | change
    with pytest.raises(ConfigError, match=match):
        config_from_hf(d)


@pytest.mark.parametrize("change, match", [
    ({"hidden_size": "big"}, "hidden_size='big' must be an integer"),
    ({"num_experts_per_tok": 2.5}, "num_experts_per_tok=2.5 must be an integer"),
    ({"norm_topk_prob": "false"}, "norm_topk_prob='false' must be true or false"),
    ({"rope_theta": "1e6", "rope_parameters": None}, "rope_theta='1e6' must be a number"),
    ({"decoder_sparse_step": "1"}, "decoder_sparse_step='1' must be an integer"),
])
def test_mistyped_hf_config_values_are_refused_by_name(change, match):
    # Untyped reads gave a ValueError traceback (int("big")), a silent 2 (int(2.5)) or a silent True
    # (bool("false")); each must be a ConfigError naming the key.
    d = config_to_hf(get_preset("qwen3-tiny")) | change
    with pytest.raises(ConfigError, match=match):
        config_from_hf(d)


def test_export_refuses_what_qwen3_cannot_compute():
    with pytest.raises(ConfigError, match=r"model.n_shared_experts=1 \(needs 0\)"):
        config_to_hf(get_preset("qwen3-tiny").replace(n_shared_experts=1))
    with pytest.raises(ConfigError, match="model.family='deepseek_v3' cannot change a qwen3_moe model"):
        get_preset("qwen3-tiny").replace(family="deepseek_v3")


def _routing(T: int, E: int, K: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    logits = torch.randn(T, E, generator=g) * 2
    return logits, logits.softmax(-1).topk(K, dim=-1).indices


def test_batch_balance_loss_equals_transformers_for_one_layer():
    logits, idx = _routing(T=40, E=8, K=3, seed=0)
    want = load_balancing_loss_func((logits,), num_experts=8, top_k=3)
    got = batch_balance_loss(logits.softmax(-1), idx, n_seqs=4) / 4
    assert abs(got.item() - want.item()) <= 1e-6 * want.item()
    # a padded token counts nowhere: as transformers with an attention mask
    mask = torch.ones(4, 10, dtype=torch.bool)
    mask[1, 7:] = False
    want = load_balancing_loss_func((logits,), num_experts=8, top_k=3, attention_mask=mask)
    got = batch_balance_loss(logits.softmax(-1), idx, n_seqs=4, valid_T=mask.flatten()) / 4
    assert abs(got.item() - want.item()) <= 1e-6 * want.item()


@pytest.mark.dist
def test_global_batch_balance_loss_over_dp_equals_the_single_process_loss():
    """Two ranks with different tokens: the shares sum to the one-process loss of all tokens, and the gradients of
    the summed shares are the one-process gradients; the micro-batch form of either half alone is not that loss."""
    logits, idx = _routing(T=48, E=8, K=2, seed=1)
    scores = logits.softmax(-1)
    ref_s = scores.clone().requires_grad_(True)
    ref = batch_balance_loss(ref_s, idx, n_seqs=4)
    ref.backward()
    ranks = ok_values(run_ranks(2, global_balance_loss_run, scores, idx, 4))
    total = sum(r["share"] for r in ranks)
    assert abs(total.item() - ref.item()) <= 1e-6 * ref.item()
    torch.testing.assert_close(torch.cat([r["grad"] for r in ranks]), ref_s.grad, rtol=1e-6, atol=1e-9)
    halves = sum(batch_balance_loss(scores[h * 24:(h + 1) * 24], idx[h * 24:(h + 1) * 24], 2) for h in range(2))
    assert abs(halves.item() - ref.item()) > 1e-3 * ref.item(), "the halves' own losses already sum to the global one"


def test_qwen3_tiny_loss_ignores_padding_in_its_balance_loss():
    cfg = get_preset("qwen3-tiny").replace(vocab_size=64, balance_loss="micro_batch")
    model = build_model(cfg, seed=0)
    x = torch.randint(0, 64, (2, 16), generator=torch.Generator().manual_seed(0))
    y = x.roll(-1, 1)
    y[1, 8:] = IGNORE_INDEX
    out = model(x, y)
    assert out.balance_loss_sum is not None and out.balance_loss_sum.item() > 0
