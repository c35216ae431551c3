"""ServerPool's elastic membership on real servers: a server that joins takes requests only once it
is healthy and serves current weights; a server that leaves gets no new request but every weight
update until it is forgotten, and its aborted samples finish elsewhere with their tokens so far,
each once."""

from __future__ import annotations

import asyncio
import pytest
from generation_helpers import ModelDirs, async_wait_until, greedy_reference, load_reference

from areal_flow.generation.client.generation_client import GenerationClient
from areal_flow.generation.client.router import ServerPool
from areal_flow.rollout.requests import generate_sample
from areal_flow.transport.messages import Finish
from areal_flow.weights.files import FileChannel
from areal_flow.weights.update import update_servers

DISK = FileChannel("disk", "/unused")
PROMPT = [2, 7, 3, 9]
GREEDY = {"max_new_tokens": 12, "temperature": 0, "ignore_eos": True}
FAST = dict(retry_backoff=0.05, health_interval=0.1)


def fast(**settings):
    from areal_flow.config.schema import RolloutConfig

    return RolloutConfig(**FAST, **settings)


def finished(server) -> int:
    return server.engine.stats()["num_finished_reqs"]


def test_a_joining_server_gets_the_current_weights_before_its_first_request(start, model_dirs: ModelDirs):
    a = start()
    joining = start(model_dirs.a)  # started from older weights than the pool's
    greedy_b = greedy_reference(load_reference(model_dirs.b), PROMPT, 12, stop_ids=())

    async def scenario():
        async with ServerPool([a.url], config=fast()) as pool:
            await update_servers(pool, DISK, model_dirs.b, 1)
            pool.add("gen_server1", joining.url)
            with pytest.raises(ValueError, match="gen_server1 is in the pool already"):
                pool.add("gen_server1", joining.url)
            assert pool.down() == ["gen_server1"]  # not before it is healthy and current
            await async_wait_until(lambda: pool.down() == [], "the new server to join")
            answers = await asyncio.gather(*[pool.generate(PROMPT, GREEDY) for _ in range(6)])
            return answers

    answers = asyncio.run(scenario())
    assert joining.engine.version == 1  # loaded on joining
    assert all(x["output_ids"] == greedy_b and x["meta_info"]["weight_version"] == "1" for x in answers)
    assert finished(a) >= 1 and finished(joining) >= 1  # both serve now


def test_a_rollout_pool_takes_a_joining_server_only_at_the_newest_version(start, model_dirs: ModelDirs):
    a, joining = start(), start()

    async def scenario():
        async with GenerationClient(a.url) as direct:
            await direct.update_weights_from_disk(model_dirs.a, 2)
        async with ServerPool([a.url], config=fast()) as pool:  # loads no weights, as a rollout worker's
            await pool.generate(PROMPT, GREEDY)  # learns version 2 from the answer
            pool.add("gen_server1", joining.url)
            await asyncio.sleep(0.4)  # health checks find it up, at version 0
            while_old = (pool.down(), pool.servers[1].last_error)
            async with GenerationClient(joining.url) as direct:
                await direct.update_weights_from_disk(model_dirs.a, 2)  # the controller's pool brings it up to date
            await async_wait_until(lambda: pool.down() == [], "the new server to join")
            return while_old

    down, error = asyncio.run(scenario())
    assert down == ["gen_server1"] and error == "it serves weight version 0, older than version 2 of the others"


def test_a_leaving_server_s_aborted_samples_finish_elsewhere_each_once_and_it_gets_updates_until_forgotten(
        start, model_dirs: ModelDirs):
    stay, leave = start(delay=0.01), start(delay=0.01)
    params = {"max_new_tokens": 30, "temperature": 1.0, "ignore_eos": True}

    async def scenario():
        async with ServerPool([stay.url, leave.url], config=fast()) as pool:
            samples = [generate_sample(pool, PROMPT, params, f"g{g}-{i}", f"g{g}") for g in range(4) for i in range(2)]
            run = asyncio.gather(*samples)
            await async_wait_until(lambda: leave.engine.stats()["generated_tokens"] > 10, "the leaving server decoding")
            pool.leave("gen_server1")
            on_leaving = pool.servers[1].in_flight
            before = finished(leave)
            # What it still decodes is decoded on the current weights: an update reaches it.
            await update_servers(pool, DISK, model_dirs.a, 1)
            updated = leave.engine.version
            # What the launcher does to a server it removes: its running requests come back aborted.
            async with GenerationClient(leave.url) as direct:
                await direct.abort_request(abort_all=True)
            outs = await run
            pool.forget("gen_server1")
            return outs, on_leaving, before, updated, [s.name for s in pool.servers]

    outs, on_leaving, before, updated, names = asyncio.run(scenario())
    assert on_leaving > 0  # it had samples running when it left
    assert len(outs) == 8 and all(len(o["output_ids"]) == 30 and o["finish"] == Finish.LENGTH for o in outs)
    assert finished(leave) - before <= on_leaving  # nothing new went to it: only the aborted came back
    assert updated == 1 and names == ["gen_server0"]
    # The tokens made on the leaving server were kept across the move: none was decoded twice (an
    # update's pause aborts and resubmits too, with the tokens so far).
    assert stay.engine.stats()["generated_tokens"] + leave.engine.stats()["generated_tokens"] == 8 * 30


def test_forgetting_a_server_drops_it_at_once_and_a_name_not_in_the_pool_is_refused(start):
    a, b = start(), start()

    async def scenario():
        async with ServerPool([a.url, b.url], config=fast()) as pool:
            pool.forget("gen_server1")
            with pytest.raises(ValueError, match=r"no generation server gen_server7 in the pool \(gen_server0\)"):
                pool.leave("gen_server7")
            answers = await asyncio.gather(*[pool.generate(PROMPT, GREEDY) for _ in range(4)])
            return answers, [s.name for s in pool.servers]

    answers, names = asyncio.run(scenario())
    assert names == ["gen_server0"] and len(answers) == 4 and finished(b) == 0


def test_a_call_begun_on_servers_one_of_which_is_then_forgotten_leaves_it_out_rather_than_failing(start):
    """An update takes its servers, pauses them, and continues them later; a server removed from
    the run meanwhile (its client closed by `forget`) counts as one that cannot be reached: the
    others are continued, the update goes on. So do a request's background abort on it and a
    request tried on it. (Its closed client used to raise a RuntimeError that escaped the pool.)"""
    a, b = start(), start()

    async def scenario():
        async with ServerPool([a.url, b.url], config=fast()) as pool:
            servers = list(pool.servers)
            paused, refused = await pool.call_each("pause", servers, lambda c: c.pause_generation("abort"))
            pool.forget("gen_server1")
            await asyncio.sleep(0.05)  # the client's close, in the background
            continued, refused_again = await pool.call_each("continue", servers, lambda c: c.continue_generation())
            answer = await pool.generate(PROMPT, GREEDY)
            await pool._abort(servers[1], "some-rid")  # logged, not raised
            return [s.name for s in paused], [s.name for s in continued], refused + refused_again, answer

    paused, continued, refused, answer = asyncio.run(scenario())
    assert paused == ["gen_server0", "gen_server1"] and continued == ["gen_server0"] and refused == []
    assert len(answer["output_ids"]) == 12 and not a.engine.paused and b.engine.paused
