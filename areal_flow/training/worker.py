"""A model worker: one rank of the trainer mesh, where the batch data lives.

Scored groups arrive on the rank's inbox straight from the reward workers (the controller chose
the rank), and with them the keys of inference nodes on a mesh of their own, from the inference
processes (training/inference.py), which the rank joins to its groups (training/join.py). For each
step the controller sends only ids: "train these groups; first send those to rank k". The rank
moves what it must, waits for its share, and runs the graph's trainer-mesh nodes in graph order on
it (inference nodes write their key into the samples it holds, then the train node updates the
model). Only statistics and the new weights' location go back. docs/architecture.md has the whole
life of a sample.
"""

from __future__ import annotations

import json
import logging
import time
from collections.abc import Callable
from functools import partial

import torch
import zmq

from areal_flow.algorithms.inputs import train_inputs
from areal_flow.algorithms.kl import kl_controller
from areal_flow.config.schema import RunConfig
from areal_flow.graph.dag import Graph, graph_from_config
from areal_flow.graph.placement import infer_name, replica_of
from areal_flow.metrics.profile import Phases
from areal_flow.runtime import run_dir as rd
from areal_flow.runtime.spec import RunSpec
from areal_flow.training import flight
from areal_flow.training.build import make_engines
from areal_flow.training.critic_link import CriticLink
from areal_flow.training.dumps import adapter_path, dump_due, dump_step, weights_path
from areal_flow.training.engine import Engine
from areal_flow.training.join import DuplicateResult, Join, Remote
from areal_flow.training.rank_checkpoint import RankCheckpoints
from areal_flow.training.step_runner import StepRunner
from areal_flow.training.updates import all_reduce_over, engine_data
from areal_flow.transport.channels import make_socket, recv_blocking, send_blocking, sent_bytes
from areal_flow.weights import make_channel
from areal_flow.transport.messages import (
    CriticSaved,
    CriticTrained,
    Hello,
    InferRequest,
    Inferred,
    PublishWeights,
    RunStep,
    Sample,
    SaveCheckpoint,
    Saved,
    ScoredGroup,
    StepDone,
    WeightsPublished,
)

log = logging.getLogger("areal_flow.trainer")


