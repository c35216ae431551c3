"""Finished groups waiting for a batch node; each is taken exactly once."""

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

    def take(self, group_ids: list[int]) -> list[list[Sample]]:
        """Remove and return these groups; a group not in the buffer is an error."""
        missing = [g for g in group_ids if g not in self._groups]
        if missing:
            raise KeyError(f"groups {missing} are not in the buffer")
        self.taken.update(group_ids)
        return [self._groups.pop(g) for g in group_ids]
