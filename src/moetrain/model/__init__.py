"""Single-device model code (no torch.distributed imports): the common pieces (layers, MoE, transformer, stages)
and one folder per model family (``deepseek``, ``qwen3``), listed in :mod:`moetrain.model.registry`."""

from moetrain.model.config import (PRESETS, ConfigError, DeepSeekV3Config, ModelConfig, ModelFamily, Qwen3MoeConfig,
                                   get_preset)
from moetrain.model.moe import CapacityConfig, LocalDispatcher, MoE, Router
from moetrain.model.experts import GroupedExperts
from moetrain.model.transformer import IGNORE_INDEX, ModelOutput, Transformer, build_model, init_weights

__all__ = ["PRESETS", "ConfigError", "DeepSeekV3Config", "ModelConfig", "ModelFamily", "Qwen3MoeConfig", "get_preset",
           "CapacityConfig", "GroupedExperts", "LocalDispatcher", "MoE", "Router", "IGNORE_INDEX", "ModelOutput",
           "Transformer", "build_model", "init_weights"]
