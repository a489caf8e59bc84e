"""Checkpoints of earlier layouts resume into today's model (weights, moments and step counts equal what was saved):
one entry per expert (``...experts.w13_E2FD.<e>``, before experts were saved as EP-sharded DTensors), and, older
still, separate gate and up halves (``...experts.w1_EFD.<e>`` and ``...experts.w3_EFD.<e>``)."""

from __future__ import annotations

import json

import pytest
import torch
import torch.distributed.checkpoint as dcp

from moetrain.model import build_model, get_preset
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.mesh import init_parallel
from moetrain.parallel.pipeline import build_stages
from moetrain.train.checkpoint import _flat_state, load_checkpoint
from moetrain.train.optim import build_optimizer
from moetrain.train.runners import single_stage_parts
from moetrain.train.step import train_step


def _legacy(flat: dict, split_halves: bool) -> dict:
    """The flat state as an earlier layout saved it: each expert tensor of dim > 0 as one entry per expert, and, with
    ``split_halves``, every stacked w13 entry as its w1 and w3 halves."""
    out = {}
    for key, t in flat.items():
        if ".experts.w" in key and t.dim() > 0:
            for e in range(t.shape[0]):
                out[f"{key}.{e}"] = t[e].clone()
        else:
            out[key] = t
    if not split_halves:
        return out
    halves = {}
    for key, t in out.items():
        if ".w13_E2FD" not in key:
            halves[key] = t
            continue
        k1, k3 = key.replace(".w13_E2FD", ".w1_EFD"), key.replace(".w13_E2FD", ".w3_EFD")
        if t.dim() == 0:
            halves[k1], halves[k3] = t.clone(), t.clone()
        else:
            half = t.shape[0] // 2
            halves[k1], halves[k3] = t[:half].clone(), t[half:].clone()
    return halves


@pytest.mark.parametrize("split_halves", [False, True], ids=["per-expert", "w1-w3-halves"])
def test_legacy_expert_keys_load_into_stacked_parameter(tmp_path, split_halves):
    cfg = get_preset("tiny")
    ctx = init_parallel(ParallelConfig(), cfg.n_routed_experts, device="cpu")
    src = build_model(cfg, seed=0)
    opt = build_optimizer(src, lr=1e-3)
    g = torch.Generator().manual_seed(0)
    tokens = torch.randint(0, cfg.vocab_size, (2, 17), generator=g)
    train_step(single_stage_parts(build_stages(src, ctx.pcfg, 0)[0], ctx), opt, [(tokens[:, :-1], tokens[:, 1:])],
               cfg, ctx)
    flat = _flat_state(src, opt)[0]
    legacy = _legacy(flat, split_halves)
    assert any(".w1_EFD." in k for k in legacy) == split_halves
    assert not any(k.endswith(".w13_E2FD") or k.endswith(".w2_EDF.exp_avg") for k in legacy)
    ckpt = tmp_path / "step_00000001"
    dcp.save(legacy, checkpoint_id=str(ckpt))
    (ckpt / "trainer_state.json").write_text(json.dumps({"step": 1, "rng": torch.get_rng_state().tolist()}))
    (ckpt / "COMPLETE").write_text("1\n")

    dst = build_model(cfg, seed=1)
    dst_opt = build_optimizer(dst, lr=1e-3)
    assert load_checkpoint(ckpt, dst, dst_opt, ctx)["step"] == 1
    for (name, a), b in zip(src.named_parameters(), dst.parameters()):
        assert torch.equal(a, b), name
    src_state = {n: opt.state[p] for n, p in src.named_parameters()}
    for name, p in dst.named_parameters():
        for key, val in src_state[name].items():
            assert torch.equal(torch.as_tensor(val), torch.as_tensor(dst_opt.state[p][key])), (name, key)
    experts = dst.moe_layers()[0].experts
    assert torch.equal(experts.w3_EFD, src.moe_layers()[0].experts.w3_EFD)  # up rows landed in [F, 2F)
