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

Where each part lives: the settings, checked when made, in options.py; what callers hand
the decode thread, in inbox.py; the decode thread's loop in decode_loop.py, which asks
scheduler.py what joins the batch and a stepper (stepper.py) to run each step: the engine's own
forward over a paged cache (paged_stepper.py, with the overlap schedule) or the transformers
forward over a left-padded cache (dense_stepper.py); sampled tokens reach their rows through
sampler.py.

This engine knows nothing about HTTP; generation/http/ puts SGLang's API in front of it.
"""

from __future__ import annotations

import dataclasses
import functools
import logging
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from typing import Any

import torch

from areal_flow.generation.compute_counts import ComputeCounts
from areal_flow.generation.engine import scheduler
from areal_flow.generation.engine.adapters import Adapters
from areal_flow.generation.engine.checkpoint import check_compatible, eos_ids, load_checkpoint, load_model
from areal_flow.generation.engine.commands import PAUSE_MODES, Abort, WeightUpdate
from areal_flow.generation.engine.cuda_graphs import GraphRunner
from areal_flow.generation.engine.decode import DecodeStep
from areal_flow.generation.engine.decode_loop import DecodeLoop
from areal_flow.generation.engine.dense_stepper import DenseStepper
from areal_flow.generation.engine.inbox import Inbox
from areal_flow.generation.engine.kv_batch import Row
from areal_flow.generation.engine.kv_budget import resolve_budget
from areal_flow.generation.engine.options import EngineOptions
from areal_flow.generation.engine.paged import BlockPool
from areal_flow.generation.engine.paged_stepper import PagedStepper
from areal_flow.generation.engine.request_checks import RequestLimits, check_request
from areal_flow.generation.engine.requests import (  # noqa: F401  (the engine's public types, imported from here too)
    EngineShutdownError,
    GenerationRequest,
    GenerationResult,
    version_for_label,
)
from areal_flow.generation.engine.sampler import Sampler
from areal_flow.generation.engine.sampling import SamplingParams  # noqa: F401  (likewise)
from areal_flow.generation.engine.step_timing import StepTimer
from areal_flow.generation.engine.stepper import Stepper
from areal_flow.weights import adapter as adapter_files

logger = logging.getLogger(__name__)


class GenerationEngine:
    """Decodes requests from a queue in batches on a background thread (see the module docstring).

    `options` are EngineOptions' fields (checked before the model loads). `tokenizer` (a
    transformers tokenizer) decodes outputs for stop strings; without one, requests with stop
    strings are refused. The attributes set here are the settings in effect for this model."""

    def __init__(self, model_path: str, *, tokenizer: Any = None, **options: Any) -> None:
        self.options = opts = EngineOptions(**options)
        if opts.num_threads is not None:
            torch.set_num_threads(opts.num_threads)
        self.device, self.dtype = torch.device(opts.device), opts.dtype
        # An adapter directory (a restarted server of a LoRA run): its base, the adapters applied below.
        self.model = load_model(adapter_files.base_of(model_path), opts.dtype, self.device)
        self.model_path = model_path
        config = self.model.config
        self.max_batch_size, self.seed = opts.max_batch_size, opts.seed
        self.max_total_tokens = resolve_budget(opts.max_total_tokens, opts.mem_fraction, config, opts.dtype,
                                               self.device)
        self.num_threads = torch.get_num_threads()
        self.vocab_size: int = config.vocab_size
        self.context_length: int | None = getattr(config, "max_position_embeddings", None)
        self.eos_token_ids = eos_ids(self.model)
        self._decode: Callable[[list[int]], str] | None = None if tokenizer is None else functools.partial(
            tokenizer.decode, skip_special_tokens=False)
        self._limits = RequestLimits(self.vocab_size, self.context_length, self.max_total_tokens,
                                     stop_strings=self._decode is not None)
        self._memory_releases = 0  # release_memory calls: a colocated trainer's turns
        self._counts = ComputeCounts()
        self._inbox = Inbox()
        self._stepper = self._make_stepper(opts)  # also makes the timer and the sampler
        # How LoRA updates apply: low-rank paths of the decode step, or merged (generation.lora_decode).
        self.lora_decode = "lowrank" if self._decode_step is not None and opts.lora_decode == "lowrank" else "merge"
        self._adapters = Adapters(self.model, self.device, served_base=adapter_files.base_of(model_path),
                                  step=self._decode_step if self.lora_decode == "lowrank" else None)
        if adapter_files.is_adapter_dir(model_path):
            adapters = self._adapters.prepare(model_path)
            adapters(self.model)  # (the decode thread is not started yet)
            self._sampler.adapter_digest = adapters.digest
        self._loop = DecodeLoop(self._inbox, self._stepper, self._sampler, self._counts, self.model,
                                opts.max_batch_size, self._timer)
        self._thread = self._loop.thread
        self._loop.start()

    def _make_stepper(self, opts: EngineOptions) -> Stepper:
        """The paged backend for the models the engine's own decode step takes (generation/engine/decode.py);
        the dense one, over the transformers forward, for the others. Sets the effective settings."""
        self._decode_step = decode_step = DecodeStep.for_model(self.model, batch_invariant=opts.batch_invariant) \
            if opts.fast_decode else None
        # Only the engine's own decode step is batch-invariant (the transformers forward pads).
        self.batch_invariant = decode_step is not None and opts.batch_invariant
        if opts.batch_invariant and not self.batch_invariant:
            logger.warning("batch-invariant decoding needs the engine's own decode step, which %s does not take: "
                           "a request's logprobs may depend on the batch", self.model_path)
        paged = decode_step is not None
        self.chunked_prefill_size = opts.prefill_chunk
        self.page_size = opts.page_size if paged else None  # None: the left-padded cache
        self.overlap = paged and opts.overlap  # forwards launched before the tokens are read back
        # The graphs that replay decode steps (None: eager).
        self.cuda_graphs = GraphRunner(decode_step, max_rows=opts.max_batch_size, capture=True) if (
            paged and opts.cuda_graphs and self.device.type == "cuda" and not self.batch_invariant) else None
        self._timer = StepTimer(self.device) if opts.time_steps and paged else None
        self._sampler = Sampler(self.device, opts.seed, version_for_label(opts.weight_label, -1), opts.weight_label,
                                self._timer)
        if not paged:
            self.prefix_cache = False
            return DenseStepper(self.model, self.device, self._sampler, self._counts, opts.max_batch_size,
                                self.max_total_tokens)
        budget, size = self.max_total_tokens, opts.page_size
        pool = BlockPool(
            layers=len(decode_step.layers), kv_heads=decode_step.kv_heads, head_dim=decode_step.head_dim,
            block_size=size, num_blocks=None if budget is None else -(-budget // size), dtype=opts.dtype,
            device=self.device, prefix_cache=opts.prefix_cache and not self.batch_invariant)
        self.prefix_cache = pool.prefix_cache  # ended requests' blocks kept
        return PagedStepper(pool, decode_step, self._sampler, self._counts, chunk_tokens=self.chunked_prefill_size,
                            graphs=self.cuda_graphs, overlap=self.overlap, timer=self._timer,
                            requeue=self._requeue)

    def _requeue(self, rows: list[Row]) -> None:
        """Queue rows the paged cache retracted again, first in line."""
        with self._inbox.cond:
            scheduler.requeue(self._inbox.waiting, rows)

    # ---- public API -------------------------------------------------------------------------

    @property
    def version(self) -> int:
        return self._sampler.version

    @property
    def weight_label(self) -> str:
        return self._sampler.label

    @property
    def is_running(self) -> bool:
        return self._thread.is_alive() and not self._inbox.stopping

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
            check_request(request, self._limits)
        rids = [r.rid for r in requests]
        if len(set(rids)) != len(rids):
            raise ValueError(f"Duplicate request ID detected: {next(r for r in rids if rids.count(r) > 1)}")
        rows = [Row(request, Future(), self._stop_ids(request), self._decode) for request in requests]
        queued, now = [], []  # now: nothing to generate and no prompt logprobs, answered at once
        for row in rows:
            (now if row.request.params.max_new_tokens == 0 and row.request.logprob_start_len is None
             else queued).append(row)
        self._inbox.queue(queued, rids)
        for row in now:
            row.future.set_result(self._sampler.result(row, ("length", None)))
        return [row.future for row in rows]

    def _stop_ids(self, request: GenerationRequest) -> frozenset[int]:
        # As SGLang: ignore_eos also ignores stop_token_ids (the request answers "length").
        if request.params.ignore_eos:
            return frozenset()
        return frozenset(request.params.stop_token_ids) | self.eos_token_ids

    def update_weights_from_disk(self, path: str, version: int, *, abort_all_requests: bool = False,
                                 label: str | None = None) -> None:
        """Load new weights and set the version (and the label, unless None); returns once they serve requests.

        The file is read and checked on the caller's thread while decoding goes on. Then the running
        requests are aborted (abort_all_requests) or drained, and the weights are copied in. A bad
        path or a checkpoint of another shape raises and leaves the old weights and version.
        `path` may be a PEFT adapter directory (LoRA updates): its adapters are applied to the base
        it names (`Adapters`), and their digest goes with every answer (`adapter_digest`).
        """
        if adapter_files.is_adapter_dir(path):
            adapters = self._adapters.prepare(path)
            update = WeightUpdate(path, version, label, {}, abort_all_requests, adapter_digest=adapters.digest,
                                  apply=adapters)
        else:
            state = load_checkpoint(path)
            check_compatible(self.model, f"weights in {path!r}", state, complete=True)
            update = WeightUpdate(path, version, label, state, abort_all_requests, apply=self._adapters.replaced(path))
        self._inbox.hand_over(self._inbox.updates, update)
        self.model_path = path

    def update_adapters_from_tensors(self, tensors: dict[str, torch.Tensor], config: dict, version: int, *,
                                     source: str, abort_all_requests: bool = False, label: str | None = None) -> None:
        """A LoRA update sent as tensors (broadcast or handle: weights/adapter.py `transfer_config`),
        applied as `update_weights_from_disk` applies an adapter directory; ValueError names what does
        not fit, and nothing is loaded."""
        adapters = self._adapters.prepare_tensors(config, tensors, source)
        self._inbox.hand_over(self._inbox.updates, WeightUpdate(
            source, version, label, {}, abort_all_requests, adapter_digest=adapters.digest, apply=adapters))

    @property
    def adapter_digest(self) -> str | None:
        """The digest of the adapters applied to the weights served now (None: full weights)."""
        return self._sampler.adapter_digest

    def update_weights_from_tensors(self, state: dict[str, torch.Tensor], version: int, *, source: str,
                                    abort_all_requests: bool = False, label: str | None = None) -> None:
        """Load some of the weights (one bucket of a broadcast: `state` maps Hugging Face names to
        tensors) as `update_weights_from_disk` loads a directory; `source` names them in errors and
        the log. A floating dtype other than the model's is cast as it is copied in (SGLang's
        loaders do the same). A name the model does not have, a shape that does not match or a
        tensor that is not floating point raises ValueError naming the tensor, and nothing of
        `state` is loaded: the old weights and version stay."""
        check_compatible(self.model, source, state, complete=False)
        self._inbox.hand_over(self._inbox.updates, WeightUpdate(source, version, label, state, abort_all_requests,
                                                                apply=self._adapters.replaced(None)))

    def abort(self, rid: str | None = None, *, wait: bool = True) -> None:
        """Answer the request `rid` (None: every request, queued or running) with finish reason
        "abort" and its tokens so far; returns once answered (or at once, without `wait`). An
        unknown rid does nothing."""
        self._inbox.hand_over(self._inbox.aborts, Abort(rid, queued_too=True), wait=wait)

    def pause(self, mode: str = "abort") -> None:
        """Step no request until `continue_generation`; queued and new requests wait. The running
        ones are aborted (mode "abort": answered with their tokens so far), retracted (mode
        "retract": queued again, first in line, with their tokens so far) or held where they are
        (mode "in_place": they keep their KV cache and go on after `continue_generation`, under
        the weights loaded meanwhile, on top of the cache of the old ones). Returns once done."""
        if mode not in PAUSE_MODES:
            raise ValueError(f"pause mode must be one of {PAUSE_MODES}, got {mode!r}")
        self._inbox.set_paused(True)
        self._inbox.hand_over(self._inbox.aborts, Abort(None, queued_too=False, retract=mode == "retract",
                                                        in_place=mode == "in_place"))

    def release_memory(self) -> None:
        """Retract the running requests (as pause "retract": they go on after `continue_generation`,
        in the same answers) and free the KV cache they held, so that a trainer on the same device
        can step in it (SGLang's /release_memory_occupation of the kv_cache). Stays paused."""
        self.pause(mode="retract")
        self._memory_releases += 1
        # Paused: the decode thread holds no block, and takes them back when it goes on.
        self._stepper.free_memory()
        if self.device.type == "cuda":
            torch.cuda.empty_cache()  # to the driver: the trainer is another process

    def continue_generation(self) -> None:
        self._inbox.set_paused(False)

    def flush_cache(self) -> None:
        """Empty the prefix cache (SGLang's /flush_cache) before the next request is admitted."""
        self._inbox.ask_flush()

    @property
    def paused(self) -> bool:
        return self._inbox.paused

    def is_idle(self) -> bool:
        """No request running or waiting (SGLang refuses /flush_cache otherwise)."""
        with self._inbox.cond:
            return not self._inbox.inflight

    def step_timing(self) -> dict[str, float] | None:
        """With `time_steps`: the running sums of the decode steps' host and device time
        (`StepTimer.totals`; `step_timing.per_step_ms` turns two into means); None without."""
        return None if self._timer is None else self._timer.totals()

    def stats(self) -> dict[str, float]:
        loop, inbox = self._loop, self._inbox
        with inbox.cond:  # the decode thread adds a wait to `waited` under this lock when it ends
            waiting, updates = len(inbox.waiting), len(inbox.updates)
            waited = self._counts.waited + (time.perf_counter() - loop.idle_from if loop.idle_from else 0.0)
        running = [row for row in loop.running if row.finish is None]  # one may have finished since
        used, total, cached = self._stepper.blocks()
        return {
            "num_running_reqs": len(running),
            "num_waiting_reqs": waiting,
            "kv_tokens_used": sum(row.last_position + 1 for row in running),  # prompt + tokens so far
            "kv_tokens_reserved": sum(row.kv_tokens for row in running),
            "kv_tokens_budget": self.max_total_tokens or 0,
            # The paged cache's blocks (0 over the transformers path; a total of 0: it grows).
            "kv_blocks_used": used,
            "kv_blocks_total": total,
            "kv_blocks_cached": cached,
            "paused": inbox.paused,
            "num_pending_weight_updates": updates,
            "generated_tokens": self._sampler.generated_tokens,
            "busy_seconds": loop.busy_seconds,
            "load_seconds": loop.load_seconds,
            "memory_releases": self._memory_releases,
            **dataclasses.asdict(self._counts),
            "waited": waited,
            "weight_version": self.version,
            "num_finished_reqs": loop.finished_reqs,
            "finished_prompt_tokens": loop.finished_prompt_tokens,
        }

    def shutdown(self) -> None:
        """Stop the thread; requests and updates not finished get EngineShutdownError."""
        self._inbox.stop()
        if threading.current_thread() is not self._thread:
            self._thread.join()
