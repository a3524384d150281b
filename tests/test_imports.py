"""Dependencies in infra/ and twin/ run one way: no module imports, however indirectly, a module
that imports it. The spec and the pure checks are at the bottom, the programs above them, the
offline runner above the programs.

Every import statement counts, wherever it stands: at module level, inside a function (a lazy
import deferred for start-up time, or one deferred only so that a circle does not fail at import
time) and under `if TYPE_CHECKING:` (the names' module is still one this module builds on). A
deferred import hides a circle from Python, not from the design; what breaks one is moving the code.

Which module an import names follows Python's import system (the Python Language Reference,
"The import system", 5.7 Package Relative Imports; `from package import name` binds a submodule
when `name` is one): `from a.b import c` depends on `a.b.c` when a/b/c.py or a/b/c/ exists, else
on `a.b`; a relative import is resolved against the importing module's package. The parent
packages an import also runs (`a`, `a.b`) are not counted: a package's `__init__` that re-exports
its submodules would otherwise make every submodule that names the package a circle.
"""

from __future__ import annotations

import ast
from pathlib import Path

from infra.spec import REPO_ROOT

ROOTS = ("infra", "twin")


def module_files(repo: Path, roots: tuple[str, ...] = ROOTS) -> dict[str, Path]:
    """Every Python module under `roots`, by dotted name (a package by its `__init__`)."""
    out = {}
    for root in roots:
        for path in sorted((repo / root).rglob("*.py")):
            parts = path.relative_to(repo).with_suffix("").parts
            if parts[-1] == "__init__":
                parts = parts[:-1]
            out[".".join(parts)] = path
    return out


def imported_modules(name: str, path: Path, known: set[str]) -> set[str]:
    """The modules of `known` that `name` (at `path`) imports, by any import statement in it."""
    package = name if path.name == "__init__.py" else name.rpartition(".")[0]
    out = set()
    for node in ast.walk(ast.parse(path.read_text(), filename=str(path))):
        if isinstance(node, ast.Import):
            targets = [alias.name for alias in node.names]
        elif isinstance(node, ast.ImportFrom):
            base = node.module or ""
            if node.level:
                anchor = package.split(".")[:len(package.split(".")) - (node.level - 1)]
                base = ".".join(anchor + ([base] if base else []))
            targets = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in known else base for alias in node.names]
        else:
            continue
        out.update(t for t in targets if t in known and t != name)
    return out


def import_graph(repo: Path = REPO_ROOT, roots: tuple[str, ...] = ROOTS) -> dict[str, set[str]]:
    files = module_files(repo, roots)
    return {name: imported_modules(name, path, set(files)) for name, path in files.items()}


def circles(graph: dict[str, set[str]]) -> list[list[str]]:
    """The strongly connected components of more than one module (Tarjan's algorithm), each
    sorted, with one circle through each written out: a -> b -> ... -> a."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    components: list[list[str]] = []

    def visit(start: str) -> None:  # iterative: a deep chain of imports must not hit the recursion limit
        work = [(start, iter(sorted(graph[start])))]
        index[start] = low[start] = len(index)
        stack.append(start)
        on_stack.add(start)
        while work:
            node, edges = work[-1]
            for nxt in edges:
                if nxt not in index:
                    index[nxt] = low[nxt] = len(index)
                    stack.append(nxt)
                    on_stack.add(nxt)
                    work.append((nxt, iter(sorted(graph[nxt]))))
                    break
                if nxt in on_stack:
                    low[node] = min(low[node], index[nxt])
            else:
                work.pop()
                if work:
                    low[work[-1][0]] = min(low[work[-1][0]], low[node])
                if low[node] == index[node]:
                    component = []
                    while True:
                        member = stack.pop()
                        on_stack.discard(member)
                        component.append(member)
                        if member == node:
                            break
                    if len(component) > 1:
                        components.append(sorted(component))

    for name in sorted(graph):
        if name not in index:
            visit(name)
    return sorted(components)


def one_circle(graph: dict[str, set[str]], component: list[str]) -> list[str]:
    """A shortest path from the component's first module back to itself, inside the component."""
    members, start = set(component), component[0]
    came_from: dict[str, str] = {}
    frontier = [start]
    while frontier:
        following = []
        for node in frontier:
            for nxt in sorted(graph[node] & members):
                if nxt == start:
                    path = [node]
                    while path[-1] != start:
                        path.append(came_from[path[-1]])
                    return path[::-1] + [start]
                if nxt not in came_from:
                    came_from[nxt] = node
                    following.append(nxt)
        frontier = following
    raise AssertionError(f"{component} is not strongly connected")


def test_no_import_circle_in_infra_or_twin():
    graph = import_graph()
    found = circles(graph)
    assert not found, "import circles (each: its modules, then one circle through them):\n" + "\n".join(
        f"- {len(c)} modules {', '.join(c)}\n  {' -> '.join(one_circle(graph, c))}" for c in found)


def test_the_graph_reads_every_kind_of_import(tmp_path):
    """The check itself: module-level, function-level, TYPE_CHECKING, relative and `from package
    import submodule` imports each make an edge, and a circle made only of lazy imports is found."""
    pkg = tmp_path / "infra" / "pkg"
    pkg.mkdir(parents=True)
    (tmp_path / "infra" / "__init__.py").write_text("")
    (pkg / "__init__.py").write_text("from .low import thing\n")
    (pkg / "low.py").write_text("def f():\n    from infra import top  # lazy\n    return top\nthing = 1\n")
    (pkg / "mid.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from infra.pkg import low\n")
    (tmp_path / "infra" / "top.py").write_text("from infra.pkg import mid\nimport infra.pkg.low as low\n")
    graph = import_graph(tmp_path, ("infra",))
    assert graph == {"infra": set(), "infra.pkg": {"infra.pkg.low"}, "infra.pkg.low": {"infra.top"},
                     "infra.pkg.mid": {"infra.pkg.low"}, "infra.top": {"infra.pkg.mid", "infra.pkg.low"}}
    assert circles(graph) == [["infra.pkg.low", "infra.pkg.mid", "infra.top"]]
    assert one_circle(graph, ["infra.pkg.low", "infra.pkg.mid", "infra.top"]) == ["infra.pkg.low", "infra.top", "infra.pkg.low"]
