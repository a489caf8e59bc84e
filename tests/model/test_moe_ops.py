"""Unit tests of the MoE building blocks, config validation, RoPE/YaRN and parameter/FLOPs accounting."""

from __future__ import annotations

import math

import pytest
import torch

from moetrain.accounting import count_params, flops_per_token
from moetrain.model.config import DeepSeekV3Config
from moetrain.model import PRESETS, ConfigError, ModelConfig, build_model, get_preset
from moetrain.model.layers import SwiGLU, rope_cos_sin, rope_inv_freq
from moetrain.model.moe import (CapacityConfig, MoE, Router, balanced_assignment, capacity_keep_mask, permute,
                                sequence_balance_loss, unpermute)
from moetrain.model.experts import GroupedExperts, grouped_mm, padded_slots


def moe_cfg(**changes) -> ModelConfig:
    base = dict(vocab_size=64, dim=16, n_layers=2, n_dense_layers=1, dense_ffn_dim=32, expert_ffn_dim=32,
                n_routed_experts=8, n_shared_experts=1, top_k=2, n_expert_groups=1, n_limited_groups=1, n_heads=2,
                q_lora_rank=0, kv_lora_rank=8, qk_nope_head_dim=8, qk_rope_head_dim=4, v_head_dim=8,
                rope_factor=1.0, max_seq_len=64, mtp_depth=0)
    base.update(changes)
    return DeepSeekV3Config(**base)


def hand_router(scores: list[list[float]], **changes) -> tuple[Router, torch.Tensor]:
    """A sigmoid router whose scores are exactly ``scores``: weight = identity, x = logit(scores)."""
    s = torch.tensor(scores, dtype=torch.float32)
    E = s.shape[1]
    cfg = moe_cfg(dim=E, n_routed_experts=E, **changes)
    r = Router(cfg)
    with torch.no_grad():
        r.weight.copy_(torch.eye(E))
    return r, torch.logit(s.double()).float()


