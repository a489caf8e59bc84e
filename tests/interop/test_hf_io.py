"""Checkpoint I/O of moetrain.interop.hf without transformers: sharding and the index, streaming and expert-sliced
loading, FP8 block dequantisation, mismatch errors, MTP layers, atomic saves and config mapping."""

from __future__ import annotations

import dataclasses
import json
import math
import warnings
from pathlib import Path

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

import moetrain.interop.safetensors_io as st_io
from moetrain.interop.hf import (CheckpointError, config_from_hf, config_to_hf, dequantize_fp8_blockwise,
                                 hf_tensor_names, load_hf_checkpoint, load_hf_config, save_hf_checkpoint)
from moetrain.model.config import DeepSeekV3Config
from moetrain.model import IGNORE_INDEX, ConfigError, ModelConfig, build_model, get_preset
from moetrain.model.config import PRESET_FAMILY, PRESETS, ModelFamily

FP8 = getattr(torch, "float8_e4m3fn", None)


def micro(**changes) -> ModelConfig:
    """A small model with every feature: q_lora, 2 expert groups, a shared expert, a dense layer whose FFN dim (200)
    is not a multiple of 128, and one MTP module."""
    base = dict(vocab_size=256, dim=64, n_layers=3, n_dense_layers=1, dense_ffn_dim=200, expert_ffn_dim=32,
                n_routed_experts=8, n_shared_experts=1, top_k=2, n_expert_groups=2, n_limited_groups=1, n_heads=2,
                q_lora_rank=32, kv_lora_rank=16, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=16,
                rope_factor=4.0, rope_original_seq_len=16, max_seq_len=64, mtp_depth=1, init_std=0.05)
    base.update(changes)
    return DeepSeekV3Config(**base)


def _model(cfg: ModelConfig, seed: int = 0):
    m = build_model(cfg, seed=seed)
    with torch.no_grad():  # make biases and norms non-default so a wrong mapping shows
        g = torch.Generator().manual_seed(seed + 100)
        for moe in m.moe_layers():
            moe.gate.expert_bias.copy_(torch.randn(moe.gate.expert_bias.shape, generator=g) * 0.1)
        for n, p in m.named_parameters():
            if n.endswith("norm.weight"):
                p.add_(torch.randn(p.shape, generator=g) * 0.1)
    return m


def _assert_same_state(a, b):
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    for k in sa:
        assert torch.equal(sa[k], sb[k]), k


def _read_all(ckpt: Path) -> dict[str, torch.Tensor]:
    files = sorted(ckpt.glob("*.safetensors"))
    out = {}
    for fp in files:
        with safe_open(str(fp), "pt") as f:
            out.update({k: f.get_tensor(k) for k in f.keys()})
    return out


class SliceSpy:
    """A safetensors slice whose reads (indexing) are recorded; shape and dtype look-ups are not reads."""

    def __init__(self, sl, key, spy):
        self._sl, self._key, self._spy = sl, key, spy

    def get_shape(self):
        return self._sl.get_shape()

    def get_dtype(self):
        return self._sl.get_dtype()

    def __getitem__(self, idx):
        self._spy.reads.append(self._key)
        return self._sl[idx]


class SafeOpenSpy:
    """Wraps safe_open in the safetensors I/O module: records open files and every tensor read (whole or sliced)."""

    def __init__(self, monkeypatch):
        self.real = safe_open
        self.open_now = 0
        self.max_open = 0
        self.opened: list[str] = []
        self.reads: list[str] = []
        spy = self

        class Handle:
            def __init__(self, path, framework, device="cpu"):
                self._cm = spy.real(path, framework=framework, device=device)
                spy.opened.append(Path(path).name)

            def __enter__(self):
                spy.open_now += 1
                spy.max_open = max(spy.max_open, spy.open_now)
                self._f = self._cm.__enter__()
                return self

            def __exit__(self, *exc):
                spy.open_now -= 1
                return self._cm.__exit__(*exc)

            def keys(self):
                return self._f.keys()

            def get_slice(self, k):
                return SliceSpy(self._f.get_slice(k), k, spy)

            def get_tensor(self, k):
                spy.reads.append(k)
                return self._f.get_tensor(k)

        monkeypatch.setattr(st_io, "safe_open", Handle)


