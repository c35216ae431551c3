"""The MFC graph. Nodes come from the recipe; edges come from the keys nodes read and write.

A key that no node writes comes from the dataset. `build_graph` checks everything that can be
checked before a process starts and reports every problem at once, each naming the node and the
recipe key (`graph.<node>.<field>`) to change.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

NODE_TYPES = ("generate", "reward", "inference", "train")
ROLES = ("actor", "ref", "critic")
STREAMING_TYPES = ("generate", "reward")
# What the generate node can write: the embedded engine and SGLang both return these.
GENERATE_KEYS = ("prompt_ids", "output_ids", "behav_logprobs", "versions")
# What the actor's train node needs, besides the output of a reward node.
TRAIN_REQUIRED = ("prompt_ids", "output_ids", "behav_logprobs")


class GraphError(ValueError):
    """The recipe's graph is wrong; the message lists every problem found."""

    def __init__(self, problems: Sequence[str]):
        self.problems = list(problems)
        super().__init__("invalid graph:\n" + "\n".join(f"  - {p}" for p in self.problems))


@dataclass(frozen=True)
class Node:
    name: str
    type: str
    role: str | None
    inputs: tuple[str, ...]
    outputs: tuple[str, ...]
    mesh: tuple[int, ...] | None
    micro_batch_tokens: int
    workers: int
    fn: str

    @property
    def streaming(self) -> bool:
        return self.type in STREAMING_TYPES


@dataclass
class Graph:
    nodes: dict[str, Node]
    order: list[str]  # topological
    producers: dict[str, str]  # key -> node that writes it
    dataset_keys: tuple[str, ...]

    @property
    def generate(self) -> Node:
        return next(n for n in self.nodes.values() if n.type == "generate")

    @property
    def rewards(self) -> list[Node]:
        return [self.nodes[n] for n in self.order if self.nodes[n].type == "reward"]

    @property
    def batch_nodes(self) -> list[Node]:
        """inference and train nodes in the order they fire on a batch."""
        return [self.nodes[n] for n in self.order if not self.nodes[n].streaming]

    @property
    def trainer_mesh(self) -> tuple[int, ...]:
        return self.batch_nodes[0].mesh or ()

    def edges(self) -> list[tuple[str, str, str]]:
        """(producer, consumer, key) for every key a node reads from another node."""
        return [
            (self.producers[k], n.name, k)
            for name in self.order
            for n in [self.nodes[name]]
            for k in n.inputs
            if k in self.producers
        ]

    def role_of_key(self, key: str) -> str | None:
        """The model role whose node wrote `key` (e.g. prox logprobs come from the actor)."""
        producer = self.producers.get(key)
        return self.nodes[producer].role if producer else None

    def type_of_producer(self, key: str) -> str | None:
        """The type of the node that writes `key`; None for dataset fields."""
        producer = self.producers.get(key)
        return self.nodes[producer].type if producer else None

    def dataset_input(self, node: Node) -> str:
        """The one dataset field a generate node reads (its prompt) or a reward node compares with."""
        return next(k for k in node.inputs if k in self.dataset_keys)

    def describe(self) -> str:
        lines = ["graph (in firing order):"]
        for name in self.order:
            n = self.nodes[name]
            where = f"mesh {format_mesh(n.mesh)}" if n.mesh is not None else f"{n.workers} worker(s)"
            role = f" [{n.role}]" if n.role else ""
            lines.append(f"  {name}: {n.type}{role} on {where}")
            for k in n.inputs:
                src = self.producers.get(k, "dataset")
                lines.append(f"      <- {k} (from {src})")
            for k in n.outputs:
                lines.append(f"      -> {k}")
        return "\n".join(lines)


def format_mesh(mesh: Sequence[int] | None) -> str:
    return ",".join(map(str, mesh)) if mesh else "-"


def parse_mesh(spec: Any, where: str) -> tuple[tuple[int, ...] | None, str | None]:
    """'0', '0-3', '0,2' or an int -> sorted device indices; returns (mesh, problem)."""
    text = str(spec).strip()
    devices: set[int] = set()
    try:
        for part in text.split(","):
            lo, _, hi = part.partition("-")
            first, last = int(lo), int(hi) if hi else int(lo)
            if first < 0 or last < first:
                raise ValueError
            devices.update(range(first, last + 1))
    except ValueError:
        return None, f"{where}: mesh {text!r} is not a device list like '0', '0-3' or '0,2'"
    return tuple(sorted(devices)), None


