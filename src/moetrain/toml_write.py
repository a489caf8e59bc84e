"""A TOML writer for the values a job configuration holds (TOML 1.0, https://toml.io/en/v1.0.0).

The standard library reads TOML (``tomllib``) but does not write it, and the GPU image has no ``tomli_w``; what
``moetrain.config.save_job_config`` writes is small and typed (tables of tables, strings, booleans, integers, floats,
and arrays of them), so a writer of exactly that needs no package. Every value it writes reads back equal through
``tomllib``/``tomli`` (tests/test_toml_write.py round-trips each kind, edge cases included).

Written forms: strings as basic strings ("...", with ``\\"``, ``\\\\``, ``\\b \\t \\n \\f \\r`` and ``\\uXXXX`` for
the other control characters; other characters as themselves, UTF-8); floats as Python's shortest ``repr``, which is
a TOML float (``1e-08``, ``1.5``, ``inf``, ``-inf``, ``nan``); tuples as arrays; a mapping nested in a table as a
``[table]`` section, one inside an array as an inline table.
"""

from __future__ import annotations

import math
import re
from collections.abc import Mapping
from typing import Any

_BARE_KEY = re.compile(r"[A-Za-z0-9_-]+")
_ESCAPES = {'"': '\\"', "\\": "\\\\", "\b": "\\b", "\t": "\\t", "\n": "\\n", "\f": "\\f", "\r": "\\r"}
_INT_MIN, _INT_MAX = -(2 ** 63), 2 ** 63 - 1


def dumps(data: Mapping[str, Any]) -> str:
    """The TOML document of ``data``: its non-mapping values as key/value pairs, its mappings as tables.

    Raises:
        TypeError: a value TOML cannot hold (None -- TOML has no null; leave the key out), a type other than
            str, bool, int, float, list, tuple or a mapping, or a key that is not a string. The message names the
            dotted key.
        ValueError: an integer outside TOML's signed 64-bit range.
    """
    lines: list[str] = []
    _table(lines, data, ())
    return "\n".join(lines) + "\n" if lines else ""


def _table(lines: list[str], table: Mapping[str, Any], path: tuple[str, ...]) -> None:
    pairs = [(k, v) for k, v in table.items() if not isinstance(v, Mapping)]
    subtables = [(k, v) for k, v in table.items() if isinstance(v, Mapping)]
    if path and (pairs or not subtables):  # a header for the table's own keys, or to define an empty table
        if lines:
            lines.append("")
        lines.append(f"[{'.'.join(_key(p, path) for p in path)}]")
    for k, v in pairs:
        lines.append(f"{_key(k, path)} = {_value(v, (*path, k))}")
    for k, v in subtables:
        _table(lines, v, (*path, _checked_key(k, path)))


def _checked_key(k: Any, path: tuple[str, ...]) -> str:
    if not isinstance(k, str):
        raise TypeError(f"TOML keys are strings; got {k!r} ({type(k).__name__}) in {_where(path) or 'the top level'}")
    return k


def _key(k: Any, path: tuple[str, ...]) -> str:
    k = _checked_key(k, path)
    return k if _BARE_KEY.fullmatch(k) else _string(k)


def _where(path: tuple[str, ...]) -> str:
    return ".".join(path)


def _string(s: str) -> str:
    out = []
    for ch in s:
        if ch in _ESCAPES:
            out.append(_ESCAPES[ch])
        elif ch < " " or ch == "\x7f":
            out.append(f"\\u{ord(ch):04X}")
        else:
            out.append(ch)
    return '"' + "".join(out) + '"'


def _value(v: Any, path: tuple[str, ...]) -> str:
    if isinstance(v, bool):  # before int: bool is an int
        return "true" if v else "false"
    if isinstance(v, int):
        if not _INT_MIN <= v <= _INT_MAX:
            raise ValueError(f"{_where(path)} = {v} is outside TOML's 64-bit integer range")
        return str(v)
    if isinstance(v, float):
        if math.isnan(v):
            return "nan"  # TOML's nan carries no sign that a reader keeps
        return repr(v)  # shortest round-trip form: '1.0', '1e-08', '1.5e+300', 'inf', '-inf', '-0.0'
    if isinstance(v, str):
        return _string(v)
    if isinstance(v, (list, tuple)):
        return "[" + ", ".join(_value(x, (*path, f"[{i}]")) for i, x in enumerate(v)) + "]"
    if isinstance(v, Mapping):
        items = ", ".join(f"{_key(k, path)} = {_value(x, (*path, str(k)))}" for k, x in v.items())
        return "{ " + items + " }" if items else "{}"
    if v is None:
        raise TypeError(f"{_where(path)} is None, which TOML cannot hold; leave the key out instead")
    raise TypeError(f"{_where(path)} has type {type(v).__name__}, which moetrain does not write as TOML")