# ---------------------------------------------------------------------------------------------------------------
# Sharding, streaming, expert slices
# ---------------------------------------------------------------------------------------------------------------

def test_sharded_save_index_and_streaming_load(tmp_path, monkeypatch):
    cfg = micro()
    src = _model(cfg, seed=0)
    max_bytes = 60_000
    out = save_hf_checkpoint(src, tmp_path / "ckpt", max_shard_bytes=max_bytes)
    index = json.loads((out / "model.safetensors.index.json").read_text())
    shards = sorted(out.glob("model-*.safetensors"))
    assert len(shards) >= 5
    assert all(s.name.endswith(f"-of-{len(shards):05d}.safetensors") for s in shards)
    assert set(index["weight_map"].values()) == {s.name for s in shards}
    assert list(index["weight_map"]) == hf_tensor_names(src)  # every tensor once, in checkpoint order
    assert index["metadata"]["total_size"] == sum(t.numel() * t.element_size() for t in _read_all(out).values())
    for s in shards:  # a shard is over the limit only when it holds a single tensor bigger than the limit
        with safe_open(str(s), "pt") as f:
            keys = list(f.keys())
            size = sum(f.get_tensor(k).numel() * 4 for k in keys)
        assert size <= max_bytes or len(keys) == 1
    assert (out / "config.json").is_file() and load_hf_config(out) == cfg

    spy = SafeOpenSpy(monkeypatch)
    dst = build_model(cfg, seed=1)
    res = load_hf_checkpoint(dst, out)
    _assert_same_state(src, dst)
    # Streaming: one shard open at a time, each shard opened once, each tensor read once; the MTP copies of the
    # embedding and head are shape-checked without being read.
    assert spy.max_open == 1 and sorted(spy.opened) == [s.name for s in shards]
    assert len(spy.reads) == len(set(spy.reads)) == res.loaded
    assert "model.layers.3.embed_tokens.weight" not in spy.reads
    assert "model.layers.3.shared_head.head.weight" not in spy.reads
    assert res.missing == [] and res.unexpected == [] and res.skipped_nonlocal == 0


def test_expert_parallel_slice_reads_only_local_experts(tmp_path, monkeypatch):
    """A model holding experts [off, off+El) of each MoE layer (as an EP rank does: the shard box of the expert
    weights says where its part sits) copies exactly those, and never reads the other experts' tensors."""
    cfg = micro()
    src = _model(cfg)
    save_hf_checkpoint(src, tmp_path / "ckpt", max_shard_bytes=100_000)
    E, El, off = cfg.n_routed_experts, 2, 4
    dst = build_model(cfg, seed=3)
    expert_global = {}
    for moe in dst.moe_layers():
        ex = moe.experts
        for name, full in list(ex.named_parameters(recurse=False)):
            setattr(ex, name, torch.nn.Parameter(torch.zeros(El, *full.shape[1:])))
            expert_global[id(getattr(ex, name))] = (E, *full.shape[1:])

    def box(t, offset=off):
        if id(t) in expert_global:
            return expert_global[id(t)], (offset, 0, 0), t
        return tuple(t.shape), (0,) * t.dim(), t

    spy = SafeOpenSpy(monkeypatch)
    res = load_hf_checkpoint(dst, tmp_path / "ckpt", shard_box=box)
    n_moe = len(dst.moe_layers())
    assert res.skipped_nonlocal == n_moe * (E - El) * 3
    for a, b in zip(src.moe_layers(), dst.moe_layers()):
        for name in ("w1_EFD", "w2_EDF", "w3_EFD"):
            assert torch.equal(getattr(a.experts, name)[off:off + El], getattr(b.experts, name))
    local = {f"experts.{e}." for e in range(off, off + El)}
    expert_reads = [k for k in spy.reads if ".mlp.experts." in k]
    assert len(expert_reads) == n_moe * El * 3
    assert all(any(s in k for s in local) for k in expert_reads)
    # Non-expert tensors are complete.
    assert torch.equal(src.embed_tokens.weight, dst.embed_tokens.weight)
    # A slice that does not fit the config is an error, not a silent partial load.
    with pytest.raises(CheckpointError, match="offset"):
        load_hf_checkpoint(dst, tmp_path / "ckpt", shard_box=lambda t: box(t, E - 1))


