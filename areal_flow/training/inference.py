"""An inference process: one replica of an inference node on a mesh of its own (a frozen role:
ref, or a critic apart; graph/dag.py `own_mesh_nodes`, docs/architecture.md).

It loads the role's model from the run's model on its one device, as a trainer rank would build
it but with no process group and no optimizer, tells the controller it is ready, then serves: it
waits for an InferRequest, takes every other one queued by then, computes the node's output for
all of their samples in one packed call (`node_outputs`, as a trainer rank computes a node on its
own mesh) and sends one Inferred per group to the trainer rank that holds the group, which joins
it (training/join.py). Replicas are independent: the reward worker picks one per group
(graph/placement.py `replica_of`). A frozen role's weights never change, so nothing is published
here. A critic's process also trains the critic on each step's batch (training/critic.py).
"""

from __future__ import annotations

import logging
import time
from typing import Callable

import numpy as np
import torch
import torch.distributed as dist
import zmq

from areal_flow.config.schema import RunConfig
from areal_flow.graph.dag import Graph, graph_from_config
from areal_flow.graph.node import Node
from areal_flow.graph.placement import infer_name
from areal_flow.runtime.devices import TRAINER_BACKENDS
from areal_flow.runtime.security import LOOPBACK
from areal_flow.runtime.spec import RunSpec
from areal_flow.training.build import node_outputs, optim_spec, torch_engine
from areal_flow.training.critic import CriticTrainer
from areal_flow.training.engine import budget_named
from areal_flow.transport.channels import make_socket, recv_blocking, send_blocking
from areal_flow.transport.messages import Array, CriticBatch, InferRequest, Inferred, Ready, SaveCheckpoint

log = logging.getLogger("areal_flow.inference")


def node_of(graph: Graph, name: str, replica: int) -> Node:
    """The node on a mesh of its own whose replica `replica` this process (`name`) is."""
    node = next((n for n in graph.own_mesh_nodes if infer_name(n.name, replica) == name), None)
    if node is None:
        own = ", ".join(n.name for n in graph.own_mesh_nodes) or "none"
        raise RuntimeError(f"{name}: no inference node on a mesh of its own has replica {replica} under this name "
                           f"(nodes on a mesh of their own: {own})")
    return node


def answers(requests: list[InferRequest], outputs: list[np.ndarray], key: str, worker: str,
            seconds: float) -> list[Inferred]:
    """One Inferred per request, from one call's `outputs` (the requests' samples in order). Each
    group's share of the call's `seconds` goes by its answer tokens."""
    ends = np.cumsum([len(r.indices) for r in requests]).tolist()
    per_group = [outputs[end - len(r.indices):end] for r, end in zip(requests, ends)]
    tokens = [sum(len(o) for o in group) for group in per_group]
    total = sum(tokens)
    return [Inferred(r.group_id, r.node, key, list(r.indices), [Array.of(o) for o in group], worker,
                     seconds * (n / total if total else 1 / len(requests)))
            for r, group, n in zip(requests, per_group, tokens)]


