"""The runtime dependencies are declared: every third-party module imported when moetrain's modules are imported
(module level, not inside a function or under ``if TYPE_CHECKING``) is a distribution of pyproject.toml's
[project].dependencies, and the Makefile's RUNTIME_MODULES (what ``make gpu-check-env`` looks for on a machine
that installs nothing) is that list. A package used only inside functions is an optional extra, imported lazily."""

from __future__ import annotations

import ast
import re
import sys
from importlib.metadata import packages_distributions
from pathlib import Path

from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

if sys.version_info >= (3, 11):
    import tomllib
else:  # the project's own fallback (moetrain.config)
    import tomli as tomllib

REPO = Path(__file__).resolve().parents[1]
SRC = REPO / "src" / "moetrain"


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or (
        isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


def import_time_modules(tree: ast.Module) -> set[str]:
    """Top-level names of the absolute imports a module runs when it is imported: its body, the branches of its
    ``if`` (but ``if TYPE_CHECKING``), ``try`` and ``with`` blocks and class bodies; never a function's body."""
    found: set[str] = set()

    def visit(stmts: list[ast.stmt]) -> None:
        for s in stmts:
            if isinstance(s, ast.Import):
                found.update(a.name.split(".")[0] for a in s.names)
            elif isinstance(s, ast.ImportFrom):
                if s.level == 0 and s.module:
                    found.add(s.module.split(".")[0])
            elif isinstance(s, ast.If):
                if not _is_type_checking(s.test):
                    visit(s.body)
                visit(s.orelse)
            elif isinstance(s, ast.Try):
                visit(s.body)
                for h in s.handlers:
                    visit(h.body)
                visit(s.orelse)
                visit(s.finalbody)
            elif isinstance(s, (ast.With, ast.ClassDef)):
                visit(s.body)

    visit(tree.body)
    return found


def third_party_runtime_imports() -> dict[str, list[str]]:
    """Third-party top-level module -> the moetrain modules importing it at import time."""
    local = {"moetrain", "__future__"}
    out: dict[str, list[str]] = {}
    for path in sorted(SRC.rglob("*.py")):
        tree = ast.parse(path.read_text(), filename=str(path))
        for mod in import_time_modules(tree):
            if mod not in local and mod not in sys.stdlib_module_names:
                out.setdefault(mod, []).append(str(path.relative_to(SRC.parent)))
    return out


def declared() -> list[Requirement]:
    pyproject = tomllib.loads((REPO / "pyproject.toml").read_text())
    return [Requirement(r) for r in pyproject["project"]["dependencies"]]


def distribution_of(module: str) -> str:
    """The installed distribution providing ``module`` (its own name where none is installed)."""
    return canonicalize_name(packages_distributions().get(module, [module])[0])


def makefile_runtime_modules() -> set[str]:
    text = (REPO / "Makefile").read_text()
    return set(re.search(r"^RUNTIME_MODULES\s*:?=\s*(.*)$", text, re.M).group(1).split())


def test_the_collector_sees_what_runs_at_import_time_only():
    tree = ast.parse("import a.b\nfrom c import d\nfrom . import e\nfrom .f import g\n"
                     "if TYPE_CHECKING:\n    import h\nelse:\n    import i\n"
                     "try:\n    import j\nexcept ImportError:\n    import k\n"
                     "def fn():\n    import lazy\n"
                     "class C:\n    import m\n    def method(self):\n        import lazy2\n")
    assert import_time_modules(tree) == {"a", "c", "i", "j", "k", "m"}


def test_every_import_time_third_party_module_is_a_declared_dependency():
    names = {canonicalize_name(r.name) for r in declared()}
    imports = third_party_runtime_imports()
    assert "torch" in imports and "numpy" in imports  # the collector reads the tree
    missing = {m: where for m, where in imports.items() if distribution_of(m) not in names}
    assert not missing, (f"imported at import time but not in [project].dependencies: {missing}; declare them, or "
                         f"import them inside the function that needs them (an optional extra, with an error "
                         f"naming its pip install)")


def test_makefile_runtime_modules_are_the_declared_dependencies():
    """RUNTIME_MODULES is what the GPU image must hold: the dependencies without an environment marker (the
    marked ones, tomli for Python < 3.11, are not needed on the image's Python 3.12). Each is imported by that
    module name."""
    unmarked = {canonicalize_name(r.name) for r in declared() if r.marker is None}
    modules = makefile_runtime_modules()
    assert {distribution_of(m) for m in modules} == unmarked, (sorted(modules), sorted(unmarked))
    marked = [r for r in declared() if r.marker is not None]
    assert all(not r.marker.evaluate({"python_version": "3.12", "python_full_version": "3.12.0"}) for r in marked), \
        marked
