"""Streaming through the agents' gateway (agents/stream.py), driven by the official `openai` client
against a real server: the server's chunks reach the agent as they are generated (the first long
before the answer ends), a streamed call is recorded token for token as the same call unstreamed,
an answer a weight update cuts goes on in the same stream, and an agent that leaves mid-stream
frees the server's request. With a stand-in pool: a cut tool call's end derived from all its
tokens, a server failing mid-stream, a server failing before it, and SGLang's emulated stream."""

from __future__ import annotations

import asyncio
import time

import msgspec
import pytest
from generation_helpers import async_wait_until, http_call, running_server, save_chat_model

from areal_flow.agents.gateway import Gateway
from areal_flow.config.schema import RolloutConfig
from areal_flow.generation.client.generation_client import GenerationClient
from areal_flow.generation.client.router import ServerPool, StreamCut
from areal_flow.runtime.ports import free_ports

openai = pytest.importorskip("openai")  # the dev extra's; not on the GPU image

TOOLS = [{"type": "function", "function": {"name": "python", "parameters": {"type": "object", "properties": {}}}}]
MESSAGES = [{"role": "user", "content": "Add 2 and 3."}]
PROMPT = "def add(a, b):"
STEP = 0.01  # seconds slept before each forward: a call still decodes when a test acts on it


@pytest.fixture(scope="module")
def slowed(tmp_path_factory):
    path = tmp_path_factory.mktemp("chat_model")
    tokenizer = save_chat_model(path)
    with running_server(str(path), step_delay=STEP) as server:
        yield str(path), tokenizer, server


def create(client, model: str, kind: str, **kw):
    """A call of `kind` (completions, chat, chat_tools) with the client's keywords."""
    if kind == "completions":
        return client.completions.create(model=model, prompt=PROMPT, **kw)
    tools = {"tools": TOOLS} if kind == "chat_tools" else {}
    return client.chat.completions.create(model=model, messages=MESSAGES, **tools, **kw)


def text_of(choice, chat: bool) -> str:
    return (choice.delta.content or "") if chat else (choice.text or "")


async def joined(stream, chat: bool) -> tuple[dict[int, str], dict[int, object], list]:
    """Each choice's text joined, each choice's last chunk, and every chunk of `stream`."""
    texts, lasts, chunks = {}, {}, []
    async for chunk in stream:
        chunks.append(chunk)
        for c in chunk.choices:
            texts[c.index] = texts.get(c.index, "") + text_of(c, chat)
            if c.finish_reason is not None:
                lasts[c.index] = c
    return texts, lasts, chunks


def through_gateway(pool_urls, tokenizer, body):
    """Run `body(gateway, client_for(key))` against a gateway in front of the servers at `pool_urls`."""
    async def main():
        async with ServerPool(pool_urls) as pool:
            gateway = Gateway(pool, tokenizer=tokenizer)
            await gateway.start()
            try:
                return await body(gateway, lambda key: openai.AsyncOpenAI(base_url=gateway.base_url(key),
                                                                          api_key="unused", max_retries=0))
            finally:
                await gateway.stop()

    return asyncio.run(main())


@pytest.mark.parametrize("kind", ["completions", "chat", "chat_tools"])
def test_a_streamed_call_is_recorded_as_the_same_call_whole_and_its_text_joins_to_the_whole_text(slowed, kind):
    model, tokenizer, server = slowed
    chat = kind != "completions"
    kw = dict(max_tokens=24, temperature=1.0, seed=1, n=1 if chat else 2)  # completions: two choices interleaved

    async def body(gateway, client_for):
        whole = await create(client_for("w"), model, kind, **kw)
        stream = await create(client_for("s"), model, kind, stream=True, stream_options={"include_usage": True}, **kw)
        texts, lasts, chunks = await joined(stream, chat)
        maps = gateway.texts.get("w"), gateway.texts.get("s")
        return whole, texts, lasts, chunks, maps, gateway.take("w"), gateway.take("s")

    whole, texts, lasts, chunks, (whole_map, stream_map), whole_rec, stream_rec = through_gateway(
        [server.url], tokenizer, body)
    assert len(whole.choices) == len(lasts) == kw["n"]
    for w in whole.choices:
        assert texts[w.index] == ((w.message.content or "") if chat else w.text)
        last = lasts[w.index]
        assert last.finish_reason == w.finish_reason and last.token_ids == w.token_ids
        assert last.output_token_logprobs == w.output_token_logprobs
        assert last.output_token_versions == w.output_token_versions and last.matched_stop == w.matched_stop
    pieces = len([c for c in chunks if c.choices])
    if kind == "chat_tools":
        assert pieces == 2  # the role, then the whole text at the end: the server holds it (a tool call?)
    else:  # piece by piece as generated, not one chunk a choice at its end
        assert pieces >= len(whole.choices) * len(whole.choices[0].token_ids) // 2
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens and not chunks[-1].choices
    assert stream_rec.calls == whole_rec.calls == kw["n"] and stream_rec.drifts == 0
    for s, w in zip(stream_rec.trajectories, whole_rec.trajectories, strict=True):
        assert (s.prompt_ids, s.output_ids, s.logprobs, s.versions, s.loss_mask) == \
               (w.prompt_ids, w.output_ids, w.logprobs, w.versions, w.loss_mask)
    assert stream_map == whole_map  # a text prompt's tokens learnt as from the whole call (text_map.py)
    assert (stream_map is not None) == (kind == "completions")