def test_single_file_and_tied_embeddings(tmp_path):
    cfg = micro(tie_embeddings=True, mtp_depth=0)
    src = _model(cfg)
    out = save_hf_checkpoint(src, tmp_path / "tied")
    names = list(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    assert "lm_head.weight" not in names  # a tied head is not stored (as HF does)
    dst = build_model(cfg, seed=9)
    load_hf_checkpoint(dst, out)
    _assert_same_state(src, dst)
    assert dst.lm_head.weight is dst.embed_tokens.weight
    # A single .safetensors file can be given directly.
    single = tmp_path / "one.safetensors"
    save_file(_read_all(out), str(single))
    dst2 = build_model(cfg, seed=10)
    load_hf_checkpoint(dst2, single)
    _assert_same_state(src, dst2)


# ---------------------------------------------------------------------------------------------------------------
# FP8
# ---------------------------------------------------------------------------------------------------------------

def quantize_fp8_blockwise(w: torch.Tensor, block: int = 128) -> tuple[torch.Tensor, torch.Tensor]:
    """Reference quantiser: per block, scale = amax / 448 (e4m3 max), q = fp8(w / scale); scale_inv = scale."""
    R, C = w.shape
    scale = torch.empty(math.ceil(R / block), math.ceil(C / block))
    q = torch.empty(R, C, dtype=FP8)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            blk = w[i * block:(i + 1) * block, j * block:(j + 1) * block]
            s = blk.abs().max().clamp(min=1e-12) / 448.0
            scale[i, j] = s
            q[i * block:(i + 1) * block, j * block:(j + 1) * block] = (blk / s).to(FP8)
    return q, scale


def _expanded_scale(scale: torch.Tensor, shape, block: int = 128) -> torch.Tensor:
    out = torch.empty(shape)
    for i in range(scale.shape[0]):
        for j in range(scale.shape[1]):
            out[i * block:(i + 1) * block, j * block:(j + 1) * block] = scale[i, j]
    return out


@pytest.mark.skipif(FP8 is None, reason="no float8_e4m3fn in this torch")
@pytest.mark.parametrize("shape", [(300, 260), (128, 256), (64, 200)])
def test_fp8_dequantize_blockwise(shape):
    g = torch.Generator().manual_seed(0)
    w = torch.randn(shape, generator=g) * torch.logspace(-2, 1, shape[1])  # blocks with different ranges
    q, s = quantize_fp8_blockwise(w)
    assert s.shape == (math.ceil(shape[0] / 128), math.ceil(shape[1] / 128))
    deq = dequantize_fp8_blockwise(q, s)
    assert deq.dtype == torch.float32 and deq.shape == w.shape
    full_scale = _expanded_scale(s, shape)
    assert torch.equal(deq, q.float() * full_scale)  # exactly W_fp8 x its block's scale, edges cropped
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, plus the subnormal spacing 2^-9 of the block scale.
    assert ((deq - w).abs() <= w.abs() * 2 ** -4 + full_scale * 2 ** -9 + 1e-12).all()
    with pytest.raises(CheckpointError, match="scale_inv"):
        dequantize_fp8_blockwise(q, torch.ones(s.shape[0] + 1, s.shape[1]))


@pytest.mark.skipif(FP8 is None, reason="no float8_e4m3fn in this torch")
def test_fp8_checkpoint_loads_dequantised(tmp_path):
    """A checkpoint whose weights are float8_e4m3fn + <name>_scale_inv (one scale stored in another shard, as a
    sharded index may do) loads as W_fp8 x scale per 128x128 block."""
    cfg = micro()
    src = _model(cfg)
    save_hf_checkpoint(src, tmp_path / "bf", max_shard_bytes=1e9)
    tensors = _read_all(tmp_path / "bf")
    quantised = {
        "model.layers.0.mlp.gate_proj.weight": (200, 64),   # 2 x 1 blocks, both cropped
        "model.layers.0.mlp.down_proj.weight": (64, 200),   # 1 x 2 blocks
        "model.layers.1.self_attn.q_b_proj.weight": (48, 32),
        "model.layers.2.mlp.experts.5.up_proj.weight": (32, 64),
    }
    refs = {}
    a, b = {}, {}
    for k, t in tensors.items():
        if k in quantised:
            assert tuple(t.shape) == quantised[k]
            q, s = quantize_fp8_blockwise(t)
            a[k] = q
            (b if k.endswith("down_proj.weight") else a)[k + "_scale_inv"] = s
            refs[k] = (t, q.float() * _expanded_scale(s, t.shape))
        else:
            a[k] = t
    d = tmp_path / "fp8"
    d.mkdir()
    save_file(a, str(d / "model-00001-of-00002.safetensors"))
    save_file(b, str(d / "model-00002-of-00002.safetensors"))
    wm = {k: "model-00001-of-00002.safetensors" for k in a} | {k: "model-00002-of-00002.safetensors" for k in b}
    (d / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": wm}))

    dst = build_model(cfg, seed=4)
    res = load_hf_checkpoint(dst, d)
    assert res.missing == [] and res.unexpected == []  # _scale_inv tensors are consumed, not unexpected
    got = {
        "model.layers.0.mlp.gate_proj.weight": dst.layers[0].mlp.w1.weight,
        "model.layers.0.mlp.down_proj.weight": dst.layers[0].mlp.w2.weight,
        "model.layers.1.self_attn.q_b_proj.weight": dst.layers[1].self_attn.q_b_proj.weight,
        "model.layers.2.mlp.experts.5.up_proj.weight": dst.layers[2].mlp.experts.w3_EFD[5],
    }
    for k, (orig, deq) in refs.items():
        assert torch.equal(got[k], deq), k
        assert ((got[k] - orig).abs() <= orig.abs() * 2 ** -4 + orig.abs().max() / 448 * 2 ** -9 + 1e-12).all(), k
    # Everything else is exact.
    assert torch.equal(dst.layers[2].mlp.experts.w3_EFD[4], src.layers[2].mlp.experts.w3_EFD[4])

    # An FP8 tensor without its scale is an error.
    a.pop("model.layers.1.self_attn.q_b_proj.weight_scale_inv")
    bad = tmp_path / "fp8_noscale"
    bad.mkdir()
    save_file(a | b, str(bad / "model.safetensors"))
    with pytest.raises(CheckpointError, match="q_b_proj.weight_scale_inv"):
        load_hf_checkpoint(build_model(cfg), bad, strict=False)


# ---------------------------------------------------------------------------------------------------------------
# Mismatches
# ---------------------------------------------------------------------------------------------------------------

def test_shape_mismatch_names_tensor_and_shapes(tmp_path):
    save_hf_checkpoint(_model(micro()), tmp_path / "a")
    other = build_model(micro(vocab_size=300))
    with pytest.raises(CheckpointError) as ei:
        load_hf_checkpoint(other, tmp_path / "a")
    msg = str(ei.value)
    assert "(256, 64)" in msg and "(300, 64)" in msg and "different model" in msg
    assert "embed_tokens.weight" in msg or "lm_head.weight" in msg
    # Shape mismatches are errors even when not strict.
    with pytest.raises(CheckpointError, match="different model"):
        load_hf_checkpoint(build_model(micro(expert_ffn_dim=48)), tmp_path / "a", strict=False)


def test_missing_and_unexpected_tensors(tmp_path):
    cfg = micro()
    src = _model(cfg)
    save_hf_checkpoint(src, tmp_path / "a")
    tensors = _read_all(tmp_path / "a")
    tensors.pop("model.layers.1.mlp.gate.e_score_correction_bias")
    tensors["model.layers.9.self_attn.o_proj.weight"] = torch.zeros(64, 32)
    d = tmp_path / "b"
    d.mkdir()
    save_file(tensors, str(d / "model.safetensors"))
    with pytest.raises(CheckpointError) as ei:
        load_hf_checkpoint(build_model(cfg), d)
    msg = str(ei.value)
    assert "model.layers.1.mlp.gate.e_score_correction_bias" in msg and "missing" in msg
    assert "model.layers.9.self_attn.o_proj.weight" in msg
    dst = build_model(cfg)
    res = load_hf_checkpoint(dst, d, strict=False)
    assert res.missing == ["model.layers.1.mlp.gate.e_score_correction_bias"]
    assert res.unexpected == ["model.layers.9.self_attn.o_proj.weight"]
    assert torch.equal(dst.layers[2].mlp.gate.expert_bias, src.layers[2].mlp.gate.expert_bias)
    # Fewer layers in the model than in the checkpoint: the extra layers are reported as unexpected.
    with pytest.raises(CheckpointError, match="no place in the model"):
        load_hf_checkpoint(build_model(micro(n_layers=2, mtp_depth=0)), tmp_path / "a")
    with pytest.raises(CheckpointError, match="no model.safetensors"):
        load_hf_checkpoint(build_model(cfg), tmp_path)


# ---------------------------------------------------------------------------------------------------------------
# MTP
# ---------------------------------------------------------------------------------------------------------------

def test_mtp_saved_as_extra_hf_layers_and_reloaded(tmp_path):
    cfg = micro(mtp_depth=2)
    src = _model(cfg)
    out = save_hf_checkpoint(src, tmp_path / "mtp", max_shard_bytes=100_000)
    names = set(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    n = cfg.n_layers
    for k in range(2):
        p = f"model.layers.{n + k}."
        for suffix in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                       "shared_head.head.weight", "embed_tokens.weight", "input_layernorm.weight",
                       "self_attn.q_a_proj.weight", "self_attn.kv_b_proj.weight", "mlp.gate.weight",
                       "mlp.gate.e_score_correction_bias", "mlp.shared_experts.down_proj.weight",
                       "mlp.experts.7.down_proj.weight", "post_attention_layernorm.weight"):
            assert p + suffix in names, p + suffix
    assert not any(x.startswith(f"model.layers.{n + 2}.") for x in names)
    t = _read_all(out)
    assert torch.equal(t[f"model.layers.{n}.embed_tokens.weight"], t["model.embed_tokens.weight"])
    assert torch.equal(t[f"model.layers.{n + 1}.shared_head.head.weight"], t["lm_head.weight"])
    assert torch.equal(t[f"model.layers.{n + 1}.eh_proj.weight"], src.mtp[1].eh_proj.weight)
    assert torch.equal(t[f"model.layers.{n}.shared_head.norm.weight"], src.mtp[0].norm.weight)

    dst = build_model(cfg, seed=5)
    load_hf_checkpoint(dst, out)
    _assert_same_state(src, dst)
    tokens = torch.randint(0, cfg.vocab_size, (2, 16), generator=torch.Generator().manual_seed(0))
    labels = torch.full_like(tokens, IGNORE_INDEX)
    labels[:, :-1] = tokens[:, 1:]
    with torch.no_grad():
        a, b = src(tokens, labels), dst(tokens, labels)
    assert len(a.mtp_loss_sums) == 2
    for x, y in zip(a.mtp_loss_sums, b.mtp_loss_sums):
        assert torch.equal(x, y)
    # A model without MTP rejects the MTP layers unless strict=False (as HF ignores them).
    no_mtp = build_model(cfg.replace(mtp_depth=0))
    with pytest.raises(CheckpointError, match=f"model.layers.{n}"):
        load_hf_checkpoint(no_mtp, out)
    res = load_hf_checkpoint(no_mtp, out, strict=False)
    assert res.missing == [] and all(u.startswith((f"model.layers.{n}.", f"model.layers.{n + 1}."))
                                     for u in res.unexpected)


# ---------------------------------------------------------------------------------------------------------------
# Atomic save
# ---------------------------------------------------------------------------------------------------------------

def test_save_is_atomic(tmp_path, monkeypatch):
    model = _model(micro())
    target = tmp_path / "ckpt"
    real = st_io.save_file
    calls = []

    def watching(tensors, filename, metadata=None):
        assert not target.exists(), "target directory visible before the save completed"
        assert Path(filename).parent != target
        calls.append(filename)
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(st_io, "save_file", watching)
    save_hf_checkpoint(model, target, max_shard_bytes=100_000)
    assert len(calls) > 2 and target.is_dir()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]  # no temp directory left behind

    # A failure half-way leaves neither the target nor a temporary directory.
    failing_target = tmp_path / "broken"

    def failing(tensors, filename, metadata=None):
        if len(list(Path(filename).parent.glob("*.safetensors"))) >= 2:
            raise OSError("disk full")
        return real(tensors, filename, metadata=metadata)

    monkeypatch.setattr(st_io, "save_file", failing)
    with pytest.raises(OSError, match="disk full"):
        save_hf_checkpoint(model, failing_target, max_shard_bytes=100_000)
    assert not failing_target.exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    # The same failure while overwriting keeps the old checkpoint intact.
    before = sorted(p.name for p in target.iterdir())
    with pytest.raises(OSError):
        save_hf_checkpoint(model, target, max_shard_bytes=100_000, overwrite=True)
    assert sorted(p.name for p in target.iterdir()) == before
    monkeypatch.setattr(st_io, "save_file", real)

    with pytest.raises(FileExistsError):
        save_hf_checkpoint(model, target)
    save_hf_checkpoint(model, target, overwrite=True)  # one shard now replaces the 100 kB shards
    assert sorted(p.name for p in target.iterdir()) == ["config.json", "model-00001-of-00001.safetensors",
                                                        "model.safetensors.index.json"]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]


