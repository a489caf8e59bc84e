"""Reference parity with Hugging Face ``transformers``' DeepseekV3 implementation.

For tiny random HF DeepseekV3 models (built and saved locally, no hub access): load into moetrain through
``load_hf_config`` + ``build_model`` + ``load_hf_checkpoint`` and compare logits, loss and the router's expert
selection; then save from moetrain and load back into HF with ``from_pretrained``.
"""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

transformers = pytest.importorskip("transformers")
from transformers import DeepseekV3Config, DeepseekV3ForCausalLM  # noqa: E402

from moetrain.interop.hf import (  # noqa: E402
    config_to_hf, load_hf_checkpoint, load_hf_config, save_hf_checkpoint)
from moetrain.model import IGNORE_INDEX, build_model  # noqa: E402
from moetrain.model.moe import MoE  # noqa: E402

B, L = 2, 32
LOGIT_ATOL = 1e-4

# Three tiny V3 shapes. All use interleaved YaRN RoPE (factor 4 or 40, tiny original context so the ramp matters),
# one dense first layer, and differ in q_lora, expert groups, head dims, shared experts, normalisation and mscale.
CASES: dict[str, dict] = {
    # q_lora on, 8 experts in 2 groups (keep 1), mscale != mscale_all_dim so cos/sin are scaled too.
    "qlora_g2_yarn4": dict(
        vocab_size=160, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=2,
        num_attention_heads=2, n_shared_experts=1, n_routed_experts=8, num_experts_per_tok=2, n_group=2,
        topk_group=1, q_lora_rank=24, kv_lora_rank=16, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=64,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                         "original_max_position_embeddings": 16, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 0.8},
        bias_std=0.1, attn="eager"),
    # q_lora None (plain q_proj), 16 experts in 4 groups keep 2, top-4, V3-like YaRN factor 40, sdpa attention.
    "noq_e16_g4k2_yarn40": dict(
        vocab_size=256, hidden_size=64, intermediate_size=128, moe_intermediate_size=24, num_hidden_layers=3,
        num_attention_heads=4, n_shared_experts=1, n_routed_experts=16, num_experts_per_tok=4, n_group=4,
        topk_group=2, q_lora_rank=None, kv_lora_rank=32, qk_rope_head_dim=8, qk_nope_head_dim=16, v_head_dim=16,
        routed_scaling_factor=2.5, norm_topk_prob=True, max_position_embeddings=320,
        rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0,
                         "original_max_position_embeddings": 8, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 1.0, "mscale_all_dim": 1.0},
        bias_std=0.05, attn="sdpa"),
    # q_lora on, no groups, 2 shared experts, unnormalised gates, scale 1, v_head_dim != nope, mscale 0.707.
    "qlora_e12_shared2_nonorm": dict(
        vocab_size=128, hidden_size=64, intermediate_size=80, moe_intermediate_size=16, num_hidden_layers=3,
        num_attention_heads=3, n_shared_experts=2, n_routed_experts=12, num_experts_per_tok=3, n_group=1,
        topk_group=1, q_lora_rank=32, kv_lora_rank=24, qk_rope_head_dim=16, qk_nope_head_dim=8, v_head_dim=12,
        routed_scaling_factor=1.0, norm_topk_prob=False, max_position_embeddings=160,
        rope_parameters={"rope_type": "yarn", "rope_theta": 50000.0, "factor": 40.0,
                         "original_max_position_embeddings": 4, "beta_fast": 32, "beta_slow": 1,
                         "mscale": 0.707, "mscale_all_dim": 0.707},
        bias_std=0.0, attn="eager"),
}


def _hf_config(case: dict) -> DeepseekV3Config:
    kw = {k: v for k, v in case.items() if k not in ("bias_std", "attn")}
    cfg = DeepseekV3Config(**kw, num_key_value_heads=kw["num_attention_heads"], first_k_dense_replace=1,
                           rope_interleave=True, num_mtp_layers=0, initializer_range=0.1, rms_norm_eps=1e-6,
                           tie_word_embeddings=False)
    cfg._attn_implementation = case["attn"]
    return cfg