@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_the_first_chunk_of_a_long_answer_comes_before_a_quarter_of_its_time(slowed, kind, capsys):
    model, tokenizer, server = slowed
    kw = dict(max_tokens=128, temperature=1.0, seed=1)  # seed 1 draws all 128 tokens on both

    async def body(gateway, client_for):
        client = client_for("t")
        start = time.perf_counter()
        await create(client, model, kind, **kw)
        whole = time.perf_counter() - start
        start, first = time.perf_counter(), None
        async for chunk in await create(client, model, kind, stream=True, **kw):
            if first is None and chunk.choices and text_of(chunk.choices[0], kind != "completions"):
                first = time.perf_counter() - start  # the first of the answer's text, not chat's role chunk
            if chunk.choices and chunk.choices[0].finish_reason is not None:
                tokens = len(chunk.choices[0].token_ids)
        return whole, first, time.perf_counter() - start, tokens

    whole, first, total, tokens = through_gateway([server.url], tokenizer, body)
    with capsys.disabled():
        print(f"\n{kind}: {tokens} tokens streamed through the gateway: first chunk at {first * 1000:.0f} ms, "
              f"the whole stream {total * 1000:.0f} ms ({first / total:.1%}); unstreamed (the emulated stream's "
              f"first chunk): {whole * 1000:.0f} ms")
    assert tokens >= 64
    assert first < total / 4


def cut_mid_stream(model: str, tokenizer, server, kind: str):
    """The same seeded call, whole, then streamed and cut by a weight update after 5 tokens."""
    async def body(gateway, client_for):
        kw = dict(max_tokens=40, temperature=1.0, seed=35)  # draws 40 tokens on both (test_gateway_resume.py)
        plain = await create(client_for("p"), model, kind, **kw)
        async with GenerationClient(server.url) as control:
            made = server.engine.stats()["generated_tokens"]
            stream = await create(client_for("k"), model, kind, stream=True, stream_options={"include_usage": True},
                                  **kw)
            reading = asyncio.ensure_future(joined(stream, kind != "completions"))
            await async_wait_until(lambda: server.engine.stats()["generated_tokens"] >= made + 5, "5 tokens")
            await control.update_weights_from_disk(model, abort_all_requests=True)  # the same weights
            texts, lasts, chunks = await reading
        return plain, texts, lasts, chunks, gateway.take("k")

    return through_gateway([server.url], tokenizer, body)


@pytest.mark.slow  # a slowed server: ~2 s each
@pytest.mark.parametrize("kind", ["completions", "chat"])
def test_an_answer_cut_by_a_weight_update_mid_stream_goes_on_in_the_same_stream(slowed, kind):
    model, tokenizer, server = slowed
    plain, texts, lasts, chunks, record = cut_mid_stream(model, tokenizer, server, kind)
    (p,), c = plain.choices, lasts[0]
    assert c.resumes >= 1 and c.finish_reason == p.finish_reason == "length"
    assert all(x.finish_reason != "abort" for chunk in chunks for x in chunk.choices)  # the cut never went out
    assert texts[0] == ((p.message.content or "") if kind == "chat" else p.text)  # one stream, the whole text
    pieces = [x for chunk in chunks for x in chunk.choices if text_of(x, kind == "chat")]
    assert len(pieces) >= 30  # the continuation streamed too, token by token (not one chunk at its end)
    assert c.token_ids == p.token_ids and c.output_token_logprobs == pytest.approx(p.output_token_logprobs, abs=1e-4)
    versions = c.output_token_versions
    assert versions[0] < versions[-1] and versions == sorted(versions)  # each token keeps its own
    assert chunks[-1].usage.completion_tokens == 40
    (trajectory,) = record.trajectories  # recorded as a whole call's: the stitched answer
    assert record.resumes == c.resumes and record.calls == 1
    assert trajectory.output_ids == c.token_ids and trajectory.versions == versions
    assert trajectory.loss_mask == [1] * 40


