"""Where the graph's nodes run: meshes that share devices only as a whole, the batch nodes on the
trainer ranks (but for the nodes that may have a mesh of their own), and one training engine and
parallel layout each role's model can run with.
"""

from __future__ import annotations

from typing import Mapping

from areal_flow.graph.mesh import format_mesh
from areal_flow.graph.node import Node


ENGINES = {"torch": None, "megatron": None}
"""Training engines by name -> why one cannot be used yet (None: it can)."""


def actor_train(nodes: Mapping[str, Node]) -> Node | None:
    """The actor's train node, whose mesh is the trainer ranks'; None in a graph without one (refused)."""
    return next((n for n in nodes.values() if n.type == "train" and n.role == "actor"), None)


def own_mesh(nodes: Mapping[str, Node]) -> list[Node]:
    """The batch nodes placed off the trainer mesh that may be: inference nodes of a role no train
    node trains (ref), whose weights never change, so a replica elsewhere computes what a trainer
    rank would; and a critic's inference and train nodes together on one mesh of their own, whose
    process computes the values and trains on them."""
    train = actor_train(nodes)
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


def check_meshes(nodes: dict[str, Node], problems: list[str]) -> None:
    """Generation and training share devices only as a whole (the same mesh: colocated, taking
    turns); batch nodes share one trainer mesh, but for an inference node of a frozen role, which
    may run on a mesh of its own that no other node uses; a judge's mesh is always its own."""
    placed = [n for n in nodes.values() if n.mesh is not None]
    own = {n.name for n in own_mesh(nodes)} | {n.name for n in nodes.values() if n.judge}
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
    train = actor_train(nodes)
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

def check_engines(nodes: dict[str, Node], problems: list[str]) -> None:
    """A role's batch nodes share one model, so they name one engine, and one that exists."""
    by_role: dict[str, Node] = {}
    own = {n.name for n in own_mesh(nodes)}
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
