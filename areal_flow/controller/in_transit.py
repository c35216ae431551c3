"""Scored groups on their way to a trainer rank, until a step trains them.

The controller routes a scored group by telling the reward worker that holds it which rank takes it
(`Route`). A reward worker can die between the route and its send: the group never reaches the
rank, which then waits for it until step_timeout (the run hung so once, with its reward worker
killed a second after it scored four groups). So the rollout worker that generated a group keeps
its copy until a step has trained the group, not only until it is routed; a restarted reward worker
has the rollout workers send their copies again (`Resend`), and a copy of a group in transit is
routed again to the same rank. A rank that already holds it drops the second copy, as it drops any
group that arrives twice (training/worker.py).
"""

from __future__ import annotations

import logging
from dataclasses import dataclass, field

from areal_flow.transport.messages import DROP

log = logging.getLogger("areal_flow.controller")


@dataclass
class InTransit:
    """Group id -> (the trainer rank it was routed to, the rollout worker keeping its copy)."""

    routes: dict[int, tuple[int, bytes]] = field(default_factory=dict)

    def routed(self, group_id: int, rank: int, owner: bytes) -> None:
        self.routes[group_id] = (rank, owner)

    def again(self, group_id: int) -> int:
        """Where a copy of a group no longer running goes: the rank it was routed to while it is in
        transit, else nowhere (DROP: it was trained, or dropped, already)."""
        if (route := self.routes.get(group_id)) is None:
            log.error("controller: group %d is not running (a duplicate?), dropped", group_id)
            return DROP
        log.warning("controller: group %d scored again after a reward worker restarted: routed to trainer rank %d "
                    "again (a rank holding it drops the copy)", group_id, route[0])
        return route[0]

    def trained(self, group_ids) -> dict[bytes, list[int]]:
        """The groups a step trained leave transit: rollout worker -> the copies it may let go."""
        released: dict[bytes, list[int]] = {}
        for g in sorted(group_ids):
            if (route := self.routes.pop(g, None)) is not None:
                released.setdefault(route[1], []).append(g)
        return released

    def all_held(self) -> dict[bytes, list[int]]:
        """Every group leaves transit (a trainer resize's checkpoint holds each one it routed)."""
        return self.trained(list(self.routes))
