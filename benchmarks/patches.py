"""Proposed speed patches to ``src/moetrain``, applied by monkeypatching so the suite can measure them (rows
``moetrain+patch``) before anyone edits ``src/``. Each patch names the function it replaces; BENCHMARKS.md carries
the same change as a diff.
"""

from __future__ import annotations

from typing import Callable

PATCHES: dict[str, Callable[[], None]] = {}
DESCRIPTIONS: dict[str, str] = {}


def patch(name: str, description: str):
    def deco(fn: Callable[[], None]) -> Callable[[], None]:
        PATCHES[name] = fn
        DESCRIPTIONS[name] = description
        return fn
    return deco


def apply(names: list[str]) -> None:
    unknown = sorted(set(names) - set(PATCHES))
    if unknown:
        raise ValueError(f"unknown patch(es) {unknown}; known: {sorted(PATCHES)}")
    for n in names:
        PATCHES[n]()


DEFAULT: list[str] = []
