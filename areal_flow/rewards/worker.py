"""The reward worker: scores generated groups and sends them on to the trainer rank the controller
chooses. It runs the graph's reward and combine nodes in graph order on every sample (the reward
functions in the reward service's worker processes, many samples and groups at once), reports the
scored group's metadata to the controller, and holds the samples until the controller answers with
a Route: the samples go to that rank's inbox, or are dropped (the controller's ledger says why).
For each inference node on a mesh of its own, a routed group's inputs to that node also go to one
of its replicas, which sends the node's key to the same rank (training/inference.py).
"""

from __future__ import annotations

import asyncio
import logging
import os
import time

import zmq
import zmq.asyncio

from areal_flow.config.schema import RunConfig
from areal_flow.graph.keys import AGENT_REWARD, final_turn
from areal_flow.graph.dag import Graph, graph_from_config
from areal_flow.graph.node import Node
from areal_flow.graph.placement import infer_name, replica_of
from areal_flow.models.tokenizer import load_tokenizer
from areal_flow.rewards.service import AGENT_FN, RewardService
from areal_flow.runtime.spec import RunSpec, read_spec
from areal_flow.transport.channels import make_socket, recv, send, sent_bytes
from areal_flow.transport.messages import (
    DROP,
    GeneratedGroup,
    GroupMeta,
    InferRequest,
    Joined,
    Route,
    SampleMeta,
    ScoredGroup,
    Stage,
    Trainers,
)

log = logging.getLogger("areal_flow.reward")


def reference_text(sample, graph: Graph, node: Node, judge_tokenizers: dict) -> str:
    """A reward node's reference: its dataset field, or the answer of the judge it reads, decoded
    with that judge's tokenizer."""
    key = graph.reference(node)
    if key in graph.dataset_keys:
        return sample.fields[key]
    return judge_tokenizers[graph.producers[key]].decode(sample.array(key).tolist(), skip_special_tokens=True)


async def score_group(group: GeneratedGroup, graph: Graph, tokenizer, service: RewardService,
                      judge_tokenizers: dict | None = None) -> ScoredGroup:
    """Each reward node writes its shaped reward under its output key and its statistics as
    `<node>_<stat>` (raw, timeout, error, seconds, and what the function returns); each combine
    node writes the weighted sum of its inputs; in graph order, so a combine node sees the rewards
    it weighs. The samples of a group are scored concurrently. `judge_tokenizers`: each judge's
    (by node name), which decode the answers a reward node reads as its reference."""
    output_key = graph.output(graph.generate, "output_ids")
    # A trajectory that took turns is scored on its final turn (graph/keys.py: final_turn).
    mask_key = graph.output(graph.generate, "loss_mask") if graph.generate.takes_turns else None

    async def one(sample) -> None:
        ids = sample.array(output_key).tolist()
        if mask_key is not None:
            ids = final_turn(ids, sample.array(mask_key).tolist())
        text = tokenizer.decode(ids, skip_special_tokens=True)
        for node in graph.scorers:
            if node.type != "reward":  # a combine node
                sample.scalars[node.outputs[0]] = sum(w * sample.scalars[k] for k, w in node.weights)
                continue
            if node.fn == AGENT_FN:
                score = service.given(node.name, sample.scalars[AGENT_REWARD])
            else:
                score = await service.score(node.name, text, reference_text(sample, graph, node, judge_tokenizers or {}))
            sample.scalars[node.outputs[0]] = score.reward
            sample.scalars.update({f"{node.name}_{k}": v for k, v in {"raw": score.raw, **score.stats}.items()})
        sample.stage = Stage.SCORED

    await asyncio.gather(*(one(s) for s in group.samples))
    return ScoredGroup(group.group_id, group.samples)


def infer_requests(group: ScoredGroup, rank: int, nodes: list[Node]) -> list[InferRequest]:
    """For each node on a mesh of its own, what its replica needs to compute the node's key for a
    group routed to trainer rank `rank`: only the arrays the node reads."""
    return [InferRequest.for_group(group, rank, n.name, n.inputs) for n in nodes]


