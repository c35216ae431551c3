"""Multi-turn trajectories in flight, kept by a checkpoint and continued by the resumed run
(rollout/live.py has the whole story).

Saving a checkpoint, the controller asks each rollout worker for its trajectories in flight
(`KeepLive`) and waits a short while for the answers (`Live`); a worker that does not answer in
time keeps nothing (its groups are generated again from their prompts, as before). A resumed run
admits each group that had kept trajectories again at the version it was first admitted at, with
them; the ledger's `admit` says how many tokens it kept (`kept_tokens`).
"""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Awaitable, Callable

from areal_flow.transport.messages import KeepLive, KeptTrajectory, Live, Message

log = logging.getLogger("areal_flow.controller")

ANSWER_TIMEOUT = 5.0
"""Seconds the checkpoint waits for the rollout workers' trajectories in flight."""


class KeptTrajectories:
    """The trajectories in flight of the rollout workers (`collect`, as a checkpoint is saved), and
    those a resumed run has yet to admit again (`pending`: group id -> (admission version, kept))."""

    def __init__(self, send: Callable[[bytes, Message], Awaitable[None]],
                 pending: dict[int, tuple[int, list[KeptTrajectory]]] | None = None):
        self.send, self.pending = send, dict(pending or {})
        self.request = 0
        self.waiting: set[bytes] = set()
        self.got: dict[int, list[KeptTrajectory]] = {}
        self.answered = asyncio.Event()

    async def collect(self, workers: list[bytes], timeout: float = ANSWER_TIMEOUT) -> dict[int, list[KeptTrajectory]]:
        """Every worker's trajectories in flight now, by group, with those still to admit again."""
        self.request += 1
        self.waiting, self.got = set(workers), {}
        self.answered.clear()
        for worker in workers:
            await self.send(worker, KeepLive(self.request))
        if workers:
            try:
                await asyncio.wait_for(self.answered.wait(), timeout)
            except asyncio.TimeoutError:
                log.warning("controller: %d rollout worker(s) did not say their trajectories in flight within %g s: "
                            "a resume generates theirs again from their prompts", len(self.waiting), timeout)
        return {**self.got, **{g: kept for g, (_, kept) in self.pending.items()}}

    def reply(self, ident: bytes, msg: Live) -> None:
        """A rollout worker's answer (a late one, to an earlier request, is dropped)."""
        if msg.request != self.request or ident not in self.waiting:
            return
        self.got.update(msg.groups)
        self.waiting.discard(ident)
        if not self.waiting:
            self.answered.set()

    def take(self, group_id: int) -> tuple[int, list[KeptTrajectory]] | None:
        """A resumed run's group being admitted again: its admission version and kept trajectories."""
        return self.pending.pop(group_id, None)
