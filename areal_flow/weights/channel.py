"""The contract of a weight channel: how each new policy version travels from the trainer ranks to
the generation servers. One channel per medium (files.py: disk and shared memory; broadcast.py:
a gloo/NCCL group; ipc.py: CUDA IPC handles), chosen once from `rollout.weight_update_mode`
(`make_channel`); update.py holds the one sequence every update follows (pause, deliver, continue).

A channel has two ends, used by two processes:
- the trainer ranks' (`after_step`, `send`): every rank calls them together, since gathering the
  weights is a collective under FSDP and megatron; rank 0 writes or sends;
- the controller's (`deliver`, `reload`): between the servers' pause and their continue.
"""

from __future__ import annotations

from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from areal_flow.generation.client.generation_client import GenerationClient
    from areal_flow.generation.client.router import Server, ServerPool
    from areal_flow.training.engine import Engine
    from areal_flow.transport.messages import PublishWeights, WeightsPublished


@dataclass(frozen=True)
class UpdateFlags:
    """What a delivery tells each server beside the weights."""

    abort_all_requests: bool = False  # pause mode abort: running requests come back with their tokens so far
    keep_cache: bool = False  # requests held in place keep their KV cache: the server must not flush it


SendByTrainers = Callable[[int, UpdateFlags], Awaitable[None]]
"""The controller's way to have every trainer rank send `version` (a PublishWeights to each, their
WeightsPublished back); raises WeightUpdateError with rank 0's account of a failure."""


class WeightChannel:
    """One medium. Subclasses set `name` (the rollout.weight_update_mode value) and the two flags,
    and implement their ends."""

    name: ClassVar[str]
    sent_by_trainers: ClassVar[bool]
    """The trainer ranks send each version when the controller asks, once the servers are paused
    (else the step writes it and the servers fetch it)."""
    every_server: ClassVar[bool]
    """One delivery involves every server together (a process group): none may be left out."""

    @property
    def overlaps_training(self) -> bool:
        """Whether the next step may train while the servers load: not when the trainer ranks are
        the ones sending."""
        return not self.sent_by_trainers

    # ---- the trainer ranks' end ----------------------------------------------------------------

    def after_step(self, engine: Engine, version: int, rank: int) -> str:
        """Called by every rank once a step has trained `version`: where the servers will find it
        ("" when it is sent later)."""
        return ""

    def send(self, engine: Engine, msg: PublishWeights, rank: int) -> WeightsPublished:
        """Called by every rank when the controller asks for `msg.version` (sent_by_trainers)."""
        raise NotImplementedError(f"rollout.weight_update_mode={self.name}: the servers fetch the weights")

    # ---- the controller's end --------------------------------------------------------------------

    async def deliver(self, pool: ServerPool, servers: list[Server], location: str, version: int,
                      flags: UpdateFlags, trainers: SendByTrainers) -> list[str]:
        """Get `version` onto the paused `servers`; returns the refusals, each naming its server."""
        raise NotImplementedError

    def reload(self, location: str, version: int) -> Callable[[GenerationClient], Awaitable[Any]] | None:
        """How a server that comes back after missing `version` gets it, or None when there is no
        copy to load (it then stays out until the next update)."""
        return None

    def source(self, location: str) -> str:
        """Where a version comes from, for messages: 'from PATH', 'by broadcast', ..."""
        return f"by rollout.weight_update_mode={self.name}"

    def describe(self) -> str:
        return f"rollout.weight_update_mode={self.name}"
