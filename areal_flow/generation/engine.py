"""The embedded generation engine: batched KV-cache decoding on one background thread.

Requests queue up; at every decode step the thread admits waiting requests into the running batch
(their prompts are prefilled and their KV cache is left-padded to the batch's width), samples one
token per row, drops rows that finished, and runs one forward for the rest. Every token is tagged
with the weight version that produced it. On request it also reports prompt logprobs (from the
prefill's logits), the most likely tokens of each step, and each token as it is made (`on_token`,
which streaming answers use).

Interruption, between two decode steps (SGLang's semantics, the ones AReaL's client relies on):
- `abort(rid)` / `abort(None)` answers the matching requests at once with their tokens so far and
  finish reason "abort"; a queued one gets no tokens.
- `pause()` aborts every running request the same way and stops admitting; requests queued or
  submitted while paused wait (they have no tokens of the old weights) until `continue_generation()`.
  `pause(mode="retract")` instead puts the running requests back at the head of the queue with
  their tokens so far and drops their KV cache: after `continue_generation()` they are prefilled
  again (under the new weights, if an update came in between) and go on, and their clients see one
  uninterrupted answer (SGLang's retract mode).
- `pause(mode="in_place")` stops stepping and keeps the running requests and their KV cache; an
  update loaded meanwhile applies at once, and after `continue_generation()` the requests go on
  under the new weights on top of the old weights' cache (PipelineRL's in-flight update). Each
  token still carries the version that sampled it and its logprob is the one it was sampled with.
- `update_weights_from_disk(..., abort_all_requests=True)` aborts the running requests and loads
  the weights right away; without it (and not paused), the update waits until the running batch has
  drained (new requests are held back meanwhile). Except in place, the KV cache of old weights is
  never reused: an aborted request's client resubmits prompt + tokens so far, which is prefilled
  under the new weights.

Memory: with `max_total_tokens` set, a request is admitted only while the running requests' prompt
plus max_new_tokens, summed, stay within it (a reservation for the longest each may grow, so nothing
is ever evicted mid-answer); the others wait in order. Requests whose prompts are identical (the G
answers of one prompt, which arrive together) are prefilled once and their KV cache is copied.

Overlap schedule (`overlap`, the paged cache; SGLang's overlap scheduler): a step launches the
sampling, then the next forward, fed with the sampled tokens where they lie on the device, and only
then waits for the tokens on the host, to append them, answer the rows they end, and schedule the
next step while the device computes the forward. On a GPU the host's share of a step (Python, the
inputs, the launches) then hides behind the device's; on the CPU, where every op runs as it is
called, the tokens and logprobs are the same either way. The price: a row whose last token was
just sampled goes through one more forward, whose result is dropped.

This engine knows nothing about HTTP; `server.py` puts SGLang's API in front of it.
"""

from __future__ import annotations

import dataclasses
import functools
import json
import logging
import math
import operator
import threading
import time
import uuid
from collections import deque
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
import torch
from safetensors.torch import load_file
from transformers import AutoModelForCausalLM
from transformers.cache_utils import Cache

from areal_flow.generation.compute_counts import ComputeCounts
from areal_flow.generation.cuda_graphs import GraphRunner
from areal_flow.generation.decode import DecodeStep
from areal_flow.generation.kv_batch import Batch, GrowingLayer, Row
from areal_flow.generation.requests import (  # noqa: F401  (the engine's public types, imported from here too)
    EngineShutdownError,
    GenerationRequest,
    GenerationResult,
    version_for_label,
)
from areal_flow.generation.paged import BlockPool
from areal_flow.generation.paged_batch import PagedBatch, Prefilled, can_follow
from areal_flow.generation.sampling import (  # noqa: F401
    GREEDY_TEMPERATURE,
    RowSampling,
    SamplingParams,
    sample,
    sample_next_tokens,
    scaled_logprobs,
    top_logprobs,
)
from areal_flow.runtime.devices import to_device
from areal_flow.generation.step_timing import StepTimer

logger = logging.getLogger(__name__)

def load_checkpoint(path: str) -> dict[str, torch.Tensor]:
    """Read the weights of a Hugging Face directory (model.safetensors, or an index of shards)."""
    root = Path(path)
    if not root.is_dir():
        raise FileNotFoundError(f"model_path {path!r} is not a directory")
    index = root / "model.safetensors.index.json"
    if (root / "model.safetensors").is_file():
        files = [root / "model.safetensors"]
    elif index.is_file():
        files = [root / name for name in sorted(set(json.loads(index.read_text())["weight_map"].values()))]
    else:
        raise FileNotFoundError(f"model_path {path!r} has no model.safetensors or model.safetensors.index.json")
    state: dict[str, torch.Tensor] = {}
    for file in files:
        try:
            state.update(load_file(file))
        except Exception as exc:  # safetensors raises its own error types for truncated/corrupt files
            raise ValueError(f"cannot read weights from {file}: {exc}") from exc
    return state


@dataclass
class _WeightUpdate:
    path: str | None  # the directory the weights came from (the new model_path); None: not from disk
    source: str  # what they came from, for the log
    version: int
    label: str | None  # None: keep the current label
    state: dict[str, torch.Tensor]
    abort_all: bool  # abort the running requests instead of waiting for them
    done: Future = field(default_factory=Future)


@dataclass
class _Abort:
    rid: str | None  # None: every request
    queued_too: bool  # also answer the matching requests that wait in the queue
    retract: bool = False  # requeue the running requests with their tokens instead of answering them
    in_place: bool = False  # touch no request: only return once the thread is between two steps
    done: Future = field(default_factory=Future)


PAUSE_MODES = ("abort", "retract", "in_place")
"""SGLang's pause modes, all implemented by the engine."""