def test_an_agent_that_leaves_mid_stream_frees_the_server_s_request(slowed):
    model, tokenizer, server = slowed
    engine = server.engine

    async def body(gateway, client_for):
        before = engine.stats()["generated_tokens"]
        # Greedy, this model's answer runs to its budget: 600 tokens, 6 s at STEP a forward.
        stream = await create(client_for("gone"), model, "completions", stream=True, max_tokens=600, temperature=0)
        seen = 0
        async for chunk in stream:
            seen += bool(chunk.choices and chunk.choices[0].text)
            if seen == 3:
                break
        await stream.close()  # the agent leaves: its connection to the gateway closes
        await async_wait_until(engine.is_idle, "the server to abort the request", timeout=30)
        await asyncio.sleep(0.3)  # anything late would be recorded by now
        return before, gateway, gateway.take("gone")

    before, gateway, record = through_gateway([server.url], tokenizer, body)
    assert engine.stats()["generated_tokens"] - before < 300  # of 600: it did not decode on for nobody
    status, _, loads = http_call(server.url, "GET", "/v1/loads")
    assert status == 200 and loads["loads"][0]["num_running_reqs"] == 0
    assert record.calls == 0 and not record.trajectories  # nothing recorded of a call the agent left


# ---- a stand-in pool: the tool call, failures --------------------------------------------------


class StandInPool:
    """A ServerPool's `stream` playing the server's streams in order; `asked` keeps each call."""

    def __init__(self, *streams: list) -> None:
        self.streams, self.asked = list(streams), []

    async def stream(self, path: str, data: bytes, *, key: str | None = None):
        self.asked.append((path, msgspec.json.decode(data)))
        for event in self.streams.pop(0):
            if isinstance(event, BaseException):
                raise event
            yield msgspec.json.encode(event)


def chunk(choice: dict, chat: bool = True, **fields) -> dict:
    return {"id": "x", "object": "chat.completion.chunk" if chat else "text_completion", "created": 1, "model": "m",
            "choices": [{"index": 0, "logprobs": None, "finish_reason": None, **choice}], **fields}


def ends(ids: list[int], reason: str, version: int, matched=None) -> dict:
    return {"finish_reason": reason, "token_ids": ids, "output_token_logprobs": [-1.0] * len(ids),
            "output_token_versions": [version] * len(ids), "weight_version": str(version), "matched_stop": matched}


def with_stand_in(tmp_path, pool: StandInPool, call):
    tokenizer = save_chat_model(tmp_path)

    async def main():
        gateway = Gateway(pool, tokenizer=tokenizer)
        await gateway.start()
        try:
            client = openai.AsyncOpenAI(base_url=gateway.base_url("k"), api_key="unused", max_retries=0)
            return await call(client), gateway.take("k")
        finally:
            await gateway.stop()

    return tokenizer, asyncio.run(main())


def test_a_tool_call_cut_mid_stream_ends_with_its_calls_derived_from_all_its_tokens(tmp_path):
    tokenizer = save_chat_model(tmp_path / "tok")
    ids = tokenizer.encode('<tool_call>{"name": "python", "arguments": {"code": "1"}}</tool_call>',
                           add_special_tokens=False)
    eos = tokenizer.eos_token_id
    text = tokenizer.decode(ids)
    pool = StandInPool(  # the server holds a tool-calling chat's text until the choice ends: role, then the end
        [chunk({"delta": {"role": "assistant", "content": ""}}),
         chunk({"delta": {"content": tokenizer.decode(ids[:10])}, **ends(ids[:10], "abort", 3)},
               prompt_token_ids=[1, 2])],
        [chunk({"text": text[10:20]}, chat=False), chunk({"text": text[20:]}, chat=False),
         chunk({"text": "", **ends(ids[10:] + [eos], "stop", 4, eos)}, chat=False, prompt_token_ids=[1, 2, *ids[:10]])])

    async def call(client):
        return [c async for c in await client.chat.completions.create(
            model="m", messages=MESSAGES, tools=TOOLS, max_tokens=100, seed=5, stream=True)]

    _, (chunks, record) = with_stand_in(tmp_path / "m", pool, call)
    role, last = chunks  # no markup streamed: the tool call's text is held to its end
    assert role.choices[0].delta.role == "assistant"
    end = last.choices[0]
    assert end.finish_reason == "tool_calls" and end.resumes == 1 and not end.delta.content
    (tool_call,) = end.delta.tool_calls
    assert tool_call.function.name == "python" and tool_call.function.arguments == '{"code": "1"}'
    assert end.token_ids == ids + [eos] and end.output_token_versions == [3] * 10 + [4] * (len(ids) - 9)
    path, rest = pool.asked[1]  # the rest asked for on the exact tokens, streamed
    assert path == "/v1/completions" and rest["prompt"] == [1, 2, *ids[:10]] and rest["stream"] is True
    assert rest["max_tokens"] == 90 and rest["seed"] == 5
    (trajectory,) = record.trajectories
    assert record.resumes == 1 and trajectory.output_ids == ids + [eos] and trajectory.prompt_ids == [1, 2]


