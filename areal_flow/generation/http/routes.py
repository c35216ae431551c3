"""The routes of SGLang's native API (the subset RL trainers use) and OpenAI's, over the embedded
engine: generation, health, load and server information, pause/continue/abort, and the KV cache's
memory; the weight routes are weight_routes.py's. Bodies of /generate are read by
generate_api.py and answered by generate_answers.py, those of the OpenAI routes by openai_api.py
and openai_answers.py; a route sees only its `Call` and what the
server serves (context.py), the HTTP plumbing is app.py's.
"""

from __future__ import annotations

import asyncio
import functools
import threading
import time
import uuid
from concurrent.futures import Future
from typing import Any

from fastapi import Response
from fastapi.responses import StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST

from areal_flow.generation.compute_counts import COMPUTE_COUNTS
from areal_flow.generation.engine.commands import PAUSE_MODES
from areal_flow.generation.http import bodies, openai_answers, openai_api
from areal_flow.generation.http.bodies import json_object
from areal_flow.generation.http.context import Call, Payload, Route, Served
from areal_flow.generation.http.errors import as_bool, bad_request
from areal_flow.generation.http.generate_answers import AnswerStream, build_answer
from areal_flow.generation.http.generate_api import parse_generate
from areal_flow.generation.http.weight_routes import WEIGHT_ROUTES

HEALTH_GENERATE_TIMEOUT = 20.0
"""Seconds /health_generate waits for its one-token request (SGLang's SGLANG_HEALTH_CHECK_TIMEOUT)."""


DISCONNECT_POLL = 1.0
"""Seconds between checks that the client of a running non-streaming /generate is still connected."""


async def route_generate(server: Served, call: Call) -> tuple[int, Payload] | Response:
    # A large body is parsed (its text tokenized) on a parser thread: bodies.py.
    parsed = await bodies.parse(server.parser, call.body, lambda body: parse_generate(bodies.as_object(body), server))
    stream = AnswerStream(parsed, server.engine, server.tokenizer, call.received) if parsed.stream else None
    items = stream.items if stream else parsed.items
    try:
        futures = server.engine.submit_many([item.request for item in items])
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    if stream is not None:
        stream.watch(futures)
        return StreamingResponse(stream.events(), media_type="text/event-stream")
    results = await _results_unless_gone(server, call, futures, [item.request.rid for item in items])
    if results is None:
        return 499, "client disconnected"
    answers = [build_answer(item, result, server.tokenizer, time.perf_counter() - call.received)
               for item, result in zip(items, results)]
    return 200, answers if parsed.array else answers[0]


async def _results_unless_gone(server: Served, call: Call, futures: list[Future], rids: list[str]
                               ) -> list | None:
    """The requests' results; None, their decoding aborted, if the client goes away first (no one
    would read the answer, as SGLang). Raises EngineShutdownError, which the endpoint answers 503."""
    results = gather_threadsafe(futures, asyncio.get_running_loop())
    while not (await asyncio.wait({results}, timeout=DISCONNECT_POLL))[0]:
        if await call.disconnected():
            for rid in rids:
                server.engine.abort(rid, wait=False)
            await results
            return None
    return results.result()


def gather_threadsafe(futures: list[Future], loop: asyncio.AbstractEventLoop) -> asyncio.Future:
    """The results of the engine's futures, in order, as one future of `loop`, which wakes once:
    when the last is done. (asyncio.wrap_future wakes the loop for each: a write to its self-pipe
    on the engine's thread, after which the HTTP thread takes the GIL and the engine waits for it
    before its next step; measured in docs/benchmarks.md.) The first exception, if any, is its."""
    gathered = loop.create_future()
    left = [len(futures)]
    lock = threading.Lock()

    def settle() -> None:
        if gathered.cancelled():
            return
        failed = next((f for f in futures if f.cancelled() or f.exception() is not None), None)
        if failed is None:
            gathered.set_result([f.result() for f in futures])
        else:
            gathered.set_exception(asyncio.CancelledError() if failed.cancelled() else failed.exception())

    def one_done(_: Future) -> None:  # on the thread that finished it, usually the engine's
        with lock:
            left[0] -= 1
            last = left[0] == 0
        if last and not loop.is_closed():  # a server shutting down: no one waits (as wrap_future)
            loop.call_soon_threadsafe(settle)

    if not futures:
        gathered.set_result([])
    for future in futures:
        future.add_done_callback(one_done)
    return gathered


OPENAI_FIELDS = {
    True: frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
                     "seed", "stream", "stream_options", "logprobs", "top_logprobs", "tools", "tool_choice",
                     "parallel_tool_calls", "skip_special_tokens", "prompt_token_ids"}),
    False: frozenset({"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream",
                      "stream_options", "logprobs", "skip_special_tokens"}),
}
"""The fields /v1/chat/completions (True) and /v1/completions (False) read (openai_api.IGNORED: those they ignore)."""


