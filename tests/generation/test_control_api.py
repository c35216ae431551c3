"""SGLang's control endpoints on a real server: /pause_generation, /continue_generation,
/abort_request, /flush_cache refusing while busy, a weight update with abort_all_requests in the
middle of generation (the rollout worker resubmits and stitches), and stop strings over HTTP.

The served model is slowed by a forward hook (a real sleep per forward), so that requests are
still decoding when a control call arrives.
"""

from __future__ import annotations

import asyncio
import time

import pytest
import torch
from generation_helpers import (
    ModelDirs, before_every_forward, full_forward_logprobs, greedy_reference, http_call, load_reference,
    running_server, wait_until,
)

from areal_flow.generation.client.generation_client import GenerationClient
from areal_flow.generation.client.router import ServerPool
from areal_flow.generation.http.server import GenerationServer
from areal_flow.rollout.requests import generate_group, generate_sample

PROMPT = [2, 7, 3, 9]
LONG = {"max_new_tokens": 200, "temperature": 0.8, "ignore_eos": True}


@pytest.fixture
def server(model_dirs: ModelDirs) -> GenerationServer:
    with running_server(model_dirs.a, max_batch_size=8, step_delay=0.005) as server:
        yield server


async def started(server: GenerationServer, tokens: int = 5) -> None:
    while server.engine.stats()["generated_tokens"] < tokens:
        await asyncio.sleep(0.002)


def test_pause_aborts_running_requests_holds_new_ones_and_continue_releases_them(server):
    async def scenario():
        async with GenerationClient(server.url) as client:
            running = asyncio.create_task(client.generate(PROMPT, LONG, rid="running"))
            await started(server)
            status, _, body = http_call(server.url, "GET", "/flush_cache")
            assert status == 400 and body == "Flush cache failed.\n"  # busy: clients poll this

            assert await client.pause_generation() == {"message": "Generation paused successfully.", "status": "ok"}
            aborted = await asyncio.wait_for(running, 1)  # answered before pause returned
            meta = aborted["meta_info"]
            assert meta["finish_reason"]["type"] == "abort" and meta["finish_reason"]["message"] == "Aborted"
            n = len(aborted["output_ids"])
            assert 0 < n < 200 == LONG["max_new_tokens"]
            assert len(meta["output_token_logprobs"]) == meta["completion_tokens"] == n

            held = asyncio.create_task(client.generate(PROMPT, {"max_new_tokens": 3}, rid="held"))
            await asyncio.sleep(0.3)
            assert not held.done()
            assert (await client.continue_generation())["status"] == "ok"
            answer = await asyncio.wait_for(held, 10)
            assert answer["meta_info"]["finish_reason"]["type"] == "length"
        status, _, _ = http_call(server.url, "POST", "/flush_cache")
        assert status == 200  # idle now

    asyncio.run(scenario())


def test_abort_request_by_rid_and_all(server):
    async def scenario():
        async with GenerationClient(server.url) as client:
            tasks = {rid: asyncio.create_task(client.generate(PROMPT, LONG, rid=rid)) for rid in ("x", "y", "z")}
            await started(server, 15)
            await client.abort_request("no-such-request")  # 200, no effect
            await client.abort_request("y")
            y = await asyncio.wait_for(tasks["y"], 2)
            assert y["meta_info"]["finish_reason"]["type"] == "abort" and y["meta_info"]["id"] == "y"
            assert not tasks["x"].done() and not tasks["z"].done()
            await client.abort_request(abort_all=True)
            for rid in ("x", "z"):
                answer = await asyncio.wait_for(tasks[rid], 2)
                assert answer["meta_info"]["finish_reason"]["type"] == "abort"

    asyncio.run(scenario())


