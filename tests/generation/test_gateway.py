"""The agents' gateway (agents/gateway.py) in front of two real servers, driven by the official
`openai` client as an agent would: a rollout's calls stay on one server and are linked into one
trajectory with the tool's result masked; an agent that edits its history has the drift counted
and nothing trained on the edited tokens; a refused request comes back as the server refused it,
and a streamed one is refused by name."""

from __future__ import annotations

import asyncio
import shutil

import pytest
from generation_helpers import running_server, save_chat_model

from areal_flow.agents.gateway import Gateway
from areal_flow.generation.client.router import ServerPool

openai = pytest.importorskip("openai")  # the dev extra's; not on the GPU image

TOOLS = [{"type": "function", "function": {"name": "python", "parameters": {"type": "object", "properties": {}}}}]


@pytest.fixture(scope="module")
def two_servers(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat_model")
    tokenizer = save_chat_model(path)
    with running_server(str(path)) as a, running_server(str(path)) as b:
        yield str(path), tokenizer, (a, b)


async def agent(client, model: str, edit: bool) -> None:
    """Two calls: the second sends the first answer back with a tool result (edited, if `edit`)."""
    messages = [{"role": "user", "content": "Add 2 and 3."}]
    first = await client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=5,
                                                 temperature=0)
    said = first.choices[0].message.content
    if edit:  # a character of its own answer changed: what a template that rewrites history does
        said = said[:1] + "!" + said[2:]
    messages += [{"role": "assistant", "content": said}, {"role": "tool", "content": "5"}]
    await client.chat.completions.create(model=model, messages=messages, tools=TOOLS, max_tokens=5, temperature=0)


def run_agents(model: str, servers, edits: dict[str, bool]):
    async def main():
        async with ServerPool([s.url for s in servers]) as pool:
            gateway = Gateway(pool)
            await gateway.start()
            try:
                clients = {key: openai.AsyncOpenAI(base_url=gateway.base_url(key), api_key="unused", max_retries=0)
                           for key in edits}
                await asyncio.gather(*[agent(clients[key], model, edit) for key, edit in edits.items()])
                client = next(iter(clients.values()))
                with pytest.raises(openai.BadRequestError, match="messages must be a non-empty list"):
                    await client.chat.completions.create(model=model, messages=[], max_tokens=2)
                with pytest.raises(openai.BadRequestError, match="stream_options must be an object"):
                    await client.chat.completions.create(model=model, messages=[{"role": "user", "content": "x"}],
                                                         max_tokens=2, stream=True, stream_options=3)
                return {key: gateway.take(key) for key in edits}
            finally:
                await gateway.stop()

    return asyncio.run(main())


def finished(server) -> int:
    return server.engine.stats()["num_finished_reqs"]


def test_an_agent_s_calls_make_one_trajectory_on_one_server_with_the_tool_result_masked(two_servers):
    model, tokenizer, servers = two_servers
    before = [finished(s) for s in servers]
    (recorder,) = run_agents(model, servers, {"a": False}).values()
    served = [finished(s) - b for s, b in zip(servers, before)]
    assert sorted(served) == [0, 2]  # both calls on the key's server
    (trajectory,) = recorder.trajectories
    assert recorder.drifts == 0 and trajectory.calls == 2
    text = tokenizer.decode(trajectory.output_ids)
    observation = [t for t, m in zip(trajectory.output_ids, trajectory.loss_mask) if m == 0]
    assert "<tool_response>\n5\n</tool_response>" in tokenizer.decode(observation)  # masked, never trained
    assert trajectory.loss_mask.count(1) == 10 and text.endswith(tokenizer.decode(trajectory.output_ids[-5:]))
    assert len(trajectory.logprobs) == len(trajectory.versions) == len(trajectory.output_ids)


