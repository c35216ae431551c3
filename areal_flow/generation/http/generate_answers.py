"""/generate's answers in SGLang's shapes: a result becomes SGLang's answer object
(`build_answer`: text, output_ids, meta_info with the logprob arrays asked for), whole or as a
stream of server-sent events (`AnswerStream`); generate_api.py has the request side."""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import json
import math
import time
from collections.abc import AsyncIterator, Iterable, Sequence
from concurrent.futures import Future
from typing import Any

from areal_flow.generation.engine.generation_engine import EngineShutdownError, GenerationEngine, GenerationResult
from areal_flow.generation.http.generate_api import GenerateCall, Item


def _finite(x: float | None) -> float | None:
    # SGLang serializes with orjson, which writes NaN and ±inf as null.
    return x if x is not None and math.isfinite(x) else None


def _finish_reason(item: Item, result: GenerationResult) -> dict | None:
    if result.finish_reason == "stop":
        return {"type": "stop", "matched": result.matched_stop}
    if result.finish_reason == "abort":
        return {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    if result.finish_reason == "length":
        return {"type": "length", "length": item.request.params.max_new_tokens}
    return None  # still generating (a stream chunk)


def _logprob_fields(item: Item, result: GenerationResult, tokenizer: Any) -> dict[str, Any]:
    """SGLang's logprob arrays: [logprob, token id, token text or None] per position."""
    decode = item.return_text_in_logprobs and tokenizer is not None
    text_of = functools.cache(lambda token: tokenizer.decode([token]) if decode else None)

    def triples(pairs: Iterable[tuple[float | None, int]]) -> list[list]:
        return [[_finite(lp), token, text_of(token)] for lp, token in pairs]

    def tops(rows: Sequence[Sequence[tuple[float, int]] | None]) -> list[list | None]:
        return [None if row is None else triples(row) for row in rows]

    request = item.request
    prompt = request.input_ids[request.logprob_start_len:] if request.logprob_start_len is not None else ()
    fields: dict[str, Any] = {
        "input_token_logprobs": triples(zip(result.input_logprobs, prompt)),
        "output_token_logprobs": triples(zip(result.output_logprobs, result.output_ids)),
        "output_token_logprobs_length": result.completion_tokens,
    }
    if request.top_logprobs_num:
        fields["input_top_logprobs"] = tops(result.input_top_logprobs)
        fields["output_top_logprobs"] = tops(result.output_top_logprobs)
    return fields


def build_answer(item: Item, result: GenerationResult, tokenizer: Any, latency: float) -> dict:
    """SGLang's answer object (text, output_ids, meta_info) for a result, final or partial."""
    meta: dict[str, Any] = {
        "id": result.rid,
        "finish_reason": _finish_reason(item, result),
        "prompt_tokens": result.prompt_tokens,
        "weight_version": result.weight_label,
        "completion_tokens": result.completion_tokens,
        "cached_tokens": result.cached_tokens,
        "num_retractions": result.retractions,
        "output_token_versions": result.output_versions,
    }
    if result.adapter_digest is not None:  # LoRA updates: the adapters these weights served with
        meta["adapter_digest"] = result.adapter_digest
    if result.finish_reason is not None:
        meta["e2e_latency"] = latency
    if item.return_logprob:
        meta.update(_logprob_fields(item, result, tokenizer))
    answer: dict[str, Any] = {}
    if tokenizer is not None:  # without a tokenizer SGLang omits text (--skip-tokenizer-init)
        ids = result.output_ids
        trim = result.finish_reason == "stop" and not item.no_stop_trim
        stop_string = result.matched_stop if isinstance(result.matched_stop, str) else None
        if trim and stop_string is None:
            ids = ids[:-1]  # SGLang trims the matched stop token from text, never from output_ids
        text = tokenizer.decode(ids, skip_special_tokens=item.skip_special_tokens)
        if trim and stop_string is not None and stop_string in text:
            text = text[:text.rfind(stop_string)]  # ... and a matched stop string, from text only
        answer["text"] = text
    answer["output_ids"] = result.output_ids
    answer["meta_info"] = meta
    return answer


# ---- streaming ---------------------------------------------------------------------------------


def _event(payload: dict | str) -> bytes:
    data = payload if isinstance(payload, str) else json.dumps(payload, separators=(",", ":"), allow_nan=False)
    return f"data: {data}\n\n".encode()


class AnswerStream:
    """The server-sent events of a streamed /generate call.

    Made on the event loop before the requests are submitted: `items` are the call's items with an
    `on_token` that the decode thread calls per token; the chunks that `stream_interval` selects are
    copied there and handed to this loop (`call_soon_threadsafe`), followed by each final result.
    """

    def __init__(self, call: GenerateCall, engine: GenerationEngine, tokenizer: Any, received: float) -> None:
        self.engine, self.tokenizer, self.received = engine, tokenizer, received
        self.array = call.array
        self.items = [dataclasses.replace(item, request=dataclasses.replace(
            item.request, on_token=functools.partial(self._on_token, i))) for i, item in enumerate(call.items)]
        self._loop = asyncio.get_running_loop()
        self._updates: asyncio.Queue[tuple[int, GenerationResult | Future]] = asyncio.Queue()
        self._futures: list[Future] = []

    def watch(self, futures: list[Future]) -> None:
        self._futures = futures
        for i, future in enumerate(futures):
            future.add_done_callback(functools.partial(self._put, i))

    def _on_token(self, index: int, partial: GenerationResult) -> None:
        """On the decode thread. As SGLang: a chunk every stream_interval tokens, from the first."""
        count, interval = partial.completion_tokens, self.items[index].stream_interval
        if interval > 1 and count % interval != 1:
            return
        snapshot = dataclasses.replace(  # the engine keeps appending to its lists
            partial, output_ids=list(partial.output_ids), output_logprobs=list(partial.output_logprobs),
            output_versions=list(partial.output_versions), output_top_logprobs=list(partial.output_top_logprobs))
        self._put(index, snapshot)

    def _put(self, index: int, update: GenerationResult | Future) -> None:
        try:
            self._loop.call_soon_threadsafe(self._updates.put_nowait, (index, update))
        except RuntimeError:  # the server's loop has closed: nobody is listening any more
            pass

    async def events(self) -> AsyncIterator[bytes]:
        """Chunks as they come, then `data: [DONE]`. A client that leaves early (the response is
        cancelled) gets its unfinished requests aborted, so that nothing decodes for nobody."""
        pending = len(self.items)
        try:
            while pending:
                index, update = await self._updates.get()
                if isinstance(update, Future):
                    pending -= 1
                    try:
                        update = update.result()
                    except Exception as exc:  # shutdown, a failed decode step: as SGLang, an error event, then [DONE]
                        yield _event({"error": {"message": str(exc)}})
                        break
                chunk = build_answer(self.items[index], update, self.tokenizer,
                                     time.perf_counter() - self.received)
                if self.array:
                    chunk["index"] = index
                yield _event(chunk)
            yield _event("[DONE]")
        finally:
            for item, future in zip(self.items, self._futures):
                if not future.done():
                    try:
                        self.engine.abort(item.request.rid, wait=False)
                    except EngineShutdownError:
                        pass
