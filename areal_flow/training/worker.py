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
import os
import shutil
import time
from collections.abc import Callable, Mapping, Sequence
from functools import cached_property, partial

import msgspec
import numpy as np
import torch
import torch.distributed as dist
import zmq

from areal_flow.algorithms import library
from areal_flow.algorithms.diagnostics import length_bucket_sums, stalest_shares
from areal_flow.algorithms.inputs import TrainInputs, train_inputs
from areal_flow.algorithms.kl import behaviour_kl, kl_controller
from areal_flow.algorithms.library import AllReduce
from areal_flow.algorithms.prox import prox_source
from areal_flow.checkpoint import store
from areal_flow.config.schema import RunConfig
from areal_flow.graph.dag import Graph, Node, graph_from_config
from areal_flow.graph.placement import infer_name, replica_of
from areal_flow.metrics.profile import Phases
from areal_flow.models.tokenizer import load_tokenizer
from areal_flow.runtime.child import torchrun_rank
from areal_flow.runtime.disk import DiskFull, writing
from areal_flow.runtime.devices import TRAINER_BACKENDS, compute_dtype, local_device
from areal_flow.runtime.security import LOOPBACK
from areal_flow.runtime.spec import RunSpec
from areal_flow.training.dumps import dump_due, dump_step, weights_path
from areal_flow.training.engine import LOSS_MASK_KEY, LOSS_SHARE_KEY, Engine, OptimSpec, budget_named
from areal_flow.training.join import DuplicateResult, Join, Remote
from areal_flow.training.step_stats import accumulate_stats
from areal_flow.training.torch_engine import TorchEngine
from areal_flow.transport.channels import make_socket, recv_blocking, send_blocking, sent_bytes
from areal_flow.weights import make_channel
from areal_flow.transport.messages import (
    Array,
    CriticBatch,
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

CRITIC_DIR = "critic"
"""A checkpoint's sub-directory holding the critic (a Hugging Face token-classification model)."""

HELD = "held-rank{rank}.msgpack"
"""A resumable checkpoint's file of the scored groups a rank held, not yet trained."""

TRAINER_STATE = "trainer-rank{rank}.json"
"""A resumable checkpoint's file of a rank's own state: its trained-samples log's length."""


class ModelWorker:
    def __init__(self, cfg: RunConfig, spec: RunSpec, name: str, rank: int):
        self.cfg, self.spec, self.name, self.rank = cfg, spec, name, rank
        self.graph: Graph = graph_from_config(cfg)
        self.roles = len(self.graph.generate.agent_roles) or 1  # an agent's roles: blocks of a group, normalised apart
        self.engines = make_engines(cfg, spec, self.graph, rank)
        self.held: dict[int, ScoredGroup] = {}  # scored groups on this rank, complete, not yet trained
        self.policy_inputs: TrainInputs | None = None  # the policy's loss inputs of the step (for its dump)
        # Groups waiting for the key of a node on a mesh of its own, and such keys waiting for their group.
        self.join = Join([Remote(n.name, n.outputs[0], self.graph.input(n, "output_ids"))
                          for n in self.graph.own_mesh_nodes])
        self.trained_log = open(spec.path(f"trained-rank{rank}.jsonl"), "a", buffering=1)
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
        # A critic on a mesh of its own: its processes' inboxes (those its values are asked on), and
        # what they have answered: the steps each trained, the checkpoints each wrote.
        apart = self.graph.critic_apart
        self.critic = self.replicas[self.critic_values.name] if apart is not None else []
        self.critic_trained: dict[int, dict[str, CriticTrained]] = {}  # step -> process -> its answer
        self.critic_saved: set[tuple[str, str]] = set()  # (checkpoint, process)
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
        if isinstance(msg, CriticTrained):
            self.critic_trained.setdefault(msg.step, {})[msg.worker] = msg
        elif isinstance(msg, CriticSaved):
            self.critic_saved.add((msg.path, msg.worker))
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

    @property
    def critic_values(self) -> Node:
        """The critic's inference node, on the critic's mesh of its own with its train node."""
        return next(n for n in self.graph.own_mesh_nodes if n.role == "critic")

    def critic_workers(self) -> list[str]:
        """The process names of the critic on a mesh of its own."""
        return [infer_name(self.critic_values.name, i) for i in range(len(self.critic))]

    def send_critic_batch(self, step: int, samples: list[Sample], kl_coef: float, engine: Engine) -> None:
        """This rank's share of the step to each of the critic's processes (the groups it values,
        `replica_of`): the value loss's inputs, as train_critic would compute them here (batch
        statistics over `engine`'s data-parallel ranks). A rank that is not its model-parallel
        group's data leader sends empty shares (the leader sends the group's samples)."""
        node = self.graph.critic_apart
        with self.phases("inputs"):
            inputs = train_inputs(samples, partial(self.graph.input, node), self.cfg.algorithm, prox_source=None,
                                  kl_coef=kl_coef, all_reduce=all_reduce_over(engine.data_parallel_group),
                                  roles=self.roles)
            data = engine_data(inputs.without_aggregation())
        with self.phases("transport"):
            for replica, socket in enumerate(self.critic):
                mine = [i for i, s in enumerate(samples) if engine.data_leader
                        and replica_of(s.group_id, len(self.critic)) == replica]
                send_blocking(socket, CriticBatch(
                    step, self.rank, [samples[i].group_id for i in mine], [Array.of(inputs.seqs[i][0]) for i in mine],
                    [Array.of(inputs.seqs[i][1]) for i in mine],
                    {k: [Array.of(v[i]) for i in mine] for k, v in data.items()}))

    def critic_step(self, step: int) -> dict[str, float]:
        """Wait for every one of the critic's processes to train step `step`; their stats (reduced
        over them already; rank 0 reports them)."""
        def missing() -> list[str]:
            done = self.critic_trained.get(step, {})
            return [f"the critic's update of step {step + 1} from {w}" for w in self.critic_workers() if w not in done]

        self.receive_until(missing, f"step {step}")
        done = self.critic_trained.pop(step)
        return {f"critic/{k}": v for k, v in done[self.critic_workers()[0]].stats.items()} if self.rank == 0 else {}

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
        # A group routed here may still be on its way from the reward process when the plan moves
        # it on: receive it first.
        self.wait_for(list(plan.moves), f"step {plan.step}")
        with self.phases("transport"):
            for g, rank in plan.moves.items():
                send_blocking(self.peers[rank], self.held.pop(g))
        self.wait_for(plan.groups, f"step {plan.step}")
        samples = [s for g in plan.groups for s in self.held.pop(g).samples]
        trained = self.engines[self.graph.train.role]
        if self.cfg.dump.weights:  # π_prox of this step, and what the servers load as this version
            with self.phases("dump"):
                trained.save_weights(weights_path(self.spec.run_dir, trained.version))
        # With a model split over ranks (TP/PP) the ranks of one model-parallel group train the
        # union of what the controller gave each of them; one of them logs it.
        samples = sorted(trained.data_parallel_batch(samples), key=lambda s: (s.group_id, s.index))
        prox_key = self.graph.input(self.graph.train, "prox_logprobs")
        source = prox_source(self.cfg.algorithm, reads_prox=prox_key is not None,
                             all_current=self.all_current(samples, trained.version))
        stats: dict[str, float] = {}
        prox_seconds = 0.0
        ran = []
        self.policy_inputs = None
        kl_coef = self.kl.coef  # the actor and the critic see the same KL reward this step
        if self.critic:  # the critic trains on its own devices while the actor trains here
            self.send_critic_batch(plan.step, samples, kl_coef, trained)
        for node in self.graph.trainer_nodes:  # graph order: prox/ref logprobs and values, then train
            is_prox = node.type != "train" and node.outputs[0] == prox_key
            if is_prox and source != "data":
                continue  # π_prox needs no forward pass this step
            t0 = time.perf_counter()
            with budget_named(f"graph.{node.name}.micro_batch_tokens", node.micro_batch_tokens,
                              self.engines[node.role].device):
                if node.type == "train" and node.role == "critic":
                    stats.update({f"critic/{k}": v for k, v in self.train_critic(node, samples, kl_coef).items()})
                elif node.type == "train":
                    stats.update(self.train(node, samples, source, trained.version, kl_coef))
                else:
                    self.infer(node, samples)
            if is_prox:
                prox_seconds = time.perf_counter() - t0
            ran.append(node.name)
        if prox_key is not None:
            stats["prox_seconds"] = prox_seconds
        if self.critic:
            stats.update(self.critic_step(plan.step))
        for node in self.graph.own_mesh_nodes:  # the inference processes' seconds for this rank's groups
            stats[f"infer/{node.name}_seconds"] = sum(s.scalars.get(f"{node.name}_seconds", 0.0) for s in samples)
        version = plan.step + 1
        trained.version = version
        with self.phases("publish"):  # "" when the trainers send it later, once the servers are paused
            weights = self.weights.after_step(trained, version, self.rank)
        if dump_due(self.cfg.dump.every_steps, plan.step) and trained.data_leader:  # once the weights are out
            with self.phases("dump"):
                self.dump(plan.step, samples)
        if self.graph.colocated and trained.device.type == "cuda":
            torch.cuda.empty_cache()  # the generation server on this GPU takes its turn next
        stats.update(self.phases.reset())
        if trained.data_leader:
            self.trained_log.write(json.dumps({"step": plan.step, "uids": [s.uid for s in samples],
                                               "nodes": ran}) + "\n")
        return StepDone(self.rank, plan.step, stats=stats, weights_path=weights, sent_bytes=sent_bytes())

    def all_current(self, samples: list[Sample], version: int) -> bool:
        """Whether every answer token of the step, on every trainer rank, was sampled by the weights
        at `version` (False when the train node reads no versions)."""
        key = self.graph.input(self.graph.train, "versions")
        mine = key is not None and all(np.all(s.array(key) == version) for s in samples)
        if self.spec.n_trainers == 1 or not dist.is_initialized():
            return mine
        flag = torch.tensor([int(mine)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank runs the same nodes
        return bool(flag.item())

    def publish(self, msg: PublishWeights) -> WeightsPublished:
        """Send the trained role's weights to the paused servers through the run's channel: every
        rank takes part in gathering them (a collective under FSDP and megatron), rank 0 sends."""
        return self.weights.send(self.engines[self.graph.train.role], msg, self.rank)

    def engine(self, node: Node) -> Engine:
        """The role's model, packing micro-batches under this node's own token budgets."""
        return configured(self.engines[node.role], node)

    def infer(self, node: Node, samples: list[Sample]) -> None:
        """Write the node's output key into every sample: it stays on this rank."""
        lps = node_outputs(self.engines[node.role], self.graph, node, [s.arrays for s in samples])
        for s, lp in zip(samples, lps):
            s.arrays[node.outputs[0]] = Array.of(lp)

    def train(self, node: Node, samples: list[Sample], source: str | None, prox_version: int,
              kl_coef: float) -> dict[str, float]:
        algo = self.cfg.algorithm
        engine = self.engine(node)
        reduce = all_reduce_over(engine.data_parallel_group)
        with self.phases("inputs"):
            inputs = train_inputs(samples, partial(self.graph.input, node), algo, prox_source=source,
                                  kl_coef=kl_coef, all_reduce=reduce, roles=self.roles)
        loss_fn = partial(library.objective, algo=algo, prox_source=source, prox_version=prox_version, kl_coef=kl_coef)
        has_ref = "ref_logprobs" in inputs.token_data
        kl_in_loss = algo.kl_in == "loss" and bool(kl_coef) and has_ref
        skip = library.zero_gradient(inputs.advantages, algo, kl_in_loss=kl_in_loss)
        stats = self.update(engine, samples, inputs, loss_fn, skip, first_loss_fn=partial(loss_fn, at_start=True))
        stats.update(length_bias(inputs, algo.max_new_tokens, reduce))
        self.policy_inputs = inputs
        if has_ref and algo.kl_coef:
            kl = behaviour_kl(inputs.token_data["behav_logprobs"], inputs.token_data["ref_logprobs"],
                              inputs.valid_masks(), algo.kl_estimator, algo.kl_clamp, reduce)
            stats.update(kl_mean=kl, kl_coef=kl_coef)
            group = engine.data_parallel_group
            self.kl.update(kl, len(samples) * (dist.get_world_size(group) if group is not None else 1))
            engine.extra_state["kl"] = self.kl.state_dict()
        return stats

    def dump(self, step: int, samples: list[Sample]) -> None:
        """This rank's samples of step `step`, with the policy's advantages, to the run's dumps/ folder
        (training/dumps.py)."""
        train, inputs = self.graph.train, self.policy_inputs
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

    def train_critic(self, node: Node, samples: list[Sample], kl_coef: float) -> dict[str, float]:
        """The clipped value loss toward the estimator's targets (GAE: A + V), token mean."""
        algo = self.cfg.algorithm
        engine = self.engine(node)
        inputs = train_inputs(samples, partial(self.graph.input, node), algo, prox_source=None, kl_coef=kl_coef,
                              all_reduce=all_reduce_over(engine.data_parallel_group), roles=self.roles)
        return self.update(engine, samples, inputs.without_aggregation(), partial(library.critic_objective, algo=algo))

    def update(self, engine: Engine, samples: list[Sample], inputs: TrainInputs, loss_fn,
               skip: list[bool] | None = None, first_loss_fn=None) -> dict[str, float]:
        return train_update(engine, [s.group_id for s in samples], inputs.seqs, engine_data(inputs), loss_fn,
                            self.cfg.algorithm, skip, first_loss_fn)

    def save_checkpoint(self, msg: SaveCheckpoint) -> None:
        try:
            with writing("the checkpoint", msg.path):
                self._save_checkpoint(msg)
        except DiskFull:
            if msg.groups is not None:
                # A temporary folder (store.begin) that nothing reads: its space is wanted for the
                # log line that says what happened, on the same disk, and by the user.
                shutil.rmtree(msg.path, ignore_errors=True)
            raise

    def _save_checkpoint(self, msg: SaveCheckpoint) -> None:
        """The end of a run (`msg.groups` None): the trained role's Hugging Face directory at
        `msg.path`, with its training state beside it, and a trained critic's in its `critic/`
        folder. A resumable checkpoint: every trained role's `save_resumable` folder (Hugging Face
        weights, sharded model and optimizer state) under `msg.path/<role>`, the
        scored groups `msg.groups` this rank holds (waiting for any still on their way) and the
        length of its trained-samples log. Collective: every rank takes part in saving the models."""
        tokenizer = self.tokenizer
        if msg.groups is None:
            self.engines[self.graph.train.role].save(msg.path, tokenizer=tokenizer)
            if "critic" in self.engines:
                self.engines["critic"].save(os.path.join(msg.path, CRITIC_DIR))
            self.save_critic_apart(msg)
            return
        self.wait_for(msg.groups, "the checkpoint")
        with open(os.path.join(msg.path, HELD.format(rank=self.rank)), "wb") as f:
            f.write(msgspec.msgpack.encode([self.held[g] for g in sorted(msg.groups)]))
        self.trained_log.flush()
        with open(os.path.join(msg.path, TRAINER_STATE.format(rank=self.rank)), "w") as f:
            json.dump({"trained_log_bytes": self.trained_log.tell()}, f)
        for node in self.graph.trainer_nodes:
            if node.type == "train":  # sharded: each rank writes its own part of the optimizer state
                role_tokenizer = tokenizer if node.role == self.graph.train.role else None
                self.engines[node.role].save_resumable(os.path.join(msg.path, node.role), tokenizer=role_tokenizer)
        self.save_critic_apart(msg)

    def save_critic_apart(self, msg: SaveCheckpoint) -> None:
        """Rank 0 has a critic on a mesh of its own write its part of the checkpoint (under
        `msg.path/critic`; each of its processes its shard) and waits for it, so that a checkpoint
        called saved holds it."""
        if not self.critic or self.rank != 0:
            return
        for socket in self.critic:
            send_blocking(socket, msg)
        workers = self.critic_workers()
        self.receive_until(lambda: [f"the critic's part from {w}" for w in workers if (msg.path, w) not in self.critic_saved],
                           f"the checkpoint {msg.path}")
        self.critic_saved -= {(msg.path, w) for w in workers}

    @cached_property
    def tokenizer(self):
        """The run's tokenizer, saved beside the trained weights; read at the first checkpoint."""
        return load_tokenizer(self.spec.model_path)

    def resume(self, folder: str) -> None:
        """Continue from the resumable checkpoint `folder`: every trained role's weights and training
        state (optimizer, LR schedule, RNG, version), the scored groups this rank now holds (those of
        each saved rank k with k mod ranks = this rank: controller/state.py `for_ranks`). The
        launcher has cut its trained-samples log back to its length then (checkpoint/store.py `rewind`)."""
        for node in self.graph.trainer_nodes:  # a critic on a mesh of its own loads its own (training/critic.py)
            if node.type == "train":
                self.engines[node.role].load_resumable(os.path.join(folder, node.role))
        saved_ranks = store.read_manifest(folder)["n_trainers"]
        for k in range(self.rank, saved_ranks, self.spec.n_trainers):
            with open(os.path.join(folder, HELD.format(rank=k)), "rb") as f:
                for group in msgspec.msgpack.decode(f.read(), type=list[ScoredGroup]):
                    self.held[group.group_id] = group
        log.info("%s: resumed from %s at version %d with %d scored groups", self.name, folder,
                 self.engines[self.graph.train.role].version, len(self.held))


def all_reduce_over(group: dist.ProcessGroup | None) -> AllReduce | None:
    """A sum of a small tensor over `group` (every rank calls it at the same point), for the
    batch-level statistics of advantages; None when the batch is on this rank alone."""
    if group is None or dist.get_world_size(group) == 1:
        return None

    def reduce(t: torch.Tensor) -> torch.Tensor:
        t = t.clone()
        dist.all_reduce(t, group=group)
        return t

    return reduce


def length_bias(inputs: TrainInputs, max_new_tokens: int, reduce: AllReduce | None) -> dict[str, float]:
    """The step's per-length-bucket sums of advantages and loss weights (diagnostics.length_bucket_sums)
    over the data-parallel ranks (`reduce`: their sum; every rank calls it, with or without samples)."""
    sums = length_bucket_sums([len(out) for _, out in inputs.seqs], inputs.advantages, inputs.valid_masks(),
                              inputs.token_data.get("token_weights"), max_new_tokens)
    if reduce is None:
        return sums
    total = reduce(torch.tensor(list(sums.values()), dtype=torch.float64))
    return dict(zip(sums, total.tolist()))


def train_update(engine: Engine, group_ids: list[int], seqs: list[tuple[np.ndarray, np.ndarray]],
                 token_data: dict[str, list[np.ndarray]], loss_fn, algo, skip: list[bool] | None = None,
                 first_loss_fn=None) -> dict[str, float]:
    """n_minibatches optimizer steps per epoch over the batch (each sample's group in `group_ids`),
    their stats added up; the sequences marked in `skip` are not run (Engine.train_step). The first
    optimizer step runs `first_loss_fn` when given (the policy's own logprobs at the step's start)."""
    stats: dict[str, float] = {}
    each = []
    for n, idx in enumerate(minibatches(group_ids, algo.n_minibatches, algo.ppo_epochs)):
        each.append(engine.train_step(
            [seqs[i] for i in idx], {k: [v[i] for i in idx] for k, v in token_data.items()},
            first_loss_fn if n == 0 and first_loss_fn is not None else loss_fn,
            skip=None if skip is None else [skip[i] for i in idx]))
        accumulate_stats(stats, each[-1])
    stats.update(stalest_shares(each))  # the stalest tokens' share of each minibatch's gradient
    return stats


def engine_data(inputs: TrainInputs) -> dict[str, list[np.ndarray]]:
    """The per-token data Engine.train_step takes: the loss function's, and the loss mask and
    denominator shares under the keys the engine reads them by."""
    data = dict(inputs.token_data)
    if inputs.loss_share is not None:
        data[LOSS_SHARE_KEY] = inputs.loss_share
    if inputs.loss_mask is not None:
        data[LOSS_MASK_KEY] = inputs.loss_mask
    return data


def minibatches(group_ids: list[int], n_minibatches: int, epochs: int) -> list[list[int]]:
    """Sample indices of each optimizer step: `epochs` passes over the batch, each split into
    `n_minibatches` by whole groups (every group's advantages train in one update), in group order."""
    groups = sorted(set(group_ids))
    splits = [set(part.tolist()) for part in np.array_split(np.array(groups, dtype=np.int64), n_minibatches)]
    one_pass = [[i for i, g in enumerate(group_ids) if g in members] for members in splits]
    return one_pass * epochs


def process_group_init(spec: RunSpec, rank: int) -> dict[str, object]:
    """How this rank joins the trainers' process group: torchrun's rendezvous when torchrun started
    it (launcher.type=slurm), else the store on trainer 0's node at the spec's dist_port."""
    if (env_rank := torchrun_rank()) is not None:
        world = int(os.environ["WORLD_SIZE"])
        # torchrun numbers ranks node by node; the placement must agree, or groups would go to the
        # wrong ranks' inboxes.
        if world != spec.n_trainers or env_rank != rank:
            raise RuntimeError(f"torchrun started rank {env_rank} of {world}, but the run spec has {spec.n_trainers} "
                               f"trainer ranks and this process is trainer{rank}")
        return {"init_method": "env://", "rank": env_rank, "world_size": world}
    # Rank 0's node: its store listens there (on loopback when the run is on one host).
    return {"init_method": f"tcp://{spec.hosts.get('trainer0', LOOPBACK)}:{spec.dist_port}", "rank": rank,
            "world_size": spec.n_trainers}


def make_engines(cfg: RunConfig, spec: RunSpec, graph: Graph, rank: int) -> dict[str, Engine]:
    """One engine per model role on this trainer rank, as the graph's trainer-mesh nodes name them
    (a node on a mesh of its own has its model in its inference processes)."""
    nodes = {n.role: n for n in graph.trainer_nodes}
    layout = graph.train.layout
    megatron = any(n.engine == "megatron" for n in nodes.values())
    device_type = cfg.cluster.device_type
    # megatron's parallel state needs a process group even for one rank.
    if spec.n_trainers > 1 or megatron:
        dist.init_process_group(TRAINER_BACKENDS[device_type], **process_group_init(spec, rank))
    engines: dict[str, Engine] = {}
    trained = {n.role for n in graph.trainer_nodes if n.type == "train"}
    training = cfg.training
    for role, node in nodes.items():
        optim = optim_spec(cfg, role) if role in trained else None
        if node.engine == "megatron":
            from areal_flow.training.megatron.engine import (
                MegatronEngine,  # imports megatron-core (seconds)
            )

            engines[role] = MegatronEngine(spec.model_path, optim=optim, tp=layout.tp, pp=layout.pp,
                                           distributed_optimizer=training.distributed_optimizer,
                                           sequence_parallel=training.sequence_parallel,
                                           **engine_options(cfg, trained=optim is not None))
        else:
            engines[role] = torch_engine(cfg, spec, role, optim,
                                         process_group=dist.group.WORLD if spec.n_trainers > 1 else None)
    return engines


def engine_options(cfg: RunConfig, trained: bool) -> dict[str, object]:
    """What every engine takes from the config: this process's device (the launcher made its GPU
    the only one it sees), number format, attention, and the chunked logprobs' settings."""
    training, device_type = cfg.training, cfg.cluster.device_type
    return dict(temperature=cfg.algorithm.temperature, device=str(local_device(device_type)),
                bf16=compute_dtype(training.dtype, device_type) == torch.bfloat16, attention=training.attention,
                activation_checkpointing=training.activation_checkpointing,
                logprob_chunk_tokens=training.logprob_chunk_tokens, entropy=training.entropy and trained)


def torch_engine(cfg: RunConfig, spec: RunSpec, role: str, optim: OptimSpec | None,
                 process_group: dist.ProcessGroup | None) -> TorchEngine:
    """A role's torch engine from the run's model (`optim` None: frozen, logprobs only), over
    `process_group`'s ranks, or alone (a trainer rank of one, an inference process's replica)."""
    # The critic: the actor's backbone with a value head, or a critic saved beside a checkpoint.
    critic_dir = os.path.join(spec.model_path, CRITIC_DIR)
    path = critic_dir if role == "critic" and os.path.isdir(critic_dir) else spec.model_path
    return TorchEngine(path, optim=optim, process_group=process_group, head="value" if role == "critic" else "lm",
                       **engine_options(cfg, trained=optim is not None))


def configured(engine: Engine, node: Node) -> Engine:
    """`engine` packing micro-batches under `node`'s own token budgets."""
    engine.micro_batch_tokens = node.micro_batch_tokens
    if node.engine == "torch":  # the megatron engine packs one THD row (the graph refuses row_tokens)
        engine.row_tokens = node.row_tokens
    return engine


def node_outputs(engine: Engine, graph: Graph, node: Node, arrays: Sequence[Mapping[str, Array]]) -> list[np.ndarray]:
    """An inference node's output for each sample (`arrays`: a sample's arrays by key): per-token
    logprobs of its answer (values, for a critic) under `engine`, packed under the node's budgets."""
    prompt, output = graph.input(node, "prompt_ids"), graph.input(node, "output_ids")
    return configured(engine, node).logprobs([(a[prompt].numpy(), a[output].numpy()) for a in arrays])


def optim_spec(cfg: RunConfig, role: str = "actor") -> OptimSpec:
    """A trained role's optimizer settings (the critic's own LR); the LR schedule counts optimizer steps."""
    algo = cfg.algorithm
    decay = algo.lr_decay_steps if algo.lr_decay_steps is not None else cfg.total_steps * algo.n_minibatches * algo.ppo_epochs
    lr = algo.critic_lr if role == "critic" and algo.critic_lr is not None else algo.lr
    return OptimSpec(lr=lr, betas=tuple(algo.betas), weight_decay=algo.weight_decay, grad_clip=algo.grad_clip,
                     schedule=algo.lr_schedule, warmup_steps=algo.lr_warmup_steps, decay_steps=decay,
                     min_lr_ratio=algo.lr_min_ratio, max_nan_steps=algo.max_nan_steps)


def main(cfg: RunConfig, spec: RunSpec, name: str, rank: int) -> None:
    torch.manual_seed(cfg.seed + rank)
    ModelWorker(cfg, spec, name, rank).run()
