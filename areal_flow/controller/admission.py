"""Admission: which prompt group each free rollout slot gets next, under the staleness rule.

Groups come in this order: first those a restarted rollout worker was running (still admitted,
their versions kept), then those a resumed run had generating when it was saved (admitted again,
in order), then new prompts from the stream. The rollout workers' slots are here too
(`slots.py`): a slot is taken by an admission and freed when its group is scored or dropped.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Sequence

from areal_flow.controller.in_transit import InTransit
from areal_flow.controller.kept import KeptTrajectories
from areal_flow.controller.ledger import Ledger
from areal_flow.controller.prompts import PromptStream
from areal_flow.controller.slots import RolloutSlots
from areal_flow.controller.state import RunState
from areal_flow.rollout import live
from areal_flow.transport.messages import DROP, AdmitRequest, KeptTrajectory, PromptGroup

log = logging.getLogger("areal_flow.controller")


class Admission:
    def __init__(self, state: RunState, prompts: PromptStream, group_size: int, ledger: Ledger, *,
                 raw_rows: Sequence[dict] = (), judge_fields: Sequence[str] = (), readmit: Sequence[int] = (),
                 kept: KeptTrajectories | None = None):
        """`raw_rows`: the training rows as in the data, row by row as `prompts.rows`, whose
        `judge_fields` a group carries to its judges; `readmit`: the groups a resumed run had
        generating, admitted again first (in order); `kept`: the trajectories its checkpoint kept
        of them (kept.py)."""
        self.state, self.prompts, self.group_size, self.ledger = state, prompts, group_size, ledger
        self.kept = kept
        self.raw_rows, self.judge_fields = list(raw_rows), list(judge_fields)
        self.slots = RolloutSlots()  # rollout workers' free generation slots
        self.readmit = list(readmit)
        # Groups a restarted rollout worker was running: still admitted (their versions kept), given
        # to a worker again; a copy that comes back first wins, a later one is refused as not running.
        self.regenerate: list[int] = []
        self.closing = False  # the run ends: no new admissions; running groups finish or stay accounted for
        self.in_transit = InTransit()  # routed to a rank, not yet trained: the rollout worker keeps its copy

    def joined(self, ident: bytes, msg: AdmitRequest) -> None:
        """A rollout worker offers its slots: at start, or again once the launcher restarted it, when
        the groups it was running are given to a worker again (they keep their admission versions)."""
        if ident in self.slots.free:
            lost = sorted(g for g, worker in self.slots.owner.items() if worker == ident)
            for g in lost:
                del self.slots.owner[g]
            self.slots.free[ident] = 0
            self.regenerate += [g for g in lost if g in self.state.staleness.running]
            log.warning("controller: %s restarted; its %d running group(s) are generated again", msg.worker, len(lost))
        self.slots.offer(ident, msg.slots)

    def grant(self) -> dict[bytes, list[PromptGroup]]:
        """Fill free rollout slots with prompt groups while the staleness rule admits them: each
        worker's groups, to send it in one message."""
        admitted: dict[bytes, list[PromptGroup]] = {}
        while self.slots and not self.closing:
            picked = self._next()
            if picked is None:
                break
            gid, version, again, kept = picked
            if version is None:  # a copy came back meanwhile
                continue
            index = self.state.running_prompts[gid]
            row = self.prompts.rows[index]
            self.ledger.write("admit", group=gid, prompt_id=row["id"], version=version, **again)
            raw = {k: self.raw_rows[index][k] for k in self.judge_fields}
            admitted.setdefault(self.slots.take(gid), []).append(PromptGroup(
                gid, row["id"], row, self.group_size, time.time(), raw=raw,
                policy_version=self.state.staleness.version, kept=kept))
        return admitted

    def _next(self) -> tuple[int, int | None, dict, list[KeptTrajectory]] | None:
        """The next group to admit, its admission version (None: not running any more), what the
        ledger says of it and the trajectories kept of it; None when the staleness rule admits
        nothing now."""
        staleness, state = self.state.staleness, self.state
        if self.regenerate:
            gid = self.regenerate.pop(0)
            return gid, staleness.running.get(gid), {"again": "its rollout worker restarted"}, []
        if not staleness.can_admit():
            return None
        if self.readmit:  # a resumed run's groups that were generating, first and in order
            gid = self.readmit.pop(0)
            taken = self.kept.take(gid) if self.kept is not None else None
            if taken is None:
                return gid, staleness.admit(gid), {"resumed": True}, []
            version, kept = taken  # admitted at its first version: its kept tokens are no older
            return gid, staleness.admit(gid, version), {"resumed": True, "kept_tokens": live.tokens(kept)}, kept
        gid = state.next_group
        state.next_group += 1
        state.running_prompts[gid] = self.prompts.next_index()
        return gid, staleness.admit(gid), {}, []

    def routed(self, group_id: int, rank: int) -> dict[bytes, list[int]]:
        """A group is scored and routed to `rank` (or DROP): its slot is free again. A dropped
        group's copy may go (the worker that ran it -> [it]); a routed one's is kept until a step
        trains it (in_transit.py)."""
        self.state.running_prompts.pop(group_id, None)
        owner = self.slots.release(group_id)
        if rank == DROP:
            return {owner: [group_id]}
        self.in_transit.routed(group_id, rank, owner)
        return {}
