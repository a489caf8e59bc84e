"""Decoding with the MLA latent cache (moetrain.model.generate, MLA.forward_cached): the cached logits equal the
training forward's at every position, greedy decoding is deterministic and equals re-running the whole sequence,
sampling is seeded, and top-p keeps the nucleus it should (hand-computed)."""

from __future__ import annotations

import dataclasses
import math

import pytest
import torch

from moetrain.model.deepseek.attention import MLACache
from moetrain.model.config import get_preset
from moetrain.model.generate import forward_cached, generate, new_kv_cache, next_token, top_p_filter
from moetrain.model.transformer import build_model


def _model(**changes):
    cfg = dataclasses.replace(get_preset("tiny"), vocab_size=256, **changes)
    return build_model(cfg, seed=3).eval()


def _full_logits(model, tokens_BL):
    with torch.no_grad():
        return model(tokens_BL, return_logits=True).logits_BLV.float()


VARIANTS = {"tiny": {}, "q_proj-rotate_half-no_yarn": {"q_lora_rank": 0, "rope_interleave": False, "rope_factor": 1.0},
            "v_dim!=qk_nope": {"n_heads": 2, "v_head_dim": 48}}


@pytest.mark.parametrize("variant,chunks", [("tiny", (1,) * 16), ("tiny", (7, 1, 3, 5)),
                                            ("q_proj-rotate_half-no_yarn", (6, 1, 1, 8)),
                                            ("v_dim!=qk_nope", (5, 1, 10))],
                         ids=["tiny-token_by_token", "tiny-prefill_then_chunks", "q_proj-rotate_half-no_yarn",
                              "v_dim!=qk_nope"])
def test_cached_logits_equal_the_full_forward_at_every_position(variant, chunks):
    torch.manual_seed(0)
    model = _model(**VARIANTS[variant])
    tokens = torch.randint(0, 256, (2, 16))
    ref = _full_logits(model, tokens)
    cache = new_kv_cache(model, 2, 20)
    got, at = [], 0
    for n in chunks:
        got.append(forward_cached(model, tokens[:, at:at + n], cache))
        at += n
    assert cache.length == 16
    got = torch.cat(got, dim=1)
    assert got.shape == ref.shape
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    # the logits are not trivially equal: positions differ from each other
    assert (ref[:, 1:] - ref[:, :-1]).abs().max() > 1e-2


def test_the_cache_holds_the_compressed_latent_and_the_rope_key_only():
    model = _model()
    cfg = model.cfg
    cache = new_kv_cache(model, 3, 40)
    assert len(cache.layers) == cfg.n_layers
    layer = cache.layers[0]
    assert isinstance(layer, MLACache)
    assert layer.kv_BTC.shape == (3, 40, cfg.kv_lora_rank)
    assert layer.k_rope_BTR.shape == (3, 40, cfg.qk_rope_head_dim)
    forward_cached(model, torch.zeros(3, 5, dtype=torch.long), cache)
    # the written latent is kv_a_layernorm of the latent half of kv_a_proj_with_mqa
    attn = model.layers[0].self_attn
    x = model.layers[0].input_layernorm(model.embed_tokens(torch.zeros(3, 5, dtype=torch.long)))
    want = attn.kv_a_layernorm(attn.kv_a_proj_with_mqa(x)[..., : cfg.kv_lora_rank])
    torch.testing.assert_close(layer.kv_BTC[:, :5], want.detach())
    assert layer.kv_BTC[:, 5:].abs().max() == 0


def test_cache_too_small_and_beyond_max_seq_len_are_refused():
    model = _model(max_seq_len=16)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        new_kv_cache(model, 1, 17)
    cache = new_kv_cache(model, 1, 4)
    with pytest.raises(ValueError, match="holds 4 tokens"):
        forward_cached(model, torch.zeros(1, 5, dtype=torch.long), cache)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        generate(model, [1, 2, 3], 14)


def test_greedy_is_deterministic_and_equals_rerunning_the_whole_sequence():
    model = _model()
    prompt = [5, 17, 42, 7]
    out = generate(model, prompt, 8)
    assert out == generate(model, prompt, 8)
    seq = list(prompt)
    for _ in range(8):  # no cache: the whole sequence each time, argmax of the last position
        seq.append(int(_full_logits(model, torch.tensor([seq]))[0, -1].argmax()))
    assert out == seq[len(prompt):]


