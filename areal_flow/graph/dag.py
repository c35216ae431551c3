"""The MFC graph. Nodes come from the recipe; edges come from the keys nodes read and write.

A key that no node writes comes from the dataset. What a key means is declared by the node that
writes it (`graph/keys.py`), and every node finds its inputs by meaning, so the runtime follows the
declared keys whatever the recipe names them. `build_graph` checks everything that can be checked
before a process starts and reports every problem at once, each naming the node and the recipe key
(`graph.<node>.<field>`) to change. What a node of each type must read and write, and whether it
streams or fires on a batch, comes from its kind's registered spec (`graph/keys.py: register`).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from areal_flow.config.validate import did_you_mean
from areal_flow.graph.keys import ROLES, RUNTIME_KINDS, TEXT, NodeKind, node_kinds
from areal_flow.graph.layout import Layout, layout_problems, parse_layout


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
    keys: tuple[tuple[str, str], ...]  # (well-known key, the name this node writes it under)
    mesh: tuple[int, ...] | None
    micro_batch_tokens: int
    row_tokens: int | None  # batch nodes, torch engine: packed rows per micro-batch call
    engine: str  # batch nodes: the training engine of the node's role
    layout: Layout | None  # batch nodes: data/tensor/pipeline parallel sizes on the mesh
    workers: int
    fn: str
    timeout: float  # reward nodes: seconds per sample
    scale: float  # reward nodes: shaping
    bias: float
    clip: float | None
    weights: tuple[tuple[str, float], ...]  # combine nodes: (input key, weight)
    model: str | None = None  # judges: the model dir (None = the run's starting model)
    template: str | None = None  # judges: the prompt's format string
    chat_template: bool = False  # judges: wrap the prompt in the judge tokenizer's chat template
    max_new_tokens: int | None = None  # judges: the answer budget (None = algorithm.max_new_tokens)
    temperature: float = 0.0  # judges: sampling temperature
    env: str | None = None  # the policy's generate node: the environment of multi-turn trajectories
    env_settings: tuple[tuple[str, Any], ...] = ()  # its settings, (name, value)
    max_turns: int = 4  # with env: policy turns a trajectory may take
    max_trajectory_tokens: int | None = None  # with env: a trajectory's token budget (None = the model's context)
    env_error_share: float = 0.5  # with env: the share of trajectories whose environment raised that stops the run
    agent: str | None = None  # the policy's generate node: 'module:function' run through the OpenAI gateway
    agent_wall_seconds: float = 120.0  # with agent: a rollout's wall time
    agent_retries: int = 1  # with agent: runs of a failed rollout before its group is dropped
    agent_roles: tuple[str, ...] = ()  # with agent: the policy's roles in a rollout, a sample each

    @property
    def takes_turns(self) -> bool:
        """A trajectory of turns with observations between them (an environment's or an agent's)."""
        return self.env is not None or self.agent is not None

    @property
    def kind(self) -> NodeKind | None:
        """Its type's registered spec (graph/keys.py), or its role's when the spec has one (a judge's);
        None for an unknown type."""
        kind = node_kinds().get(self.type)
        return dict(kind.by_role).get(self.role, kind) if kind is not None else None

    @property
    def judge(self) -> bool:
        """A generate node of role judge: a frozen model on generation servers of its own."""
        return self.type == "generate" and self.role == "judge"

    @property
    def streaming(self) -> bool:
        return self.kind is not None and self.kind.streaming

    def meaning_of_output(self, key: str) -> str:
        """What an output of this node is: the well-known key it stands for."""
        if self.kind is not None and self.kind.outputs_mean is not None:
            return self.kind.outputs_mean
        return next((known for known, name in self.keys if name == key), key)


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
        train = _actor_train(self.nodes)
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


def format_mesh(mesh: Sequence[int] | None) -> str:
    """Sorted devices as a mesh is written: runs of three or more as 'a-b' ('0-7,9,10'); '-' when empty."""
    if not mesh:
        return "-"
    runs: list[list[int]] = []
    for d in mesh:
        if runs and d == runs[-1][-1] + 1:
            runs[-1].append(d)
        else:
            runs.append([d])
    return ",".join(f"{r[0]}-{r[-1]}" if len(r) > 2 else ",".join(map(str, r)) for r in runs)


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


def _field(c: Any, name: str, default: Any = None) -> Any:
    """A node field from a NodeConfig or a plain mapping (tests build graphs from dicts)."""
    value = c.get(name, default) if isinstance(c, Mapping) else getattr(c, name, default)
    return default if value is None else value


def _unknown_node(name: str, nodes_cfg: Mapping[str, Any]) -> str:
    """A node without a type is one the recipe does not have: an override of a mistyped name
    (`graph.actor_trian.mesh=1`) makes it. Its name, the recipe's nodes and the likely one."""
    known = [n for n, c in nodes_cfg.items() if _field(c, "type", "")]
    return (f"node '{name}': the recipe has no node of that name (graph.{name} sets no type); its nodes: "
            f"{', '.join(known) or 'none'}{did_you_mean(name, known, 'graph.')} (a new node needs graph.{name}.type: "
            f"{' | '.join(node_kinds())})")


def build_graph(
    nodes_cfg: Mapping[str, Any],
    dataset_keys: Sequence[str],
    n_devices: int,
    reward_fns: Sequence[str] = (),
) -> Graph:
    """Validate the recipe's `graph:` section and return the graph, or raise GraphError."""
    problems: list[str] = []
    nodes: dict[str, Node] = {}
    for name, c in nodes_cfg.items():
        key = f"graph.{name}"
        ntype, role = _field(c, "type", ""), _field(c, "role")
        kind = node_kinds().get(ntype)
        if kind is None and not ntype:
            problems.append(_unknown_node(name, nodes_cfg))
        elif kind is None:
            problems.append(f"node '{name}': unknown type {ntype!r} ({key}.type); expected one of {', '.join(node_kinds())}")
        elif kind.roles and role not in ROLES:
            problems.append(f"node '{name}': unknown model role {role!r} ({key}.role); expected one of {', '.join(ROLES)}")
        elif kind.roles and role not in kind.roles:
            problems.append(f"node '{name}': a {ntype} node runs on role {' or '.join(kind.roles)}, not {role!r} ({key}.role)")
        elif not kind.roles and role is not None:
            problems.append(f"node '{name}': a {ntype} node has no model role ({key}.role={role!r})")
        if ntype == "reward" and reward_fns and _field(c, "fn") not in reward_fns and ":" not in str(_field(c, "fn")):
            problems.append(f"node '{name}': unknown reward function {_field(c, 'fn')!r} ({key}.fn); "
                            f"expected one of {', '.join(reward_fns)}, or 'module:function'")
        mesh = None
        if kind is not None and kind.roles:
            if _field(c, "mesh") is None:
                problems.append(f"node '{name}': needs a mesh ({key}.mesh), e.g. '0'")
            else:
                mesh, problem = parse_mesh(_field(c, "mesh"), f"node '{name}' ({key}.mesh)")
                if problem:
                    problems.append(problem)
                elif mesh[-1] >= n_devices:
                    problems.append(
                        f"node '{name}': mesh {_field(c, 'mesh')!r} ({key}.mesh) uses device {mesh[-1]} "
                        f"but the cluster has {n_devices} (cluster.n_nodes × cluster.n_devices)"
                    )
                    mesh = None
        layout = None
        if kind is not None and kind.roles and not kind.streaming and mesh is not None:
            layout = _layout(name, _field(c, "parallel"), len(mesh), problems)
        nodes[name] = Node(
            name=name,
            type=ntype,
            role=role,
            inputs=tuple(_field(c, "inputs", ())),
            outputs=tuple(_field(c, "outputs", ())),
            keys=tuple(dict(_field(c, "keys", {})).items()),
            mesh=mesh,
            micro_batch_tokens=int(_field(c, "micro_batch_tokens", 8192)),
            row_tokens=None if _field(c, "row_tokens") is None else int(_field(c, "row_tokens")),
            engine=_field(c, "engine", "torch"),
            layout=layout,
            workers=int(_field(c, "workers", 1)),
            fn=_field(c, "fn", ""),
            timeout=float(_field(c, "timeout", 30.0)),
            scale=float(_field(c, "scale", 1.0)),
            bias=float(_field(c, "bias", 0.0)),
            clip=None if _field(c, "clip") is None else float(_field(c, "clip")),
            weights=tuple((k, float(w)) for k, w in dict(_field(c, "weights", {})).items()),
            model=_field(c, "model"),
            template=_field(c, "template"),
            chat_template=bool(_field(c, "chat_template", False)),
            max_new_tokens=_field(c, "max_new_tokens"),
            temperature=float(_field(c, "temperature", 0.0)),
            env=_field(c, "env"),
            env_settings=tuple(dict(_field(c, "env_settings", {}) or {}).items()),
            max_turns=int(_field(c, "max_turns", 4)),
            max_trajectory_tokens=_field(c, "max_trajectory_tokens"),
            env_error_share=float(_field(c, "env_error_share", 0.5)),
            agent=_field(c, "agent"),
            agent_wall_seconds=float(_field(c, "agent_wall_seconds", 120.0)),
            agent_retries=int(_field(c, "agent_retries", 1)),
            agent_roles=tuple(str(r) for r in _field(c, "agent_roles", ()) or ()),
        )
        problems += _judge_setting_problems(nodes[name], _field(c, "parallel"))
        if nodes[name].env is not None and (ntype != "generate" or role != "actor"):
            problems.append(f"node '{name}': env ({key}.env) is for the policy's generate node (type generate, "
                            "role actor), which takes the turns")
        if nodes[name].agent is not None and (ntype != "generate" or role != "actor"):
            problems.append(f"node '{name}': agent ({key}.agent) is for the policy's generate node (type generate, "
                            "role actor), whose rollouts it runs")
        if nodes[name].agent is not None and nodes[name].env is not None:
            problems.append(f"node '{name}': {key}.env and {key}.agent both run its rollouts: set one of them")

    producers = _check_keys(nodes, dataset_keys, problems)
    meaning = {k: TEXT for k in dataset_keys} | {k: nodes[p].meaning_of_output(k) for k, p in producers.items()}
    order = _topological_order(nodes, producers, problems)
    for n in nodes.values():
        if n.kind is not None:
            _check_node(n, n.kind, nodes, producers, meaning, problems)
    _check_loss_mask(nodes, meaning, problems)
    _check_shape(nodes, problems)
    _check_meshes(nodes, problems)
    _check_engines(nodes, problems)
    if problems:
        raise GraphError(problems)
    return Graph(nodes=nodes, order=order, producers=producers, dataset_keys=tuple(dataset_keys), meaning=meaning)


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
    read = {k for n in nodes.values() for k in n.inputs}
    for n in nodes.values():
        if n.outputs and not read & set(n.outputs):  # it would run for nothing, e.g. a ref node nobody reads
            them = "it" if len(n.outputs) == 1 else "them"
            problems.append(f"node '{n.name}' writes {', '.join(map(repr, n.outputs))} (graph.{n.name}.outputs) but no "
                            f"node reads {them}: list {them} in the inputs of the node that uses {them}, or remove "
                            f"the node (~graph.{n.name})")
    return producers


def _check_loss_mask(nodes: dict[str, Node], meaning: dict[str, str], problems: list[str]) -> None:
    """A generate node that takes turns writes loss_mask, and every node training the policy reads
    it: without it an environment's observations would be trained as if the policy wrote them."""
    policy = next((n for n in nodes.values() if n.takes_turns), None)
    if policy is None:
        return
    what = f"an agent (graph.{policy.name}.agent)" if policy.agent else f"an environment (graph.{policy.name}.env)"
    if not any(meaning.get(k) == "loss_mask" for k in policy.outputs):
        problems.append(f"node '{policy.name}': with {what} it must write "
                        f"loss_mask: add it to graph.{policy.name}.outputs")
        return
    for n in nodes.values():
        if n.type == "train" and n.role == "actor" and not any(meaning.get(k) == "loss_mask" for k in n.inputs):
            problems.append(f"node '{n.name}': graph.{policy.name} takes turns with {what}, so the policy's "
                            f"train node must read loss_mask (add it to graph.{n.name}.inputs): observations are "
                            "not the policy's tokens")


def _check_node(n: Node, kind: NodeKind, nodes: dict[str, Node], producers: dict[str, str], meaning: dict[str, str],
                problems: list[str]) -> None:
    """The keys one node reads and writes, by meaning, against its kind's spec."""
    where = f"graph.{n.name}"
    if n.type not in RUNTIME_KINDS:
        problems.append(f"node '{n.name}': type {n.type!r} ({where}.type) is a registered node kind that no process "
                        f"of this version runs (they run {', '.join(RUNTIME_KINDS)})")
    for known, name in n.keys:
        if known not in kind.writes or kind.outputs_mean is not None:
            problems.append(f"node '{n.name}': {where}.keys maps {known!r}, which a {n.type} node does not write "
                            f"(it writes {', '.join(kind.writes) or 'nothing'})")
        elif name not in n.outputs:
            problems.append(f"node '{n.name}': {where}.keys maps {known!r} to {name!r}, which is not one of its outputs")
    if kind.n_outputs is not None and len(n.outputs) != kind.n_outputs:
        problems.append(f"node '{n.name}': a {n.type} node writes exactly {kind.n_outputs} key ({where}.outputs has "
                        f"{list(n.outputs)})")
    written = [n.meaning_of_output(k) for k in n.outputs]
    for k, m in zip(n.outputs, written):
        owner = dict(kind.role_writes).get(m)
        if m not in kind.writes:
            problems.append(f"node '{n.name}': a {n.type} node writes {' or '.join(kind.writes) or 'nothing'}, not {k!r} "
                            f"({where}.outputs; name a well-known key differently with {where}.keys)")
        elif owner is not None and n.role != owner:
            problems.append(f"node '{n.name}': {m} come from an {n.type} node with role {owner}, "
                            f"not {n.role!r} ({where}.role)")
    if len(set(written)) < len(written):
        problems.append(f"node '{n.name}': writes one meaning twice ({where}.outputs={list(n.outputs)})")
    for m in kind.must_write:
        if m not in written:
            problems.append(f"node '{n.name}': a {n.type} node must write {m} ({where}.outputs)")

    read = [meaning[k] for k in n.inputs if k in meaning]
    _check_dataset_fields(n, kind, read, meaning, problems)
    for k in n.inputs:
        m = meaning.get(k)
        if m not in (None, TEXT) and m not in kind.reads + kind.may_read:
            problems.append(f"node '{n.name}' ({n.type}) reads {k!r} ({m}), which it does not use ({where}.inputs)")
    missing = [m for m in kind.reads if m not in read]
    if missing:
        names = ["the output of a reward node" if m == "rewards" else m for m in missing]
        problems.append(f"node '{n.name}': a {n.type} node must read {', '.join(names)} ({where}.inputs)")
    if kind.weighted:
        weights = dict(n.weights)
        if len(n.inputs) < 2 or set(weights) != set(n.inputs):
            problems.append(f"node '{n.name}': a {n.type} node reads two or more {' or '.join(kind.reads + kind.may_read)} "
                            "and gives each a weight "
                            f"({where}.weights must have exactly the keys of {where}.inputs)")
    else:
        twice = sorted({m for m in read if m != TEXT and read.count(m) > 1})
        if twice:
            problems.append(f"node '{n.name}' reads more than one {', '.join(twice)} ({where}.inputs): "
                            "add a combine node that weighs them into one key")
    if n.streaming:
        for k in n.inputs:
            src = producers.get(k)
            if src and not nodes[src].streaming:
                streaming = [t for t, spec in node_kinds().items() if spec.streaming]
                batch = [t for t in node_kinds() if t not in streaming]
                problems.append(
                    f"node '{n.name}' ({n.type}) reads '{k}' from batch node '{src}' ({where}.inputs): "
                    f"streaming nodes ({', '.join(streaming)}) run before batch nodes ({', '.join(batch)})"
                )


def _check_dataset_fields(n: Node, kind: NodeKind, read: list[str], meaning: dict[str, str],
                          problems: list[str]) -> None:
    """How many dataset fields a node reads: its kind's one (none when it reads its reference from
    a judge instead), or one or more (a judge's template)."""
    where, fields = f"graph.{n.name}", [k for k in n.inputs if meaning.get(k) == TEXT]
    judged = [m for m in read if m in kind.reference_from]
    if judged and fields:
        problems.append(f"node '{n.name}': a {n.type} node compares the answer with one reference: dataset field "
                        f"{fields[0]!r} or a judge's {judged[0]}, not both ({where}.inputs)")
    elif kind.any_dataset_fields and not fields:
        problems.append(f"node '{n.name}': a {n.type} node of role {n.role} reads one or more dataset fields, "
                        f"{kind.dataset_field} ({where}.inputs has none)")
    elif not judged and not kind.any_dataset_fields and len(fields) != (1 if kind.dataset_field else 0):
        problems.append(f"node '{n.name}': a {n.type} node reads "
                        + (f"exactly one dataset field, {kind.dataset_field}" if kind.dataset_field else "no dataset field")
                        + f" ({where}.inputs has {fields or 'none'})")


JUDGE_SETTINGS = {"template": None, "model": None, "chat_template": False, "max_new_tokens": None, "temperature": 0.0}
"""The NodeConfig fields only a judge reads, with their defaults."""


def _judge_setting_problems(n: Node, parallel: Any) -> list[str]:
    """A judge's own settings: its template is required and it has no parallel layout; no other node has them."""
    where = f"graph.{n.name}"
    if n.judge:
        return ([f"node '{n.name}': a judge needs a prompt template ({where}.template)"] if not n.template else []) + (
            [f"node '{n.name}': {where}.parallel: a judge runs one generation server per device of its mesh (no "
             "tensor parallel for judges in this version)"] if parallel is not None else [])
    given = [f"{where}.{k}" for k, default in JUDGE_SETTINGS.items() if getattr(n, k) != default]
    if not given:
        return []
    policy = "; the policy's are dataset.prompt_template, model.path and algorithm.*" if n.type == "generate" else ""
    return [f"node '{n.name}': {', '.join(given)}: a judge's setting{'s' * (len(given) > 1)} (role judge){policy}"]


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


def _check_shape(nodes: dict[str, Node], problems: list[str]) -> None:
    """What this runtime can run: one generate node of the actor (the policy), one train node of the actor."""
    by_type = {t: [n for n in nodes.values() if n.type == t] for t in node_kinds()}
    policies = [n.name for n in by_type["generate"] if n.role == "actor"]
    if len(policies) == 0:
        problems.append("the graph needs exactly one generate node with role actor (the policy), found 0")
    elif len(policies) > 1:
        problems.append(f"the graph needs exactly one generate node with role actor (the policy), found "
                        f"{len(policies)} ({', '.join(map(repr, policies))}): two trained policies are not supported "
                        f"in this version; a frozen model's generate node is role judge (graph.{policies[1]}.role)")
    if not by_type["reward"]:
        problems.append("the graph needs a reward node (type: reward) to write the rewards the train node reads")
    trains = {role: [n.name for n in by_type["train"] if n.role == role] for role in ("actor", "critic")}
    if len(trains["actor"]) != 1:
        problems.append(f"the graph needs exactly one train node with role actor, found {len(trains['actor'])}")
    if len(trains["critic"]) > 1:
        problems.append(f"the graph has {len(trains['critic'])} train nodes with role critic "
                        f"({', '.join(trains['critic'])}): at most one")


def _actor_train(nodes: Mapping[str, Node]) -> Node | None:
    """The actor's train node, whose mesh is the trainer ranks'; None in a graph without one (refused)."""
    return next((n for n in nodes.values() if n.type == "train" and n.role == "actor"), None)


def _own_mesh(nodes: Mapping[str, Node]) -> list[Node]:
    """The batch nodes placed off the trainer mesh that may be: inference nodes of a role no train
    node trains (ref), whose weights never change, so a replica elsewhere computes what a trainer
    rank would; and a critic's inference and train nodes together on one mesh of their own, whose
    process computes the values and trains on them."""
    train = _actor_train(nodes)
    if train is None or train.mesh is None:
        return []
    trained = {n.role: n for n in nodes.values() if n.type == "train"}
    critic = trained.get("critic")
    apart = (critic is not None and critic.mesh is not None and critic.mesh != train.mesh
             and all(n.mesh == critic.mesh for n in nodes.values() if n.type == "inference" and n.role == "critic"))
    return [n for n in nodes.values() if n.type in ("inference", "train") and n.mesh is not None
            and n.mesh != train.mesh
            and ((n.type == "inference" and n.role not in trained)
                 or (apart and n.role == "critic" and n.mesh == critic.mesh))]


def _check_meshes(nodes: dict[str, Node], problems: list[str]) -> None:
    """Generation and training share devices only as a whole (the same mesh: colocated, taking
    turns); batch nodes share one trainer mesh, but for an inference node of a frozen role, which
    may run on a mesh of its own that no other node uses; a judge's mesh is always its own."""
    placed = [n for n in nodes.values() if n.mesh is not None]
    own = {n.name for n in _own_mesh(nodes)} | {n.name for n in nodes.values() if n.judge}
    for i, a in enumerate(placed):
        for b in placed[i + 1:]:
            shared = set(a.mesh) & set(b.mesh)
            if shared and a.role == b.role == "critic" and a.mesh == b.mesh and not a.streaming and not b.streaming:
                continue  # the critic's values and its training: one process, on one mesh
            if shared and (a.name in own or b.name in own):
                mine, other = (a, b) if a.judge or (a.name in own and not b.judge) else (b, a)
                problems.append(
                    f"node '{mine.name}': mesh {format_mesh(mine.mesh)} (graph.{mine.name}.mesh) shares device(s) "
                    f"{format_mesh(sorted(shared))} with '{other.name}' ({format_mesh(other.mesh)}): {_why_apart(mine)}"
                )
            elif a.streaming != b.streaming and shared and a.mesh != b.mesh:
                problems.append(
                    f"meshes of '{a.name}' ({format_mesh(a.mesh)}) and '{b.name}' ({format_mesh(b.mesh)}) overlap "
                    f"on device(s) {format_mesh(sorted(shared))}: generation and training share devices only when "
                    f"their meshes are the same (colocated), otherwise each needs its own (graph.{b.name}.mesh)"
                )
    train = _actor_train(nodes)
    if train is None or train.mesh is None:
        return
    for n in placed:
        if not n.streaming and n.name not in own and n.mesh != train.mesh:
            problems.append(
                f"meshes of batch nodes '{n.name}' ({format_mesh(n.mesh)}) and '{train.name}' "
                f"({format_mesh(train.mesh)}) differ (graph.{n.name}.mesh): {_why_on_trainer(n)}"
            )


def _why_apart(n: Node) -> str:
    if n.role == "critic":
        return "a critic on a mesh of its own trains in a process of its own, on devices no other node uses"
    if n.judge:
        return "a judge's generation servers hold its model and KV cache for the whole run, on devices no other node uses"
    return "an inference node on a mesh of its own needs devices that no other node uses"


def _why_on_trainer(n: Node) -> str:
    if n.role == "critic":
        return ("a critic's inference and train nodes run together: both on the trainer mesh, or both on one mesh of "
                "their own (graph.<node>.mesh the same for both)")
    if n.type == "inference":
        return (f"role {n.role!r} is trained, so its inference node runs on the trainer ranks, with the weights they "
                "train; only an inference node of a frozen role (ref) or a critic may have a mesh of its own")
    return "the actor's train nodes run on the trainer ranks, on one mesh"


ENGINES = {"torch": None, "megatron": None}
"""Training engines by name -> why one cannot be used yet (None: it can)."""


def _layout(name: str, spec: Any, mesh_size: int, problems: list[str]) -> Layout | None:
    """The batch node's parallel layout (default: all data parallel), checked against its mesh."""
    where = f"node '{name}' (graph.{name}.parallel)"
    if spec is None:
        return Layout(dp=mesh_size)
    try:
        layout = parse_layout(spec, where)
    except ValueError as exc:
        problems.append(str(exc))
        return None
    problems.extend(layout_problems(layout, n_devices=mesh_size, model=None, where=where))
    return layout


def _check_engines(nodes: dict[str, Node], problems: list[str]) -> None:
    """A role's batch nodes share one model, so they name one engine, and one that exists."""
    by_role: dict[str, Node] = {}
    own = {n.name for n in _own_mesh(nodes)}
    for n in nodes.values():
        if n.kind is None or n.kind.streaming:  # engines are the batch nodes'
            continue
        if n.engine not in ENGINES:
            problems.append(f"node '{n.name}': unknown engine {n.engine!r} (graph.{n.name}.engine); "
                            f"expected one of {', '.join(ENGINES)}")
        elif ENGINES[n.engine]:
            problems.append(f"node '{n.name}': engine {n.engine!r} (graph.{n.name}.engine) is not implemented in "
                            f"this version: {ENGINES[n.engine]}")
        elif n.name in own and n.engine != "torch":
            problems.append(f"node '{n.name}': engine {n.engine!r} (graph.{n.name}.engine) on a mesh of its own: its "
                            "inference processes run engine 'torch', one replica per device")
        elif n.name in own and n.layout is not None and (n.layout.tp > 1 or n.layout.pp > 1):
            problems.append(f"node '{n.name}': layout {n.layout} (graph.{n.name}.parallel) splits the model on a mesh "
                            "of its own: its inference processes are independent replicas, one per device (data "
                            "parallel only)")
        elif n.engine != "megatron" and n.layout is not None and (n.layout.tp > 1 or n.layout.pp > 1):
            problems.append(f"node '{n.name}': layout {n.layout} (graph.{n.name}.parallel) splits the model, which "
                            f"engine {n.engine!r} cannot: tensor and pipeline parallel need engine: megatron")
        elif n.engine == "megatron" and n.row_tokens is not None:
            problems.append(f"node '{n.name}': row_tokens={n.row_tokens} (graph.{n.name}.row_tokens) is for engine "
                            "'torch'; the megatron engine packs each micro-batch as one THD row")
        first = by_role.setdefault(n.role, n)
        if first.engine != n.engine:
            problems.append(f"nodes '{first.name}' and '{n.name}' run role {n.role!r} on different engines "
                            f"({first.engine!r}, {n.engine!r}; graph.{n.name}.engine): a role has one model")
    # A batch node's, placed on the trainer mesh (a node on a mesh of its own has replicas, not ranks).
    batch = [n for n in nodes.values() if n.layout is not None and n.name not in own]
    for n in batch[1:]:
        if n.layout != batch[0].layout:
            problems.append(f"batch nodes '{batch[0].name}' ({batch[0].layout}) and '{n.name}' ({n.layout}) have "
                            f"different layouts (graph.{n.name}.parallel): the trainer ranks hold one layout")


def graph_from_config(cfg: Any, reward_fns: Sequence[str] = ()) -> Graph:
    """The validated graph of a run config. `reward_fns`: the built-in reward functions a reward
    node may name, checked when given; the launcher passes them (`rewards/` sits above `graph/`),
    so the processes of a run, whose config it checked, need not."""
    n_devices = cfg.cluster.n_nodes * cfg.cluster.n_devices
    return build_graph(cfg.graph, list(cfg.dataset.fields), n_devices, reward_fns)