def test_save_dtype_and_bias_stays_fp32(tmp_path):
    cfg = micro(mtp_depth=0)
    model = _model(cfg)
    out = save_hf_checkpoint(model, tmp_path / "bf16", dtype=torch.bfloat16)
    t = _read_all(out)
    assert t["model.layers.1.mlp.experts.0.gate_proj.weight"].dtype == torch.bfloat16
    assert t["model.layers.1.mlp.gate.e_score_correction_bias"].dtype == torch.float32
    assert json.loads((out / "config.json").read_text())["dtype"] == "bfloat16"
    dst = build_model(cfg)
    load_hf_checkpoint(dst, out)
    assert torch.equal(dst.layers[1].mlp.experts.w2_EDF,
                       model.layers[1].mlp.experts.w2_EDF.to(torch.bfloat16).float())


# ---------------------------------------------------------------------------------------------------------------
# Config mapping
# ---------------------------------------------------------------------------------------------------------------

TRAINING_FIELDS = {"balance_loss_alpha", "mtp_loss_weight", "bias_update_rate", "routing"}
ARCH_FIELDS = [f.name for f in dataclasses.fields(DeepSeekV3Config) if f.name not in TRAINING_FIELDS | {"init_std"}]


@pytest.mark.parametrize("name", sorted(n for n in PRESETS if PRESET_FAMILY[n] == ModelFamily.DEEPSEEK_V3))
def test_config_round_trip_every_preset(name):
    cfg = get_preset(name)
    d = config_to_hf(cfg)
    # a softmax router without expert biases is DeepSeek-V2's, whose HF modeling routes that way (V3's is sigmoid)
    want = "deepseek_v2" if cfg.score_func == "softmax" else "deepseek_v3"
    assert d["model_type"] == want and d["num_key_value_heads"] == cfg.n_heads
    assert config_from_hf(json.loads(json.dumps(d))) == cfg
    changed = cfg.replace(routing="balanced", bias_update_rate=0.0, tie_embeddings=True, rope_interleave=False)
    assert config_from_hf(json.loads(json.dumps(config_to_hf(changed)))) == changed