def build_graph(
    nodes_cfg: Mapping[str, Mapping[str, Any]],
    dataset_keys: Sequence[str],
    n_devices: int,
    reward_fns: Sequence[str] = (),
) -> Graph:
    """Validate the recipe's `graph:` section and return the graph, or raise GraphError."""
    problems: list[str] = []
    nodes: dict[str, Node] = {}
    for name, c in nodes_cfg.items():
        key = f"graph.{name}"
        ntype, role = c.get("type") or "", c.get("role")
        if ntype not in NODE_TYPES:
            problems.append(f"node '{name}': unknown type {ntype!r} ({key}.type); expected one of {', '.join(NODE_TYPES)}")
        if ntype in ("generate", "inference", "train") and role not in ROLES:
            problems.append(f"node '{name}': unknown model role {role!r} ({key}.role); expected one of {', '.join(ROLES)}")
        if ntype == "reward" and role is not None:
            problems.append(f"node '{name}': a reward node has no model role ({key}.role={role!r})")
        if ntype == "reward" and reward_fns and c.get("fn") not in reward_fns:
            problems.append(f"node '{name}': unknown reward function {c.get('fn')!r} ({key}.fn); expected one of {', '.join(reward_fns)}")
        mesh = None
        if ntype in ("generate", "inference", "train"):
            if c.get("mesh") is None:
                problems.append(f"node '{name}': needs a mesh ({key}.mesh), e.g. '0'")
            else:
                mesh, problem = parse_mesh(c["mesh"], f"node '{name}' ({key}.mesh)")
                if problem:
                    problems.append(problem)
                elif mesh[-1] >= n_devices:
                    problems.append(
                        f"node '{name}': mesh {c['mesh']!r} ({key}.mesh) uses device {mesh[-1]} "
                        f"but the cluster has {n_devices} (cluster.n_devices)"
                    )
                    mesh = None
        nodes[name] = Node(
            name=name,
            type=ntype,
            role=role,
            inputs=tuple(c.get("inputs") or ()),
            outputs=tuple(c.get("outputs") or ()),
            mesh=mesh,
            micro_batch_tokens=int(c.get("micro_batch_tokens", 8192)),
            workers=int(c.get("workers", 1)),
            fn=c.get("fn") or "",
        )

    producers = _check_keys(nodes, dataset_keys, problems)
    order = _topological_order(nodes, producers, problems)
    _check_shape(nodes, producers, dataset_keys, problems)
    _check_meshes(nodes, problems)
    if problems:
        raise GraphError(problems)
    return Graph(nodes=nodes, order=order, producers=producers, dataset_keys=tuple(dataset_keys))


def _check_keys(nodes: dict[str, Node], dataset_keys: Sequence[str], problems: list[str]) -> dict[str, str]:
    producers: dict[str, str] = {}
    for n in nodes.values():
        for k in n.outputs:
            if k in dataset_keys:
                problems.append(f"key '{k}' is written by node '{n.name}' (graph.{n.name}.outputs) but is also a dataset field")
            elif k in producers:
                problems.append(
                    f"key '{k}' is written by two nodes: '{producers[k]}' and '{n.name}' (graph.{n.name}.outputs)"
                )
            else:
                producers[k] = n.name
    for n in nodes.values():
        for k in n.inputs:
            if k not in producers and k not in dataset_keys:
                problems.append(
                    f"node '{n.name}' reads key '{k}' (graph.{n.name}.inputs) but no node writes it "
                    f"and the dataset has no such field (dataset fields: {', '.join(dataset_keys) or 'none'})"
                )
    return producers


def _topological_order(nodes: dict[str, Node], producers: dict[str, str], problems: list[str]) -> list[str]:
    deps = {n.name: {producers[k] for k in n.inputs if k in producers} for n in nodes.values()}
    order: list[str] = []
    ready = [name for name in nodes if not deps[name]]
    while ready:
        name = ready.pop(0)
        order.append(name)
        for other in nodes:
            if name in deps[other]:
                deps[other].discard(name)
                if not deps[other] and other not in order and other not in ready:
                    ready.append(other)
    stuck = [name for name in nodes if name not in order]
    if stuck:
        cycle = _find_cycle(stuck, nodes, producers)
        problems.append("cycle in the graph: " + " -> ".join(f"'{a}' ({k})" for a, k in cycle) + f" -> '{cycle[0][0]}'")
    return order