def test_an_agent_that_edits_its_history_drifts_and_nothing_edited_is_trained(two_servers):
    model, tokenizer, servers = two_servers
    records = run_agents(model, servers, {"honest": False, "editor": True})
    assert records["honest"].drifts == 0 and len(records["honest"].trajectories) == 1
    editor = records["editor"]
    assert editor.drifts == 1 and editor.drift_rate == 0.5 and len(editor.trajectories) == 2
    first, second = editor.trajectories
    assert first.calls == 1 and second.calls == 1  # the edited history starts a new sample ...
    assert "!" in tokenizer.decode(second.prompt_ids) and second.loss_mask == [1] * len(second.output_ids)
    (example,) = editor.examples  # ... as its prompt, never trained; the example shows where
    assert tokenizer.decode(example.sent).startswith("!")


def test_a_streamed_call_gets_the_answer_s_chunks_and_is_recorded_like_a_whole_one(two_servers):
    model, tokenizer, servers = two_servers

    async def main():
        async with ServerPool([servers[0].url]) as pool:
            gateway = Gateway(pool)
            await gateway.start()
            try:
                client = openai.AsyncOpenAI(base_url=gateway.base_url("s"), api_key="unused", max_retries=0)
                kw = dict(model=model, messages=[{"role": "user", "content": "Add 2 and 3."}], tools=TOOLS,
                          max_tokens=12, temperature=1.0, seed=3)
                whole = await client.chat.completions.create(**kw)
                chunks = [c async for c in await client.chat.completions.create(
                    **kw, stream=True, stream_options={"include_usage": True})]
                text = [c async for c in await client.completions.create(
                    model=model, prompt="def f(", max_tokens=6, temperature=0, stream=True)]
                return whole, chunks, text, gateway.take("s")
            finally:
                await gateway.stop()

    whole, chunks, text, record = asyncio.run(main())
    (w,) = whole.choices
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert streamed == (w.message.content or "") and chunks[0].choices[0].delta.role == "assistant"
    last = [c.choices[0] for c in chunks if c.choices][-1]
    assert last.finish_reason == w.finish_reason and last.token_ids == w.token_ids  # the extension fields too
    assert chunks[-1].usage.completion_tokens == len(w.token_ids) and not chunks[-1].choices
    t = text[-1].choices[0]  # streamed as generated: the text in pieces, the tokens in the last chunk
    joined = "".join(c.choices[0].text for c in text)
    assert t.finish_reason == "length" and len(t.token_ids) == 6
    assert joined == tokenizer.decode(t.token_ids, skip_special_tokens=True)
    assert record.calls == 3 and record.drifts == 0  # streamed calls recorded as whole ones
    assert [tr.output_ids for tr in record.trajectories] == [w.token_ids, last.token_ids, t.token_ids]


def test_the_gateway_sends_a_completions_prompt_as_its_tokens(tmp_path):
    # A server whose model directory has no tokenizer refuses text prompts: through a gateway that
    # has the policy's tokenizer the same call goes through, as the tokens the server would have made.
    tokenizer = save_chat_model(tmp_path / "with")
    (tmp_path / "bare").mkdir()
    for name in ("config.json", "model.safetensors"):
        shutil.copy(tmp_path / "with" / name, tmp_path / "bare" / name)
    model = str(tmp_path / "bare")

    async def main():
        with running_server(model) as server:
            async with ServerPool([server.url]) as pool:
                gateways = [Gateway(pool, tokenizer=tokenizer), Gateway(pool)]
                for gateway in gateways:
                    await gateway.start()
                try:
                    tokens, text = (openai.AsyncOpenAI(base_url=g.base_url("k"), api_key="unused", max_retries=0)
                                    for g in gateways)
                    out = await tokens.completions.create(model=model, prompt="def f(", max_tokens=3, temperature=0)
                    with pytest.raises(openai.BadRequestError, match="a text prompt needs the model's tokenizer"):
                        await text.completions.create(model=model, prompt="def f(", max_tokens=3)
                    return out, gateways[0].take("k")
                finally:
                    for gateway in gateways:
                        await gateway.stop()

    out, record = asyncio.run(main())
    assert out.prompt_token_ids == tokenizer.encode("def f(", add_special_tokens=False)
    assert record.trajectories[0].prompt_ids == out.prompt_token_ids and len(out.choices[0].token_ids) == 3
