"""The graph's data flow: which node writes each key, who reads it, in what order they fire, and
whether each node reads and writes what its kind (`graph/keys.py`) says, by meaning.

Each check adds what it finds to the problems `build_graph` reports at once, naming the node and
the recipe key to change.
"""

from __future__ import annotations

from typing import Sequence

from areal_flow.graph.keys import RUNTIME_KINDS, TEXT, NodeKind, node_kinds
from areal_flow.graph.node import Node


def check_keys(nodes: dict[str, Node], dataset_keys: Sequence[str], problems: list[str]) -> dict[str, str]:
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


def check_node(n: Node, kind: NodeKind, nodes: dict[str, Node], producers: dict[str, str], meaning: dict[str, str],
               problems: list[str]) -> None:
    """The keys one node reads and writes, by meaning, against its kind's spec."""
    _check_outputs(n, kind, problems)
    _check_inputs(n, kind, nodes, producers, meaning, problems)


def _check_outputs(n: Node, kind: NodeKind, problems: list[str]) -> None:
    """What a node writes: the meanings its kind writes (each once, by the role that owns it, the
    required ones all), and a `keys` map onto its own outputs."""
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


def _check_inputs(n: Node, kind: NodeKind, nodes: dict[str, Node], producers: dict[str, str],
                  meaning: dict[str, str], problems: list[str]) -> None:
    """What a node reads: its dataset fields, the meanings its kind reads (all that it must, none it
    does not use, one of each unless it weighs them) and, for a streaming node, nothing a batch node writes."""
    where = f"graph.{n.name}"
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

def check_loss_mask(nodes: dict[str, Node], meaning: dict[str, str], problems: list[str]) -> None:
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

def topological_order(nodes: dict[str, Node], producers: dict[str, str], problems: list[str]) -> list[str]:
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

def check_shape(nodes: dict[str, Node], problems: list[str]) -> None:
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