class Case:
    """One HF model, its checkpoint, the moetrain model loaded from it and both forwards on the same tokens."""

    def __init__(self, name: str, tmp: Path):
        spec = CASES[name]
        self.name, self.spec = name, spec
        torch.manual_seed(1234)
        self.hf = DeepseekV3ForCausalLM(_hf_config(spec)).eval()
        with torch.no_grad():
            # Non-trivial norms (a swapped norm would show) and routers whose scores are well spread (routing varies
            # from token to token), plus a random expert bias that changes the selection.
            for n, p in self.hf.named_parameters():
                if n.endswith("norm.weight"):
                    p.add_(0.2 * torch.randn_like(p))
                if n.endswith("mlp.gate.weight"):
                    p.copy_(0.25 * torch.randn_like(p))
            for n, b in self.hf.named_buffers():
                if n.endswith("e_score_correction_bias"):
                    b.copy_(spec["bias_std"] * torch.randn_like(b))
        self.hf_dir = tmp / "hf"
        self.hf.save_pretrained(self.hf_dir)
        self.cfg = load_hf_config(self.hf_dir)
        self.model = build_model(self.cfg, seed=99).eval()
        self.load_result = load_hf_checkpoint(self.model, self.hf_dir)
        self.tokens = torch.randint(0, spec["vocab_size"], (B, L), generator=torch.Generator().manual_seed(7))
        self.labels = torch.full_like(self.tokens, IGNORE_INDEX)
        self.labels[:, :-1] = self.tokens[:, 1:]  # moetrain: labels are the next tokens; HF shifts internally
        with torch.no_grad():
            self.hf_out = self.hf(self.tokens, labels=self.tokens)
            self.out = self.model(self.tokens, self.labels, return_logits=True)
        self.tmp = tmp


@pytest.fixture(scope="module", params=list(CASES))
def case(request, tmp_path_factory) -> Case:
    return Case(request.param, tmp_path_factory.mktemp(request.param))


def test_config_mapped(case: Case):
    s, cfg = case.spec, case.cfg
    assert cfg.q_lora_rank == (s["q_lora_rank"] or 0)
    assert (cfg.n_routed_experts, cfg.top_k, cfg.n_expert_groups, cfg.n_limited_groups) == (
        s["n_routed_experts"], s["num_experts_per_tok"], s["n_group"], s["topk_group"])
    assert cfg.rope_factor == s["rope_parameters"]["factor"] and cfg.rope_interleave
    assert cfg.rope_original_seq_len == s["rope_parameters"]["original_max_position_embeddings"]
    assert cfg.rope_mscale_all_dim == s["rope_parameters"]["mscale_all_dim"]
    assert cfg.mtp_depth == 0 and cfg.score_func == "sigmoid"
    assert case.load_result.missing == [] and case.load_result.unexpected == []
    # HF wrote the released per-expert layout, which is what was loaded.
    from safetensors import safe_open
    with safe_open(str(case.hf_dir / "model.safetensors"), "pt") as f:
        names = set(f.keys())
    assert "model.layers.1.mlp.experts.0.gate_proj.weight" in names
    assert not any(n.endswith("gate_up_proj") for n in names)
    # moetrain's softmax scale equals HF's attention scaling.
    assert case.model.layers[0].self_attn.softmax_scale == pytest.approx(case.hf.model.layers[0].self_attn.scaling,
                                                                         rel=1e-12)


def test_logits_and_loss_match(case: Case, record_property):
    diff = (case.hf_out.logits - case.out.logits_BLV).abs().max().item()
    record_property("max_abs_logit_diff", diff)
    print(f"\n[{case.name}] max |logits_hf - logits_moetrain| = {diff:.3e}")
    assert case.hf_out.logits.abs().max() > 0.5  # the comparison is not between near-zero numbers
    assert diff <= LOGIT_ATOL
    our_loss = case.out.lm_loss_sum / case.out.n_loss_tokens
    assert case.out.n_loss_tokens.item() == B * (L - 1)
    assert our_loss.item() == pytest.approx(case.hf_out.loss.item(), abs=1e-5)


def _capture_router(hf_model, layer: int, tokens: torch.Tensor):
    got = {}

    def hook(mod, inputs, output):
        got["x"] = inputs[0].detach().reshape(-1, inputs[0].shape[-1]).clone()
        got["weights"], got["idx"] = output[1].detach(), output[2].detach()

    h = hf_model.model.layers[layer].mlp.gate.register_forward_hook(hook)
    try:
        with torch.no_grad():
            hf_model(tokens)
    finally:
        h.remove()
    return got


