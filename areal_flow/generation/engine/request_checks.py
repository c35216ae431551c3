"""Whether the engine can take a request: its prompt, sampling settings and logprob asks checked
against the served model and the engine's limits, before anything is queued (ValueError, in the
words SGLang answers with where it has them)."""

from __future__ import annotations

import math
import operator
from dataclasses import dataclass

from areal_flow.generation.engine.requests import GenerationRequest


@dataclass(frozen=True)
class RequestLimits:
    """What the engine serving a request bounds it by."""

    vocab_size: int
    context_length: int | None
    """The model's max_position_embeddings; None: unknown."""
    max_total_tokens: int | None
    """The KV budget: a request reserves prompt + max_new_tokens of it; None: none."""
    stop_strings: bool
    """Whether stop strings can be matched (the engine has a tokenizer to decode outputs with)."""


def check_request(request: GenerationRequest, limits: RequestLimits) -> None:
    """Raise ValueError naming the first field of `request` that `limits` refuse."""
    _check_lengths(request, limits)
    _check_ids(request.input_ids, limits.vocab_size)
    _check_sampling(request, limits)
    start, ids = request.logprob_start_len, request.input_ids
    if start is not None and not 0 <= start <= len(ids):
        raise ValueError(f"logprob_start_len must be in [0, {len(ids)}] (the prompt's length), got {start}")
    if not 0 <= request.top_logprobs_num <= limits.vocab_size:
        raise ValueError(f"top_logprobs_num must be in [0, {limits.vocab_size}] (the vocabulary size), "
                         f"got {request.top_logprobs_num}")


def _check_lengths(request: GenerationRequest, limits: RequestLimits) -> None:
    ids, p = request.input_ids, request.params
    if len(ids) == 0:
        raise ValueError("input_ids cannot be empty.")
    if p.max_new_tokens < 0:
        raise ValueError(f"max_new_tokens must be at least 0, got {p.max_new_tokens}.")
    total = len(ids) + p.max_new_tokens
    if limits.max_total_tokens is not None and total > limits.max_total_tokens:
        raise ValueError(
            f"the request needs {total} tokens of KV cache ({len(ids)} of prompt and "
            f"max_new_tokens {p.max_new_tokens}), more than the server's max_total_tokens {limits.max_total_tokens}")
    if limits.context_length is not None and total > limits.context_length:
        raise ValueError(
            f"Requested token count exceeds the model's maximum context length of {limits.context_length} tokens. "
            f"You requested a total of {total} tokens: {len(ids)} tokens from the input "
            f"messages and {p.max_new_tokens} tokens for the completion (max_new_tokens). Please reduce the "
            "number of tokens in the input messages or the completion to fit within the limit."
        )


def _check_ids(ids: tuple[int, ...], vocab_size: int) -> None:
    # After the lengths: a prompt far over them is refused at once, not after a walk over its ids.
    try:
        bad = next((t for t in ids if not 0 <= operator.index(t) < vocab_size), None)
    except TypeError:
        raise ValueError("input_ids must hold integers") from None
    if bad is not None:
        raise ValueError(f"input_ids holds token id {bad}, outside the vocabulary [0, {vocab_size})")


def _check_sampling(request: GenerationRequest, limits: RequestLimits) -> None:
    p = request.params
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
    if p.stop and not limits.stop_strings:
        raise ValueError("stop strings need a tokenizer; this engine has none (send stop_token_ids instead)")
    if len(p.stop) > 32 or any(not isinstance(s, str) or not s for s in p.stop):
        raise ValueError(f"stop must be at most 32 non-empty strings, got {list(p.stop)!r}")
    if p.seed is not None and not -(2**63) <= p.seed < 2**64:
        raise ValueError(f"sampling_seed must fit in 64 bits, got {p.seed}")
