"""Inside each package the modules import each other one way: no circle.

A circle inside a package is the package-level cycle of `test_package_layers.py` one floor down: two
modules that each need the other, so neither can be read, tested or moved alone, and whichever is
imported first sees the other half-made (hence the function-level imports that hide most of them).
Read from the source as the layering test reads it, with its helpers: every import a module runs, at
module level or inside a function, but not one under `if TYPE_CHECKING:`, which only annotates. Only
edges between modules of the same package count (a package's `__init__.py` is one of its modules);
`from package import module` depends on that module. A circle is reported with its modules and the
import line that makes each edge, so the import to move is named.
"""

from __future__ import annotations

import ast
import textwrap
from collections import defaultdict
from pathlib import Path

from test_package_layers import PACKAGE, Edges, _imported, _runtime_imports, cycles, describe

Module = tuple[str, ...]  # the path under the package root, without `.py`; a package's __init__ is the package's own


def _modules(root: Path) -> dict[Module, Path]:
    found = {}
    for path in sorted(root.rglob("*.py")):
        parts = path.relative_to(root).with_suffix("").parts
        found[parts[:-1] if parts[-1] == "__init__" else parts] = path
    return found


def _package(module: Module, path: Path) -> Module:
    """The package a module is one of: its folder (an `__init__.py` belongs to its own package)."""
    return module if path.name == "__init__.py" else module[:-1]


def _targets(node: ast.Import | ast.ImportFrom, parts: Module, modules: dict[Module, Path]) -> list[Module]:
    """The modules an import statement runs: `from a.b import c` names module a.b.c when there is one,
    else a.b (c is then one of a.b's names)."""
    named = _imported(node, parts)
    if isinstance(node, ast.ImportFrom) and len(named) == 1:
        return [(*named[0], a.name) if (*named[0], a.name) in modules else named[0] for a in node.names]
    return named


def module_edges(root: Path) -> Edges:
    """module -> module of the same package it imports -> 'file:line: the import line' for each import."""
    modules = _modules(root)
    edges: Edges = defaultdict(lambda: defaultdict(set))
    for module, path in modules.items():
        source = path.read_text(encoding="utf-8")
        lines = source.splitlines()
        rel = path.relative_to(root).with_suffix("").parts
        name = ".".join((root.name, *module))
        package = _package(module, path)
        for node in _runtime_imports(ast.parse(source, str(path)).body):
            for target in _targets(node, rel, modules):
                if target in modules and target != module and _package(target, modules[target]) == package:
                    where = f"{path.relative_to(root.parent).as_posix()}:{node.lineno}: {lines[node.lineno - 1].strip()}"
                    edges[name][".".join((root.name, *target))].add(where)
    return edges


def test_no_package_has_an_import_circle_among_its_modules():
    edges = module_edges(PACKAGE)
    assert "areal_flow.graph.dag" in edges["areal_flow.graph"]  # it read them, `from package import module` too
    found = cycles(edges)
    assert not found, "modules of one package import each other in a circle (move the import, or what both need, " \
        "down into a module of its own):\n" + \
        "\n\n".join(f"{', '.join(group)}; for one:\n{describe(c, edges)}" for group, c in found)


def test_a_circle_is_found_with_its_import_lines_and_annotations_make_none(tmp_path):
    """The checker itself, on a package written here (named areal_flow, as the layering test's
    helpers expect): a function-level import closes a circle, an import under TYPE_CHECKING does
    not, and a module of a subpackage never joins one."""
    root = tmp_path / "areal_flow"
    files = {
        "__init__.py": "",
        "a.py": "from areal_flow import b\n",
        "b.py": "def f():\n    from areal_flow.a import g\n",
        "c.py": "from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n    from areal_flow import a\n",
        "sub/__init__.py": "",
        "sub/d.py": "from areal_flow import a\n",
        "e.py": "from areal_flow.sub import d\n",
    }
    for name, text in files.items():
        (root / name).parent.mkdir(parents=True, exist_ok=True)
        (root / name).write_text(textwrap.dedent(text))
    edges = module_edges(root)
    assert cycles(edges) == [(["areal_flow.a", "areal_flow.b"], ["areal_flow.a", "areal_flow.b", "areal_flow.a"])]
    assert describe(["areal_flow.a", "areal_flow.b", "areal_flow.a"], edges) == \
        ("  areal_flow.a -> areal_flow.b: areal_flow/a.py:1: from areal_flow import b\n"
         "  areal_flow.b -> areal_flow.a: areal_flow/b.py:2: from areal_flow.a import g")
    assert not edges["areal_flow.c"] and not edges["areal_flow.e"] and not edges["areal_flow.sub.d"]
