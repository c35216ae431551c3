"""Stops a run whose rollouts fail, rather than let it drop groups until step_timeout (docs/agents.md,
"When rollouts fail").

A group the rollout worker could not generate comes back dropped by name (GroupMeta.problem): an
agent whose every run of a rollout failed (agents/runner.py), an environment that raised in one of
its trajectories (rollout/turns.py). Each scored group is observed here (`observe`), and the step
loop asks before each batch whether the run must stop (`stopped`):

- `FailedGroups`: groups dropped so in a row, none scored between them. An agent that fails every
  rollout (one that forgets its `return`) dropped 6,554 groups in 171 s without a line; after
  rollout.failed_groups_stall in a row the run stops, naming the last failure (the agent, its
  error) and the key, as dynamic filtering's stall does (intake.py: FilterStreak).
- `EnvErrors`: the trajectories whose environment raised (their env/error scalar), counted in the
  step rows (env/errors, env/error_share of the trajectories scored since the step before); past
  graph.<node>.env_error_share of the last ERROR_WINDOW trajectories the run stops, naming the
  environment, its last error and the key.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass, field
from typing import Any

from areal_flow.rollout.turns import ENV_ERROR
from areal_flow.transport.messages import GroupMeta

ERROR_WINDOW = 200
"""The trajectories over which an environment's share of errors is judged: the last ones scored."""


@dataclass
class FailedGroups:
    """Groups dropped as failed in a row, none scored between them."""

    limit: int  # rollout.failed_groups_stall; 0 = never stop
    count: int = 0
    last: str = ""  # the last failure, as the rollout worker named it

    def observe(self, problem: str | None) -> None:
        self.count, self.last = (self.count + 1, problem) if problem else (0, self.last)

    def stopped(self) -> str | None:
        if not self.limit or self.count < self.limit:
            return None
        return (f"the run trains nothing: the last {self.count} prompt groups failed in a row, none scored between "
                f"them (rollout.failed_groups_stall={self.limit}); the last: {self.last}")


@dataclass
class EnvErrors:
    """The trajectories whose environment raised: counted per step, and judged over a window."""

    env: str  # graph.<node>.env, as the recipe names it
    key: str  # the key of the share: graph.<node>.env_error_share
    share: float
    recent: deque = field(default_factory=lambda: deque(maxlen=ERROR_WINDOW))  # per trajectory: raised?
    errors: int = 0  # since the last step row
    trajectories: int = 0  # since the last step row
    last: str = ""  # the last group dropped for them, as the rollout worker named it

    def observe(self, meta: GroupMeta, problem: str | None) -> None:
        raised = [s.scalars.get(ENV_ERROR, 0.0) > 0 for s in meta.samples]
        self.recent.extend(raised)
        self.errors += sum(raised)
        self.trajectories += len(raised)
        if any(raised) and problem:
            self.last = problem

    def stopped(self) -> str | None:
        n = sum(self.recent)
        if n <= self.share * ERROR_WINDOW:
            return None
        return (f"environment {self.env} raised in {n} of the last {len(self.recent)} trajectories, more than "
                f"{self.key}={self.share:g} of {ERROR_WINDOW}; the last: {self.last}")

    def step_figures(self) -> dict[str, float]:
        """env/errors and env/error_share since the last step row; the count starts again."""
        figures = {"env/errors": self.errors, "env/error_share": self.errors / max(self.trajectories, 1)}
        self.errors = self.trajectories = 0
        return figures


@dataclass
class RolloutFailures:
    """Both watches of a run: failed groups in a row, and an environment's errors where it has one."""

    groups: FailedGroups
    env: EnvErrors | None = None

    @classmethod
    def of(cls, failed_groups_stall: int, node: Any) -> "RolloutFailures":
        """The watches for the policy's generate node `node` (an environment's where it names one)."""
        env = EnvErrors(node.env, f"graph.{node.name}.env_error_share", node.env_error_share) if node.env else None
        return cls(FailedGroups(failed_groups_stall), env)

    def observe(self, meta: GroupMeta, problem: str | None) -> None:
        """A scored group: dropped for `problem`, or (None) trainable, filtered or kept."""
        self.groups.observe(problem)
        if self.env is not None:
            self.env.observe(meta, problem)

    def stopped(self) -> str | None:
        """The one line the run stops with, or None while it goes on."""
        return (self.env.stopped() if self.env is not None else None) or self.groups.stopped()

    def step_figures(self) -> dict[str, float]:
        return self.env.step_figures() if self.env is not None else {}
