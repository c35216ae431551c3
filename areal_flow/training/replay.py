"""Replaying the trainer's side of a run from its flight record (training/flight.py), alone: no
servers, rollout or reward workers. The replay builds the trained model as the run's trainer did,
or loads the newest checkpoint at or before the first step asked for, then runs each recorded step
through the same code the trainer ran (training/step_runner.py) with the recorded samples, π_prox
source, KL coefficient, generator states and threads, and compares the digest of the weights it
ends with against the record's. `python -m areal_flow.replay` is the command.

A run of several trainer ranks replays as as many processes, one `Replayer` each (rank r reads
its own record and joins a gloo group on this host, as the run's ranks did theirs); every rank
compares its own shard's digest and rank 0 learns the others' verdicts. A critic on a mesh of its
own is refused by name.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass, field

import msgspec
import numpy as np
import torch
import torch.distributed as dist

from areal_flow.algorithms import library
from areal_flow.algorithms.kl import kl_controller
from areal_flow.checkpoint import store
from areal_flow.generation.engine.checkpoint import load_checkpoint
from areal_flow.graph.dag import graph_from_config
from areal_flow.metrics.profile import Phases
from areal_flow.models.tokenizer import load_tokenizer
from areal_flow.runtime.spec import read_run
from areal_flow.training import flight
from areal_flow.training.build import make_engines
from areal_flow.training.dumps import dump_step, weights_path
from areal_flow.training.micro_batches import global_counts, loss_masks, micro_batch_data, seq_lengths
from areal_flow.training.step_runner import StepRunner
from areal_flow.training.updates import engine_data

REPLAY_DIR = "replay"
"""Where `--dump STEP` writes, under the run directory: replay/step-NNNNNNNN/."""


TOKENS = "tokens-rank{rank}.jsonl"
"""A dumped step's per-token figures of one rank's samples, a JSON object a sample."""


class ReplayError(ValueError):
    """The run cannot be replayed as asked (the message names the file, step or setting)."""


@dataclass
class StepResult:
    step: int  # from 0
    equal: bool  # on every rank
    digest: str  # rank 0's
    recorded: str
    loss: float | None
    recorded_loss: float | None
    differ: list[int] = field(default_factory=list)  # the ranks whose weights differ
    weight_gap: float | None = 0.0  # max |Δ| of a weight against the run's saved ones; None: none saved


class Replayer:
    """The trainer of `run_dir`, rebuilt: `start(first)` puts it where the run was before step
    `first` (from 0); `step(s)` replays step s and compares it."""

    def __init__(self, run_dir: str, rank: int = 0, dist_port: int | None = None):
        """`rank`: the trainer rank to be (each of a run's ranks replays in a process of its own);
        `dist_port`: where rank 0's store listens on this host, when the ranks need a process group."""
        self.run_dir, self.rank = run_dir, rank
        self.cfg, spec = read_run(run_dir)
        self.graph = graph_from_config(self.cfg)
        if self.graph.critic_apart is not None:
            raise ReplayError(f"{run_dir}: graph.{self.graph.critic_apart.name} trains a critic on a mesh of its own; "
                              "replay does not cover it yet")
        self.steps = flight.recorded_steps(run_dir, rank)
        if not self.steps:
            raise ReplayError(f"{os.path.join(run_dir, flight.FLIGHT)}: no flight record of rank {rank} (was the run "
                              "made with flight.record=true?)")
        # The run's ranks met at trainer 0's host; the replay's all run here.
        self.spec = msgspec.structs.replace(spec, hosts={}, dist_port=dist_port or spec.dist_port)
        torch.manual_seed(self.cfg.seed + rank)  # as the run's trainer rank before building its engines
        self.engines = make_engines(self.cfg, self.spec, self.graph, rank)
        self.kl = kl_controller(self.cfg.algorithm)
        self.runner = StepRunner(self.cfg, self.graph, self.engines, Phases(), self.kl, self.spec.n_trainers,
                                 self.spec.model_path)

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
        record = flight.read(self.run_dir, step, self.rank)
        trained = self.trained
        where = f"{flight.path_of(self.run_dir, step, self.rank)}"
        if trained.version != record.prox_version:
            raise ReplayError(f"{where}: the step started from version {record.prox_version}, the replay is at "
                              f"version {trained.version} (a gap in the record?)")
        flight.restore_rng(record)
        samples, source = self.runner.batch(record.samples, gathered=True)
        if source != record.prox_source:
            raise ReplayError(f"{where}: π_prox came from {record.prox_source!r}, the replay takes it from {source!r}")
        before = trained.logprobs(_seqs(self.graph, samples)) if dump else None
        stats, _ = self.runner.run_nodes(samples, source, trained.version, record.kl_coef)
        trained.version = step + 1
        digest = trained.weights_digest()
        if dump:
            terms, grads = self.loss_terms(samples, before, source, record)
            self.dump(step, samples, before, terms, grads)
        differ = self.differing_ranks(digest == record.digest)
        gap = self.weight_gap(step) if differ else 0.0  # equal digests: every weight equal
        return StepResult(step, not differ, digest, record.digest, _loss(stats), _loss(record.stats), differ, gap)

    def weight_gap(self, step: int) -> float | None:
        """The largest |Δ| between a weight after step `step` (from 0) and the run's own, where the
        run saved them (a checkpoint after that step, or dump.weights' copy of the next version);
        None where it did not. Collective: every rank calls it; rank 0's answer counts."""
        path = saved_weights(self.run_dir, self.graph.train.role, step + 1)
        if path is None:
            return None
        saved = load_checkpoint(path) if self.rank == 0 else {}
        gap = 0.0
        for bucket in self.trained.export_weights(1 << 28):  # every rank takes every bucket (FSDP gathers)
            for name, tensor in bucket:
                if name in saved:  # (a tied weight is saved once)
                    ref = saved[name]
                    gap = max(gap, float((tensor.to(ref.dtype).double() - ref.double()).abs().max()))
        return gap

    def differing_ranks(self, equal: bool) -> list[int]:
        """The ranks whose weights differ from their record this step (every rank learns all)."""
        if self.spec.n_trainers == 1:
            return [] if equal else [0]
        verdicts: list[bool | None] = [None] * self.spec.n_trainers
        dist.all_gather_object(verdicts, equal)
        return [r for r, ok in enumerate(verdicts) if not ok]

    def loss_terms(self, samples, before: list[np.ndarray], source: str | None, record: flight.FlightStep
                   ) -> tuple[list[np.ndarray] | None, list[np.ndarray] | None]:
        """Each token's term of the train node's objective at the step's start, and its derivative
        ∂L/∂log π_θ: the rank's samples as one minibatch whose denominator counts every rank's
        tokens (the step's first loss when algorithm.n_minibatches = 1). Terms None for a policy
        loss of the user's own (it gives its sum alone); both None when no policy loss ran."""
        inputs = self.runner.policy_inputs
        if inputs is None:
            return None, None
        data = engine_data(inputs)
        masks = loss_masks(inputs.seqs, data)
        *_, denominator = global_counts(masks, seq_lengths(inputs.seqs), self.trained.data_parallel_group, data)
        packed, mask = micro_batch_data(list(range(len(samples))), data, masks, torch.device("cpu"))
        logp = torch.tensor(np.concatenate(before), dtype=torch.float32, requires_grad=True)
        how = dict(algo=self.cfg.algorithm, prox_source=source, prox_version=record.prox_version,
                   kl_coef=record.kl_coef)
        loss, _ = library.objective(logp, packed, mask, max(denominator, 1.0), at_start=True, **how)
        loss.backward()
        terms = library.objective_terms(logp.detach(), packed, mask, max(denominator, 1.0), **how)
        cuts = np.cumsum([len(lp) for lp in before])[:-1]
        return (None if terms is None else np.split(terms.detach().numpy(), cuts)), np.split(logp.grad.numpy(), cuts)

    def dump(self, step: int, samples, before: list[np.ndarray], terms: list[np.ndarray] | None,
             grads: list[np.ndarray] | None) -> str:
        """The step's batch (every array), the policy's logprobs before the update, the per-token
        ratio, behaviour weight, loss inputs, loss terms and their gradients, and the weights after
        it, under replay/step-NNNNNNNN/."""
        folder = os.path.join(self.run_dir, REPLAY_DIR, f"step-{step + 1:08d}")
        os.makedirs(folder, exist_ok=True)
        graph, inputs = self.graph, self.runner.policy_inputs
        tokenizer = load_tokenizer(self.spec.model_path)  # the run's, as the trainer's dumps decode
        dump_step(folder, step, self.rank, samples, prompt_key=graph.input(graph.train, "prompt_ids"),
                  output_key=graph.input(graph.train, "output_ids"), reward_key=graph.input(graph.train, "rewards"),
                  versions_key=graph.output(graph.generate, "versions"),
                  loss_mask_key=graph.output(graph.generate, "loss_mask"),
                  advantages=None if inputs is None else inputs.advantages,
                  masks=None if inputs is None else inputs.valid_masks(),
                  decode=lambda ids: tokenizer.decode(ids.tolist(), skip_special_tokens=False), arrays=True)
        behav_key = graph.input(graph.train, "behav_logprobs")
        prox_key = graph.input(graph.train, "prox_logprobs")
        with open(os.path.join(folder, TOKENS.format(rank=self.rank)), "w") as f:
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
                if terms is not None:
                    row["loss_term"] = terms[i].tolist()  # they sum, over every rank's tokens, to the loss
                if grads is not None:
                    row["loss_grad"] = grads[i].tolist()  # ∂L/∂log π_θ: how hard the token is pushed
                f.write(json.dumps(row) + "\n")
        self.trained.save_weights(os.path.join(folder, "weights"))
        return folder


def saved_weights(run_dir: str, role: str, version: int) -> str | None:
    """A Hugging Face directory of `role`'s weights at `version` that the run saved: a complete
    checkpoint's, or dump.weights' (None: neither)."""
    for path in store.listed(run_dir):
        if store.problem(path) is None and store.read_manifest(path)["version"] == version:
            return os.path.join(path, role)
    dumped = weights_path(run_dir, version)
    return dumped if os.path.isdir(dumped) else None


def _seqs(graph, samples) -> list[tuple[np.ndarray, np.ndarray]]:
    prompt, output = graph.input(graph.train, "prompt_ids"), graph.input(graph.train, "output_ids")
    return [(s.array(prompt), s.array(output)) for s in samples]


def _loss(stats: dict[str, float]) -> float | None:
    loss = stats.get("loss")
    return None if loss is None or (isinstance(loss, float) and math.isnan(loss)) else float(loss)
