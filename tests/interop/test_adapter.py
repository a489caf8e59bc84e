"""The state-dict adapter pattern: the registry picks a family's adapter from config.json (or refuses, naming what is
supported), and load/save go through the adapter alone, so a second family with other tensor names round-trips
without any change to the loader or the writer."""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

import moetrain.model.registry as registry
from moetrain.interop.adapter import StateMap
from moetrain.model.deepseek.adapter import DeepSeekAdapter
from moetrain.interop.hf import hf_tensor_names, load_hf_checkpoint, load_hf_config, save_hf_checkpoint
from moetrain.interop.registry import adapter_for_config, adapter_for_hf_config, supported_model_types
from moetrain.model.config import DeepSeekV3Config
from moetrain.model import ConfigError, ModelConfig, build_model


def micro(**changes) -> ModelConfig:
    base = dict(vocab_size=128, dim=32, n_layers=3, n_dense_layers=1, dense_ffn_dim=48, expert_ffn_dim=16,
                n_routed_experts=8, n_shared_experts=1, top_k=2, n_expert_groups=1, n_limited_groups=1, n_heads=2,
                q_lora_rank=16, kv_lora_rank=16, qk_nope_head_dim=8, qk_rope_head_dim=8, v_head_dim=8, max_seq_len=32,
                mtp_depth=1, init_std=0.05)
    base.update(changes)
    return DeepSeekV3Config(**base)


def test_registry_picks_deepseek_by_model_type_architecture_or_default():
    assert isinstance(adapter_for_hf_config({"model_type": "deepseek_v2"}), DeepSeekAdapter)
    assert isinstance(adapter_for_hf_config({"architectures": ["DeepseekV3ForCausalLM"]}), DeepSeekAdapter)
    assert isinstance(adapter_for_hf_config({"hidden_size": 64}), DeepSeekAdapter)  # as before the registry
    assert isinstance(adapter_for_config(micro()), DeepSeekAdapter)
    assert {"deepseek_v3", "deepseek_v2"} <= set(supported_model_types())


def test_unsupported_model_type_or_architecture_names_the_supported_types():
    with pytest.raises(ConfigError, match=r"model_type='mixtral' is not supported.*'deepseek_v3'.*'deepseek_v2'.*"
                                          r"'qwen3_moe'"):
        adapter_for_hf_config({"model_type": "mixtral"})
    with pytest.raises(ConfigError, match=r"architectures=\['LlamaForCausalLM'\].*'deepseek_v3'"):
        adapter_for_hf_config({"architectures": ["LlamaForCausalLM"]})
    with pytest.raises(ConfigError, match="expected a config dict"):
        adapter_for_hf_config([1, 2])


def test_hf_tensor_names_are_the_saved_ones_for_a_v2_layout(tmp_path):
    """A V2-style model (softmax router, no expert-bias balancing) writes no e_score_correction_bias; the names
    hf_tensor_names promises are exactly the index's."""
    model = build_model(micro(score_func="softmax", bias_update_rate=0.0))
    out = save_hf_checkpoint(model, tmp_path / "v2")
    index = json.loads((out / "model.safetensors.index.json").read_text())
    assert json.loads((out / "config.json").read_text())["model_type"] == "deepseek_v2"
    assert list(index["weight_map"]) == hf_tensor_names(model)
    assert not any(n.endswith("e_score_correction_bias") for n in hf_tensor_names(model))


class _Renamed(DeepSeekAdapter):
    """A second 'family' for the test: DeepSeek's tensors under ``backbone.`` instead of ``model.``."""

    model_types = ("toy_moe",)
    architectures = ("ToyMoeForCausalLM",)
    family = "a test family"

    def config_to_hf(self, cfg):
        return super().config_to_hf(cfg) | {"model_type": "toy_moe", "architectures": ["ToyMoeForCausalLM"]}

    def config_from_hf(self, d):
        return super().config_from_hf(d | {"model_type": "deepseek_v3"})

    def state_map(self, model) -> StateMap:
        m = super().state_map(model)
        rename = lambda n: n.replace("model.", "backbone.", 1)  # noqa: E731
        for e in m.entries + [s.entry for s in m.stacked]:
            e.hf_name = rename(e.hf_name)
            e.tied_to = rename(e.tied_to) if e.tied_to else None
        for s in m.stacked:
            s.hf_name, s.covers = rename(s.hf_name), [rename(c) for c in s.covers]
        return m


def test_a_second_adapter_round_trips_through_the_same_loader_and_writer(tmp_path, monkeypatch):
    cfg = micro()
    specs = registry.SPECS
    monkeypatch.setattr(registry, "SPECS", (dataclasses.replace(specs[0], adapter=_Renamed()),) + specs)
    src = build_model(cfg, seed=0)
    out = save_hf_checkpoint(src, tmp_path / "toy", max_shard_bytes=20_000)
    hf_cfg = json.loads((out / "config.json").read_text())
    names = list(json.loads((out / "model.safetensors.index.json").read_text())["weight_map"])
    assert hf_cfg["model_type"] == "toy_moe"
    assert names and all(n.startswith("backbone.") or n == "lm_head.weight" for n in names)
    assert load_hf_config(out) == cfg
    dst = build_model(cfg, seed=1)
    res = load_hf_checkpoint(dst, out)
    assert res.missing == [] and res.unexpected == []
    for (k, a), b in zip(src.state_dict().items(), dst.state_dict().values()):
        assert torch.equal(a, b), k

    # Without that adapter registered, its config.json is refused by name.
    monkeypatch.setattr(registry, "SPECS", specs)
    with pytest.raises(ConfigError, match="model_type='toy_moe' is not supported"):
        load_hf_config(out)
