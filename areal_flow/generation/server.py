"""SGLang's native HTTP API (the subset RL trainers use) in front of the embedded engine.

FastAPI on uvicorn, as SGLang itself serves it: one event loop on a background thread answers
every connection (HTTP/1.1 keep-alive), and a request waits for the engine's thread without
holding a thread of its own. Field names, response shapes and error envelopes follow SGLang's
native API, so a client written for SGLang works here unchanged. The areal_flow extension is
`meta_info.output_token_versions`: the weight version of each generated token.

    python -m areal_flow.generation.server --model-path DIR --host 127.0.0.1 --port 30000
"""

from __future__ import annotations

import argparse
import asyncio
import json
import logging
import math
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import uvicorn
from fastapi import FastAPI, Request, Response
from starlette.exceptions import HTTPException as StarletteHTTPException

from areal_flow.generation.engine import (
    PAUSE_MODES,
    EngineShutdownError,
    GenerationEngine,
    GenerationRequest,
    GenerationResult,
    SamplingParams,
)

logger = logging.getLogger(__name__)

MAX_BODY_BYTES = 64 << 20
"""Larger request bodies are refused (413) rather than read into memory."""

SAMPLING_KEYS = {"max_new_tokens", "temperature", "top_p", "top_k", "min_p", "stop", "stop_token_ids", "ignore_eos",
                 "sampling_seed"}
"""sampling_params the engine implements."""

NEUTRAL_SAMPLING_KEYS: dict[str, tuple[Any, ...]] = {
    "min_new_tokens": (0,), "frequency_penalty": (0, 0.0), "presence_penalty": (0, 0.0),
    "repetition_penalty": (1, 1.0), "n": (1,), "stop_regex": ([], ""),
    "json_schema": (), "regex": (), "ebnf": (), "structural_tag": (), "logit_bias": ({},),
}
"""SGLang keys the engine does not implement: accepted at their no-op values (AReaL always sends
frequency_penalty 0.0), refused otherwise so that nobody gets silently different sampling. null is
always the no-op."""

TEXT_SAMPLING_KEYS = {"skip_special_tokens", "no_stop_trim", "spaces_between_special_tokens", "custom_params",
                      "stream_interval"}
"""SGLang keys that shape only the returned text or are free-form (SGLang itself ignores custom_params)."""


class HTTPError(Exception):
    """Answer with this status and SGLang's `{"error": {"message": ...}}` envelope."""

    def __init__(self, status: int, message: str) -> None:
        super().__init__(message)
        self.status = status
        self.message = message


def bad_request(message: str) -> HTTPError:
    return HTTPError(400, message)


# ---- request parsing ---------------------------------------------------------------------------


@dataclass(frozen=True)
class _Item:
    """One prompt of a /generate call, with what its answer should contain."""

    request: GenerationRequest
    return_logprob: bool
    skip_special_tokens: bool
    no_stop_trim: bool


def _per_item(body: dict, key: str, n: int, batch: bool) -> list[Any]:
    """A field that is a scalar (shared by every prompt) or, in the batch form, a list per prompt."""
    value = body.get(key)
    if batch and isinstance(value, list):
        if len(value) != n:
            raise bad_request(f"{key} has {len(value)} entries but the batch has {n} prompts")
        return value
    return [value] * n


def _int(params: dict, key: str, default: int | None) -> int | None:
    value = params.get(key, default)
    if value is not None and (isinstance(value, bool) or not isinstance(value, int)):
        raise bad_request(f"sampling_params.{key} must be an integer, got {value!r}")
    return default if value is None else value


def _float(params: dict, key: str, default: float) -> float:
    value = params.get(key, default)
    if value is None:
        return default
    if isinstance(value, bool) or not isinstance(value, (int, float)):
        raise bad_request(f"sampling_params.{key} must be a number, got {value!r}")
    return float(value)


def _bool(value: Any, name: str, default: bool) -> bool:
    if value is None:
        return default
    if not isinstance(value, bool):
        raise bad_request(f"{name} must be true or false, got {value!r}")
    return value


def _token_list(value: Any, what: str) -> list[int]:
    if not isinstance(value, list) or any(isinstance(t, bool) or not isinstance(t, int) for t in value):
        raise bad_request(f"{what} must be a list of integer token ids")
    return value


