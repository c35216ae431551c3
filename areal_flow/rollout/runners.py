"""How the policy's generate node runs a sample: an environment's turns (turns.py), an agent's
calls (agents/runner.py), or one `/generate` request (requests.py) when it names neither."""

from __future__ import annotations

from typing import Any

from areal_flow.agents.runner import AgentRunner
from areal_flow.rollout.turns import Turns


def runner_of(node: Any, cfg: Any, model_path: str) -> Turns | AgentRunner | None:
    """The generate node's runner of turns or agent rollouts, or None (one turn a sample)."""
    return Turns.of(node, cfg, model_path) or AgentRunner.of(node, model_path, cfg.generation.backend,
                                                             cfg.generation.tool_call_parser)
