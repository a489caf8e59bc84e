"""The model families moetrain builds, one :class:`ModelSpec` each (as TorchTitan's ``ModelSpec``): the one list
through which the trainer, ``moetrain count``, the planner, ``--init-from``, ``export``, the dry run and checkpoints
find a family's config class, presets and Hugging Face adapter.

Adding a family: its folder under ``moetrain/model/`` (config, attention, presets, adapter) and one entry in
:data:`SPECS`; no trainer or parallel code changes (docs/architecture.md, "Where a change belongs").
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Callable

from moetrain.errors import ConfigError
from moetrain.model.config_base import ModelConfig, ModelFamily
from moetrain.model.deepseek import presets as deepseek_presets
from moetrain.model.deepseek.adapter import DeepSeekAdapter
from moetrain.model.deepseek.config import DeepSeekV3Config
from moetrain.model.qwen3 import presets as qwen3_presets
from moetrain.model.qwen3.adapter import Qwen3MoeAdapter
from moetrain.model.qwen3.config import Qwen3MoeConfig
from moetrain.model.state_dict import StateDictAdapter


@dataclass(frozen=True)
class ModelSpec:
    """One model family.

    Attributes:
        family: its :class:`ModelFamily` (the ``family`` key of a saved config).
        name: a human name for messages.
        config_cls: its :class:`ModelConfig` subclass.
        presets: preset name -> a function returning a fresh config.
        job_defaults: preset name -> the training settings it brings (``moetrain.model.config.PRESET_JOB_DEFAULTS``).
        adapter: its HF state-dict adapter (``model_types`` / ``architectures`` it reads are the adapter's).
        demo_preset: its CPU-sized preset (tests, the demo; a job of this family without a preset starts there).
    """

    family: ModelFamily
    name: str
    config_cls: type[ModelConfig]
    presets: dict[str, Callable[[], ModelConfig]]
    job_defaults: dict[str, dict[str, dict[str, Any]]]
    adapter: StateDictAdapter
    demo_preset: str


#: Every family; the first is also the reader of a config.json that names neither ``model_type`` nor
#: ``architectures`` (early DeepSeek exports, and config dicts assembled by hand).
SPECS: tuple[ModelSpec, ...] = (
    ModelSpec(ModelFamily.DEEPSEEK_V3, "DeepSeek-V3 / DeepSeek-V2 / Kimi-K2", DeepSeekV3Config,
              deepseek_presets.PRESETS, deepseek_presets.JOB_DEFAULTS, DeepSeekAdapter(), "tiny"),
    ModelSpec(ModelFamily.QWEN3_MOE, "Qwen3-MoE", Qwen3MoeConfig, qwen3_presets.PRESETS, qwen3_presets.JOB_DEFAULTS,
              Qwen3MoeAdapter(), "qwen3-tiny"),
)


def spec_for(cfg: ModelConfig) -> ModelSpec:
    """The spec of ``cfg``'s family.

    Raises:
        ConfigError: a config of no registered family."""
    for s in SPECS:
        if isinstance(cfg, s.config_cls):
            return s
    raise ConfigError(f"no model family for a config of type {type(cfg).__name__}; families: "
                      f"{[s.family.value for s in SPECS]}")


def spec_of_family(family: Any) -> ModelSpec:
    """The spec of ``family`` (a :class:`ModelFamily` or its value).

    Raises:
        ConfigError: an unknown family (naming the known ones)."""
    for s in SPECS:
        if s.family.value == family or s.family == family:
            return s
    raise ConfigError(f"model.family={family!r}; allowed: {', '.join(repr(s.family.value) for s in SPECS)}")


def supported_model_types() -> list[str]:
    """Every HF ``model_type`` some family reads."""
    return [mt for s in SPECS for mt in s.adapter.model_types]


def _supported() -> str:
    return f"moetrain reads {supported_model_types()} ({'; '.join(s.name for s in SPECS)})"


def spec_for_hf_config(d: dict[str, Any]) -> ModelSpec:
    """The family of HF ``config.json`` dict ``d``: by its ``model_type``; without one, by ``architectures``;
    without either, the first of :data:`SPECS`.

    Raises:
        ConfigError: ``d`` is not a dict, or no family reads its ``model_type`` / ``architectures`` (the message
            names the supported model types).
    """
    if not isinstance(d, dict):
        raise ConfigError(f"expected a config dict, got {type(d).__name__}")
    model_type = d.get("model_type")
    if model_type is not None:
        for s in SPECS:
            if model_type in s.adapter.model_types:
                return s
        raise ConfigError(f"model_type={model_type!r} is not supported; {_supported()}")
    archs = d.get("architectures") or []
    if archs:
        for s in SPECS:
            if set(archs) & set(s.adapter.architectures):
                return s
        raise ConfigError(f"architectures={archs!r} (and no model_type) is not supported; {_supported()}")
    return SPECS[0]
