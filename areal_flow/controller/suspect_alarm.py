"""A run-time warning when the policy starts to game its reward (docs/rewards.md, "Suspect samples").

The reward functions flag a sample whose answer did what no honest one does: a program that
tampered with its checks, exited under them or returned what is not plain data, a math answer that
hedged. Each step logs the share of its samples so flagged as `reward/suspect`, so that reward
hacking shows as a rising line; the first step past `metrics.suspect_warn` says so once, on the
console (the launcher prints `warning` rows) and in the metrics.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class SuspectAlarm:
    """Watches each step row's reward/suspect."""

    threshold: float  # warn above this share of a step's samples; 0 = never
    raised: bool = False

    def observe(self, row: dict) -> str | None:
        """The warning's message the first time a step's suspect share passes the threshold, else None."""
        share = row.get("reward/suspect")
        if self.raised or self.threshold <= 0 or share is None or share <= self.threshold:
            return None
        self.raised = True
        return (f"reward hacking? {100 * share:.1f}% of step {row.get('step')}'s samples were suspect (a program that "
                f"tampered with its checks, exited under them or returned what is not plain data; a hedged math "
                f"answer), above metrics.suspect_warn={self.threshold:g}: read their answers "
                f"(dump.every_steps) and the reward's per-node */suspect figures (docs/rewards.md)")