# deepseek-ai/DeepSeek-V3 config.json (docs/reference.md section 2), released style: top-level rope_theta, rope_scaling
# with key "type", FP8 quantization_config, and keys moetrain does not use.
RELEASED_V3 = {
    "architectures": ["DeepseekV3ForCausalLM"],
    "attention_bias": False, "attention_dropout": 0.0,
    "auto_map": {"AutoConfig": "configuration_deepseek.DeepseekV3Config",
                 "AutoModel": "modeling_deepseek.DeepseekV3Model",
                 "AutoModelForCausalLM": "modeling_deepseek.DeepseekV3ForCausalLM"},
    "aux_loss_alpha": 0.001, "bos_token_id": 0, "eos_token_id": 1, "ep_size": 1,
    "first_k_dense_replace": 3, "hidden_act": "silu", "hidden_size": 7168, "initializer_range": 0.02,
    "intermediate_size": 18432, "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v3",
    "moe_intermediate_size": 2048, "moe_layer_freq": 1, "n_group": 8, "n_routed_experts": 256, "n_shared_experts": 1,
    "norm_topk_prob": True, "num_attention_heads": 128, "num_experts_per_tok": 8, "num_hidden_layers": 61,
    "num_key_value_heads": 128, "num_nextn_predict_layers": 1, "pretraining_tp": 1, "q_lora_rank": 1536,
    "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "quantization_config": {"activation_scheme": "dynamic", "fmt": "e4m3", "quant_method": "fp8",
                            "weight_block_size": [128, 128]},
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 1.0, "mscale_all_dim": 1.0,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 2.5, "scoring_func": "sigmoid", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 4, "topk_method": "noaux_tc", "torch_dtype": "bfloat16",
    "transformers_version": "4.33.1", "use_cache": True, "v_head_dim": 128, "vocab_size": 129280,
}

