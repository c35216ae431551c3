"""What the HTTP stack (FastAPI/uvicorn server, aiohttp client) must keep doing, on real sockets."""

from __future__ import annotations

import asyncio
import http.client
import json
import socket
import subprocess
import sys
import textwrap
import threading
import time
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest
from generation_helpers import ModelDirs, http_call, wait_until

from areal_flow.generation.client.generation_client import GenerationClient, GenerationError
from areal_flow.generation.http.bodies import MAX_REQUEST_BYTES as MAX_BODY_BYTES
from areal_flow.generation.http.server import serve

REPO = Path(__file__).resolve().parents[2]
SHORT = {"input_ids": [2, 3], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}


def raw_exchange(port: int, request: bytes) -> bytes:
    """Send raw bytes and read the answer until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=30) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


def test_port_0_reports_the_port_really_bound(server_a):
    host, port = server_a.server_address
    assert port != 0 and server_a.url == f"http://{host}:{port}" == f"http://127.0.0.1:{port}"
    status, _, info = http_call(server_a.url, "GET", "/server_info")
    assert status == 200 and (info["host"], info["port"]) == (host, port)


def test_unknown_path_and_wrong_method_answer_in_the_sglang_envelope(server_a):
    for method, path in (("GET", "/nope"), ("POST", "/health/"), ("GET", "/docs")):
        status, headers, payload = http_call(server_a.url, method, path)
        assert status == 404 and headers["content-type"] == "application/json"
        assert payload == {"error": {"message": f"no route {method} {path}"}}
    status, headers, payload = http_call(server_a.url, "DELETE", "/generate")
    assert status == 405 and headers["content-type"] == "application/json"
    assert payload == {"error": {"message": "/generate takes POST, PUT, not DELETE"}}
    assert sorted(method.strip() for method in headers["allow"].split(",")) == ["POST", "PUT"]


def test_one_keep_alive_connection_serves_many_requests(server_a):
    connection = http.client.HTTPConnection("127.0.0.1", server_a.server_address[1], timeout=30)
    try:
        connection.request("GET", "/health")
        assert connection.getresponse().read() == b""
        sock = connection.sock
        for body in (SHORT, {"input_ids": []}, SHORT):  # an error answer keeps the connection too
            connection.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
            connection.getresponse().read()
        connection.request("GET", "/flush_cache")
        assert connection.getresponse().read() == b"Cache flushed.\n"
        assert connection.sock is sock  # http.client reconnects silently: the same socket proves reuse
    finally:
        connection.close()


def test_answers_on_a_kept_alive_connection_are_not_held_back_by_nagle(server_a):
    """An answer goes out as two writes (headers, body). With Nagle's algorithm on the server's
    connection, the body waits for the client's delayed ACK of the headers: at least 40 ms on
    Linux, on every request after the first of a kept-alive connection (every call of a client's
    pool). The bound below is 10x what an answer takes here, and 2x under that floor."""
    connection = http.client.HTTPConnection("127.0.0.1", server_a.server_address[1], timeout=30)
    try:
        seconds = []
        for _ in range(7):
            t0 = time.perf_counter()
            connection.request("GET", "/get_weight_version")
            assert json.loads(connection.getresponse().read())["weight_version"]
            seconds.append(time.perf_counter() - t0)
    finally:
        connection.close()
    assert sorted(seconds[1:])[3] < 0.02, seconds  # the median of the kept-alive ones


def test_a_chunked_body_is_read(server_a):
    def chunks():
        yield json.dumps(SHORT)[:10].encode()
        yield json.dumps(SHORT)[10:].encode()

    connection = http.client.HTTPConnection("127.0.0.1", server_a.server_address[1], timeout=30)
    try:
        connection.request("POST", "/generate", chunks(), {"Content-Type": "application/json"}, encode_chunked=True)
        answer = connection.getresponse()
        assert answer.status == 200 and len(json.loads(answer.read())["output_ids"]) == 2
    finally:
        connection.close()


def test_a_body_over_the_limit_gets_413_and_the_connection_is_closed(server_a):
    port = server_a.server_address[1]
    # Announced by Content-Length: refused before a byte of it is read.
    head = f"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Length: {MAX_BODY_BYTES + 1}\r\n\r\n".encode()
    answer = raw_exchange(port, head)
    assert answer.startswith(b"HTTP/1.1 413 ") and b"connection: close" in answer.lower()
    assert json.loads(answer.split(b"\r\n\r\n", 1)[1])["error"]["message"].startswith(
        f"request body of {MAX_BODY_BYTES + 1} bytes")

    # Chunked, so no length is announced: refused once the limit is passed. Exactly one byte over,
    # so that the server has read all that was sent when it closes (unread data would reset the
    # connection, and the answer could be lost).
    chunk = b"x" * (1 << 20)
    body = (f"{len(chunk):x}\r\n".encode() + chunk + b"\r\n") * (MAX_BODY_BYTES // len(chunk)) + b"1\r\nx\r\n"
    answer = raw_exchange(port, b"POST /generate HTTP/1.1\r\nHost: x\r\nTransfer-Encoding: chunked\r\n\r\n" + body)
    assert answer.startswith(b"HTTP/1.1 413 ") and b"over the" in answer
    assert http_call(server_a.url, "POST", "/generate", SHORT)[0] == 200


def test_stop_while_a_request_decodes_answers_it_503_promptly(model_dirs: ModelDirs):
    server, thread = serve(model_dirs.a)
    answers: list[tuple[int, dict]] = []
    body = {"input_ids": [2, 3], "sampling_params": {"max_new_tokens": 250, "ignore_eos": True}}
    asking = threading.Thread(target=lambda: answers.append(http_call(server.url, "POST", "/generate", body)[::2]))
    asking.start()
    wait_until(lambda: server.engine.stats()["num_running_reqs"] > 0, "the request to decode")
    started = time.monotonic()
    server.stop()
    stopped = time.monotonic() - started
    asking.join(timeout=10)
    thread.join(timeout=10)
    assert not asking.is_alive() and not thread.is_alive()
    (status, payload), = answers
    assert status == 503 and "shut down" in payload["error"]["message"]
    assert stopped < 3, stopped  # not the 250 tokens, nor uvicorn's graceful-shutdown limit
    server.stop()  # idempotent


def test_client_made_outside_a_loop_reports_dead_and_silent_servers_unhealthy():
    with socket.socket() as probe:  # a port with nothing listening
        probe.bind(("127.0.0.1", 0))
        dead = GenerationClient(f"http://127.0.0.1:{probe.getsockname()[1]}")
    with socket.create_server(("127.0.0.1", 0)) as silent:  # accepts connections, never answers
        mute = GenerationClient(f"http://127.0.0.1:{silent.getsockname()[1]}", timeout=0.3)

        async def scenario() -> tuple[bool, bool]:
            try:
                return await dead.health(), await mute.health()
            finally:
                await dead.close()
                await mute.close()

        assert asyncio.run(scenario()) == (False, False)


def test_client_error_carries_status_decoded_body_and_url(server_a):
    async def scenario() -> GenerationError:
        async with GenerationClient(server_a.url + "/") as client:
            try:
                await client.generate([], {})
            except GenerationError as exc:
                return exc
            raise AssertionError("an empty prompt was accepted")

    error = asyncio.run(scenario())
    assert error.status == 400 and error.url == server_a.url + "/generate"
    assert error.body == {"error": {"message": "input_ids cannot be empty."}}
    assert str(error) == f"{server_a.url}/generate answered 400: input_ids cannot be empty."


def test_the_client_module_imports_neither_torch_nor_the_engine():
    code = ("import sys, areal_flow.generation.client.generation_client; "
            "print(sorted(m for m in sys.modules if m == 'torch' or m.endswith('generation.engine')))")
    out = subprocess.run([sys.executable, "-c", code], cwd=REPO, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "[]"


def test_a_client_never_closed_is_closed_quietly_when_its_loop_ends(server_a):
    """A rollout worker never calls close(): it runs until SIGTERM raises SystemExit in its loop.
    Its idle pooled connection must not be reported as an unclosed session or connector."""
    code = textwrap.dedent("""
        import asyncio, sys
        from areal_flow.generation.client.generation_client import GenerationClient

        client = GenerationClient(sys.argv[1])

        async def main():
            assert await client.health()
            raise SystemExit(0)

        asyncio.run(main())
    """)
    out = subprocess.run([sys.executable, "-c", code, server_a.url], cwd=REPO, capture_output=True, text=True)
    assert (out.returncode, out.stderr) == (0, "")


class SlowServer(BaseHTTPRequestHandler):
    """Answers every POST with {} after DELAY seconds."""

    protocol_version = "HTTP/1.1"
    DELAY = 1.0

    def do_POST(self):
        self.rfile.read(int(self.headers["Content-Length"]))
        time.sleep(self.DELAY)
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", "2")
        self.end_headers()
        self.wfile.write(b"{}")

    def log_message(self, *args):
        pass


@pytest.mark.slow  # seconds of waiting on a timeout or a process: the full suite runs it
def test_client_timeout_counts_from_when_a_call_has_a_connection():
    """A call queued behind busy connections is not timed while it waits (rollout workers queue
    hundreds of calls behind their pool): each of these calls needs DELAY of its 1.6 * DELAY."""
    server = ThreadingHTTPServer(("127.0.0.1", 0), SlowServer)
    threading.Thread(target=server.serve_forever, daemon=True).start()

    async def scenario() -> list[dict]:
        url = f"http://127.0.0.1:{server.server_address[1]}"
        async with GenerationClient(url, max_connections=1, timeout=1.6 * SlowServer.DELAY) as client:
            return await asyncio.gather(client.generate([1]), client.generate([2]))

    try:
        started = time.monotonic()
        assert asyncio.run(scenario()) == [{}, {}]
        assert time.monotonic() - started >= 2 * SlowServer.DELAY  # one after the other
    finally:
        server.shutdown()
        server.server_close()
