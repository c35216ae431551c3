"""SGLang's native HTTP API (the subset RL trainers use) in front of the embedded engine.

FastAPI on uvicorn, as SGLang itself serves it: one event loop on a background thread answers
every connection (HTTP/1.1 keep-alive), and a request waits for the engine's thread without
holding a thread of its own. Field names, response shapes and error envelopes follow SGLang's
native API, so a client written for SGLang works here unchanged. New weights come from disk
(`/update_weights_from_disk`) or by broadcast from the trainer over a weights group
(`/init_weights_update_group`, `/update_weights_from_distributed`, `/destroy_weights_update_group`;
`weights/group.py`). The areal_flow extension is
`meta_info.output_token_versions`: the integer weight version of each generated token (SGLang's
`weight_version` is a free label; see `engine.version_for_label`). `/generate` bodies and answers,
streaming included, are in `generate_api.py`; `/v1/loads` and `/metrics` in `load_report.py`;
the size limit of a body, its JSON decoding and the parsing of large ones off the event loop in
`bodies.py`.
With an API key (`--api-key`, as SGLang's, or the AREAL_FLOW_API_KEY environment variable) every
request but /health* and /metrics needs `Authorization: Bearer <key>`, else it is answered 401 as
SGLang answers it (ApiKeyGuard).

    python -m areal_flow.generation.server --model-path DIR --host 127.0.0.1 --port 30000
"""

from __future__ import annotations

import argparse
import asyncio
import faulthandler
import gc
import hmac
import functools
import json
import logging
import os
import signal
import socket
import sys
import threading
import time
import uuid
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Future, ThreadPoolExecutor
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.responses import StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from areal_flow.generation import bodies, openai_api
from areal_flow.generation.bodies import json_object
from areal_flow.generation.compute_counts import COMPUTE_COUNTS
from areal_flow.generation.commands import PAUSE_MODES
from areal_flow.generation.engine import EngineShutdownError, GenerationEngine, version_for_label
from areal_flow.generation.generate_api import (
    AnswerStream,
    HTTPError,
    as_bool,
    bad_request,
    build_answer,
    parse_generate,
)
from areal_flow.generation.load_report import LoadReport
from areal_flow.runtime.devices import DTYPES, compute_dtype, local_device
from areal_flow.runtime.security import API_KEY_ENV
from areal_flow.weights import group as weight_group
from areal_flow.weights import ipc

logger = logging.getLogger(__name__)

HEALTH_GENERATE_TIMEOUT = 20.0
"""Seconds /health_generate waits for its one-token request (SGLang's SGLANG_HEALTH_CHECK_TIMEOUT)."""

DISCONNECT_POLL = 1.0
"""Seconds between checks that the client of a running non-streaming /generate is still connected."""

# ---- routes ------------------------------------------------------------------------------------

Payload = dict | list | str | None
"""A JSON value, text/plain, or an empty body."""


@dataclass(frozen=True)
class Call:
    """What a route gets of its HTTP request."""

    body: bytes
    received: float
    """time.perf_counter() when the request arrived."""
    query: Mapping[str, str]
    disconnected: Callable[[], Awaitable[bool]]
    """Whether the client has gone (Starlette's Request.is_disconnected)."""


async def route_generate(server: GenerationServer, call: Call) -> tuple[int, Payload] | Response:
    # A large body is parsed (its text tokenized) on a parser thread: generation/bodies.py.
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


