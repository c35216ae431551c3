"""An asyncio client for SGLang's native HTTP API: the embedded server or real SGLang alike.

On aiohttp, as AReaL's own client for SGLang servers: one session per client, holding a pool of
keep-alive connections bounded by `max_connections`. Imports neither torch nor the engine, so
rollout workers stay light.
"""

from __future__ import annotations

import asyncio
import functools
import json
import time
import urllib.error
import urllib.request
from collections.abc import AsyncIterator, Sequence
from typing import Any
from urllib.parse import urlsplit

import aiohttp

from areal_flow.weights import adapter as adapter_files


class ClientClosed(aiohttp.ClientConnectionError):
    """The client was closed (its server left the run: `ServerPool.forget`). A call begun before
    that, an update's or a retry's, meets it as a server that cannot be reached."""


class GenerationError(RuntimeError):
    """The server answered with an error status; `status` and the decoded `body` say what."""

    def __init__(self, status: int, body: Any, url: str) -> None:
        message = body
        if isinstance(body, dict):
            error = body.get("error")
            message = error.get("message", error) if isinstance(error, dict) else error or body.get("message", body)
        super().__init__(f"{url} answered {status}: {message}")
        self.status = status
        self.body = body
        self.url = url


class GenerationClient:
    """Talks to one generation server at `base_url` (for example http://127.0.0.1:30000); every
    request carries `Authorization: Bearer <api_key>` when an `api_key` is given (SGLang's
    --api-key; a secured run's servers refuse requests without it)."""

    def __init__(self, base_url: str, *, max_connections: int = 64, timeout: float = 600,
                 api_key: str | None = None) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"base_url must look like http://host:port, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._max_connections = max_connections
        self._headers = auth_headers(api_key)
        # Calls wait here for a free connection, so that `timeout` counts from when a call has one:
        # aiohttp's own total timeout would also count the wait for the pool, and a rollout worker
        # queues hundreds of requests behind its connections.
        self._slots = asyncio.Semaphore(max_connections)
        self._session: aiohttp.ClientSession | None = None
        self._closer: asyncio.Task | None = None
        self._closed = False

    async def __aenter__(self) -> GenerationClient:
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # ---- the API ------------------------------------------------------------------------------

    async def generate(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any] | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> dict:
        """One prompt; returns SGLang's response object (text, output_ids, meta_info)."""
        return await self._call("POST", "/generate", one_prompt(input_ids, sampling_params, rid, return_logprob,
                                                                stream=False))

    async def post(self, path: str, payload: Any) -> Any:
        """POST a JSON body to `path` (an OpenAI endpoint, say); the answer decoded."""
        return await self._call("POST", path, payload)

    async def get(self, path: str) -> Any:
        return await self._call("GET", path, None)

    async def post_bytes(self, path: str, data: bytes) -> bytes:
        """POST a JSON body already encoded; the answer's body as it came (a proxy's way: nothing
        decoded and encoded again). A status other than 2xx raises GenerationError as `_call` does."""
        return (await self._send("POST", path, data=data, headers={"Content-Type": "application/json"}))[1]

    async def generate_stream(
        self,
        input_ids: Sequence[int],
        sampling_params: dict[str, Any] | None = None,
        *,
        rid: str | None = None,
        return_logprob: bool = True,
    ) -> AsyncIterator[dict]:
        """One prompt, streamed: yields SGLang's chunks (cumulative: each holds everything so far;
        the last one has a finish_reason). Leaving the loop early closes the connection, and the
        server aborts the request."""
        payload = one_prompt(input_ids, sampling_params, rid, return_logprob, stream=True)
        url = self.base_url + "/generate"
        async with self._slots, self._http().post(url, json=payload) as answer:
            async for body in _events(answer, url):
                chunk = json.loads(body)
                if "error" in chunk:  # an error after the stream began (the status is already 200)
                    raise GenerationError(answer.status, chunk, url)
                yield chunk

    async def post_stream(self, path: str, data: bytes) -> AsyncIterator[bytes]:
        """POST a JSON body already encoded that asks for a stream (an OpenAI call with `stream:
        true`); yields each server-sent event's data as it comes, as bytes (a proxy's way, as
        `post_bytes`), up to `[DONE]`. A status other than 200 raises GenerationError as `_call`
        does; so does, with status 502, an error event or a stream cut before `[DONE]` (the server
        failed after it began). Leaving the loop early closes the connection: the server aborts
        the request (routes.py)."""
        url = self.base_url + path
        headers = {"Content-Type": "application/json"}
        async with self._slots, self._http().post(url, data=data, headers=headers) as answer:
            async for body in _events(answer, url):
                if body.startswith(b'{"error"'):  # the server's error event: its JSON starts so
                    raise GenerationError(502, _decoded("json", body), url)
                yield body

    async def generate_batch(
        self,
        list_of_input_ids: Sequence[Sequence[int]],
        sampling_params: dict[str, Any] | None = None,
        *,
        return_logprob: bool = True,
    ) -> list[dict]:
        """Several prompts in one request (SGLang's batch form); answers in prompt order."""
        if not list_of_input_ids:
            return []
        payload = {
            "input_ids": [list(ids) for ids in list_of_input_ids],
            "sampling_params": dict(sampling_params or {}),
            "return_logprob": return_logprob,
            "stream": False,
        }
        answers = await self._call("POST", "/generate", payload)
        if not isinstance(answers, list) or len(answers) != len(list_of_input_ids):
            raise GenerationError(200, answers, f"{self.base_url}/generate (expected {len(list_of_input_ids)} answers)")
        return answers

    async def update_weights_from_disk(
        self, model_path: str, weight_version: int | str | None = None, *, abort_all_requests: bool = False,
        flush_cache: bool = True, adapter_digest: str | None = None,
    ) -> dict:
        """Load new weights from an HF directory (or a PEFT adapter directory, for LoRA updates);
        raises GenerationError (400) when that fails. `flush_cache=False` while requests are held
        in place (SGLang refuses to flush then). `adapter_digest`: the digest of the adapters sent
        (weights/adapter.py), which the server must report having merged; else GenerationError,
        naming the version: the adapter did not arrive as sent."""
        payload: dict[str, Any] = {"model_path": model_path, "abort_all_requests": abort_all_requests,
                                   "flush_cache": flush_cache}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)  # SGLang declares it a string
        answer = await self._call("POST", "/update_weights_from_disk", payload)
        if adapter_digest is not None and (problem := adapter_files.arrival_problem(answer, adapter_digest,
                                                                                    weight_version)):
            raise GenerationError(200, {"message": problem}, self.base_url)
        return answer

    async def pause_generation(self, mode: str = "abort") -> dict:
        """Hold new requests until continue_generation and stop the running ones: mode "abort"
        answers them with finish_reason abort and their tokens so far; "retract" (SGLang ≥ 0.5.10)
        queues them again, to go on after continue_generation in the same answer; "in_place" (SGLang
        ≥ 0.5.10) holds them with their KV cache, to go on where they stopped. Returns once done."""
        # An empty body for abort: SGLang before 0.5.10 takes no mode.
        return await self._call("POST", "/pause_generation", {} if mode == "abort" else {"mode": mode})

    async def continue_generation(self) -> dict:
        return await self._call("POST", "/continue_generation", {})

    async def release_memory_occupation(self) -> dict:
        """Free the server's KV cache for a trainer on the same devices; it stays paused (SGLang
        needs --enable-memory-saver)."""
        return await self._call("POST", "/release_memory_occupation", {"tags": ["kv_cache"]})

    async def resume_memory_occupation(self) -> dict:
        return await self._call("POST", "/resume_memory_occupation", {"tags": ["kv_cache"]})

    async def abort_request(self, rid: str | None = None, *, abort_all: bool = False) -> None:
        """Abort the request `rid`, or every request with abort_all; an unknown rid is no error."""
        if rid is None and not abort_all:
            raise ValueError("give a rid or abort_all=True")
        await self._call("POST", "/abort_request", {"rid": rid or "", "abort_all": abort_all})

    async def health(self) -> bool:
        try:
            async with self._slots, self._http().get(self.base_url + "/health") as answer:
                return answer.status == 200
        except (aiohttp.ClientError, asyncio.TimeoutError):
            return False

    async def get_weight_version(self) -> str:
        """The label of the weights the server serves (SGLang's /get_weight_version)."""
        return str((await self._call("GET", "/get_weight_version", None))["weight_version"])

    async def get_server_info(self) -> dict:
        try:
            return await self._call("GET", "/server_info", None)
        except GenerationError as exc:
            if exc.status != 404:
                raise
            return await self._call("GET", "/get_server_info", None)  # SGLang before 0.5.10

    async def close(self) -> None:
        self._closed = True
        if self._session is not None:
            self._closer.cancel()
            await self._session.close()

    # ---- HTTP ---------------------------------------------------------------------------------

    def _http(self) -> aiohttp.ClientSession:
        if self._closed:
            raise ClientClosed(f"the client of {self.base_url} is closed")
        if self._session is None:
            # Made on first use: aiohttp makes a session only inside a running event loop (which it
            # then belongs to), and a client may be constructed before any loop runs.
            self._session = aiohttp.ClientSession(
                connector=aiohttp.TCPConnector(limit=self._max_connections),
                timeout=aiohttp.ClientTimeout(total=self.timeout),
                headers=self._headers,
                # Compact: token-id lists are most of a request, and ", " costs a byte per id.
                json_serialize=functools.partial(json.dumps, separators=(",", ":")),
            )
            # Not every owner calls close(): a rollout worker runs until the launcher stops it. Left
            # open, the session would be reported at exit as an unclosed session and connector.
            self._closer = asyncio.create_task(_close_when_the_loop_ends(self._session))
        return self._session

    async def _call(self, method: str, path: str, payload: Any) -> Any:
        return _decoded(*await self._send(method, path, json=payload))

    async def _send(self, method: str, path: str, **request: Any) -> tuple[str, bytes]:
        """The answer's content type and body; GenerationError (the body decoded) unless a 2xx."""
        url = self.base_url + path
        async with self._slots, self._http().request(method, url, **request) as answer:
            status, content_type, data = answer.status, answer.content_type, await answer.read()
        if not 200 <= status < 300:
            raise GenerationError(status, _decoded(content_type, data), url)
        return content_type, data


