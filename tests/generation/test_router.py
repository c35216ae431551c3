"""ServerPool on real servers: least load, affinity, retries on another server when one stops or
stalls, no retry of a 4xx, every server down, a server coming back, and the weight-update fan-out.

The two servers of a test serve different weights where the test must tell which server answered:
a greedy answer then names the model that made it. A forward hook (a real sleep per forward) keeps
requests decoding while the test acts.
"""

from __future__ import annotations

import asyncio
import shutil
import time
from collections import Counter

import pytest
from generation_helpers import ModelDirs, async_wait_until, greedy_reference, load_reference

from areal_flow.config.schema import RolloutConfig
from areal_flow.controller.publisher import WeightPublisher
from areal_flow.generation.client.generation_client import GenerationClient, GenerationError
from areal_flow.generation.client.router import ServerPool, ServerPoolError
from areal_flow.weights.broadcast import BroadcastChannel
from areal_flow.weights.files import FileChannel
from areal_flow.weights.update import WeightUpdateError, update_servers

DISK = FileChannel("disk", "/unused")  # the controller's end: each server loads the directory it is given
from areal_flow.generation.http.server import GenerationServer
from areal_flow.rollout.requests import generate_sample
from areal_flow.transport.messages import Finish

PROMPT = [2, 7, 3, 9]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}


def fast(**settings) -> RolloutConfig:
    """Short backoff and health interval, for tests that take servers down."""
    return RolloutConfig(retry_backoff=0.05, health_interval=0.1, **settings)


@pytest.fixture(scope="module")
def greedy(model_dirs: ModelDirs) -> dict[str, list[int]]:
    """The greedy answer to PROMPT of each model: model a's and model b's differ."""
    answers = {m: greedy_reference(load_reference(getattr(model_dirs, m)), PROMPT, 12, stop_ids=()) for m in "ab"}
    assert answers["a"] != answers["b"]
    return answers


def spy(pool: ServerPool) -> list[tuple[str, str, str]]:
    """Record (server, rid, outcome) of every request the pool sends; the requests stay real."""
    calls: list[tuple[str, str, str]] = []
    for server in pool.servers:
        async def post(path, payload, _real=server.client.post, _name=server.name):
            try:
                answer = await _real(path, payload)
            except Exception as exc:
                calls.append((_name, payload["rid"], type(exc).__name__))
                raise
            calls.append((_name, payload["rid"], "ok"))
            return answer

        server.client.post = post
    return calls


def served(server: GenerationServer) -> int:
    return server.engine.stats()["generated_tokens"]


def test_least_load_spreads_concurrent_requests_and_avoids_the_busy_server(start):
    a, b = start(delay=0.01), start(delay=0.01)

    async def scenario():
        async with ServerPool([a.url, b.url]) as pool:
            await asyncio.gather(*[pool.generate(PROMPT, {"max_new_tokens": 5, "ignore_eos": True})
                                   for _ in range(8)])
            spread = served(a), served(b)
            # A group of 4 long requests holds one server; the 4 requests after it go to the other.
            group = [asyncio.create_task(pool.generate(PROMPT, {"max_new_tokens": 40, "ignore_eos": True}, key="g"))
                     for _ in range(4)]
            await asyncio.sleep(0)
            busy = next(s for s in pool.servers if s.in_flight)
            assert busy.in_flight == 4
            await asyncio.gather(*group, *[pool.generate(PROMPT, {"max_new_tokens": 3, "ignore_eos": True})
                                           for _ in range(4)])
            assert all(s.in_flight == 0 for s in pool.servers)
            return spread, busy.name

    (spread, busy) = asyncio.run(scenario())
    assert spread == (20, 20)  # 4 requests of 5 tokens on each
    group_server, other = (a, b) if busy == "gen_server0" else (b, a)
    assert served(group_server) == 20 + 4 * 40 and served(other) == 20 + 4 * 3