async def _results_unless_gone(server: GenerationServer, call: Call, futures: list[Future], rids: list[str]
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


OPENAI_FIELDS = {
    True: frozenset({"model", "messages", "max_tokens", "max_completion_tokens", "temperature", "top_p", "n", "stop",
                     "seed", "stream", "stream_options", "logprobs", "top_logprobs", "tools", "tool_choice",
                     "skip_special_tokens"}),
    False: frozenset({"model", "prompt", "max_tokens", "temperature", "top_p", "n", "stop", "seed", "stream",
                      "stream_options", "logprobs", "skip_special_tokens"}),
}
"""The fields /v1/chat/completions (True) and /v1/completions (False) read (openai_api.IGNORED: those they ignore)."""


async def route_openai(server: GenerationServer, call: Call, *, chat: bool) -> tuple[int, Payload] | Response:
    """/v1/chat/completions and /v1/completions (generation/openai_api.py); a large body is parsed
    (rendered and tokenized) on a parser thread (generation/bodies.py)."""
    engine = server.engine

    def read(body: Any) -> openai_api.OpenAICall:
        return openai_api.parse_call(body, chat=chat, model_path=server.tokenizer_path, tokenizer=server.tokenizer,
                                     context_length=engine.context_length, known=OPENAI_FIELDS[chat],
                                     kv_budget=engine.max_total_tokens, vocab_size=engine.vocab_size)

    parsed = await bodies.parse(server.parser, call.body, read, lambda why: openai_api.openai_error(400, why))
    stream = openai_api.OpenAIStream(parsed, server.tokenizer, server.engine) if parsed.stream else None
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
    return 200, openai_api.build_response(parsed, results, server.tokenizer)


async def route_models(server: GenerationServer, call: Call) -> tuple[int, Payload]:
    return 200, openai_api.list_models(server.tokenizer_path, server.engine.context_length, server.started)


def _weight_version(value: Any, current: int) -> tuple[int, str | None]:
    """The integer version and the label (None: unchanged) that `weight_version` asks for."""
    if value is None:
        return current + 1, None  # new weights always get a new version, so token versions tell them apart
    if isinstance(value, int) and not isinstance(value, bool) and value >= 0:
        value = str(value)
    if not isinstance(value, str) or not value.strip():
        raise ValueError(f"weight_version must be a non-empty string (or a non-negative integer), got {value!r}")
    return version_for_label(value, current), value


async def route_update_weights(server: GenerationServer, call: Call) -> tuple[int, Payload]:
    body = json_object(call.body)
    engine = server.engine
    path = body.get("model_path")
    try:
        if not isinstance(path, str) or not path:
            raise ValueError("model_path is required: a directory with model.safetensors")
        version, label = _weight_version(body.get("weight_version"), engine.version)
        abort_all = as_bool(body.get("abort_all_requests"), "abort_all_requests", False)
        as_bool(body.get("flush_cache"), "flush_cache", True)  # the engine keeps no prefix cache to flush
        # Without abort_all_requests the update waits for the running requests to finish: on a
        # worker thread, not the event loop.
        await asyncio.to_thread(engine.update_weights_from_disk, path, version, abort_all_requests=abort_all,
                                label=label)
    except HTTPError as exc:
        return 400, {"success": False, "message": exc.message, "num_paused_requests": 0}
    except (OSError, ValueError) as exc:
        message = f"Failed to update weights: {exc}. The server keeps weight version {engine.weight_label}."
        return 400, {"success": False, "message": message, "num_paused_requests": 0}
    message = f"Succeeded to update model weights. Weight version updated to {engine.weight_label}."
    return 200, {"success": True, "message": message, "num_paused_requests": 0}


# ---- weights by broadcast (SGLang's /init_weights_update_group, /update_weights_from_distributed) --

WEIGHT_GROUP_TIMEOUT = 600.0
"""Seconds a server waits for the other ranks of a weights group: to join it, and for each
broadcast (the trainer gathers a bucket meanwhile)."""


@dataclass(eq=False)
class WeightGroup:
    """A weights group this server joined: trainer rank 0 broadcasts, this server is `rank`."""

    name: str
    process_group: Any
    rank: int
    world_size: int
    lock: threading.Lock
    """Held while a bucket is received and loaded: two buckets on one group must not interleave,
    and the next one is received into the same buffer."""
    device: Any = "cpu"
    """Where the buffer lives: the backend's memory (gloo: the CPU, nccl: the engine's GPU)."""
    buffer: Any = None
    """The receive buffer (flat uint8), kept from bucket to bucket and grown to the largest. Fresh
    memory costs its page faults on every bucket: 0.5 s per GB on the 2-core test machine, about
    as much as the broadcast itself; a GPU caching allocator keeps its blocks the same way."""

    def receive(self, specs: list) -> dict:
        size = weight_group.bucket_bytes(specs)
        if self.buffer is None or self.buffer.numel() < size:
            self.buffer = None  # the old one is freed before the larger one is made
            self.buffer = torch.empty(size, dtype=torch.uint8, device=self.device)
        return weight_group.receive(self.process_group, specs, self.buffer)


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


def _off_loop(fn: Callable[..., Any], *args: Any) -> Awaitable[Any]:
    """Run `fn` on a daemon thread. A broadcast whose sender died blocks until the group's timeout;
    on a daemon thread it cannot hold up the process's exit (asyncio.to_thread's pool would)."""
    future: Future = Future()

    def run() -> None:
        try:
            future.set_result(fn(*args))
        except BaseException as exc:
            future.set_exception(exc)

    threading.Thread(target=run, name="weights-group", daemon=True).start()
    return asyncio.wrap_future(future)


def _group_field(body: dict, key: str, kind: type, default: Any = None) -> Any:
    value = body.get(key, default)
    if not isinstance(value, kind) or isinstance(value, bool) or (kind is str and not value):
        raise bad_request(f"{key} must be {'a non-empty string' if kind is str else 'an integer'}, got {value!r}")
    return value


async def route_init_weights_update_group(server: GenerationServer, call: Call) -> tuple[int, Payload]:
    """Join the weights group as rank `rank_offset` (the embedded engine is one rank: SGLang's TP
    ranks would take rank_offset + tp_rank). Returns once every rank has joined."""
    body = json_object(call.body)
    try:
        address = _group_field(body, "master_address", str)
        port = _group_field(body, "master_port", int)
        rank = _group_field(body, "rank_offset", int)
        world_size = _group_field(body, "world_size", int)
        name = _group_field(body, "group_name", str, weight_group.DEFAULT_GROUP)
        backend = _group_field(body, "backend", str, "nccl")  # SGLang's default; the embedded engine needs gloo
        if not 0 < rank < world_size:
            raise bad_request(f"rank_offset must be in [1, world_size) = [1, {world_size}): rank 0 is the "
                              f"trainer's, got {rank}")
        if backend == "nccl" and server.engine.device.type != "cuda":
            raise bad_request(f"backend 'nccl' needs the engine on CUDA, and this server runs on "
                              f"{server.engine.device.type}: join with backend 'gloo'")
        with server.weight_groups_lock:
            if name in server.weight_groups:
                raise bad_request(f"a weights group named {name!r} exists already; destroy it first "
                                  "(/destroy_weights_update_group)")
        process_group = await _off_loop(functools.partial(
            weight_group.join, None, master_address=address, master_port=port, rank=rank, world_size=world_size,
            group_name=name, backend=backend, timeout=WEIGHT_GROUP_TIMEOUT))
    except HTTPError as exc:
        return 400, {"success": False, "message": f"Failed to init the weights update group: {exc.message}"}
    except weight_group.WeightGroupError as exc:
        return 400, {"success": False, "message": f"Failed to init the weights update group: {exc}"}
    with server.weight_groups_lock:
        # NCCL broadcasts from and into GPU memory, gloo CPU memory.
        device = server.engine.device if backend == "nccl" else torch.device("cpu")
        server.weight_groups[name] = WeightGroup(name, process_group, rank, world_size, threading.Lock(), device)
    logger.info("joined weights group %r as rank %d of %d (%s, store at %s:%d)", name, rank, world_size, backend,
                address, port)
    return 200, {"success": True, "message": "Succeeded to initialize custom process group."}


async def route_update_weights_from_distributed(server: GenerationServer, call: Call) -> tuple[int, Payload]:
    """Receive one bucket by broadcast and load it. Once the bucket can be read (its group exists,
    names, dtypes and shapes are well formed) its tensors are received whatever else is wrong, so
    that the sender's broadcast completes and the group stays usable; only then is a bucket that
    does not fit the model refused, naming the tensor, with nothing of it loaded."""
    body = json_object(call.body)
    engine = server.engine
    refused = {"success": False, "message": ""}
    try:
        name = _group_field(body, "group_name", str, weight_group.DEFAULT_GROUP)
        with server.weight_groups_lock:
            group = server.weight_groups.get(name)
        if group is None:
            raise ValueError(f"no weights group named {name!r}; join one first (/init_weights_update_group)")
        specs = weight_group.parse_bucket(body.get("names"), body.get("dtypes"), body.get("shapes"))
    except HTTPError as exc:
        return 400, refused | {"message": f"Failed to update weights: {exc.message}"}
    except ValueError as exc:
        return 400, refused | {"message": f"Failed to update weights: {exc}"}

    problem = ""  # found before the tensors arrive, told once they have
    try:
        version, label = _weight_version(body.get("weight_version"), engine.version)
        abort_all = as_bool(body.get("abort_all_requests"), "abort_all_requests", False)
        as_bool(body.get("flush_cache"), "flush_cache", True)  # the engine keeps no prefix cache to flush
        if body.get("load_format") is not None:
            raise bad_request(f"load_format {body['load_format']!r} is not supported: the embedded engine loads "
                              "Hugging Face tensors as they are (load_format null)")
    except HTTPError as exc:
        problem = exc.message
    except ValueError as exc:
        problem = str(exc)

    def receive_and_load() -> str:
        """Returns why the bucket was refused, or ""."""
        with group.lock:
            try:
                state = group.receive(specs)
            except RuntimeError as exc:  # the broadcast failed: the sender left or the group timed out
                return f"receiving from group {name!r} failed: {exc}"
            if problem:
                return problem
            try:
                # Returns once the tensors are copied into the model: the buffer is free again.
                engine.update_weights_from_tensors(state, version, source=f"weights group {name!r} ({len(state)} "
                                                   "tensors)", abort_all_requests=abort_all, label=label)
            except ValueError as exc:
                return str(exc)
        return ""

    if why := await _off_loop(receive_and_load):
        return 400, refused | {"message": f"Failed to update weights: {why}. The server keeps weight version "
                                          f"{engine.weight_label}."}
    return 200, {"success": True, "message": f"Succeeded to update model weights. Weight version updated to "
                                             f"{engine.weight_label}."}


async def route_destroy_weights_update_group(server: GenerationServer, call: Call) -> tuple[int, Payload]:
    body = json_object(call.body)
    try:
        name = _group_field(body, "group_name", str, weight_group.DEFAULT_GROUP)
    except HTTPError as exc:
        return 400, {"success": False, "message": exc.message}
    with server.weight_groups_lock:
        group = server.weight_groups.pop(name, None)
    if group is None:
        return 400, {"success": False, "message": f"no weights group named {name!r}"}
    # The group's sockets close when nothing holds it; one still receiving keeps it until it is done.
    logger.info("left weights group %r", name)
    return 200, {"success": True, "message": f"Succeeded to destroy custom process group {name}."}


async def route_health(server: GenerationServer, call: Call) -> tuple[int, Payload]:
    return (200 if server.engine.is_running else 503), None


async def route_health_generate(server: GenerationServer, call: Call) -> tuple[int, Payload]:
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


async def route_ready(server: GenerationServer, call: Call) -> tuple[int, Payload]:
    # As SGLang's /ready: healthy and not paused (a paused server holds new requests).
    return (200 if server.engine.is_running and not server.engine.paused else 503), None


async def route_loads(server: GenerationServer, call: Call) -> tuple[int, Payload]:
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


async def route_metrics(server: GenerationServer, call: Call) -> Response:
    return Response(server.load_report.prometheus_text(), media_type=CONTENT_TYPE_LATEST)


async def route_model_info(server: GenerationServer, call: Call) -> tuple[int, Payload]:
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


async def route_server_info(server: GenerationServer, call: Call) -> tuple[int, Payload]:
    engine = server.engine
    host, port = server.server_address[:2]
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
        "skip_tokenizer_init": server.tokenizer is None,
        "weight_version": engine.weight_label,
        "busy_seconds": stats["busy_seconds"],
        "load_seconds": stats["load_seconds"],
        "memory_releases": stats["memory_releases"],  # a colocated trainer's turns
        **{key: stats[key] for key in COMPUTE_COUNTS},  # for the advisor's fit of the decode cost
        "internal_states": [stats],
    }