def test_a_character_split_at_a_cut_holds_the_rest_of_the_text_to_the_end(tmp_path):
    tokenizer = save_chat_model(tmp_path / "tok")
    ids = tokenizer.encode("return a + b", add_special_tokens=False)
    text = tokenizer.decode(ids)
    pool = StandInPool(  # the cut piece's text ends in a partly decoded character (a byte-level tokenizer's)
        [chunk({"text": text[:3]}, chat=False),
         chunk({"text": text[3:5] + "\ufffd", **ends(ids[:6], "abort", 0)}, chat=False, prompt_token_ids=[1])],
        [chunk({"text": "\ufffd" + text[6:9]}, chat=False),
         chunk({"text": text[9:], **ends(ids[6:], "length", 1)}, chat=False, prompt_token_ids=[1, *ids[:6]])])

    async def call(client):
        return [c async for c in await client.completions.create(model="m", prompt=[1], max_tokens=len(ids),
                                                                  stream=True)]

    _, (chunks, record) = with_stand_in(tmp_path / "m", pool, call)
    assert [c.choices[0].text for c in chunks] == [text[:3], text[3:5], text[5:]]  # nothing of the seam's guess
    assert chunks[-1].choices[0].finish_reason == "length" and chunks[-1].choices[0].token_ids == ids
    assert record.trajectories[0].output_ids == ids and record.resumes == 1


def test_a_server_failing_mid_stream_ends_the_agent_s_stream_with_an_error_and_records_nothing(tmp_path):
    pool = StandInPool([chunk({"text": "ab"}, chat=False), StreamCut("gen_server0 failed in the middle")])

    async def call(client):
        got = []
        with pytest.raises(openai.APIError, match="failed in the middle"):
            async for c in await client.completions.create(model="m", prompt=[1, 2], max_tokens=5, stream=True):
                got.append(c)
        return got

    _, (got, record) = with_stand_in(tmp_path, pool, call)
    assert [c.choices[0].text for c in got] == ["ab"] and record.calls == 0


def test_a_server_failing_before_the_first_chunk_is_left_for_another(slowed):
    model, tokenizer, server = slowed
    dead = f"http://127.0.0.1:{free_ports(1)[0]}"  # nothing listens there: the connection is refused

    async def main():
        config = RolloutConfig(retry_backoff=0.0)
        async with ServerPool([dead, server.url], config=config) as pool:
            body = msgspec.json.encode({"model": model, "prompt": PROMPT, "max_tokens": 4, "stream": True})
            events = [msgspec.json.decode(e) async for e in pool.stream("/v1/completions", body, key="k")]
            return events, pool.down(), [s.in_flight for s in pool.servers]

    events, down, in_flight = asyncio.run(main())
    assert down == ["gen_server0"] and in_flight == [0, 0]
    assert len(events[-1]["choices"][0]["token_ids"]) == 4 and "prompt_token_ids" in events[-1]


@pytest.mark.slow  # the SGLang stand-in's process
def test_sglang_s_stream_stays_emulated_and_is_recorded_as_a_whole_call(tmp_path):
    from test_gateway_sglang import standin

    model = str(tmp_path / "m")
    tokenizer = save_chat_model(tmp_path / "m")
    proc, url = standin(model)
    try:
        async def main():
            async with ServerPool([url]) as pool:
                gateway = Gateway(pool, tokenizer=tokenizer, backend="sglang")
                await gateway.start()
                try:
                    client = openai.AsyncOpenAI(base_url=gateway.base_url("w"), api_key="unused", max_retries=0)
                    whole = await create(client, model, "chat", max_tokens=8, temperature=0)
                    client = openai.AsyncOpenAI(base_url=gateway.base_url("s"), api_key="unused", max_retries=0)
                    streamed = await joined(await create(client, model, "chat", max_tokens=8, temperature=0,
                                                         stream=True), True)
                    return whole, streamed, gateway.take("w"), gateway.take("s")
                finally:
                    await gateway.stop()

        whole, (texts, lasts, _), whole_rec, stream_rec = asyncio.run(main())
    finally:
        proc.terminate()
        proc.wait(timeout=30)
    assert texts[0] == whole.choices[0].message.content and lasts[0].token_ids == whole.choices[0].token_ids
    (s,), (w,) = stream_rec.trajectories, whole_rec.trajectories
    assert (s.prompt_ids, s.output_ids, s.versions) == (w.prompt_ids, w.output_ids, w.versions)
