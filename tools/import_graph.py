"""moetrain's import graph: the import cycles between modules and the imports that run upward through the layers.

``python tools/import_graph.py [SRC]`` prints both (exit 1 when there is any); ``tests/test_layers.py`` asserts on
the same functions. Every import counts, a function-local one included: deferring an import hides a cycle from
Python's loader, not from the reader.

The layers, low to high (docs/architecture.md): a module may import its own layer and the ones below.
"""

from __future__ import annotations

import ast
import sys
from pathlib import Path

#: The layers, low to high: each entry names a top-level module or package of moetrain, or a dotted module inside
#: one that sits elsewhere than its package (the longest name that matches decides). ``precision.apply`` swaps FP8
#: modules into a built model (applied from outside, as parallelism is), so it sits above ``model``, while the FP8
#: kernels it installs sit below it; ``config`` (the job: one typed section per component, ``train.config`` being the
#: training loop's) is what the trainer is built from; ``plan.cli`` is the ``moetrain plan`` command.
LAYERS: tuple[tuple[str, ...], ...] = (
    ("errors", "fsutil", "devices", "toml_write", "layout"),
    ("precision",),
    ("model",),
    ("precision.apply", "accounting"),
    ("parallel",),
    ("data",),
    ("interop",),
    ("plan",),
    ("train.config", "config"),
    ("train",),
    ("cli", "__main__", "plan.cli", "plan.cli_args", "plan.__main__", "api"),
)


def layer_of(module: str) -> int:
    """Index in LAYERS of ``module`` (a dotted name under moetrain); the package ``moetrain`` itself is on top.

    Raises:
        KeyError: no entry of LAYERS covers the module (a new top-level module: add it to its layer).
    """
    rel = module.partition(".")[2] or "cli"
    best = None
    for i, names in enumerate(LAYERS):
        for n in names:
            if (rel == n or rel.startswith(n + ".")) and (best is None or len(n) > best[1]):
                best = (i, len(n))
    if best is None:
        raise KeyError(f"{module}: in no layer of tools/import_graph.LAYERS; add it to the layer it belongs to")
    return best[0]


def imports(src: Path) -> dict[str, set[str]]:
    """{module: moetrain modules it imports}, for every .py under ``src/moetrain`` (``from moetrain.x import y``
    counts ``moetrain.x.y`` when that is a module, else ``moetrain.x``)."""
    root = src / "moetrain"
    mods = {}
    for f in root.rglob("*.py"):
        parts = f.relative_to(src).with_suffix("").parts
        name = ".".join(parts[:-1] if parts[-1] == "__init__" else parts)
        mods[name] = f
    out: dict[str, set[str]] = {}
    for name, f in mods.items():
        deps: set[str] = set()
        pkg = name if f.name == "__init__.py" else name.rpartition(".")[0]
        for node in ast.walk(ast.parse(f.read_text(), str(f))):
            if isinstance(node, ast.ImportFrom):
                base = node.module or ""
                if node.level:
                    anchor = pkg.split(".")
                    anchor = anchor[:len(anchor) - node.level + 1]
                    base = ".".join(anchor + ([base] if base else []))
                if not base.startswith("moetrain"):
                    continue
                for a in node.names:
                    deps.add(f"{base}.{a.name}" if f"{base}.{a.name}" in mods else base)
            elif isinstance(node, ast.Import):
                deps.update(a.name for a in node.names if a.name.startswith("moetrain"))
        deps.discard(name)
        out[name] = {d for d in deps if d in mods}
    return out


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """Strongly connected components of more than one module (Tarjan), each sorted; a package's ``__init__``
    re-exporting its submodules is not a cycle of theirs, so edges into a package from its own submodules are left out."""
    g = {m: {d for d in ds if not m.startswith(d + ".")} for m, ds in graph.items()}
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on: set[str] = set()
    out: list[list[str]] = []
    sys.setrecursionlimit(10000)

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on.add(v)
        for w in g.get(v, ()):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1:
                out.append(sorted(comp))

    for v in sorted(g):
        if v not in index:
            visit(v)
    return sorted(out)


def upward(graph: dict[str, set[str]]) -> list[tuple[str, str]]:
    """(importer, imported) pairs where the imported module's layer is above the importer's."""
    return sorted((m, d) for m, ds in graph.items() for d in ds if layer_of(d) > layer_of(m))


def main(argv: list[str]) -> int:
    src = Path(argv[1]) if len(argv) > 1 else Path(__file__).resolve().parents[1] / "src"
    g = imports(src)
    cyc, up = cycles(g), upward(g)
    print(f"{len(g)} modules, {sum(map(len, g.values()))} imports")
    print(f"cycles: {len(cyc)}")
    for c in cyc:
        print("  " + " <-> ".join(c))
    print(f"upward imports: {len(up)}")
    for m, d in up:
        print(f"  {m} -> {d}")
    return 1 if cyc or up else 0


if __name__ == "__main__":
    sys.exit(main(sys.argv))