def test_affinity_keeps_a_group_and_its_resubmissions_on_one_server(start, model_dirs, greedy):
    servers = {"a": start(model_dirs.a, delay=0.005), "b": start(model_dirs.b, delay=0.005)}

    async def scenario():
        async with ServerPool([servers["a"].url, servers["b"].url]) as pool:
            calls = spy(pool)
            groups = [asyncio.gather(*[generate_sample(pool, PROMPT, GREEDY, f"g{g}-{i}", f"g{g}") for i in range(3)])
                      for g in range(6)]
            run = asyncio.gather(*groups)
            # Interrupt both servers mid-generation, as a weight update does: every running sample
            # comes back aborted and is resubmitted with its tokens so far.
            await async_wait_until(lambda: served(servers["a"]) > 5 and served(servers["b"]) > 5, "both decoding")
            await asyncio.gather(*[c.pause_generation() for c in pool.clients])
            await asyncio.gather(*[c.continue_generation() for c in pool.clients])
            return await run, calls

    outs, calls = asyncio.run(scenario())
    models = []
    for group in outs:
        # Every sample of a group, resumed or not, is the greedy answer of one model.
        (model,) = {m for m in "ab" for o in group if o["output_ids"] == greedy[m]}
        assert all(o["output_ids"] == greedy[model] for o in group)
        models.append(model)
    assert Counter(models) == {"a": 3, "b": 3}  # and the groups spread over both
    # Samples were resubmitted (attempt 1), each to the server of its first request.
    where = {rid: server for server, rid, outcome in calls}
    resubmitted = [rid for rid in where if rid.endswith("-1")]
    assert resubmitted and all(where[rid] == where[rid[:-1] + "0"] for rid in resubmitted)


def test_a_stopped_server_s_requests_are_retried_on_the_other_and_each_sample_completes_once(start):
    a, b = start(delay=0.01), start(delay=0.01)
    params = {"max_new_tokens": 30, "temperature": 1.0, "ignore_eos": True}

    async def scenario():
        async with ServerPool([a.url, b.url], config=fast()) as pool:
            calls = spy(pool)
            samples = [generate_sample(pool, PROMPT, params, f"g{g}-{i}", f"g{g}") for g in range(4) for i in range(3)]
            run = asyncio.gather(*samples)
            await async_wait_until(lambda: served(a) > 10, "server a decoding")
            await asyncio.to_thread(a.stop)
            return await run, calls, pool.down(), pool.servers[0].last_error

    outs, calls, down, error = asyncio.run(scenario())
    assert len(outs) == 12 and all(len(o["output_ids"]) == 30 and o["finish"] == Finish.LENGTH for o in outs)
    assert down == ["gen_server0"] and error.startswith(f"{a.url}/generate answered 503")
    failed = [rid for server, rid, outcome in calls if outcome != "ok"]
    assert failed and all(server == "gen_server0" for server, _, outcome in calls if outcome != "ok")
    # Each sample's request answered once: by b after a failed, never twice.
    answered = Counter(rid.split(".retry")[0] for _, rid, outcome in calls if outcome == "ok")
    assert answered == {f"g{g}-{i}-0": 1 for g in range(4) for i in range(3)}
    assert all(f"{rid}.retry1" in {r for s, r, o in calls if s == "gen_server1" and o == "ok"} for rid in failed)


@pytest.mark.slow  # 1.4-2.3 s: the full suite runs it; the fast tier keeps its 3 minutes
def test_a_request_that_times_out_is_aborted_where_it_ran_and_retried_elsewhere(start):
    slow, quick = start(delay=0.2), start()
    params = {"max_new_tokens": 40, "ignore_eos": True}

    async def scenario():
        async with ServerPool([slow.url, quick.url], config=fast(request_timeout=1.5)) as pool:
            calls = spy(pool)
            answer = await pool.generate(PROMPT, params, rid="late")
            # The abort is sent in the background, at once: the slow server drops the request
            # instead of decoding it for the 8 s its 40 tokens take there.
            await async_wait_until(slow.engine.is_idle, "the slow server to drop the request", timeout=3)
            return answer, calls

    answer, calls = asyncio.run(scenario())
    assert calls == [("gen_server0", "late", "TimeoutError"), ("gen_server1", "late.retry1", "ok")]
    assert len(answer["output_ids"]) == 40 and answer["meta_info"]["id"] == "late.retry1"
    assert served(slow) < 40


