"""Model families: configs round-trip with their family, old saved configs load as DeepSeek-V3, planner-only GQA
shapes are refused by the trainer, and Qwen3-MoE's blocks take FP8 and activation checkpointing like DeepSeek's."""

from __future__ import annotations

import pytest
import torch

from moetrain.model import (PRESETS, ConfigError, DeepSeekV3Config, ModelConfig, Qwen3MoeConfig, build_model,
                            get_preset)
from moetrain.model.config import PRESET_FAMILY
from moetrain.model.registry import SPECS, spec_for
from moetrain.precision.apply import apply_fp8


@pytest.mark.parametrize("name", sorted(PRESETS))
def test_every_preset_round_trips_with_its_family(name):
    cfg = get_preset(name)
    d = cfg.to_dict()
    assert d["family"] == PRESET_FAMILY[name].value == spec_for(cfg).family.value
    assert ModelConfig.from_dict(d) == cfg and type(ModelConfig.from_dict(d)) is type(cfg)


def test_a_saved_config_without_family_is_deepseek_v3():
    d = get_preset("tiny").to_dict()
    del d["family"], d["balance_loss"]  # as every run saved before there were families
    cfg = ModelConfig.from_dict(d)
    assert isinstance(cfg, DeepSeekV3Config) and cfg == get_preset("tiny")


def test_family_errors_name_the_fix():
    with pytest.raises(ConfigError, match="model.family='mixtral'; allowed: 'deepseek_v3', 'qwen3_moe'"):
        ModelConfig.from_dict({"family": "mixtral"})
    with pytest.raises(ConfigError, match="unknown field.*model.kv_lora_rank"):
        ModelConfig.from_dict({"family": "qwen3_moe", "kv_lora_rank": 8})
    with pytest.raises(ConfigError, match="model.balance_loss='global'; allowed: 'sequence', 'micro_batch'"):
        get_preset("qwen3-tiny").replace(balance_loss="global")
    assert [s.family.value for s in SPECS] == ["deepseek_v3", "qwen3_moe"]


@pytest.mark.parametrize("field", [{"qkv_bias": True}, {"qk_norm": False}, {"shared_ffn_dim": 64}])
def test_planner_only_gqa_shapes_are_refused_by_the_trainer(field):
    cfg = get_preset("qwen3-tiny").replace(**field)
    with pytest.raises(ConfigError, match=f"model.{next(iter(field))}=.*for `moetrain plan` only"):
        build_model(cfg, device="meta")


def test_qwen3_fp8_switches_its_attention_projections():
    model = build_model(get_preset("qwen3-tiny").replace(n_layers=1), device="meta")
    done = apply_fp8(model, "blockwise")
    assert {f"layers.0.self_attn.{p}" for p in ("q_proj", "k_proj", "v_proj", "o_proj")} <= set(done)
    assert "layers.0.mlp.experts" in done and not any("norm" in n for n in done)


def test_qwen3_activation_checkpointing_gives_the_same_loss_and_gradients():
    cfg = get_preset("qwen3-tiny").replace(vocab_size=128, balance_loss="micro_batch")
    x = torch.randint(0, 128, (2, 16), generator=torch.Generator().manual_seed(0))
    grads = []
    for recompute in (False, True):
        model = build_model(cfg, seed=0)
        for b in model.layers:
            b.recompute = recompute
        out = model(x, x.roll(-1, 1))
        out.loss(cfg).backward()
        grads.append([p.grad.clone() for p in model.parameters()])
    for a, b in zip(*grads):
        torch.testing.assert_close(a, b, rtol=0, atol=0)


def test_qwen3_config_checks():
    with pytest.raises(ConfigError, match="model.n_kv_heads=3 must divide n_heads=4"):
        Qwen3MoeConfig(n_heads=4, n_kv_heads=3)
    with pytest.raises(ConfigError, match="model.head_dim=7 must be even"):
        Qwen3MoeConfig(head_dim=7)
    # no MTP modules in the qwen3_moe layout: a run with them could not be exported
    with pytest.raises(ConfigError, match="model.mtp_depth=1: Qwen3-MoE has no multi-token prediction"):
        Qwen3MoeConfig(mtp_depth=1)


def test_a_qwen3_config_json_without_its_shape_keys_is_refused_naming_them():
    """A qwen3_moe config.json missing hidden_size must not silently become Qwen3-30B-A3B's 2048."""
    from moetrain.model.qwen3.adapter import config_from_hf, config_to_hf

    full = config_to_hf(PRESETS["qwen3-tiny"]())
    assert config_from_hf(full).dim == PRESETS["qwen3-tiny"]().dim
    with pytest.raises(ConfigError, match="hidden_size"):
        config_from_hf({k: v for k, v in full.items() if k != "hidden_size"})
    with pytest.raises(ConfigError, match="num_experts"):
        config_from_hf({k: v for k, v in full.items() if k not in ("num_experts", "num_local_experts")})


def test_a_run_saved_before_families_resumes_and_another_family_is_refused(tmp_path):
    import json

    from moetrain.config import JobConfig
    from moetrain.train.checkpoint import CheckpointError
    from moetrain.train.trainer import check_checkpoint_compatible

    old = get_preset("tiny").to_dict()
    del old["family"], old["balance_loss"]
    (tmp_path / "trainer_state.json").write_text(json.dumps({"model_config": old}))
    check_checkpoint_compatible(tmp_path, JobConfig(model=get_preset("tiny")))
    with pytest.raises(CheckpointError, match="family: checkpoint 'deepseek_v3' vs config 'qwen3_moe'"):
        check_checkpoint_compatible(tmp_path, JobConfig(model=get_preset("qwen3-tiny")))


def test_a_qwen3_job_file_round_trips_with_or_without_its_preset(tmp_path):
    """A saved job names the family; a model read from a HF config (no preset) reloads as its family."""
    from moetrain.config import JobConfig, build_job_config, read_config_file, save_job_config

    job = build_job_config({"model": {"preset": "qwen3-tiny"}})
    back = build_job_config(read_config_file(save_job_config(job, tmp_path / "job.toml")))
    assert back.model == job.model and isinstance(back.model, Qwen3MoeConfig)
    hf = JobConfig(model=get_preset("qwen3-tiny").replace(dim=96), preset="hf:/x/config.json")
    back = build_job_config(read_config_file(save_job_config(hf, tmp_path / "hf.toml")))
    assert back.model == hf.model and back.preset == "qwen3-tiny"


def test_calling_the_base_builds_the_family_config_as_before_families():
    """Code written before families (the longseq acceptance script among it) builds configs with
    ``ModelConfig(**cfg.to_dict())`` and ``ModelConfig(q_lora_rank=...)``: the base dispatches on ``family``."""
    tiny = PRESETS["tiny"]()
    again = ModelConfig(**{**tiny.to_dict(), "max_seq_len": 8192})
    assert type(again) is DeepSeekV3Config and again.max_seq_len == 8192 and again.q_lora_rank == tiny.q_lora_rank
    assert type(ModelConfig(q_lora_rank=0)) is DeepSeekV3Config
    q = PRESETS["qwen3-tiny"]()
    assert ModelConfig(**q.to_dict()) == q and Qwen3MoeConfig(**q.to_dict()) == q
    with pytest.raises(ConfigError, match="model.family='qwen3_moe' where a deepseek_v3 model is expected"):
        DeepSeekV3Config(**q.to_dict())
    with pytest.raises(ConfigError, match="model.family='gpt'; allowed"):
        ModelConfig(family="gpt")
