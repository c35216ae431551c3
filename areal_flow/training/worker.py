"""A model worker: one rank of the trainer mesh. It runs the batch nodes the controller fires
(`inference`: logprobs of a role's model; `train`: one PPO update of the actor), publishes the new
weights for generation after each update, and writes the checkpoint at the end.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from functools import partial

import numpy as np
import torch
import torch.distributed as dist
import zmq

from areal_flow.algorithms.advantages import group_normalized_advantages
from areal_flow.algorithms.kl import kl_k3
from areal_flow.algorithms.ppo import decoupled_ppo_loss
from areal_flow.graph.dag import Graph, Node, graph_from_config
from areal_flow.models.tokenizer import load_tokenizer
from areal_flow.runtime.spec import RunSpec
from areal_flow.training.engine import TorchEngine, accumulate_stats
from areal_flow.transport.channels import endpoint, make_socket, recv_blocking
from areal_flow.transport.messages import (
    Array,
    Hello,
    NodeResult,
    RunNode,
    Sample,
    SaveCheckpoint,
    Saved,
    encode,
)

log = logging.getLogger("areal_flow.trainer")


def ppo_loss(logprobs, batch, mask, n_valid_tokens, *, algo, kl_coef: float):
    """The actor's objective on one micro-batch: decoupled PPO (+ k3 KL when a ref node exists)."""
    loss, stats = decoupled_ppo_loss(
        logprobs, batch.get("prox_logprobs"), batch["behav_logprobs"], batch["advantages"], mask,
        eps_clip=algo.eps_clip, eps_clip_high=algo.eps_clip_high, behav_weight_cap=algo.behav_weight_cap,
        n_valid_tokens=n_valid_tokens,
    )
    if "ref_logprobs" in batch and kl_coef:
        kl = kl_k3(logprobs, batch["ref_logprobs"], mask, n_valid_tokens)
        loss = loss + kl_coef * kl
        stats["kl_sum"] = kl.detach() * n_valid_tokens
    return loss, stats


def ppo_inputs(samples: list[Sample], graph: Graph, node: Node, group_size: int, scale_by_std: bool
               ) -> tuple[list[tuple[np.ndarray, np.ndarray]], dict[str, list[np.ndarray]]]:
    """The train node's sequences and per-output-token data, from samples sorted by (group, index).

    Advantages are normalised within each group and broadcast to every token of the answer. An
    input written by an inference node of the train node's own role is the proximal policy's
    logprobs; one written by another role's inference node is the reference model's.
    """
    reward_key = next(k for k in node.inputs if graph.type_of_producer(k) == "reward")
    rewards = torch.tensor([s.scalars[reward_key] for s in samples], dtype=torch.float32)
    adv = group_normalized_advantages(rewards, group_size, scale_by_std=scale_by_std) if samples else rewards
    seqs = [(s.array("prompt_ids"), s.array("output_ids")) for s in samples]
    token_data = {
        "behav_logprobs": [s.array("behav_logprobs") for s in samples],
        "advantages": [np.full(len(out), float(a), dtype=np.float32) for (_, out), a in zip(seqs, adv)],
    }
    for key in node.inputs:
        if graph.type_of_producer(key) == "inference":
            sem = "prox_logprobs" if graph.role_of_key(key) == node.role else "ref_logprobs"
            token_data[sem] = [s.array(key) for s in samples]
    return seqs, token_data


