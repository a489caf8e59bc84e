"""Typed reading of a Hugging Face ``config.json``, for every family's adapter: the file parsed with its name and
the line and column of a JSON error (:func:`read_config_json`), each value checked against the type the adapter
needs (:class:`HFConfigReader`), and required keys named when absent -- rather than a ``ValueError`` from
``int("four")`` or an absent ``hidden_size`` silently taking a default of another model.

JSON types as HF writes them: an integer is a JSON number without a fraction (``4``, not ``4.0`` nor ``"4"``), a
float any JSON number, a bool ``true``/``false``. ``null`` is read as absent, as ``transformers`` does
(``"q_lora_rank": null``).
"""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

from moetrain.errors import ConfigError

#: A value of ``HFConfigReader.get``'s ``default`` that makes the key required.
REQUIRED: Any = object()

_TYPE_NAMES = {int: "an integer", float: "a number", bool: "true or false", str: "a string", dict: "a JSON object"}
_EXAMPLES = {int: "4", float: "0.5", bool: "true", str: '"silu"', dict: "{...}"}


def read_config_json(path: str | os.PathLike) -> dict[str, Any]:
    """The JSON object in ``path`` (a ``config.json``).

    Raises:
        FileNotFoundError: no such file.
        ConfigError: not UTF-8, not valid JSON (naming the file, line and column), or not a JSON object.
    """
    p = Path(path)
    if not p.is_file():
        raise FileNotFoundError(f"no HF config at {p}")
    try:
        d = json.loads(p.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise ConfigError(f"{p} is not a text file ({e}); a HF config.json is UTF-8 JSON") from None
    except json.JSONDecodeError as e:
        raise ConfigError(f"{p} is not valid JSON: {e.msg} at line {e.lineno} column {e.colno}") from None
    if not isinstance(d, dict):
        raise ConfigError(f"{p} holds a JSON {type(d).__name__}, not an object of config keys")
    return d


class HFConfigReader:
    """The values of a HF config dict ``d`` (or of a nested block of it, ``prefix`` naming the block in messages),
    each checked against its type. Errors name the key, the value found and the expected type; the caller that
    knows the file adds its name (:func:`moetrain.interop.hf.load_hf_config`).

    Example: ``HFConfigReader(d).get("num_hidden_layers", int)`` -> 61, or ConfigError
    ``num_hidden_layers='four' must be an integer, e.g. "num_hidden_layers": 4``.
    """

    def __init__(self, d: dict[str, Any], prefix: str = ""):
        if not isinstance(d, dict):
            raise ConfigError(f"expected a config dict{f' for {prefix!r}' if prefix else ''}, got "
                              f"{type(d).__name__}")
        self.d, self.prefix = d, prefix

    def require(self, keys: tuple[str, ...], what: str) -> None:
        """Refuse a config without every one of ``keys`` (absent or null), naming all missing ones; ``what`` says
        what they describe ("the DeepSeek-V3 architecture").

        Raises:
            ConfigError: naming the missing keys.
        """
        missing = [self.prefix + k for k in keys if self.d.get(k) is None]
        if missing:
            raise ConfigError(f"missing required key(s) {', '.join(missing)}: {what} cannot be read without them "
                              f"(no default is assumed)")

    def has(self, key: str) -> bool:
        """Whether ``key`` is present and not null."""
        return self.d.get(key) is not None

    def get(self, key: str, tp: type, default: Any = REQUIRED) -> Any:
        """``d[key]`` checked to be of type ``tp`` (int, float, bool, str or dict; a float may be given as a JSON
        integer and is returned as float); ``default`` when the key is absent or null (``REQUIRED``: refused).

        Raises:
            ConfigError: the value has another type (naming the key, the value and the type expected), or a
                required key is missing.
        """
        v = self.d.get(key)
        if v is None:
            if default is REQUIRED:
                raise ConfigError(f"missing required key {self.prefix}{key} (expected {_TYPE_NAMES[tp]})")
            return default
        ok = {int: lambda x: isinstance(x, int) and not isinstance(x, bool),
              float: lambda x: isinstance(x, (int, float)) and not isinstance(x, bool),
              bool: lambda x: isinstance(x, bool), str: lambda x: isinstance(x, str),
              dict: lambda x: isinstance(x, dict)}[tp]
        if not ok(v):
            raise ConfigError(f"{self.prefix}{key}={v!r} must be {_TYPE_NAMES[tp]}, e.g. "
                              f'"{key}": {_EXAMPLES[tp]}')
        return float(v) if tp is float else v

    def block(self, key: str) -> "HFConfigReader":
        """The reader of the nested object ``d[key]`` (empty when absent or null).

        Raises:
            ConfigError: ``d[key]`` is not an object.
        """
        return HFConfigReader(self.get(key, dict, {}), prefix=f"{self.prefix}{key}.")