def test_a_4xx_is_raised_with_the_server_s_message_and_not_retried(start):
    a, b = start(), start()

    async def scenario():
        async with ServerPool([a.url, b.url], config=fast()) as pool:
            calls = spy(pool)
            with pytest.raises(GenerationError) as caught:
                await pool.generate(PROMPT, {"stop": [3]}, rid="bad")
            return caught.value, calls, pool.down()

    error, calls, down = asyncio.run(scenario())
    assert error.status == 400 and "sampling_params.stop must be a string or a list of strings" in str(error)
    assert calls == [("gen_server0", "bad", "GenerationError")] and down == []


@pytest.mark.slow  # 1.4-2.3 s: the full suite runs it; the fast tier keeps its 3 minutes
def test_every_server_down_fails_after_down_timeout_naming_each_server(start):
    a, b = start(), start()
    a.stop()
    b.stop()

    async def scenario():
        async with ServerPool([a.url, b.url], config=fast(request_retries=5, down_timeout=1.0)) as pool:
            t0 = time.monotonic()
            with pytest.raises(ServerPoolError) as caught:
                await pool.generate(PROMPT, GREEDY, rid="lost")
            return str(caught.value), time.monotonic() - t0

    message, seconds = asyncio.run(scenario())
    assert 1.0 <= seconds < 6
    assert message.startswith("request lost: every generation server is down and none came back within 1 s "
                              "(rollout.down_timeout); ")
    for server, name in ((a, "gen_server0"), (b, "gen_server1")):
        assert f"{name} ({server.url}): " in message
    assert message.count("Cannot connect to host") == 2


def test_a_server_that_comes_back_is_used_again_and_a_waiting_request_completes(start, model_dirs):
    a = start()
    port = a.server_address[1]

    async def scenario():
        async with ServerPool([a.url], config=fast(down_timeout=30)) as pool:
            await pool.generate(PROMPT, GREEDY)
            await asyncio.to_thread(a.stop)
            waiting = asyncio.create_task(pool.generate(PROMPT, GREEDY, rid="patient"))
            await async_wait_until(lambda: pool.down() == ["gen_server0"], "the server to be marked down")
            await asyncio.sleep(0.5)  # several health checks find nothing
            assert not waiting.done()
            again = await asyncio.to_thread(start, model_dirs.b, port=port)  # a restart, on the same address
            answer = await asyncio.wait_for(waiting, 10)
            return answer, pool.down(), again

    answer, down, again = asyncio.run(scenario())
    assert down == [] and answer["meta_info"]["id"] == "patient.retry1"
    assert served(again) == 12  # the restarted server answered it


def test_publish_pauses_updates_and_continues_every_server(start, model_dirs):
    a, b = start(delay=0.005), start(delay=0.005)

    async def scenario():
        publisher = WeightPublisher([a.url, b.url], ["gen_server0", "gen_server1"], DISK)
        async with ServerPool([a.url, b.url]) as pool:
            running = [asyncio.create_task(pool.generate(PROMPT, {"max_new_tokens": 200, "ignore_eos": True}))
                       for _ in range(2)]
            await async_wait_until(lambda: served(a) > 3 and served(b) > 3, "both decoding")
            await publisher.publish(model_dirs.b, 1)
            answers = await asyncio.gather(*running)
        await publisher.close()
        return answers

    answers = asyncio.run(scenario())
    assert all(a["meta_info"]["finish_reason"]["type"] == "abort" for a in answers)  # paused mid-answer
    for server in (a, b):
        assert server.engine.version == 1 and not server.engine.paused


def test_a_refused_update_fails_the_publish_but_every_server_is_continued(start, model_dirs):
    a, wide = start(model_dirs.a), start(model_dirs.wide)  # the wide model cannot take b's weights

    async def scenario():
        publisher = WeightPublisher([a.url, wide.url], ["gen_server0", "gen_server1"], DISK)
        with pytest.raises(WeightUpdateError) as caught:
            await publisher.publish(model_dirs.b, 1)
        await publisher.close()
        return str(caught.value)

    message = asyncio.run(scenario())
    assert message.startswith(f"weight version 1 from {model_dirs.b}: gen_server1 refused to load the weights: ")
    assert "gen_server0" not in message
    assert a.engine.version == 1 and wide.engine.version == 0
    assert not a.engine.paused and not wide.engine.paused
    for server in (a, wide):  # both generate again
        assert server.engine.submit(PROMPT, max_new_tokens=2).result(timeout=10).output_ids


