"""Where staleness is enforced (docs/architecture.md, "Staleness"): admission of prompt groups and the choice of batches.

Counts are in prompt groups. With B groups per train step and the generation servers serving
policy version v, a group is admitted only while

    accepted + running < (η + v + 1) · B   and   running < max_concurrent.

Admission alone does not bound the staleness of a group that runs long: training could move on
while it generates, and newer groups that finished first would fill the batches. So a group
admitted at version v must be trained by step v + η, and a batch for step s is the B oldest
finished groups only if, after it, the groups due by step s + k (finished or still running)
fit in the k batches left before then, for every k. Otherwise the step waits for an older group
to finish. Every trained token then satisfies s − v_token ≤ η. With η = 0 this is the
synchronous loop: generate B groups, train on exactly those, update, repeat.
"""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class StalenessManager:
    batch_size: int
    max_staleness: int
    max_concurrent: int
    version: int = 0
    accepted: int = 0  # groups finished, trained or not
    running: dict[int, int] = field(default_factory=dict)  # group id -> version at admission
    finished: dict[int, int] = field(default_factory=dict)  # finished, not yet trained

    def can_admit(self) -> bool:
        limit = (self.max_staleness + self.version + 1) * self.batch_size
        return self.accepted + len(self.running) < limit and len(self.running) < self.max_concurrent

    def admit(self, group_id: int, version: int | None = None) -> int:
        """Record an admitted group; returns the version it was admitted at: now, or `version` (a
        resumed run's group that keeps trajectories generated since then: it stays due by
        version + η, which bounds its kept tokens' staleness too)."""
        if not self.can_admit():
            raise RuntimeError("admit() called while admission is closed")
        if group_id in self.running or group_id in self.finished:
            raise ValueError(f"group {group_id} admitted twice")
        self.running[group_id] = self.version if version is None else version
        return self.running[group_id]

    def finish(self, group_id: int) -> None:
        """A group came back complete (all its samples scored)."""
        if group_id not in self.running:
            raise KeyError(f"group {group_id} finished but was not running")
        self.finished[group_id] = self.running.pop(group_id)
        self.accepted += 1

    def abandon(self, group_id: int) -> None:
        """A running group came back unusable: it leaves the running set without being accepted."""
        del self.running[group_id]

    def pick_batch(self, step: int) -> list[int] | None:
        """The group ids step `step` trains (oldest first), or None while it must wait."""
        if len(self.finished) < self.batch_size:
            return None
        batch = sorted(self.finished, key=lambda g: (self.finished[g], g))[: self.batch_size]
        taken = set(batch)  # a set: the advisor's simulations call this with thousands of finished groups
        later = [v for g, v in self.finished.items() if g not in taken] + list(self.running.values())
        if later:
            for k in range(max(later) + self.max_staleness - step + 1):
                due = sum(v + self.max_staleness <= step + k for v in later)
                if due > k * self.batch_size:
                    return None
        return batch

    def trained(self, group_ids: list[int]) -> None:
        for g in group_ids:
            del self.finished[g]

    def set_version(self, version: int) -> None:
        if version < self.version:
            raise ValueError(f"policy version went back from {self.version} to {version}")
        self.version = version