def _find_cycle(stuck: list[str], nodes: dict[str, Node], producers: dict[str, str]) -> list[tuple[str, str]]:
    """Walk producer links backwards from a stuck node until a node repeats: that is a cycle."""
    path: list[tuple[str, str]] = []
    seen: dict[str, int] = {}
    name = stuck[0]
    while name not in seen:
        seen[name] = len(path)
        key = next(k for k in nodes[name].inputs if producers.get(k) in stuck)
        path.append((producers[key], key))
        name = producers[key]
    cycle = path[seen[name]:]
    cycle.reverse()  # producer order: a writes k that b reads ...
    return cycle


def _check_shape(nodes: dict[str, Node], producers: dict[str, str], dataset_keys: Sequence[str],
                 problems: list[str]) -> None:
    """What this version of the runtime can run: one generate node, streaming before batch nodes."""
    by_type = {t: [n for n in nodes.values() if n.type == t] for t in NODE_TYPES}
    if len(by_type["generate"]) != 1:
        problems.append(f"the graph needs exactly one generate node, found {len(by_type['generate'])}")
    if not by_type["reward"]:
        problems.append("the graph needs a reward node (type: reward) to write the rewards the train node reads")
    for n in by_type["generate"] + by_type["reward"]:
        fields = [k for k in n.inputs if k in dataset_keys]
        if len(fields) != 1:
            what = "its prompt" if n.type == "generate" else "the reference answer"
            problems.append(f"node '{n.name}': a {n.type} node reads exactly one dataset field, {what} "
                            f"(graph.{n.name}.inputs has {fields or 'none'})")
    for n in by_type["reward"]:
        if len(n.outputs) != 1 or "output_ids" not in n.inputs:
            problems.append(f"node '{n.name}': a reward node reads output_ids and writes exactly one key "
                            f"(graph.{n.name}.inputs/outputs)")
    for g in by_type["generate"]:
        extra = [k for k in g.outputs if k not in GENERATE_KEYS]
        if extra or "output_ids" not in g.outputs:
            problems.append(
                f"node '{g.name}': a generate node writes output_ids and any of {', '.join(GENERATE_KEYS)} "
                f"(graph.{g.name}.outputs has {list(g.outputs)})"
            )
    trains = [n for n in by_type["train"] if n.role == "actor"]
    if len(trains) != 1 or len(by_type["train"]) != 1:
        problems.append(f"the graph needs exactly one train node with role actor, found {len(by_type['train'])} train node(s)")
    for t in trains:
        missing = [k for k in TRAIN_REQUIRED if k not in t.inputs]
        if not any(nodes[producers[k]].type == "reward" for k in t.inputs if k in producers):
            missing.append("the output of a reward node")
        if missing:
            problems.append(f"node '{t.name}': a train node must read {', '.join(missing)} (graph.{t.name}.inputs)")
    for n in by_type["inference"]:
        if len(n.outputs) != 1:
            problems.append(f"node '{n.name}': an inference node writes exactly one key (graph.{n.name}.outputs)")
    for n in nodes.values():
        if n.streaming:
            for k in n.inputs:
                src = producers.get(k)
                if src and not nodes[src].streaming:
                    problems.append(
                        f"node '{n.name}' ({n.type}) reads '{k}' from batch node '{src}' (graph.{n.name}.inputs): "
                        "streaming nodes (generate, reward) run before batch nodes (inference, train)"
                    )


def _check_meshes(nodes: dict[str, Node], problems: list[str]) -> None:
    """Generation and training never share devices; batch nodes share one trainer mesh."""
    placed = [n for n in nodes.values() if n.mesh is not None]
    for i, a in enumerate(placed):
        for b in placed[i + 1:]:
            shared = set(a.mesh) & set(b.mesh)
            if not shared and (a.streaming or b.streaming):
                continue
            if a.streaming != b.streaming and shared:
                problems.append(
                    f"meshes of '{a.name}' ({format_mesh(a.mesh)}) and '{b.name}' ({format_mesh(b.mesh)}) overlap "
                    f"on device(s) {format_mesh(sorted(shared))}: generation and training cannot share devices "
                    f"(graph.{b.name}.mesh)"
                )
            elif not a.streaming and not b.streaming and a.mesh != b.mesh:
                problems.append(
                    f"meshes of batch nodes '{a.name}' ({format_mesh(a.mesh)}) and '{b.name}' ({format_mesh(b.mesh)}) "
                    f"differ (graph.{b.name}.mesh): batch nodes run on one trainer mesh in this version"
                )


def graph_from_config(cfg: Any) -> Graph:
    """The validated graph of a composed run config."""
    from areal_flow.rewards.functions import REWARD_FNS

    return build_graph(cfg.graph, list(cfg.dataset.fields), cfg.cluster.n_devices, list(REWARD_FNS))
