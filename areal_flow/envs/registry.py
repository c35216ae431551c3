"""The environments a recipe can name by a word, and the class a recipe's `env` names."""

from __future__ import annotations

from areal_flow.config.import_path import resolve_named
from areal_flow.envs.base import Environment
from areal_flow.envs.code_feedback import CodeFeedback
from areal_flow.envs.python_tool import PythonTool

ENVS: dict[str, type[Environment]] = {
    "python_tool": PythonTool,
    "code_feedback": CodeFeedback,
}


def resolve_env(name: str, where: str) -> type[Environment]:
    """The Environment class `name` names (one of ENVS, or 'package.module:Class'). ValueError
    naming `where` (the config key) when there is none."""
    cls = resolve_named(name, ENVS, where=where, unknown=lambda: (
        f"{where}: no environment {name!r}; built in: {', '.join(sorted(ENVS))}, or 'package.module:Class' of your own"))
    if not (isinstance(cls, type) and issubclass(cls, Environment)):
        raise ValueError(f"{where}: {name!r} is not a subclass of areal_flow.envs.base.Environment")
    return cls