@pytest.mark.parametrize("group", [1, 3], ids=["one sample", "a group of 3 in one request"])
def test_an_update_mid_generation_is_resubmitted_and_stitched_across_versions(server, model_dirs, group):
    """The rollout worker's loop against a real update: tokens before it on version 0, after it on
    version 1, and every logprob that of the weights that produced it; a group's answers come from
    one request (sampling_params.n) and each goes on alone."""
    params = {"max_new_tokens": 120, "temperature": 0.8, "top_p": 1.0, "ignore_eos": True}

    async def scenario():
        async with ServerPool([server.url]) as pool, GenerationClient(server.url) as admin:
            if group == 1:
                samples = asyncio.ensure_future(asyncio.gather(generate_sample(pool, PROMPT, params, "s0", "g0")))
            else:
                samples = asyncio.create_task(generate_group(pool, PROMPT, params, group, "g0"))
            await started(server, 10 * group)
            t0 = time.perf_counter()
            await admin.pause_generation()
            await admin.update_weights_from_disk(model_dirs.b, 1, abort_all_requests=True)
            await admin.continue_generation()
            return await samples, time.perf_counter() - t0

    outs, update_seconds = asyncio.run(scenario())
    assert update_seconds < 2  # not the seconds the rest of the answer takes at 5 ms a token
    assert len(outs) == group and len({tuple(o["output_ids"]) for o in outs}) == group  # n different answers
    a, b = load_reference(model_dirs.a), load_reference(model_dirs.b)
    for out in outs:
        versions, tokens = out["versions"], out["output_ids"]
        k = versions.index(1)  # the first token of the new weights
        assert 0 < k and versions == [0] * k + [1] * (len(tokens) - k)
        assert len(tokens) == len(out["behav_logprobs"]) == 120 and out["finish"].value == "length"
        under_a = full_forward_logprobs(a, PROMPT, tokens, 0.8)
        under_b = full_forward_logprobs(b, PROMPT, tokens, 0.8)
        torch.testing.assert_close(torch.tensor(out["behav_logprobs"]), torch.cat([under_a[:k], under_b[k:]]),
                                   atol=1e-4, rtol=0)


def test_stop_strings_and_seeds_over_http(server, model_dirs):
    tokenizer = server.tokenizer
    free_run = greedy_reference(load_reference(model_dirs.a), PROMPT, 30, stop_ids=())
    index = next(i for i in range(2, len(free_run))
                 if tokenizer.decode(free_run[i - 1:i + 1]) not in tokenizer.decode(free_run[:i]))
    stop = tokenizer.decode(free_run[index - 1:index + 1])
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 30, "temperature": 0, "ignore_eos": True,
                                                      "stop": stop}}
    status, _, answer = http_call(server.url, "POST", "/generate", body)
    assert status == 200 and answer["output_ids"] == free_run[:index + 1]  # the tokens stay
    assert answer["meta_info"]["finish_reason"] == {"type": "stop", "matched": stop}
    full = tokenizer.decode(free_run[:index + 1])
    assert answer["text"] == full[:full.rfind(stop)] and stop not in answer["text"]  # the string leaves the text
    body["sampling_params"]["no_stop_trim"] = True
    assert http_call(server.url, "POST", "/generate", body)[2]["text"].endswith(stop)

    seeded = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 20, "sampling_seed": 7, "min_p": 0.05}}
    first, again = (http_call(server.url, "POST", "/generate", seeded)[2] for _ in range(2))
    assert first["output_ids"] == again["output_ids"]
    # n samples of a seeded request draw from seed, seed + 1, ... (as SGLang): they differ, and
    # sample j is the single answer of seed + j.
    seeded["sampling_params"].update(n=3, max_new_tokens=40, ignore_eos=True)
    samples = [a["output_ids"] for a in http_call(server.url, "POST", "/generate", seeded)[2]]
    assert len({tuple(ids) for ids in samples}) == 3
    seeded["sampling_params"].update(n=1, sampling_seed=9)
    assert http_call(server.url, "POST", "/generate", seeded)[2]["output_ids"] == samples[2]
    status, _, answer = http_call(server.url, "POST", "/generate", {"input_ids": PROMPT,
                                                                     "sampling_params": {"stop": [3]}})
    assert status == 400 and "sampling_params.stop must be a string or a list of strings" in answer["error"]["message"]


@pytest.mark.parametrize("interrupt, pause_mode", [(True, "abort"), (True, "retract"), (True, "in_place"),
                                                   (False, "abort")])
