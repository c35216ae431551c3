"""A generation server: the HTTP app (app.py, routes.py) on uvicorn, as SGLang itself serves it,
in front of an embedded engine. One event loop on a background thread answers every connection
(HTTP/1.1 keep-alive), and a request waits for the engine's thread without holding a thread of
its own. Field names, response shapes and error envelopes follow SGLang's native API, so a client
written for SGLang works here unchanged; the areal_flow extension is
`meta_info.output_token_versions`, the integer weight version of each generated token. The
command line is cli.py's (`python -m areal_flow.generation.server`).
"""

from __future__ import annotations

import logging
import socket
import threading
import time
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import uvicorn

from areal_flow.generation import tool_parsers
from areal_flow.generation.engine.generation_engine import GenerationEngine
from areal_flow.generation.http import bodies
from areal_flow.generation.http.app import create_app
from areal_flow.generation.http.context import Served
from areal_flow.weights import adapter as adapter_files

logger = logging.getLogger(__name__)

BACKLOG = 256
"""Listen backlog: a rollout worker opens dozens of connections at once."""


KEEP_ALIVE_SECONDS = 600
"""An idle keep-alive connection is closed after this long (uvicorn's default is 5 s). The client
(aiohttp) drops idle connections after 15 s, so it is the one to end them: it never sends a request
on a connection the server is closing at that very moment."""


GRACEFUL_SHUTDOWN_SECONDS = 5
"""stop() lets requests in flight finish writing their answers for this long; then uvicorn cancels
them (answering 500) and closes their connections, so stop() returns even if a client stalls."""


class GenerationServer:
    """The app on uvicorn, on its own thread and event loop; `stop()` ends it and the engine.
    With an `api_key`, requests need it as a bearer token (ApiKeyGuard). `tool_call_parser`: the
    format of the model's tool calls (generation/tool_parsers.py; auto: the chat template's)."""

    def __init__(self, address: tuple[str, int], engine: GenerationEngine, tokenizer: Any, tokenizer_path: str,
                 api_key: str | None = None, max_request_bytes: int = bodies.MAX_REQUEST_BYTES,
                 tool_call_parser: str = "auto"):
        if max_request_bytes < 1:
            raise ValueError(f"max_request_bytes must be at least 1, got {max_request_bytes}")
        # Resolved once: the template does not change while the server runs.
        parser_name = tool_parsers.resolve(tool_call_parser, getattr(tokenizer, "chat_template", None),
                                           key="tool_call_parser")
        # Large bodies are parsed and tokenized on the parser's threads, off the event loop (bodies.py).
        parser = ThreadPoolExecutor(bodies.PARSE_THREADS, thread_name_prefix="generation-parse")
        self.served = Served(engine, tokenizer, tokenizer_path, parser, max_request_bytes, started=int(time.time()),
                             tool_call_parser=parser_name)
        self.engine, self.tokenizer, self.tokenizer_path = engine, tokenizer, tokenizer_path
        config = uvicorn.Config(
            create_app(self.served, api_key),
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
        self.served.address = self.server_address
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
        self.served.parser.shutdown(wait=False, cancel_futures=True)  # a body still tokenizing answers no one


def optional_tokenizer(model_path: str) -> Any:
    """The model directory's fast tokenizer, or None when it has no tokenizer.json."""
    if not (Path(model_path) / "tokenizer.json").is_file():
        return None
    from areal_flow.models.tokenizer import load_tokenizer

    return load_tokenizer(model_path)


def serve(
    model_path: str, host: str = "127.0.0.1", port: int = 0, *, api_key: str | None = None,
    max_request_bytes: int = bodies.MAX_REQUEST_BYTES, tool_call_parser: str = "auto", **engine_kw: Any
) -> tuple[GenerationServer, threading.Thread]:
    """Start an engine and its HTTP server on a background thread (port 0: a free port); with an
    `api_key`, requests need it as a bearer token; bodies over `max_request_bytes` are refused;
    chat answers' tool calls are read by `tool_call_parser` (generation/tool_parsers.py)."""
    tool_parsers.resolve(tool_call_parser, key="tool_call_parser")  # a bad name fails before the model loads
    tokenizer = optional_tokenizer(adapter_files.base_of(model_path))  # an adapter directory has none
    engine = GenerationEngine(model_path, tokenizer=tokenizer, **engine_kw)  # the tokenizer: for stop strings
    try:
        server = GenerationServer((host, port), engine, tokenizer, model_path, api_key, max_request_bytes,
                                  tool_call_parser)
    except BaseException:
        engine.shutdown()
        raise
    return server, server.start()
