"""An asyncio client for SGLang's native HTTP API: the embedded server or real SGLang alike.

A small HTTP/1.1 client on `asyncio.open_connection` (no aiohttp): JSON bodies with
Content-Length, a pool of keep-alive connections bounded by `max_connections`, one retry on a
fresh connection when a pooled one turns out to have been closed by the server while idle.
Imports neither torch nor the engine, so rollout workers stay light.
"""

from __future__ import annotations

import asyncio
import json
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from typing import Any
from urllib.parse import urlsplit

_Connection = tuple[asyncio.StreamReader, asyncio.StreamWriter]


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


class _StaleConnection(ConnectionError):
    """The connection failed before any byte of the answer arrived."""


class GenerationClient:
    """Talks to one generation server at `base_url` (for example http://127.0.0.1:30000)."""

    def __init__(self, base_url: str, *, max_connections: int = 64, timeout: float = 600) -> None:
        parts = urlsplit(base_url)
        if parts.scheme != "http" or not parts.hostname:
            raise ValueError(f"base_url must look like http://host:port, got {base_url!r}")
        self.base_url = base_url.rstrip("/")
        self.timeout = timeout
        self._host = parts.hostname
        self._port = parts.port or 80
        self._host_header = parts.netloc
        self._prefix = parts.path.rstrip("/")
        self._slots = asyncio.Semaphore(max_connections)
        self._idle: list[_Connection] = []
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
        payload: dict[str, Any] = {
            "input_ids": list(input_ids),
            "sampling_params": dict(sampling_params or {}),
            "return_logprob": return_logprob,
            "stream": False,
        }
        if rid is not None:
            payload["rid"] = rid
        return await self._call("POST", "/generate", payload)

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
        self, model_path: str, weight_version: int | str | None = None, *, abort_all_requests: bool = False
    ) -> dict:
        """Load new weights from an HF directory; raises GenerationError (400) when that fails."""
        payload: dict[str, Any] = {"model_path": model_path, "abort_all_requests": abort_all_requests}
        if weight_version is not None:
            payload["weight_version"] = str(weight_version)  # SGLang declares it a string
        return await self._call("POST", "/update_weights_from_disk", payload)

    async def health(self) -> bool:
        try:
            status, _, _ = await self._request("GET", "/health", None)
        except (OSError, asyncio.TimeoutError):
            return False
        return status == 200

    async def get_server_info(self) -> dict:
        try:
            return await self._call("GET", "/server_info", None)
        except GenerationError as exc:
            if exc.status != 404:
                raise
            return await self._call("GET", "/get_server_info", None)  # SGLang before 0.5.10

    async def close(self) -> None:
        self._closed = True
        idle, self._idle = self._idle, []
        for _, writer in idle:
            writer.close()
        for _, writer in idle:
            try:
                await writer.wait_closed()
            except OSError:
                pass

    # ---- HTTP/1.1 -----------------------------------------------------------------------------

    async def _call(self, method: str, path: str, payload: Any) -> Any:
        status, headers, data = await self._request(method, path, payload)
        body: Any = data.decode("utf-8", errors="replace")
        if "json" in headers.get("content-type", "") and data:
            body = json.loads(data)
        if not 200 <= status < 300:
            raise GenerationError(status, body, self.base_url + path)
        return body

    async def _request(self, method: str, path: str, payload: Any) -> tuple[int, dict[str, str], bytes]:
        if self._closed:
            raise RuntimeError("GenerationClient is closed")
        body = b"" if payload is None else json.dumps(payload, separators=(",", ":")).encode()
        async with self._slots:
            return await asyncio.wait_for(self._exchange(method, path, body), self.timeout)

    async def _exchange(self, method: str, path: str, body: bytes) -> tuple[int, dict[str, str], bytes]:
        for attempt in range(2):
            reused = bool(self._idle)
            connection = self._idle.pop() if reused else await asyncio.open_connection(self._host, self._port)
            try:
                status, headers, data, keep_alive = await self._roundtrip(connection, method, path, body)
            except _StaleConnection:
                connection[1].close()
                # The server closed this pooled connection while it sat idle, so the request never
                # reached it: safe to send again, once, on a fresh connection.
                if reused and attempt == 0:
                    continue
                raise
            except BaseException:  # also cancellation/timeouts: the stream is out of step now
                connection[1].close()
                raise
            if keep_alive and not self._closed:
                self._idle.append(connection)
            else:
                connection[1].close()
            return status, headers, data
        raise AssertionError("unreachable")

    async def _roundtrip(
        self, connection: _Connection, method: str, path: str, body: bytes
    ) -> tuple[int, dict[str, str], bytes, bool]:
        reader, writer = connection
        head = (
            f"{method} {self._prefix}{path} HTTP/1.1\r\nHost: {self._host_header}\r\n"
            f"Content-Type: application/json\r\nAccept: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
        )
        try:
            writer.write(head.encode("latin-1") + body)
            await writer.drain()
            status_line = await reader.readline()
        except ConnectionError as exc:
            raise _StaleConnection(str(exc)) from exc
        if not status_line:
            raise _StaleConnection("connection closed before the response")
        version, status, *_ = status_line.decode("latin-1").split(" ", 2)
        headers: dict[str, str] = {}
        while (line := await reader.readline()) not in (b"\r\n", b"\n", b""):
            name, _, value = line.decode("latin-1").partition(":")
            headers[name.strip().lower()] = value.strip()
        keep_alive = headers.get("connection", "").lower() != "close" and version == "HTTP/1.1"
        if "chunked" in headers.get("transfer-encoding", "").lower():
            data = await _read_chunked(reader)
        elif "content-length" in headers:
            data = await reader.readexactly(int(headers["content-length"]))
        elif int(status) in (204, 304):
            data = b""
        else:  # no framing: the body runs to the end of the connection
            data, keep_alive = await reader.read(), False
        return int(status), headers, data, keep_alive


async def _read_chunked(reader: asyncio.StreamReader) -> bytes:
    chunks = []
    while size := int((await reader.readline()).split(b";")[0].strip() or b"0", 16):
        chunks.append(await reader.readexactly(size))
        await reader.readline()  # the CRLF after each chunk
    while (await reader.readline()) not in (b"\r\n", b"\n", b""):  # trailers
        pass
    return b"".join(chunks)


def wait_healthy(base_url: str, timeout: float = 60.0) -> None:
    """Block until GET {base_url}/health answers 200; TimeoutError naming the URL otherwise."""
    url = base_url.rstrip("/") + "/health"
    deadline = time.monotonic() + timeout
    last_error = "no answer yet"
    while True:
        try:
            with urllib.request.urlopen(url, timeout=max(deadline - time.monotonic(), 0.1)) as answer:
                if answer.status == 200:
                    return
                last_error = f"status {answer.status}"
        except urllib.error.HTTPError as exc:
            last_error = f"status {exc.code}"
        except (OSError, ValueError) as exc:
            last_error = repr(exc)
        if time.monotonic() >= deadline:
            raise TimeoutError(f"generation server at {base_url} not healthy after {timeout:.0f} s ({last_error})")
        time.sleep(0.1)  # a server still starting has no way to tell us when it is up
