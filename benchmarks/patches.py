"""Proposed speed patches to ``src/moetrain``, applied by monkeypatching so the suite can measure a proposal (rows
``moetrain+patch``, ``--patches NAME,...``) before anyone edits ``src/``. A patch registers with :func:`patch`,
replaces functions through :func:`_set` (so :func:`restore` can undo it) and must not change results beyond
floating-point rounding (the suite checks "same function" against unpatched moetrain).

History (BENCHMARKS.md has the measurements): ``wgrad_layout``, ``cpu_experts_bmm``, ``fused_gate_up``,
``grad_norm_foreach`` and ``fused_adamw`` were measured here and moved into ``src``. No proposal is pending, so
``DEFAULT`` is empty and the suite measures ``src`` as it is.
"""

from __future__ import annotations

from typing import Callable

PATCHES: dict[str, Callable[[], None]] = {}
DESCRIPTIONS: dict[str, str] = {}
DEFAULT: list[str] = []

_ABSENT = object()
_SAVED: list[tuple[object, str, object]] = []


def patch(name: str, description: str):
    """Register ``fn`` as the proposal ``name``; ``description`` says what it changes and why."""
    def deco(fn: Callable[[], None]) -> Callable[[], None]:
        PATCHES[name] = fn
        DESCRIPTIONS[name] = description
        return fn
    return deco


def _set(obj: object, attr: str, value: object) -> None:
    """setattr that remembers the original, so :func:`restore` can undo every patch."""
    _SAVED.append((obj, attr, vars(obj).get(attr, getattr(obj, attr, _ABSENT))))
    setattr(obj, attr, value)


def apply(names: list[str]) -> None:
    unknown = sorted(set(names) - set(PATCHES))
    if unknown:
        raise ValueError(f"unknown patch(es) {unknown}; known: {sorted(PATCHES)}")
    for n in names:
        PATCHES[n]()


def restore() -> None:
    """Undo every applied patch (latest first)."""
    while _SAVED:
        obj, attr, value = _SAVED.pop()
        if value is _ABSENT:
            delattr(obj, attr)
        else:
            setattr(obj, attr, value)


class patched:
    """``with patched(names): ...`` applies the patches for the block only."""

    def __init__(self, names: list[str]):
        self.names = names

    def __enter__(self) -> None:
        restore()
        apply(self.names)

    def __exit__(self, *exc: object) -> None:
        restore()