def test_by_broadcast_the_weights_go_between_pause_and_continue_and_a_refusal_still_continues(start, model_dirs,
                                                                                              greedy):
    """rollout.weight_update_mode=distributed: the publisher pauses every server, has the trainer
    (here this process, over a real gloo group) broadcast the version, and continues them all, also
    when a server refuses a bucket."""
    import torch

    from areal_flow.generation.engine.checkpoint import load_checkpoint
    from areal_flow.training.engine import bucketed
    from areal_flow.weights.sender import Server, WeightSender, WeightTransferError

    a, b = start(delay=0.005), start(delay=0.005)
    sender = WeightSender([Server("gen_server0", a.url), Server("gen_server1", b.url)], timeout=30)
    weights = {1: load_checkpoint(model_dirs.b), 2: {"model.layers.0.mlp.nope.weight": torch.ones(2)}}
    calls = []

    async def transfer(version: int, flags) -> None:
        calls.append((version, flags.abort_all_requests, a.engine.paused, b.engine.paused))
        buckets = bucketed(iter(weights[version].items()), 1 << 14)
        try:
            await asyncio.to_thread(sender.send, buckets, version, abort_all_requests=flags.abort_all_requests)
        except WeightTransferError as exc:  # what the controller makes of the trainer's report
            raise WeightUpdateError(str(exc)) from None

    async def scenario():
        publisher = WeightPublisher([a.url, b.url], ["gen_server0", "gen_server1"], BroadcastChannel([]),
                                    trainers=transfer)
        async with ServerPool([a.url, b.url]) as pool:
            running = [asyncio.create_task(pool.generate(PROMPT, {"max_new_tokens": 200, "ignore_eos": True}))
                       for _ in range(2)]
            await async_wait_until(lambda: served(a) > 3 and served(b) > 3, "both decoding")
            await publisher.publish("", 1)
            answers = await asyncio.gather(*running)
            after = await pool.generate(PROMPT, GREEDY)
        with pytest.raises(WeightUpdateError) as refused:
            await publisher.publish("", 2)
        await publisher.close()
        return answers, after, str(refused.value)

    answers, after, message = asyncio.run(scenario())
    assert calls == [(1, True, True, True), (2, True, True, True)]  # always sent while both were paused
    assert all(x["meta_info"]["finish_reason"]["type"] == "abort" for x in answers)
    assert after["output_ids"] == greedy["b"] and after["meta_info"]["output_token_versions"] == [1] * 12
    assert message.startswith("weight version 2 by broadcast: ") and "model.layers.0.mlp.nope.weight" in message
    assert "gen_server0 refused it" in message and "gen_server1 refused it" in message
    for server in (a, b):
        assert server.engine.version == 1 and not server.engine.paused


def test_by_broadcast_a_down_server_fails_the_update_before_any_server_is_paused(start, model_dirs):
    a, b = start(), start()
    b.stop()
    calls = []

    async def transfer(version: int, flags) -> None:
        calls.append(version)

    async def scenario():
        async with ServerPool([a.url, b.url], config=fast()) as pool:
            await pool.generate(PROMPT, GREEDY)  # tries b first or second: either way b is marked down
            await pool.generate(PROMPT, GREEDY)
            with pytest.raises(WeightUpdateError) as caught:
                await update_servers(pool, BroadcastChannel([]), "", 1, trainers=transfer)
            return str(caught.value)

    message = asyncio.run(scenario())
    assert message.startswith("weight version 1 cannot be sent by broadcast: every generation server takes part in "
                              "each delivery, and gen_server1 (")
    assert calls == [] and a.engine.version == 0 and not a.engine.paused


