"""Which state-dict adapter reads a ``config.json`` or writes a model: one entry per model family.

A new family adds its adapter (:class:`moetrain.interop.adapter.StateDictAdapter`) to :data:`ADAPTERS`; load, save and
export find it here by the HF ``model_type`` (or ``architectures``) of a ``config.json``, or by the model config.
"""

from __future__ import annotations

from typing import Any

from moetrain.interop.adapter import StateDictAdapter
from moetrain.interop.deepseek import DeepSeekAdapter
from moetrain.errors import ConfigError
from moetrain.model.config import ModelConfig

#: The adapters, tried in order; the first is also the reader of a config.json that names neither its
#: ``model_type`` nor its ``architectures`` (early DeepSeek exports, and config dicts assembled by hand).
ADAPTERS: tuple[StateDictAdapter, ...] = (DeepSeekAdapter(),)


def supported_model_types() -> list[str]:
    """Every HF ``model_type`` some adapter reads."""
    return [mt for a in ADAPTERS for mt in a.model_types]


def _supported() -> str:
    return f"moetrain reads {supported_model_types()} ({'; '.join(a.family for a in ADAPTERS)})"


def adapter_for_hf_config(d: dict[str, Any]) -> StateDictAdapter:
    """The adapter of HF ``config.json`` dict ``d``: by its ``model_type``; without one, by ``architectures``;
    without either, the first of :data:`ADAPTERS`.

    Raises:
        ConfigError: ``d`` is not a dict, or no adapter reads its ``model_type`` / ``architectures`` (the message
            names the supported model types).
    """
    if not isinstance(d, dict):
        raise ConfigError(f"expected a config dict, got {type(d).__name__}")
    model_type = d.get("model_type")
    if model_type is not None:
        for a in ADAPTERS:
            if model_type in a.model_types:
                return a
        raise ConfigError(f"model_type={model_type!r} is not supported; {_supported()}")
    archs = d.get("architectures") or []
    if archs:
        for a in ADAPTERS:
            if set(archs) & set(a.architectures):
                return a
        raise ConfigError(f"architectures={archs!r} (and no model_type) is not supported; {_supported()}")
    return ADAPTERS[0]


def adapter_for_config(cfg: ModelConfig) -> StateDictAdapter:
    """The adapter that writes (and names the tensors of) models of ``cfg``.

    Raises:
        ConfigError: no adapter handles this config.
    """
    for a in ADAPTERS:
        if a.handles(cfg):
            return a
    raise ConfigError(f"no HF layout for a model config of type {type(cfg).__name__}; {_supported()}")
