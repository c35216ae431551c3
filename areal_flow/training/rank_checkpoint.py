"""A trainer rank's part of a checkpoint, and its resume from one.

At the end of a run the trained role is saved as a Hugging Face directory (a critic beside it). A
resumable checkpoint (checkpoint/store.py: its folder and manifest) holds, from each rank, every
trained role's `save_resumable` folder, the scored groups the rank held and had not trained
(HELD), and the length of its trained-samples log (TRAINER_STATE), to which the launcher cuts the
log back on resume.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
from functools import cached_property
from typing import IO

import msgspec

from areal_flow.checkpoint import store
from areal_flow.graph.dag import Graph
from areal_flow.models.tokenizer import load_tokenizer
from areal_flow.runtime import run_dir as rd
from areal_flow.runtime.disk import DiskFull, writing
from areal_flow.runtime.spec import RunSpec
from areal_flow.training.build import CRITIC_DIR
from areal_flow.training.engine import Engine
from areal_flow.transport.messages import SaveCheckpoint, ScoredGroup

log = logging.getLogger("areal_flow.trainer")

HELD, TRAINER_STATE = rd.HELD, rd.TRAINER_STATE


class RankCheckpoints:
    """The checkpoint half of ModelWorker, which sets what it reads (`spec`, `graph`, `rank`,
    `name`, `engines`, `held`, `trained_log`) and provides `wait_for` (receive until the rank holds
    the groups) and `save_critic_apart` (a critic on a mesh of its own writes its part)."""

    spec: RunSpec
    graph: Graph
    rank: int
    name: str
    engines: dict[str, Engine]
    held: dict[int, ScoredGroup]
    trained_log: IO[str]

    def wait_for(self, groups: list[int], what: str) -> None:
        raise NotImplementedError

    def save_critic_apart(self, msg: SaveCheckpoint) -> None:
        raise NotImplementedError

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
