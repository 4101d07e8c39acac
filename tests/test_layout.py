"""The package's layout: no import cycles among specdec's modules, none among its subpackages, and
the backends depend on nothing above them.

Read from the source with ast, not by importing: every import counts, at module level or inside a
function (a lazy import hides a cycle without removing it) or under `if TYPE_CHECKING:` (the
dependency is there all the same). An import of a package is an edge to
its __init__. Importing a submodule also runs its parent packages' __init__ files; those implicit
edges are left out (each package's __init__ imports its own submodules, so counting them would make
every subpackage a cycle), but an explicit `from specdec.drafters import X` inside specdec.drafters'
own modules is a real cycle and counts."""

from __future__ import annotations

import ast
from collections import defaultdict, deque
from pathlib import Path

import specdec

ROOT = Path(specdec.__file__).parent
SUBPACKAGES = ("adaptive", "backends", "bench", "commands", "drafters", "models", "serve", "train")


def module_name(path: Path) -> str:
    parts = ("specdec", *path.relative_to(ROOT).with_suffix("").parts)
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


MODULES = {module_name(p): p for p in sorted(ROOT.rglob("*.py"))}


def is_package(name: str) -> bool:
    return MODULES[name].name == "__init__.py"


def imported(module: str, node: ast.Import | ast.ImportFrom) -> list[str]:
    """The specdec modules an import statement in `module` loads explicitly: `import p.m` and
    `from p.m import name`: p.m; `from p import m`: p.m where m is a module, else p (whose __init__
    defines the name). Parent packages run on the way are left out, as above."""
    if isinstance(node, ast.Import):
        names = [alias.name for alias in node.names]
    else:
        if node.level:  # relative: resolve against the importing module's package
            package = module if is_package(module) else module.rpartition(".")[0]
            for _ in range(node.level - 1):
                package = package.rpartition(".")[0]
            base = f"{package}.{node.module}" if node.module else package
        else:
            base = node.module or ""
        names = [f"{base}.{alias.name}" if f"{base}.{alias.name}" in MODULES else base for alias in node.names]
    out = []
    for name in names:
        if name.split(".")[0] != "specdec":
            continue
        while name not in MODULES:  # a module not written yet, or a name in one: its longest module prefix
            name = name.rpartition(".")[0]
        if name != module:
            out.append(name)
    return list(dict.fromkeys(out))


def import_graph() -> dict[str, dict[str, int]]:
    """{module: {imported module: line of the first such import}} over every specdec module."""
    graph: dict[str, dict[str, int]] = {}
    for module, path in MODULES.items():
        edges: dict[str, int] = {}
        for node in ast.walk(ast.parse(path.read_text(), str(path))):
            if isinstance(node, ast.Import | ast.ImportFrom):
                for target in imported(module, node):
                    edges.setdefault(target, node.lineno)
        graph[module] = edges
    return graph


