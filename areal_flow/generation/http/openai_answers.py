"""OpenAI's answers from the engine's results: whole (`build_response`) or streamed as server-sent
events (`OpenAIStream`); each choice with its text, its tool calls (`parse_tool_calls`) and the
exact tokens (openai_api.py has the request side and the module's overview)."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import time
import uuid
from concurrent.futures import Future
from typing import Any

from areal_flow.generation.engine.generation_engine import GenerationResult
from areal_flow.generation import tool_parsers
from areal_flow.generation.http.openai_api import OpenAICall


def answer_text(result: GenerationResult, tokenizer: Any, skip_special_tokens: bool = True) -> str:
    """The answer as text, without the eos or the stop string that ended it (OpenAI's). With
    `skip_special_tokens` false, the special tokens it wrote before its end stay in the text, so
    that an agent that sends the text back sends the tokens back (a sampled `<unk>` left out of the
    text would be a drift, agents/trajectories.py)."""
    ids = result.output_ids
    if result.finish_reason == "stop" and isinstance(result.matched_stop, int) and ids and ids[-1] == result.matched_stop:
        ids = ids[:-1]  # the end-of-sequence token that ended it
    text = tokenizer.decode(ids, skip_special_tokens=skip_special_tokens) if tokenizer is not None else ""
    if result.finish_reason == "stop" and isinstance(result.matched_stop, str):
        text = text[: text.find(result.matched_stop)] if result.matched_stop in text else text
    return text


def parse_tool_calls(text: str, parser: str = "hermes", *, only: str | None = None,
                     parallel: bool = True) -> tuple[str | None, list[dict]] | None:
    """(content before the calls, the calls in OpenAI's shape) of an answer holding calls in the
    format of `parser` (generation/tool_parsers.py), or None when it holds none or one does not
    parse (the answer is then plain text). `only`: calls to other functions are left out (a named
    tool_choice; none left: plain text); `parallel` false: the first call only."""
    parsed = tool_parsers.parse(parser, text)
    if parsed is None:
        return None
    content, calls = parsed
    calls = [c for c in calls if only is None or c["name"] == only][: None if parallel else 1]
    if not calls:
        return None
    return content, [{"id": f"call_{uuid.uuid4().hex[:24]}", "type": "function", "function": c} for c in calls]


def finish_reason(result: GenerationResult) -> str:
    return {"stop": "stop", "length": "length"}.get(result.finish_reason or "", "abort")


def extensions(result: GenerationResult) -> dict:
    """The exact tokens of a choice (areal_flow's and SGLang's extension fields), and the stop string
    or token that ended it (`matched_stop`, as SGLang's; OpenAI's text leaves a stop string out)."""
    fields = {"token_ids": result.output_ids, "output_token_logprobs": result.output_logprobs,
              "output_token_versions": result.output_versions, "weight_version": result.weight_label,
              "matched_stop": result.matched_stop if result.finish_reason == "stop" else None}
    if result.adapter_digest is not None:  # LoRA updates: the adapters these weights served with
        fields["adapter_digest"] = result.adapter_digest
    return fields


def logprobs_of(call: OpenAICall, result: GenerationResult, tokenizer: Any) -> dict | None:
    """OpenAI's `logprobs` of a choice, when asked: per token its text, logprob and the top ones."""
    if call.logprobs is None:
        return None
    piece = (lambda t: tokenizer.decode([t])) if tokenizer is not None else str
    tops = result.output_top_logprobs or [[] for _ in result.output_ids]
    if call.chat:
        return {"content": [
            {"token": piece(t), "logprob": lp, "bytes": list(piece(t).encode()),
             "top_logprobs": [{"token": piece(i), "logprob": v, "bytes": list(piece(i).encode())} for v, i in top]}
            for t, lp, top in zip(result.output_ids, result.output_logprobs, tops)]}
    return {"tokens": [piece(t) for t in result.output_ids], "token_logprobs": result.output_logprobs,
            "top_logprobs": [{piece(i): v for v, i in top} for top in tops] if call.logprobs else None,
            "text_offset": None}


def choice(call: OpenAICall, index: int, result: GenerationResult, tokenizer: Any) -> dict:
    text, reason = answer_text(result, tokenizer, call.skip_special_tokens), finish_reason(result)
    out: dict[str, Any] = {"index": index}
    if call.chat:
        message: dict[str, Any] = {"role": "assistant", "content": text}
        parsed = (parse_tool_calls(text, call.tool_parser, only=call.tool_name, parallel=call.parallel_tool_calls)
                  if call.tools else None)
        if parsed is not None:
            message["content"], message["tool_calls"] = parsed
            reason = "tool_calls" if reason == "stop" else reason
        out["message"] = message
    else:
        out["text"] = text
    out.update(logprobs=logprobs_of(call, result, tokenizer), finish_reason=reason, **extensions(result))
    return out


def usage(call: OpenAICall, results: list[GenerationResult]) -> dict:
    completion = sum(r.completion_tokens for r in results)
    cached = sum(r.cached_tokens for r in results)
    return {"prompt_tokens": len(call.prompt_ids), "completion_tokens": completion,
            "total_tokens": len(call.prompt_ids) + completion, "prompt_tokens_details": {"cached_tokens": cached}}


def build_response(call: OpenAICall, results: list[GenerationResult], tokenizer: Any) -> dict:
    return {"id": f"{'chatcmpl' if call.chat else 'cmpl'}-{uuid.uuid4().hex}",
            "object": "chat.completion" if call.chat else "text_completion", "created": int(time.time()),
            "model": call.model, "choices": [choice(call, i, r, tokenizer) for i, r in enumerate(results)],
            "usage": usage(call, results), "prompt_token_ids": list(call.prompt_ids)}


# ---- streaming -----------------------------------------------------------------------------------


class OpenAIStream:
    """The server-sent events of a streamed call. Made on the event loop before the requests are
    submitted: each request's `on_token` (the decode thread) hands a copy of its tokens so far to
    this loop, and each result follows; `events` turns them into OpenAI's chunks. Text that may
    still change is held back: an unfinished character, the start of a stop string, and with
    tools the whole answer until it ends."""

    def __init__(self, call: OpenAICall, tokenizer: Any, engine: Any) -> None:
        self.call, self.tokenizer, self.engine = call, tokenizer, engine
        self.loop = asyncio.get_running_loop()
        self.queue: asyncio.Queue = asyncio.Queue()
        self.requests = [dataclasses.replace(r, on_token=functools.partial(self._on_token, i))
                         for i, r in enumerate(call.requests())]
        self.id = f"{'chatcmpl' if call.chat else 'cmpl'}-{uuid.uuid4().hex}"
        self.created = int(time.time())

    def _on_token(self, index: int, partial: GenerationResult) -> None:
        self.loop.call_soon_threadsafe(self.queue.put_nowait, (index, list(partial.output_ids)))

    def watch(self, futures: list[Future]) -> None:
        for i, future in enumerate(futures):
            future.add_done_callback(lambda f, i=i: self.loop.call_soon_threadsafe(self.queue.put_nowait, (i, f)))

    def _chunk(self, index: int, delta: dict | str, reason: str | None = None, **more: Any) -> str:
        piece = {"index": index, ("delta" if self.call.chat else "text"): delta, "logprobs": None,
                 "finish_reason": reason, **more}
        return self._event({"choices": [piece]})

    def _event(self, fields: dict) -> str:
        chunk = {"id": self.id, "object": "chat.completion.chunk" if self.call.chat else "text_completion",
                 "created": self.created, "model": self.call.model, **fields}
        return f"data: {json.dumps(chunk, separators=(',', ':'))}\n\n"

    def _shown(self, ids: list[int]) -> str:
        """The text of unfinished tokens that will not change: up to a partly decoded character or
        a possible start of a stop string."""
        skip = self.call.skip_special_tokens
        if not skip and ids and self.tokenizer is not None and ids[-1] == self.tokenizer.eos_token_id:
            ids = ids[:-1]  # the end, never text (answer_text)
        text = self.tokenizer.decode(ids, skip_special_tokens=skip) if self.tokenizer is not None else ""
        text = text.rstrip("\ufffd")
        longest = max((len(s) for s in self.call.params.stop), default=1)
        return text[: len(text) - (longest - 1)] if longest > 1 else text

    async def events(self):
        call, n = self.call, self.call.n
        sent, results = [""] * n, [None] * n
        try:
            if call.chat:
                for i in range(n):
                    yield self._chunk(i, {"role": "assistant", "content": ""})
            while None in results:
                i, item = await self.queue.get()
                if results[i] is not None:
                    continue
                if isinstance(item, Future):
                    exc = item.exception()
                    if exc is not None:
                        yield f"data: {json.dumps({'error': {'message': str(exc), 'type': 'server_error'}})}\n\n"
                        return
                    results[i] = item.result()
                    yield self._last(i, results[i], sent[i])
                elif not call.tools:
                    text = self._shown(item)
                    if len(text) > len(sent[i]) and text.startswith(sent[i]):
                        delta, sent[i] = text[len(sent[i]):], text
                        yield self._chunk(i, {"content": delta} if call.chat else delta)
            if call.echo_usage:
                yield self._event({"choices": [], "usage": usage(call, results)})
            yield "data: [DONE]\n\n"
        finally:
            for request, result in zip(self.requests, results):
                if result is None:  # the client went away: stop decoding what no one reads
                    self.engine.abort(request.rid, wait=False)

    def _last(self, index: int, result: GenerationResult, sent: str) -> str:
        """A choice's last chunk: the rest of its text (or its tool calls), why it ended, its tokens.
        It carries every extension field of the whole answer's choice (`matched_stop` too: the agent
        gateway carries a cut choice on from it) and, beside `choices`, the call's
        `prompt_token_ids` (a field OpenAI's client ignores), so that a streamed call can be
        recorded as exactly as a whole one (agents/stream.py)."""
        whole = choice(self.call, index, result, self.tokenizer)
        more = {k: v for k, v in whole.items() if k not in ("index", "message", "text", "finish_reason")}
        if self.call.chat:
            message = whole["message"]
            delta: dict[str, Any] | str = {}
            if message.get("content"):
                delta["content"] = message["content"][len(sent):]
            if "tool_calls" in message:
                delta["tool_calls"] = [{"index": k, **c} for k, c in enumerate(message["tool_calls"])]
        else:
            delta = whole["text"][len(sent):]
        piece = {"index": index, ("delta" if self.call.chat else "text"): delta,
                 "finish_reason": whole["finish_reason"], **more}
        return self._event({"choices": [piece], "prompt_token_ids": list(self.call.prompt_ids)})
