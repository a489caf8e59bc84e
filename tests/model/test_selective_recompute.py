"""Selective recompute (``parallel.recompute_modules``, Megatron's ``--recompute-modules``): every module alone and
all together give the loss and every gradient bit for bit as keeping the activations (fp32, one process; the
distributed layouts in tests/parallel/test_selective_recompute_layouts.py), and each drops what it names from the
tensors kept for the backward."""

from __future__ import annotations

import pytest
import torch

from moetrain.layout import RecomputeModule as RM
from moetrain.model.config import get_preset
from moetrain.model.recompute import DroppedOutputs, set_recompute
from moetrain.model.transformer import build_model

ALL = frozenset(RM)


def _config(family: str):
    cfg = get_preset("tiny" if family == "deepseek" else "qwen3-tiny")
    return cfg.replace(vocab_size=128, max_seq_len=32, mtp_depth=1 if family == "deepseek" else 0,
                       balance_loss_alpha=1e-2)


def _loss_and_grads(cfg, modules: frozenset, seed: int = 0):
    model = build_model(cfg, seed=0)
    for block in model.blocks():
        set_recompute(block, modules)
    g = torch.Generator().manual_seed(seed)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=g)
    out = model(tokens[:, :-1], tokens[:, 1:])
    loss = out.loss(cfg)
    loss.backward()
    return loss.detach(), {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}


@pytest.mark.parametrize("family", ["deepseek", "qwen3"])
@pytest.mark.parametrize("modules", [frozenset({m}) for m in RM] + [ALL, ALL - {RM.MOE}],
                         ids=lambda s: "+".join(sorted(s)) if len(s) < len(ALL) - 1 else
                         ("all" if len(s) == len(ALL) else "all-but-moe"))
def test_recompute_is_bit_identical(family, modules):
    cfg = _config(family)
    ref_loss, ref_grads = _loss_and_grads(cfg, frozenset())
    loss, grads = _loss_and_grads(cfg, modules)
    assert torch.equal(loss, ref_loss)
    assert grads.keys() == ref_grads.keys()
    for n in ref_grads:
        assert torch.equal(grads[n], ref_grads[n]), n


def _backward_calls(cfg, modules: frozenset, monkeypatch) -> dict[str, int]:
    """How many times each recomputable piece runs during the backward (0 = kept, > 0 = recomputed). Counted by
    patching the classes' forwards (torch's checkpoint recomputes without running module hooks)."""
    from moetrain.model import experts as experts_mod
    from moetrain.model.deepseek.attention import MLA
    from moetrain.model.layers import RMSNorm, SwiGLU
    from moetrain.model.moe import MoE

    model = build_model(cfg, seed=0)
    for block in model.blocks():
        set_recompute(block, modules)
    counts = dict.fromkeys(["layernorm", "core_attn", "mla_up_proj", "mlp", "shared_experts", "moe", "moe_act"], 0)
    phase = {"backward": False}
    block_norms = {id(n) for b in model.blocks() for n in (b.input_layernorm, b.post_attention_layernorm)}
    dense = {id(b.mlp) for b in model.blocks() if isinstance(b.mlp, SwiGLU)}

    def counting(cls, name, key_of):
        orig = getattr(cls, name)

        def wrapped(self, *a, **k):
            key = key_of(self)
            if phase["backward"] and key:
                counts[key] += 1
            return orig(self, *a, **k)
        monkeypatch.setattr(cls, name, wrapped)

    counting(RMSNorm, "forward", lambda m: "layernorm" if id(m) in block_norms else None)
    counting(SwiGLU, "forward", lambda m: "mlp" if id(m) in dense else "shared_experts")
    counting(MoE, "forward", lambda m: "moe")
    attn_cls = type(model.blocks()[0].self_attn)
    counting(attn_cls, "_sdpa", lambda m: "core_attn")
    if attn_cls is MLA:
        counting(MLA, "_up_proj", lambda m: "mla_up_proj")
    swiglu = experts_mod._swiglu
    monkeypatch.setattr(experts_mod, "_swiglu", lambda h: (phase["backward"] and counts.__setitem__(
        "moe_act", counts["moe_act"] + 1), swiglu(h))[1])
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=torch.Generator().manual_seed(0))
    loss = model(tokens[:, :-1], tokens[:, 1:]).loss(cfg)
    phase["backward"] = True
    loss.backward()
    return counts


@pytest.mark.parametrize("module", [m for m in RM if m != RM.MOE])
def test_each_module_is_recomputed_in_the_backward_and_only_it(module, monkeypatch):
    cfg = _config("deepseek")
    assert cfg.n_dense_layers >= 1
    counts = _backward_calls(cfg, frozenset({module}), monkeypatch)
    assert counts[module.value] > 0
    assert all(n == 0 for k, n in counts.items() if k != module.value), counts


def test_nothing_is_recomputed_without_recompute(monkeypatch):
    assert not any(_backward_calls(_config("deepseek"), frozenset(), monkeypatch).values())


def test_moe_recompute_reruns_the_whole_moe_layer(monkeypatch):
    counts = _backward_calls(_config("deepseek"), frozenset({RM.MOE}), monkeypatch)
    assert counts["moe"] > 0 and counts["moe_act"] > 0 and counts["shared_experts"] > 0
    assert counts["layernorm"] == counts["core_attn"] == counts["mla_up_proj"] == 0


def test_dropped_outputs_recompute_once_and_rebuild_views():
    calls = []
    x = torch.randn(4, 6, requires_grad=True)
    w = torch.randn(6, 3, requires_grad=True)

    def produce():
        calls.append(1)
        return (torch.tanh(x),)

    with DroppedOutputs(lambda: produce()) as drop:
        h = drop.add(torch.tanh(x))
        y = (h.t().contiguous().t() @ w).sum() + (h[1:, 2:] ** 2).sum()  # views of h saved by two ops
    calls.clear()
    y.backward()
    assert len(calls) == 1  # one recomputation for every saved view
    x2, w2 = x.detach().clone().requires_grad_(), w.detach().clone().requires_grad_()
    h2 = torch.tanh(x2)
    ((h2 @ w2).sum() + (h2[1:, 2:] ** 2).sum()).backward()
    assert torch.equal(x.grad, x2.grad) and torch.equal(w.grad, w2.grad)