def auth_headers(api_key: str | None) -> dict[str, str]:
    """The headers that carry `api_key` the way SGLang's --api-key wants it (none without a key)."""
    return {"Authorization": f"Bearer {api_key}"} if api_key is not None else {}


def _decoded(content_type: str, data: bytes) -> Any:
    """An answer's body: JSON decoded, anything else as text."""
    if "json" in content_type and data:
        return json.loads(data)
    return data.decode("utf-8", errors="replace")


async def _events(answer: aiohttp.ClientResponse, url: str) -> AsyncIterator[bytes]:
    """The data of each server-sent event of `answer` up to `[DONE]`; GenerationError for a status
    other than 200, or (502) for a stream that ends before `[DONE]`."""
    if answer.status != 200:
        raise GenerationError(answer.status, _decoded(answer.content_type, await answer.read()), url)
    # Events are split by hand: a cumulative chunk can outgrow aiohttp's line limit.
    pending = bytearray()
    async for data in answer.content.iter_any():
        pending += data
        *events, rest = pending.split(b"\n\n")
        pending = bytearray(rest)
        for event in filter(None, events):
            body = bytes(event.removeprefix(b"data: "))
            if body == b"[DONE]":
                return
            yield body
    raise GenerationError(502, "the stream ended without data: [DONE]", url)