def test_a_down_server_is_left_out_of_an_update_and_reported(start, model_dirs):
    a, b = start(), start()
    b.stop()

    async def scenario():
        async with ServerPool([a.url, b.url], config=fast()) as pool:
            return await update_servers(pool, DISK, model_dirs.b, 1)

    assert asyncio.run(scenario()) == ["gen_server1"]
    assert a.engine.version == 1 and not a.engine.paused


def test_a_server_that_missed_an_update_gets_the_last_weights_before_it_is_used_again(start, model_dirs, greedy):
    a, b = start(), start()
    port = b.server_address[1]
    b.stop()

    async def scenario():
        async with ServerPool([a.url, b.url], config=fast()) as pool:
            assert await update_servers(pool, DISK, model_dirs.b, 1) == ["gen_server1"]
            again = await asyncio.to_thread(start, model_dirs.a, port=port)  # restarted on its start weights
            await async_wait_until(lambda: pool.down() == [], "the restarted server to be taken back")
            async with GenerationClient(again.url) as direct:
                answer = await direct.generate(PROMPT, GREEDY)
            return again, answer

    again, answer = asyncio.run(scenario())
    assert again.engine.version == 1 and again.engine.weight_label == "1"
    assert answer["output_ids"] == greedy["b"]  # the weights of version 1, not the ones it started with


def test_a_server_that_cannot_load_the_missed_weights_stays_down_naming_why(start, model_dirs, tmp_path):
    a, b = start(), start()
    port = b.server_address[1]
    b.stop()
    version_1 = shutil.copytree(model_dirs.b, tmp_path / "v1")

    async def scenario():
        async with ServerPool([a.url, b.url], config=fast()) as pool:
            await update_servers(pool, DISK, str(version_1), 1)
            shutil.rmtree(version_1)  # gone by the time the server returns
            again = await asyncio.to_thread(start, model_dirs.a, port=port)
            await async_wait_until(lambda: "on its return" in pool.servers[1].last_error, "the failed catch-up")
            await asyncio.sleep(0.3)  # more health checks: still not taken back
            return again, pool.down(), pool.servers[1].last_error

    again, down, error = asyncio.run(scenario())
    assert down == ["gen_server1"] and again.engine.version != 1
    assert "could not load weight version 1" in error and "v1" in error


def test_held_out_evaluation_goes_through_the_pool_and_survives_a_down_server(start, model_dirs):
    from transformers import AutoTokenizer

    from areal_flow.controller.evaluation import held_out_accuracy

    a, b = start(), start()
    b.stop()
    tokenizer = AutoTokenizer.from_pretrained(model_dirs.a)
    reference = load_reference(model_dirs.a)
    prompts = ["c d e", "f g", "h i j k", "b c", "d d d", "p o n"]
    rows = []
    for i, text in enumerate(prompts):  # every other row's reference is the model's greedy answer
        greedy = greedy_reference(reference, tokenizer.encode(text, add_special_tokens=False), 6)
        rows.append({"q": text, "a": tokenizer.decode(greedy, skip_special_tokens=True) if i % 2 == 0 else "nope"})

    async def scenario():
        async with ServerPool([a.url, b.url], config=fast()) as pool:
            async def exact(text: str, ref: str) -> float:
                return float(text == ref)

            return await held_out_accuracy(pool, tokenizer, rows, exact, "q", "a", 6)

    result = asyncio.run(scenario())
    assert result.accuracy == 0.5 and result.n == len(prompts) and sum(result.versions.values()) == len(prompts)
    assert [s["reference"] for s in result.samples] == [r["a"] for r in rows[:len(result.samples)]]
    assert a.engine.stats()["num_finished_reqs"] >= len(prompts)  # every prompt was answered by the server up