def cycles(graph: dict[str, dict[str, int]]) -> list[list[str]]:
    """A shortest cycle through the first node of each strongly connected component that has a
    cycle (Tarjan's algorithm, then a breadth-first search inside the component); the other
    members of the component follow it after a "|"."""
    index, low, stack, on_stack, components = {}, {}, [], set(), []

    def connect(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in graph.get(v, {}):
            if w not in index:
                connect(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            component = set()
            while True:
                w = stack.pop()
                on_stack.discard(w)
                component.add(w)
                if w == v:
                    break
            if len(component) > 1 or v in graph.get(v, {}):
                components.append(component)

    for v in sorted(graph):
        if v not in index:
            connect(v)
    found = []
    for component in components:
        start = min(component)
        came_from, queue = {start: None}, deque([start])
        while queue:
            v = queue.popleft()
            if start in graph[v] and (v != start or start in graph[start]):
                path = [v]
                while came_from[path[-1]] is not None:
                    path.append(came_from[path[-1]])
                cycle = path[::-1] + [start]
                found.append(cycle + (["|", *sorted(component - set(cycle))] if component - set(cycle) else []))
                break
            for w in sorted(graph[v]):
                if w in component and w not in came_from:
                    came_from[w] = v
                    queue.append(w)
    return found


def describe(cycle: list[str], where) -> str:
    """A cycle as `a -> b -> a`, then the import that makes each step (where(a, b)), then the other
    modules caught in the same knot."""
    rest = cycle[cycle.index("|") + 1 :] if "|" in cycle else []
    cycle = cycle[: len(cycle) - len(rest) - (1 if rest else 0)]
    return (
        " -> ".join(cycle)
        + "".join(f"\n    {where(a, b)}" for a, b in zip(cycle, cycle[1:]))
        + (f"\n    (in the same knot: {', '.join(rest)})" if rest else "")
    )


def test_the_graph_sees_lazy_and_relative_imports_and_packages():
    src = "import os\nfrom specdec.drafters import make_drafter\n\ndef f():\n    from . import cache\n"
    src += "    from .models.load import Model\n"
    tree = ast.parse(src)
    found = [
        n
        for node in ast.walk(tree)
        if isinstance(node, ast.Import | ast.ImportFrom)
        for n in imported("specdec.engine", node)
    ]
    assert found == ["specdec.drafters", "specdec.cache", "specdec.models.load"]
    assert imported("specdec.drafters.model", ast.parse("from . import base, DRAFTERS").body[0]) == [
        "specdec.drafters.base",
        "specdec.drafters",
    ]
    assert imported("specdec.cli", ast.parse("import specdec.bench.run as r").body[0]) == ["specdec.bench.run"]
    assert imported("specdec.drafters", ast.parse("from .base import Drafter").body[0]) == ["specdec.drafters.base"]
    assert cycles({"a": {"b": 1}, "b": {"c": 1}, "c": {"a": 1, "d": 1}, "d": {}}) == [["a", "b", "c", "a"]]
    assert cycles({"a": {"b": 1}, "b": {"a": 1, "c": 1}, "c": {"b": 1}}) == [["a", "b", "a", "|", "c"]]
    assert cycles({"a": {"a": 1}}) == [["a", "a"]]
    assert cycles({"a": {"b": 1}, "b": {}}) == []


def test_no_import_cycles_among_modules():
    graph = import_graph()
    assert len(graph) > 40 and graph["specdec.engine"], "the graph should cover every module"
    found = cycles(graph)
    where = lambda a, b: f"{MODULES[a].relative_to(ROOT.parent)}:{graph[a][b]} imports {b}"  # noqa: E731
    assert not found, "import cycles:\n" + "\n".join(describe(c, where) for c in found)


def unit(module: str) -> str:
    """A module's place in the layout: its subpackage, or itself for a top-level module."""
    parts = module.split(".")
    if len(parts) == 1:
        return "specdec (__init__)"
    return parts[1]


def test_no_import_cycles_among_subpackages():
    graph = import_graph()
    units: dict[str, dict[str, int]] = defaultdict(dict)
    where: dict[tuple[str, str], str] = {}
    for module, edges in graph.items():
        for target, line in edges.items():
            a, b = unit(module), unit(target)
            if a != b:
                units[a].setdefault(b, line)
                where.setdefault((a, b), f"{MODULES[module].relative_to(ROOT.parent)}:{line} imports {target}")
        units.setdefault(unit(module), {})
    assert set(SUBPACKAGES) <= set(units)
    found = cycles(units)
    assert not found, "cycles between subpackages:\n" + "\n".join(describe(c, lambda a, b: where[a, b]) for c in found)


def test_backends_depend_on_nothing_above_them():
    graph = import_graph()
    above = {"bench", "train", "serve", "drafters"}
    bad = [
        f"{MODULES[m].relative_to(ROOT.parent)}:{line} imports {t}"
        for m, edges in graph.items()
        if unit(m) == "backends"
        for t, line in edges.items()
        if unit(t) in above
    ]
    assert not bad, "specdec.backends imports from above it:\n" + "\n".join(bad)
