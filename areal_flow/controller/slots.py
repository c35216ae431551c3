"""Rollout slots: how many more prompt groups each rollout worker can take, and which worker runs
each admitted group.

A worker offers its slots once (`AdmitRequest`). A slot is taken when a group is admitted to the
worker and freed when that group is scored or dropped, which the controller learns from the
group's metadata anyway: a worker never sends a message per group to ask for the next one, and
the controller wakes once per group less. Plain values, tested without sockets.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class RolloutSlots:
    free: dict[bytes, int] = field(default_factory=dict)  # worker socket identity -> free slots
    owner: dict[int, bytes] = field(default_factory=dict)  # admitted, not yet scored: group id -> worker

    def offer(self, worker: bytes, slots: int) -> None:
        if slots < 1:
            raise ValueError(f"rollout worker {worker.decode(errors='replace')} offered {slots} slots")
        self.free[worker] = self.free.get(worker, 0) + slots

    def __bool__(self) -> bool:
        """Whether any worker has a free slot."""
        return any(self.free.values())

    def take(self, group_id: int) -> bytes:
        """The worker that runs `group_id`: the one with the most free slots (the first to offer, on
        a tie), so that groups spread evenly over workers."""
        worker = max(self.free, key=self.free.__getitem__, default=None)
        if worker is None or not self.free[worker]:
            raise RuntimeError("no rollout worker has a free slot")
        if group_id in self.owner:
            raise ValueError(f"group {group_id} was given a slot twice")
        self.free[worker] -= 1
        self.owner[group_id] = worker
        return worker

    def release(self, group_id: int) -> bytes:
        """The group is scored or dropped: its worker's slot is free again. Returns the worker."""
        worker = self.owner.pop(group_id)
        self.free[worker] += 1
        return worker
