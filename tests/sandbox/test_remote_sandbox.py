"""The remote backend against a real HTTP service that speaks SandboxFusion's /run_code (it stands
in for SandboxFusion, which runs in a container elsewhere: this one runs the test's own trusted
programs in a temporary directory, with a timeout)."""

import asyncio
import base64
import json
import os
import subprocess
import sys
import tempfile
import threading

import pytest
from aiohttp import web

from areal_flow.config.schema import SandboxConfig
from areal_flow.rewards.code import CodeReward, parse_tests, score_program
from areal_flow.sandbox.remote import RemoteSandbox

REQUESTS = web.AppKey("requests", list)


async def run_code(request: web.Request) -> web.Response:
    body = await request.json()
    request.app[REQUESTS].append(body)
    if body.get("language") != "python":
        return web.json_response({"status": "SandboxError", "message": "unsupported language"})

    def execute():
        with tempfile.TemporaryDirectory() as d:
            for name, content in body.get("files", {}).items():
                with open(os.path.join(d, name), "wb") as f:
                    f.write(base64.b64decode(content))
            try:
                p = subprocess.run([sys.executable, "-c", body["code"]], input=body.get("stdin", ""), cwd=d,
                                   capture_output=True, text=True, timeout=body.get("run_timeout", 10))
            except subprocess.TimeoutExpired:
                return {"status": "Failed", "run_result": {"status": "TimeLimitExceeded", "stdout": "", "stderr": ""}}
            return {"status": "Success" if p.returncode == 0 else "Failed",
                    "run_result": {"status": "Finished", "return_code": p.returncode, "stdout": p.stdout,
                                   "stderr": p.stderr, "execution_time": 0.01}}

    return web.json_response(await asyncio.to_thread(execute))


@pytest.fixture
def service():
    app = web.Application()
    app[REQUESTS] = []
    app.router.add_post("/run_code", run_code)
    loop = asyncio.new_event_loop()
    runner = web.AppRunner(app)
    loop.run_until_complete(runner.setup())
    site = web.TCPSite(runner, "127.0.0.1", 0)
    loop.run_until_complete(site.start())
    port = site._server.sockets[0].getsockname()[1]
    thread = threading.Thread(target=loop.run_forever, daemon=True)
    thread.start()
    yield f"http://127.0.0.1:{port}", app[REQUESTS]
    asyncio.run_coroutine_threadsafe(runner.cleanup(), loop).result(10)
    loop.call_soon_threadsafe(loop.stop)
    thread.join(10)


def test_stdio_and_function_call_tests_score_as_locally(service):
    url, requests = service
    box = RemoteSandbox(SandboxConfig(backend="remote", url=url + "/", wall_seconds=2.0))
    stdio = parse_tests({"inputs": ["2", "3"], "outputs": ["4", "9"]})
    assert score_program(box, "print(int(input()) ** 2)", stdio)["reward"] == 1.0
    wrong = score_program(box, "print(int(input()) * 3)", stdio)
    assert [t.status for t in wrong["tests"]] == ["wrong_answer", "passed"]
    calls = parse_tests({"inputs": ["[1, 2]\n3"], "outputs": ["[3, 6]"], "fn_name": "scale"})
    program = "class Solution:\n    def scale(self, xs, k):\n        return [x * k for x in xs]\n"
    assert score_program(box, program, calls)["reward"] == 1.0
    sent = requests[-1]  # the calls go as stdin, with the program as a file; what they must return stays here
    assert [json.loads(line)[:2] for line in sent["stdin"].splitlines()] == [[0, "scale"]]
    assert "[3, 6]" not in sent["stdin"] and "6" not in sent["stdin"]
    assert base64.b64decode(sent["files"]["solution.py"]).decode() == program
    assert sent["run_timeout"] == 2.0 * 2 and sent["memory_limit_MB"] == 1024
    lying = "class A:\n    def __eq__(self, other):\n        return True\ndef scale(xs, k):\n    return A()\n"
    got = score_program(box, lying, calls)
    assert got["reward"] == 0.0 and got["tests"][0].status == "not_plain" and got["suspect"]


def test_assert_style_tests_need_the_local_sandbox(service):
    """Their source holds what they expect: it must not run where the program runs."""
    url, requests = service
    box = RemoteSandbox(SandboxConfig(backend="remote", url=url, wall_seconds=2.0, fail_fast=False))
    asserts = parse_tests({"asserts": ["assert f(1) == 2", "assert f(2) == 5"]})
    n_sent = len(requests)
    got = score_program(box, "def f(x):\n    return 2 * x\n", asserts)
    assert [t.status for t in got["tests"]] == ["sandbox_error"] * 2 and got["reward"] == 0.0
    assert "sandbox.backend=local" in got["tests"][0].stderr and len(requests) == n_sent


def test_timeouts_errors_and_a_sandbox_error_map_onto_the_local_statuses(service):
    url, _ = service
    box = RemoteSandbox(SandboxConfig(backend="remote", url=url, wall_seconds=1.0))
    assert box.run("import time; time.sleep(5)", [""])[0].status == "timeout"
    assert box.run("raise SystemExit(2)", [""])[0].status == "runtime_error"
    assert box.run("x = 1", [""])[0].status == "ok"


def test_a_service_that_is_down_scores_zero_as_a_sandbox_error(unused_port):
    reward = CodeReward(SandboxConfig(backend="remote", url=f"http://127.0.0.1:{unused_port}", wall_seconds=1.0))
    out = reward("```python\nprint(1)\n```", json.dumps({"inputs": [""], "outputs": ["1"]}))
    assert out["reward"] == 0.0 and out["tests_sandbox_error"] == 1.0


def test_remote_needs_a_url():
    with pytest.raises(ValueError, match="sandbox.backend=remote needs sandbox.url"):
        RemoteSandbox(SandboxConfig(backend="remote"))


@pytest.fixture
def unused_port():
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]
