"""The package's folders are its layers, and imports point one way: down the table below, never up, and never
in a circle. Every import counts: at module level, inside functions (lazy GPU imports) and under
TYPE_CHECKING, since each is a dependency of the code that holds it."""

from __future__ import annotations

import ast
import os

import pytest

ROOT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "gdsload")

#: Each layer may import its own and lower ones. A folder is one layer; top-level modules are named.
LAYERS: dict[str, int] = {
    "errors": 0, "_units": 0, "_tasks": 0,
    "system": 1,
    "format": 2, "cuda": 2,
    "remote": 3,
    "codecs": 4, "backends": 4,
    "pipeline": 5, "conversion": 5,
    "options": 6, "integrations": 6, "_fork": 6, "dataset": 6,
    "mixture": 7,
    "tools": 8, "__init__": 8, "__main__": 8,
}


def _modules() -> dict[str, str]:
    """Dotted name (below ``gdsload``) -> file, for every module of the package."""
    found = {}
    for folder, _, files in os.walk(ROOT):
        for f in files:
            if f.endswith(".py"):
                parts = os.path.relpath(os.path.join(folder, f), ROOT)[:-3].split(os.sep)
                found[".".join(parts)] = os.path.join(folder, f)
    return found


def _imports(name: str, path: str, modules: dict[str, str]) -> set[str]:
    """The package's modules that ``name`` imports, anywhere in it (``from . import x`` names module x)."""
    package = name.split(".")[:-1]
    out = set()
    with open(path) as f:
        tree = ast.parse(f.read(), path)
    for node in ast.walk(tree):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package[:len(package) - node.level + 1] + (node.module.split(".") if node.module else [])
            elif node.module and (node.module == "gdsload" or node.module.startswith("gdsload.")):
                base = node.module.split(".")[1:]
            else:
                continue
            for alias in node.names:
                sub = ".".join(base + [alias.name])
                module = ".".join(base)
                out.add(sub if sub in modules else module if module in modules else ".".join(base + ["__init__"]))
        elif isinstance(node, ast.Import):
            out |= {a.name[len("gdsload."):] for a in node.names if a.name.startswith("gdsload.")}
    return {m for m in out if m in modules and m != name}


def _layer(name: str) -> int:
    top = name.split(".")[0]
    assert top in LAYERS, f"gdsload/{name.replace('.', '/')}.py: not in any layer of tests/test_import_graph.py"
    return LAYERS[top]


GRAPH = {name: _imports(name, path, _modules()) for name, path in _modules().items()}


@pytest.mark.parametrize("name", sorted(GRAPH))
def test_a_module_imports_nothing_above_its_layer(name):
    up = {m for m in GRAPH[name] if _layer(m) > _layer(name)}
    assert not up, f"gdsload.{name} (layer {_layer(name)}) imports {sorted(up)} from above"


def test_the_import_graph_has_no_cycle():
    state: dict[str, int] = {}  # 1: on the current path, 2: done
    path: list[str] = []

    def visit(node: str) -> None:
        state[node] = 1
        path.append(node)
        for nxt in sorted(GRAPH[node]):
            if state.get(nxt) == 1:
                cycle = path[path.index(nxt):] + [nxt]
                raise AssertionError("import cycle: " + " -> ".join(cycle))
            if nxt not in state:
                visit(nxt)
        path.pop()
        state[node] = 2

    for node in sorted(GRAPH):
        if node not in state:
            visit(node)


def test_the_check_sees_imports_of_every_kind(tmp_path):
    """The parser finds relative, absolute, lazy and type-only imports, so the two tests above are not empty."""
    assert {"errors", "pipeline.reader"} <= GRAPH["dataset"]
    assert any(GRAPH[m] for m in GRAPH if m.startswith("backends."))
    assert sum(len(v) for v in GRAPH.values()) > 150


#: The backend families' rooms inside the backends layer (a subfolder is in its top folder's layer): the
#: native stager lies below the pinned and mmap backends, which both use it and never import each other.
FAMILIES: dict[str, int] = {"native": 0, "pinned": 1, "mmap": 1}


def test_the_backend_families_import_only_rooms_below_them():
    def family(name: str) -> str | None:
        parts = name.split(".")
        if parts[0] != "backends" or len(parts) < 3:
            return None
        assert parts[1] in FAMILIES, f"gdsload/backends/{parts[1]}/: not a family of tests/test_import_graph.py"
        return parts[1]

    sideways = [f"{m} imports {n}" for m in GRAPH for n in GRAPH[m]
                if family(m) and family(n) not in (None, family(m)) and FAMILIES[family(n)] >= FAMILIES[family(m)]]
    assert not sideways, sideways
    assert "backends.native.stager" in GRAPH["backends.mmap.copier"], "the check sees imports between rooms"


#: Imported anywhere in gdsload, these would cost a fresh process a fraction of a second on the path of its
#: first batch (``import cupyx`` imports SciPy); the library has what it needs from them elsewhere.
SLOW_IMPORTS = ("cupyx", "scipy")


def test_no_module_imports_what_pulls_in_scipy():
    found = []
    for name, path in _modules().items():
        with open(path) as f:
            tree = ast.parse(f.read(), path)
        for node in ast.walk(tree):
            names = ([a.name for a in node.names] if isinstance(node, ast.Import)
                     else [node.module or ""] if isinstance(node, ast.ImportFrom) and not node.level else [])
            found += [f"{name}:{node.lineno} imports {n}" for n in names if n.split(".")[0] in SLOW_IMPORTS]
    assert not found, found
