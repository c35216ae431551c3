"""One node of the recipe's graph: its settings as read from `graph.<name>`, and what can be wrong
with the node alone (its type and role, mesh, layout and the settings only some kinds read).

What a node of each type reads and writes is its kind's registered spec (`graph/keys.py`); the
rules between nodes are `dataflow.py`'s and `devices.py`'s.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any, Mapping, Sequence

from areal_flow.config.validate import did_you_mean
from areal_flow.graph.keys import ROLES, NodeKind, node_kinds
from areal_flow.graph.layout import Layout, layout_problems, parse_layout
from areal_flow.graph.mesh import parse_mesh


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
    agent_drift: str = "last_segment"  # with agent: a drifted rollout trains its last segment, or fails ("drop")
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


def read_node(name: str, c: Any, nodes_cfg: Mapping[str, Any], n_devices: int, reward_fns: Sequence[str],
              problems: list[str]) -> Node:
    """Node `name` from its config `c` (a NodeConfig or a mapping); what is wrong with it alone is
    added to `problems`, each naming the node and the recipe key (`graph.<name>.<field>`)."""
    ntype, role = _field(c, "type", ""), _field(c, "role")
    kind = node_kinds().get(ntype)
    problems += _type_problems(name, ntype, role, kind, nodes_cfg)
    if ntype == "reward" and reward_fns and _field(c, "fn") not in reward_fns and ":" not in str(_field(c, "fn")):
        problems.append(f"node '{name}': unknown reward function {_field(c, 'fn')!r} (graph.{name}.fn); "
                        f"expected one of {', '.join(reward_fns)}, or 'module:function'")
    mesh = _mesh(name, c, n_devices, problems) if kind is not None and kind.roles else None
    layout = None
    if kind is not None and kind.roles and not kind.streaming and mesh is not None:
        layout = _layout(name, _field(c, "parallel"), len(mesh), problems)
    node = _node(name, c, mesh, layout)
    problems += _judge_setting_problems(node, _field(c, "parallel"))
    problems += _rollout_problems(node)
    return node


def _node(name: str, c: Any, mesh: tuple[int, ...] | None, layout: Layout | None) -> Node:
    return Node(
        name=name,
        type=_field(c, "type", ""),
        role=_field(c, "role"),
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
        agent_drift=str(_field(c, "agent_drift", "last_segment")),
        agent_roles=tuple(str(r) for r in _field(c, "agent_roles", ()) or ()),
    )


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

def _type_problems(name: str, ntype: str, role: str | None, kind: NodeKind | None,
                   nodes_cfg: Mapping[str, Any]) -> list[str]:
    """A type that is registered, and a role that its kind runs on (none for a kind without roles)."""
    key = f"graph.{name}"
    if kind is None and not ntype:
        return [_unknown_node(name, nodes_cfg)]
    if kind is None:
        return [f"node '{name}': unknown type {ntype!r} ({key}.type); expected one of {', '.join(node_kinds())}"]
    if kind.roles and role not in ROLES:
        return [f"node '{name}': unknown model role {role!r} ({key}.role); expected one of {', '.join(ROLES)}"]
    if kind.roles and role not in kind.roles:
        return [f"node '{name}': a {ntype} node runs on role {' or '.join(kind.roles)}, not {role!r} ({key}.role)"]
    if not kind.roles and role is not None:
        return [f"node '{name}': a {ntype} node has no model role ({key}.role={role!r})"]
    return []


def _mesh(name: str, c: Any, n_devices: int, problems: list[str]) -> tuple[int, ...] | None:
    """The devices of a node that runs a model: its mesh, on the cluster's devices; None when it is wrong."""
    key = f"graph.{name}"
    if _field(c, "mesh") is None:
        problems.append(f"node '{name}': needs a mesh ({key}.mesh), e.g. '0'")
        return None
    mesh, problem = parse_mesh(_field(c, "mesh"), f"node '{name}' ({key}.mesh)")
    if problem:
        problems.append(problem)
    elif mesh[-1] >= n_devices:
        problems.append(
            f"node '{name}': mesh {_field(c, 'mesh')!r} ({key}.mesh) uses device {mesh[-1]} "
            f"but the cluster has {n_devices} (cluster.n_nodes × cluster.n_devices)"
        )
        return None
    return mesh


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

JUDGE_SETTINGS = {"template": None, "model": None, "chat_template": False, "max_new_tokens": None, "temperature": 0.0}
"""The generate node's fields only a judge reads (config/nodes.py: GenerateNodeConfig), with their defaults."""


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

def _rollout_problems(n: Node) -> list[str]:
    """An environment or an agent runs the policy's rollouts: only its generate node names one, and one of them."""
    key, policy = f"graph.{n.name}", n.type == "generate" and n.role == "actor"
    problems = []
    if n.env is not None and not policy:
        problems.append(f"node '{n.name}': env ({key}.env) is for the policy's generate node (type generate, "
                        "role actor), which takes the turns")
    if n.agent is not None and not policy:
        problems.append(f"node '{n.name}': agent ({key}.agent) is for the policy's generate node (type generate, "
                        "role actor), whose rollouts it runs")
    if n.agent is not None and n.env is not None:
        problems.append(f"node '{n.name}': {key}.env and {key}.agent both run its rollouts: set one of them")
    return problems