# deepseek-ai/DeepSeek-V2-Lite config.json (the shape of the 16B preset).
RELEASED_V2_LITE = {
    "architectures": ["DeepseekV2ForCausalLM"], "attention_bias": False, "aux_loss_alpha": 0.001,
    "first_k_dense_replace": 1, "hidden_act": "silu", "hidden_size": 2048, "initializer_range": 0.02,
    "intermediate_size": 10944, "kv_lora_rank": 512, "max_position_embeddings": 163840, "model_type": "deepseek_v2",
    "moe_intermediate_size": 1408, "moe_layer_freq": 1, "n_group": 1, "n_routed_experts": 64, "n_shared_experts": 2,
    "norm_topk_prob": False, "num_attention_heads": 16, "num_experts_per_tok": 6, "num_hidden_layers": 27,
    "num_key_value_heads": 16, "q_lora_rank": None, "qk_nope_head_dim": 128, "qk_rope_head_dim": 64,
    "rms_norm_eps": 1e-06,
    "rope_scaling": {"beta_fast": 32, "beta_slow": 1, "factor": 40, "mscale": 0.707, "mscale_all_dim": 0.707,
                     "original_max_position_embeddings": 4096, "type": "yarn"},
    "rope_theta": 10000, "routed_scaling_factor": 1.0, "scoring_func": "softmax", "seq_aux": True,
    "tie_word_embeddings": False, "topk_group": 1, "topk_method": "greedy", "v_head_dim": 128,
    "vocab_size": 102400,
}


