"""What a route is given: the call (its body and how to tell the client left) and what the server
serves (`Served`: the engine, the tokenizer, and the state the routes keep between calls). Routes
see neither FastAPI nor the server's plumbing (app.py, server.py)."""

from __future__ import annotations

import threading
from collections.abc import Awaitable, Callable, Mapping
from concurrent.futures import Executor
from dataclasses import dataclass, field
from typing import Any

from starlette.responses import Response

from areal_flow.generation.engine.generation_engine import GenerationEngine
from areal_flow.generation.http.bodies import MAX_REQUEST_BYTES
from areal_flow.generation.http.load_report import LoadReport
from areal_flow.generation.http.weight_groups import WeightGroup

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


@dataclass(eq=False)
class Served:
    """What a server's routes answer from."""

    engine: GenerationEngine
    tokenizer: Any
    """The model directory's tokenizer (text prompts, stop strings, answers' text); None: ids only."""
    tokenizer_path: str
    parser: Executor
    """Where large bodies are parsed and tokenized, off the event loop (bodies.py)."""
    max_request_bytes: int = MAX_REQUEST_BYTES
    """Larger bodies are refused (413) before they are read."""
    address: tuple[str, int] = ("", 0)
    """The address the server listens on (set once its socket is bound)."""
    started: int = 0
    """time.time() at the start: /v1/models' `created`."""
    tool_call_parser: str = "hermes"
    """How chat answers' tool calls are read (generation/tool_parsers.py; `auto` resolved at start)."""
    load_report: LoadReport = field(init=False)
    weight_groups: dict[str, WeightGroup] = field(default_factory=dict)
    """The weights groups joined, by name (weight_routes.py)."""
    weight_groups_lock: threading.Lock = field(default_factory=threading.Lock)

    def __post_init__(self) -> None:
        self.load_report = LoadReport(self.engine)


Route = Callable[[Served, Call], Awaitable[tuple[int, Payload] | Response]]
"""A route: the call in, a status and payload (or a whole Response: a stream, /metrics) out."""