async def route_weight_version(server: GenerationServer, call: Call) -> tuple[int, Payload]:
    return 200, {"weight_version": server.engine.weight_label}


async def route_flush_cache(server: GenerationServer, call: Call) -> tuple[int, Payload]:
    # As SGLang it refuses while requests run or wait: clients poll it to learn that the server is idle.
    if not server.engine.is_idle():
        return 400, "Flush cache failed.\n"
    server.engine.flush_cache()
    return 200, "Cache flushed.\n"


async def route_pause(server: GenerationServer, call: Call) -> tuple[int, Payload]:
    mode = json_object(call.body).get("mode") or "abort"
    if mode not in PAUSE_MODES:
        raise bad_request(f"pause_generation mode {mode!r} is not supported by the embedded engine; it pauses "
                          f"in mode {', '.join(map(repr, PAUSE_MODES))}")
    await asyncio.to_thread(server.engine.pause, mode)  # returns once the running requests are aborted or retracted
    return 200, {"message": "Generation paused successfully.", "status": "ok"}


async def route_continue(server: GenerationServer, call: Call) -> tuple[int, Payload]:
    json_object(call.body)
    server.engine.continue_generation()
    return 200, {"message": "Generation continued successfully.", "status": "ok"}


async def route_update_weights_from_tensor(server: GenerationServer, call: Call) -> tuple[int, Payload]:
    """SGLang's /update_weights_from_tensor: tensors of a process on this machine, by handle (CUDA
    IPC on a GPU, shared-memory files on the CPU: weights/ipc.py), copied into the model before the
    answer, so the sender may free them then. One serialized bucket: the embedded engine is one TP
    rank."""
    body = json_object(call.body)
    engine = server.engine
    refused = {"success": False, "message": ""}
    try:
        buckets = body.get("serialized_named_tensors")
        if not isinstance(buckets, list) or len(buckets) != 1:
            raise bad_request("serialized_named_tensors must be a list of one serialized bucket (one per TP rank; "
                              f"the embedded engine is one), got {type(buckets).__name__}"
                              + (f" of {len(buckets)}" if isinstance(buckets, list) else ""))
        if body.get("load_format") is not None:
            raise bad_request(f"load_format {body['load_format']!r} is not supported: the embedded engine loads "
                              "Hugging Face tensors as they are (load_format null)")
        version, label = _weight_version(body.get("weight_version"), engine.version)
        abort_all = as_bool(body.get("abort_all_requests"), "abort_all_requests", False)
        as_bool(body.get("flush_cache"), "flush_cache", True)  # the engine keeps no prefix cache to flush
        named = await asyncio.to_thread(ipc.deserialize, buckets[0])
        state = dict(named)
        await asyncio.to_thread(engine.update_weights_from_tensors, state, version, abort_all_requests=abort_all,
                                source=f"tensors by handle ({len(state)} tensors)", label=label)
    except HTTPError as exc:
        return 400, refused | {"message": f"Failed to update weights: {exc.message}"}
    except ValueError as exc:
        return 400, refused | {"message": f"Failed to update weights: {exc}. The server keeps weight version "
                                          f"{engine.weight_label}."}
    return 200, {"success": True, "message": f"Succeeded to update model weights. Weight version updated to "
                                             f"{engine.weight_label}."}