class ModelWorker:
    def __init__(self, cfg, spec: RunSpec, name: str, rank: int):
        self.cfg, self.spec, self.name, self.rank = cfg, spec, name, rank
        self.graph: Graph = graph_from_config(cfg)
        group = None
        if spec.n_trainers > 1:
            dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{spec.dist_port}",
                                    rank=rank, world_size=spec.n_trainers)
            group = dist.group.WORLD
        algo = cfg.algorithm
        train_node = next(n for n in self.graph.batch_nodes if n.type == "train")
        self.engines: dict[str, TorchEngine] = {}
        for node in self.graph.batch_nodes:
            if node.role in self.engines:
                continue
            trainable = node.role == train_node.role
            self.engines[node.role] = TorchEngine(
                spec.model_path, lr=algo.lr, betas=tuple(algo.betas), weight_decay=algo.weight_decay,
                grad_clip=algo.grad_clip, micro_batch_tokens=node.micro_batch_tokens,
                temperature=algo.temperature, trainable=trainable, process_group=group,
            )
        self.trained_log = open(spec.path(f"trained-rank{rank}.jsonl"), "a", buffering=1)
        self.socket = make_socket(zmq.Context(), zmq.DEALER, connect=endpoint(spec.trainer_port), identity=name)

    def run(self) -> None:
        self.socket.send(encode(Hello(self.rank)))
        while True:  # until the launcher stops this process
            msg = recv_blocking(self.socket, f"{self.name} controller")
            if isinstance(msg, SaveCheckpoint):
                self.save_checkpoint(msg.path)
                self.socket.send(encode(Saved(self.rank, msg.path)))
            elif isinstance(msg, RunNode):
                node = self.graph.nodes[msg.node]
                result = self.inference(node, msg.samples) if node.type == "inference" else self.train(node, msg)
                self.socket.send(encode(result))
            else:
                log.error("%s: unexpected %s, dropped", self.name, type(msg).__name__)

    def engine(self, node: Node) -> TorchEngine:
        """The role's model, packing micro-batches under this node's own token budget."""
        engine = self.engines[node.role]
        engine.micro_batch_tokens = node.micro_batch_tokens
        return engine

    def inference(self, node: Node, samples: list[Sample]) -> NodeResult:
        lps = self.engine(node).logprobs([(s.array("prompt_ids"), s.array("output_ids")) for s in samples])
        key = node.outputs[0]
        return NodeResult(node.name, self.rank, outputs={s.uid: {key: Array.of(lp)} for s, lp in zip(samples, lps)})

    def train(self, node: Node, msg: RunNode) -> NodeResult:
        algo = self.cfg.algorithm
        samples = sorted(msg.samples, key=lambda s: (s.group_id, s.index))  # groups contiguous
        seqs, token_data = ppo_inputs(samples, self.graph, node, algo.group_size, algo.adv_scale_by_std)
        loss_fn = partial(ppo_loss, algo=algo, kl_coef=algo.kl_coef)
        engine = self.engine(node)
        stats: dict[str, float] = {}
        groups = sorted({s.group_id for s in samples})
        for mb_groups in np.array_split(np.array(groups, dtype=np.int64), algo.n_minibatches):
            # Minibatches hold whole groups, so every advantage's group trains in one update.
            idx = [i for i, s in enumerate(samples) if s.group_id in set(mb_groups.tolist())]
            accumulate_stats(stats, engine.train_step(
                [seqs[i] for i in idx], {k: [v[i] for i in idx] for k, v in token_data.items()}, loss_fn))
        version = msg.step + 1
        weights = self.spec.path("weights", f"v{version}")
        if self.rank == 0:
            engine.save_weights(weights)
            _prune_weights(self.spec.path("weights"), keep=version)
        self.trained_log.write(json.dumps({"step": msg.step, "uids": [s.uid for s in samples]}) + "\n")
        return NodeResult(node.name, self.rank, stats=stats, weights_path=weights)

    def save_checkpoint(self, path: str) -> None:
        role = next(n.role for n in self.graph.batch_nodes if n.type == "train")
        if self.rank == 0:
            self.engines[role].save_hf(path, tokenizer=load_tokenizer(self.spec.model_path))


def _prune_weights(root: str, keep: int) -> None:
    """Old published versions are no longer read once the next one is loaded; keep the last two."""
    for name in os.listdir(root):
        if name.startswith("v") and name[1:].isdigit() and int(name[1:]) < keep - 1:
            shutil.rmtree(os.path.join(root, name), ignore_errors=True)


def main(cfg, spec: RunSpec, name: str, rank: int) -> None:
    torch.manual_seed(cfg.seed + rank)
    ModelWorker(cfg, spec, name, rank).run()
