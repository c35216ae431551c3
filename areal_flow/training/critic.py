"""The training half of a critic on a mesh of its own (graph/dag.py `critic_apart`).

Its process is the critic inference node's one replica (training/inference.py): it computes each
routed group's values as soon as the group is scored, with the critic as it is then, and the trainer
ranks join them to their groups. At each step every trainer rank sends it the value loss's inputs
for its share of the batch (CriticBatch: the returns the rank computed from those values and the
rewards); once every rank's share is in, it makes the step's optimizer steps, as the ranks would
have (whole-group minibatches, `ppo_epochs` passes), and tells every rank (CriticTrained), which
waits for it before reporting its step done. The actor trains on the trainer ranks meanwhile. A
checkpoint's critic part is written here when trainer rank 0 forwards the SaveCheckpoint, and a
resumed run's critic is loaded here.

On several devices its processes train data parallel (FSDP2 over their own process group) and
answer value requests independently, each for the groups routed to it. A forward through sharded
weights is a collective, which independent requests cannot make together, so each process also
holds a whole copy of the critic for its values, refreshed from the trained one after each update
(when every process is there) at the price of the critic's weights once more on each device.

What differs from a critic on the trainer ranks: values come from the critic of when the group was
scored (up to the staleness bound's versions older than the step's), not of the step itself.
"""

from __future__ import annotations

import logging
import os
from functools import partial

import torch

from areal_flow.algorithms import library
from areal_flow.config.schema import RunConfig
from areal_flow.graph.node import Node
from areal_flow.runtime.spec import RunSpec
from areal_flow.training.build import CRITIC_DIR, configured
from areal_flow.training.engine import Engine, budget_named
from areal_flow.training.updates import train_update
from areal_flow.transport.messages import CriticBatch, CriticSaved, CriticTrained, SaveCheckpoint

log = logging.getLogger("areal_flow.critic")


class CriticTrainer:
    """Collects each step's CriticBatch from every trainer rank and trains on them together.
    `values`: the engine that answers value requests; `engine` itself, or (on several devices) a
    whole copy of it, which `refresh` brings up to date."""

    def __init__(self, cfg: RunConfig, spec: RunSpec, engine: Engine, node: Node, name: str,
                 values: Engine | None = None):
        self.cfg, self.engine, self.node, self.name = cfg, engine, node, name
        self.values = values if values is not None else engine
        self.n_trainers = spec.n_trainers
        self.pending: dict[int, dict[int, CriticBatch]] = {}  # step -> rank -> its share
        if spec.resume:
            engine.load_resumable(os.path.join(spec.resume, CRITIC_DIR))
            log.info("%s: the critic resumed from %s at version %d", name, spec.resume, engine.version)
            self.refresh()  # a fresh start loaded both from the same files: nothing to copy

    def refresh(self) -> None:
        """The value copy takes the trained weights: collective over the critic's processes."""
        if self.values is self.engine:
            return
        target = self.values.model
        with torch.no_grad():
            for bucket in self.engine.export_weights():
                for name, tensor in bucket:
                    target.get_parameter(name).copy_(tensor)
        self.values.version = self.engine.version

    def batch(self, msg: CriticBatch) -> CriticTrained | None:
        """A rank's share arrived: the step's CriticTrained once every rank's is in, else None."""
        shares = self.pending.setdefault(msg.step, {})
        if msg.rank in shares:
            log.error("%s: a second share of step %d from trainer rank %d, dropped", self.name, msg.step + 1, msg.rank)
            return None
        shares[msg.rank] = msg
        if len(shares) < self.n_trainers:
            return None
        del self.pending[msg.step]
        return self.train(msg.step, [shares[r] for r in sorted(shares)])

    def train(self, step: int, shares: list[CriticBatch]) -> CriticTrained:
        """The step's optimizer steps over every rank's share, as one batch."""
        group_ids = [g for m in shares for g in m.group_ids]
        seqs = [(p.numpy(), o.numpy()) for m in shares for p, o in zip(m.prompts, m.outputs)]
        keys = shares[0].token_data.keys()
        data = {k: [a.numpy() for m in shares for a in m.token_data[k]] for k in keys}
        engine = configured(self.engine, self.node)
        with budget_named(f"graph.{self.node.name}.micro_batch_tokens", self.node.micro_batch_tokens, engine.device):
            stats = train_update(engine, group_ids, seqs, data,
                                 partial(library.critic_objective, algo=self.cfg.algorithm), self.cfg.algorithm)
        engine.version = step + 1
        self.refresh()
        log.info("%s: trained the critic on step %d (%d sequences of %d groups from %d ranks), now version %d",
                 self.name, step + 1, len(seqs), len(set(group_ids)), len(shares), engine.version)
        return CriticTrained(step, engine.version, stats, self.name)

    def save(self, msg: SaveCheckpoint) -> CriticSaved:
        """The critic's part of a checkpoint: its resumable state, or at the end of a run its
        Hugging Face directory, under `msg.path/critic`."""
        path = os.path.join(msg.path, CRITIC_DIR)
        if msg.groups is None:
            self.engine.save(path)
        else:
            self.engine.save_resumable(path)
        log.info("%s: wrote the critic (version %d) to %s", self.name, self.engine.version, path)
        return CriticSaved(msg.path, self.name)
