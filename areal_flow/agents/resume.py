"""An agent's answer that a weight update cut short, carried on to its end: what the gateway does
with a choice that comes back `finish_reason: abort` (an interruptible run's update, docs/agents.md).

The call cannot be sent again as it was: the tokens so far are the policy's, kept with their
logprobs and versions, as the rollout worker keeps a `/generate` sample's (rollout/requests.py).
The rest is asked for as a `/v1/completions` call on the exact token ids (the prompt and the tokens
so far), with the budget left, the call's stop strings, temperature and top_p, and the choice's
own seed: a seeded token draws from (seed, position), so the stream goes on where it stopped. The
stitched choice's text, tool calls and finish reason are then derived again from all its tokens,
as the server derives them (generation/http/openai_answers.py: `choice`), so the agent gets one whole
answer and never sees the cut. A resumed choice's OpenAI `logprobs`, when the agent asked for
them, carry each token's logprob but not the top alternatives.
"""

from __future__ import annotations

from typing import Any

MAX_RESUMES = 16
"""Continuations one choice may take; an answer cut more often than this stays cut (`abort`)."""


def budget_left(body: dict, choice_: dict) -> int | None:
    """Tokens the choice may still take (None: up to the model's context, the server's rule when
    the call set no limit); 0 when it used its whole budget, so an abort there is a truncation."""
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    return None if limit is None else max(0, int(limit) - len(choice_["token_ids"]))


def continuation(body: dict, prompt_ids: list[int], index: int, choice_: dict) -> dict:
    """The `/v1/completions` body that asks for the rest of choice `index` of the call `body`."""
    seed = body.get("seed")
    return {"model": body["model"], "prompt": list(prompt_ids) + list(choice_["token_ids"]),
            "max_tokens": budget_left(body, choice_), "temperature": body.get("temperature"),
            "top_p": body.get("top_p"), "stop": body.get("stop"), "n": 1,
            "seed": None if seed is None else seed + index}  # choice i of n draws from seed + i (the server's rule)


def stitch(choice_: dict, more: dict) -> None:
    """Append a continuation's tokens to the choice; its end becomes the choice's."""
    for key in ("token_ids", "output_token_logprobs", "output_token_versions"):
        choice_[key] = list(choice_[key]) + list(more[key])
    for key in ("finish_reason", "matched_stop", "weight_version"):
        choice_[key] = more.get(key)


def rederived(body: dict, chat: bool, index: int, choice_: dict, model: str, tokenizer: Any) -> dict:
    """The stitched choice as the server would have answered it: its text (or message and tool
    calls) and finish reason from all its tokens; the extension fields as stitched."""
    # Imported here: they load torch (the engine's types), which the rollout worker otherwise never
    # needs (its start-up: 0.8 s without, 4 s with).
    from areal_flow.generation.engine.generation_engine import GenerationResult
    from areal_flow.generation.http.openai_answers import choice
    from areal_flow.generation.http.openai_api import OpenAICall
    from areal_flow.generation.engine.sampling import SamplingParams

    reason = choice_["finish_reason"]
    result = GenerationResult(
        rid="", prompt_tokens=0, output_ids=choice_["token_ids"], output_logprobs=choice_["output_token_logprobs"],
        output_versions=choice_["output_token_versions"], weight_version=0,
        finish_reason="stop" if reason == "tool_calls" else reason, matched_stop=choice_.get("matched_stop"),
        weight_label=str(choice_.get("weight_version") or "default"))
    asked = body.get("logprobs")  # chat: true/false; completions: how many alternatives (0: none)
    call = OpenAICall(chat=chat, model=model, prompt_ids=(), params=SamplingParams(), n=1, stream=False,
                      logprobs=None if asked is None or asked is False else 0,
                      tools=chat and bool(body.get("tools")) and body.get("tool_choice") != "none",
                      echo_usage=False, skip_special_tokens=body.get("skip_special_tokens", True) is not False)
    return choice(call, index, result, tokenizer)


def cut(choice_: dict) -> bool:
    """Whether a choice was cut by an interruption (not ended by a stop, its length or a tool call)."""
    return choice_.get("finish_reason") == "abort"
