"""Readiness, load and metrics routes of real servers: /ready, SGLang's /v1/loads, and Prometheus
/metrics (parsed with prometheus_client), two servers in one process apart."""

from __future__ import annotations

import asyncio
import time

import pytest
from generation_helpers import ModelDirs, http_call, running_server, wait_until
from prometheus_client.parser import text_string_to_metric_families

from areal_flow.generation.client.generation_client import GenerationClient
from areal_flow.generation.http.server import GenerationServer

PROMPT = [2, 7, 3, 9]


@pytest.fixture
def slow_server(model_dirs: ModelDirs) -> GenerationServer:
    """One request at a time, each decode step slowed, so that requests are seen running and waiting."""
    with running_server(model_dirs.a, max_batch_size=1, step_delay=0.005) as server:
        yield server


def metrics(server: GenerationServer) -> dict[str, float]:
    """Sample name -> value of GET /metrics (one label set per server)."""
    status, headers, text = http_call(server.url, "GET", "/metrics")
    assert status == 200 and headers["content-type"].startswith("text/plain")
    samples = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            assert sample.labels == {"model_name": server.engine.model_path}
            samples[sample.name] = sample.value
    return samples


def loads(server: GenerationServer, query: str = "") -> dict:
    status, _, body = http_call(server.url, "GET", "/v1/loads" + query)
    assert status == 200, body
    return body


def test_ready_answers_503_while_paused(server_a):
    assert http_call(server_a.url, "GET", "/ready")[:1] == (200,)
    try:
        assert http_call(server_a.url, "POST", "/pause_generation", {})[0] == 200
        status, _, body = http_call(server_a.url, "GET", "/ready")
        assert (status, body) == (503, "")
        assert http_call(server_a.url, "GET", "/health")[0] == 200  # alive, just not taking work
    finally:
        http_call(server_a.url, "POST", "/continue_generation", {})
    assert http_call(server_a.url, "GET", "/ready")[0] == 200


def test_loads_and_metrics_count_running_and_waiting_requests(slow_server):
    idle = loads(slow_server, "?include=core")
    assert idle["loads"][0]["num_running_reqs"] == idle["loads"][0]["num_waiting_reqs"] == 0
    assert idle["loads"][0]["max_running_requests"] == 1 and idle["loads"][0]["dp_rank"] == 0
    engine = slow_server.engine
    # The first request's answer is long (it is aborted below, so its length costs nothing): it
    # cannot finish in the moment between seeing the two requests and holding them.
    sampling = {"max_new_tokens": 200, "ignore_eos": True}

    def one_running_one_waiting() -> bool:
        stats = engine.stats()  # one snapshot: both counts (and the tokens) from the same moment
        return stats["num_running_reqs"] == 1 and stats["num_waiting_reqs"] == 1 and stats["generated_tokens"] >= 1

    async def scenario() -> tuple[dict, dict[str, float]]:
        async with GenerationClient(slow_server.url) as client:
            first = asyncio.create_task(client.generate(PROMPT, sampling))
            second = asyncio.create_task(client.generate(PROMPT, sampling))
            try:
                await asyncio.to_thread(wait_until, one_running_one_waiting, "one running (decoding), one waiting", 60)
                # Hold the engine there (no decode step, no admission) so that the two scrapes read
                # that state however slowly they come: under load the first request once finished
                # between the wait and the scrapes, which then saw the second running and none waiting.
                engine.pause(mode="in_place")
                assert one_running_one_waiting(), engine.stats()  # not finished in between
                busy = await asyncio.to_thread(loads, slow_server)
                scraped = await asyncio.to_thread(metrics, slow_server)
            finally:
                await client.abort_request(abort_all=True)
                engine.continue_generation()
            await asyncio.gather(first, second)
            return busy, scraped

    busy, scraped = asyncio.run(scenario())
    load = busy["loads"][0]
    assert (load["num_running_reqs"], load["num_waiting_reqs"], load["utilization"]) == (1, 1, 1.0)
    assert scraped["sglang:num_running_reqs"] == 1 and scraped["sglang:num_queue_reqs"] == 1
    assert set(busy) == {"timestamp", "version", "accelerator", "num_accelerators", "loads"}
    # No KV token budget in this engine: usage reads 0, the running request's tokens are counted.
    assert load["token_usage"] == load["max_total_num_tokens"] == 0 and load["num_used_tokens"] > len(PROMPT)


@pytest.mark.slow  # 1.4-2.3 s: the full suite runs it; the fast tier keeps its 3 minutes
def test_metrics_count_tokens_requests_and_busy_time_and_throughput_decays(server_a):
    before = metrics(server_a)
    answer = http_call(server_a.url, "POST", "/generate",
                       {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 30, "ignore_eos": True}})[2]
    assert len(answer["output_ids"]) == 30
    after = metrics(server_a)
    assert after["sglang:generation_tokens_total"] - before["sglang:generation_tokens_total"] == 30
    assert after["sglang:prompt_tokens_total"] - before["sglang:prompt_tokens_total"] == len(PROMPT)
    assert after["sglang:num_requests_total"] - before["sglang:num_requests_total"] == 1
    assert after["areal_flow:busy_seconds_total"] > before["areal_flow:busy_seconds_total"]
    assert after["areal_flow:weight_version"] == 0
    wait_until(lambda: metrics(server_a)["sglang:num_running_reqs"] == 0, "the finished request to leave the batch")
    time.sleep(1.1)  # a throughput window with those tokens in it, then one with none
    assert loads(server_a)["loads"][0]["gen_throughput"] > 0
    time.sleep(1.1)
    assert metrics(server_a)["sglang:gen_throughput"] == 0


def test_two_servers_in_one_process_keep_their_own_metrics(server_a, model_dirs):
    with running_server(model_dirs.b) as other:  # a second registry: no clash with server_a's metric names
        http_call(server_a.url, "POST", "/generate", {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}})
        assert metrics(other)["sglang:generation_tokens_total"] == 0
        assert metrics(server_a)["sglang:generation_tokens_total"] >= 4


def test_kv_usage_is_the_running_requests_tokens_over_the_budget(model_dirs):
    with running_server(model_dirs.a, step_delay=0.005, max_total_tokens=400) as server:
        server.engine.submit(PROMPT, max_new_tokens=200, ignore_eos=True)
        # Running and past its first token (admitted, a request is running while its prompt is prefilled).
        wait_until(lambda: server.engine.stats()["generated_tokens"] >= 1, "decoding")
        load, scraped = loads(server)["loads"][0], metrics(server)
        server.engine.abort()
    assert load["max_total_num_tokens"] == 400 and len(PROMPT) < load["num_used_tokens"] <= len(PROMPT) + 200
    assert load["token_usage"] == load["num_used_tokens"] / 400
    assert 0 < scraped["sglang:token_usage"] <= (len(PROMPT) + 200) / 400 and scraped["sglang:num_used_tokens"] > 0


@pytest.mark.parametrize(("query", "expected"), [("?include=bogus", "include"), ("?format=prometheus", "format"),
                                                 ("?dp_rank=x", "dp_rank")])
def test_bad_loads_query_gets_400_naming_the_parameter(server_a, query, expected):
    status, _, body = http_call(server_a.url, "GET", "/v1/loads" + query)
    assert status == 400 and expected in body["error"]["message"]
    assert loads(server_a, "?dp_rank=0")["loads"][0]["dp_rank"] == 0
    assert loads(server_a, "?dp_rank=1")["loads"] == []