async def route_openai(server: Served, call: Call, *, chat: bool) -> tuple[int, Payload] | Response:
    """/v1/chat/completions and /v1/completions (openai_api.py); a large body is parsed
    (rendered and tokenized) on a parser thread (bodies.py)."""
    engine = server.engine

    def read(body: Any) -> openai_api.OpenAICall:
        return openai_api.parse_call(body, chat=chat, model_path=server.tokenizer_path, tokenizer=server.tokenizer,
                                     context_length=engine.context_length, known=OPENAI_FIELDS[chat],
                                     kv_budget=engine.max_total_tokens, vocab_size=engine.vocab_size,
                                     tool_parser=server.tool_call_parser)

    parsed = await bodies.parse(server.parser, call.body, read, lambda why: openai_api.openai_error(400, why))
    stream = openai_answers.OpenAIStream(parsed, server.tokenizer, server.engine) if parsed.stream else None
    requests = stream.requests if stream else parsed.requests()
    try:
        futures = server.engine.submit_many(requests)
    except ValueError as exc:
        raise openai_api.openai_error(400, str(exc), "messages" if chat else "prompt") from None
    if stream is not None:
        stream.watch(futures)
        return StreamingResponse(stream.events(), media_type="text/event-stream")
    results = await _results_unless_gone(server, call, futures, [r.rid for r in requests])
    if results is None:
        return 499, "client disconnected"
    return 200, openai_answers.build_response(parsed, results, server.tokenizer)


async def route_models(server: Served, call: Call) -> tuple[int, Payload]:
    return 200, openai_api.list_models(server.tokenizer_path, server.engine.context_length, server.started)


async def route_health(server: Served, call: Call) -> tuple[int, Payload]:
    return (200 if server.engine.is_running else 503), None


async def route_health_generate(server: Served, call: Call) -> tuple[int, Payload]:
    """As SGLang's: 200 once a one-token request through the engine answers, 503 if it does not
    within HEALTH_GENERATE_TIMEOUT. While paused it answers 503 at once (SGLang's would hold the
    request until the timeout)."""
    engine = server.engine
    if not engine.is_running or engine.paused:
        return 503, None
    rid = f"health_generate-{uuid.uuid4().hex}"
    try:
        await asyncio.wait_for(asyncio.wrap_future(engine.submit([0], max_new_tokens=1, rid=rid)),
                               HEALTH_GENERATE_TIMEOUT)
    except asyncio.TimeoutError:
        engine.abort(rid, wait=False)
        return 503, None
    return 200, None


async def route_ready(server: Served, call: Call) -> tuple[int, Payload]:
    # As SGLang's /ready: healthy and not paused (a paused server holds new requests).
    return (200 if server.engine.is_running and not server.engine.paused else 503), None


async def route_loads(server: Served, call: Call) -> tuple[int, Payload]:
    sections = {s.strip() for s in call.query.get("include", "all").split(",")}
    unknown = sections - {"core", "memory", "spec", "lora", "disagg", "queues", "all"}
    if unknown:
        raise bad_request(f"include has unknown sections {sorted(unknown)}; the embedded engine reports 'core'")
    if call.query.get("format", "json") != "json":
        raise bad_request(f"format {call.query['format']!r} is not supported: /v1/loads answers json "
                          "(the Prometheus metrics are at /metrics)")
    report = server.load_report.loads()
    dp_rank = call.query.get("dp_rank")
    if dp_rank is not None:
        if not dp_rank.isdigit():
            raise bad_request(f"dp_rank must be a non-negative integer, got {dp_rank!r}")
        report["loads"] = [load for load in report["loads"] if load["dp_rank"] == int(dp_rank)]
    return 200, report


async def route_metrics(server: Served, call: Call) -> Response:
    return Response(server.load_report.prometheus_text(), media_type=CONTENT_TYPE_LATEST)


async def route_model_info(server: Served, call: Call) -> tuple[int, Payload]:
    config = server.engine.model.config
    return 200, {
        "model_path": server.engine.model_path,
        "tokenizer_path": server.tokenizer_path if server.tokenizer is not None else None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": server.engine.weight_label,
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": config.model_type,
        "architectures": config.architectures,
    }


async def route_server_info(server: Served, call: Call) -> tuple[int, Payload]:
    engine = server.engine
    host, port = server.address[:2]
    stats = engine.stats()  # once: it takes the engine's lock and walks the running batch
    return 200, {
        "engine": "areal_flow-embedded",
        "model_path": engine.model_path,
        "host": host,
        "port": port,
        "max_batch_size": engine.max_batch_size,
        "max_running_requests": engine.max_batch_size,
        "max_total_num_tokens": engine.max_total_tokens,
        "context_length": engine.context_length,
        "vocab_size": engine.vocab_size,
        "eos_token_ids": sorted(engine.eos_token_ids),
        "random_seed": engine.seed,
        "num_threads": engine.num_threads,
        "enable_deterministic_inference": engine.batch_invariant,
        "page_size": engine.page_size,
        "disable_radix_cache": not engine.prefix_cache,
        "chunked_prefill_size": engine.chunked_prefill_size,
        "disable_cuda_graph": engine.cuda_graphs is None,
        "disable_overlap_schedule": not engine.overlap,
        "lora_decode": engine.lora_decode,
        "skip_tokenizer_init": server.tokenizer is None,
        "tool_call_parser": server.tool_call_parser,
        "weight_version": engine.weight_label,
        "busy_seconds": stats["busy_seconds"],
        "load_seconds": stats["load_seconds"],
        "memory_releases": stats["memory_releases"],  # a colocated trainer's turns
        **{key: stats[key] for key in COMPUTE_COUNTS},  # for the advisor's fit of the decode cost
        "internal_states": [stats],
    }


