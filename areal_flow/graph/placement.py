"""Which processes a graph needs and where they run."""

from __future__ import annotations

from dataclasses import dataclass, field

from areal_flow.graph.dag import Graph
from areal_flow.graph.mesh import format_mesh


@dataclass(frozen=True)
class Proc:
    """One OS process of the run."""

    name: str
    role: str  # controller | gen_server | rollout | reward | trainer | inference | judge_server
    devices: tuple[int, ...] = ()  # cores (CPU) or GPUs it owns, numbered across nodes; () = floats
    rank: int = 0  # an inference process or a judge server: its index among the graph node's
    node: int = 0  # the node (host) it runs on
    local_devices: tuple[int, ...] = ()  # `devices` as numbered on its node (what CUDA_VISIBLE_DEVICES lists)
    graph_node: str = ""  # an inference process or a judge server: the graph node on a mesh of its own that it runs


LISTENERS = ("gen_server", "rollout", "trainer", "inference", "judge_server")
"""The roles whose processes listen, in the order a run spec lists their ports (a new one goes
last, so the ports of a fixed base do not move)."""


def infer_name(node: str, replica: int) -> str:
    """The process name of replica `replica` of graph node `node` on a mesh of its own."""
    return f"{node}_infer{replica}"


def judge_server_name(node: str, i: int) -> str:
    """The process name of generation server `i` of judge `node`."""
    return f"{node}_server{i}"


def replica_of(group_id: int, replicas: int) -> int:
    """The replica of a node on a mesh of its own that computes a group's key: by group id, which
    the reward worker that sends the request and the trainer rank that waits for it both know."""
    return group_id % replicas


@dataclass
class Placement:
    procs: list[Proc] = field(default_factory=list)
    # Graph nodes on a mesh of their own whose replicas form a process group (a critic trained on
    # several devices): each gets a torch.distributed rendezvous port beside the trainers' "dist".
    rendezvous: list[str] = field(default_factory=list)

    def of_role(self, role: str) -> list[Proc]:
        return [p for p in self.procs if p.role == role]

    def describe(self, device_type: str) -> str:
        unit = "core" if device_type == "cpu" else "gpu"
        nodes = sorted({p.node for p in self.procs})
        lines = ["placement:" if nodes == [0] else f"placement on {len(nodes)} nodes:"]
        for p in self.procs:
            where = f"{unit} {format_mesh(p.local_devices)}" if p.devices else "any core (light)"
            lines.append(f"  {p.name:<14} {where}" if nodes == [0] else f"  {p.name:<14} node {p.node:<3} {where}")
        return "\n".join(lines)


def _on_node(name: str, role: str, devices: tuple[int, ...], rank: int, per_node: int, graph_node: str = "") -> Proc:
    # Callers keep a process's devices on one node (run/checks.py checks the groups).
    node = devices[0] // per_node
    return Proc(name, role, devices, rank, node, tuple(d - node * per_node for d in devices), graph_node)


def place(graph: Graph, rollout_workers: int, gen_tp_size: int = 1, per_node: int | None = None) -> Placement:
    """One generation server per `gen_tp_size` consecutive generate-mesh devices (which must divide
    the mesh: run/checks.py), one trainer rank per trainer-mesh device, the reward pool,
    rollout workers, one inference process per device of each node on a mesh of its own, and one
    controller, one generation server per device of each judge; on nodes of `per_node` devices
    (default: one node), with the light processes on node 0."""
    own = [d for n in [*graph.own_mesh_nodes, *graph.judges] for d in n.mesh or ()]
    per_node = per_node or max((*(graph.generate.mesh or ()), *graph.trainer_mesh, *own, 0)) + 1
    procs = [Proc("controller", "controller")]
    gen_mesh = graph.generate.mesh or ()
    for i, start in enumerate(range(0, len(gen_mesh), gen_tp_size)):
        procs.append(_on_node(f"gen_server{i}", "gen_server", tuple(gen_mesh[start:start + gen_tp_size]), i, per_node))
    procs += [Proc(f"rollout{i}", "rollout", (), i) for i in range(rollout_workers)]
    # One reward process runs every reward node in graph order on each group it takes; each node
    # scores in its own pool of `workers` processes (rewards/service.py).
    procs += [Proc("reward0", "reward", (), 0)] if graph.rewards else []
    for rank, dev in enumerate(graph.trainer_mesh):
        procs.append(_on_node(f"trainer{rank}", "trainer", (dev,), rank, per_node))
    for node in graph.own_mesh_nodes:  # one device each; a frozen role's are independent replicas
        for replica, dev in enumerate(node.mesh or ()):
            procs.append(_on_node(infer_name(node.name, replica), "inference", (dev,), replica, per_node, node.name))
    for node in graph.judges:  # frozen models: one server per device, never sent weights
        for i, dev in enumerate(node.mesh or ()):
            procs.append(_on_node(judge_server_name(node.name, i), "judge_server", (dev,), i, per_node, node.name))
    apart = graph.critic_apart
    rendezvous = [n.name for n in graph.own_mesh_nodes
                  if apart is not None and n.role == apart.role and len(n.mesh or ()) > 1]
    return Placement(procs, rendezvous)