def test_released_v3_config_equals_preset():
    cfg = config_from_hf(RELEASED_V3)
    preset = get_preset("deepseek-v3-671b")
    for name in ARCH_FIELDS:
        assert getattr(cfg, name) == getattr(preset, name), name
    assert cfg.q_lora_rank == 1536 and cfg.mtp_depth == 1 and cfg.rope_factor == 40.0
    assert cfg.init_std == 0.02  # the HF initializer_range, not the report's 0.006 of the preset
    assert cfg.softmax_scale == pytest.approx(0.13523, abs=5e-6)
    # v5 style (rope_parameters) means the same.
    v5 = {k: v for k, v in RELEASED_V3.items() if k not in ("rope_scaling", "rope_theta")}
    v5["rope_parameters"] = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 40.0, "beta_fast": 32.0,
                             "beta_slow": 1.0, "mscale": 1.0, "mscale_all_dim": 1.0,
                             "original_max_position_embeddings": 4096}
    assert config_from_hf(v5) == cfg


def test_released_v2_lite_config_equals_preset(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(RELEASED_V2_LITE))
    cfg = load_hf_config(tmp_path)
    preset = get_preset("deepseek-v2-lite-16b")
    for name in ARCH_FIELDS:
        assert getattr(cfg, name) == getattr(preset, name), name
    assert cfg.q_lora_rank == 0 and cfg.score_func == "softmax" and cfg.bias_update_rate == 0.0
    assert load_hf_config(tmp_path / "config.json") == cfg


