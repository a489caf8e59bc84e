"""Interchange with other formats (Hugging Face DeepSeek-V3/V2 checkpoints and configs)."""

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

__all__ = ["CheckpointError", "LoadResult", "config_from_hf", "config_to_hf", "dequantize_fp8_blockwise",
           "hf_tensor_names", "load_hf_checkpoint", "load_hf_config", "save_hf_checkpoint"]