def parse_sampling_params(params: Any, prompt_len: int, context_length: int | None) -> SamplingParams:
    if params is None:
        params = {}
    if not isinstance(params, dict):
        raise bad_request(f"sampling_params must be an object, got {params!r}")
    for key, value in params.items():
        if key in SAMPLING_KEYS or key in TEXT_SAMPLING_KEYS:
            continue
        if key not in NEUTRAL_SAMPLING_KEYS:
            raise bad_request(f"unknown field `{key}` in sampling_params; expected one of {sorted(SAMPLING_KEYS)}")
        if value is not None and value not in NEUTRAL_SAMPLING_KEYS[key]:
            raise bad_request(f"sampling_params.{key}={value!r} is not supported by the embedded engine")
    max_new_tokens = _int(params, "max_new_tokens", 128)
    if "max_new_tokens" in params and params["max_new_tokens"] is None:
        # SGLang: null means "up to the context".
        if context_length is None:
            raise bad_request("sampling_params.max_new_tokens is required: the model declares no context length")
        max_new_tokens = max(context_length - prompt_len, 0)
    stop_ids = params.get("stop_token_ids")
    return SamplingParams(
        max_new_tokens=max_new_tokens,
        temperature=_float(params, "temperature", 1.0),
        top_p=_float(params, "top_p", 1.0),
        top_k=_int(params, "top_k", -1),
        stop_token_ids=() if stop_ids is None else tuple(_token_list(stop_ids, "sampling_params.stop_token_ids")),
        ignore_eos=_bool(params.get("ignore_eos"), "sampling_params.ignore_eos", False),
        min_p=_float(params, "min_p", 0.0),
        stop=_stop_strings(params.get("stop")),
        seed=_int(params, "sampling_seed", None),
    )


def _stop_strings(value: Any) -> tuple[str, ...]:
    """SGLang's `stop`: a string, a list of strings, or null/"" for none."""
    if value is None or value == "":
        return ()
    if isinstance(value, str):
        return (value,)
    if not isinstance(value, list) or not all(isinstance(s, str) for s in value):
        raise bad_request(f"sampling_params.stop must be a string or a list of strings, got {value!r}")
    return tuple(value)


def parse_generate(body: dict, server: GenerationServer) -> tuple[list[_Item], bool]:
    """The prompts of a /generate body and whether it used the batch form."""
    if body.get("stream"):
        raise bad_request("stream is not supported by the embedded engine yet")
    for key, neutral in (("logprob_start_len", (-1,)), ("top_logprobs_num", (0,)), ("token_ids_logprob", ())):
        if body.get(key) is not None and body[key] not in neutral:
            raise bad_request(f"{key} is not supported by the embedded engine yet")
    input_ids, text = body.get("input_ids"), body.get("text")
    if input_ids is not None and text is not None:
        raise bad_request("give either text or input_ids, not both")
    if input_ids is not None:
        if not isinstance(input_ids, list) or not input_ids:
            raise bad_request("input_ids cannot be empty." if input_ids == [] else "input_ids must be a list")
        batch = isinstance(input_ids[0], list)
        prompts = [_token_list(p, f"input_ids[{i}]") for i, p in enumerate(input_ids)] if batch else [
            _token_list(input_ids, "input_ids")]
    elif text is not None:
        if server.tokenizer is None:
            raise bad_request(f"text needs a tokenizer.json in {server.tokenizer_path}; send input_ids instead")
        batch = isinstance(text, list)
        texts = text if batch else [text]
        if not texts or not all(isinstance(t, str) for t in texts):
            raise bad_request("text must be a string or a non-empty list of strings")
        prompts = [server.tokenizer.encode(t) for t in texts]
    else:
        raise bad_request("Either text, input_ids or input_embeds should be provided.")

    n = len(prompts)
    rid = body.get("rid")
    if rid is None:
        rids: list[str | None] = [None] * n
    elif isinstance(rid, str):
        rids = [f"{rid}_{i}" for i in range(n)] if batch else [rid]  # SGLang's batch naming
    elif batch and isinstance(rid, list) and len(rid) == n and all(isinstance(r, str) for r in rid):
        rids = rid
    else:
        raise bad_request("rid must be a string (or, in the batch form, a list of one string per prompt)")
    sampling = _per_item(body, "sampling_params", n, batch)
    logprob_flags = _per_item(body, "return_logprob", n, batch)

    items = []
    for prompt, item_rid, params, return_logprob in zip(prompts, rids, sampling, logprob_flags):
        parsed = parse_sampling_params(params, len(prompt), server.engine.context_length)
        params = params or {}
        items.append(_Item(
            GenerationRequest(tuple(prompt), parsed, item_rid or uuid.uuid4().hex),
            return_logprob=_bool(return_logprob, "return_logprob", False),
            skip_special_tokens=_bool(params.get("skip_special_tokens"), "sampling_params.skip_special_tokens", True),
            no_stop_trim=_bool(params.get("no_stop_trim"), "sampling_params.no_stop_trim", False),
        ))
    return items, batch


