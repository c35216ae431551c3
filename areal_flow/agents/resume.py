"""An agent's answer that a weight update cut short, carried on to its end: the OpenAI wire's side of
generation/client/carry_on.py, for a choice that comes back `finish_reason: abort` (an interruptible
run's update, docs/agents.md).

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

from areal_flow.generation.client.carry_on import Piece

END_FIELDS = ("matched_stop", "weight_version")
"""A choice's fields that come from the piece that ended it."""

MAX_RESUMES = 16
"""Continuations one choice may take; an answer cut more often than this stays cut (`abort`)."""

CARRY_ON_FAILED = "an answer cut by a weight update could not be carried on"


def budget(body: dict) -> int | None:
    """The call's token budget (None: up to the model's context, the server's rule when the call
    set no limit)."""
    limit = body.get("max_completion_tokens", body.get("max_tokens"))
    return None if limit is None else int(limit)


def piece(choice_: dict) -> Piece:
    """A choice of the embedded server's shape as a piece of an answer (generation/client/carry_on.py)."""
    return Piece(list(choice_["token_ids"]), list(choice_["output_token_logprobs"]),
                 list(choice_["output_token_versions"]), choice_["finish_reason"],
                 {key: choice_.get(key) for key in END_FIELDS})


def continuation(body: dict, prompt_ids: list[int], index: int, so_far: list[int], left: int | None) -> dict:
    """The `/v1/completions` body that asks for the rest of choice `index` of the call `body`, the
    tokens `so_far` generated and `left` tokens of budget left."""
    seed = body.get("seed")
    return {"model": body["model"], "prompt": list(prompt_ids) + list(so_far), "max_tokens": left,
            "temperature": body.get("temperature"), "top_p": body.get("top_p"), "stop": body.get("stop"), "n": 1,
            "seed": None if seed is None else seed + index}  # choice i of n draws from seed + i (the server's rule)


def stitched(choice_: dict, whole: Piece) -> dict:
    """The choice with the whole answer's tokens and end in place of its own."""
    return {**choice_, "token_ids": whole.token_ids, "output_token_logprobs": whole.logprobs,
            "output_token_versions": whole.versions, "finish_reason": whole.finish, **whole.end}


def rederived(body: dict, chat: bool, index: int, choice_: dict, model: str, tokenizer: Any,
              tool_call_parser: str = "auto") -> dict:
    """The stitched choice as the server would have answered it: its text (or message and tool
    calls) and finish reason from all its tokens; the extension fields as stitched. Tool calls are
    read by `tool_call_parser` (generation.tool_call_parser; auto: the policy's chat template), as
    the servers read them."""
    # Imported here: they load torch (the engine's types), which the rollout worker otherwise never
    # needs (its start-up: 0.8 s without, 4 s with).
    from areal_flow.generation.engine.generation_engine import GenerationResult
    from areal_flow.generation.http.openai_answers import choice
    from areal_flow.generation.http.openai_api import OpenAICall, tool_settings
    from areal_flow.generation.engine.sampling import SamplingParams
    from areal_flow.generation.tool_parsers import resolve

    reason = choice_["finish_reason"]
    result = GenerationResult(
        rid="", prompt_tokens=0, output_ids=choice_["token_ids"], output_logprobs=choice_["output_token_logprobs"],
        output_versions=choice_["output_token_versions"], weight_version=0,
        finish_reason="stop" if reason == "tool_calls" else reason, matched_stop=choice_.get("matched_stop"),
        weight_label=str(choice_.get("weight_version") or "default"))
    asked = body.get("logprobs")  # chat: true/false; completions: how many alternatives (0: none)
    # The body's tools and tool_choice were checked by the server that answered it.
    tooling = (tool_settings(body, body.get("tools") or [],
                             resolve(tool_call_parser, getattr(tokenizer, "chat_template", None)))
               if chat else {"tools": False})
    call = OpenAICall(chat=chat, model=model, prompt_ids=(), params=SamplingParams(), n=1, stream=False,
                      logprobs=None if asked is None or asked is False else 0,
                      echo_usage=False, skip_special_tokens=body.get("skip_special_tokens", True) is not False,
                      **tooling)
    return choice(call, index, result, tokenizer)
