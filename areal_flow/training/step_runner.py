"""A trainer rank's computation of one step, apart from its sockets: the graph's trainer-mesh nodes
in graph order on the rank's share of the batch (inference nodes write their key into the samples,
then the train node updates the model). The model worker (training/worker.py) runs it on the groups
it received; `python -m areal_flow.replay` runs it on a flight record's (training/flight.py), so a
replayed step is computed by the same code as the original.
"""

from __future__ import annotations

import time
from functools import partial

import numpy as np
import torch
import torch.distributed as dist

from areal_flow.algorithms import library
from areal_flow.algorithms.inputs import TrainInputs, train_inputs
from areal_flow.algorithms.kl import behaviour_kl
from areal_flow.algorithms.prox import prox_source
from areal_flow.config.schema import RunConfig
from areal_flow.graph.dag import Graph
from areal_flow.graph.node import Node
from areal_flow.metrics.profile import Phases
from areal_flow.training import exact_prox
from areal_flow.training.build import configured, node_outputs
from areal_flow.training.engine import Engine, budget_named
from areal_flow.training.updates import all_reduce_over, engine_data, length_bias, train_update
from areal_flow.transport.messages import Array, Sample


class StepRunner:
    """`engines`: the rank's model per role; `kl`: the KL controller (β toward the ref model), which
    the caller saves and restores; `n_trainers`: the ranks that agree on the step's π_prox source."""

    def __init__(self, cfg: RunConfig, graph: Graph, engines: dict[str, Engine], phases: Phases, kl, n_trainers: int,
                 model_path: str):
        self.cfg, self.graph, self.engines, self.phases, self.kl = cfg, graph, engines, phases, kl
        self.n_trainers = n_trainers
        # training.zero_mismatch: π_prox through the servers' own forward (training/exact_prox.py).
        self.exact = exact_prox.for_run(cfg, model_path, self.trained.device) if cfg.training.zero_mismatch else None
        self.roles = len(graph.generate.agent_roles) or 1  # an agent's roles: blocks of a group, normalised apart
        self.policy_inputs: TrainInputs | None = None  # the policy's loss inputs of the last step (for its dump)

    @property
    def trained(self) -> Engine:
        return self.engines[self.graph.train.role]

    def batch(self, samples: list[Sample], gathered: bool = False) -> tuple[list[Sample], str | None]:
        """The samples this rank trains, in the order it trains them, and where the step's π_prox
        comes from. With a model split over ranks (TP/PP) the ranks of one model-parallel group
        train the union of what the controller gave each of them (`gathered`: `samples` are that
        union already, as a flight record keeps them)."""
        trained = self.trained
        if not gathered:
            samples = trained.data_parallel_batch(samples)
        samples = sorted(samples, key=lambda s: (s.group_id, s.index))
        reads_prox = self.graph.input(self.graph.train, "prox_logprobs") is not None
        source = prox_source(self.cfg.algorithm, reads_prox=reads_prox,
                             all_current=self.all_current(samples, trained.version), exact=self.exact is not None)
        self.policy_inputs = None
        return samples, source

    def run_nodes(self, samples: list[Sample], source: str | None, prox_version: int,
                  kl_coef: float) -> tuple[dict[str, float], list[str]]:
        """The trainer-mesh nodes in graph order (prox/ref logprobs and values, then train) on
        `samples`: their stats, and the names of those that ran (π_prox's forward only when this
        step's `source` of it is the data)."""
        prox_key = self.graph.input(self.graph.train, "prox_logprobs")
        stats: dict[str, float] = {}
        prox_seconds = 0.0
        ran = []
        for node in self.graph.trainer_nodes:
            is_prox = node.type != "train" and node.outputs[0] == prox_key
            if is_prox and source != "data":
                continue  # π_prox needs no forward pass this step
            t0 = time.perf_counter()
            with budget_named(f"graph.{node.name}.micro_batch_tokens", node.micro_batch_tokens,
                              self.engines[node.role].device):
                stats.update(self.run_node(node, samples, source, prox_version, kl_coef))
            if is_prox:
                prox_seconds = time.perf_counter() - t0
            ran.append(node.name)
        if prox_key is not None:
            stats["prox_seconds"] = prox_seconds
        return stats, ran

    def run_node(self, node: Node, samples: list[Sample], source: str | None, prox_version: int,
                 kl_coef: float) -> dict[str, float]:
        """One trainer-mesh node: a train node's update (its stats), or an inference node's outputs
        written into the samples."""
        if node.type == "train" and node.role == "critic":
            return {f"critic/{k}": v for k, v in self.train_critic(node, samples, kl_coef).items()}
        if node.type == "train":
            return self.train(node, samples, source, prox_version, kl_coef)
        self.infer(node, samples)
        return {}

    def all_current(self, samples: list[Sample], version: int) -> bool:
        """Whether every answer token of the step, on every trainer rank, was sampled by the weights
        at `version` (False when the train node reads no versions)."""
        key = self.graph.input(self.graph.train, "versions")
        mine = key is not None and all(np.all(s.array(key) == version) for s in samples)
        if self.n_trainers == 1 or not dist.is_initialized():
            return mine
        flag = torch.tensor([int(mine)])
        dist.all_reduce(flag, op=dist.ReduceOp.MIN)  # every rank runs the same nodes
        return bool(flag.item())

    def engine(self, node: Node) -> Engine:
        """The role's model, packing micro-batches under this node's own token budgets."""
        return configured(self.engines[node.role], node)

    def infer(self, node: Node, samples: list[Sample]) -> None:
        """Write the node's output key into every sample: it stays on this rank."""
        if self.exact is not None and node.outputs[0] == self.graph.input(self.graph.train, "prox_logprobs"):
            lps = self.exact_prox(node, samples)
        else:
            lps = node_outputs(self.engines[node.role], self.graph, node, [s.arrays for s in samples])
        for s, lp in zip(samples, lps):
            s.arrays[node.outputs[0]] = Array.of(lp)

    def exact_prox(self, node: Node, samples: list[Sample]) -> list[np.ndarray]:
        """log π_prox of the samples' answers as the servers computed them (training.zero_mismatch)."""
        self.exact.load(self.engines[node.role])
        key = partial(self.graph.input, node)
        versions = self.graph.input(self.graph.train, "versions")
        return self.exact.logprobs([s.array(key("prompt_ids")) for s in samples],
                                   [s.array(key("output_ids")) for s in samples], [s.array(versions) for s in samples])

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