# ---- responses ---------------------------------------------------------------------------------


def _finite(x: float) -> float | None:
    # SGLang serializes with orjson, which writes NaN and ±inf as null.
    return x if math.isfinite(x) else None


def build_response(item: _Item, result: GenerationResult, server: GenerationServer, latency: float) -> dict:
    if result.finish_reason == "stop":
        finish: dict[str, Any] = {"type": "stop", "matched": result.matched_stop}
    elif result.finish_reason == "abort":
        finish = {"type": "abort", "message": "Aborted", "status_code": None, "err_type": None}
    else:
        finish = {"type": "length", "length": item.request.params.max_new_tokens}
    meta: dict[str, Any] = {
        "id": result.rid,
        "finish_reason": finish,
        "prompt_tokens": result.prompt_tokens,
        "weight_version": str(result.weight_version),
        "completion_tokens": result.completion_tokens,
        "cached_tokens": 0,
        "num_retractions": result.retractions,
        "output_token_versions": result.output_versions,
        "e2e_latency": latency,
    }
    if item.return_logprob:
        meta["input_token_logprobs"] = []  # logprob_start_len is always -1 here
        meta["output_token_logprobs"] = [
            [_finite(lp), tok, None] for lp, tok in zip(result.output_logprobs, result.output_ids)
        ]
        meta["output_token_logprobs_length"] = result.completion_tokens
    response: dict[str, Any] = {}
    if server.tokenizer is not None:  # without a tokenizer SGLang omits text (--skip-tokenizer-init)
        ids = result.output_ids
        trim = result.finish_reason == "stop" and not item.no_stop_trim
        stop_string = result.matched_stop if isinstance(result.matched_stop, str) else None
        if trim and stop_string is None:
            ids = ids[:-1]  # SGLang trims the matched stop token from text, never from output_ids
        text = server.tokenizer.decode(ids, skip_special_tokens=item.skip_special_tokens)
        if trim and stop_string is not None and stop_string in text:
            text = text[:text.rfind(stop_string)]  # ... and a matched stop string, from text only
        response["text"] = text
    response["output_ids"] = result.output_ids
    response["meta_info"] = meta
    return response


# ---- routes ------------------------------------------------------------------------------------

Payload = dict | list | str | None
"""A JSON value, text/plain, or an empty body."""


def _json_object(raw: bytes) -> dict:
    if not raw.strip():
        return {}
    try:
        body = json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise bad_request(f"request body is not valid JSON: {exc}") from None
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


async def route_generate(server: GenerationServer, raw: bytes, received: float) -> tuple[int, Payload]:
    items, batch = parse_generate(_json_object(raw), server)
    try:
        futures = server.engine.submit_many([item.request for item in items])
    except ValueError as exc:
        raise bad_request(str(exc)) from None
    responses = []
    for item, future in zip(items, futures):
        result = await asyncio.wrap_future(future)  # EngineShutdownError surfaces as 503 in the endpoint
        responses.append(build_response(item, result, server, time.perf_counter() - received))
    return 200, responses if batch else responses[0]


def _parse_version(value: Any, current: int) -> int:
    if value is None:
        return current + 1  # new weights always get a new version, so token versions tell them apart
    if isinstance(value, str) and value.strip().isdigit():
        return int(value)
    if isinstance(value, bool) or not isinstance(value, int) or value < 0:
        raise ValueError(f"weight_version must be a non-negative integer (or a string of one), got {value!r}")
    return value


