"""/generate in SGLang's shapes: a body becomes engine requests; results become SGLang's answers,
whole or as a stream of server-sent events.

A body holds one prompt or a batch (`input_ids: [[...]]`, `text: [...]`); with `sampling_params.n`
each prompt is sampled n times. Either way it becomes a flat list of `Item`s in SGLang's order,
prompt-major (p0s0, p0s1, ..., p1s0, ...), answered with one object (one prompt, n = 1) or an array.
Streamed chunks are cumulative (SGLang's default): each holds everything generated so far, and
only the last has a finish_reason.

This module reads the bodies; generate_answers.py writes the answers.
"""

from __future__ import annotations

import dataclasses
import uuid
from dataclasses import dataclass
from typing import Any

from areal_flow.generation.engine.generation_engine import GenerationEngine, GenerationRequest
from areal_flow.generation.engine.sampling import SamplingParams
from areal_flow.generation.http.context import Served
from areal_flow.generation.http.errors import as_bool, bad_request
from areal_flow.generation.limits import MAX_N

SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
                 "sampling_seed", "n", "stream_interval"}
"""sampling_params the engine implements."""

NEUTRAL_SAMPLING_KEYS: dict[str, tuple[Any, ...]] = {
    "min_new_tokens": (0,), "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0), "stop_regex": ([], ""),
    "json_schema": (), "regex": (), "ebnf": (), "structural_tag": (), "logit_bias": ({},),
}
"""SGLang keys the engine does not implement: accepted at their no-op values (AReaL always sends
frequency_penalty 0.0), refused otherwise so that nobody gets silently different sampling. null is
always the no-op."""

TEXT_SAMPLING_KEYS = {"skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens", "custom_params"}
"""SGLang keys that shape only the returned text or are free-form (SGLang itself ignores custom_params)."""


# ---- request parsing ---------------------------------------------------------------------------


@dataclass(frozen=True)
class Item:
    """One answer of a /generate call: its engine request and what the answer should contain."""

    request: GenerationRequest
    return_logprob: bool
    return_text_in_logprobs: bool
    skip_special_tokens: bool
    no_stop_trim: bool
    stream_interval: int


@dataclass(frozen=True)
class GenerateCall:
    items: list[Item]
    array: bool
    """Answer with an array: the batch form, or n > 1."""
    stream: bool


def _per_prompt(body: dict, key: str, n: int, batch: bool) -> list[Any]:
    """A field that is a scalar (shared by every prompt) or, in the batch form, a list per prompt."""
    value = body.get(key)
    if batch and isinstance(value, list):
        if len(value) != n:
            raise bad_request(f"{key} has {len(value)} entries but the batch has {n} prompts")
        return value
    return [value] * n


def _integer(value: Any, name: str, default: int) -> int:
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, int):
        raise bad_request(f"{name} must be an integer, got {value!r}")
    return value


def _int(params: dict, key: str, default: int | None) -> int | None:
    value = params.get(key)
    return default if value is None else _integer(value, f"sampling_params.{key}", 0)


def _float(params: dict, key: str, default: float) -> float:
    value = params.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"sampling_params.{key} must be a number, got {value!r}")
    return float(value)


def _token_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in value):
        raise bad_request(f"{what} must be a list of integer token ids")
    return value


def _sampling_dict(params: Any) -> dict:
    if params is None:
        return {}
    if not isinstance(params, dict):
        raise bad_request(f"sampling_params must be an object, got {params!r}")
    return params


def parse_sampling_params(params: dict, prompt_len: int, token_limit: int | None) -> SamplingParams:
    """`token_limit`: the most tokens a request may hold, prompt and answer (token_limit())."""
    for key, value in params.items():
        if key in SAMPLING_KEYS or key in TEXT_SAMPLING_KEYS:
            continue
        if key not in NEUTRAL_SAMPLING_KEYS:
            raise bad_request(f"unknown field `{key}` in sampling_params; expected one of {sorted(SAMPLING_KEYS)}")
        if value is not None and value not in NEUTRAL_SAMPLING_KEYS[key]:
            raise bad_request(f"sampling_params.{key}={value!r} is not supported by the embedded engine")
    max_new_tokens = _int(params, "max_new_tokens", 128)
    if "max_new_tokens" in params and params["max_new_tokens"] is None:
        # SGLang: null means "up to the context" (here: or the KV cache budget, when smaller).
        if token_limit is None:
            raise bad_request("sampling_params.max_new_tokens is required: the model declares no context length")
        max_new_tokens = max(token_limit - prompt_len, 0)
    stop_ids = params.get("stop_token_ids")
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=_float(params, "temperature", 1.0),
        top_p=_float(params, "top_p", 1.0),
        top_k=_int(params, "top_k", -1),
        stop_token_ids=() if stop_ids is None else tuple(_token_list(stop_ids, "sampling_params.stop_token_ids")),
        ignore_eos=as_bool(params.get("ignore_eos"), "sampling_params.ignore_eos", False),
        min_p=_float(params, "min_p", 0.0),
        stop=_stop_strings(params.get("stop")),
        seed=_int(params, "sampling_seed", None),
    )


def token_limit(engine: GenerationEngine) -> int | None:
    """The most tokens a request may hold, prompt and answer: the model's context, or the server's KV
    cache budget (max_total_tokens) when smaller; None when neither is known."""
    return min((n for n in (engine.context_length, engine.max_total_tokens) if n is not None), default=None)


