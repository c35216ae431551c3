"""Where staleness is enforced (DESIGN §4.1): admission of prompt groups and the firing of batches.

Counts are in prompt groups. With B groups per train step and the generation servers serving
policy version v, a group is admitted only while

    accepted + running < (η + v + 1) · B   and   running < max_concurrent.

Admission alone does not bound the staleness of a group that runs long: training could move on
while it generates. So a batch for step s also waits until every group admitted at version
≤ s − η has finished; there are at most B of them and they are the oldest, so the oldest-first
batch contains them, and every trained token satisfies s − v_token ≤ η. With η = 0 this is the
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
    accepted: int = 0  # groups finished (trained or waiting in the buffer)
    running: dict[int, int] = field(default_factory=dict)  # group id -> version at admission

    def can_admit(self) -> bool:
        limit = (self.max_staleness + self.version + 1) * self.batch_size
        return self.accepted + len(self.running) < limit and len(self.running) < self.max_concurrent

    def admit(self, group_id: int) -> int:
        """Record an admitted group; returns the version it was admitted at."""
        if not self.can_admit():
            raise RuntimeError("admit() called while admission is closed")
        if group_id in self.running:
            raise ValueError(f"group {group_id} admitted twice")
        self.running[group_id] = self.version
        return self.version

    def finish(self, group_id: int) -> None:
        """A group came back complete (all its samples scored)."""
        if group_id not in self.running:
            raise KeyError(f"group {group_id} finished but was not running")
        del self.running[group_id]
        self.accepted += 1

    def batch_may_fire(self, step: int) -> bool:
        """False while a group that step `step` must include (admitted at ≤ step − η) still runs."""
        return all(v > step - self.max_staleness for v in self.running.values())

    def set_version(self, version: int) -> None:
        if version < self.version:
            raise ValueError(f"policy version went back from {self.version} to {version}")
        self.version = version
