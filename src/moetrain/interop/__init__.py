"""Interchange with other formats: Hugging Face checkpoints and configs (per model family through a state-dict
adapter, :mod:`moetrain.interop.registry`), and reading moetrain's own DCP checkpoints in one process."""

from moetrain.interop.adapter import StateDictAdapter
from moetrain.interop.hf import (
    CheckpointError,
    LoadResult,
    config_from_hf,
    config_to_hf,
    dequantize_fp8_blockwise,
    hf_tensor_names,
    load_hf_checkpoint,
    load_hf_config,
    save_hf_checkpoint,
)
from moetrain.interop.registry import adapter_for_config, adapter_for_hf_config

__all__ = ["CheckpointError", "LoadResult", "StateDictAdapter", "adapter_for_config", "adapter_for_hf_config",
           "config_from_hf", "config_to_hf", "dequantize_fp8_blockwise", "hf_tensor_names", "load_hf_checkpoint",
           "load_hf_config", "save_hf_checkpoint"]