def test_config_defaults_and_none_values():
    d = {k: v for k, v in RELEASED_V3.items()
         if k not in ("scoring_func", "num_nextn_predict_layers", "rope_interleave")}
    d.update(n_group=None, topk_group=None, rope_scaling=None)
    cfg = config_from_hf(d)
    assert cfg.score_func == "sigmoid" and cfg.mtp_depth == 0 and cfg.rope_interleave is True
    assert (cfg.n_expert_groups, cfg.n_limited_groups) == (1, 1) and cfg.rope_factor == 1.0


def test_config_errors():
    with pytest.raises(ConfigError, match="model_type='llama'"):
        config_from_hf({**RELEASED_V3, "model_type": "llama"})
    with pytest.raises(ConfigError, match="rope type 'linear'"):
        config_from_hf({**RELEASED_V3, "rope_scaling": {"type": "linear", "factor": 2.0}})
    with pytest.raises(ConfigError, match="group_limited_greedy"):
        config_from_hf({**RELEASED_V2_LITE, "topk_method": "group_limited_greedy", "n_group": 8, "topk_group": 3})
    with pytest.raises(ConfigError, match="hidden_act"):
        config_from_hf({**RELEASED_V3, "hidden_act": "gelu"})
    with pytest.raises(ConfigError, match="top_k"):
        config_from_hf({**RELEASED_V3, "num_experts_per_tok": 300})
    with pytest.raises(ConfigError, match="unexpected field"):
        config_from_hf({**RELEASED_V3, "moetrain": {"dim": 5}})
    # A YaRN config without mscale values means an attention factor moetrain cannot express: warned about.
    rs = {k: v for k, v in RELEASED_V3["rope_scaling"].items() if k not in ("mscale", "mscale_all_dim")}
    with pytest.warns(UserWarning, match="attention factor"):
        config_from_hf({**RELEASED_V3, "rope_scaling": rs})
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        config_from_hf(RELEASED_V3)