# ---------------------------------------------------------------------------------------------------------------
# MoE == FFN in the trivial case
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("use_grouped_mm", [True, False])
def test_single_expert_top1_equals_swiglu(use_grouped_mm):
    """One routed expert, top-1, no shared expert, norm_topk with route_scale 1: the gate weight is exactly 1, so the
    MoE is a plain SwiGLU FFN with the same weights -- outputs and gradients."""
    cfg = moe_cfg(n_routed_experts=1, top_k=1, n_shared_experts=0, route_scale=1.0, norm_topk=True)
    torch.manual_seed(0)
    moe = MoE(cfg)
    moe.experts.use_grouped_mm = use_grouped_mm
    with torch.no_grad():
        for p in (moe.gate.weight, moe.experts.w1_EFD, moe.experts.w2_EDF, moe.experts.w3_EFD):
            p.normal_(0, 0.3)
    ffn = SwiGLU(cfg.dim, cfg.expert_ffn_dim)
    with torch.no_grad():
        ffn.w1.weight.copy_(moe.experts.w1_EFD[0])
        ffn.w2.weight.copy_(moe.experts.w2_EDF[0])
        ffn.w3.weight.copy_(moe.experts.w3_EFD[0])
    x = torch.randn(2, 5, cfg.dim)
    x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
    y_moe, stats = moe(x1)
    y_ffn = ffn(x2)
    assert torch.equal(moe.gate(x.view(-1, cfg.dim)).topk_weight_TK, torch.ones(10, 1))
    torch.testing.assert_close(y_moe, y_ffn, rtol=1e-6, atol=1e-6)
    assert stats.tokens_per_expert_E.tolist() == [10]
    g = torch.randn_like(y_ffn)
    (y_moe * g).sum().backward()
    (y_ffn * g).sum().backward()
    torch.testing.assert_close(x1.grad, x2.grad, rtol=1e-5, atol=1e-6)
    g1, g3 = moe.experts.w13_E2FD.grad[0].chunk(2, dim=0)  # [gate; up] stacked along the output dim
    torch.testing.assert_close(g1, ffn.w1.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(moe.experts.w2_EDF.grad[0], ffn.w2.weight.grad, rtol=1e-5, atol=1e-6)
    torch.testing.assert_close(g3, ffn.w3.weight.grad, rtol=1e-5, atol=1e-6)
    # The gate weight s/s is constant, so the router gets (numerically) no gradient.
    assert moe.gate.weight.grad is None or moe.gate.weight.grad.abs().max() < 1e-6


# ---------------------------------------------------------------------------------------------------------------
# Router
# ---------------------------------------------------------------------------------------------------------------

def test_group_limited_routing_keeps_only_best_groups():
    # 4 groups of 2 experts; a group scores the sum of its top-2 scores; keep 2 groups.
    #   group 0: [0.95, 0.05] -> 1.00   (holds the single best expert, but a poor group)
    #   group 1: [0.72, 0.70] -> 1.42   kept
    #   group 2: [0.60, 0.66] -> 1.26   kept
    #   group 3: [0.10, 0.10] -> 0.20
    scores = [[0.95, 0.05, 0.72, 0.70, 0.60, 0.66, 0.10, 0.10]]
    r, x = hand_router(scores, n_expert_groups=4, n_limited_groups=2, top_k=3)
    out = r(x)
    assert sorted(out.topk_idx_TK[0].tolist()) == [2, 3, 5]  # expert 0 (best overall) is excluded with its group
    torch.testing.assert_close(out.scores_TE, torch.tensor(scores))
    # Without groups the same scores pick expert 0.
    r1, _ = hand_router(scores, top_k=3)
    assert sorted(r1(x).topk_idx_TK[0].tolist()) == [0, 2, 3]
    # Many random tokens: every selection lies within the 2 kept groups, which are the 2 best by top-2 sum.
    g = torch.Generator().manual_seed(0)
    s = torch.rand(256, 8, generator=g) * 0.98 + 0.01
    r2, _ = hand_router(s.tolist(), n_expert_groups=4, n_limited_groups=2, top_k=3)
    out = r2(torch.logit(s.double()).float())
    kept = s.view(256, 4, 2).topk(2, dim=-1).values.sum(-1).topk(2, dim=-1).indices  # (T, 2)
    chosen_groups = out.topk_idx_TK // 2
    assert all(set(c) <= set(k) for c, k in zip(chosen_groups.tolist(), kept.tolist()))


@pytest.mark.parametrize("norm_topk", [True, False])
def test_expert_bias_changes_selection_not_weights(norm_topk):
    scores = [[0.9, 0.8, 0.3, 0.2]]
    r, x = hand_router(scores, top_k=2, route_scale=2.5, norm_topk=norm_topk)
    plain = r(x)
    assert sorted(plain.topk_idx_TK[0].tolist()) == [0, 1]
    with torch.no_grad():
        r.expert_bias.copy_(torch.tensor([0.0, 0.0, 0.7, 0.0]))  # biased choice scores: 0.9, 0.8, 1.0, 0.2
    biased = r(x)
    idx = biased.topk_idx_TK[0].tolist()
    assert sorted(idx) == [0, 2]
    # Gate weights are the *unbiased* scores of the chosen experts (0.9 and 0.3), normalised and scaled.
    s = torch.tensor(scores)[0, idx]
    want = (s / s.sum() if norm_topk else s) * 2.5
    torch.testing.assert_close(biased.topk_weight_TK[0], want)
    torch.testing.assert_close(biased.scores_TE, plain.scores_TE)  # the scores themselves ignore the bias
    # Same rule with bias zero: weights are the unbiased scores of experts 0 and 1.
    s0 = torch.tensor(scores)[0, plain.topk_idx_TK[0]]
    torch.testing.assert_close(plain.topk_weight_TK[0], (s0 / s0.sum() if norm_topk else s0) * 2.5)


def test_balanced_routing_gives_equal_counts():
    cfg = moe_cfg(routing="balanced", n_routed_experts=8, top_k=4, n_expert_groups=4, n_limited_groups=2)
    r = Router(cfg)
    torch.nn.init.normal_(r.weight)
    out = r(torch.randn(16, cfg.dim))
    assert torch.bincount(out.topk_idx_TK.flatten(), minlength=8).tolist() == [8] * 8
    assert all(len(set(row)) == 4 for row in out.topk_idx_TK.tolist())  # no expert twice for a token
    # Weights still come from the scores (so the router keeps its gradient).
    torch.testing.assert_close(out.topk_weight_TK,
                               out.scores_TE.gather(1, out.topk_idx_TK) /
                               out.scores_TE.gather(1, out.topk_idx_TK).sum(-1, keepdim=True) * cfg.route_scale)
    counts = torch.bincount(balanced_assignment(7, 3, 5).flatten(), minlength=5)
    assert counts.max() - counts.min() <= 1 and counts.sum() == 21


def test_sequence_balance_loss_hand_computed():
    # E = 3 experts, K = 1, two sequences of L = 2 tokens. f_i = E/(K L) * count_i = 1.5 * count_i,
    # P_i = mean over the sequence of s_i / sum_j s_j; loss = sum over sequences of sum_i f_i P_i.
    scores = torch.tensor([
        [0.5, 0.3, 0.2],   # seq 0, token 0 -> expert 0   (row sum 1)
        [0.2, 0.2, 0.6],   # seq 0, token 1 -> expert 2   (row sum 1)
        [1.0, 1.0, 2.0],   # seq 1, token 0 -> expert 2   (row sum 4: normalised 0.25, 0.25, 0.5)
        [0.3, 0.6, 0.1],   # seq 1, token 1 -> expert 1   (row sum 1)
    ])
    idx = torch.tensor([[0], [2], [2], [1]])
    # seq 0: f = 1.5*[1, 0, 1] = [1.5, 0, 1.5]; P = [(0.5+0.2)/2, (0.3+0.2)/2, (0.2+0.6)/2] = [0.35, 0.25, 0.40]
    #        loss = 1.5*0.35 + 1.5*0.40 = 0.525 + 0.600 = 1.125
    # seq 1: f = [0, 1.5, 1.5]; P = [(0.25+0.3)/2, (0.25+0.6)/2, (0.5+0.1)/2] = [0.275, 0.425, 0.300]
    #        loss = 1.5*0.425 + 1.5*0.300 = 0.6375 + 0.4500 = 1.0875
    # total = 1.125 + 1.0875 = 2.2125
    assert sequence_balance_loss(scores, idx, n_seqs=2).item() == pytest.approx(2.2125, abs=1e-6)
    # K = 2, one sequence of 2 tokens, E = 4: picks {0,1} and {1,2}; counts [1,2,1,0]; f = 4/(2*2)*counts = counts;
    # uniform scores give P = 1/4 each: loss = (1 + 2 + 1 + 0) / 4 = 1.0
    uniform = torch.full((2, 4), 0.3)
    assert sequence_balance_loss(uniform, torch.tensor([[0, 1], [1, 2]]), n_seqs=1).item() == pytest.approx(1.0)
    # Perfectly balanced selection with uniform scores has the minimum value 1 per sequence.
    assert sequence_balance_loss(torch.full((4, 4), 0.1), torch.tensor([[0], [1], [2], [3]]), 1).item() == \
        pytest.approx(1.0)


# ---------------------------------------------------------------------------------------------------------------
# Dispatch
# ---------------------------------------------------------------------------------------------------------------

def _random_topk(T: int, K: int, E: int, seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    g = torch.Generator().manual_seed(seed)
    idx = torch.stack([torch.randperm(E, generator=g)[:K] for _ in range(T)])
    w = torch.rand(T, K, generator=g)
    return idx, w


def test_permute_unpermute_round_trip():
    T, K, E, D = 10, 3, 5, 6
    x = torch.randn(T, D)
    idx, w = _random_topk(T, K, E)
    x_SD, counts, state = permute(x, idx, w, E)
    assert counts.tolist() == torch.bincount(idx.flatten(), minlength=E).tolist()
    assert x_SD.shape == (T * K, D)
    experts_of_rows = torch.repeat_interleave(torch.arange(E), counts)
    # Every row is a copy of its token, grouped by expert in token order (stable).
    for s in range(T * K):
        t = state.row_token_S[s].item()
        assert torch.equal(x_SD[s], x[t]) and experts_of_rows[s].item() in idx[t].tolist()
    for e in range(E):
        toks = state.row_token_S[experts_of_rows == e]
        assert toks.tolist() == sorted(toks.tolist())
    # Identity experts: unpermute gives sum_k w_tk * x_t; with weights 1/K, x itself.
    y = unpermute(x_SD, state, x.dtype)
    torch.testing.assert_close(y, x * w.sum(1, keepdim=True))
    x_SD, counts, state = permute(x, idx, torch.full((T, K), 1.0 / K), E)
    torch.testing.assert_close(unpermute(x_SD, state, x.dtype), x)
    # Dropped assignments are left out, and their tokens lose their share.
    keep = torch.ones(T, K, dtype=torch.bool)
    keep[0, 0] = keep[3, 2] = False
    x_SD, counts, state = permute(x, idx, w, E, keep)
    assert x_SD.shape[0] == T * K - 2 and counts.sum() == T * K - 2
    torch.testing.assert_close(unpermute(x_SD, state, x.dtype), x * (w * keep).sum(1, keepdim=True))


def test_capacity_keep_mask_both_policies():
    # T=4 tokens, K=2, E=2, factor 0.5: capacity = ceil(0.5 * 4 * 2 / 2) = 2 rows per expert.
    idx = torch.tensor([[0, 1], [0, 1], [0, 1], [1, 0]])
    w = torch.tensor([[0.1, 0.9], [0.8, 0.2], [0.7, 0.3], [0.6, 0.4]])
    # Expert 0 gets (t0,k0) w.1, (t1,k0) w.8, (t2,k0) w.7, (t3,k1) w.4; expert 1 gets (t0,k1) w.9, (t1,k1) w.2,
    # (t2,k1) w.3, (t3,k0) w.6.
    keep, cap = capacity_keep_mask(idx, w, 2, CapacityConfig(factor=0.5, policy="position"))
    assert cap == 2
    # "position": each expert keeps its earliest two assignments (tokens 0 and 1).
    assert keep.tolist() == [[True, True], [True, True], [False, False], [False, False]]
    keep, cap = capacity_keep_mask(idx, w, 2, CapacityConfig(factor=0.5, policy="probs"))
    # "probs": expert 0 keeps w .8 (t1) and .7 (t2); expert 1 keeps .9 (t0) and .6 (t3).
    assert keep.tolist() == [[False, True], [True, False], [True, False], [True, False]]
    assert capacity_keep_mask(idx, w, 2, CapacityConfig()) == (None, 0)
    keep, cap = capacity_keep_mask(idx, w, 2, CapacityConfig(factor=2.0))
    assert cap == 8 and keep.all()


# ---------------------------------------------------------------------------------------------------------------
# Grouped GEMM
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("counts", [[5, 0, 4, 3], [0, 12, 0, 0], [3, 3, 3, 3]])
def test_grouped_mm_equals_per_expert_loop(counts):
    S, Kd, N, E = sum(counts), 16, 12, len(counts)
    g = torch.Generator().manual_seed(1)
    x = torch.randn(S, Kd, generator=g)
    w = torch.randn(E, N, Kd, generator=g)  # stored (E, N, K) layout
    c = torch.tensor(counts)
    dy = torch.randn(S, N, generator=g)
    results = []
    for use in (True, False):
        xi, wi = x.clone().requires_grad_(), w.clone().requires_grad_()
        y = grouped_mm(xi, wi, c, use_grouped_mm=use)
        (y * dy).sum().backward()
        results.append((y.detach(), xi.grad, wi.grad))
    # Reference: explicit per-expert products.
    ref = torch.cat([xe @ w[e].t() for e, xe in enumerate(torch.split(x, counts))])
    for y, gx, gw in results:
        torch.testing.assert_close(y, ref, rtol=1e-5, atol=1e-5)
    (y0, gx0, gw0), (y1, gx1, gw1) = results
    torch.testing.assert_close(y0, y1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gx0, gx1, rtol=1e-5, atol=1e-5)
    torch.testing.assert_close(gw0, gw1, rtol=1e-5, atol=1e-5)
    for e, n in enumerate(counts):
        if n == 0:  # an expert without rows gets an exactly zero gradient on both paths
            assert torch.equal(gw0[e], torch.zeros(N, Kd)) and torch.equal(gw1[e], torch.zeros(N, Kd))


def test_grouped_experts_module_paths_agree():
    cfg = moe_cfg()
    torch.manual_seed(0)
    moe = MoE(cfg)
    with torch.no_grad():
        for p in moe.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, 6, cfg.dim)
    y_g, _ = moe(x)
    moe.experts.use_grouped_mm = False
    y_l, _ = moe(x)
    torch.testing.assert_close(y_g, y_l, rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("counts", [[4, 4, 4, 4], [5, 4, 4, 4], [5, 5, 5, 5, 5, 5, 5, 0]])
def test_padded_batched_experts_equal_per_expert_loop(counts):
    """The CPU batched path (equal slots + torch.bmm) computes what the exact loop computes, gradients included."""
    E, D, Fh = len(counts), 16, 8
    torch.manual_seed(0)
    experts = GroupedExperts(E, D, Fh)
    with torch.no_grad():
        for p in experts.parameters():
            p.normal_(0, 0.3)
    c = torch.tensor(counts)
    S = sum(counts)
    assert padded_slots(counts, S) is not None  # the path under test is taken
    x, dy = torch.randn(S, D), torch.randn(S, D)
    results = []
    for use in (True, False):
        experts.use_grouped_mm = use
        for p in experts.parameters():
            p.grad = None
        xi = x.clone().requires_grad_()
        y = experts(xi, c)
        (y * dy).sum().backward()
        results.append([y.detach(), xi.grad] + [p.grad.clone() for p in experts.parameters()])
    for a, b in zip(*results):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


def test_padded_slots_layout_and_refusals():
    C, slot = padded_slots([2, 1, 2], 5, max_pad=0.5)
    assert C == 2 and slot.tolist() == [0, 1, 2, 4, 5]  # expert 1's second slot (3) is padding
    assert padded_slots([3, 3], 6) == (3, None)  # equal groups: a view, no copy
    assert padded_slots([8, 1, 1, 1], 11) is None  # 32 slots for 11 rows: too much padding
    assert padded_slots([2, 2], 5) is None  # a trailing capacity-padding row: not this layout
    assert padded_slots([0, 0], 0) is None


def test_grouped_mm_unaligned_dims_fall_back(monkeypatch):
    # expert_ffn_dim 6 in fp32: the down projection's 24-byte rows are refused by torch._grouped_mm (16-byte
    # strides). That GEMM must take the exact per-expert loop (the gate/up GEMM, K = 16 and N = 12, stays on the
    # kernel), and the experts give the hand-written SwiGLU of each row's expert.
    torch.manual_seed(0)
    E, D, F_ = 4, 16, 6
    experts = GroupedExperts(E, D, F_)
    torch.nn.init.normal_(experts.w13_E2FD, std=0.3)
    torch.nn.init.normal_(experts.w2_EDF, std=0.3)
    counts = [3, 0, 5, 1]  # unequal groups: the CPU batched-slot path (padded_slots) does not apply either
    x = torch.randn(sum(counts), D)
    kernel_calls = []
    real = torch._grouped_mm
    monkeypatch.setattr(torch, "_grouped_mm", lambda *a, **k: kernel_calls.append(a) or real(*a, **k))
    y = experts(x, torch.tensor(counts))
    assert [tuple(a[0].shape) for a in kernel_calls] == [(9, D)]  # the gate/up GEMM only
    assert all(a[0].shape[-1] * a[0].element_size() % 16 == 0 for a in kernel_calls)
    ref, row = [], 0
    for e, n in enumerate(counts):
        xe = x[row:row + n]
        h1, h3 = xe @ experts.w1_EFD[e].t(), xe @ experts.w3_EFD[e].t()
        ref.append((h1 * torch.sigmoid(h1) * h3) @ experts.w2_EDF[e].t())
        row += n
    torch.testing.assert_close(y, torch.cat(ref), rtol=1e-5, atol=1e-6)
    # and the aligned shape does use the kernel, so the spy above can see a call when one happens
    aligned = GroupedExperts(E, D, 8)
    torch.nn.init.normal_(aligned.w13_E2FD, std=0.3)
    torch.nn.init.normal_(aligned.w2_EDF, std=0.3)
    aligned(x, torch.tensor(counts))
    assert len(kernel_calls) == 3
    cfg = moe_cfg(expert_ffn_dim=6)  # and the whole model runs with such experts
    tok = torch.randint(0, cfg.vocab_size, (2, 8))
    assert torch.isfinite(build_model(cfg)(tok, tok).lm_loss_sum)


def test_grouped_mm_loop_padding_rows_are_zero():
    x, w = torch.randn(14, 16), torch.randn(4, 12, 16)
    y = grouped_mm(x, w, torch.tensor([5, 0, 4, 3]), use_grouped_mm=False)
    assert torch.equal(y[12:], torch.zeros(2, 12))


def test_grouped_mm_kernel_padding_rows_are_zero():
    torch.manual_seed(0)
    ok = True
    for _ in range(5):
        x, w = torch.randn(16, 16), torch.randn(4, 12, 16)
        y = grouped_mm(x, w, torch.tensor([5, 0, 4, 3]), use_grouped_mm=True)
        ok &= torch.equal(y[12:], torch.zeros(4, 12))
    assert ok


# ---------------------------------------------------------------------------------------------------------------
# Config validation
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("changes, field", [
    (dict(top_k=9), "top_k"),
    (dict(n_expert_groups=2, n_limited_groups=3), "n_limited_groups"),
    (dict(n_expert_groups=3), "n_expert_groups"),
    (dict(score_func="relu"), "score_func"),
    (dict(qk_rope_head_dim=5), "qk_rope_head_dim"),
])
def test_bad_config_names_the_field(changes, field):
    with pytest.raises(ConfigError, match=field):
        moe_cfg(**changes)


def test_unknown_field_in_from_dict():
    with pytest.raises(ConfigError, match="n_experts") as ei:
        ModelConfig.from_dict({**moe_cfg().to_dict(), "n_experts": 4})
    assert "unknown field" in str(ei.value)
    assert ModelConfig.from_dict(moe_cfg().to_dict()) == moe_cfg()


# ---------------------------------------------------------------------------------------------------------------
# RoPE / YaRN
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name, mscale, mscale_all_dim", [
    ("deepseek-v3-671b", 1.0, 1.0), ("deepseek-v2-lite-16b", 0.707, 0.707), ("deepseek-v3-671b", 1.0, 0.8)])
