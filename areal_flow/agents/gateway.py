"""The gateway: OpenAI's endpoints for agents, in front of the generation servers, recording every
call's exact tokens.

An agent gets a client whose base URL names its rollout: `http://HOST:PORT/t/<key>/v1`. Each call
goes to the generation servers through the rollout worker's ServerPool with `<key>` as its routing
key, so a rollout's calls stay on one server (its prefix cache holds their history) while the keys
spread by load; a failed server's calls are retried on another. The server's answer carries the
call's exact tokens (openai_api.py's extension fields): the gateway hands them to the key's
Recorder (trajectories.py), which links the calls into trajectories and counts drift, and returns
the answer unchanged. A rollout's text prompts (`/v1/completions`) are tokenized here, the text
it sent and got before standing for the tokens it was (text_map.py), and its chat histories are
sent as the policy's tokens where it sent back what it got (chat_map.py). A choice a weight update cut
(`finish_reason: abort`, an interruptible run) is carried on to its end first (resume.py), so the
agent gets and the record keeps one whole answer. A call with `stream: true` is streamed from the
server to the agent as it is generated, recorded as a whole call is, a cut choice carried on in
the same stream (stream.py). In front of SGLang (`backend="sglang"`), each call asks for the exact
tokens SGLang returns only when asked, and its answer is put in the embedded server's shape first
(sglang_wire.py); a streamed call is asked for whole there and streamed back as it ends (sse.py).

A key opened with `open(key, Sampling(...))` (the agent runner's rollouts) has the run's sampling
applied to each call: the policy's model name and temperature/top_p (the trainer computes the
policy's logprobs at the run's temperature, so an agent may not sample at another), and where the
agent sets none, the answer budget and a seed of its own for each call.

Starlette on uvicorn, served from the caller's event loop (`start`); the agent runner's clients
call the app in process (agents/runner.py).
"""

from __future__ import annotations

import asyncio
import dataclasses
import socket
from typing import Any, Callable

import msgspec
import uvicorn
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from areal_flow.agents import resume, sglang_wire, sse
from areal_flow.agents.chat_map import ChatMap
from areal_flow.agents.resume import CARRY_ON_FAILED
from areal_flow.agents.stream import Choice, Relay
from areal_flow.agents.text_map import TextMap
from areal_flow.agents.trajectories import Recorder
from areal_flow.generation.client.carry_on import CUT, Piece, carry_on
from areal_flow.generation.client.generation_client import GenerationError
from areal_flow.generation.client.router import ServerPool, ServerPoolError

OPENAI_PATHS = ("chat/completions", "completions")


class Answer(msgspec.Struct):
    prompt_token_ids: list[int]
    choices: list[Choice]


@dataclasses.dataclass(frozen=True)
class Call:
    """An agent's call as the gateway sends it to the server."""

    body: dict
    raw: bytes  # the body encoded, as sent
    text: str | None  # a /v1/completions text prompt (text_map.py learns its tokens)
    chat: tuple[Any, Any] | None  # a chat call's (messages, tools) where the gateway maps them (chat_map.py)
    asked: Any  # the agent's own `logprobs`
    stream: bool
    include_usage: bool  # stream_options.include_usage


@dataclasses.dataclass
class Sampling:
    """How one key's calls sample: `forced` replaces what the agent sent, `defaults` fill what it did
    not; call k gets seed `seeds(k)` unless it sends one (None: no seed)."""

    forced: dict[str, Any]
    defaults: dict[str, Any]
    seeds: Callable[[int], int | None] = lambda _: None
    calls: int = 0

    def apply(self, body: dict) -> dict:
        seed = self.seeds(self.calls)
        self.calls += 1
        seed = {} if seed is None else {"seed": seed}
        return {**self.defaults, **seed, **body, **self.forced}