async def route_update_weights(server: GenerationServer, raw: bytes, received: float) -> tuple[int, Payload]:
    body = _json_object(raw)
    engine = server.engine
    path = body.get("model_path")
    try:
        if not isinstance(path, str) or not path:
            raise ValueError("model_path is required: a directory with model.safetensors")
        version = _parse_version(body.get("weight_version"), engine.version)
        abort_all = _bool(body.get("abort_all_requests"), "abort_all_requests", False)
        # Without abort_all_requests the update waits for the running requests to finish: on a
        # worker thread, not the event loop.
        await asyncio.to_thread(engine.update_weights_from_disk, path, version, abort_all_requests=abort_all)
    except HTTPError as exc:
        return 400, {"success": False, "message": exc.message, "num_paused_requests": 0}
    except (OSError, ValueError) as exc:
        message = f"Failed to update weights: {exc}. The server keeps weight version {engine.version}."
        return 400, {"success": False, "message": message, "num_paused_requests": 0}
    message = f"Succeeded to update model weights. Weight version updated to {version}."
    return 200, {"success": True, "message": message, "num_paused_requests": 0}


async def route_health(server: GenerationServer, raw: bytes, received: float) -> tuple[int, Payload]:
    return (200 if server.engine.is_running else 503), None


async def route_model_info(server: GenerationServer, raw: bytes, received: float) -> tuple[int, Payload]:
    config = server.engine.model.config
    return 200, {
        "model_path": server.engine.model_path,
        "tokenizer_path": server.tokenizer_path if server.tokenizer is not None else None,
        "is_generation": True,
        "preferred_sampling_params": None,
        "weight_version": str(server.engine.version),
        "has_image_understanding": False,
        "has_audio_understanding": False,
        "model_type": config.model_type,
        "architectures": config.architectures,
    }


async def route_server_info(server: GenerationServer, raw: bytes, received: float) -> tuple[int, Payload]:
    engine = server.engine
    host, port = server.server_address[:2]
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
        "skip_tokenizer_init": server.tokenizer is None,
        "weight_version": str(engine.version),
        "busy_seconds": engine.stats()["busy_seconds"],
        "internal_states": [engine.stats()],
    }


async def route_weight_version(server: GenerationServer, raw: bytes, received: float) -> tuple[int, Payload]:
    return 200, {"weight_version": str(server.engine.version)}


async def route_flush_cache(server: GenerationServer, raw: bytes, received: float) -> tuple[int, Payload]:
    # The engine keeps no prefix cache between requests, so there is nothing to flush; as SGLang it
    # refuses while requests run or wait, because clients poll it to learn that the server is idle.
    if not server.engine.is_idle():
        return 400, "Flush cache failed.\n"
    return 200, "Cache flushed.\n"


async def route_pause(server: GenerationServer, raw: bytes, received: float) -> tuple[int, Payload]:
    mode = _json_object(raw).get("mode") or "abort"
    if mode not in PAUSE_MODES:
        raise bad_request(f"pause_generation mode {mode!r} is not supported by the embedded engine; it pauses "
                          f"in mode {' or '.join(map(repr, PAUSE_MODES))}")
    await asyncio.to_thread(server.engine.pause, mode)  # returns once the running requests are aborted or retracted
    return 200, {"message": "Generation paused successfully.", "status": "ok"}


async def route_continue(server: GenerationServer, raw: bytes, received: float) -> tuple[int, Payload]:
    _json_object(raw)
    server.engine.continue_generation()
    return 200, {"message": "Generation continued successfully.", "status": "ok"}


async def route_abort(server: GenerationServer, raw: bytes, received: float) -> tuple[int, Payload]:
    body = _json_object(raw)
    rid, abort_all = body.get("rid") or "", _bool(body.get("abort_all"), "abort_all", False)
    if not isinstance(rid, str):
        raise bad_request(f"rid must be a string, got {rid!r}")
    if abort_all or rid:  # an empty rid without abort_all is ignored, as in SGLang; an unknown rid too
        await asyncio.to_thread(server.engine.abort, None if abort_all else rid)
    return 200, None


Route = Callable[["GenerationServer", bytes, float], Awaitable[tuple[int, Payload]]]

