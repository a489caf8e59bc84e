"""The DeepSeek-V3 architecture (also DeepSeek-V2 and Kimi-K2): config, MLA attention, presets, HF adapter."""