async def route_release_memory(server: GenerationServer, call: Call) -> tuple[int, Payload]:
    """SGLang's /release_memory_occupation for the KV cache: the running requests are retracted and
    their cache freed; the server stays paused until /continue_generation. The embedded engine's
    weights stay where they are (tags other than kv_cache are refused)."""
    tags = json_object(call.body).get("tags") or ["kv_cache"]
    if not isinstance(tags, list) or set(tags) - {"kv_cache"}:
        raise bad_request(f"tags {tags!r}: the embedded engine releases only its KV cache (tags: ['kv_cache']); its "
                          "weights stay on the device")
    await asyncio.to_thread(server.engine.release_memory)
    return 200, {"success": True, "message": "KV cache released; generation paused until /continue_generation"}


async def route_resume_memory(server: GenerationServer, call: Call) -> tuple[int, Payload]:
    """SGLang's /resume_memory_occupation: the embedded engine allocates its KV cache as requests
    come, so there is nothing to take back; generation goes on at /continue_generation."""
    json_object(call.body)
    return 200, {"success": True, "message": "memory resumed"}


async def route_abort(server: GenerationServer, call: Call) -> tuple[int, Payload]:
    body = json_object(call.body)
    rid, abort_all = body.get("rid") or "", as_bool(body.get("abort_all"), "abort_all", False)
    if not isinstance(rid, str):
        raise bad_request(f"rid must be a string, got {rid!r}")
    if abort_all or rid:  # an empty rid without abort_all is ignored, as in SGLang; an unknown rid too
        await asyncio.to_thread(server.engine.abort, None if abort_all else rid)
    return 200, None