ROUTES: dict[str, tuple[frozenset[str], Route]] = {
    "/generate": (frozenset({"POST", "PUT"}), route_generate),
    "/update_weights_from_disk": (frozenset({"POST"}), route_update_weights),
    "/health": (frozenset({"GET"}), route_health),
    "/health_generate": (frozenset({"GET"}), route_health),
    "/get_model_info": (frozenset({"GET"}), route_model_info),
    "/model_info": (frozenset({"GET"}), route_model_info),
    "/get_server_info": (frozenset({"GET"}), route_server_info),
    "/server_info": (frozenset({"GET"}), route_server_info),
    "/get_weight_version": (frozenset({"GET"}), route_weight_version),
    "/flush_cache": (frozenset({"GET", "POST"}), route_flush_cache),
    "/pause_generation": (frozenset({"POST"}), route_pause),
    "/continue_generation": (frozenset({"POST"}), route_continue),
    "/abort_request": (frozenset({"POST"}), route_abort),
}
"""Path → (methods, handler). SGLang ≥0.5.10 names and their older get_* aliases both work."""


# ---- HTTP plumbing -----------------------------------------------------------------------------

BACKLOG = 256
"""Listen backlog: a rollout worker opens dozens of connections at once."""

KEEP_ALIVE_SECONDS = 600
"""An idle keep-alive connection is closed after this long (uvicorn's default is 5 s). The client
(aiohttp) drops idle connections after 15 s, so it is the one to end them: it never sends a request
on a connection the server is closing at that very moment."""

GRACEFUL_SHUTDOWN_SECONDS = 5
"""stop() lets requests in flight finish writing their answers for this long; then uvicorn cancels
them (answering 500) and closes their connections, so stop() returns even if a client stalls."""


def _response(status: int, payload: Payload, headers: dict[str, str] | None = None) -> Response:
    if payload is None:
        return Response(status_code=status, headers=headers)
    if isinstance(payload, str):
        return Response(payload, status, headers, media_type="text/plain")
    # allow_nan=False: SGLang writes no NaN (see _finite); one that gets here is a bug, answered 500.
    data = json.dumps(payload, separators=(",", ":"), allow_nan=False)
    return Response(data, status, headers, media_type="application/json")


def _error(status: int, message: str, headers: dict[str, str] | None = None) -> Response:
    return _response(status, {"error": {"message": message}}, headers)


async def _read_body(request: Request) -> bytes:
    length = request.headers.get("content-length")  # uvicorn has already refused one that is not a number
    if length is not None and int(length) > MAX_BODY_BYTES:
        raise HTTPError(413, f"request body of {length} bytes is over the {MAX_BODY_BYTES} byte limit")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > MAX_BODY_BYTES:  # a chunked body announces no length
            raise HTTPError(413, f"request body is over the {MAX_BODY_BYTES} byte limit")
    return bytes(body)


def _endpoint(server: GenerationServer, route: Route) -> Callable[[Request], Awaitable[Response]]:
    async def endpoint(request: Request) -> Response:
        received = time.perf_counter()
        try:
            status, payload = await route(server, await _read_body(request), received)
            return _response(status, payload)
        except HTTPError as exc:
            # After a 413 the rest of the body may still be on its way: close instead of reading it.
            return _error(exc.status, exc.message, {"Connection": "close"} if exc.status == 413 else None)
        except EngineShutdownError as exc:
            return _error(503, str(exc))
        except Exception as exc:
            # A bug must cost one request, not the server. Answered here rather than by an exception
            # handler: an exception that reaches uvicorn also closes the (keep-alive) connection.
            logger.exception("%s %s failed", request.method, request.url.path)
            return _error(500, f"internal error: {exc!r}")

    return endpoint


async def _routing_error(request: Request, exc: StarletteHTTPException) -> Response:
    """Starlette's 404 (unknown path) and 405 (wrong method), in SGLang's envelope."""
    method, path = request.method, request.url.path
    if exc.status_code == 405:
        message = f"{path} takes {', '.join(sorted(ROUTES[path][0]))}, not {method}"
    else:  # 404: routing raises nothing else
        message = f"no route {method} {path}"
    return _error(exc.status_code, message, exc.headers)  # a 405 keeps its Allow header


