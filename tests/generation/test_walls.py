"""The walls inside generation/: the engine knows nothing of HTTP or of clients, the client side
knows nothing of the engine or the server (a rollout worker imports it without torch), the HTTP
side serves the engine and knows nothing of clients; and no module of generation/ imports another
that imports it back, counting every import (under TYPE_CHECKING and inside functions too)."""

from __future__ import annotations

import ast
from pathlib import Path

GENERATION = Path(__file__).resolve().parents[2] / "areal_flow" / "generation"

FORBIDDEN = {
    "engine": ("areal_flow.generation.http", "areal_flow.generation.client"),
    "client": ("areal_flow.generation.engine", "areal_flow.generation.http", "torch"),
    "http": ("areal_flow.generation.client",),
}
"""Subpackage -> the modules (and their submodules) its modules may not import."""


def imports(path: Path) -> set[str]:
    """Every module an import statement of `path` names (for `from a import b`: a, and a.b)."""
    names = set()
    for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
        if isinstance(node, ast.Import):
            names.update(alias.name for alias in node.names)
        elif isinstance(node, ast.ImportFrom) and node.module and not node.level:
            names.add(node.module)
            names.update(f"{node.module}.{alias.name}" for alias in node.names)
    return names


def graph(root: Path) -> dict[str, set[str]]:
    """Module -> the other modules under `root` (a generation/ folder) it imports."""
    modules = {}
    for path in root.rglob("*.py"):
        parts = ("areal_flow", "generation", *path.relative_to(root).with_suffix("").parts)
        modules[".".join(parts[:-1] if parts[-1] == "__init__" else parts)] = path
    return {name: {m for m in imports(path) if m in modules and m != name and not name.startswith(m + ".")}
            for name, path in modules.items()}


def circles(edges: dict[str, set[str]]) -> list[str]:
    """Each circle once, as a path from its least module back to it."""
    found = []
    for start in sorted(edges):
        stack, seen = [(start, [start])], set()
        while stack:
            node, path = stack.pop()
            for nxt in sorted(edges[node]):
                if nxt == start:
                    found.append(" -> ".join([*path, start]))
                elif nxt > start and nxt not in seen:
                    seen.add(nxt)
                    stack.append((nxt, [*path, nxt]))
    return found


def breaches(root: Path) -> list[str]:
    return [f"{path.relative_to(root)} imports {name}"
            for package, prefixes in FORBIDDEN.items() for path in sorted((root / package).rglob("*.py"))
            for name in sorted(imports(path)) if any(name == p or name.startswith(p + ".") for p in prefixes)]


def test_each_subpackage_keeps_to_its_side():
    assert not breaches(GENERATION), "\n".join(breaches(GENERATION))


def test_no_two_modules_import_each_other_even_for_types_or_inside_functions():
    found = circles(graph(GENERATION))
    assert not found, "\n".join(found)


def test_the_checks_see_a_circle_through_a_type_import_and_a_client_that_imports_the_engine(tmp_path):
    (tmp_path / "client").mkdir()
    (tmp_path / "a.py").write_text("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                   "    from areal_flow.generation.b import B\n")
    (tmp_path / "b.py").write_text("def f():\n    from areal_flow.generation import a\n")
    (tmp_path / "client" / "c.py").write_text("import torch\nfrom areal_flow.generation.engine.sampler import Drawn\n")
    assert circles(graph(tmp_path)) == ["areal_flow.generation.a -> areal_flow.generation.b -> areal_flow.generation.a"]
    assert breaches(tmp_path) == ["client/c.py imports areal_flow.generation.engine.sampler",
                                  "client/c.py imports areal_flow.generation.engine.sampler.Drawn",
                                  "client/c.py imports torch"]
