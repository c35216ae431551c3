"""A trainer rank's side of a critic on a mesh of its own (graph/dag.py `critic_apart`; critic.py
is the critic's side).

Each step the rank sends every one of the critic's processes its share of the value loss's inputs
(`CriticBatch`: the groups that process values, `replica_of`), and before reporting the step done
waits until each has trained it (`CriticTrained`). For a checkpoint, rank 0 forwards the
SaveCheckpoint and waits until each process has written its part (`CriticSaved`). The answers
arrive on the rank's inbox, which hands them here (`received`); what is still missing is named
for the rank's wait, which fails after step_timeout naming it.
"""

from __future__ import annotations

import numpy as np
import zmq

from areal_flow.graph.dag import Graph
from areal_flow.graph.placement import infer_name, replica_of
from areal_flow.transport.channels import send_blocking
from areal_flow.transport.messages import Array, CriticBatch, CriticSaved, CriticTrained, Sample, SaveCheckpoint


class CriticLink:
    """The critic's processes as one trainer rank sees them. `replicas`: the inboxes of the replicas
    of each node on a mesh of its own, the critic's inference node's among them."""

    def __init__(self, graph: Graph, replicas: dict[str, list[zmq.Socket]], rank: int) -> None:
        values = next(n for n in graph.own_mesh_nodes if n.role == "critic")  # the critic's inference node
        self.sockets, self.rank = replicas[values.name], rank
        self.workers = [infer_name(values.name, i) for i in range(len(self.sockets))]
        """The process names of the critic, in replica order."""
        self.trained: dict[int, dict[str, CriticTrained]] = {}  # step -> process -> its answer
        self.saved: set[tuple[str, str]] = set()  # (checkpoint, process)

    def received(self, msg: CriticTrained | CriticSaved) -> None:
        """An answer from one of the critic's processes, from the rank's inbox."""
        if isinstance(msg, CriticTrained):
            self.trained.setdefault(msg.step, {})[msg.worker] = msg
        else:
            self.saved.add((msg.path, msg.worker))

    def send(self, step: int, samples: list[Sample], seqs: list[tuple[np.ndarray, np.ndarray]],
             data: dict[str, list[np.ndarray]], leader: bool) -> None:
        """Each process's share of this rank's samples of `step`, with their sequences `seqs` and
        per-token value-loss inputs `data` (index-aligned with `samples`). A rank that is not its
        model-parallel group's data leader (`leader`) sends empty shares: the leader sends the
        group's samples."""
        for replica, socket in enumerate(self.sockets):
            mine = [i for i, s in enumerate(samples) if leader and replica_of(s.group_id, len(self.sockets)) == replica]
            send_blocking(socket, CriticBatch(
                step, self.rank, [samples[i].group_id for i in mine], [Array.of(seqs[i][0]) for i in mine],
                [Array.of(seqs[i][1]) for i in mine], {k: [Array.of(v[i]) for i in mine] for k, v in data.items()}))

    def update_missing(self, step: int) -> list[str]:
        """What the rank still waits for before step `step` is done: each process that has not
        trained it."""
        done = self.trained.get(step, {})
        return [f"the critic's update of step {step + 1} from {w}" for w in self.workers if w not in done]

    def update_stats(self, step: int) -> dict[str, float]:
        """The critic's stats of the trained step `step` under "critic/" (reduced over its processes
        already; rank 0 reports them, the others nothing), and forget its answers."""
        done = self.trained.pop(step)
        return {f"critic/{k}": v for k, v in done[self.workers[0]].stats.items()} if self.rank == 0 else {}

    def ask_save(self, msg: SaveCheckpoint) -> None:
        """Have every process write its part of the checkpoint `msg.path`."""
        for socket in self.sockets:
            send_blocking(socket, msg)

    def save_missing(self, path: str) -> list[str]:
        """The processes whose part of the checkpoint `path` has not been written yet."""
        return [f"the critic's part from {w}" for w in self.workers if (path, w) not in self.saved]

    def forget_save(self, path: str) -> None:
        self.saved -= {(path, w) for w in self.workers}
