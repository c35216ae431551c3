"""What a request to the generation engine is and what it answers: the engine's public data,
free of its decode thread (generation/engine/generation_engine.py), which the rows it decodes (kv_batch.Row) and the
server's API build on."""

from __future__ import annotations

import uuid
from collections.abc import Callable
from dataclasses import dataclass, field

from areal_flow.generation.engine.sampling import SamplingParams


class EngineShutdownError(RuntimeError):
    """The engine stopped before the request or weight update finished."""


@dataclass(frozen=True)
class GenerationRequest:
    input_ids: tuple[int, ...]
    """The prompt token ids."""
    params: SamplingParams = SamplingParams()
    """How to sample and when to stop."""
    rid: str = field(default_factory=lambda: uuid.uuid4().hex)
    """Request id, unique among the requests in flight."""
    logprob_start_len: int | None = None
    """Report the logprob of each prompt token from this position on (SGLang's logprob_start_len,
    0 <= k <= len(input_ids)); None: none. They come from the prefill forward, as log_softmax of the
    logits without temperature (SGLang's default), and the first one is None."""
    top_logprobs_num: int = 0
    """Also report this many most likely tokens at every reported position."""
    on_token: Callable[[GenerationResult], None] | None = field(default=None, compare=False)
    """Called on the decode thread after each generated token that does not end the request, with
    the result so far (finish_reason None). Its lists are the engine's own and keep growing: copy
    what is needed before returning. The last token comes with the future's result instead."""


@dataclass
class GenerationResult:
    rid: str
    prompt_tokens: int
    output_ids: list[int]
    """Generated ids, including a matched eos/stop token."""
    output_logprobs: list[float]
    """log_softmax(logits / T) at each generated token, over the full vocabulary."""
    output_versions: list[int]
    """The weight version that produced each generated token."""
    finish_reason: str | None
    """"stop" (an eos or stop token matched), "length" (max_new_tokens reached) or "abort"
    (aborted, paused or interrupted by a weight update: output_ids are the tokens so far); None in
    the partial results passed to `on_token`."""
    matched_stop: int | str | None
    """The stop token or stop string when finish_reason is "stop"."""
    weight_version: int
    """The engine's weight version when the request finished."""
    retractions: int = 0
    """How often the request was retracted by a pause (mode retract) and prefilled again."""
    weight_label: str = "default"
    """The label of those weights (SGLang's weight_version string)."""
    adapter_digest: str | None = None
    """With LoRA updates (weights/adapter.py): the digest of the adapters merged into those weights."""
    output_top_logprobs: list[list[tuple[float, int]]] = field(default_factory=list)
    """Per generated token, the request's top_logprobs_num most likely (logprob, id), as output_logprobs."""
    input_logprobs: list[float | None] = field(default_factory=list)
    """Per prompt token from logprob_start_len on: its logprob given the tokens before it (the first is None)."""
    input_top_logprobs: list[list[tuple[float, int]] | None] = field(default_factory=list)
    """Per prompt token from logprob_start_len on: the most likely (logprob, id) at its position (the first is None)."""
    cached_tokens: int = 0
    """Tokens its prefills took from the prefix cache instead of computing them."""

    @property
    def completion_tokens(self) -> int:
        return len(self.output_ids)


def version_for_label(label: str, current: int) -> int:
    """The integer version that tags tokens made by weights labelled `label`: a label of digits is
    that number; any other label (SGLang takes any string) is the next version after `current`."""
    return int(label) if label.isascii() and label.isdigit() else current + 1
