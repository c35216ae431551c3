"""Every file under a run directory is named once, in areal_flow/runtime/run_dir.py: no other module
spells one of its file names as a string literal (read with `ast`), so a reader of the run directory
and its writer cannot drift apart."""

from __future__ import annotations

import ast
import os
from pathlib import Path

from areal_flow.runtime import run_dir as rd

PACKAGE = Path(__file__).resolve().parents[2] / "areal_flow"

ELSEWHERE = {("launch.py", rd.CONFIG)}
"""Literals that name another directory's file of the same name: a recipe folder's config.yaml."""


def _file_names() -> set[str]:
    """run_dir's names that are files (a dot in their last part), per-rank patterns as written."""
    names = {v for k, v in vars(rd).items() if k.isupper() and isinstance(v, str)}
    return {n for n in names if "." in os.path.basename(n)}


def test_run_dir_names_are_distinct_and_relative():
    names = [v for k, v in vars(rd).items() if k.isupper() and isinstance(v, str)]
    assert len(names) == len(set(names)), "two run_dir names spell the same file"
    assert not any(os.path.isabs(n) or n.startswith("..") for n in names)
    assert rd.of_rank(rd.TRAINED, 3) == "trained-rank3.jsonl"
    assert rd.log_of("trainer0") == os.path.join("logs", "trainer0.log")


def test_no_module_spells_a_run_directory_file_name():
    names = _file_names()
    assert {"metrics.jsonl", "spec.json", "servers.json", "manifest.json"} <= names
    found = []
    for path in sorted(PACKAGE.rglob("*.py")):
        rel = path.relative_to(PACKAGE).as_posix()
        if rel == "runtime/run_dir.py":
            continue
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Constant) and node.value in names and (rel, node.value) not in ELSEWHERE:
                found.append(f"areal_flow/{rel}:{node.lineno}: {node.value!r}")
    assert not found, "name these through areal_flow.runtime.run_dir:\n" + "\n".join(found)
