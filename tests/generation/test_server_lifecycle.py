"""Starting and stopping: the CLI as a subprocess (SIGTERM → exit 0), and in-process stop()."""

from __future__ import annotations

import asyncio
import http.client
import signal
import threading
import time

import pytest
from generation_helpers import ModelDirs, http_call, server_process, wait_until

from areal_flow.generation.client.generation_client import GenerationClient, wait_healthy
from areal_flow.generation.engine.generation_engine import EngineShutdownError
from areal_flow.generation.http.server import serve



@pytest.mark.slow  # processes of its own: the full suite runs it, the fast tier does not
def test_cli_serves_and_exits_cleanly_on_sigterm(model_dirs: ModelDirs):
    with server_process(model_dirs.a, "--host", "127.0.0.1", "--max-batch-size", "8", "--num-threads", "1",
                        "--weight-version", "4") as (proc, url, _):

        async def ask() -> dict:
            async with GenerationClient(url) as client:
                return await client.generate([2, 3, 4], {"max_new_tokens": 5, "ignore_eos": True})

        answer = asyncio.run(ask())
        assert len(answer["output_ids"]) == 5
        # --weight-version labels the initial weights; digits also set the token version.
        assert answer["meta_info"]["weight_version"] == "4" and answer["meta_info"]["output_token_versions"] == [4] * 5
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_stop_answers_unfinished_requests_closes_connections_and_ends_threads(model_dirs: ModelDirs):
    before = set(threading.enumerate())
    server, thread = serve(model_dirs.a, max_batch_size=1)
    # Queue work ahead of the HTTP request, so that it is surely unfinished when stop() comes.
    ahead = [server.engine.submit([2], max_new_tokens=250, ignore_eos=True) for _ in range(20)]
    # An idle keep-alive connection, which stop() must close.
    idle = http.client.HTTPConnection("127.0.0.1", server.server_address[1], timeout=30)
    idle.request("GET", "/health")
    assert idle.getresponse().read() == b""
    statuses: list[int] = []
    slow = threading.Thread(target=lambda: statuses.append(http_call(
        server.url, "POST", "/generate",
        {"input_ids": [2, 3], "sampling_params": {"max_new_tokens": 250, "ignore_eos": True}})[0]))
    slow.start()
    wait_until(lambda: server.engine.stats()["num_waiting_reqs"] >= 20, "the HTTP request to queue")

    server.stop()
    thread.join(timeout=10)
    slow.join(timeout=10)
    assert not thread.is_alive() and not slow.is_alive()
    assert statuses == [503]  # answered, not left hanging
    assert all(isinstance(f.exception(timeout=5), EngineShutdownError) for f in ahead)
    deadline = time.monotonic() + 5
    while set(threading.enumerate()) - before and time.monotonic() < deadline:
        time.sleep(0.01)
    assert not set(threading.enumerate()) - before, set(threading.enumerate()) - before
    assert idle.sock.recv(1) == b""  # the server closed the idle connection
    idle.close()


def test_wait_healthy_names_the_server_and_its_url_when_nothing_answers():
    import socket

    with socket.socket() as probe:  # a port with nothing listening
        probe.bind(("127.0.0.1", 0))
        url = f"http://127.0.0.1:{probe.getsockname()[1]}"
    with pytest.raises(TimeoutError, match=f"generation server at {url} not healthy after 0 s"):
        wait_healthy(url, timeout=0.2)
    # The controller's start-up wait names the process too (a judge's server, say).
    with pytest.raises(TimeoutError, match=f"generation server judge_server1 at {url} not healthy"):
        wait_healthy(url, timeout=0.2, name="judge_server1")


def test_client_reconnects_when_the_server_closed_its_pooled_connection(model_dirs: ModelDirs):
    """A server restart closes the connection the client keeps in its pool: the next call opens a new one."""
    server, thread = serve(model_dirs.a)
    port = server.server_address[1]
    sampling = {"max_new_tokens": 3, "temperature": 0, "ignore_eos": True}

    def restart_on_the_same_port():
        server.stop()  # closes the connection the client keeps in its pool
        thread.join(timeout=10)
        return serve(model_dirs.a, port=port)

    async def scenario() -> tuple[dict, dict, object]:
        async with GenerationClient(f"http://127.0.0.1:{port}", max_connections=1) as client:
            first = await client.generate([2, 3], sampling)
            restarted = await asyncio.to_thread(restart_on_the_same_port)
            return first, await client.generate([2, 3], sampling), restarted

    first, second, (server2, thread2) = asyncio.run(scenario())
    try:
        assert second["output_ids"] == first["output_ids"]
    finally:
        server2.stop()
        thread2.join(timeout=10)
