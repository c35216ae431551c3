"""What becomes of a scored group: routed to a trainer rank, filtered (trainable, but it would teach
little), or dropped (unusable); each outcome in the ledger, with the watches that stop a run whose
groups keep being filtered or keep failing (`intake.FilterStreak`, `rollout_failures.py`).

Which rank takes a routed group is the intake's choice (`intake.py`); the controller only sends the
answer. Plain values and the ledger, tested without sockets.
"""

from __future__ import annotations

import logging

from areal_flow.controller.intake import FilterStreak, outside_range
from areal_flow.controller.ledger import Ledger
from areal_flow.controller.rollout_failures import RolloutFailures
from areal_flow.controller.state import RunState
from areal_flow.transport.messages import DROP, GroupMeta

log = logging.getLogger("areal_flow.controller")


def token_versions(meta: GroupMeta) -> dict[str, int]:
    """A group's answer tokens by the policy version that generated them (JSON keys)."""
    counts: dict[str, int] = {}
    for s in meta.samples:
        for version, n in s.versions.items():
            counts[str(version)] = counts.get(str(version), 0) + n
    return counts


class Outcomes:
    def __init__(self, state: RunState, ledger: Ledger, failures: RolloutFailures, *,
                 success_rate_range: list[float] | None, filter_stall_batches: int, batch_size: int):
        self.state, self.ledger, self.failures = state, ledger, failures
        self.bounds, self.stall_batches = success_rate_range, filter_stall_batches
        self.filter_streak = FilterStreak(filter_stall_batches * batch_size)

    def decide(self, meta: GroupMeta) -> int:
        """The rank that takes a scored, running group, or DROP; the outcome is in the ledger and
        the run state's counts."""
        state, intake, staleness = self.state, self.state.intake, self.state.staleness
        rank, problem = intake.accept(meta)
        self.failures.observe(meta, problem)
        # Each answer's length and the group's stage times go to the ledger: what the advisor fits
        # generation from (advise/fit.py), the filtered groups' answers included.
        stats = {"lengths": [s.lengths.get(intake.output_keys[0], 0) for s in meta.samples], **meta.times}
        if problem is None and (why := outside_range(meta, intake.reward_key, self.bounds)):
            # Trainable, but it would teach little (all right or all wrong gives no advantage): it
            # leaves the intake and the running set, so admission opens for a group in its place.
            intake.take([meta.group_id])
            staleness.abandon(meta.group_id)
            state.filtered += 1
            self.filter_streak.dropped(meta, intake.reward_key)
            self.ledger.write("filter", group=meta.group_id, reason=why, **stats)
            state.generated_tokens += sum(stats["lengths"])
            return DROP
        if problem:
            # Unusable, but accounted for: it leaves the running set (else the staleness rule would
            # wait for it forever) and the ledger and summary say it was dropped.
            log.error("controller: group %d dropped: %s", meta.group_id, problem)
            staleness.abandon(meta.group_id)
            self.ledger.write("drop", group=meta.group_id, reason=problem, **stats)
            return rank
        staleness.finish(meta.group_id)
        self.filter_streak.kept()
        state.generated_tokens += sum(stats["lengths"])
        # Its answer tokens by the version that made them: the audit checks each against η.
        self.ledger.write("finish", group=meta.group_id, rank=rank, tokens=token_versions(meta), **stats)
        return rank

    def filter_stalled(self) -> str | None:
        """The line the run stops with when dynamic filtering has dropped too many groups in a row."""
        streak = self.filter_streak
        if not streak.stalled:
            return None
        return (f"the run trains nothing: dynamic filtering dropped the last {streak.count} prompt groups in a row, "
                f"none kept ({self.stall_batches} batches' worth, algorithm.filter_stall_batches="
                f"{self.stall_batches}); their success rates fell outside algorithm.success_rate_range={self.bounds} "
                f"({streak.describe()}): widen it, or null to train every group")
