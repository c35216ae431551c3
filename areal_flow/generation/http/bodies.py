"""Request bodies before a route reads them: refused by their size before they are read (413),
decoded as JSON with a 400 for every way that fails (nesting too deep included), and parsed on a
thread of their own when they are large, so that tokenizing one does not hold up the event loop,
which answers every other request and /health.

Bodies up to INLINE_BYTES are parsed on the event loop (a thread hop would cost more than they
do); larger ones on the server's PARSE_THREADS parser threads (Hugging Face tokenizers release
the GIL while they encode). Those threads are the parser's alone, so huge bodies queue behind each
other, never ahead of a small request, nor of the routes' other work (pausing, aborting,
loading weights) on asyncio's default executor.
"""

from __future__ import annotations

import asyncio
import json
import sys
from collections.abc import Callable
from concurrent.futures import Executor
from typing import Any, TypeVar

from starlette.requests import Request

from areal_flow.generation.http.errors import HTTPError, bad_request

MAX_REQUEST_BYTES = 16 << 20
"""The default limit on a request body (generation.max_request_bytes): a conversation filling a
128k-token context is under 1 MiB of JSON, a /generate batch of 64 prompts of 16k token ids about
8 MiB. A larger body is refused (413) before it is read."""

LIMIT_KEY = "generation.max_request_bytes, --max-request-bytes"
"""Where the limit is set, as a 413 names it."""

INLINE_BYTES = 16 << 10
"""Bodies up to this size are parsed on the event loop (a rollout's /generate of a 2k-token prompt:
under a millisecond), larger ones on a parser thread (16 KB of text takes 16 ms to tokenize here)."""

PARSE_THREADS = 2
"""Parser threads of a server (tokenizing a large prompt takes seconds: 3 MB of text, 3 s)."""

T = TypeVar("T")


class BodyError(ValueError):
    """A body that is not the JSON a route reads; its message says why."""


async def read_body(request: Request, limit: int) -> bytes:
    """The request's body, or a 413 naming the limit and where it is set, as soon as the body is
    known to be larger: at once when its Content-Length says so, else once that much has come."""
    length = request.headers.get("content-length")  # uvicorn has already refused one that is not a number
    if length is not None and int(length) > limit:
        raise HTTPError(413, f"request body of {length} bytes is over the server's limit of {limit} bytes "
                             f"({LIMIT_KEY})")
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:  # a chunked body announces no length
            raise HTTPError(413, f"request body is over the server's limit of {limit} bytes ({LIMIT_KEY})")
    return bytes(body)


def too_deep() -> str:
    return ("request body is nested too deeply to be read: its arrays and objects nest hundreds of levels deep "
            f"(JSON is read to about {sys.getrecursionlimit()} levels, a tool's schema for the chat template to "
            "about half that)")


def decode_json(raw: bytes) -> Any:
    """The JSON value of a body (None for an empty one); BodyError when it is not JSON, and when
    it nests deeper than the parser recurses (json.loads raises RecursionError)."""
    if not raw.strip():
        return None
    try:
        return json.loads(raw)
    except (json.JSONDecodeError, UnicodeDecodeError) as exc:
        raise BodyError(f"request body is not valid JSON: {exc}") from None
    except RecursionError:
        raise BodyError(too_deep()) from None


def as_object(body: Any) -> dict:
    """A decoded body that must be a JSON object (an empty body: {}), or a 400 (SGLang's envelope)."""
    if body is None:
        return {}
    if not isinstance(body, dict):
        raise bad_request("request body must be a JSON object")
    return body


def json_object(raw: bytes) -> dict:
    """A body that must be a JSON object (empty: {}), or a 400 (SGLang's envelope) saying why."""
    try:
        return as_object(decode_json(raw))
    except BodyError as exc:
        raise bad_request(str(exc)) from None


async def parse(executor: Executor, raw: bytes, read: Callable[[Any], T],
                error: Callable[[str], HTTPError] = bad_request) -> T:
    """`read` of the decoded body (which checks it and may tokenize it): on the event loop when
    the body is small, on a parser thread of `executor` when it is large. A body that is not JSON
    is answered `error(why)`, and so is one nested too deeply, for the parser or for what reads it
    (rendering a chat template copies a tool's schema recursively: RecursionError at about 500 levels)."""

    def run() -> T:
        try:
            return read(decode_json(raw))
        except BodyError as exc:
            raise error(str(exc)) from None
        except RecursionError:
            raise error(too_deep()) from None

    if len(raw) <= INLINE_BYTES:
        return run()
    return await asyncio.get_running_loop().run_in_executor(executor, run)
