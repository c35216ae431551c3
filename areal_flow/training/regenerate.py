"""Regenerating one recorded answer: the same tokens and behaviour logprobs from the weights of the
versions that made them, the sample's seed and the run's sampling settings (`python -m
areal_flow.replay RUN_DIR --regenerate STEP:UID`).

A sample's tokens come in spans, one per weight version: an update that cut the answer left its
tokens so far, and the rest was asked for on the prompt plus those tokens under the new weights
(generation/client/carry_on.py). Each span is regenerated the same way: an engine on the weights of
its version (`dump.weights` keeps them, dumps/weights/vNNNNNNNN) is asked for the span's length on
the prompt plus the tokens before it, with the sample's own seed (generation/client/seeds.py: a
seeded token draws from (seed, its position), so a continuation goes on with the stream where it
stopped). The last span runs to its end as the original did (EOS or the budget).

That gives the same tokens only where the run's servers decoded batch-invariantly
(`generation.deterministic`, on by default at η = 0): otherwise an answer's logits depend on what it
was batched with, which nothing recorded. One-turn answers of `/generate` rollouts only: an
environment's or an agent's observations are not regenerated.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np

from areal_flow.generation.client.seeds import group_seed
from areal_flow.generation.engine.generation_engine import GenerationEngine, GenerationRequest
from areal_flow.generation.engine.sampling import SamplingParams
from areal_flow.generation.engine.scoring import spans_of
from areal_flow.graph.dag import graph_from_config
from areal_flow.runtime.devices import compute_dtype
from areal_flow.runtime.spec import read_run
from areal_flow.training import flight
from areal_flow.training.dumps import adapter_path, weights_path
from areal_flow.training.replay import ReplayError
from areal_flow.weights import adapter as adapter_files


@dataclass
class Regenerated:
    spans: list[tuple[int, int]]  # (version, tokens) of the recorded answer, in order
    tokens: list[int]
    logprobs: list[float]
    recorded_tokens: list[int]
    recorded_logprobs: list[float]

    @property
    def tokens_equal(self) -> bool:
        return self.tokens == self.recorded_tokens

    @property
    def logprobs_equal(self) -> bool:
        return self.tokens_equal and np.array_equal(np.float32(self.logprobs), np.float32(self.recorded_logprobs))


def regenerate(run_dir: str, step: int, uid: str) -> Regenerated:
    """Regenerate sample `uid` of step `step` (from 0) of the run's flight record (rank 0's)."""
    cfg, _ = read_run(run_dir)
    graph = graph_from_config(cfg)
    gen = cfg.generation
    if not cfg.batch_invariant_servers:
        raise ReplayError(f"{run_dir}: the run's servers did not decode batch-invariantly (generation.deterministic), "
                          "so an answer's tokens depended on its batch: it cannot be regenerated")
    if graph.generate.takes_turns:
        raise ReplayError(f"{run_dir}: graph.{graph.generate.name} rolls out through an environment or an agent; "
                          "regeneration covers one-turn answers")
    record = flight.read(run_dir, step)
    sample = next((s for s in record.samples if s.uid == uid), None)
    if sample is None:
        raise ReplayError(f"{flight.path_of(run_dir, step, 0)}: no sample {uid!r} in step {step + 1}")
    prompt = sample.array(graph.input(graph.train, "prompt_ids")).tolist()
    output = sample.array(graph.input(graph.train, "output_ids")).tolist()
    behav = sample.array(graph.input(graph.train, "behav_logprobs")).tolist()
    spans = spans_of(sample.array(graph.output(graph.generate, "versions")))
    seed = group_seed(cfg.seed, sample.group_id, cfg.algorithm.group_size) + sample.index
    algo = cfg.algorithm
    tokens: list[int] = []
    logprobs: list[float] = []
    for i, (version, length) in enumerate(spans):
        path = weights_path(run_dir, version)
        if not os.path.isdir(path):
            raise ReplayError(f"{path}: the weights of version {version} are not kept (run with dump.weights=true)")
        last = i == len(spans) - 1
        params = SamplingParams(max_new_tokens=algo.max_new_tokens - len(tokens) if last else length,
                                temperature=algo.temperature, top_p=algo.top_p, seed=seed)
        device = cfg.cluster.device_type  # (one CPU thread: a CPU server's, on its one core)
        if adapter_files.is_adapter_dir(adapter_path(run_dir, version)):  # LoRA: the base and the adapters, as served
            path = adapter_path(run_dir, version)
        engine = GenerationEngine(path, batch_invariant=True, lora_decode=gen.lora_decode,
                                  num_threads=1 if device == "cpu" else None, page_size=gen.page_size or 16, device=device,
                                  dtype=compute_dtype(gen.dtype, device), prefix_cache=False)
        try:
            answer = engine.submit_many([GenerationRequest(tuple(prompt + tokens), params)])[0].result(timeout=600)
        finally:
            engine.shutdown()
        tokens += answer.output_ids
        logprobs += answer.output_logprobs
    return Regenerated(spans, tokens, logprobs, output, behav)
