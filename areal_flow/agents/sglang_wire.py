"""The gateway in front of SGLang (`generation.backend=sglang`): SGLang's OpenAI endpoints give a
call's exact tokens only when asked, and in fields of their own; this asks for them and puts them
where the gateway reads the embedded server's (openai_api.py's extension fields).

SGLang (0.5.13 on, its "token in, token out" request extensions) answers `/v1/chat/completions`
and `/v1/completions` with, per choice, `prompt_token_ids` when a call sends
`return_prompt_token_ids: true`, and `meta_info` (the fields of its `/generate`: each output
token's `[logprob, id, text]`, the weight version, the finish reason and its matched stop) when it
sends `return_meta_info: true` with logprobs on. `ask` adds these to a call; `normalised` turns the
answer into the embedded server's shape: top-level `prompt_token_ids`, per choice `token_ids`,
`output_token_logprobs`, `output_token_versions` (from SGLang's weight version, or its per-span
versions: rollout/requests.py reads `/generate`'s the same way), `weight_version`, `matched_stop`.
What the agent did not ask for (`meta_info`, the choice's prompt ids, OpenAI `logprobs`) is taken
out, so the agent's answer looks as it would from OpenAI.
"""

from __future__ import annotations

from typing import Any

from areal_flow.generation.client.versions import token_versions

MINIMUM = "0.5.13"
"""The first SGLang release whose OpenAI endpoints return a call's token ids (`return_meta_info`)."""


class SGLangAnswerError(ValueError):
    """An SGLang answer without the token ids the gateway records."""


def ask(body: dict) -> dict:
    """The call `body` asking SGLang for its exact tokens (chat and completions alike)."""
    asked = body.get("logprobs")
    # Chat's logprobs are a flag; completions' a count of alternatives, whose 0 SGLang may read as none.
    logprobs = asked if asked not in (None, False, 0) else (True if "messages" in body else 1)
    return {**body, "logprobs": logprobs, "return_meta_info": True, "return_prompt_token_ids": True}


def normalised(answer: dict, asked_logprobs: Any) -> dict:
    """SGLang's `answer` with its token fields where the gateway reads them (in place; returned).
    `asked_logprobs`: the agent's own `logprobs` (None or False: its answer has none)."""
    prompt = None
    for index, choice in enumerate(answer.get("choices") or ()):
        meta, ids = choice.pop("meta_info", None), choice.pop("prompt_token_ids", None)
        if not isinstance(meta, dict) or not isinstance(meta.get("output_token_logprobs"), list) or ids is None:
            raise SGLangAnswerError(
                f"SGLang answered choice {index} without its token ids (meta_info.output_token_logprobs and "
                f"prompt_token_ids): the gateway needs SGLang {MINIMUM} or later, which returns them for "
                "return_meta_info and return_prompt_token_ids")
        prompt = prompt if prompt is not None else list(ids)
        tokens = meta["output_token_logprobs"]
        finish = meta.get("finish_reason") if isinstance(meta.get("finish_reason"), dict) else {}
        choice.update(token_ids=[int(t[1]) for t in tokens], output_token_logprobs=[float(t[0]) for t in tokens],
                      output_token_versions=token_versions(meta, len(tokens)),
                      weight_version=meta.get("weight_version"),
                      matched_stop=finish.get("matched") if finish.get("type") == "stop" else None)
        if asked_logprobs in (None, False):
            choice["logprobs"] = None
    answer["prompt_token_ids"] = prompt if prompt is not None else []
    return answer
