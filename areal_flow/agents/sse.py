"""A whole answer sent as OpenAI's stream: what the gateway answers a call with `stream: true` in
front of SGLang (`backend="sglang"`).

The gateway reads the exact tokens SGLang returns from a whole answer's `meta_info` (sglang_wire.py),
and SGLang's streamed chunks are not known to carry them all (nothing checked on real SGLang), so
there the gateway asks for the whole answer, records it (the exact tokens, a cut answer carried on:
resume.py) and streams it to the agent as it ends: per choice a chunk with its role (chat), one
with its text or tool calls, its finish reason and the extension fields (as the embedded server's
last chunk carries them), then the usage chunk when `stream_options.include_usage` asks, then
`[DONE]`. An agent written for streaming works unchanged; it gets its tokens when the answer ends.
In front of the embedded server, streams are real (stream.py).
"""

from __future__ import annotations

from typing import Any, Iterator

import msgspec

EXTENSIONS = ("token_ids", "output_token_logprobs", "output_token_versions", "weight_version", "matched_stop",
              "resumes")


def streamed(body: dict) -> dict:
    """The call as the gateway sends it to SGLang: whole, not streamed."""
    return {k: v for k, v in body.items() if k not in ("stream", "stream_options")}


def chunks(answer: dict, chat: bool, include_usage: bool) -> Iterator[bytes]:
    """The server-sent events of `answer` (a whole chat.completion or text_completion)."""
    head = {"id": answer["id"], "object": "chat.completion.chunk" if chat else "text_completion",
            "created": answer["created"], "model": answer["model"]}
    for choice in answer["choices"]:
        index, more = choice["index"], {k: choice[k] for k in EXTENSIONS if k in choice}
        if chat:
            message = choice["message"]
            yield _event(head, [{"index": index, "delta": {"role": "assistant", "content": ""},
                                 "logprobs": None, "finish_reason": None}])
            delta: dict[str, Any] = {"content": message.get("content")} if message.get("content") else {}
            if message.get("tool_calls"):
                delta["tool_calls"] = [{"index": k, **call} for k, call in enumerate(message["tool_calls"])]
            piece = {"index": index, "delta": delta}
        else:
            piece = {"index": index, "text": choice["text"]}
        yield _event(head, [{**piece, "logprobs": choice.get("logprobs"), "finish_reason": choice["finish_reason"],
                             **more}])
    if include_usage:
        yield _event(head, [], usage=answer.get("usage"))
    yield b"data: [DONE]\n\n"


def _event(head: dict, choices: list[dict], **fields: Any) -> bytes:
    return b"data: " + msgspec.json.encode({**head, "choices": choices, **fields}) + b"\n\n"