def test_the_publisher_interrupts_running_requests_or_waits_for_them(server, model_dirs, interrupt, pause_mode):
    from areal_flow.controller.publisher import WeightPublisher
    from areal_flow.weights.files import FileChannel

    async def scenario():
        publisher = WeightPublisher([server.url], ["gen_server0"], FileChannel("disk", "/unused"), interrupt=interrupt,
                                    pause_mode=pause_mode)
        async with GenerationClient(server.url) as client:
            running = asyncio.create_task(client.generate(PROMPT, {**LONG, "max_new_tokens": 60}))
            await started(server)
            seconds = await publisher.publish(model_dirs.b, 1)
            answer = await running
        await publisher.close()
        return seconds, answer

    seconds, answer = asyncio.run(scenario())
    reason, versions = answer["meta_info"]["finish_reason"]["type"], answer["meta_info"]["output_token_versions"]
    assert server.engine.version == 1 and not server.engine.paused
    if not interrupt:  # the update waited for the whole answer, all of it on the old weights
        assert reason == "length" and versions == [0] * 60
    elif pause_mode == "abort":  # aborted with its tokens so far, the update at once
        assert reason == "abort" and len(answer["output_ids"]) < 60 and seconds < 1.0
    else:  # retracted or held in place: one whole answer, its tail on the new weights, the update at once
        k = versions.index(1)
        assert reason == "length" and versions == [0] * k + [1] * (60 - k) and k > 0 and seconds < 1.0
        assert answer["meta_info"]["num_retractions"] == (1 if pause_mode == "retract" else 0)


def test_a_retracting_pause_keeps_the_answer_whole_across_a_weight_update(server, model_dirs):
    async def scenario():
        async with GenerationClient(server.url) as client, GenerationClient(server.url) as admin:
            running = asyncio.create_task(client.generate(PROMPT, {**LONG, "max_new_tokens": 80}, rid="r"))
            await started(server, 10)
            await admin.pause_generation(mode="retract")
            await asyncio.sleep(0.2)
            assert not running.done()  # retracted, not answered
            await admin.update_weights_from_disk(model_dirs.b, 1)  # nothing runs: no wait
            await admin.continue_generation()
            return await asyncio.wait_for(running, 60)

    answer = asyncio.run(scenario())
    meta = answer["meta_info"]
    assert meta["finish_reason"]["type"] == "length" and len(answer["output_ids"]) == 80
    assert meta["num_retractions"] == 1 and meta["weight_version"] == "1"
    versions = meta["output_token_versions"]
    k = versions.index(1)
    assert k >= 10 and versions == [0] * k + [1] * (80 - k)
    status, _, body = http_call(server.url, "POST", "/pause_generation", {"mode": "sideways"})
    assert status == 400 and "mode 'sideways' is not supported" in body["error"]["message"]
    assert not server.engine.paused


def test_health_generate_runs_a_one_token_request_and_fails_when_the_engine_does_not_answer(
        model_dirs: ModelDirs, monkeypatch):
    from areal_flow.generation.http import routes

    with running_server(model_dirs.a, max_batch_size=8) as server:
        finished = server.engine.stats()["num_finished_reqs"]
        assert http_call(server.url, "GET", "/health_generate")[0] == 200
        assert server.engine.stats()["num_finished_reqs"] == finished + 1  # it went through the engine
        server.engine.pause()
        started = time.monotonic()
        assert http_call(server.url, "GET", "/health_generate")[0] == 503  # paused: no generation
        assert time.monotonic() - started < 5
        server.engine.continue_generation()
        # An engine too slow to answer within the timeout: 503, and the probe is aborted.
        monkeypatch.setattr(routes, "HEALTH_GENERATE_TIMEOUT", 0.2)
        before_every_forward(server.engine, lambda *_: time.sleep(0.5))
        assert http_call(server.url, "GET", "/health_generate")[0] == 503
        wait_until(server.engine.is_idle, "the probe to be aborted")
        assert http_call(server.url, "GET", "/health")[0] == 200  # /health does not generate
