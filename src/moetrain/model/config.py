"""Model configs by family, and the presets: the import path the rest of moetrain uses.

The common base :class:`ModelConfig` lives in :mod:`moetrain.model.config_base`; each family's config, attention,
presets and HF adapter in its own folder (:mod:`moetrain.model.deepseek`, :mod:`moetrain.model.qwen3`), listed once
in :mod:`moetrain.model.registry`. This module gathers the presets of every family (:data:`PRESETS`,
:data:`PRESET_JOB_DEFAULTS`, :func:`get_preset`) and re-exports the config types; importing it registers every
family with :meth:`ModelConfig.from_dict`.
"""

from __future__ import annotations

import difflib
from typing import Any, Callable

from moetrain.errors import ConfigError
from moetrain.model.config_base import (  # noqa: F401 - re-exported
    DEFAULT_FAMILY,
    TRAINING_FIELDS,
    BalanceLoss,
    ModelConfig,
    ModelFamily,
    RoutingMode,
    ScoreFunc,
    Yarn,
    family_class,
    from_dict_strict,
)
from moetrain.model.deepseek.config import DeepSeekV3Config
from moetrain.model.deepseek.presets import (  # noqa: F401 - re-exported
    deepseek_v2_lite_16b,
    deepseek_v3_671b,
    kimi_k2_1t,
    small,
    tiny,
)
from moetrain.model.qwen3.config import Qwen3MoeConfig
from moetrain.model.qwen3.presets import qwen3_30b_a3b, qwen3_235b_a22b, qwen3_tiny  # noqa: F401 - re-exported
from moetrain.model.registry import SPECS

__all__ = ["ConfigError", "TRAINING_FIELDS", "BalanceLoss", "ModelConfig", "ModelFamily", "DeepSeekV3Config",
           "Qwen3MoeConfig", "PRESETS", "PRESET_JOB_DEFAULTS", "PRESET_FAMILY", "get_preset", "from_dict_strict"]

#: Every preset of every family (:data:`moetrain.model.registry.SPECS`), by name.
PRESETS: dict[str, Callable[[], ModelConfig]] = {n: f for s in SPECS for n, f in s.presets.items()}

#: The family of each preset.
PRESET_FAMILY: dict[str, ModelFamily] = {n: s.family for s in SPECS for n in s.presets}

#: What each preset brings to the rest of the job: training settings that fit its size, ``{section: {field: value}}``
#: over the dataclass defaults (the one table of them, each family's rows from its presets module; ``"hf"`` is for a
#: model taken from a HF config.json, by ``model.hf_config`` or ``--init-from``, a conservative continued-pre-training
#: start). :func:`moetrain.config.build_job_config` applies them under job files and ``--set``, and besides:
#: ``data.seq_len`` is capped at the model's ``max_seq_len``; ``parallel.ep`` is lowered to the largest size that
#: divides the world and the experts when the user does not set it; ``data.vocab_size`` (the size of a trained BPE)
#: defaults to the model's ``vocab_size``, and ``model.vocab_size`` then follows the tokenizer.
PRESET_JOB_DEFAULTS: dict[str, dict[str, dict[str, Any]]] = {
    **{n: d for s in SPECS for n, d in s.job_defaults.items()},
    "hf": {"parallel": {"ep": 8}, "data": {"seq_len": 1024},
           "train": {"micro_batch_size": 1, "lr": 1e-4, "min_lr": 1e-5, "warmup_steps": 100}},
}


def get_preset(name: str) -> ModelConfig:
    """Return a fresh config of the named preset.

    Raises:
        ConfigError: unknown name; the message lists the presets and guesses the nearest.
    """
    try:
        return PRESETS[name]()
    except KeyError:
        close = difflib.get_close_matches(name, PRESETS, n=1)  # as unknown --set fields get a guess
        guess = f" (did you mean {close[0]!r}?)" if close else ""
        raise ConfigError(f"unknown model preset {name!r}{guess}; choose one of {sorted(PRESETS)}") from None
