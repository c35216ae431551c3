"""Finished groups waiting for a batch node, taken oldest first, each exactly once."""

from __future__ import annotations

from areal_flow.transport.messages import Sample


class GroupBuffer:
    def __init__(self) -> None:
        self._groups: dict[int, list[Sample]] = {}
        self.taken: set[int] = set()

    def __len__(self) -> int:
        return len(self._groups)

    def add(self, group_id: int, samples: list[Sample]) -> None:
        if group_id in self._groups or group_id in self.taken:
            raise ValueError(f"group {group_id} arrived twice")
        self._groups[group_id] = samples

    def take_oldest(self, n: int) -> list[list[Sample]]:
        """The n groups with the earliest birth time (admission time), removed from the buffer."""
        if n > len(self._groups):
            raise ValueError(f"asked for {n} groups, only {len(self._groups)} are ready")
        oldest = sorted(self._groups, key=lambda g: (self._groups[g][0].birth_time, g))[:n]
        self.taken.update(oldest)
        return [self._groups.pop(g) for g in oldest]

    def group_ids(self) -> list[int]:
        return list(self._groups)