def test_router_selects_same_experts(case: Case):
    """HF's router and moetrain's Router choose the same experts with the same weights on the same inputs, in every
    MoE layer: group-limited selection, expert bias for selection only, normalisation and scaling all agree."""
    moe_layers = [i for i, b in enumerate(case.model.layers) if isinstance(b.mlp, MoE)]
    assert moe_layers
    for i in moe_layers:
        got = _capture_router(case.hf, i, case.tokens)
        router = case.model.layers[i].mlp.gate
        with torch.no_grad():
            r = router(got["x"])
        hf_idx, order = got["idx"].sort(dim=-1)
        our_idx, our_order = r.topk_idx_TK.sort(dim=-1)
        assert torch.equal(hf_idx, our_idx), f"layer {i}: expert selection differs"
        torch.testing.assert_close(got["weights"].gather(1, order), r.topk_weight_TK.gather(1, our_order),
                                   rtol=1e-6, atol=1e-7)

        # The routing is not trivial: tokens choose different expert sets ...
        assert len({tuple(row) for row in our_idx.tolist()}) > 4
        G = case.cfg.n_expert_groups
        if G > 1:
            # ... and with groups, every token's experts lie in at most n_limited_groups groups.
            per = case.cfg.n_routed_experts // G
            groups_used = (our_idx // per)
            assert max(len(set(g)) for g in groups_used.tolist()) <= case.cfg.n_limited_groups
        if case.spec["bias_std"] > 0:
            # ... and the bias changes the selection (so its mapping and use are both exercised).
            bias = router.expert_bias.clone()
            with torch.no_grad():
                router.expert_bias.zero_()
                r0 = router(got["x"])
                router.expert_bias.copy_(bias)
            assert not torch.equal(r0.topk_idx_TK.sort(dim=-1).values, our_idx)


def test_save_from_moetrain_loads_in_hf(case: Case):
    """moetrain -> HF: save_hf_checkpoint output loads with from_pretrained, with nothing missing or unexpected, and
    gives bit-identical outputs to the original HF model."""
    out_dir = case.tmp / "from_moetrain"
    save_hf_checkpoint(case.model, out_dir, max_shard_bytes=200_000)
    with open(out_dir / "config.json") as f:
        written = json.load(f)
    assert written["model_type"] == "deepseek_v3" and written["architectures"] == ["DeepseekV3ForCausalLM"]
    assert len(json.load(open(out_dir / "model.safetensors.index.json"))["weight_map"]) > 0
    hf2, info = DeepseekV3ForCausalLM.from_pretrained(out_dir, attn_implementation=case.spec["attn"],
                                                      output_loading_info=True)
    hf2.eval()
    assert not info["missing_keys"] and not info["unexpected_keys"] and not info["mismatched_keys"], info
    sd1, sd2 = case.hf.state_dict(), hf2.state_dict()
    assert sd1.keys() == sd2.keys()
    for k in sd1:
        assert torch.equal(sd1[k], sd2[k]), k
    with torch.no_grad():
        out2 = hf2(case.tokens, labels=case.tokens)
    assert torch.equal(out2.logits, case.hf_out.logits)
    assert torch.equal(out2.loss, case.hf_out.loss)


def test_config_to_hf_is_read_by_transformers(case: Case):
    """The config.json moetrain writes means the same model to transformers (rope, scaling, q_lora, groups)."""
    hf_cfg = DeepseekV3Config.from_dict(config_to_hf(case.cfg))
    ref = case.hf.config
    for key in ("hidden_size", "num_hidden_layers", "first_k_dense_replace", "n_routed_experts", "n_group",
                "topk_group", "num_experts_per_tok", "q_lora_rank", "kv_lora_rank", "qk_rope_head_dim",
                "qk_nope_head_dim", "v_head_dim", "routed_scaling_factor", "norm_topk_prob", "rope_interleave",
                "num_attention_heads", "num_key_value_heads", "intermediate_size", "moe_intermediate_size",
                "n_shared_experts", "vocab_size"):
        assert getattr(hf_cfg, key) == getattr(ref, key), key
    for key in ("rope_type", "rope_theta", "factor", "original_max_position_embeddings", "beta_fast", "beta_slow",
                "mscale", "mscale_all_dim"):
        assert hf_cfg.rope_parameters[key] == ref.rope_parameters[key], key


def test_hf_v5_stacked_expert_layout(case: Case, tmp_path):
    """The transformers-v5 in-memory layout (experts.gate_up_proj (E, 2F, D), experts.down_proj (E, D, F)), as a
    plain ``save_file`` of ``state_dict()`` writes it, loads to the same weights as the per-expert layout."""
    from safetensors.torch import save_file

    sd = {k: v.contiguous() for k, v in case.hf.state_dict().items()}
    assert any(k.endswith("experts.gate_up_proj") for k in sd)
    save_file(sd, str(tmp_path / "model.safetensors"))
    other = build_model(case.cfg, seed=5)
    res = load_hf_checkpoint(other, tmp_path)
    assert res.missing == [] and res.unexpected == []
    for (n, a), (_, b) in zip(case.model.state_dict().items(), other.state_dict().items()):
        assert torch.equal(a, b), n
