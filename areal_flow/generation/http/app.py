"""The HTTP plumbing of a generation server: the FastAPI app that reads each request's body (its
size limit: bodies.py), hands it to its route (routes.ROUTES) and turns what the route returns or
raises into an answer in SGLang's envelope (OpenAI's on /v1/ routes); unknown paths and methods
in that envelope too; and SGLang's --api-key guard in front of it all.

With an API key (`--api-key`, as SGLang's, or the AREAL_FLOW_API_KEY environment variable) every
request but /health* and /metrics needs `Authorization: Bearer <key>`, else it is answered 401 as
SGLang answers it (ApiKeyGuard).
"""

from __future__ import annotations

import hmac
import json
import logging
import time
from collections.abc import Awaitable, Callable

from fastapi import FastAPI, Request, Response
from starlette.datastructures import Headers
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.types import ASGIApp, Receive, Scope, Send

from areal_flow.generation.engine.generation_engine import EngineShutdownError
from areal_flow.generation.http import bodies, openai_api
from areal_flow.generation.http.context import Call, Payload, Route, Served
from areal_flow.generation.http.errors import HTTPError
from areal_flow.generation.http.routes import ROUTES

logger = logging.getLogger(__name__)


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


def _endpoint(server: Served, path: str, route: Route) -> Callable[[Request], Awaitable[Response]]:
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


def create_app(server: Served, api_key: str | None = None) -> FastAPI:
    """The routes of ROUTES and nothing else: no docs pages, no redirects of trailing slashes;
    behind ApiKeyGuard when there is an `api_key`."""
    app = FastAPI(docs_url=None, redoc_url=None, openapi_url=None, redirect_slashes=False,
                  exception_handlers={StarletteHTTPException: _routing_error})
    for path, (methods, route) in ROUTES.items():
        app.add_api_route(path, _endpoint(server, path, route), methods=sorted(methods), include_in_schema=False)
    if api_key is not None:
        app.add_middleware(ApiKeyGuard, api_key=api_key)
    return app
