"""The MFC graph. Nodes come from the recipe; edges come from the keys nodes read and write.

A key that no node writes comes from the dataset. What a key means is declared by the node that
writes it (`graph/keys.py`), and every node finds its inputs by meaning, so the runtime follows the
declared keys whatever the recipe names them. `build_graph` checks everything that can be checked
before a process starts and reports every problem at once, each naming the node and the recipe key
(`graph.<node>.<field>`) to change: each node alone as it is read (`node.py`), then the data flow
between nodes (`dataflow.py`) and where they run (`devices.py`). What a node of each type must read
and write, and whether it streams or fires on a batch, comes from its kind's registered spec
(`graph/keys.py: register`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from areal_flow.graph.dataflow import check_keys, check_loss_mask, check_node, check_shape, topological_order
from areal_flow.graph.devices import actor_train, check_engines, check_meshes
from areal_flow.graph.keys import TEXT
from areal_flow.graph.mesh import format_mesh
from areal_flow.graph.node import Node, read_node


class GraphError(ValueError):
    """The recipe's graph is wrong; the message lists every problem found."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("invalid graph:\n" + "\n".join(f"  - {p}" for p in self.problems))


@dataclass
class Graph:
    nodes: dict[str, Node]
    order: list[str]  # topological
    producers: dict[str, str]  # key -> node that writes it
    dataset_keys: tuple[str, ...]
    meaning: dict[str, str]  # key -> well-known key it stands for (TEXT for dataset fields)

    @property
    def generate(self) -> Node:
        """The policy's generate node (role actor)."""
        return next(n for n in self.nodes.values() if n.type == "generate" and n.role == "actor")

    @property
    def judges(self) -> list[Node]:
        """Generate nodes of role judge, in graph order."""
        return [self.nodes[n] for n in self.order if self.nodes[n].judge]

    @property
    def train(self) -> Node:
        """The actor's train node: the policy the run trains and publishes."""
        return next(n for n in self.nodes.values() if n.type == "train" and n.role == "actor")

    @property
    def critic_train(self) -> Node | None:
        """The critic's train node, when the graph trains one."""
        return next((n for n in self.nodes.values() if n.type == "train" and n.role == "critic"), None)

    @property
    def scorers(self) -> list[Node]:
        """reward and combine nodes (whose outputs are rewards), in the order they run on each sample."""
        return [self.nodes[n] for n in self.order if (kind := self.nodes[n].kind) and kind.outputs_mean == "rewards"]

    @property
    def rewards(self) -> list[Node]:
        return [n for n in self.scorers if n.type == "reward"]

    @property
    def batch_nodes(self) -> list[Node]:
        """inference and train nodes in the order they fire on a batch."""
        return [self.nodes[n] for n in self.order if not self.nodes[n].streaming]

    @property
    def trainer_mesh(self) -> tuple[int, ...]:
        """The trainer ranks' devices: the actor's train node's mesh (not the first batch node's, which
        may be a ref node on a mesh of its own)."""
        train = actor_train(self.nodes)
        return (train.mesh if train is not None else None) or ()

    @property
    def trainer_nodes(self) -> list[Node]:
        """The batch nodes the trainer ranks run in each step, in graph order."""
        return [n for n in self.batch_nodes if n.mesh == self.trainer_mesh]

    @property
    def own_mesh_nodes(self) -> list[Node]:
        """Inference nodes on a mesh of their own (a frozen role's, ref, or a critic's apart): each
        device of it runs a replica in an inference process, and the trainer ranks join its output
        to their groups by group id."""
        return [n for n in self.batch_nodes if n.mesh != self.trainer_mesh and n.type == "inference"]

    @property
    def critic_apart(self) -> Node | None:
        """The critic's train node when it runs on a mesh of its own, in the process that computes
        its values (training/critic.py); None when the trainer ranks train it, or there is none."""
        critic = self.critic_train
        return critic if critic is not None and critic.mesh is not None and critic.mesh != self.trainer_mesh else None

    @property
    def colocated(self) -> bool:
        """Whether generation and training run on the same devices, taking turns (docs/colocation.md)."""
        return bool(self.trainer_mesh) and self.generate.mesh == self.trainer_mesh

    @property
    def roles(self) -> list[str]:
        """Model roles the trainer ranks hold, in firing order."""
        return list(dict.fromkeys(n.role for n in self.trainer_nodes))

    def input(self, node: Node, meaning: str) -> str | None:
        """The key `node` reads for a well-known meaning (e.g. its 'prox_logprobs'), or None."""
        return next((k for k in node.inputs if self.meaning.get(k) == meaning), None)

    def output(self, node: Node, meaning: str) -> str | None:
        """The key `node` writes for a well-known meaning, or None when it does not write it."""
        return next((k for k in node.outputs if node.meaning_of_output(k) == meaning), None)

    def dataset_input(self, node: Node) -> str:
        """The one dataset field a generate node reads (its prompt) or a reward node compares with."""
        return next(k for k in node.inputs if k in self.dataset_keys)

    def dataset_inputs(self, node: Node) -> list[str]:
        """Every dataset field a node reads (a judge's template may name several)."""
        return [k for k in node.inputs if k in self.dataset_keys]

    def reference(self, node: Node) -> str:
        """A reward node's reference: the dataset field it compares with, or the judge's key it reads."""
        judged = [k for k in node.inputs if self.meaning.get(k) in (node.kind.reference_from if node.kind else ())]
        return judged[0] if judged else self.dataset_input(node)

    @property
    def eval_reward(self) -> Node | None:
        """The first reward node whose reference is a dataset field (held-out evaluation calls no judge)."""
        return next((n for n in self.rewards if self.reference(n) in self.dataset_keys), None)

    def edges(self) -> list[tuple[str, str, str]]:
        """(producer, consumer, key) for every key a node reads from another node."""
        return [
            (self.producers[k], n.name, k)
            for name in self.order
            for n in [self.nodes[name]]
            for k in n.inputs
            if k in self.producers
        ]

    def describe(self) -> str:
        lines = ["graph (in firing order):"]
        for name in self.order:
            n = self.nodes[name]
            where = f"mesh {format_mesh(n.mesh)}" if n.mesh is not None else f"{n.workers} worker(s)"
            role = f" [{n.role}]" if n.role else ""
            lines.append(f"  {name}: {n.type}{role} on {where}")
            for k in n.inputs:
                src = self.producers.get(k, "dataset")
                lines.append(f"      <- {k} (from {src}){_as(k, self.meaning.get(k))}")
            for k in n.outputs:
                lines.append(f"      -> {k}{_as(k, self.meaning.get(k))}")
        for n in self.own_mesh_nodes:
            lines.append(f"{n.name}: on a mesh of its own, one inference process per device; the trainer ranks "
                         f"join its {', '.join(n.outputs)} to their groups")
            if (critic := self.critic_apart) is not None and n.role == critic.role:
                lines[-1] += f"; the same process runs {critic.name}, on the batch the trainer ranks send it"
        for n in self.judges:
            model = n.model or "the run's starting model"
            lines.append(f"{n.name}: a frozen judge on mesh {format_mesh(n.mesh)}, one generation server per device, "
                         f"model {model}; never updated")
        if self.colocated:
            lines.append(f"colocated: generation and training take turns on mesh {format_mesh(self.trainer_mesh)} (the "
                         "generation servers free their KV cache for each train step and go on at its weight update)")
        return "\n".join(lines)