def create_app(server: GenerationServer) -> FastAPI:
    """The routes of ROUTES and nothing else: no docs pages, no redirects of trailing slashes."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False,
                  exception_handlers={StarletteHTTPException: _routing_error})
    for path, (methods, route) in ROUTES.items():
        app.add_api_route(path, _endpoint(server, route), methods=sorted(methods), include_in_schema=False)
    return app


class GenerationServer:
    """The app on uvicorn, on its own thread and event loop; `stop()` ends it and the engine."""

    def __init__(self, address: tuple[str, int], engine: GenerationEngine, tokenizer: Any, tokenizer_path: str):
        self.engine = engine
        self.tokenizer = tokenizer
        self.tokenizer_path = tokenizer_path
        config = uvicorn.Config(
            create_app(self),
            lifespan="off",
            log_config=None,  # uvicorn's loggers propagate to the process's logging as configured
            access_log=logger.isEnabledFor(logging.DEBUG),
            backlog=BACKLOG,
            timeout_keep_alive=KEEP_ALIVE_SECONDS,
            timeout_graceful_shutdown=GRACEFUL_SHUTDOWN_SECONDS,
        )
        self._uvicorn = uvicorn.Server(config)
        # Bound here rather than by uvicorn, so that a port 0 is resolved before serve() returns.
        self._socket = socket.create_server(address, backlog=BACKLOG)
        self.server_address: tuple[str, int] = self._socket.getsockname()[:2]
        self._thread = threading.Thread(target=self._uvicorn.run, kwargs={"sockets": [self._socket]},
                                        name="generation-http", daemon=True)
        self._stopped = False

    @property
    def url(self) -> str:
        host, port = self.server_address
        return f"http://{host}:{port}"

    def start(self) -> threading.Thread:
        self._thread.start()
        return self._thread

    def stop(self) -> None:
        """Stop the engine (unfinished requests get 503), then uvicorn: no new connections, open ones closed."""
        if self._stopped:
            return
        self._stopped = True
        self.engine.shutdown()  # first, so requests still decoding are answered 503 right away
        # uvicorn notices within 0.1 s: it stops accepting, closes idle connections, and closes the
        # others once their answers are written (GRACEFUL_SHUTDOWN_SECONDS at most).
        self._uvicorn.should_exit = True
        if self._thread.is_alive():
            self._thread.join()
        self._socket.close()  # uvicorn closes it too; this covers a thread that never ran


def optional_tokenizer(model_path: str) -> Any:
    """The model directory's fast tokenizer, or None when it has no tokenizer.json."""
    if not (Path(model_path) / "tokenizer.json").is_file():
        return None
    from areal_flow.models.tokenizer import load_tokenizer

    return load_tokenizer(model_path)


def serve(
    model_path: str, host: str = "127.0.0.1", port: int = 0, **engine_kw: Any
) -> tuple[GenerationServer, threading.Thread]:
    """Start an engine and its HTTP server on a background thread (port 0: a free port)."""
    tokenizer = optional_tokenizer(model_path)
    engine = GenerationEngine(model_path, tokenizer=tokenizer, **engine_kw)  # the tokenizer: for stop strings
    try:
        server = GenerationServer((host, port), engine, tokenizer, model_path)
    except BaseException:
        engine.shutdown()
        raise
    return server, server.start()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m areal_flow.generation.server",
                                     description=__doc__.split("\n")[0])
    parser.add_argument("--model-path", required=True, help="Hugging Face model directory")
    parser.add_argument("--host", default="127.0.0.1", help="address to bind (loopback unless placed on other hosts)")
    parser.add_argument("--port", type=int, default=30000, help="port to bind (0: any free port)")
    parser.add_argument("--max-batch-size", type=int, default=128, help="most requests decoded together")
    parser.add_argument("--max-total-tokens", type=int, default=None,
                        help="KV cache budget in tokens: requests wait while the running ones' prompt + "
                             "max_new_tokens would exceed it (default: no budget)")
    parser.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    from transformers.utils import logging as hf_logging

    hf_logging.disable_progress_bar()  # keep the server log to log lines

    # Handlers first: a SIGTERM during model loading then still ends in a clean shutdown.
    stop = threading.Event()
    for sig in (signal.SIGTERM, signal.SIGINT):
        signal.signal(sig, lambda *_: stop.set())
    server, thread = serve(
        args.model_path, args.host, args.port,
        max_batch_size=args.max_batch_size, seed=args.seed, num_threads=args.num_threads,
        max_total_tokens=args.max_total_tokens,
    )
    logger.info("serving %s at %s", args.model_path, server.url)
    stop.wait()
    logger.info("shutting down")
    server.stop()
    thread.join()
    return 0


if __name__ == "__main__":
    sys.exit(main())
