"""Multi-turn trajectories in flight, kept across a resume (docs/reliability.md, "Turns in flight").

A trajectory of an environment's turns takes several requests; a run killed or stopped while it is
half done would, on resume, generate it again from its prompt and throw away the turns it had. So
the rollout worker keeps, for each trajectory in flight, its state at the last turn's boundary:
its tokens (each with its logprob, version and mask), the environment's `snapshot()`, the
environment's figures and rewards so far, and whether the last answer still waits for the
environment (a tool call running). When the controller saves a checkpoint it asks every rollout
worker for them (`KeepLive` / `Live`) and writes them beside the run state (`live.msgpack`); a
resumed run admits each such group again at the version it was first admitted at (its kept
tokens' versions are no older: the staleness bound holds), with its kept trajectories, and the
rollout worker continues each from its last token. The rest of the group, and every trajectory
whose environment cannot say its state (`snapshot()` returns None, the default; an agent's), is
generated again from the prompt, as before. A turn under way at the checkpoint is not kept: it is
generated again after the trajectory's last kept boundary.
"""

from __future__ import annotations

import dataclasses
import os
from collections.abc import Callable
from typing import Any

import msgspec

from areal_flow.transport.messages import KeptTrajectory
from areal_flow.transport.trajectory import Trajectory

FILE = "live.msgpack"
"""The kept trajectories in a checkpoint's folder: {group id: [KeptTrajectory]}."""

Keep = Callable[[Trajectory, Any, dict, list, bool], None]
"""Called at each turn's boundary: (trajectory, environment, figures, rewards, stepped)."""


def kept_of(index: int, trajectory: Trajectory, env: Any, figures: dict, rewards: list,
            stepped: bool) -> KeptTrajectory | None:
    """Sample `index`'s trajectory as a checkpoint keeps it, or None when its environment cannot
    say its state."""
    state = env.snapshot()
    if state is None:
        return None
    t = trajectory
    return KeptTrajectory(index=index, prompt_ids=list(t.prompt_ids), output_ids=list(t.output_ids),
                          loss_mask=list(t.loss_mask), logprobs=list(t.logprobs), versions=list(t.versions),
                          answer_starts=list(t.answer_starts), served=list(t.served), stepped=stepped,
                          env_state=state, figures=dict(figures), rewards=list(rewards))


def resumed(kept: KeptTrajectory) -> Trajectory:
    """The kept trajectory, to continue."""
    return Trajectory(list(kept.prompt_ids), list(kept.output_ids), list(kept.loss_mask), list(kept.logprobs),
                      list(kept.versions), list(kept.answer_starts), served=list(kept.served))


def tokens(kept: list[KeptTrajectory]) -> int:
    """The tokens past their prompts that kept trajectories hold (a ledger's `kept_tokens`)."""
    return sum(len(k.output_ids) for k in kept)


@dataclasses.dataclass
class LiveGroup:
    """A group's trajectories in flight: each sample's state at its last boundary (None: none yet,
    or its environment cannot say)."""

    kept: list[KeptTrajectory | None]

    def keeper(self, index: int) -> Keep:
        def keep(trajectory: Trajectory, env: Any, figures: dict, rewards: list, stepped: bool) -> None:
            self.kept[index] = kept_of(index, trajectory, env, figures, rewards, stepped)
        return keep

    def now(self) -> list[KeptTrajectory]:
        return [k for k in self.kept if k is not None]


def encode(groups: dict[int, list[KeptTrajectory]]) -> bytes:
    """What a checkpoint's FILE holds."""
    return msgspec.msgpack.encode(groups)


def load(folder: str) -> dict[int, list[KeptTrajectory]]:
    """A checkpoint's kept trajectories ({} for a checkpoint that has none: saved before they were kept)."""
    path = os.path.join(folder, FILE)
    if not os.path.exists(path):
        return {}
    with open(path, "rb") as f:
        return msgspec.msgpack.decode(f.read(), type=dict[int, list[KeptTrajectory]])
