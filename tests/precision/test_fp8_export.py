"""``export_run(..., fp8=True)``: the released block-scaled layout (float8_e4m3fn + weight_scale_inv per 128x128
block, quantization_config), read back exactly by the FP8 loader."""

from __future__ import annotations

import json

import pytest

import torch
from safetensors import safe_open

from moetrain.train.export import export_run
from moetrain.model.deepseek.adapter import is_fp8_weight
from moetrain.interop.hf import FP8_QUANTIZATION_CONFIG, iter_hf_state, load_hf_checkpoint
from moetrain.model import build_model, get_preset
from moetrain.parallel.config import ParallelConfig
from moetrain.parallel.mesh import init_parallel
from moetrain.precision.quant import fake_quantise
from moetrain.train.checkpoint import save_checkpoint
from moetrain.train.optim import build_optimizer


def test_fp8_export_round_trips_through_the_loader(tmp_path):
    # dim 136 / q_lora 72: weights with edge blocks in both dims (136 = 128 + 8).
    cfg = get_preset("tiny").replace(vocab_size=256, dim=136, q_lora_rank=72, n_layers=2)
    ctx = init_parallel(ParallelConfig(), cfg.n_routed_experts, device="cpu")
    model = build_model(cfg, seed=0)
    with torch.no_grad():  # spread the magnitudes so blocks get distinct scales
        for p in model.parameters():
            p.mul_(torch.logspace(-1, 1, p.shape[-1]))
    save_checkpoint(tmp_path / "run", 1, model, build_optimizer(model, 1e-3), {"model_config": cfg.to_dict()}, ctx)
    out = export_run(tmp_path / "run", tmp_path / "hf8", fp8=True)
    hf_cfg = json.loads((out / "config.json").read_text())
    assert hf_cfg["quantization_config"] == FP8_QUANTIZATION_CONFIG and hf_cfg["dtype"] == "bfloat16"

    index = json.loads((out / "model.safetensors.index.json").read_text())["weight_map"]
    want = dict(iter_hf_state(model))
    n_fp8 = 0
    for name, fname in index.items():
        with safe_open(out / fname, "pt") as f:
            t = f.get_tensor(name)
        if name.endswith("_scale_inv"):
            continue
        if is_fp8_weight(name):
            n_fp8 += 1
            assert t.dtype == torch.float8_e4m3fn
            with safe_open(out / index[name + "_scale_inv"], "pt") as f:
                s = f.get_tensor(name + "_scale_inv")
            rows, cols = t.shape
            assert s.dtype == torch.float32 and s.shape == (-(-rows // 128), -(-cols // 128))
            assert torch.equal(s[0, 0], want[name][:128, :128].abs().max() / 448)
        else:
            assert t.dtype == (torch.float32 if name.endswith("e_score_correction_bias") else torch.bfloat16), name
    assert n_fp8 > 0 and "model.layers.1.mlp.experts.3.down_proj.weight" in index
    assert not is_fp8_weight("model.embed_tokens.weight") and not is_fp8_weight("model.layers.1.mlp.gate.weight")

    back = build_model(cfg, seed=1)
    load_hf_checkpoint(back, out)
    got = dict(iter_hf_state(back))
    for name, w in want.items():
        if is_fp8_weight(name):
            # Exact: the loader's W_fp8 * weight_scale_inv is the quantiser's own dequantisation.
            assert torch.equal(got[name], fake_quantise(w, (128, 128), "fp32")), name
        else:
            assert torch.equal(got[name], w.to(torch.bfloat16).to(w.dtype) if w.dtype == torch.float32
                               and not name.endswith("e_score_correction_bias") else w), name


def test_fp8_export_loads_in_hf_transformers(tmp_path):
    """HF ``transformers`` reads ``export --fp8`` as the released FP8 checkpoint: on a machine without a GPU it
    dequantises every block on load (its FineGrainedFP8 quantizer), giving exactly the weights moetrain's own
    loader gives, and the same logits as moetrain on them.

    Every FP8 weight dim here is a multiple of 128 or at most 128: transformers 5.24 takes a block to be
    rows // scale_rows, so an edge block of a dim such as 192 (128 + 64) is read as two blocks of 96 rows. The
    released DeepSeek-V3 layout (``weight_scale_inv`` of [ceil(out/128), ceil(in/128)], edge blocks zero-padded)
    is what moetrain writes and reads; only those edge dims would differ in transformers."""
    pytest.importorskip("accelerate")  # transformers' FP8 quantizer needs it (a dev dependency)
    transformers = pytest.importorskip("transformers")
    from moetrain.interop.hf import load_hf_config
    from moetrain.model import IGNORE_INDEX

    # q_b 384 x 64, kv_b 512 x 32, o_proj 128 x 256, dense FFN 384 x 128: no edge block over 128
    cfg = get_preset("tiny").replace(vocab_size=256, n_heads=8, n_layers=3)
    ctx = init_parallel(ParallelConfig(), cfg.n_routed_experts, device="cpu")
    model = build_model(cfg, seed=0)
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(torch.logspace(-1, 1, p.shape[-1]))
    save_checkpoint(tmp_path / "run", 1, model, build_optimizer(model, 1e-3), {"model_config": cfg.to_dict()}, ctx)
    out = export_run(tmp_path / "run", tmp_path / "hf8", fp8=True)

    hf = transformers.AutoModelForCausalLM.from_pretrained(out, dtype=torch.float32).eval()
    mine = build_model(load_hf_config(out), seed=1).eval()
    load_hf_checkpoint(mine, out, mtp_optional=True)
    ours = dict(iter_hf_state(mine))
    theirs = hf.state_dict()
    compared = 0
    for name, w in ours.items():
        if not is_fp8_weight(name) or name.startswith(f"model.layers.{cfg.n_layers}."):
            continue  # transformers builds no MTP layer
        if ".experts." in name:  # transformers v5 stacks the experts: gate_up_proj (E, 2F, D), down_proj (E, D, F)
            layer, rest = name.split(".mlp.experts.")
            e, proj = int(rest.split(".")[0]), rest.split(".")[1]
            stacked = theirs[f"{layer}.mlp.experts.{'down_proj' if proj == 'down_proj' else 'gate_up_proj'}"][e]
            F = cfg.expert_ffn_dim
            got = {"gate_proj": stacked[:F], "up_proj": stacked[F:], "down_proj": stacked}[proj]
        else:
            got = theirs[name]
        assert torch.equal(got, w), name
        compared += 1
    assert compared > 40

    tokens = torch.randint(0, cfg.vocab_size, (2, 32), generator=torch.Generator().manual_seed(3))
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[:, :-1] = tokens[:, 1:]
    with torch.no_grad():
        hf_logits = hf(tokens).logits
        our_logits = mine(tokens, labels, return_logits=True).logits_BLV
    assert hf_logits.abs().max() > 0.5
    torch.testing.assert_close(our_logits, hf_logits, atol=1e-4, rtol=0)
