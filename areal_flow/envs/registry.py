"""The environments a recipe can name by a word."""

from __future__ import annotations

from areal_flow.envs.base import Environment
from areal_flow.envs.code_feedback import CodeFeedback
from areal_flow.envs.python_tool import PythonTool

ENVS: dict[str, type[Environment]] = {
    "python_tool": PythonTool,
    "code_feedback": CodeFeedback,
}
