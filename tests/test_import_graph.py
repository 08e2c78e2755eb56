"""The shape of the package: no import cycle between modules of batchinfer/, and the kernels import
nothing from the layers above them (attention, engine, models).

The graph is read from the source with `ast`: every `import` and `from ... import` anywhere in a module
(module level, inside functions, under `if TYPE_CHECKING:`), relative imports resolved. `from a import b`
is an edge to the module `a.b` when there is one, else to `a`. Importing a submodule also runs its
parent package's `__init__`, but that is not counted as an edge: a package's `__init__` may re-export
its submodules.
"""

from __future__ import annotations

import ast
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent

UPPER_LAYERS = ("batchinfer.attention", "batchinfer.engine", "batchinfer.models")


def modules(root: Path, package: str) -> dict[str, tuple[Path, bool]]:
    """Dotted module name -> (file, is a package) for every .py file of the package under root."""
    out = {}
    for path in sorted((root / package).rglob("*.py")):
        parts = list(path.relative_to(root).with_suffix("").parts)
        is_pkg = parts[-1] == "__init__"
        out[".".join(parts[:-1] if is_pkg else parts)] = (path, is_pkg)
    return out


def import_graph(root: Path, package: str) -> dict[str, set[str]]:
    """Module -> the modules of the package it imports (see the module docstring)."""
    mods = modules(root, package)

    def known(name: str) -> str | None:  # the longest prefix of a dotted name that is one of our modules
        parts = name.split(".")
        for i in range(len(parts), 0, -1):
            if ".".join(parts[:i]) in mods:
                return ".".join(parts[:i])
        return None

    graph: dict[str, set[str]] = {}
    for name, (path, is_pkg) in mods.items():
        here = name.split(".") if is_pkg else name.split(".")[:-1]  # the package relative imports start from
        targets: set[str | None] = set()
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"), str(path))):
            if isinstance(node, ast.Import):
                targets.update(known(a.name) for a in node.names)
            elif isinstance(node, ast.ImportFrom):
                if node.level:
                    base = here[: len(here) - (node.level - 1)]
                    source = ".".join(base + ([node.module] if node.module else []))
                else:
                    source = node.module or ""
                for a in node.names:
                    sub = f"{source}.{a.name}"
                    targets.add(sub if sub in mods else known(source))
        graph[name] = {t for t in targets if t is not None and t != name}
    return graph


def cycle_groups(graph: dict[str, set[str]]) -> list[set[str]]:
    """The strongly connected groups of more than one module: each module of a group reaches every other."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    groups: list[set[str]] = []

    def visit(v: str) -> None:  # Tarjan's algorithm (the graph is a few hundred modules: recursion is fine)
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                group.add(w)
                if w == v:
                    break
            if len(group) > 1:
                groups.append(group)

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return groups


def cycles(graph: dict[str, set[str]]) -> list[list[str]]:
    """One import cycle (a -> b -> ... -> a) per cycle group."""
    return [_cycle_in(graph, g) for g in cycle_groups(graph)]


def describe(graph: dict[str, set[str]], group: set[str]) -> str:
    cycle = _cycle_in(graph, group)
    rest = sorted(group - set(cycle))
    return " -> ".join(cycle) + (f" (the same cycle group: {', '.join(rest)})" if rest else "")


def _cycle_in(graph: dict[str, set[str]], group: set[str]) -> list[str]:
    """One cycle inside a strongly connected group, starting at its first module: a shortest way back."""
    start = min(group)
    paths = {start: [start]}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(graph[v] & group):
                if w == start:
                    return paths[v] + [start]
                if w not in paths:
                    paths[w] = paths[v] + [w]
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"{sorted(group)} is not strongly connected")


def kernel_imports(graph: dict[str, set[str]]) -> set[tuple[str, str]]:
    """(kernel module, upper-layer module) for every import of the attention, engine or models layer by a kernel."""
    return {(m, t) for m, ts in graph.items() if m.startswith("batchinfer.kernels") for t in ts if t.startswith(UPPER_LAYERS)}


@pytest.fixture(scope="module")
def graph() -> dict[str, set[str]]:
    return import_graph(ROOT, "batchinfer")


def test_no_import_cycle(graph):
    found = cycle_groups(graph)
    assert not found, "import cycles in batchinfer/:\n  " + "\n  ".join(describe(graph, g) for g in found)


def test_kernels_import_no_upper_layer(graph):
    found = sorted(kernel_imports(graph))
    assert not found, "kernels importing attention/engine/models:\n  " + "\n  ".join(f"{m} -> {t}" for m, t in found)


def test_job_executors_never_import_the_driver(graph):
    executors = [m for m in graph if m.startswith("batchinfer.job.executors")]
    assert executors and not [m for m in executors if "batchinfer.job.driver" in graph[m]]


def test_the_walker_finds_relative_function_local_and_type_only_cycles(tmp_path):
    """The walker on a small package: it must see each kind of import, or the tests above prove nothing."""
    pkg = tmp_path / "pkg"
    (pkg / "sub").mkdir(parents=True)
    files = {
        "__init__.py": "",
        "a.py": "def f():\n    from . import b\n",  # function-local, relative
        "b.py": "from pkg.sub import c\n",  # `from package import module`
        "sub/__init__.py": "",
        "sub/c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from ..a import f\n",  # type-only, level 2
        "d.py": "import pkg.sub.c\nimport os\n",  # absolute; no way back to d: no cycle
    }
    for name, text in files.items():
        (pkg / name).write_text(text)
    g = import_graph(tmp_path, "pkg")
    assert g["pkg.a"] == {"pkg.b"} and g["pkg.b"] == {"pkg.sub.c"} and g["pkg.sub.c"] == {"pkg.a"}
    assert g["pkg.d"] == {"pkg.sub.c"} and g["pkg"] == set()
    assert cycles(g) == [["pkg.a", "pkg.b", "pkg.sub.c", "pkg.a"]]
    (pkg / "sub" / "c.py").write_text("")
    assert cycles(import_graph(tmp_path, "pkg")) == []
