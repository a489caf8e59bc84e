"""The whole model as one pipeline stage (what the trainer runs at PP = 1) computes exactly what the single-device
``Transformer`` computes: the same loss sums, the same gradient of every parameter, bit for bit, and the same MoE
statistics -- both forwards are built from the same pieces (RoPE cache, padding mask, layer loop, MTP loop)."""

from __future__ import annotations

import pytest
import torch

from moetrain.model.config import tiny
from moetrain.model.stage import AttachLoss
from moetrain.model.transformer import IGNORE_INDEX, build_model
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.pipeline import build_stages


def _batch(cfg, B: int = 3, L: int = 24):
    g = torch.Generator().manual_seed(5)
    data = torch.randint(0, cfg.vocab_size, (B, L + 1), generator=g)
    x, y = data[:, :-1].clone(), data[:, 1:].clone()
    y[0, -5:] = IGNORE_INDEX  # padding: computed, not counted
    return x, y


@pytest.mark.parametrize("mtp_depth", [0, 1, 2])
def test_whole_model_stage_equals_the_transformer_bit_for_bit(mtp_depth):
    torch.set_num_threads(1)
    cfg = tiny().replace(vocab_size=256, balance_loss_alpha=1e-2, mtp_depth=mtp_depth, max_seq_len=64)
    x, y = _batch(cfg)
    scale = cfg.balance_loss_alpha / x.shape[0]

    ref = build_model(cfg, seed=0)
    out = ref(x, y)
    sums_ref = torch.stack([out.lm_loss_sum, *out.mtp_loss_sums])
    # the balance terms enter the objective with weight alpha / N_sequences, as the trainer weights them
    AttachLoss.apply(sums_ref, out.balance_loss_sum * scale).sum().backward()
    grads_ref = {n: p.grad.clone() for n, p in ref.named_parameters()}

    stage = build_stages(build_model(cfg, seed=0), ParallelConfig(), 0)[0]
    stage.start_step(scale)
    sums = stage(tokens_BL=x, labels_BL=y)
    sums.sum().backward()

    assert torch.equal(sums.detach(), sums_ref.detach())
    grads = {n: p.grad for n, p in stage.named_parameters()}
    assert grads.keys() == grads_ref.keys()
    for name, g in grads_ref.items():
        assert torch.equal(grads[name], g), name
    loads = [s.tokens_per_expert_E for s in out.moe_stats]
    assert sorted(stage.stats.loads) == list(range(len(loads)))
    assert all(torch.equal(stage.stats.loads[m], c) for m, c in enumerate(loads))
    balance = out.moe_stats[0].balance_loss_sum.detach().double()
    for st in out.moe_stats[1:]:
        balance = balance + st.balance_loss_sum.detach().double()
    assert torch.equal(stage.stats.balance_sum, balance)


def test_a_sequence_longer_than_max_seq_len_is_refused_by_both():
    cfg = tiny().replace(vocab_size=64, max_seq_len=8)
    x = torch.zeros(1, 9, dtype=torch.long)
    model = build_model(cfg, seed=0)
    stage = build_stages(model, ParallelConfig(), 0)[0]
    with pytest.raises(ValueError, match="exceeds max_seq_len=8"):
        model(x, x)
    with pytest.raises(ValueError, match="exceeds max_seq_len=8"):
        stage(tokens_BL=x, labels_BL=x)
