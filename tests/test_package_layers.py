"""Dependencies between areal_flow's packages point one way: no cycle, config at the bottom.

The package graph is read from the source with `ast`: every import a module runs (at module level
and inside functions, since a lazy import is still a dependency), but not those under
`if TYPE_CHECKING:`, which only annotate. A cycle is reported with the packages in it and the files
whose imports make each edge, so the import to move is named. Layers, roughly: config <- algorithms,
runtime <- transport, models <- graph <- rewards, generation, weights <- training <- launchers <- run
<- launch.py.
"""

from __future__ import annotations

import ast
import functools
import subprocess
import sys
from collections import defaultdict
from pathlib import Path

import pytest

PACKAGE = Path(__file__).resolve().parents[1] / "areal_flow"

Edges = dict[str, dict[str, set[str]]]  # package -> imported package -> the files whose imports make the edge


def _is_type_checking(test: ast.expr) -> bool:
    return (isinstance(test, ast.Name) and test.id == "TYPE_CHECKING") or \
        (isinstance(test, ast.Attribute) and test.attr == "TYPE_CHECKING")


@functools.cache
def _unit(parts: tuple[str, ...]) -> str | None:
    """The package (or top-level module, e.g. `launch`) that `areal_flow.<parts>` belongs to."""
    if not parts:
        return None
    return parts[0] if (PACKAGE / parts[0]).is_dir() or (PACKAGE / f"{parts[0]}.py").is_file() else None


def _runtime_imports(statements: list[ast.stmt]):
    """The import statements that run, at any depth of functions, classes and blocks (imports are
    statements: expressions are not searched), leaving out `if TYPE_CHECKING:` bodies."""
    for node in statements:
        if isinstance(node, (ast.Import, ast.ImportFrom)):
            yield node
        elif isinstance(node, ast.If) and _is_type_checking(node.test):
            yield from _runtime_imports(node.orelse)
        else:
            for block in ("body", "orelse", "finalbody", "handlers", "cases"):
                yield from _runtime_imports(getattr(node, block, []))


def _imported(node: ast.Import | ast.ImportFrom, module: tuple[str, ...]) -> list[tuple[str, ...]]:
    """The areal_flow modules (paths under areal_flow) an import statement in `module` names."""
    if isinstance(node, ast.Import):
        return [tuple(a.name.split(".")[1:]) for a in node.names if a.name.split(".")[0] == "areal_flow"]
    if node.level:  # relative: from the module's own package, up `level - 1` more
        package = module[:-1]
        parts = (*package[:len(package) - (node.level - 1)], *(node.module.split(".") if node.module else ()))
    elif node.module and node.module.split(".")[0] == "areal_flow":
        parts = tuple(node.module.split(".")[1:])
    else:
        return []
    return [parts] if parts else [(a.name,) for a in node.names]  # from areal_flow import graph


@functools.cache  # both tests read it: parsed once
def package_edges() -> Edges:
    edges: Edges = defaultdict(lambda: defaultdict(set))
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).with_suffix("")
        src = rel.parts[0] if len(rel.parts) > 1 else rel.stem  # a top-level module is a unit of its own
        edges[src]  # listed even when it imports no other package
        for node in _runtime_imports(ast.parse(path.read_text(encoding="utf-8"), str(path)).body):
            for parts in _imported(node, rel.parts):
                if (dst := _unit(parts)) not in (None, src):
                    edges[src][dst].add(path.relative_to(PACKAGE.parent).as_posix())
    return edges


def cycles(edges: Edges) -> list[tuple[list[str], list[str]]]:
    """Each group of packages that import each other (Tarjan's strongly connected components of
    more than one package), sorted, with one shortest cycle through it as [a, b, ..., a]."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    groups: list[set[str]] = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        for w in edges.get(v, {}):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            group = set()
            while (w := stack.pop()) != v:
                group.add(w)
            groups.append(group | {v})

    for v in sorted(edges):
        if v not in index:
            visit(v)
    return [(sorted(g), _shortest_cycle(sorted(g)[0], g, edges)) for g in groups if len(g) > 1]


def _shortest_cycle(start: str, group: set[str], edges: Edges) -> list[str]:
    """Breadth first from `start` back to it, inside `group`."""
    back: dict[str, str] = {}
    frontier = [start]
    while frontier:
        nxt = []
        for v in frontier:
            for w in sorted(edges.get(v, {})):
                if w == start:
                    path = [v]
                    while path[-1] != start:
                        path.append(back[path[-1]])
                    return [start, *reversed(path[:-1]), start]
                if w in group and w not in back:
                    back[w] = v
                    nxt.append(w)
        frontier = nxt
    raise AssertionError(f"no cycle through {start} in {sorted(group)}")


def describe(cycle: list[str], edges: Edges) -> str:
    return "\n".join(f"  {a} -> {b}: {', '.join(sorted(edges[a][b]))}" for a, b in zip(cycle, cycle[1:]))


def test_the_packages_import_each_other_in_no_cycle():
    edges = package_edges()
    assert {"config", "graph", "training", "launchers", "run", "launch"} <= set(edges)  # it read them
    found = cycles(edges)
    assert not found, "areal_flow's packages import each other in a cycle (move the import that points up):\n" + \
        "\n\n".join(f"{', '.join(group)}; for one:\n{describe(c, edges)}" for group, c in found)


def test_config_is_the_lowest_layer_and_run_the_highest_package():
    edges = package_edges()
    assert not edges.get("config"), "config/ imports no other package of areal_flow:\n" + \
        "\n".join(f"  config -> {b}: {', '.join(sorted(files))}" for b, files in edges["config"].items())
    importers = {a: sorted(e["run"]) for a, e in edges.items() if "run" in e}
    assert set(importers) == {"launch"}, f"only launch.py composes the steps of a run/: {importers}"


def test_a_cycle_is_found_and_named_with_its_files():
    """The checker itself: a back edge among otherwise layered packages makes one cycle, reported
    with the file that makes each edge."""
    edges: Edges = defaultdict(lambda: defaultdict(set))
    for a, b, f in (("graph", "config", "g.py"), ("training", "graph", "t.py"), ("graph", "training", "dag.py"),
                    ("run", "training", "r.py")):
        edges[a][b].add(f)
    assert cycles(edges) == [(["graph", "training"], ["graph", "training", "graph"])]
    assert describe(["graph", "training", "graph"], edges) == "  graph -> training: dag.py\n  training -> graph: t.py"
    del edges["graph"]["training"]
    assert cycles(edges) == []


@pytest.mark.slow  # a fresh interpreter: 1-2 s
def test_the_rollout_worker_the_controller_and_the_reward_workers_start_without_torch():
    # Each is a process of every run (several of them in a test's run): torch costs each ~3 s of
    # start-up on 2 cores, which the end-to-end tests pay many times over.
    code = ("import sys, areal_flow.rollout.worker, areal_flow.controller.main, areal_flow.rewards.worker; "
            "print(sorted(m for m in ('torch', 'transformers', 'openai') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]", out.stdout
