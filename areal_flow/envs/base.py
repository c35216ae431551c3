"""The environment interface: what a multi-turn rollout talks to between the policy's turns.

An environment is made for one trajectory from its dataset row and the recipe's settings. The
rollout worker generates a policy turn until one of the environment's `stop` strings, EOS or the
length budget, then passes the turn's text to `step`, which answers with an observation (text the
worker tokenizes alone and appends, loss mask 0), an optional reward and whether the trajectory is
done. A recipe names an environment as it names a reward function: a name of `ENVS`
(`graph.generate.env: python_tool`) or 'package.module:Class' (`registry.py: resolve_env`).

An environment never raises for anything the policy wrote: a tool that fails is an observation
that says so. What it raises all the same (a bug) ends that trajectory only, and drops its group,
counted (rollout/turns.py; docs/agents.md, "When rollouts fail"). It may be slow (a tool runs in
the sandbox): `step` is a coroutine, and a worker runs many trajectories at once.
"""

from __future__ import annotations

import abc
import dataclasses
from typing import Any



@dataclasses.dataclass(frozen=True)
class Step:
    """An environment's answer to one policy turn."""

    observation: str = ""  # text to append after the turn ("" = none); the policy is trained on none of it
    reward: float | None = None  # a reward for this turn, where the environment gives one
    done: bool = False  # the trajectory ends here
    figures: dict[str, float] = dataclasses.field(default_factory=dict)  # per-turn counts: tool_calls, tool_errors, ...


class Environment(abc.ABC):
    """One trajectory's environment. Subclasses set `stop` and implement `step`; `close` frees what
    the trajectory held."""

    stop: tuple[str, ...] = ()  # strings that end a policy turn (a tool call's closing tag)
    figures: tuple[str, ...] = ()  # the Step.figures it reports: a trajectory that never reports one counts 0

    def __init__(self, row: dict[str, Any], **settings: Any):
        self.row = row

    @abc.abstractmethod
    async def step(self, turn: str) -> Step:
        """The answer to the policy's turn `turn` (its text, the stop string included, special tokens such as EOS left out)."""

    async def close(self) -> None:
        """Called once the trajectory ends, whatever ended it."""

    def snapshot(self) -> dict[str, Any] | None:
        """What this environment must remember to go on after a resume (JSON values), taken at a
        turn's boundary (before `step` reads an answer, and once its observation is appended); None
        when it cannot say, the default: a resumed run then generates the trajectory again from its
        prompt (rollout/live.py)."""
        return None

    def restore(self, state: dict[str, Any]) -> None:
        """Go on from `state` (what `snapshot` gave), on an environment just made from the row and
        the settings."""

    def check(self) -> None:
        """Called once at launch on an environment made from the first training row: raise
        ValueError for what would fail every trajectory (a tool the machine cannot run), so the run
        fails at start."""