def one_prompt(input_ids: Sequence[int], sampling_params: dict[str, Any] | None, rid: str | None,
                return_logprob: bool, *, stream: bool) -> dict[str, Any]:
    """The /generate body for one prompt."""
    payload: dict[str, Any] = {
        "input_ids": list(input_ids),
        "sampling_params": dict(sampling_params or {}),
        "return_logprob": return_logprob,
        "stream": stream,
    }
    if rid is not None:
        payload["rid"] = rid
    return payload


async def _close_when_the_loop_ends(session: aiohttp.ClientSession) -> None:
    """Wait until cancelled, then close `session`: asyncio.run() cancels every pending task as it ends."""
    try:
        await asyncio.get_running_loop().create_future()
    finally:
        await session.close()


def wait_healthy(base_url: str, timeout: float = 60.0, api_key: str | None = None, name: str | None = None) -> None:
    """Block until GET {base_url}/health answers 200; TimeoutError naming the server (`name`, its
    process) and the URL otherwise. `api_key`: sent as a bearer token (SGLang and the embedded
    server answer /health without one, a proxy in front of them may not)."""
    request = urllib.request.Request(base_url.rstrip("/") + "/health", headers=auth_headers(api_key))
    deadline = time.monotonic() + timeout
    last_error = "no answer yet"
    while True:
        try:
            with urllib.request.urlopen(request, timeout=max(deadline - time.monotonic(), 0.1)) as answer:
                if answer.status == 200:
                    return
                last_error = f"status {answer.status}"
        except urllib.error.HTTPError as exc:
            last_error = f"status {exc.code}"
        except (OSError, ValueError) as exc:
            last_error = repr(exc)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"generation server {name + ' ' if name else ''}at {base_url} not healthy after "
                               f"{timeout:.0f} s ({last_error})")
        time.sleep(0.1)  # a server still starting has no way to tell us when it is up


def describe_error(error: BaseException) -> str:
    """A request's failure in a few words, for a log line or an error naming the server."""
    if isinstance(error, asyncio.TimeoutError):
        return "no answer in time (rollout.request_timeout)"
    return str(error) or type(error).__name__
