"""The zero-mismatch mode's π_prox (`training.zero_mismatch`): the trainer's logprobs computed as the
generation servers computed the behaviour logprobs, so that a token sampled by the weights π_prox
is (every token at η = 0) has log π_prox = log π_behav bit for bit, and the step's mismatch figures
(train/mismatch/*) read 0.

The trainer's own forward cannot give that: it runs each packed micro-batch through the
transformers model, whose matmuls see other row counts and whose attention sums in another order
than the server's decode steps, so its logprobs differ from the server's in their last bits (5e-6
at most on the CPU recipes: tests/test_logprob_audit.py). Here a second copy of the model, in the
servers' number format, runs the servers' own code (generation/engine/scoring.py): each request
the server ran is prefilled whole and its answer fed one decode step at a time through the
batch-invariant forward. The copy takes the trained weights as the servers do, once per version:
`export_weights` (the weight channels' source), or with LoRA the adapters `export_update` gives,
applied to the base as the servers apply them (generation/engine/adapters.py: low-rank paths, or
merged in fp32, by generation.lora_decode).

It costs a second copy of the weights in memory and a decode step per answer token instead of one
packed forward (docs/benchmarks.md, "Zero mismatch"). The training forward (log π_θ, with its
gradient) stays the transformers one: its first minibatch's ratio π_θ/π_prox is 1 only up to that
forward's last bits.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

import numpy as np
import torch
from transformers import AutoConfig, AutoModelForCausalLM

from areal_flow.config.schema import RunConfig
from areal_flow.generation.engine.adapters import Adapters
from areal_flow.generation.engine.checkpoint import copy_in, load_checkpoint
from areal_flow.generation.engine.decode import DecodeStep
from areal_flow.generation.engine.scoring import pool_for, requests_of, score
from areal_flow.runtime.devices import compute_dtype
from areal_flow.training.engine import Engine

WAVE_TOKENS = 1 << 15
"""Positions scored together (the copy's KV cache holds this many at once)."""
BUCKET_BYTES = 1 << 26
"""The trained weights travel to the copy in buckets of this size (the servers' channels' default)."""


class ZeroMismatchError(ValueError):
    """The model, or the weights the trainer exports, cannot run through the servers' forward."""


@contextmanager
def torch_threads(n: int | None) -> Iterator[None]:
    """torch's intra-op threads set to `n` (None: left) for the block, and put back after."""
    before = torch.get_num_threads()
    if n is not None:
        torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(before)


class ExactProx:
    """log π_prox of answers through the servers' forward on a copy of the trained weights.

    `model_path`: the run's model (its config); `dtype`, `threads`, `block_size`: the servers'
    number format, torch threads (CPU) and KV page size; `temperature`: the sampling temperature."""

    def __init__(self, model_path: str, *, device: torch.device, dtype: torch.dtype, threads: int | None,
                 block_size: int, temperature: float, lora_decode: str | None = None) -> None:
        config = AutoConfig.from_pretrained(model_path)
        with torch.random.fork_rng(devices=[]):  # its random init is overwritten: leave the trainer's stream
            model = AutoModelForCausalLM.from_config(config, dtype=dtype).to(device).eval()
        step = DecodeStep.for_model(model, batch_invariant=True)
        if step is None:
            raise ZeroMismatchError(f"training.zero_mismatch: {model_path} (model_type {config.model_type}) is not a "
                                    "model the generation engine's own forward computes (llama and qwen2 families), "
                                    "so its servers' logprobs cannot be reproduced")
        self.step, self.pool = step, pool_for(step, block_size)
        self.params = dict(model.named_parameters())  # the q/k/v and gate/up ones are views of their fused weight
        # LoRA (`lora_decode`: the servers' generation.lora_decode): the base's weights, once, and each
        # version's adapters applied to them as the servers apply them.
        self.adapters = None
        if lora_decode is not None:
            with torch.no_grad():
                copy_in(model, load_checkpoint(model_path))
            self.adapters = Adapters(model, device, step=step if lora_decode == "lowrank" else None,
                                     served_base=model_path)
        self.model = model
        self.tied = bool(getattr(config, "tie_word_embeddings", False))
        self.threads, self.temperature = threads, temperature
        self.version: int | None = None  # the version of the weights the copy holds

    def load(self, engine: Engine) -> None:
        """Copy the trained weights at the engine's version (nothing if the copy has them). Collective
        under FSDP or megatron: every rank calls it."""
        if engine.version == self.version:
            return
        if self.adapters is not None:
            buckets, config = engine.export_update(BUCKET_BYTES)
            if config is None:
                raise ZeroMismatchError("training.zero_mismatch: the servers take LoRA adapters, the trainer exports "
                                        "every weight")
            tensors = {name: tensor for bucket in buckets for name, tensor in bucket}
            self.adapters.prepare_tensors(config, tensors, "training.zero_mismatch")(self.model)
            self.version = engine.version
            return
        loaded = set()
        with torch.no_grad():
            for bucket in engine.export_weights(BUCKET_BYTES):
                for name, tensor in bucket:
                    target = self.params.get(name)
                    if target is None and not (self.tied and name == "lm_head.weight"):
                        raise ZeroMismatchError(f"training.zero_mismatch: the trainer exports {name!r}, which the "
                                                "servers' model does not have")
                    if target is not None:
                        if target.shape != tensor.shape:
                            raise ZeroMismatchError(f"training.zero_mismatch: {name} has shape {tuple(tensor.shape)} "
                                                    f"in the trainer, {tuple(target.shape)} in the servers' model")
                        target.copy_(tensor)  # cast to the servers' dtype, as a weight update does
                        loaded.add(name)
        if missing := sorted(set(self.params) - loaded):
            raise ZeroMismatchError(f"training.zero_mismatch: the trainer exports no {', '.join(missing[:3])}")
        self.version = engine.version

    def logprobs(self, prompts: Sequence[np.ndarray], answers: Sequence[np.ndarray],
                 versions: Sequence[np.ndarray]) -> list[np.ndarray]:
        """Per answer, float32 log π of each token under the copy's weights: each request that
        sampled it (one per run of equal versions) scored as the server ran it."""
        requests = [requests_of(p.tolist(), a.tolist(), v) for p, a, v in zip(prompts, answers, versions)]
        with torch_threads(self.threads):
            scored = score(self.step, self.pool, [r for rs in requests for r in rs], self.temperature, WAVE_TOKENS)
        out, at = [], 0
        for rs in requests:
            out.append(np.concatenate(scored[at: at + len(rs)]) if rs else np.empty(0, np.float32))
            at += len(rs)
        return out


def for_run(cfg: RunConfig, model_path: str, device: torch.device) -> ExactProx:
    """The run's ExactProx: its servers' number format, threads (a CPU server's are its cores,
    generation.tp_size) and page size (launchers/commands.py starts them so)."""
    gen, device_type = cfg.generation, cfg.cluster.device_type
    return ExactProx(model_path, device=device, dtype=compute_dtype(gen.dtype, device_type),
                     threads=gen.tp_size if device_type == "cpu" else None, block_size=gen.page_size or 16,
                     temperature=cfg.algorithm.temperature,
                     lora_decode=gen.lora_decode if cfg.training.lora.rank else None)
