"""Single-device DeepSeek-V3 model code (no torch.distributed imports)."""

from moetrain.model.config import PRESETS, ConfigError, ModelConfig, get_preset
from moetrain.model.moe import CapacityConfig, GroupedExperts, LocalDispatcher, MoE, Router
from moetrain.model.transformer import IGNORE_INDEX, ModelOutput, Transformer, build_model, init_weights

__all__ = ["PRESETS", "ConfigError", "ModelConfig", "get_preset", "CapacityConfig", "GroupedExperts",
           "LocalDispatcher", "MoE", "Router", "IGNORE_INDEX", "ModelOutput", "Transformer", "build_model",
           "init_weights"]