def test_yarn_matches_transformers(name, mscale, mscale_all_dim):
    tr = pytest.importorskip("transformers")
    from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS

    cfg = get_preset(name).replace(rope_mscale=mscale, rope_mscale_all_dim=mscale_all_dim)
    hf_cfg = tr.DeepseekV3Config(
        qk_rope_head_dim=cfg.qk_rope_head_dim, max_position_embeddings=cfg.max_seq_len,
        rope_parameters={"rope_type": "yarn", "rope_theta": cfg.rope_theta, "factor": cfg.rope_factor,
                         "original_max_position_embeddings": cfg.rope_original_seq_len,
                         "beta_fast": cfg.rope_beta_fast, "beta_slow": cfg.rope_beta_slow,
                         "mscale": mscale, "mscale_all_dim": mscale_all_dim})
    inv_hf, attention_factor = ROPE_INIT_FUNCTIONS["yarn"](hf_cfg, "cpu")
    inv = rope_inv_freq(cfg)
    assert inv.shape == (cfg.qk_rope_head_dim // 2,)
    torch.testing.assert_close(inv, inv_hf.float(), rtol=1e-6, atol=0)
    assert not torch.allclose(inv, 1.0 / cfg.rope_theta ** (torch.arange(0, 64, 2) / 64))  # YaRN did something
    cos, sin = rope_cos_sin(cfg, 3)
    assert cos[0, 0].item() == pytest.approx(attention_factor, rel=1e-6)  # cos(0) * attention factor
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import yarn_apply_mscale
    assert cfg.softmax_scale == pytest.approx(yarn_apply_mscale(hf_cfg.rope_parameters, cfg.qk_head_dim ** -0.5),
                                              rel=1e-12)


def test_v3_softmax_scale():
    cfg = get_preset("deepseek-v3-671b")
    assert round(cfg.softmax_scale, 5) == 0.13523
    assert cfg.softmax_scale == pytest.approx(192 ** -0.5 * (0.1 * math.log(40) + 1) ** 2, rel=1e-12)
    assert cfg.replace(rope_factor=1.0).softmax_scale == pytest.approx(192 ** -0.5)


# ---------------------------------------------------------------------------------------------------------------
# Accounting
# ---------------------------------------------------------------------------------------------------------------

@pytest.mark.parametrize("name", sorted(PRESETS))
def test_meta_model_parameter_count_matches_accounting(name):
    cfg = get_preset(name)
    model = build_model(cfg, "meta")
    n = sum(p.numel() for p in model.parameters())
    assert n == count_params(cfg).total_with_mtp
    tied = build_model(cfg.replace(tie_embeddings=True), "meta")
    assert sum(p.numel() for p in tied.parameters()) == count_params(cfg.replace(tie_embeddings=True)).total_with_mtp


def test_accounting_reference_numbers():
    v3 = count_params(get_preset("deepseek-v3-671b"))
    assert v3.total == pytest.approx(671.03e9, rel=5e-4)
    assert v3.active == pytest.approx(37.55e9, rel=5e-4)
    assert v3.active_nonembedding == pytest.approx(36.63e9, rel=5e-4)
    assert v3.mtp == pytest.approx(11.61e9, rel=1e-3)
    assert v3.attention_per_layer == pytest.approx(187.11e6, rel=1e-4)
    assert v3.expert == pytest.approx(44.04e6, rel=1e-4)
    assert v3.moe_layer_total == pytest.approx(11.32e9, rel=1e-3)
    fl = flops_per_token(get_preset("deepseek-v3-671b"), 4096)
    assert fl.megatron == pytest.approx(260.0e9, rel=2e-3)
    v2 = count_params(get_preset("deepseek-v2-lite-16b"))
    assert v2.total == pytest.approx(15.71e9, rel=5e-4)
    assert v2.active_nonembedding == pytest.approx(2.45e9, rel=5e-3)


@pytest.mark.parametrize("counts", [[6, 6, 6, 6], [9, 1, 7, 3]], ids=["equal-loads-batched", "unequal-grouped"])
def test_experts_train_under_cpu_bf16_autocast(counts):
    """CPU bf16 autocast: the batched path (equal loads, as forced-balanced routing gives) and the grouped path run
    forward and backward, and agree with fp32 to bf16 precision. The batched GEMM used to run in bf16 under autocast
    in forward and in fp32 without it in backward ("expected scalar type Float but found BFloat16")."""
    from moetrain.model.experts import GroupedExperts

    torch.manual_seed(0)
    ex = GroupedExperts(4, 16, 8)
    for p in ex.parameters():
        torch.nn.init.normal_(p, 0, 0.2)
    x = torch.randn(sum(counts), 16)
    tpe = torch.tensor(counts)
    ref_x = x.clone().requires_grad_(True)
    ex(ref_x, tpe).square().sum().backward()
    ref = [p.grad.clone() for p in ex.parameters()] + [ref_x.grad]
    ex.zero_grad()
    xb = x.clone().requires_grad_(True)
    with torch.autocast("cpu", dtype=torch.bfloat16):
        y = ex(xb, tpe)
    assert y.dtype == torch.bfloat16
    y.float().square().sum().backward()
    got = [p.grad for p in ex.parameters()] + [xb.grad]
    for g, r in zip(got, ref):
        assert g.dtype == torch.float32
        torch.testing.assert_close(g, r, rtol=0.05, atol=0.05 * r.abs().max().item())


def test_padding_positions_do_not_count_in_loads_or_balance_loss():
    """Positions labelled IGNORE_INDEX are computed but not counted: the expert loads (which steer the bias update)
    and the sequence-wise balance loss of a padded sequence equal those of the same sequence without its padding
    (causal attention keeps the padding from changing the real tokens' routing)."""
    from moetrain.model import IGNORE_INDEX

    cfg = get_preset("tiny").replace(vocab_size=256, balance_loss_alpha=1e-2)
    model = build_model(cfg, seed=0).eval()
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, 256, (1, 12), generator=g)
    labels = torch.randint(0, 256, (1, 12), generator=g)
    padded = labels.clone()
    padded[:, 7:] = IGNORE_INDEX
    with torch.no_grad():
        full = model(tokens, padded)
        cut = model(tokens[:, :7], labels[:, :7])
    for a, b in zip(full.moe_stats, cut.moe_stats):
        assert torch.equal(a.tokens_per_expert_E, b.tokens_per_expert_E)
        torch.testing.assert_close(a.balance_loss_sum, b.balance_loss_sum, rtol=1e-5, atol=1e-7)
    n_main = sum(isinstance(b.mlp, MoE) for b in model.layers)
    assert all(int(s.tokens_per_expert_E.sum()) == 7 * cfg.top_k for s in full.moe_stats[:n_main])