def _stop_strings(value: Any) -> tuple[str, ...]:
    """SGLang's `stop`: a string, a list of strings, or null/"" for none."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_request(f"sampling_params.stop must be a string or a list of strings, got {value!r}")
    return tuple(value)


def _prompts(body: dict, server: Served) -> tuple[list[list[int]], bool]:
    """The prompts' token ids, and whether the body used the batch form."""
    input_ids, text = body.get("input_ids"), body.get("text")
    if input_ids is not None and text is not None:
        raise bad_request("give either text or input_ids, not both")
    if input_ids is not None:
        if not isinstance(input_ids, list) or not input_ids:
            raise bad_request("input_ids cannot be empty." if input_ids == [] else "input_ids must be a list")
        if isinstance(input_ids[0], list):
            return [_token_list(p, f"input_ids[{i}]") for i, p in enumerate(input_ids)], True
        return [_token_list(input_ids, "input_ids")], False
    if text is not None:
        if server.tokenizer is None:
            raise bad_request(f"text needs a tokenizer.json in {server.tokenizer_path}; send input_ids instead")
        texts = text if isinstance(text, list) else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise bad_request("text must be a string or a non-empty list of strings")
        return [server.tokenizer.encode(t) for t in texts], isinstance(text, list)
    raise bad_request("Either text, input_ids or input_embeds should be provided.")


def _samples_per_prompt(sampling: list[dict]) -> int:
    counts = {_integer(params.get("n"), "sampling_params.n", 1) for params in sampling}
    if len(counts) > 1:
        raise bad_request(f"sampling_params.n must be the same for every prompt of a batch, got {sorted(counts)}")
    n = counts.pop()
    if not 1 <= n <= MAX_N:
        raise bad_request(f"sampling_params.n must be in [1, {MAX_N}], got {n}")
    return n


def parse_generate(body: dict, server: Served) -> GenerateCall:
    """The answers a /generate body asks for, validated field by field (400 naming the field)."""
    stream = as_bool(body.get("stream"), "stream", False)
    if body.get("token_ids_logprob") not in (None, []):
        raise bad_request("token_ids_logprob is not supported by the embedded engine")
    text_in_logprobs = as_bool(body.get("return_text_in_logprobs"), "return_text_in_logprobs", False)
    prompts, batch = _prompts(body, server)
    count = len(prompts)
    sampling = [_sampling_dict(p) for p in _per_prompt(body, "sampling_params", count, batch)]
    n = _samples_per_prompt(sampling)
    if n > 1:
        listed = [key for key in ("return_logprob", "logprob_start_len") if isinstance(body.get(key), list)]
        if listed:  # as SGLang
            raise bad_request(f"{listed[0]} cannot be a list when sampling_params.n > 1")
    rids = _rids(body.get("rid"), count, batch, n)
    columns = zip(prompts, sampling, *(_per_prompt(body, key, count, batch) for key in
                                       ("return_logprob", "logprob_start_len", "top_logprobs_num")))
    items, limit = [], token_limit(server.engine)
    for i, (prompt, params, return_logprob, start, top) in enumerate(columns):
        parsed = parse_sampling_params(params, len(prompt), limit)
        return_logprob = as_bool(return_logprob, "return_logprob", False)
        start, top = _integer(start, "logprob_start_len", -1), _integer(top, "top_logprobs_num", 0)
        if not return_logprob:  # as SGLang, which then ignores both
            start, top = -1, 0
        if not -1 <= start <= len(prompt):
            raise bad_request(f"logprob_start_len must be -1 or in [0, {len(prompt)}] (the prompt's length), "
                              f"got {start}")
        if not 0 <= top <= server.engine.vocab_size:
            raise bad_request(f"top_logprobs_num must be in [0, {server.engine.vocab_size}] (the vocabulary size), "
                              f"got {top}")
        stream_interval = _int(params, "stream_interval", 1)
        if stream_interval < 1:
            raise bad_request(f"sampling_params.stream_interval must be at least 1, got {stream_interval}")
        item = Item(
            GenerationRequest(tuple(prompt), parsed, logprob_start_len=None if start < 0 else start,
                              top_logprobs_num=top),
            return_logprob=return_logprob,
            return_text_in_logprobs=text_in_logprobs,
            skip_special_tokens=as_bool(params.get("skip_special_tokens"), "sampling_params.skip_special_tokens",
                                        True),
            no_stop_trim=as_bool(params.get("no_stop_trim"), "sampling_params.no_stop_trim", False),
            stream_interval=stream_interval,
        )
        items += [dataclasses.replace(item, request=dataclasses.replace(
                      item.request, rid=rid, params=_nth_sample_params(parsed, j)))
                  for j, rid in enumerate(rids[i * n: (i + 1) * n])]
    return GenerateCall(items, array=batch or n > 1, stream=stream)


def _nth_sample_params(params: SamplingParams, j: int) -> SamplingParams:
    """The parameters of sample j of n: with a sampling_seed, sample j draws from seed + j (wrapped
    to 64 bits), as SGLang does, so that the n samples of a seeded request differ."""
    if params.seed is None or j == 0:
        return params
    seed = params.seed + j
    return dataclasses.replace(params, seed=seed - 2**64 if seed >= 2**64 else seed)


def _rids(rid: Any, count: int, batch: bool, n: int) -> list[str]:
    """One rid per answer. SGLang names a batch's answers `<rid>_<i>`, and gives each of n > 1
    samples a fresh id (so only abort_all reaches them)."""
    if rid is not None and not (isinstance(rid, str) or batch and isinstance(rid, list) and len(rid) == count
                                and all(isinstance(r, str) for r in rid)):
        raise bad_request("rid must be a string (or, in the batch form, a list of one string per prompt)")
    if rid is None or n > 1:
        return [uuid.uuid4().hex for _ in range(count * n)]
    if isinstance(rid, str):
        return [f"{rid}_{i}" for i in range(count)] if batch else [rid]
    return rid
