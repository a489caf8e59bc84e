"""Which state-dict adapter reads a ``config.json`` or writes a model: the adapters of the model families'
:class:`~moetrain.model.registry.ModelSpec` (:data:`moetrain.model.registry.SPECS`, the one list of families).

Load, save and export find an adapter here by the HF ``model_type`` (or ``architectures``) of a ``config.json``, or
by the model config.
"""

from __future__ import annotations

from typing import Any

from moetrain.model.config_base import ModelConfig
from moetrain.model.registry import SPECS, spec_for, spec_for_hf_config, supported_model_types  # noqa: F401
from moetrain.model.state_dict import StateDictAdapter

#: The adapters of :data:`moetrain.model.registry.SPECS`, in order.
ADAPTERS: tuple[StateDictAdapter, ...] = tuple(s.adapter for s in SPECS)


def adapter_for_hf_config(d: dict[str, Any]) -> StateDictAdapter:
    """The adapter of HF ``config.json`` dict ``d`` (:func:`moetrain.model.registry.spec_for_hf_config`).

    Raises:
        ConfigError: ``d`` is not a dict, or no family reads its ``model_type`` / ``architectures``.
    """
    return spec_for_hf_config(d).adapter


def adapter_for_config(cfg: ModelConfig) -> StateDictAdapter:
    """The adapter that writes (and names the tensors of) models of ``cfg``.

    Raises:
        ConfigError: no family handles this config.
    """
    return spec_for(cfg).adapter