class GenerationEngine:
    """Decodes requests from a queue in batches on a background thread (see the module docstring).

    `num_threads` sets torch's intra-op threads for the whole process (torch has no per-thread knob).
    """

    def __init__(
        self, model_path: str, *, max_batch_size: int = 128, seed: int = 0, num_threads: int | None = None,
        tokenizer: Any = None, max_total_tokens: int | None = None, weight_label: str = "default",
        fast_decode: bool = True, device: str = "cpu", dtype: torch.dtype = torch.float32,
        mem_fraction: float | None = None, batch_invariant: bool = False, page_size: int = 16,
        chunked_prefill_size: int | None = None, cuda_graphs: bool = True, time_steps: bool = False,
        prefix_cache: bool = True, overlap: bool = True,
    ) -> None:
        """`tokenizer` (a transformers tokenizer) decodes outputs for stop strings; without one,
        requests with stop strings are refused. `max_total_tokens` bounds the KV cache (see the
        module docstring); None leaves only max_batch_size. `weight_label` names the initial weights
        (SGLang's --weight-version); the initial integer version is `version_for_label(weight_label, -1)`.
        `fast_decode=False` runs every decode step through the transformers forward instead of the
        engine's own (generation/decode.py): slower, for comparison and debugging. `device` holds the
        weights, the KV cache and the sampling; `dtype` is the weights' and the cache's number format
        (logits are float32 for sampling and logprobs either way). `mem_fraction` (a GPU, no
        max_total_tokens): the KV budget is what remains of that share of the device's memory once
        the weights are loaded (`kv_budget_tokens`). `batch_invariant` (the server's
        --enable-deterministic-inference): a request's tokens and logprobs do not depend on what
        else is in the batch, so a seeded request answers bit-identically however requests arrive
        (generation/decode.py: measured on the CPU; only with the engine's own decode step);
        prompts are then prefilled whole. It costs about a fifth of the tokens/s of a full batch of
        many prompt lengths. `page_size`: tokens per block of the paged KV cache
        (generation/paged.py). `chunked_prefill_size`: prompt tokens prefilled per forward, beside
        the decoding rows' tokens (SGLang's --chunked-prefill-size); None or -1: whole prompts.
        `cuda_graphs` (on CUDA, not batch-invariant): decode steps replay captured graphs
        (generation/cuda_graphs.py); False runs them eagerly (SGLang's --disable-cuda-graph).
        `time_steps` (the paged cache): split each decode step's time into the engine's host work
        and the device's (generation/step_timing.py; `step_timing()` reads it): for benchmarks,
        off by default. `prefix_cache` (the paged cache, not batch-invariant: a request's answer
        would then depend on what ran before it): keep ended requests' full blocks for requests
        that start with the same tokens (generation/paged.py; SGLang's radix cache). `overlap` (the
        paged cache): launch each forward before reading back the tokens it feeds (the module
        docstring's overlap schedule); False reads them back first (SGLang's
        --disable-overlap-schedule)."""
        if max_batch_size < 1:
            raise ValueError(f"max_batch_size must be at least 1, got {max_batch_size}")
        if max_total_tokens is not None and max_total_tokens < 1:
            raise ValueError(f"max_total_tokens must be at least 1, got {max_total_tokens}")
        if num_threads is not None:
            torch.set_num_threads(num_threads)
        self.device, self.dtype = torch.device(device), dtype
        self.model = AutoModelForCausalLM.from_pretrained(model_path, dtype=dtype, attn_implementation="sdpa")
        self.model.to(self.device).eval().requires_grad_(False)
        config = self.model.config
        if any(kind != "full_attention" for kind in getattr(config, "layer_types", None) or ()):
            raise ValueError(f"{model_path}: sliding-window attention layers are not supported by the embedded engine")
        self.model_path = model_path
        self.max_batch_size = max_batch_size
        if max_total_tokens is None and mem_fraction is not None and self.device.type == "cuda":
            # This process's own memory: a colocated trainer's is outside the share, as in SGLang.
            total, weights = torch.cuda.get_device_properties(self.device).total_memory, \
                torch.cuda.memory_allocated(self.device)
            max_total_tokens = kv_budget_tokens(mem_fraction, total, weights, kv_bytes_per_token(config, dtype))
            logger.info("KV budget %d tokens: %.0f%% of %.1f GiB, of which the weights take %.1f GiB",
                        max_total_tokens, 100 * mem_fraction, total / 2**30, weights / 2**30)
        self.max_total_tokens = max_total_tokens
        self.seed = seed
        self.num_threads = torch.get_num_threads()
        self._join_group = max(1, max_batch_size // 8)
        # Compact the batch once a quarter of its rows are dead (measured best of 1/2, 3/4, 9/10 on
        # tools/bench_generation.py): a dead row costs a full row of every decode step until then.
        self._compact_at = 0.75
        self.vocab_size: int = config.vocab_size
        self.context_length: int | None = getattr(config, "max_position_embeddings", None)
        self.eos_token_ids = _eos_ids(self.model)
        # Decode steps in plain torch ops where the architecture allows (generation/decode.py).
        self._decode_step = DecodeStep.for_model(self.model, batch_invariant=batch_invariant) if fast_decode else None
        # Only the engine's own decode step is batch-invariant (the transformers forward pads).
        self.batch_invariant = self._decode_step is not None and batch_invariant
        # The paged cache serves the models the engine's own forward takes; the others keep the
        # transformers forward over a left-padded cache (kv_batch.Batch).
        self._pool: BlockPool | None = None
        if self._decode_step is not None:
            if page_size < 1:
                raise ValueError(f"page_size must be at least 1, got {page_size}")
            step = self._decode_step
            self._pool = BlockPool(
                layers=len(step.layers), kv_heads=step.kv_heads, head_dim=step.head_dim, block_size=page_size,
                num_blocks=None if max_total_tokens is None else -(-max_total_tokens // page_size),
                dtype=dtype, device=self.device, prefix_cache=prefix_cache and not self.batch_invariant)
        # The graphs that replay decode steps (None: eager).
        self.cuda_graphs = GraphRunner(self._decode_step, max_rows=max_batch_size, capture=True) if (
            self._pool is not None and cuda_graphs and self.device.type == "cuda" and not self.batch_invariant) else None
        if chunked_prefill_size is not None and chunked_prefill_size != -1 and chunked_prefill_size < 1:
            raise ValueError(f"chunked_prefill_size must be -1 or at least 1, got {chunked_prefill_size}")
        # Prompt tokens per forward (None: whole prompts, as batch-invariant decoding needs).
        self.chunked_prefill_size = None if batch_invariant or chunked_prefill_size == -1 else chunked_prefill_size
        self.page_size = page_size if self._pool is not None else None  # None: the left-padded cache
        self.prefix_cache = self._pool is not None and self._pool.prefix_cache  # ended requests' blocks kept
        self.overlap = self._pool is not None and overlap  # forwards launched before the tokens are read back
        if batch_invariant and not self.batch_invariant:
            logger.warning("batch-invariant decoding needs the engine's own decode step, which %s does not take: "
                           "a request's logprobs may depend on the batch", model_path)
        self._decode: Callable[[list[int]], str] | None = None if tokenizer is None else functools.partial(
            tokenizer.decode, skip_special_tokens=False)
        self._generator = torch.Generator(device=self.device).manual_seed(seed)
        self._timer = StepTimer(self.device) if time_steps and self._pool is not None else None
        self._version = version_for_label(weight_label, -1)
        self._label = weight_label
        self._cond = threading.Condition()
        self._waiting: deque[Row] = deque()
        self._updates: deque[_WeightUpdate] = deque()
        self._aborts: list[_Abort] = []
        self._paused = False
        self._flush = False  # flush_cache asked: the decode thread empties the prefix cache next
        self._inflight: set[str] = set()
        self._stopping = False
        self._running: list[Row] = []  # the live rows after the last decode step
        self._generated_tokens = 0
        self._busy_seconds = 0.0
        self._load_seconds = 0.0  # copying weight updates in (decoding stops meanwhile)
        self._memory_releases = 0  # release_memory calls: a colocated trainer's turns
        self._counts = ComputeCounts()
        self._idle_from: float | None = None  # when the decode thread began to wait for work, while it waits
        # Rows a step finished, answered once the step's counts and busy time are in the stats:
        # whoever reads an answer may read the stats next.
        self._step_finished: list[Row] = []
        self._finished_reqs = 0
        self._finished_prompt_tokens = 0
        self._thread = threading.Thread(target=self._run, name="generation-engine", daemon=True)
        self._thread.start()

    # ---- public API -------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._version

    @property
    def weight_label(self) -> str:
        return self._label

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._stopping

    def submit(
        self,
        input_ids: Sequence[int],
        *,
        max_new_tokens: int = 128,
        temperature: float = 1.0,
        top_p: float = 1.0,
        top_k: int = -1,
        stop_token_ids: Sequence[int] = (),
        ignore_eos: bool = False,
        min_p: float = 0.0,
        stop: Sequence[str] = (),
        seed: int | None = None,
        rid: str | None = None,
    ) -> Future[GenerationResult]:
        params = SamplingParams(max_new_tokens, temperature, top_p, top_k, tuple(stop_token_ids), ignore_eos,
                                min_p, tuple(stop), seed)
        request = GenerationRequest(tuple(input_ids), params, rid or uuid.uuid4().hex)
        return self.submit_many([request])[0]

    def submit_many(self, requests: Sequence[GenerationRequest]) -> list[Future[GenerationResult]]:
        """Queue requests; all are validated first, so either all are queued or none (ValueError)."""
        for request in requests:
            self._validate(request)
        rids = [r.rid for r in requests]
        if len(set(rids)) != len(rids):
            raise ValueError(f"Duplicate request ID detected: {next(r for r in rids if rids.count(r) > 1)}")
        futures: list[Future[GenerationResult]] = []
        with self._cond:
            if self._stopping:
                raise EngineShutdownError("the generation engine is shut down")
            clash = next((rid for rid in rids if rid in self._inflight), None)
            if clash is not None:
                raise ValueError(f"Duplicate request ID detected: {clash} is still in flight")
            for request in requests:
                future: Future[GenerationResult] = Future()
                futures.append(future)
                if request.params.max_new_tokens == 0 and request.logprob_start_len is None:
                    future.set_result(self._result(Row(request, future, frozenset()), ("length", None)))
                    continue
                # As SGLang: ignore_eos also ignores stop_token_ids (the request answers "length").
                stop_ids = frozenset() if request.params.ignore_eos else \
                    frozenset(request.params.stop_token_ids) | self.eos_token_ids
                self._inflight.add(request.rid)
                self._waiting.append(Row(request, future, stop_ids, self._decode))
            self._cond.notify_all()
        return futures

    def update_weights_from_disk(self, path: str, version: int, *, abort_all_requests: bool = False,
                                 label: str | None = None) -> None:
        """Load new weights and set the version (and the label, unless None); returns once they serve requests.

        The file is read and checked on the caller's thread while decoding goes on. Then the running
        requests are aborted (abort_all_requests) or drained, and the weights are copied in. A bad
        path or a checkpoint of another shape raises and leaves the old weights and version.
        """
        state = load_checkpoint(path)
        self._check_compatible(f"weights in {path!r}", state, complete=True)
        self._hand_over(self._updates, _WeightUpdate(path, path, version, label, state, abort_all_requests))

    def update_weights_from_tensors(self, state: dict[str, torch.Tensor], version: int, *, source: str,
                                    abort_all_requests: bool = False, label: str | None = None) -> None:
        """Load some of the weights (one bucket of a broadcast: `state` maps Hugging Face names to
        tensors) as `update_weights_from_disk` loads a directory; `source` names them in errors and
        the log. A floating dtype other than the model's is cast as it is copied in (SGLang's
        loaders do the same). A name the model does not have, a shape that does not match or a
        tensor that is not floating point raises ValueError naming the tensor, and nothing of
        `state` is loaded: the old weights and version stay."""
        self._check_compatible(source, state, complete=False)
        self._hand_over(self._updates, _WeightUpdate(None, source, version, label, state, abort_all_requests))

    def abort(self, rid: str | None = None, *, wait: bool = True) -> None:
        """Answer the request `rid` (None: every request, queued or running) with finish reason
        "abort" and its tokens so far; returns once answered (or at once, without `wait`). An
        unknown rid does nothing."""
        self._hand_over(self._aborts, _Abort(rid, queued_too=True), wait=wait)

    def pause(self, mode: str = "abort") -> None:
        """Step no request until `continue_generation`; queued and new requests wait. The running
        ones are aborted (mode "abort": answered with their tokens so far), retracted (mode
        "retract": queued again, first in line, with their tokens so far) or held where they are
        (mode "in_place": they keep their KV cache and go on after `continue_generation`, under
        the weights loaded meanwhile, on top of the cache of the old ones). Returns once done."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        with self._cond:
            self._paused = True
        self._hand_over(self._aborts, _Abort(None, queued_too=False, retract=mode == "retract",
                                             in_place=mode == "in_place"))

    def release_memory(self) -> None:
        """Retract the running requests (as pause "retract": they go on after `continue_generation`,
        in the same answers) and free the KV cache they held, so that a trainer on the same device
        can step in it (SGLang's /release_memory_occupation of the kv_cache). Stays paused."""
        self.pause(mode="retract")
        self._memory_releases += 1
        if self._pool is not None:  # paused: the decode thread holds no block, and takes them back when it goes on
            self._pool.free_memory()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # to the driver: the trainer is another process

    def continue_generation(self) -> None:
        with self._cond:
            self._paused = False
            self._cond.notify_all()

    def flush_cache(self) -> None:
        """Empty the prefix cache (SGLang's /flush_cache) before the next request is admitted."""
        with self._cond:
            self._flush = True
            self._cond.notify_all()

    @property
    def paused(self) -> bool:
        return self._paused

    def is_idle(self) -> bool:
        """No request running or waiting (SGLang refuses /flush_cache otherwise)."""
        with self._cond:
            return not self._inflight

    def _hand_over(self, queue: deque | list, command: _WeightUpdate | _Abort, wait: bool = True) -> None:
        """Queue a command for the decode thread, which carries it out between two steps; wait for it."""
        with self._cond:
            if self._stopping:
                raise EngineShutdownError("the generation engine is shut down")
            queue.append(command)
            self._cond.notify_all()
        if wait:
            command.done.result()

    def step_timing(self) -> dict[str, float] | None:
        """With `time_steps`: the running sums of the decode steps' host and device time
        (`StepTimer.totals`; `step_timing.per_step_ms` turns two into means); None without."""
        return None if self._timer is None else self._timer.totals()

    def stats(self) -> dict[str, float]:
        with self._cond:  # the decode thread adds a wait to `waited` under this lock when it ends
            waiting, updates = len(self._waiting), len(self._updates)
            waited = self._counts.waited + (time.perf_counter() - self._idle_from if self._idle_from else 0.0)
        running = [row for row in self._running if row.finish is None]  # one may have finished since
        return {
            "num_running_reqs": len(running),
            "num_waiting_reqs": waiting,
            "kv_tokens_used": sum(row.last_position + 1 for row in running),  # prompt + tokens so far
            "kv_tokens_reserved": sum(row.kv_tokens for row in running),
            "kv_tokens_budget": self.max_total_tokens or 0,
            # The paged cache's blocks (0 over the transformers path; a total of 0: it grows).
            "kv_blocks_used": 0 if self._pool is None else self._pool.used_blocks,
            "kv_blocks_total": 0 if self._pool is None or self._pool.growable else self._pool.num_blocks,
            "kv_blocks_cached": 0 if self._pool is None else self._pool.cached_blocks,
            "paused": self._paused,
            "num_pending_weight_updates": updates,
            "generated_tokens": self._generated_tokens,
            "busy_seconds": self._busy_seconds,
            "load_seconds": self._load_seconds,
            "memory_releases": self._memory_releases,
            **dataclasses.asdict(self._counts),
            "waited": waited,
            "weight_version": self._version,
            "num_finished_reqs": self._finished_reqs,
            "finished_prompt_tokens": self._finished_prompt_tokens,
        }

    def shutdown(self) -> None:
        """Stop the thread; requests and updates not finished get EngineShutdownError."""
        with self._cond:
            self._stopping = True
            self._cond.notify_all()
        if threading.current_thread() is not self._thread:
            self._thread.join()

    # ---- validation ---------------------------------------------------------------------------

    def _validate(self, request: GenerationRequest) -> None:
        ids, p = request.input_ids, request.params
        if len(ids) == 0:
            raise ValueError("input_ids cannot be empty.")
        if p.max_new_tokens < 0:
            raise ValueError(f"max_new_tokens must be at least 0, got {p.max_new_tokens}.")
        if self.max_total_tokens is not None and len(ids) + p.max_new_tokens > self.max_total_tokens:
            raise ValueError(
                f"the request needs {len(ids) + p.max_new_tokens} tokens of KV cache ({len(ids)} of prompt and "
                f"max_new_tokens {p.max_new_tokens}), more than the server's max_total_tokens {self.max_total_tokens}")
        if self.context_length is not None and len(ids) + p.max_new_tokens > self.context_length:
            raise ValueError(
                f"Requested token count exceeds the model's maximum context length of {self.context_length} tokens. "
                f"You requested a total of {len(ids) + p.max_new_tokens} tokens: {len(ids)} tokens from the input "
                f"messages and {p.max_new_tokens} tokens for the completion (max_new_tokens). Please reduce the "
                "number of tokens in the input messages or the completion to fit within the limit."
            )
        # After the lengths: a prompt far over them is refused at once, not after a walk over its ids.
        try:
            bad = next((t for t in ids if not 0 <= operator.index(t) < self.vocab_size), None)
        except TypeError:
            raise ValueError("input_ids must hold integers") from None
        if bad is not None:
            raise ValueError(f"input_ids holds token id {bad}, outside the vocabulary [0, {self.vocab_size})")
        if not (p.temperature >= 0 and math.isfinite(p.temperature)):
            raise ValueError(f"temperature must be non-negative and finite, got {p.temperature}.")
        if not 0 < p.top_p <= 1:
            raise ValueError(f"top_p must be in (0, 1], got {p.top_p}.")
        if p.top_k == 0 or p.top_k < -1:
            raise ValueError(f"top_k must be -1 (disable) or at least 1, got {p.top_k}.")
        if any(t < 0 for t in p.stop_token_ids):
            raise ValueError(f"stop_token_ids must be non-negative token ids, got {list(p.stop_token_ids)}")
        if not 0 <= p.min_p <= 1:
            raise ValueError(f"min_p must be in [0, 1], got {p.min_p}.")
        if p.stop and self._decode is None:
            raise ValueError("stop strings need a tokenizer; this engine has none (send stop_token_ids instead)")
        if len(p.stop) > 32 or any(not isinstance(s, str) or not s for s in p.stop):
            raise ValueError(f"stop must be at most 32 non-empty strings, got {list(p.stop)!r}")
        if p.seed is not None and not -(2**63) <= p.seed < 2**64:
            raise ValueError(f"sampling_seed must fit in 64 bits, got {p.seed}")
        start = request.logprob_start_len
        if start is not None and not 0 <= start <= len(ids):
            raise ValueError(f"logprob_start_len must be in [0, {len(ids)}] (the prompt's length), got {start}")
        if not 0 <= request.top_logprobs_num <= self.vocab_size:
            raise ValueError(f"top_logprobs_num must be in [0, {self.vocab_size}] (the vocabulary size), "
                             f"got {request.top_logprobs_num}")

    def _check_compatible(self, what: str, state: dict[str, torch.Tensor], *, complete: bool) -> None:
        """Refuse weights that would not fit the served model, before any of them is copied;
        `complete`: every weight must be there (a checkpoint, not a bucket)."""
        expected = self.model.state_dict()
        unknown = sorted(set(state) - set(expected))
        # named_parameters() drops duplicates, so a tied lm_head may be absent from the file.
        missing = sorted({name for name, _ in self.model.named_parameters()} - set(state)) if complete else []
        wrong = [f"{n} {tuple(t.shape)} != {tuple(expected[n].shape)}" for n, t in state.items()
                 if n in expected and t.shape != expected[n].shape]
        not_float = [f"{n} {str(t.dtype).removeprefix('torch.')}" for n, t in state.items()
                     if n in expected and not t.is_floating_point() and expected[n].is_floating_point()]
        problems = [
            f"unknown weights {unknown[:3]}" if unknown else "",
            f"missing weights {missing[:3]}" if missing else "",
            f"shape mismatch {wrong[:3]}" if wrong else "",
            f"not floating point {not_float[:3]}" if not_float else "",
        ]
        if any(problems):
            raise ValueError(f"{what} do not fit the served model: " + "; ".join(p for p in problems if p))

    # ---- the decode thread --------------------------------------------------------------------

    def _run(self) -> None:
        batch: Batch | PagedBatch | None = None
        with torch.inference_mode():
            while True:
                with self._cond:
                    # Paused, nothing steps: a batch held in place waits for continue_generation.
                    self._idle_from = time.perf_counter()  # stats() counts a wait in progress too
                    while not (self._stopping or (self._waiting and not self._paused) or self._updates
                               or self._aborts or (batch and not self._paused)):
                        if self._timer is not None:
                            self._timer.idle()  # the next step does not follow the last at once
                        self._cond.wait()
                    self._counts.waited += time.perf_counter() - self._idle_from
                    self._idle_from = None
                    if self._stopping:
                        break
                    aborts, self._aborts = self._aborts, []
                    flush, self._flush = self._flush, False
                    if self._updates and self._updates[0].abort_all:
                        aborts.append(_Abort(None, queued_too=False))
                    if any(abort.retract for abort in aborts) and batch is not None:
                        self._retract(batch)
                        batch = None  # the old weights' cache goes with it
                    aborted = self._take_aborted(aborts, batch)
                    update, admitted = None, []
                    if self._updates:
                        # Admit nothing while an update waits, so the running batch drains.
                        # (An update with abort_all has just aborted every running row; paused,
                        # the update is applied at once, as SGLang does, also under a held batch.)
                        if batch is None or not batch.live() or self._paused:
                            update = self._updates.popleft()
                    elif not self._paused:
                        admitted = self._admit(batch)
                if flush and self._pool is not None:
                    self._pool.flush()  # before anything new takes from it
                for row in aborted:
                    self._finish(row)
                for abort in aborts:
                    abort.done.set_result(None)
                if aborts:  # some rows may have been aborted or retracted
                    if batch is not None and not batch.live():
                        batch = self._discard(batch)  # every row aborted: the old weights' cache goes with it
                    self._count_running(batch)
                started = time.perf_counter()
                if update is not None:
                    self._apply_update(update)
                    continue
                if (batch is None and not admitted) or self._paused:
                    continue  # woken for an abort, or paused (a batch held in place waits)
                try:
                    if self._pool is not None:
                        batch = self._paged_step(batch, admitted, started)
                    elif admitted:
                        batch = self._join(batch, admitted, started)
                    elif len(batch.live()) <= self._compact_at * len(batch.rows):
                        batch = Batch.combine([(batch, batch.live())])  # enough rows dead: compact
                    # A compaction's copy counts with the decode step it comes before.
                    decoding = time.perf_counter() if admitted else started
                    if self._pool is None:
                        rows, width = len(batch.live()), batch.mask.shape[1] + 1  # the forward adds a column
                        batch = self._step(batch)
                        self._counts.decoded(rows, rows * width, time.perf_counter() - decoding)
                except Exception as exc:
                    logger.exception("decode step failed; failing the requests in it")
                    self._answer_step_finished()  # rows finished before the failure keep their answers
                    self._fail([*(batch.rows if batch else ()), *admitted], exc)
                    batch = self._discard(batch)
                # Time spent computing, for the generator's busy fraction in the run metrics.
                self._busy_seconds += time.perf_counter() - started
                self._answer_step_finished()
                self._count_running(batch)
        self._count_running(None)
        with self._cond:
            waiting, updates, aborts = list(self._waiting), list(self._updates), self._aborts
            self._waiting.clear()
            self._updates.clear()
            self._aborts = []
        for abort in aborts:  # the requests it was for fail below, which answers them too
            abort.done.set_result(None)
        self._fail([*(batch.rows if batch else ()), *waiting], EngineShutdownError("the generation engine shut down"))
        self._discard(batch)
        for update in updates:
            update.done.set_exception(EngineShutdownError("the generation engine shut down before the update"))

    def _admit(self, batch: Batch | None) -> list[Row]:
        """Take the requests that join the running batch off the queue, in order (caller holds the lock)."""
        if not self._waiting:
            return []  # every decode step asks: spare it the pass over the running rows
        live = batch.live_rows() if batch is not None else []
        room = self.max_batch_size - len(live)
        if self._pool is None:
            # New requests join in groups: each join costs a prefill forward and a copy of the
            # left-padded cache, so only a short queue may join one request at a time.
            if batch is not None and room < min(self._join_group, len(self._waiting)):
                return []
            budget = self.max_total_tokens
            # A reservation for the longest each request may grow: nothing is evicted mid-answer.
            free = math.inf if budget is None else budget - sum(row.kv_tokens for row in live)
        else:
            # Paged: the blocks a request needs now, with one block kept free for each running
            # row's next (a request that runs out later is retracted: paged_batch.make_room).
            free = self._pool.free_blocks - len(live)
            prefilling = {row.sequence for row in live
                          if row.computed < len(row.request.input_ids) + len(row.output_ids)}
            # How far the prefills of those sequences have got: a row that wants prompt logprobs
            # from a position one has passed cannot follow it and prefills its own (PagedBatch.add).
            progress = batch.prefill_progress() if isinstance(batch, PagedBatch) else {}
        admitted: list[Row] = []
        while self._waiting and len(admitted) < room:
            row = self._waiting[0]
            forks = False
            if self._pool is None:
                need = row.kv_tokens
            elif row.sequence in prefilling and can_follow(progress.get(row.sequence, 0), row):
                need, forks = 2, True  # forks a prompt being prefilled: its own last block
            else:
                need = self._pool.blocks_for(len(row.sequence) + 1) + 1
            if need > free:
                break  # it waits for running requests to finish; the ones behind it wait their turn
            self._waiting.popleft()
            if self._claim(row):
                admitted.append(row)
                free -= need
                if self._pool is not None:
                    prefilling.add(row.sequence)
                    if not forks:  # it leads a prefill from the start, which any row can follow
                        progress[row.sequence] = 0
        return admitted

    def _claim(self, row: Row) -> bool:
        """Mark a queued row's future as running; False (and the rid freed) if it was cancelled.
        A retracted row's future is running already."""
        if row.future.running() or row.future.set_running_or_notify_cancel():
            return True
        self._inflight.discard(row.request.rid)
        return False

    def _retract(self, batch: Batch | PagedBatch) -> None:
        """Queue the live rows of `batch` again, first in line, with their tokens so far (caller holds
        the lock); their KV cache is dropped."""
        rows = batch.live_rows()
        self._discard(batch)
        self._requeue(rows)

    def _discard(self, batch: Batch | PagedBatch | None) -> None:
        """Drop a batch and its KV cache (the paged one's blocks back to the pool); returns None."""
        if isinstance(batch, PagedBatch):
            batch.release_all()
        if self._pool is not None:  # and whatever a failed step left taken
            self._pool.reset()

    def _requeue(self, rows: list[Row]) -> None:
        """Queue rows again, first in line, to be prefilled anew with their tokens so far (caller holds the lock)."""
        for row in rows:
            row.retractions += 1
        self._waiting.extendleft(reversed(rows))

    def _count_running(self, batch: Batch | None) -> None:
        # The rows only: stats() sums their tokens when asked, not every decode step.
        self._running = batch.live_rows() if batch is not None else []

    def _take_aborted(self, aborts: list[_Abort], batch: Batch | None) -> list[Row]:
        """Mark the rows that `aborts` match as finished by abort and take queued ones off the
        queue (caller holds the lock); returns them, to be answered outside the lock."""
        if not aborts:
            return []
        hit = []
        running = batch.live_rows() if batch is not None else []
        for abort in aborts:
            if abort.in_place:
                continue
            for row in running:
                if row.finish is None and abort.rid in (None, row.request.rid):
                    row.finish = ("abort", None)
                    hit.append(row)
            if abort.queued_too:
                queued = [row for row in self._waiting if abort.rid in (None, row.request.rid)]
                for row in queued:
                    self._waiting.remove(row)
                    if self._claim(row):
                        row.finish = ("abort", None)
                        hit.append(row)
        return hit

    def _join(self, batch: Batch | None, admitted: list[Row], started: float) -> Batch:
        """Prefill the admitted rows and add them to the running batch (the left-padded cache of the
        transformers forward); the copy that joins them counts with the prefill."""
        part = self._prefill(admitted)
        joined = part if batch is None else Batch.combine(
            [(batch, batch.live()), (part, list(range(len(part.rows))))])
        lengths = [len(q) for q in {row.sequence for row in admitted}]
        self._counts.prefilled(sum(lengths), len(lengths) * max(lengths), time.perf_counter() - started)
        return joined

    def _prefill(self, rows: list[Row]) -> Batch:
        """One forward over the rows' prompts (a retracted row: prompt + tokens so far). Identical
        sequences are computed once and their cache rows copied."""
        sequences: dict[tuple[int, ...], int] = {}
        index = [sequences.setdefault(row.sequence, len(sequences)) for row in rows]
        for row in rows:
            row.logits_version = self._version
        width = max(map(len, sequences))
        ids = torch.zeros(len(sequences), width, dtype=torch.int64)  # pad id 0: masked out, never attended
        mask = torch.zeros(len(sequences), width, dtype=torch.int64)
        for i, sequence in enumerate(sequences):
            ids[i, width - len(sequence):] = torch.tensor(sequence)
            mask[i, width - len(sequence):] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)  # built on the host: one copy each
        positions = (mask.cumsum(dim=1) - 1).clamp(min=0)
        # Prompt logits only for rows that asked for prompt logprobs, and only from their start. (A
        # retracted row has them already.)
        scored = [r for r in rows if r.request.logprob_start_len is not None and not r.output_ids]
        keep = max([1] + [len(r.request.input_ids) - r.request.logprob_start_len for r in scored])
        out = self.model(input_ids=ids, attention_mask=mask, position_ids=positions,
                         past_key_values=Cache(layer_class_to_replicate=GrowingLayer), use_cache=True,
                         logits_to_keep=keep)
        cache, logits = out.past_key_values, out.logits
        if len(sequences) < len(rows):
            rows_of = torch.tensor(index, device=self.device)
            cache = Cache(layers=[GrowingLayer.gather([(layer.keys, layer.values, rows_of, 0)], width)
                                  for layer in cache.layers])
            mask, logits = mask[rows_of], logits[rows_of]
        if scored:
            self._prompt_logprobs(rows, logits)
        return Batch(rows, cache, mask, logits[:, -1].float())

    def _prompt_logprobs(self, rows: list[Row], logits: torch.Tensor) -> None:
        """Fill the prompt logprobs of the rows that asked for them from the prefill's logits
        [B, keep, V] (the last `keep` positions); answer the rows that only wanted those."""
        keep = logits.shape[1]
        for row, row_logits in zip(rows, logits):
            request = row.request
            if request.logprob_start_len is None or row.output_ids:
                continue
            ids, start = request.input_ids, request.logprob_start_len
            if len(ids) - start > keep:  # a slice past the start would silently read other positions
                raise RuntimeError(f"request {request.rid}: its prefill kept the logits of {keep} prompt "
                                   f"positions, its prompt logprobs need {len(ids) - start}")
            # Position p's logits predict token p + 1: tokens start+1 .. n-1 need positions start .. n-2.
            logprobs = torch.log_softmax(row_logits[keep - (len(ids) - start): keep - 1].float(), dim=-1)
            targets = torch.tensor(ids[start + 1:], dtype=torch.int64, device=logprobs.device)
            head: list[Any] = [None] if start < len(ids) else []
            row.input_logprobs = head + logprobs.gather(1, targets[:, None]).squeeze(1).tolist()
            if request.top_logprobs_num:
                row.input_top_logprobs = head + [top_logprobs(lp, request.top_logprobs_num) for lp in logprobs]
            if request.params.max_new_tokens == 0:  # prefill-only scoring
                row.finish = ("length", None)
                self._step_finished.append(row)

    def _paged_step(self, batch: PagedBatch | None, admitted: list[Row], started: float) -> PagedBatch | None:
        """Sample a token for every ready row, then one forward: their new tokens and the next
        chunk of the rows being prefilled (generation/paged_batch.py). Counts the step's time as
        decode and prefill, split by tokens.

        With `overlap`, the forward is launched before the sampled tokens are read back: it feeds
        them from the device, and the host answers and schedules while the device computes (the
        module docstring). Rows are then known to have finished one forward late: they go through
        it, and are dropped after (their extra keys and values freed with their blocks)."""
        if self._timer is not None:
            self._timer.begin(started)
        if batch is None:
            batch = PagedBatch(self._pool, self._decode_step, self.chunked_prefill_size, self.cuda_graphs,
                               timer=self._timer)
        self._pool.ensure()
        batch.add(admitted)
        batch.drop_finished()
        sampled, kv, drawn = len(batch.ready), 0, None
        if sampled:
            if batch.sampling is None:
                batch.sampling = RowSampling.of([row.request.params for row in batch.ready], self.device)
            drawn = self._launch_sample(batch.ready, batch.logits, batch.sampling)
            kv = sum(row.computed + 1 for row in batch.ready)  # what their forward reads, as if all went on
            if not self.overlap:
                self._take(drawn)
                drawn = None
                batch.drop_finished()
        decode_tokens, prefill_tokens = 0, 0
        if batch.rows:
            retracted = batch.make_room()
            keep = {id(leader): self._prompt_positions(leader, batch.followers.get(id(leader), ()))
                    for leader in batch.pending}
            # Overlapped: the ready rows are the sampled ones (less those retracted, the last), in order.
            fed = None if drawn is None else drawn.tokens[: len(batch.ready)]
            decode_tokens, prefill_tokens, completed = batch.forward(keep, fed)
            if drawn is not None:  # the device computes the forward meanwhile
                self._take(drawn)
                drawn = None
            if retracted:  # a retracted row whose last token ended it is answered, not queued
                with self._cond:
                    self._requeue([row for row in retracted if row.finish is None])
            self._prefilled(batch, completed)
            for row in batch.ready:
                row.logits_version = self._version  # the forward computed its next logits
            if self.overlap:
                batch.drop_finished()  # the rows the tokens just read back ended
        if drawn is not None:  # (every sampled row is in the forward: never left here)
            self._take(drawn)
        seconds = time.perf_counter() - started
        share = prefill_tokens / max(1, decode_tokens + prefill_tokens)
        if sampled:
            self._counts.decoded(sampled, kv, seconds * (1 - share))
        if prefill_tokens:
            self._counts.prefilled(prefill_tokens, prefill_tokens, seconds * share)
        self._counts.cached_tokens += batch.cached_tokens
        batch.cached_tokens = 0
        if self._timer is not None:
            self._timer.end(decode_only=bool(sampled) and not prefill_tokens)
        return batch if batch.rows else None

    def _prefilled(self, batch: PagedBatch, completed: list[Prefilled]) -> None:
        """The prompt logprobs of the rows whose prefill the forward completed, for those that asked."""
        for prefilled in completed:
            rows = [prefilled.leader, *prefilled.followers]
            logits = prefilled.prompt_logits
            if logits is None and any(row.request.logprob_start_len is not None and not row.output_ids
                                      for row in rows):
                # Asked from the prompt's end: no position kept, and none reported, but a
                # prefill-only request (max_new_tokens 0) is answered there, not sampled.
                logits = batch.logits[:0]
            if logits is not None:
                self._prompt_logprobs(rows, logits[None].expand(len(rows), -1, -1))

    @staticmethod
    def _prompt_positions(leader: Row, followers: Sequence[Row]) -> int:
        """How many of the last positions of a sequence the rows prefilling it need logits of: for
        prompt logprobs from logprob_start_len (0: none; the last one's come anyway). Only rows
        that joined before the prefill passed their first one follow it (paged_batch.can_follow)."""
        return max((row.prompt_positions for row in (leader, *followers)), default=0)

    def _step(self, batch: Batch) -> Batch | None:
        """Sample a token for every live row, set aside the rows that finish, decode one step."""
        alive, tokens = self._sample(batch.rows, batch.logits, batch.sampling)
        if alive == 0:
            return None
        batch.mask = torch.cat([batch.mask, batch.mask.new_ones(len(batch.rows), 1)], dim=1)
        # A dead row's position stops advancing, so it never runs past the context length.
        positions = torch.tensor([row.last_position for row in batch.rows], device=self.device)
        out = self.model(
            input_ids=tokens[:, None], attention_mask=batch.mask, position_ids=positions[:, None],
            past_key_values=batch.cache, use_cache=True,
        )
        batch.logits = out.logits[:, -1].float()
        return batch

    def _sample(self, rows: list[Row], logits: torch.Tensor, sampling: RowSampling) -> tuple[int, torch.Tensor]:
        """Sample a token for every live row of `rows` from `logits` [len(rows), V] and append it;
        set aside the rows that finish. Returns how many rows are still live, and the tokens."""
        drawn = self._launch_sample(rows, logits, sampling)
        return self._take(drawn), drawn.tokens

    def _launch_sample(self, rows: list[Row], logits: torch.Tensor, sampling: RowSampling) -> _Drawn:
        """Launch the sampling of a token for every row of `rows` from `logits` [len(rows), V], and
        the copy of the tokens and their logprobs to the host, without waiting for either."""
        positions = None if sampling.seeded is None else to_device(
            [row.next_position for row in rows], logits.device, torch.int64)
        timer = self._timer
        if timer is not None:
            timer.sample_launching()
        tokens, logprobs = sample(logits, sampling, positions, self._generator)
        if timer is not None:
            timer.sample_launched()
        self._top_logprobs(rows, logits, sampling.temperature)
        return _Drawn.launch(rows, tokens, logprobs)

    def _take(self, drawn: _Drawn) -> int:
        """Wait for `drawn`'s tokens and append each to its row (the live ones); set aside the rows
        that finish. Returns how many rows are still live."""
        token_list, logprobs = drawn.read()  # the step's one wait for the device
        if self._timer is not None:
            self._timer.mark("readback")
        rows = drawn.rows
        if np.isnan(logprobs).any():
            bad = rows[int(np.flatnonzero(np.isnan(logprobs))[0])].request.rid
            raise FloatingPointError(f"the model's logits for request {bad} hold NaN (broken weights?)")
        alive = 0
        for row, token, logprob in zip(rows, token_list, logprobs.tolist()):
            if row.finish is not None:
                continue  # dead row: decodes along, unused, until the next compaction
            row.append(token, logprob, row.logits_version)
            row.logits_version = self._version  # the forward below computes its next logits
            self._generated_tokens += 1
            if row.finish is None:
                alive += 1
                if row.request.on_token is not None:
                    self._report(row)
            else:
                self._step_finished.append(row)
        return alive

    def _top_logprobs(self, rows: list[Row], logits: torch.Tensor, temperature: torch.Tensor) -> None:
        """Append the most likely tokens of this step to the live rows that asked for them, from the
        distribution they sample from (temperature-scaled, as their output logprobs)."""
        asked = [i for i, row in enumerate(rows) if row.finish is None and row.request.top_logprobs_num]
        if not asked:
            return
        logprobs = scaled_logprobs(logits[asked], temperature[asked])
        for i, row_logprobs in zip(asked, logprobs):
            row = rows[i]
            row.top_logprobs.append(top_logprobs(row_logprobs, row.request.top_logprobs_num))

    def _report(self, row: Row) -> None:
        try:
            row.request.on_token(self._result(row, (None, None)))
        except Exception:  # a faulty listener must not fail the batch
            logger.exception("on_token of request %s failed", row.request.rid)

    def _apply_update(self, update: _WeightUpdate) -> None:
        started, error = time.perf_counter(), None
        try:
            params = self.model.state_dict()  # these tensors share storage with the model's
            for name, tensor in update.state.items():
                params[name].copy_(tensor)
            self._version = update.version
            self._label = self._label if update.label is None else update.label
            if self._pool is not None:
                self._pool.flush()  # cached keys and values are the old weights'
            if update.path is not None:
                self.model_path = update.path
        except Exception as exc:
            logger.exception("weight update from %s failed", update.source)
            error = exc
        # Counted before the caller hears it is done: it may read the stats next.
        self._load_seconds += time.perf_counter() - started
        if error is not None:
            update.done.set_exception(error)
        else:
            logger.info("weights from %s loaded, version %d", update.source, update.version)
            update.done.set_result(None)

    def _result(self, row: Row, finish: tuple[str | None, int | str | None]) -> GenerationResult:
        return GenerationResult(
            rid=row.request.rid, prompt_tokens=len(row.request.input_ids), output_ids=row.output_ids,
            output_logprobs=row.logprobs, output_versions=row.versions, finish_reason=finish[0],
            matched_stop=finish[1], weight_version=self._version, retractions=row.retractions,
            weight_label=self._label, output_top_logprobs=row.top_logprobs, input_logprobs=row.input_logprobs,
            input_top_logprobs=row.input_top_logprobs, cached_tokens=row.cached_tokens,
        )

    def _finish(self, row: Row) -> None:
        assert row.finish is not None
        # Free the rid first: a client may reuse it as soon as it reads the answer.
        with self._cond:
            self._inflight.discard(row.request.rid)
        self._finished_reqs += 1
        self._finished_prompt_tokens += len(row.request.input_ids)
        self._counts.answered += 1
        row.future.set_result(self._result(row, row.finish))

    def _answer_step_finished(self) -> None:
        rows, self._step_finished = self._step_finished, []
        for row in rows:
            self._finish(row)

    def _fail(self, rows: Sequence[Row], exc: BaseException) -> None:
        # Rows already answered are skipped: their rid may already belong to a new request.
        # (A row can be listed twice: admitted, and already combined into the batch.)
        unanswered = list({id(row): row for row in rows if not row.future.done()}.values())
        with self._cond:
            for row in unanswered:
                self._inflight.discard(row.request.rid)
        for row in unanswered:
            row.future.set_exception(exc)


@dataclass
class _Drawn:
    """Sampled tokens on their way to the host: the rows they are for, the tokens [B] int64 on the
    device, and one host buffer [2B] int64 that a copy launched with them fills (the float32
    logprobs travel as their bits, sign-extended into int64, and come back bit for bit: one
    transfer and one wait, not one each)."""

    rows: list[Row]
    tokens: torch.Tensor
    host: torch.Tensor
    copied: torch.cuda.Event | None  # recorded after the copy (CUDA); None: the copy is done

    @classmethod
    def launch(cls, rows: list[Row], tokens: torch.Tensor, logprobs: torch.Tensor) -> _Drawn:
        both = torch.cat([tokens, logprobs.float().view(torch.int32).to(torch.int64)])
        if tokens.device.type != "cuda":
            return cls(rows, tokens, both, None)
        # Into pinned memory without waiting: the copy is queued before the next forward, so
        # waiting for it later waits for the sampling alone.
        host = torch.empty(both.shape, dtype=torch.int64, pin_memory=True)
        host.copy_(both, non_blocking=True)
        copied = torch.cuda.Event()
        copied.record()
        return cls(rows, tokens, host, copied)

    def read(self) -> tuple[list[int], np.ndarray]:
        """The tokens as a list and their logprobs as float32, once the copy is done."""
        if self.copied is not None:
            self.copied.synchronize()
        both = self.host.numpy()
        rows = len(both) // 2
        return both[:rows].tolist(), both[rows:].astype(np.int32).view(np.float32)


def kv_bytes_per_token(config: Any, dtype: torch.dtype) -> int:
    """Bytes of KV cache one token takes in every layer: keys and values of each KV head."""
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    kv_heads = getattr(config, "num_key_value_heads", None) or config.num_attention_heads
    return 2 * config.num_hidden_layers * kv_heads * head_dim * dtype.itemsize


def kv_budget_tokens(mem_fraction: float, total_bytes: int, used_bytes: int, per_token_bytes: int) -> int:
    """The KV cache tokens that fit in `mem_fraction` of a device's `total_bytes` beside the
    `used_bytes` the server already holds (its weights); SGLang's --mem-fraction-static rule.
    Raises ValueError when nothing is left for the cache."""
    left = int(mem_fraction * total_bytes) - used_bytes
    if left < per_token_bytes:
        raise ValueError(f"generation.mem_fraction_static={mem_fraction} of {total_bytes / 2**30:.1f} GiB leaves no "
                         f"room for a KV cache: the server's weights take {used_bytes / 2**30:.1f} GiB of it; raise it")
    return left // per_token_bytes


def _eos_ids(model: torch.nn.Module) -> frozenset[int]:
    """The eos ids of the config and the generation config together (as SGLang does)."""
    ids: set[int] = set()
    for source in (model.config, getattr(model, "generation_config", None)):
        eos = getattr(source, "eos_token_id", None)
        if eos is not None:
            ids.update([eos] if isinstance(eos, int) else eos)
    return frozenset(ids)