class RewardWorker:
    def __init__(self, cfg: RunConfig, spec: RunSpec, name: str):
        self.name = name
        self.graph = graph_from_config(cfg)
        self.tokenizer = load_tokenizer(spec.model_path)
        self.judge_tokenizers = {node: load_tokenizer(path) for node, path in spec.judge_models.items()}
        self.versions_key = self.graph.output(self.graph.generate, "versions")
        ctx = zmq.asyncio.Context()
        self.inbox = make_socket(ctx, zmq.PULL, connect=[spec.endpoint(f"rollout{i}", p) for i, p in enumerate(spec.rollout_ports)],
                                 security=spec.security)
        self.controller = make_socket(ctx, zmq.DEALER, connect=spec.endpoint("controller", spec.controller_port), identity=name,
                                      security=spec.security)
        self.ctx, self.run_dir = ctx, spec.run_dir
        self.ranks = self.connect_ranks(spec)
        # Each node on a mesh of its own -> its replicas' inboxes.
        self.replicas = {node: [make_socket(ctx, zmq.PUSH, connect=spec.endpoint(infer_name(node, i), p),
                                            security=spec.security) for i, p in enumerate(ports)]
                         for node, ports in spec.infer_ports.items()}
        self.held: dict[int, ScoredGroup] = {}  # scored, waiting for the controller's Route
        self.service = RewardService(self.graph.rewards, cfg.sandbox)
        self.tasks: set[asyncio.Task] = set()

    async def score(self) -> None:
        log.info("%s scoring with %s", self.name, [n.name for n in self.graph.scorers])
        while True:
            msg = await recv(self.inbox, f"{self.name} inbox")
            if not isinstance(msg, GeneratedGroup):
                log.error("%s: a %s on the inbox is not a generated group, dropped", self.name, type(msg).__name__)
                continue
            task = asyncio.create_task(self.handle(msg))  # groups are scored side by side
            self.tasks.add(task)
            task.add_done_callback(self.done)

    def done(self, task: asyncio.Task) -> None:
        self.tasks.discard(task)
        if not task.cancelled() and task.exception() is not None:
            # Scoring never raises for what a sample holds (the service scores that 0): this is a
            # reward node's pool that could not be rebuilt (RewardPoolError, which names it) or a
            # bug. Stop the process, which the launcher reports, rather than stall the run.
            log.error("%s: scoring a group failed", self.name, exc_info=task.exception())
            os._exit(1)

    async def handle(self, msg: GeneratedGroup) -> None:
        scored = await score_group(msg, self.graph, self.tokenizer, self.service, self.judge_tokenizers)
        self.held[scored.group_id] = scored
        meta = [SampleMeta.of(s, self.versions_key) for s in scored.samples]
        traffic = {**msg.traffic, self.name: sent_bytes()}
        times = {**msg.times, "scored": time.time()}
        await send(self.controller, GroupMeta(scored.group_id, self.name, meta, traffic, times, msg.problem))

    def connect_ranks(self, spec: RunSpec) -> list[zmq.asyncio.Socket]:
        """A PUSH socket to each trainer rank's inbox."""
        return [make_socket(self.ctx, zmq.PUSH, connect=spec.endpoint(f"trainer{r}", p), security=spec.security)
                for r, p in enumerate(spec.trainer_ports)]

    def resized(self, n_trainers: int) -> None:
        """The trainer ranks were resized: send to the new ones (spec.json lists them). Every group
        routed to an old rank reached it before its checkpoint, so nothing waits on the old sockets."""
        spec = read_spec(self.run_dir)
        if spec.n_trainers != n_trainers:
            raise RuntimeError(f"{self.name}: the controller resized the trainers to {n_trainers} ranks, but "
                               f"{self.run_dir}/spec.json lists {spec.n_trainers}")
        for sock in self.ranks:
            sock.close(linger=0)
        self.ranks = self.connect_ranks(spec)
        log.info("%s: sending scored groups to %d trainer rank(s) from here", self.name, n_trainers)

    async def forward(self) -> None:
        while True:
            msg = await recv(self.controller, f"{self.name} controller")
            if isinstance(msg, Trainers):
                self.resized(msg.n_trainers)
                continue
            if not isinstance(msg, Route) or msg.group_id not in self.held:
                log.error("%s: %s from the controller matches no scored group here, dropped", self.name, msg)
                continue
            group = self.held.pop(msg.group_id)
            if msg.rank == DROP:
                # Dynamic filtering drops groups by design; a real fault is logged by the controller.
                log.info("%s: the controller dropped group %d (its ledger says why)", self.name, msg.group_id)
            else:
                await send(self.ranks[msg.rank], group)
                for request in infer_requests(group, msg.rank, self.graph.own_mesh_nodes):
                    replicas = self.replicas[request.node]
                    await send(replicas[replica_of(group.group_id, len(replicas))], request)

    async def run(self) -> None:
        await send(self.controller, Joined(self.name))  # again after a restart: the controller has the groups resent
        try:
            await asyncio.gather(self.score(), self.forward())
        finally:
            self.service.close()


def main(cfg: RunConfig, spec: RunSpec, name: str, rank: int) -> None:
    async def run() -> None:  # sockets are made inside the loop they belong to
        await RewardWorker(cfg, spec, name).run()

    asyncio.run(run())