def test_generation_stops_at_the_end_of_document_token():
    model = _model()
    out = generate(model, [5, 17], 10)
    eos = out[3]
    stopped = generate(model, [5, 17], 10, eos_id=eos)
    assert stopped == out[: out.index(eos) + 1]


def test_sampling_is_seeded():
    model = _model()
    a = generate(model, [5, 17], 10, temperature=1.5, top_p=0.95, seed=1)
    assert a == generate(model, [5, 17], 10, temperature=1.5, top_p=0.95, seed=1)
    assert a != generate(model, [5, 17], 10, temperature=1.5, top_p=0.95, seed=2)
    assert a != generate(model, [5, 17], 10)  # not greedy


def test_top_p_keeps_the_smallest_set_reaching_p_hand_computed():
    probs = torch.tensor([0.15, 0.5, 0.05, 0.3])  # sorted: 0.5 (id 1), 0.3 (id 3), 0.15 (id 0), 0.05 (id 2)
    logits = probs.log()[None]
    kept = lambda p: set(torch.isfinite(top_p_filter(logits, p))[0].nonzero().flatten().tolist())  # noqa: E731
    assert kept(0.4) == {1}             # 0.5 >= 0.4 already
    assert kept(0.7) == {1, 3}          # 0.5 < 0.7 <= 0.8
    assert kept(0.9) == {1, 3, 0}       # 0.8 < 0.9 <= 0.95
    assert kept(0.97) == {0, 1, 2, 3}
    assert kept(1.0) == {0, 1, 2, 3}
    # the kept logits are unchanged; renormalised they give 0.5/0.8 and 0.3/0.8
    filtered = top_p_filter(logits, 0.7)
    assert torch.equal(filtered[0, [1, 3]], logits[0, [1, 3]])
    torch.testing.assert_close(filtered.softmax(-1)[0, [1, 3]], torch.tensor([0.625, 0.375]))
    with pytest.raises(ValueError, match="top_p"):
        top_p_filter(logits, 0.0)


def test_next_token_draws_only_from_the_nucleus_at_the_right_rates():
    probs = torch.tensor([[0.15, 0.5, 0.05, 0.3]])
    gen = torch.Generator().manual_seed(0)
    draws = torch.stack([next_token(probs.log(), 1.0, 0.7, gen) for _ in range(2000)]).flatten()
    assert set(draws.tolist()) == {1, 3}
    assert math.isclose(float((draws == 1).float().mean()), 0.625, abs_tol=0.035)
    assert int(next_token(probs.log(), 0.0, 0.7)) == 1  # temperature 0: argmax
    with pytest.raises(ValueError, match="temperature"):
        next_token(probs.log(), -1.0, 1.0)


@pytest.mark.parametrize("chunks", [(1,) * 16, (7, 1, 3, 5)], ids=["token_by_token", "prefill_then_chunks"])
def test_qwen3_gqa_cached_logits_equal_the_full_forward(chunks):
    """Qwen3-MoE's grouped-query attention decodes with its own key/value cache behind the same two methods."""
    from moetrain.model.qwen3.attention import GQACache

    torch.manual_seed(0)
    model = build_model(dataclasses.replace(get_preset("qwen3-tiny"), vocab_size=256), seed=3).eval()
    tokens = torch.randint(0, 256, (2, 16))
    ref = _full_logits(model, tokens)
    cache = new_kv_cache(model, 2, 20)
    assert isinstance(cache.layers[0], GQACache)
    assert cache.layers[0].k_BTGd.shape == (2, 20, model.cfg.n_kv_heads, model.cfg.head_dim)
    got, at = [], 0
    for n in chunks:
        got.append(forward_cached(model, tokens[:, at:at + n], cache))
        at += n
    got = torch.cat(got, dim=1)
    torch.testing.assert_close(got, ref, rtol=1e-5, atol=1e-5)
    assert (ref[:, 1:] - ref[:, :-1]).abs().max() > 1e-2