Route = Callable[["GenerationServer", Call], Awaitable["tuple[int, Payload] | Response"]]

ROUTES: dict[str, tuple[frozenset[str], Route]] = {
    "/generate": (frozenset({"POST", "PUT"}), route_generate),
    "/update_weights_from_disk": (frozenset({"POST"}), route_update_weights),
    "/init_weights_update_group": (frozenset({"POST"}), route_init_weights_update_group),
    "/update_weights_from_distributed": (frozenset({"POST"}), route_update_weights_from_distributed),
    "/destroy_weights_update_group": (frozenset({"POST"}), route_destroy_weights_update_group),
    "/update_weights_from_tensor": (frozenset({"POST"}), route_update_weights_from_tensor),
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


def _error(status: int, message: str, headers: dict[str, str] | None = None, extra: dict | None = None) -> Response:
    return _response(status, {"error": {"message": message, **(extra or {})}}, headers)


def _endpoint(server: GenerationServer, path: str, route: Route) -> Callable[[Request], Awaitable[Response]]:
    openai = path.startswith("/v1/")  # OpenAI's routes answer in OpenAI's envelope, a 413 too

    async def endpoint(request: Request) -> Response:
        received = time.perf_counter()
        try:
            try:
                body = await bodies.read_body(request, server.max_request_bytes)
            except HTTPError as exc:
                raise openai_api.openai_error(exc.status, exc.message, code="request_too_large") if openai else exc
            call = Call(body, received, request.query_params, request.is_disconnected)
            answer = await route(server, call)
            return answer if isinstance(answer, Response) else _response(*answer)
        except HTTPError as exc:
            # After a 413 the rest of the body may still be on its way: close instead of reading it.
            return _error(exc.status, exc.message, {"Connection": "close"} if exc.status == 413 else None, exc.extra)
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


OPEN_PATHS = ("/health", "/metrics")
"""Path prefixes answered without the API key, as SGLang's: liveness probes and Prometheus scrapers
hold no secret, and these routes neither take input nor change state."""


class ApiKeyGuard:
    """SGLang's --api-key: a request without `Authorization: Bearer <key>` is answered 401 with
    SGLang's body before it is routed (an unknown path too), unless it is an OPTIONS request or
    its path starts with one of OPEN_PATHS. Plain ASGI rather than an `@app.middleware("http")`
    function, which would buffer streamed answers and hide a client's disconnect from /generate."""

    def __init__(self, app: ASGIApp, api_key: str) -> None:
        self.app = app
        self.expected = f"Bearer {api_key}".encode()

    def allowed(self, scope: Scope) -> bool:
        if scope["method"] == "OPTIONS" or scope["path"].startswith(OPEN_PATHS):
            return True
        given = Headers(scope=scope).get("authorization", "")
        scheme, _, token = given.partition(" ")
        # The scheme is case-insensitive (RFC 9110); the token is compared in constant time.
        return scheme.lower() == "bearer" and hmac.compare_digest(f"Bearer {token}".encode(), self.expected)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] == "http" and not self.allowed(scope):
            await _response(401, {"error": "Unauthorized"})(scope, receive, send)
            return
        await self.app(scope, receive, send)


