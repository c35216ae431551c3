"""Joining the output of a node on a mesh of its own to the groups a trainer rank holds.

An inference node of a frozen role (ref) may run on a mesh of its own (graph/dag.py:
`own_mesh_nodes`): its inference processes compute its key, and the trainer ranks join it to their
groups by group id. The reward worker sends a routed group to its trainer rank and the node's
inputs to a replica at the same time, so on the rank either may come first: a group waits in
`pending` until every such node's result is there, a result waits in `results` until its group
is, and when both are each sample gets its array. Only complete groups leave: waiting for a group,
moving it to another rank and saving it in a checkpoint stay as they were. No sockets here
(training/worker.py receives; tests/training/test_join.py drives it).
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Mapping

from areal_flow.graph.placement import infer_name, replica_of
from areal_flow.transport.messages import Inferred, ScoredGroup


class JoinError(ValueError):
    """A result that does not fit its group; the message names the group, the node and the key."""


class DuplicateResult(JoinError):
    """A second result of one node for one group: the receiver logs it and drops it."""


@dataclass(frozen=True)
class Remote:
    """A node whose output the rank joins: its name, the key it writes and the per-token key whose
    length each of its arrays must have (the answer's: one logprob per answer token)."""

    node: str
    key: str
    length_key: str


@dataclass
class Join:
    remotes: list[Remote]
    pending: dict[int, ScoredGroup] = field(default_factory=dict)  # groups waiting for a result
    results: dict[int, dict[str, Inferred]] = field(default_factory=dict)  # group -> node -> result, waiting for it
    joined: set[int] = field(default_factory=set)  # groups completed here: a later result for one is a duplicate
    asked: dict[int, float] = field(default_factory=dict)  # pending group -> when its results were last asked for

    def missing(self, group: ScoredGroup) -> list[Remote]:
        """The nodes whose key some sample of `group` lacks."""
        return [r for r in self.remotes if any(r.key not in s.arrays for s in group.samples)]

    def waiting_for(self, group_id: int) -> list[Remote]:
        """The nodes whose results a pending group still waits for ([] when it is not pending)."""
        group = self.pending.get(group_id)
        if group is None:
            return []
        have = self.results.get(group_id, {})
        return [r for r in self.missing(group) if r.node not in have]

    def lacking(self, groups: list[int], replicas: Mapping[str, int]) -> list[str]:
        """What each of `groups` (none complete here) lacks, for an error: the group itself, or a key,
        named with the replica that computes it for that group (`replicas`: node -> how many)."""
        absent = [g for g in groups if g not in self.pending]
        why = [f"groups {absent}, which never arrived on its inbox"] if absent else []
        for g in groups:
            for r in self.waiting_for(g):
                replica = infer_name(r.node, replica_of(g, replicas[r.node]))
                why.append(f"group {g}, which arrived without its {r.key} (graph.{r.node}), never sent by {replica}")
        return why

    def group(self, group: ScoredGroup, now: float = 0.0) -> ScoredGroup | None:
        """A group arrived (at time `now`, when the reward worker asked for its results): it,
        complete, or None while it waits for a result."""
        if not self.missing(group):  # moved from another rank or saved complete: nothing to wait for
            return group
        self.pending[group.group_id] = group
        self.asked[group.group_id] = now
        return self._complete(group.group_id)

    def overdue(self, now: float, after: float) -> list[tuple[ScoredGroup, Remote]]:
        """The pending groups, each with a node whose result it still lacks, last asked for more than
        `after` seconds before `now`: to ask its replica again (one that died and was restarted lost
        the request). They count as asked at `now`; a result that then comes twice is dropped."""
        late = [g for g, t in self.asked.items() if now - t > after]
        for g in late:
            self.asked[g] = now
        return [(self.pending[g], r) for g in late for r in self.waiting_for(g)]

    def result(self, msg: Inferred) -> ScoredGroup | None:
        """A result arrived: its group, now complete, or None while the group (or another node's
        result) is missing. Raises DuplicateResult for a second result of a node for a group, and
        JoinError for one that does not fit its group."""
        if msg.group_id in self.joined or msg.node in self.results.get(msg.group_id, {}):
            raise DuplicateResult(f"group {msg.group_id}: a second {msg.key} from node '{msg.node}' "
                                  f"({msg.worker}), dropped")
        self.results.setdefault(msg.group_id, {})[msg.node] = msg
        return self._complete(msg.group_id)

    def _complete(self, group_id: int) -> ScoredGroup | None:
        group = self.pending.get(group_id)
        if group is None or self.waiting_for(group_id):
            return None
        results = self.results.pop(group_id, {})
        for remote in self.missing(group):
            _check(group, results[remote.node], remote)
        for remote in self.missing(group):  # every result checked first: a refused join changes nothing
            _apply(group, results[remote.node], remote)
        del self.pending[group_id]
        self.asked.pop(group_id, None)
        self.joined.add(group_id)
        return group


def _check(group: ScoredGroup, msg: Inferred, remote: Remote) -> None:
    where = f"group {group.group_id}: node '{remote.node}' ({msg.worker})"
    if msg.key != remote.key:
        raise JoinError(f"{where} sent key {msg.key!r}, the graph has it write {remote.key!r}")
    indices = sorted(s.index for s in group.samples)
    if sorted(msg.indices) != indices or len(msg.arrays) != len(msg.indices):
        raise JoinError(f"{where} sent {remote.key} for samples {sorted(msg.indices)} ({len(msg.arrays)} arrays), "
                        f"the group has samples {indices}")
    by_index = {s.index: s for s in group.samples}
    for i, array in zip(msg.indices, msg.arrays):
        want = len(by_index[i].arrays[remote.length_key])
        if len(array) != want:
            raise JoinError(f"{where} sent {remote.key} of {len(array)} values for sample {i}, whose "
                            f"{remote.length_key} has {want}")


def _apply(group: ScoredGroup, msg: Inferred, remote: Remote) -> None:
    by_index = {s.index: s for s in group.samples}
    for i, array in zip(msg.indices, msg.arrays):
        by_index[i].arrays[remote.key] = array
        # Its share of the replica's forward call, as reward nodes record their seconds.
        by_index[i].scalars[f"{remote.node}_seconds"] = msg.seconds / len(msg.indices)