class Gateway:
    """Serves `/t/{key}/v1/chat/completions`, `/t/{key}/v1/completions` and `/t/{key}/v1/models`
    for the agents of one rollout worker; `recorders[key]` holds each key's trajectories."""

    def __init__(self, pool: ServerPool, host: str = "127.0.0.1", require_open: bool = False,
                 tokenizer: Any = None, backend: str = "embedded", tool_call_parser: str = "auto") -> None:
        # require_open: a call on a key not opened (or taken already: a call the rollout's wall time
        # cut off, answered late) is refused, and nothing is recorded for it. tokenizer: the policy's,
        # to derive a resumed answer's text (None: a cut answer comes back cut).
        self.pool, self.host, self.require_open, self.tokenizer = pool, host, require_open, tokenizer
        self.sglang = backend == "sglang"  # the servers are SGLang's (generation.backend)
        # generation.tool_call_parser: a resumed answer's calls are read as the servers read them.
        self.tool_call_parser = tool_call_parser
        self.recorders: dict[str, Recorder] = {}
        self.sampling: dict[str, Sampling] = {}
        self.texts: dict[str, TextMap] = {}  # each key's texts and the tokens they stand for
        self.chats: dict[str, ChatMap] = {}  # each key's conversations and the tokens they stand for
        # Chat histories are mapped onto the policy's tokens where the servers take them
        # (`prompt_token_ids`: the embedded server's extension; SGLang renders its own).
        self.map_chats = tokenizer is not None and not self.sglang and bool(getattr(tokenizer, "chat_template", None))
        # Starlette, FastAPI's core: the gateway checks no request models, and FastAPI's layers cost
        # the rollout worker a tenth of its CPU in an agent run (py-spy; bench_gateway.py).
        routes = [Route(f"/t/{{key}}/v1/{path}", self._forwarder(f"/v1/{path}"), methods=["POST"])
                  for path in OPENAI_PATHS]
        self.app = Starlette(routes=[*routes, Route("/t/{key}/v1/models", self._models, methods=["GET"])])
        self._server: uvicorn.Server | None = None
        self._task: asyncio.Task | None = None
        self.port = 0

    def base_url(self, key: str) -> str:
        """The base URL an agent's client takes for the rollout `key`."""
        return f"http://{self.host}:{self.port}/t/{key}/v1"

    def open(self, key: str, sampling: Sampling) -> str:
        """The base URL for rollout `key`, whose calls sample by `sampling`."""
        self.sampling[key] = sampling
        return self.base_url(key)

    def take(self, key: str) -> Recorder:
        """The rollout's record, removed from the gateway (the rollout is over)."""
        self.sampling.pop(key, None)
        self.texts.pop(key, None)
        self.chats.pop(key, None)
        return self.recorders.pop(key, Recorder())

    async def start(self) -> None:
        sock = socket.create_server((self.host, 0))
        self.port = sock.getsockname()[1]
        self._server = uvicorn.Server(uvicorn.Config(self.app, log_level="warning", lifespan="off",
                                                     timeout_keep_alive=600))
        self._task = asyncio.create_task(self._server.serve(sockets=[sock]))
        while not self._server.started:
            if self._task.done():
                self._task.result()  # raises what stopped it
            await asyncio.sleep(0.01)

    async def stop(self) -> None:
        if self._server is not None:
            self._server.should_exit = True
            await self._task

    def _forwarder(self, path: str):
        async def forward(request: Request) -> Response:
            key = request.path_params["key"]
            call = self._prepared(key, path, await request.body())
            if isinstance(call, Response):
                return call
            if call.stream and not self.sglang:  # in front of SGLang, emulated (sse.py)
                return await self._streamed(key, path, call)
            return await self._whole(key, path, call)

        return forward

    def _prepared(self, key: str, path: str, raw: bytes) -> Call | Response:
        """The call `raw` as the gateway sends it to the server, or the answer refusing it."""
        # Bodies pass through as bytes, decoded once (msgspec) to check the request and to record
        # the answer, never encoded again: the gateway's cost is a call's (bench_gateway.py).
        try:
            body = msgspec.json.decode(raw)
        except msgspec.DecodeError as exc:
            return _error(400, f"the request body is not valid JSON: {exc}")
        if not isinstance(body, dict):
            return _error(400, "the request body must be a JSON object")
        sent, stream, include_usage = body, body.get("stream") is True, False
        if stream:
            options = body.get("stream_options") or {}
            if not isinstance(options, dict):
                return _error(400, "stream_options must be an object", "stream_options")
            include_usage = bool(options.get("include_usage"))
            if self.sglang:  # asked for whole (recorded whole), streamed back as it ends (sse.py)
                body = sse.streamed(body)
        if self.require_open and key not in self.sampling:
            return _error(404, f"no rollout {key!r} is open on this gateway (it ended, or never began)")
        if (sampling := self.sampling.get(key)) is not None:
            body = sampling.apply(body)
        text = body.get("prompt") if path == "/v1/completions" and self.tokenizer is not None else None
        if isinstance(text, str):
            # The prompt's tokens made here, not by the server: the text the rollout sent and got
            # before stands for the tokens it was (text_map.py: no drift from a stop string or a
            # special token its text left out); the rest is tokenized as the server would
            # (openai_api._prompt). Also cheaper: tokenizing a long conversation's text costs the
            # server's interpreter, which decodes for every agent, ~0.4 ms a call (bench_gateway.py).
            body = {**body, "prompt": self.texts.setdefault(key, TextMap()).tokens(text, self._encode)}
        chat = (body.get("messages"), body.get("tools")) if path == "/v1/chat/completions" and self.map_chats else None
        if chat is not None and (ids := self.chats.setdefault(key, ChatMap(self.tokenizer)).tokens(*chat)) is not None:
            # The history's tokens made here (chat_map.py): the policy's own where the agent sent
            # back what it got, whatever the template would render of it.
            body = {**body, "prompt_token_ids": ids}
        asked = body.get("logprobs")
        if self.sglang:
            body = sglang_wire.ask(body)
        if body is not sent:  # encoded once, whatever changed it
            raw = msgspec.json.encode(body)
        return Call(body, raw, text if isinstance(text, str) else None, chat, asked, stream, include_usage)

    async def _whole(self, key: str, path: str, call: Call) -> Response:
        """The call asked of the server whole, carried on if cut, recorded, answered (streamed as
        it ends for SGLang's: sse.py)."""
        try:
            data = await self._post(path, call.raw, key, call.asked)
        except GenerationError as exc:  # the server refused the request: its answer, as it gave it
            return _refused(exc)
        except (ServerPoolError, sglang_wire.SGLangAnswerError) as exc:
            return _error(502, str(exc))
        if self.require_open and key not in self.sampling:  # the rollout ended while the call ran
            return _error(404, f"rollout {key!r} ended while this call ran: its answer is not recorded")
        answer = msgspec.json.decode(data, type=Answer)
        if self.tokenizer is not None and any(c.finish_reason == CUT for c in answer.choices):
            try:
                # The agent's own logprobs: a rederived choice carries OpenAI's only if it asked.
                data, answer = await self._resumed(key, path, {**call.body, "logprobs": call.asked}, data)
            except (GenerationError, ServerPoolError, sglang_wire.SGLangAnswerError) as exc:
                return _error(502, f"{CARRY_ON_FAILED}: {exc}")
        self.record(key, call, answer.prompt_token_ids, answer.choices)
        if call.stream:
            return Response(b"".join(sse.chunks(msgspec.json.decode(data), path.endswith("chat/completions"),
                                                call.include_usage)), media_type="text/event-stream")
        return Response(data, media_type="application/json")

    async def _streamed(self, key: str, path: str, call: Call) -> Response:
        """The call streamed from the key's server to the agent as it is generated (stream.py).
        Its first event is awaited here, so that a call the server refuses, or that no server can
        take, is answered with the status a whole call gets."""
        relay = Relay(self, key, path.endswith("chat/completions"), call)
        upstream = self.pool.stream(path, call.raw, key=key)
        try:
            first = await anext(upstream)
        except GenerationError as exc:
            return _refused(exc)
        except ServerPoolError as exc:
            return _error(502, str(exc))
        except StopAsyncIteration:
            return _error(502, "the server's stream ended before its first event")
        return StreamingResponse(relay.events(first, upstream), media_type="text/event-stream")

    def record(self, key: str, call: Call, prompt_ids: list[int], choices: list[Choice], resumes: int = 0) -> None:
        """A call's answer into the key's record (and its text prompt's tokens into its text map)."""
        recorder = self.recorders.setdefault(key, Recorder())
        recorder.resumes += resumes
        for choice in choices:
            recorder.record(prompt_ids, choice.token_ids, choice.output_token_logprobs, choice.output_token_versions)
        if call.text is not None and (texts := self.texts.get(key)) is not None:
            texts.learn(call.text, prompt_ids, [
                (c.text or "", self.tokenizer.decode(c.token_ids, skip_special_tokens=False), c.token_ids)
                for c in choices])
        if call.chat is not None and (chats := self.chats.get(key)) is not None:
            chats.learn(*call.chat, prompt_ids, [(c.message, c.token_ids) for c in choices if c.message is not None])

    def going(self, key: str) -> bool:
        """Whether the rollout `key` still waits for its calls (a call is carried on only then)."""
        return not self.require_open or key in self.sampling

    async def _post(self, path: str, raw: bytes, key: str, asked_logprobs: Any) -> bytes:
        """The servers' answer to the call `raw` on `key`'s server, in the embedded server's shape."""
        data = await self.pool.post(path, lambda _: raw, key=key, abortable=False)
        if self.sglang:
            data = msgspec.json.encode(sglang_wire.normalised(msgspec.json.decode(data), asked_logprobs))
        return data

    async def _resumed(self, key: str, path: str, body: dict, data: bytes) -> tuple[bytes, Answer]:
        """The answer `data` to `body` with each cut choice carried on to its end (resume.py)."""
        whole = msgspec.json.decode(data)
        prompt = whole["prompt_token_ids"]
        for index, choice in enumerate(whole["choices"]):
            async def ask(so_far: Piece, left: int | None, index: int = index) -> Piece:
                rest = resume.continuation(body, prompt, index, so_far.token_ids, left)
                more = await self._post("/v1/completions", msgspec.json.encode(sglang_wire.ask(rest) if self.sglang
                                                                               else rest), key, None)
                return resume.piece(msgspec.json.decode(more)["choices"][0])

            got, resumes = await carry_on(resume.piece(choice), resume.budget(body), ask, limit=resume.MAX_RESUMES,
                                          going=lambda: self.going(key))
            if got.finish == choice["finish_reason"] and not resumes:
                continue  # not cut, or cut and left so (the rollout ended)
            whole["choices"][index] = {**self.rederived(body, path.endswith("chat/completions"), index,
                                                        resume.stitched(choice, got), whole["model"]),
                                       "resumes": resumes}
            self.recorders.setdefault(key, Recorder()).resumes += resumes
        if isinstance(whole.get("usage"), dict):
            completion = sum(len(c["token_ids"]) for c in whole["choices"])
            whole["usage"].update(completion_tokens=completion, total_tokens=len(prompt) + completion)
        return msgspec.json.encode(whole), msgspec.convert(whole, type=Answer)

    def rederived(self, body: dict, chat: bool, index: int, stitched: dict, model: str) -> dict:
        """A choice carried on, derived again from all its tokens as the servers would answer it
        (resume.py): with the policy's tokenizer, its calls read by the servers' parser."""
        return resume.rederived(body, chat, index, stitched, model, self.tokenizer, self.tool_call_parser)

    def _encode(self, text: str) -> list[int]:
        return self.tokenizer.encode(text, add_special_tokens=False)

    async def _models(self, request: Request) -> JSONResponse:
        return JSONResponse(await self.pool.servers[0].client.get("/v1/models"))


def _refused(exc: GenerationError) -> JSONResponse:
    """The server's refusal of a call, as it gave it."""
    return JSONResponse(exc.body if isinstance(exc.body, dict) else {"error": {"message": str(exc.body)}}, exc.status)


def _error(status: int, message: str, param: str | None = None) -> JSONResponse:
    return JSONResponse({"error": {"message": message, "type": "invalid_request_error", "param": param,
                                   "code": None}}, status)