def create_app(server: GenerationServer, api_key: str | None = None) -> FastAPI:
    """The routes of ROUTES and nothing else: no docs pages, no redirects of trailing slashes;
    behind ApiKeyGuard when there is an `api_key`."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False,
                  exception_handlers={StarletteHTTPException: _routing_error})
    for path, (methods, route) in ROUTES.items():
        app.add_api_route(path, _endpoint(server, path, route), methods=sorted(methods), include_in_schema=False)
    if api_key is not None:
        app.add_middleware(ApiKeyGuard, api_key=api_key)
    return app


class GenerationServer:
    """The app on uvicorn, on its own thread and event loop; `stop()` ends it and the engine.
    With an `api_key`, requests need it as a bearer token (ApiKeyGuard)."""

    def __init__(self, address: tuple[str, int], engine: GenerationEngine, tokenizer: Any, tokenizer_path: str,
                 api_key: str | None = None, max_request_bytes: int = bodies.MAX_REQUEST_BYTES):
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be at least 1, got {max_request_bytes}")
        self.engine = engine
        self.tokenizer = tokenizer
        self.tokenizer_path = tokenizer_path
        self.max_request_bytes = max_request_bytes  # larger bodies are refused (413) before they are read
        # Large bodies are parsed and tokenized here, off the event loop (generation/bodies.py).
        self.parser = ThreadPoolExecutor(bodies.PARSE_THREADS, thread_name_prefix="generation-parse")
        self.started = int(time.time())  # /v1/models' `created`
        self.load_report = LoadReport(engine)
        self.weight_groups: dict[str, WeightGroup] = {}  # the weights groups joined, by name
        self.weight_groups_lock = threading.Lock()
        config = uvicorn.Config(
            create_app(self, api_key),
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
        # Every answer goes out in two writes (headers, then body). asyncio turns Nagle off only for
        # sockets whose proto is IPPROTO_TCP, and create_server's (so every accepted one's) is 0: the
        # body then waited for the client's delayed ACK, 40 ms on each request of a kept-alive
        # connection after the first. Set on the listening socket, Linux gives it to accepted ones.
        self._socket.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
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
        self.parser.shutdown(wait=False, cancel_futures=True)  # a body still tokenizing answers no one


def optional_tokenizer(model_path: str) -> Any:
    """The model directory's fast tokenizer, or None when it has no tokenizer.json."""
    if not (Path(model_path) / "tokenizer.json").is_file():
        return None
    from areal_flow.models.tokenizer import load_tokenizer

    return load_tokenizer(model_path)


