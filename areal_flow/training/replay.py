"""Replaying the trainer's side of a run from its flight record (training/flight.py), alone: no
servers, rollout or reward workers. The replay builds the trained model as the run's trainer did,
or loads the newest checkpoint at or before the first step asked for, then runs each recorded step
through the same code the trainer ran (training/step_runner.py) with the recorded samples, π_prox
source, KL coefficient, generator states and threads, and compares the digest of the weights it
ends with against the record's. `python -m areal_flow.replay` is the command.

A run of one trainer rank only, so far: several ranks would need as many processes (their
collectives); refused by name, as is a critic on a mesh of its own.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass

import numpy as np
import torch

from areal_flow.algorithms.kl import kl_controller
from areal_flow.checkpoint import store
from areal_flow.graph.dag import graph_from_config
from areal_flow.metrics.profile import Phases
from areal_flow.models.tokenizer import load_tokenizer
from areal_flow.runtime.spec import read_run
from areal_flow.training import flight
from areal_flow.training.build import make_engines
from areal_flow.training.dumps import dump_step
from areal_flow.training.step_runner import StepRunner

REPLAY_DIR = "replay"
"""Where `--dump STEP` writes, under the run directory: replay/step-NNNNNNNN/."""


class ReplayError(ValueError):
    """The run cannot be replayed as asked (the message names the file, step or setting)."""


@dataclass
class StepResult:
    step: int  # from 0
    equal: bool
    digest: str
    recorded: str
    loss: float | None
    recorded_loss: float | None


class Replayer:
    """The trainer of `run_dir`, rebuilt: `start(first)` puts it where the run was before step
    `first` (from 0); `step(s)` replays step s and compares it."""

    def __init__(self, run_dir: str):
        self.run_dir = run_dir
        self.cfg, self.spec = read_run(run_dir)
        if self.spec.n_trainers != 1:
            raise ReplayError(f"{run_dir}: the run had {self.spec.n_trainers} trainer ranks; replay covers runs of one "
                              "trainer rank so far")
        self.graph = graph_from_config(self.cfg)
        if self.graph.critic_apart is not None:
            raise ReplayError(f"{run_dir}: graph.{self.graph.critic_apart.name} trains a critic on a mesh of its own; "
                              "replay does not cover it yet")
        self.steps = flight.recorded_steps(run_dir)
        if not self.steps:
            raise ReplayError(f"{os.path.join(run_dir, flight.FLIGHT)}: no flight record (was the run made with "
                              "flight.record=true?)")
        torch.manual_seed(self.cfg.seed)  # as the trainer's rank 0 before building its engines
        self.engines = make_engines(self.cfg, self.spec, self.graph, 0)
        self.kl = kl_controller(self.cfg.algorithm)
        self.runner = StepRunner(self.cfg, self.graph, self.engines, Phases(), self.kl, 1, self.spec.model_path)

    @property
    def trained(self):
        return self.runner.trained

    def start(self, first: int) -> str | None:
        """Load the newest complete checkpoint saved after at most `first` steps (None: none, the
        run's base model); returns its path."""
        checkpoint = None
        for path in store.listed(self.run_dir):
            if store.problem(path) is None and store.read_manifest(path)["step"] <= first:
                checkpoint = path
        if checkpoint is not None:
            for node in self.graph.trainer_nodes:
                if node.type == "train":
                    self.engines[node.role].load_resumable(os.path.join(checkpoint, node.role))
            if "kl" in self.trained.extra_state:
                self.kl.load_state_dict(self.trained.extra_state["kl"])
        return checkpoint

    def step(self, step: int, dump: bool = False) -> StepResult:
        """Replay step `step` (from 0) from its record; with `dump`, write its inspection files."""
        record = flight.read(self.run_dir, step)
        trained = self.trained
        where = f"{flight.path_of(self.run_dir, step, 0)}"
        if trained.version != record.prox_version:
            raise ReplayError(f"{where}: the step started from version {record.prox_version}, the replay is at "
                              f"version {trained.version} (a gap in the record?)")
        flight.restore_rng(record)
        samples, source = self.runner.batch(record.samples)
        if source != record.prox_source:
            raise ReplayError(f"{where}: π_prox came from {record.prox_source!r}, the replay takes it from {source!r}")
        before = trained.logprobs(_seqs(self.graph, samples)) if dump else None
        stats, _ = self.runner.run_nodes(samples, source, trained.version, record.kl_coef)
        trained.version = step + 1
        digest = trained.weights_digest()
        if dump:
            self.dump(step, samples, before)
        return StepResult(step, digest == record.digest, digest, record.digest, _loss(stats), _loss(record.stats))

    def dump(self, step: int, samples, before: list[np.ndarray]) -> str:
        """The step's batch (every array), the policy's logprobs before the update, the per-token
        ratio and behaviour weight and loss inputs, and the weights after it, under replay/step-NNNNNNNN/."""
        folder = os.path.join(self.run_dir, REPLAY_DIR, f"step-{step + 1:08d}")
        os.makedirs(folder, exist_ok=True)
        graph, inputs = self.graph, self.runner.policy_inputs
        tokenizer = load_tokenizer(self.spec.model_path)  # the run's, as the trainer's dumps decode
        dump_step(folder, step, 0, samples, prompt_key=graph.input(graph.train, "prompt_ids"),
                  output_key=graph.input(graph.train, "output_ids"), reward_key=graph.input(graph.train, "rewards"),
                  versions_key=graph.output(graph.generate, "versions"),
                  loss_mask_key=graph.output(graph.generate, "loss_mask"),
                  advantages=None if inputs is None else inputs.advantages,
                  masks=None if inputs is None else inputs.valid_masks(),
                  decode=lambda ids: tokenizer.decode(ids.tolist(), skip_special_tokens=False), arrays=True)
        behav_key = graph.input(graph.train, "behav_logprobs")
        prox_key = graph.input(graph.train, "prox_logprobs")
        with open(os.path.join(folder, "tokens.jsonl"), "w") as f:
            for i, (sample, logp) in enumerate(zip(samples, before)):
                row = {"uid": sample.uid, "logprobs_before": logp.tolist()}
                if behav_key in sample.arrays:
                    behav = sample.array(behav_key).astype(np.float64)
                    prox = sample.array(prox_key).astype(np.float64) if prox_key in sample.arrays else behav
                    row["ratio"] = np.exp(logp - prox).tolist()  # π_θ / π_prox at the step's start
                    row["behaviour_weight"] = np.exp(prox - behav).tolist()  # π_prox / π_behav
                if inputs is not None:
                    row["advantages"] = np.asarray(inputs.advantages[i]).tolist()
                    row["in_loss"] = np.asarray(inputs.valid_masks()[i]).astype(int).tolist()
                f.write(json.dumps(row) + "\n")
        self.trained.save_weights(os.path.join(folder, "weights"))
        return folder


def _seqs(graph, samples) -> list[tuple[np.ndarray, np.ndarray]]:
    prompt, output = graph.input(graph.train, "prompt_ids"), graph.input(graph.train, "output_ids")
    return [(s.array(prompt), s.array(output)) for s in samples]


def _loss(stats: dict[str, float]) -> float | None:
    loss = stats.get("loss")
    return None if loss is None or (isinstance(loss, float) and math.isnan(loss)) else float(loss)
