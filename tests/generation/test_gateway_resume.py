"""An agent's call cut by a weight update (an interruptible run) is carried on by the gateway
(agents/resume.py): the agent gets one whole answer, the record keeps every token with the version
that made it, and a seeded call draws the tokens an uncut call draws (same weights reloaded), on
`/v1/completions` and on `/v1/chat/completions` alike."""

from __future__ import annotations

import asyncio

import pytest
from generation_helpers import async_wait_until, running_server, save_chat_model

from areal_flow.agents import resume
from areal_flow.agents.gateway import Gateway
from areal_flow.generation.client.generation_client import GenerationClient
from areal_flow.generation.client.router import ServerPool

openai = pytest.importorskip("openai")  # the dev extra's; not on the GPU image

MAX = 40


@pytest.fixture(scope="module")
def slowed(tmp_path_factory):
    """A server whose every forward sleeps: a call is still decoding when the update comes."""
    path = tmp_path_factory.mktemp("chat_model")
    tokenizer = save_chat_model(path)
    with running_server(str(path), step_delay=0.02) as server:
        yield str(path), tokenizer, server


def call(client, model: str, chat: bool):
    kw = dict(model=model, max_tokens=MAX, temperature=1.0, seed=35)  # a seed that draws 40 tokens on both
    if chat:
        return client.chat.completions.create(messages=[{"role": "user", "content": "Add 2 and 3."}], **kw)
    return client.completions.create(prompt="def add(a, b):", **kw)


def plain_and_cut(model: str, tokenizer, server, chat: bool):
    """The same seeded call twice through the gateway: once alone, once cut by a weight update."""
    async def main():
        async with ServerPool([server.url]) as pool, GenerationClient(server.url) as control:
            gateway = Gateway(pool, tokenizer=tokenizer)
            await gateway.start()
            try:
                client = openai.AsyncOpenAI(base_url=gateway.base_url("k"), api_key="unused", max_retries=0)
                plain = await call(client, model, chat)
                gateway.take("k")
                made = server.engine.stats()["generated_tokens"]
                cut = asyncio.ensure_future(call(client, model, chat))
                await async_wait_until(lambda: server.engine.stats()["generated_tokens"] >= made + 5, "5 tokens")
                await control.update_weights_from_disk(model, abort_all_requests=True)  # the same weights
                return plain, await cut, gateway.take("k")
            finally:
                await gateway.stop()

    return asyncio.run(main())


@pytest.mark.slow  # a slowed server: 2.5 s each; the fast tier keeps its 3 minutes
@pytest.mark.parametrize("chat", [False, True], ids=["completions", "chat"])
def test_a_call_cut_by_a_weight_update_comes_back_whole_with_the_tokens_an_uncut_call_draws(slowed, chat):
    model, tokenizer, server = slowed
    plain, cut, record = plain_and_cut(model, tokenizer, server, chat)
    (p,), (c,) = plain.choices, cut.choices
    assert len(p.token_ids) == MAX, "the seed must draw a long answer for the cut to fall inside it"
    assert c.resumes >= 1 and c.finish_reason == p.finish_reason == "length"
    assert c.token_ids == p.token_ids  # the seeded stream went on where it stopped
    assert c.output_token_logprobs == pytest.approx(p.output_token_logprobs, abs=1e-4)
    versions = c.output_token_versions
    assert versions[0] < versions[-1] and versions == sorted(versions)  # each token keeps its own
    assert (c.message.content if chat else c.text) == (p.message.content if chat else p.text)
    assert cut.usage.completion_tokens == MAX
    (trajectory,) = record.trajectories  # recorded whole: one answer, every token the policy's
    assert record.resumes == c.resumes and trajectory.output_ids == c.token_ids
    assert trajectory.loss_mask == [1] * MAX and trajectory.versions == versions


def test_a_stitched_choice_is_derived_again_from_all_its_tokens(tmp_path):
    tokenizer = save_chat_model(tmp_path)
    ids = tokenizer.encode('<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>',
                           add_special_tokens=False)
    body = {"model": "m", "max_tokens": 100, "seed": 5, "temperature": 0.7, "stop": ["\n\n"],
            "tools": [{"type": "function", "function": {"name": "python"}}]}
    first = {"token_ids": ids[:10], "output_token_logprobs": [-1.0] * 10, "output_token_versions": [3] * 10,
             "finish_reason": "abort", "matched_stop": None, "weight_version": "3"}
    rest = resume.continuation(body, [1, 2], 1, first["token_ids"], resume.budget(body) - len(first["token_ids"]))
    assert rest == {"model": "m", "prompt": [1, 2, *ids[:10]], "max_tokens": 90, "temperature": 0.7, "top_p": None,
                    "stop": ["\n\n"], "n": 1, "seed": 6}  # choice 1 of the call draws from seed + 1
    more = resume.piece({"token_ids": ids[10:] + [tokenizer.eos_token_id], "output_token_logprobs": [-2.0] * (len(ids) - 9),
                         "output_token_versions": [4] * (len(ids) - 9), "finish_reason": "stop",
                         "matched_stop": tokenizer.eos_token_id, "weight_version": "4"})
    first = resume.stitched(first, resume.piece(first).then(more))
    assert first["token_ids"] == ids + [tokenizer.eos_token_id] and first["output_token_versions"][9:11] == [3, 4]
    assert first["matched_stop"] == tokenizer.eos_token_id and first["weight_version"] == "4"  # the last piece's end
    whole = resume.rederived(body, True, 1, first, "m", tokenizer)
    assert whole["finish_reason"] == "tool_calls" and whole["index"] == 1
    (tool_call,) = whole["message"]["tool_calls"]
    assert tool_call["function"] == {"name": "python", "arguments": '{"code": "1"}'}
    assert resume.budget(body) == 100
    assert resume.budget({"model": "m"}) is None  # no limit: up to the context, the server's rule