def serve(
    model_path: str, host: str = "127.0.0.1", port: int = 0, *, api_key: str | None = None,
    max_request_bytes: int = bodies.MAX_REQUEST_BYTES, **engine_kw: Any
) -> tuple[GenerationServer, threading.Thread]:
    """Start an engine and its HTTP server on a background thread (port 0: a free port); with an
    `api_key`, requests need it as a bearer token; bodies over `max_request_bytes` are refused."""
    tokenizer = optional_tokenizer(model_path)
    engine = GenerationEngine(model_path, tokenizer=tokenizer, **engine_kw)  # the tokenizer: for stop strings
    try:
        server = GenerationServer((host, port), engine, tokenizer, model_path, api_key, max_request_bytes)
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
                        help="KV cache budget in tokens: requests wait while the blocks they need are taken, and "
                             "the newest are retracted when the running ones outgrow it (default: no budget)")
    parser.add_argument("--page-size", type=int, default=16, help="tokens per block of the paged KV cache")
    parser.add_argument("--chunked-prefill-size", type=int, default=None,
                        help="prompt tokens prefilled per forward beside the decoding rows (-1 or unset: whole prompts)")
    parser.add_argument("--disable-radix-cache", action="store_true",
                        help="keep no prefix cache: every request prefills its whole prompt (SGLang's flag; the "
                             "embedded engine's prefix cache is hash-chained blocks, generation/paged.py)")
    parser.add_argument("--disable-cuda-graph", action="store_true",
                        help="cuda: run decode steps eagerly instead of replaying captured CUDA graphs")
    parser.add_argument("--disable-overlap-schedule", action="store_true",
                        help="read each step's sampled tokens back before launching the next forward (SGLang's "
                             "flag); by default the forward is launched first and the host's work overlaps it")
    parser.add_argument("--num-threads", type=int, default=None, help="torch intra-op threads")
    parser.add_argument("--seed", type=int, default=0, help="sampling seed")
    parser.add_argument("--device", default="cpu", choices=("cpu", "cuda"),
                        help="where weights, KV cache and sampling live (cuda: the first GPU this process sees)")
    parser.add_argument("--dtype", default="auto", choices=sorted(DTYPES) + ["auto"],
                        help="number format of the weights and KV cache; auto = bfloat16 on cuda, float32 on cpu")
    parser.add_argument("--mem-fraction-static", type=float, default=None,
                        help="cuda, without --max-total-tokens: the KV budget is what is left of this share of the "
                             "GPU's memory after the weights (SGLang's flag)")
    parser.add_argument("--enable-deterministic-inference", action="store_true",
                        help="batch-invariant decoding (SGLang's flag): a request's tokens and logprobs do not "
                             "depend on what else is in the batch, so a seeded request answers bit-identically "
                             "however requests arrive; slower (generation/decode.py)")
    parser.add_argument("--weight-version", default="default",
                        help="label of the initial weights (digits also set the integer token version)")
    parser.add_argument("--api-key", default=os.environ.get(API_KEY_ENV) or None,
                        help="requests need `Authorization: Bearer API_KEY` (all but /health* and /metrics), as "
                             f"SGLang's; default: the {API_KEY_ENV} environment variable, which unlike the command "
                             "line other users cannot read")
    parser.add_argument("--max-request-bytes", type=int, default=bodies.MAX_REQUEST_BYTES,
                        help="larger request bodies are refused (413) before they are read or parsed "
                             f"(generation.max_request_bytes; default {bodies.MAX_REQUEST_BYTES})")
    parser.add_argument("--log-level", default="INFO")
    args = parser.parse_args(argv)
    faulthandler.enable()  # a native crash prints every thread's stack into the log, as the roles' (runtime/child.py)
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
        max_total_tokens=args.max_total_tokens, weight_label=args.weight_version, api_key=args.api_key or None,
        max_request_bytes=args.max_request_bytes,
        device=str(local_device(args.device)), dtype=compute_dtype(args.dtype, args.device),
        mem_fraction=args.mem_fraction_static, batch_invariant=args.enable_deterministic_inference,
        page_size=args.page_size, chunked_prefill_size=args.chunked_prefill_size,
        cuda_graphs=not args.disable_cuda_graph, prefix_cache=not args.disable_radix_cache,
        overlap=not args.disable_overlap_schedule,
    )
    # Never the key itself: logs are read by more people than the run's owner.
    logger.info("serving %s at %s%s", args.model_path, server.url,
                " (requests need the API key)" if args.api_key else "")
    stop.wait()
    logger.info("shutting down")
    server.stop()
    thread.join()
    # The interpreter's last garbage collection walks every object torch and transformers made:
    # 1-2 s of a run's stop on 2 cores (py-spy: gc_collect_main). Frozen objects are not walked.
    gc.freeze()
    return 0


if __name__ == "__main__":
    sys.exit(main())