class InferenceWorker:
    def __init__(self, cfg: RunConfig, spec: RunSpec, name: str, replica: int):
        self.name = name
        self.graph = graph_from_config(cfg)
        self.node = node_of(self.graph, name, replica)
        apart = self.graph.critic_apart
        trains = apart is not None and apart.role == self.node.role
        # A critic on several devices trains data parallel over its processes (FSDP2, as the trainer
        # ranks do); a frozen role's replicas are independent.
        group = None
        if trains and len(self.node.mesh) > 1:
            dist.init_process_group(TRAINER_BACKENDS[cfg.cluster.device_type], init_method=(
                f"tcp://{spec.hosts.get(infer_name(self.node.name, 0), LOOPBACK)}:{spec.infer_dist_ports[self.node.name]}"),
                rank=replica, world_size=len(self.node.mesh))
            group = dist.group.WORLD
        self.engine = torch_engine(cfg, spec, self.node.role, optim=optim_spec(cfg, apart.role) if trains else None,
                                   process_group=group)
        # Sharded weights cannot answer a request alone: values from a whole copy (training/critic.py).
        values = torch_engine(cfg, spec, self.node.role, optim=None, process_group=None) if group is not None else None
        self.critic = CriticTrainer(cfg, spec, self.engine, apart, name, values) if trains else None
        ctx = zmq.Context()
        self.inbox = make_socket(ctx, zmq.PULL, bind=spec.endpoint(name, spec.infer_ports[self.node.name][replica]),
                                 security=spec.security)
        self.ranks = [make_socket(ctx, zmq.PUSH, connect=spec.endpoint(f"trainer{r}", p), security=spec.security)
                      for r, p in enumerate(spec.trainer_ports)]
        self.control = make_socket(ctx, zmq.DEALER, connect=spec.endpoint("controller", spec.controller_port),
                                   identity=name, security=spec.security)

    def run(self, stop: Callable[[], bool] = lambda: False) -> None:
        """Serve until the launcher stops the process (or `stop()` is true: a test's thread)."""
        send_blocking(self.control, Ready(self.name))
        log.info("%s: replica of node '%s' (role %s) ready", self.name, self.node.name, self.node.role)
        while not stop():
            if self.inbox.poll(1000) and (requests := self.take()):
                self.answer(requests)

    def answer(self, requests: list[InferRequest]) -> None:
        """Serve `requests` in one call and send each result to its trainer rank."""
        for rank, msg in self.serve(requests):
            send_blocking(self.ranks[rank], msg)

    def take(self) -> list[InferRequest]:
        """Every request queued on the inbox now: they go through the model in one call. A critic's
        process trains as each step's batch completes, and writes its checkpoint part, on the way."""
        requests = []
        while self.inbox.poll(0):
            msg = recv_blocking(self.inbox, f"{self.name} inbox")
            if isinstance(msg, InferRequest) and msg.node == self.node.name:
                requests.append(msg)
            elif self.critic is not None and isinstance(msg, CriticBatch):
                if requests:  # values asked before this update come from the critic before it
                    self.answer(requests)
                    requests = []
                if (done := self.critic.batch(msg)) is not None:
                    for rank in self.ranks:
                        send_blocking(rank, done)
            elif self.critic is not None and isinstance(msg, SaveCheckpoint):
                send_blocking(self.ranks[0], self.critic.save(msg))
            elif msg is not None:
                log.error("%s: a %s on the inbox is not a request for node '%s', dropped", self.name,
                          getattr(msg, "node", type(msg).__name__), self.node.name)
        return requests

    def serve(self, requests: list[InferRequest]) -> list[tuple[int, Inferred]]:
        """The node's output for every request's samples in one call: (trainer rank, result) per group."""
        t0 = time.perf_counter()
        node = self.node
        with budget_named(f"graph.{node.name}.micro_batch_tokens", node.micro_batch_tokens, self.engine.device):
            engine = self.critic.values if self.critic is not None else self.engine
            outputs = node_outputs(engine, self.graph, node, [a for r in requests for a in r.inputs])
        seconds = time.perf_counter() - t0
        results = answers(requests, outputs, node.outputs[0], self.name, seconds)
        log.info("%s: %s of groups %s for ranks %s (%d sequences, %d answer tokens) in %.3f s", self.name,
                 node.outputs[0], [r.group_id for r in requests], sorted({r.rank for r in requests}), len(outputs),
                 sum(len(o) for o in outputs), seconds)
        return [(r.rank, msg) for r, msg in zip(requests, results)]


def main(cfg: RunConfig, spec: RunSpec, name: str, rank: int) -> None:
    torch.manual_seed(cfg.seed)
    InferenceWorker(cfg, spec, name, rank).run()