@pytest.mark.parametrize("kw, message", [
    ({"urls": []}, "a ServerPool needs at least one server url"),
    ({"names": ["only_one"]}, "1 names for 2 server urls"),
    ({"config": RolloutConfig(request_retries=-1)}, "rollout.request_retries=-1 must be ≥ 0"),
    ({"config": RolloutConfig(request_timeout=0)}, "rollout.request_timeout=0 must be > 0"),
    ({"urls": ["http://127.0.0.1:1", "127.0.0.1:2"]}, "base_url must look like http://host:port, got '127.0.0.1:2'"),
])
def test_bad_pool_settings_are_refused_naming_the_setting(kw, message):
    kw = {"urls": ["http://127.0.0.1:1", "http://127.0.0.1:2"], **kw}
    with pytest.raises(ValueError, match=message):
        ServerPool(kw.pop("urls"), **kw)


def test_a_pool_that_loads_no_weights_takes_a_restarted_server_back_only_at_the_newest_version(start, model_dirs):
    """A rollout worker's pool: a server restarted from older weights stays out until the pool that
    loads weights (the controller's) has given it the version the answers came from."""
    a = start()
    port = a.server_address[1]

    async def scenario():
        async with GenerationClient(a.url) as direct:
            await direct.update_weights_from_disk(model_dirs.a, 2)
        async with ServerPool([a.url], config=fast(down_timeout=30)) as pool:
            assert (await pool.generate(PROMPT, GREEDY))["meta_info"]["weight_version"] == "2"
            await asyncio.to_thread(a.stop)
            waiting = asyncio.create_task(pool.generate(PROMPT, GREEDY, rid="patient"))
            await async_wait_until(lambda: pool.down() == ["gen_server0"], "the server to be marked down")
            again = await asyncio.to_thread(start, model_dirs.a, port=port)  # restarted at version 0
            await asyncio.sleep(0.5)  # several health checks find it up, at an older version
            out_while_old = (pool.down(), pool.servers[0].last_error, waiting.done())
            async with GenerationClient(again.url) as direct:
                await direct.update_weights_from_disk(model_dirs.a, 2)
            answer = await asyncio.wait_for(waiting, 10)
            return out_while_old, answer

    (down, error, done), answer = asyncio.run(scenario())
    assert down == ["gen_server0"] and not done
    assert error == "it serves weight version 0, older than version 2 of the others"
    assert answer["meta_info"]["weight_version"] == "2"


def test_a_restarted_server_waits_for_the_version_the_controller_admits_at_not_only_the_answers_newest(start, model_dirs):
    """The race a chaos run met: the servers loaded version 2 and the controller admitted groups at
    it, but no answer had come back from version 2 yet, when a server restarted from version 1 (the
    weights it last loaded) answered /health. The rollout worker's pool must not take it back until
    it serves version 2: the admitted groups tell the pool the version (ServerPool.newest)."""
    a = start()
    port = a.server_address[1]

    async def scenario():
        async with GenerationClient(a.url) as direct:
            await direct.update_weights_from_disk(model_dirs.a, 1)
        async with ServerPool([a.url], config=fast(down_timeout=30)) as pool:
            assert (await pool.generate(PROMPT, GREEDY))["meta_info"]["weight_version"] == "1"
            async with GenerationClient(a.url) as direct:
                await direct.update_weights_from_disk(model_dirs.a, 2)  # the controller's update
            pool.newest(2)  # a group admitted at version 2 reaches the rollout worker
            await asyncio.to_thread(a.stop)
            waiting = asyncio.create_task(pool.generate(PROMPT, GREEDY, rid="patient"))
            await async_wait_until(lambda: pool.down() == ["gen_server0"], "the server to be marked down")
            again = await asyncio.to_thread(start, model_dirs.a, port=port)
            async with GenerationClient(again.url) as direct:
                await direct.update_weights_from_disk(model_dirs.a, 1)  # restarted from version 1
            await asyncio.sleep(0.5)  # several health checks find it up, at version 1
            out_while_old = (pool.down(), pool.servers[0].last_error, waiting.done())
            async with GenerationClient(again.url) as direct:
                await direct.update_weights_from_disk(model_dirs.a, 2)  # the controller's pool brings it up to date
            answer = await asyncio.wait_for(waiting, 10)
            return out_while_old, answer

    (down, error, done), answer = asyncio.run(scenario())
    assert down == ["gen_server0"] and not done
    assert error == "it serves weight version 1, older than version 2 of the others"
    assert answer["meta_info"]["weight_version"] == "2"
