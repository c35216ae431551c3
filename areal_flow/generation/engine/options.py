"""The settings of one generation engine, checked when they are made: a bad value is refused
before the model is loaded, naming the setting (the server's flags map onto these one to one)."""

from __future__ import annotations

from dataclasses import dataclass

import torch

LORA_DECODE = ("lowrank", "merge")


@dataclass(frozen=True)
class EngineOptions:
    """How `GenerationEngine` decodes (generation/engine/generation_engine.py). The effective values, once the model
    is known (a model the engine's own decode step does not take gets no paged cache, and so no
    prefix cache, overlap or CUDA graphs), are the engine's attributes of the same names."""

    max_batch_size: int = 128
    """Most requests decoded together."""
    seed: int = 0
    """Seed of the engine's sampling generator (a request's own sampling_seed overrides it)."""
    num_threads: int | None = None
    """torch's intra-op threads, for the whole process (torch has no per-thread knob); None: unchanged."""
    max_total_tokens: int | None = None
    """KV cache budget in tokens: a request is admitted only while its reservation fits (the engine's
    module docstring); None: only max_batch_size (or `mem_fraction` on a GPU) bounds it."""
    weight_label: str = "default"
    """Label of the initial weights (SGLang's --weight-version); their integer version is
    `version_for_label(weight_label, -1)`."""
    fast_decode: bool = True
    """Decode with the engine's own forward (generation/engine/decode.py) where the architecture allows;
    False: every step through the transformers forward (slower; for comparison and debugging)."""
    device: str = "cpu"
    """Where the weights, the KV cache and the sampling live."""
    dtype: torch.dtype = torch.float32
    """Number format of the weights and the cache (logits are float32 for sampling either way)."""
    mem_fraction: float | None = None
    """On a GPU without max_total_tokens: the KV budget is what remains of this share of the
    device's memory once the weights are loaded (SGLang's --mem-fraction-static; generation/engine/kv_budget.py)."""
    batch_invariant: bool = False
    """A request's tokens and logprobs do not depend on what else is in the batch (SGLang's
    --enable-deterministic-inference): only with the engine's own decode step; prompts are then
    prefilled whole. About a fifth of the tokens/s of a full batch of many prompt lengths."""
    page_size: int = 16
    """Tokens per block of the paged KV cache (generation/engine/paged.py)."""
    chunked_prefill_size: int | None = None
    """Prompt tokens prefilled per forward beside the decoding rows (SGLang's
    --chunked-prefill-size); None or -1: whole prompts."""
    cuda_graphs: bool = True
    """On CUDA, not batch-invariant: decode steps replay captured graphs (generation/engine/cuda_graphs.py);
    False runs them eagerly (SGLang's --disable-cuda-graph)."""
    time_steps: bool = False
    """The paged cache: split each decode step's time into host and device work
    (generation/engine/step_timing.py; `GenerationEngine.step_timing`): for benchmarks."""
    prefix_cache: bool = True
    """The paged cache, not batch-invariant (an answer would then depend on what ran before it):
    keep ended requests' full blocks for requests that start with the same tokens (SGLang's radix cache)."""
    overlap: bool = True
    """The paged cache: launch each forward before reading back the tokens it feeds (the engine's
    overlap schedule); False reads them back first (SGLang's --disable-overlap-schedule)."""
    lora_decode: str = "lowrank"
    """LoRA updates (generation/engine/adapters.py): "lowrank" adds each adapter's low-rank path to
    its projection at decode, where the engine's own decode step runs (an update copies the adapters
    alone); "merge" merges them into the weights in fp32 (fewer operations a step, an fp32 copy of
    the adapted base weights, a merge an update)."""

    def __post_init__(self) -> None:
        if self.max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {self.max_batch_size}")
        if self.max_total_tokens is not None and self.max_total_tokens < 1:
            raise ValueError(f"max_total_tokens must be at least 1, got {self.max_total_tokens}")
        if self.page_size < 1:
            raise ValueError(f"page_size must be at least 1, got {self.page_size}")
        if self.lora_decode not in LORA_DECODE:
            raise ValueError(f"lora_decode must be one of {', '.join(LORA_DECODE)}, got {self.lora_decode!r}")
        chunk = self.chunked_prefill_size
        if chunk is not None and chunk != -1 and chunk < 1:
            raise ValueError(f"chunked_prefill_size must be -1 or at least 1, got {chunk}")

    @property
    def prefill_chunk(self) -> int | None:
        """Prompt tokens per forward; None: whole prompts (as batch-invariant decoding needs)."""
        if self.batch_invariant or self.chunked_prefill_size == -1:
            return None
        return self.chunked_prefill_size