async def route_weight_version(server: Served, call: Call) -> tuple[int, Payload]:
    return 200, {"weight_version": server.engine.weight_label}


async def route_flush_cache(server: Served, call: Call) -> tuple[int, Payload]:
    # As SGLang it refuses while requests run or wait: clients poll it to learn that the server is idle.
    if not server.engine.is_idle():
        return 400, "Flush cache failed.\n"
    server.engine.flush_cache()
    return 200, "Cache flushed.\n"


async def route_pause(server: Served, call: Call) -> tuple[int, Payload]:
    mode = json_object(call.body).get("mode") or "abort"
    if mode not in PAUSE_MODES:
        raise bad_request(f"pause_generation mode {mode!r} is not supported by the embedded engine; it pauses "
                          f"in mode {', '.join(map(repr, PAUSE_MODES))}")
    await asyncio.to_thread(server.engine.pause, mode)  # returns once the running requests are aborted or retracted
    return 200, {"message": "Generation paused successfully.", "status": "ok"}


async def route_continue(server: Served, call: Call) -> tuple[int, Payload]:
    json_object(call.body)
    server.engine.continue_generation()
    return 200, {"message": "Generation continued successfully.", "status": "ok"}


async def route_release_memory(server: Served, call: Call) -> tuple[int, Payload]:
    """SGLang's /release_memory_occupation for the KV cache: the running requests are retracted and
    their cache freed; the server stays paused until /continue_generation. The embedded engine's
    weights stay where they are (tags other than kv_cache are refused)."""
    tags = json_object(call.body).get("tags") or ["kv_cache"]
    if not isinstance(tags, list) or set(tags) - {"kv_cache"}:
        raise bad_request(f"tags {tags!r}: the embedded engine releases only its KV cache (tags: ['kv_cache']); its "
                          "weights stay on the device")
    await asyncio.to_thread(server.engine.release_memory)
    return 200, {"success": True, "message": "KV cache released; generation paused until /continue_generation"}


async def route_resume_memory(server: Served, call: Call) -> tuple[int, Payload]:
    """SGLang's /resume_memory_occupation: the embedded engine allocates its KV cache as requests
    come, so there is nothing to take back; generation goes on at /continue_generation."""
    json_object(call.body)
    return 200, {"success": True, "message": "memory resumed"}


async def route_abort(server: Served, call: Call) -> tuple[int, Payload]:
    body = json_object(call.body)
    rid, abort_all = body.get("rid") or "", as_bool(body.get("abort_all"), "abort_all", False)
    if not isinstance(rid, str):
        raise bad_request(f"rid must be a string, got {rid!r}")
    if abort_all or rid:  # an empty rid without abort_all is ignored, as in SGLang; an unknown rid too
        await asyncio.to_thread(server.engine.abort, None if abort_all else rid)
    return 200, None


ROUTES: dict[str, tuple[frozenset[str], Route]] = {
    "/generate": (frozenset({"POST", "PUT"}), route_generate),
    **WEIGHT_ROUTES,
    "/health": (frozenset({"GET"}), route_health),
    "/health_generate": (frozenset({"GET"}), route_health_generate),
    "/ready": (frozenset({"GET"}), route_ready),
    "/v1/loads": (frozenset({"GET"}), route_loads),
    "/v1/models": (frozenset({"GET"}), route_models),
    "/v1/completions": (frozenset({"POST"}), functools.partial(route_openai, chat=False)),
    "/v1/chat/completions": (frozenset({"POST"}), functools.partial(route_openai, chat=True)),
    "/metrics": (frozenset({"GET"}), route_metrics),
    "/get_model_info": (frozenset({"GET"}), route_model_info),
    "/model_info": (frozenset({"GET"}), route_model_info),
    "/get_server_info": (frozenset({"GET"}), route_server_info),
    "/server_info": (frozenset({"GET"}), route_server_info),
    "/get_weight_version": (frozenset({"GET"}), route_weight_version),
    "/flush_cache": (frozenset({"GET", "POST"}), route_flush_cache),
    "/pause_generation": (frozenset({"POST"}), route_pause),
    "/continue_generation": (frozenset({"POST"}), route_continue),
    "/abort_request": (frozenset({"POST"}), route_abort),
    "/release_memory_occupation": (frozenset({"GET", "POST"}), route_release_memory),
    "/resume_memory_occupation": (frozenset({"GET", "POST"}), route_resume_memory),
}
"""Path → (methods, handler). SGLang ≥0.5.10 names and their older get_* aliases both work."""
