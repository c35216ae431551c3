"""--api-key on the embedded server, started as a real subprocess: SGLang's rules (401 with
`{"error": "Unauthorized"}` unless `Authorization: Bearer <key>`; /health* and /metrics open), and
areal_flow's clients carrying the key."""

from __future__ import annotations

import asyncio
import secrets

import pytest
from generation_helpers import ModelDirs, http_call, server_process

from areal_flow.generation.client.generation_client import GenerationClient, GenerationError
from areal_flow.generation.client.router import ServerPool
from areal_flow.runtime.security import host_address

# A server process of its own: the full suite runs these, the fast tier does not.
pytestmark = pytest.mark.slow

GENERATE = {"input_ids": [2, 3, 4], "sampling_params": {"max_new_tokens": 2, "ignore_eos": True}}


@pytest.fixture(scope="module")
def guarded(model_dirs: ModelDirs):
    """(url, key, the server's log so far) of a server with an API key, on this host's address."""
    key = secrets.token_urlsafe(32)
    with server_process(model_dirs.a, "--host", host_address(), "--max-batch-size", "8", "--num-threads", "1",
                        "--api-key", key) as (_, url, log):
        yield url, key, log


@pytest.mark.parametrize("path", ["/generate", "/update_weights_from_disk"])
def test_a_request_without_the_key_is_refused_and_one_with_it_served(guarded, model_dirs, path):
    url, key, _ = guarded
    body = GENERATE if path == "/generate" else {"model_path": model_dirs.a}  # the served weights again
    for headers in ({}, {"Authorization": "Bearer not-the-key"}, {"Authorization": key},  # no scheme
                    {"Authorization": f"Basic {key}"}, {"X-API-Key": key}):
        status, _, payload = http_call(url, "POST", path, body, headers)
        assert (status, payload) == (401, {"error": "Unauthorized"}), headers
    status, _, payload = http_call(url, "POST", path, body, {"Authorization": f"Bearer {key}"})
    assert status == 200, payload
    if path == "/generate":
        assert len(payload["output_ids"]) == 2
    else:
        assert payload["success"] is True
    # The scheme is case-insensitive (RFC 9110), as in SGLang.
    assert http_call(url, "POST", path, body, {"Authorization": f"bearer {key}"})[0] == 200


def test_health_and_metrics_are_open_and_every_other_route_guarded(guarded):
    url, key, log = guarded
    for path in ("/health", "/health_generate", "/metrics"):  # SGLang's open prefixes
        assert http_call(url, "GET", path)[0] == 200, path
    for method, path in (("GET", "/get_model_info"), ("GET", "/get_weight_version"), ("POST", "/pause_generation"),
                         ("POST", "/continue_generation"), ("POST", "/abort_request"), ("GET", "/v1/loads"),
                         ("GET", "/no_such_route")):  # refused before routing, as by SGLang's middleware
        assert http_call(url, method, path, {})[0] == 401, path
    assert http_call(url, "GET", "/get_weight_version", headers={"Authorization": f"Bearer {key}"})[0] == 200
    assert "requests need the API key" in "".join(log)
    assert key not in "".join(log)  # never logged


def test_the_clients_send_the_key(guarded):
    url, key, _ = guarded

    async def main():
        async with GenerationClient(url, api_key=key) as client:
            answer = await client.generate([2, 3], {"max_new_tokens": 3, "ignore_eos": True})
            streamed = [chunk async for chunk in client.generate_stream([2, 3], {"max_new_tokens": 2,
                                                                                 "ignore_eos": True})]
        async with ServerPool([url], api_key=key) as pool:
            pooled = await pool.generate([2, 3], {"max_new_tokens": 1, "ignore_eos": True})
        async with GenerationClient(url) as keyless:
            with pytest.raises(GenerationError, match="401: Unauthorized"):
                await keyless.generate([2, 3], {"max_new_tokens": 1})
        return answer, streamed, pooled

    answer, streamed, pooled = asyncio.run(main())
    assert len(answer["output_ids"]) == 3 and len(streamed[-1]["output_ids"]) == 2
    assert len(pooled["output_ids"]) == 1
