"""The Qwen3-MoE architecture: config, grouped-query attention with q/k norms, presets, HF adapter."""