def _as(key: str, meaning: str | None) -> str:
    return f" as {meaning}" if meaning and meaning not in (key, TEXT) else ""


def build_graph(
    nodes_cfg: Mapping[str, Any],
    dataset_keys: Sequence[str],
    n_devices: int,
    reward_fns: Sequence[str] = (),
) -> Graph:
    """Validate the recipe's `graph:` section and return the graph, or raise GraphError."""
    problems: list[str] = []
    nodes = {name: read_node(name, c, nodes_cfg, n_devices, reward_fns, problems) for name, c in nodes_cfg.items()}
    producers = check_keys(nodes, dataset_keys, problems)
    meaning = {k: TEXT for k in dataset_keys} | {k: nodes[p].meaning_of_output(k) for k, p in producers.items()}
    order = topological_order(nodes, producers, problems)
    for n in nodes.values():
        if n.kind is not None:
            check_node(n, n.kind, nodes, producers, meaning, problems)
    check_loss_mask(nodes, meaning, problems)
    check_shape(nodes, problems)
    check_meshes(nodes, problems)
    check_engines(nodes, problems)
    if problems:
        raise GraphError(problems)
    return Graph(nodes=nodes, order=order, producers=producers, dataset_keys=tuple(dataset_keys), meaning=meaning)


def graph_from_config(cfg: Any, reward_fns: Sequence[str] = ()) -> Graph:
    """The validated graph of a run config. `reward_fns`: the built-in reward functions a reward
    node may name, checked when given; the launcher passes them (`rewards/` sits above `graph/`),
    so the processes of a run, whose config it checked, need not."""
    n_devices = cfg.cluster.n_nodes * cfg.cluster.n_devices
    return build_graph(cfg.graph, list(cfg.dataset.fields), n_devices, reward_fns)