class ModelWorker(RankCheckpoints):
    """One trainer rank: holds scored groups, trains its share of each step on the graph's
    trainer-mesh nodes, publishes the new weights, and writes and resumes its part of checkpoints
    (rank_checkpoint.py)."""

    def __init__(self, cfg: RunConfig, spec: RunSpec, name: str, rank: int):
        self.cfg, self.spec, self.name, self.rank = cfg, spec, name, rank
        self.graph: Graph = graph_from_config(cfg)
        self.engines = make_engines(cfg, spec, self.graph, rank)
        self.held: dict[int, ScoredGroup] = {}  # scored groups on this rank, complete, not yet trained
        # Groups waiting for the key of a node on a mesh of its own, and such keys waiting for their group.
        self.join = Join([Remote(n.name, n.outputs[0], self.graph.input(n, "output_ids"))
                          for n in self.graph.own_mesh_nodes])
        self.trained_log = open(spec.path(rd.of_rank(rd.TRAINED, rank)), "a", buffering=1)
        ctx = zmq.Context()
        self.control = make_socket(ctx, zmq.DEALER, connect=spec.endpoint("controller", spec.controller_port), identity=name,
                                   security=spec.security)
        self.inbox = make_socket(ctx, zmq.PULL, bind=spec.endpoint(f"trainer{rank}", spec.trainer_ports[rank]),
                                 security=spec.security)
        self.peers = {r: make_socket(ctx, zmq.PUSH, connect=spec.endpoint(f"trainer{r}", p), security=spec.security)
                      for r, p in enumerate(spec.trainer_ports) if r != rank}
        # The replicas of nodes on a mesh of their own, to ask again for a result that does not come.
        self.replicas = {node: [make_socket(ctx, zmq.PUSH, connect=spec.endpoint(infer_name(node, i), p),
                                            security=spec.security) for i, p in enumerate(ports)]
                         for node, ports in spec.infer_ports.items()}
        self.poller = zmq.Poller()
        self.poller.register(self.control, zmq.POLLIN)
        self.poller.register(self.inbox, zmq.POLLIN)
        self.weights = make_channel(cfg, spec)  # how each version reaches the servers (areal_flow/weights/)
        self.phases = Phases()  # wait, transport, inputs, publish: the step's profile beside the engine's
        self.kl = kl_controller(cfg.algorithm)  # β toward the ref model; adaptive with kl_target
        self.runner = StepRunner(cfg, self.graph, self.engines, self.phases, self.kl, spec.n_trainers,
                                 spec.model_path)
        # A critic on a mesh of its own: its processes' inboxes are those its values are asked on.
        self.critic = CriticLink(self.graph, self.replicas, rank) if self.graph.critic_apart is not None else None
        trained = self.engines[self.graph.train.role]
        if spec.resume:
            self.resume(spec.resume)
        if "kl" in trained.extra_state:  # resumed from a checkpoint: go on with its β
            self.kl.load_state_dict(trained.extra_state["kl"])

    def run(self) -> None:
        send_blocking(self.control, Hello(self.rank))
        while True:  # until the launcher stops this process
            ready = dict(self.poller.poll())
            if self.inbox in ready:
                self.receive()
            if self.control in ready:
                msg = recv_blocking(self.control, f"{self.name} control")
                if isinstance(msg, RunStep):
                    send_blocking(self.control, self.step(msg))
                elif isinstance(msg, PublishWeights):
                    send_blocking(self.control, self.publish(msg))
                elif isinstance(msg, SaveCheckpoint):
                    self.save_checkpoint(msg)
                    send_blocking(self.control, Saved(self.rank, msg.path))
                elif msg is not None:
                    log.error("%s: a %s is not for a trainer rank, dropped", self.name, type(msg).__name__)

    def receive(self) -> None:
        with self.phases("transport"):  # counted in the next step's profile, wherever it arrives
            msg = recv_blocking(self.inbox, f"{self.name} inbox")
        if isinstance(msg, (CriticTrained, CriticSaved)):
            if self.critic is not None:
                self.critic.received(msg)
        elif isinstance(msg, Inferred):
            try:
                self.hold(self.join.result(msg))
            except DuplicateResult as e:  # a result that does not fit its group (JoinError) stops the rank
                log.error("%s: %s", self.name, e)
        elif not isinstance(msg, ScoredGroup):
            if msg is not None:
                log.error("%s: a %s on the inbox is not a scored group, dropped", self.name, type(msg).__name__)
        elif msg.group_id in self.held or msg.group_id in self.join.pending:
            log.error("%s: group %d arrived twice, the second copy dropped", self.name, msg.group_id)
        else:
            self.hold(self.join.group(msg, time.monotonic()))

    def hold(self, group: ScoredGroup | None) -> None:
        """Keep a complete group until a step trains it or moves it (None: it waits for a key)."""
        if group is not None:
            self.held[group.group_id] = group

    def wait_for(self, groups: list[int], what: str) -> None:
        """Receive until this rank holds every group of its share of `what` (e.g. 'step 3'), or fail
        naming the missing ones."""
        def missing() -> list[str]:
            lacking = [g for g in groups if g not in self.held]
            if not lacking:
                return []
            replicas = {node: len(ports) for node, ports in self.spec.infer_ports.items()}
            return self.join.lacking(lacking, replicas)

        self.receive_until(missing, what)

    def receive_until(self, missing: Callable[[], list[str]], what: str) -> None:
        """Receive until `missing()` names nothing, or fail after step_timeout naming what it still does."""
        timeout = self.cfg.step_timeout or float("inf")
        deadline = time.monotonic() + timeout
        while lacking := missing():
            left = deadline - time.monotonic()
            if left <= 0:
                raise TimeoutError(f"{self.name}: {what} waited {timeout:.0f} s (step_timeout) for " + "; ".join(lacking))
            with self.phases("wait"):
                ready = self.inbox.poll(min(left, 1.0) * 1000)
            if ready:
                self.receive()
            self.ask_again()

    def send_critic_batch(self, step: int, samples: list[Sample], kl_coef: float, engine: Engine) -> None:
        """This rank's share of the step to the critic's processes: the value loss's inputs, as
        train_critic would compute them here (batch statistics over `engine`'s data-parallel ranks)."""
        with self.phases("inputs"):
            inputs = train_inputs(samples, partial(self.graph.input, self.graph.critic_apart), self.cfg.algorithm,
                                  prox_source=None, kl_coef=kl_coef,
                                  all_reduce=all_reduce_over(engine.data_parallel_group), roles=self.runner.roles)
            data = engine_data(inputs.without_aggregation())
        with self.phases("transport"):
            self.critic.send(step, samples, inputs.seqs, data, leader=engine.data_leader)

    def critic_step(self, step: int) -> dict[str, float]:
        """Wait for every one of the critic's processes to train step `step`; their stats."""
        self.receive_until(lambda: self.critic.update_missing(step), f"step {step}")
        return self.critic.update_stats(step)

    def ask_again(self) -> None:
        """Ask a replica again for each result a held group has waited for longer than
        recover.infer_rerequest_seconds: the replica may have died (and been restarted) with the
        request. A result that then comes twice is dropped (Join.result)."""
        for group, remote in self.join.overdue(time.monotonic(), self.cfg.recover.infer_rerequest_seconds):
            node = self.graph.nodes[remote.node]
            replicas = self.replicas[remote.node]
            i = replica_of(group.group_id, len(replicas))
            log.warning("%s: group %d has no %s yet: asked %s again", self.name, group.group_id, remote.key,
                        infer_name(remote.node, i))
            send_blocking(replicas[i], InferRequest.for_group(group, self.rank, remote.node, node.inputs))

    def step(self, plan: RunStep) -> StepDone:
        """One train step: this rank's share of the batch, the trainer-mesh nodes in graph order on
        it (StepRunner), the new version published, the step's flight record written; the stats go
        back to the controller."""
        samples = self.take_share(plan)
        trained = self.engines[self.graph.train.role]
        if self.cfg.dump.weights:  # π_prox of this step, and what the servers load as this version
            with self.phases("dump"):
                trained.save_weights(weights_path(self.spec.run_dir, trained.version))
                if self.cfg.training.lora.rank:  # and the adapters, as the servers get them (replay --regenerate)
                    trained.save_update(adapter_path(self.spec.run_dir, trained.version))
        samples, source = self.runner.batch(samples)
        kl_coef = self.kl.coef  # the actor and the critic see the same KL reward this step
        record = None
        if self.cfg.flight.record:
            with self.phases("flight"):
                record = flight.begin(plan.step, self.rank, samples, source, trained.version, kl_coef)
        if self.critic is not None:  # the critic trains on its own devices while the actor trains here
            self.send_critic_batch(plan.step, samples, kl_coef, trained)
        stats, ran = self.runner.run_nodes(samples, source, trained.version, kl_coef)
        if self.critic is not None:
            stats.update(self.critic_step(plan.step))
        for node in self.graph.own_mesh_nodes:  # the inference processes' seconds for this rank's groups
            stats[f"infer/{node.name}_seconds"] = sum(s.scalars.get(f"{node.name}_seconds", 0.0) for s in samples)
        weights = self.publish_step(plan.step, samples, trained)
        if record is not None:
            with self.phases("flight"):
                self.record_flight(record, trained, stats)
        stats.update(self.phases.reset())
        if trained.data_leader:
            self.trained_log.write(json.dumps({"step": plan.step, "uids": [s.uid for s in samples],
                                               "nodes": ran}) + "\n")
        digest = trained.adapter_digest() if trained.optim is not None else None  # LoRA: what the servers must report
        return StepDone(self.rank, plan.step, stats=stats, weights_path=weights, sent_bytes=sent_bytes(),
                        adapter_digest=digest or "")

    def record_flight(self, record: flight.FlightStep, trained: Engine, stats: dict[str, float]) -> None:
        """Write the step's flight record; a full disk loses it, not the run (the replay then names
        the missing step)."""
        try:
            stats["flight_bytes"] = flight.end(self.spec.run_dir, record, trained.weights_digest(), stats)
        except OSError:
            log.exception("%s: the flight record of step %d was not written", self.name, record.step + 1)

    def take_share(self, plan: RunStep) -> list[Sample]:
        """Send on the groups the plan moves to other ranks, wait for this rank's share of the
        batch, and take its samples."""
        # A group routed here may still be on its way from the reward process when the plan moves
        # it on: receive it first.
        self.wait_for(list(plan.moves), f"step {plan.step}")
        with self.phases("transport"):
            for g, rank in plan.moves.items():
                send_blocking(self.peers[rank], self.held.pop(g))
        self.wait_for(plan.groups, f"step {plan.step}")
        return [s for g in plan.groups for s in self.held.pop(g).samples]

    def publish_step(self, step: int, samples: list[Sample], trained: Engine) -> str:
        """The trained role becomes version step + 1 and goes out to the servers (its location, or
        "" when the trainers send it later, once the servers are paused); the step's dump after."""
        version = step + 1
        trained.version = version
        with self.phases("publish"):
            weights = self.weights.after_step(trained, version, self.rank)
        if dump_due(self.cfg.dump.every_steps, step) and trained.data_leader:  # once the weights are out
            with self.phases("dump"):
                self.dump(step, samples)
        if self.graph.colocated and trained.device.type == "cuda":
            torch.cuda.empty_cache()  # the generation server on this GPU takes its turn next
        return weights

    def publish(self, msg: PublishWeights) -> WeightsPublished:
        """Send the trained role's weights to the paused servers through the run's channel: every
        rank takes part in gathering them (a collective under FSDP and megatron), rank 0 sends."""
        return self.weights.send(self.engines[self.graph.train.role], msg, self.rank)

    def dump(self, step: int, samples: list[Sample]) -> None:
        """This rank's samples of step `step`, with the policy's advantages, to the run's dumps/ folder
        (training/dumps.py)."""
        train, inputs = self.graph.train, self.runner.policy_inputs
        tokenizer = self.tokenizer
        try:
            dump_step(self.spec.run_dir, step, self.rank, samples,
                      prompt_key=self.graph.input(train, "prompt_ids"), output_key=self.graph.input(train, "output_ids"),
                      reward_key=self.graph.input(train, "rewards"),
                      versions_key=self.graph.output(self.graph.generate, "versions"),
                      loss_mask_key=self.graph.output(self.graph.generate, "loss_mask"),
                      advantages=None if inputs is None else inputs.advantages,
                      masks=None if inputs is None else inputs.valid_masks(),
                      decode=lambda ids: tokenizer.decode(ids.tolist(), skip_special_tokens=False),
                      arrays=self.cfg.dump.tokens)
        except OSError:  # a full disk loses the dump, not the run
            log.exception("%s: the sample dump of step %d was not written", self.name, step + 1)

    def save_critic_apart(self, msg: SaveCheckpoint) -> None:
        """Rank 0 has a critic on a mesh of its own write its part of the checkpoint (under
        `msg.path/critic`; each of its processes its shard) and waits for it, so that a checkpoint
        called saved holds it."""
        if self.critic is None or self.rank != 0:
            return
        self.critic.ask_save(msg)
        self.receive_until(lambda: self.critic.save_missing(msg.path), f"the checkpoint {msg.path}")
        self.critic.forget_save(msg.path)

def main(cfg: RunConfig, spec: RunSpec, name: str, rank: int) -> None:
    torch.manual_seed(cfg.seed + rank)
    ModelWorker(cfg, spec, name, rank).run()
