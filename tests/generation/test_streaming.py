"""Streamed /generate (server-sent events) on a real server and the aiohttp client: SGLang's
framing and cumulative chunks, stream_interval, the same tokens as a whole answer, batch and n
streams, and a client that leaves mid-stream gets its request aborted."""

from __future__ import annotations

import asyncio
import json
import socket
import threading
import time

import pytest
import torch
from generation_helpers import ModelDirs, before_every_forward, http_call, load_reference, running_server, wait_until

from areal_flow.generation.client.generation_client import GenerationClient
from areal_flow.generation.http.server import GenerationServer, serve

PROMPT = [2, 7, 3, 9]


def stream_chunks(server: GenerationServer, prompt: list[int], sampling: dict, **kw) -> list[dict]:
    async def collect() -> list[dict]:
        async with GenerationClient(server.url) as client:
            return [chunk async for chunk in client.generate_stream(prompt, sampling, **kw)]

    return asyncio.run(collect())


def raw_events(server: GenerationServer, body: dict) -> tuple[str, list[str]]:
    """The content type and the `data:` payloads of a streamed answer, read off the wire."""
    status, headers, payload = http_call(server.url, "POST", "/generate", {**body, "stream": True})
    assert status == 200, payload
    events = payload.split("\n\n")
    assert events[-1] == "" and all(e.startswith("data: ") for e in events[:-1]), payload
    return headers["content-type"], [e.removeprefix("data: ") for e in events[:-1]]


@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "sampling_seed": 1234}],
                         ids=["greedy", "seeded"])
def test_a_stream_gives_the_tokens_logprobs_and_versions_of_the_whole_answer(server_a, sampling):
    sampling = {"max_new_tokens": 12, "ignore_eos": True, **sampling}
    status, _, whole = http_call(server_a.url, "POST", "/generate",
                                 {"input_ids": PROMPT, "sampling_params": sampling, "return_logprob": True})
    assert status == 200
    chunks = stream_chunks(server_a, PROMPT, sampling, rid="s1")

    last = chunks[-1]
    assert last["output_ids"] == whole["output_ids"] and last["text"] == whole["text"]
    meta, whole_meta = last["meta_info"], whole["meta_info"]
    assert meta["id"] == "s1" and meta["finish_reason"] == whole_meta["finish_reason"]
    assert meta["output_token_versions"] == whole_meta["output_token_versions"] == [0] * 12
    assert [t[1] for t in meta["output_token_logprobs"]] == whole["output_ids"]
    torch.testing.assert_close(torch.tensor([t[0] for t in meta["output_token_logprobs"]]),
                               torch.tensor([t[0] for t in whole_meta["output_token_logprobs"]]), atol=1e-5, rtol=0)
    # Cumulative chunks (SGLang's default): each extends the one before; only the last is finished.
    assert [len(c["output_ids"]) for c in chunks] == list(range(1, 13))
    for chunk in chunks:
        n = len(chunk["output_ids"])
        assert chunk["output_ids"] == last["output_ids"][:n] and chunk["meta_info"]["completion_tokens"] == n
        assert chunk["meta_info"]["output_token_logprobs"] == meta["output_token_logprobs"][:n]
        assert "index" not in chunk  # a single prompt: no index, as in SGLang
    assert all(c["meta_info"]["finish_reason"] is None for c in chunks[:-1])


def test_sse_framing_ends_with_done(server_a):
    content_type, events = raw_events(server_a, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 3}})
    assert content_type.startswith("text/event-stream")
    assert events[-1] == "[DONE]" and len(events) == 4
    assert [len(json.loads(e)["output_ids"]) for e in events[:-1]] == [1, 2, 3]


@pytest.mark.parametrize(("interval", "lengths"), [(1, list(range(1, 11))), (3, [1, 4, 7, 10]), (4, [1, 5, 9, 10])])
def test_stream_interval_sends_a_chunk_every_interval_tokens_from_the_first(server_a, interval, lengths):
    chunks = stream_chunks(server_a, PROMPT, {"max_new_tokens": 10, "ignore_eos": True, "stream_interval": interval})
    assert [len(c["output_ids"]) for c in chunks] == lengths  # and always the final one


def test_batch_and_n_streams_interleave_chunks_with_their_index(server_a):
    body = {"input_ids": [PROMPT, [5, 6]], "return_logprob": True,
            "sampling_params": {"max_new_tokens": 6, "temperature": 0, "ignore_eos": True, "n": 2}}
    status, _, whole = http_call(server_a.url, "POST", "/generate", body)
    assert status == 200 and len(whole) == 4
    _, events = raw_events(server_a, body)
    assert events[-1] == "[DONE]"
    chunks = [json.loads(e) for e in events[:-1]]
    finals = {}
    for chunk in chunks:
        index = chunk["index"]
        assert 0 <= index < 4
        if chunk["meta_info"]["finish_reason"] is not None:
            assert index not in finals
            finals[index] = chunk
    assert sorted(finals) == [0, 1, 2, 3]
    for index, answer in enumerate(whole):  # prompt-major: p0s0, p0s1, p1s0, p1s1
        assert finals[index]["output_ids"] == answer["output_ids"]
    assert len({c["meta_info"]["id"] for c in chunks}) == 4


@pytest.fixture
def slow_server(model_dirs: ModelDirs) -> GenerationServer:
    with running_server(model_dirs.a, max_batch_size=8, step_delay=0.005) as server:
        yield server


def test_a_client_that_leaves_mid_stream_gets_its_request_aborted(slow_server):
    engine = slow_server.engine
    sampling = {"max_new_tokens": 240, "ignore_eos": True}

    async def leave_early() -> int:
        async with GenerationClient(slow_server.url) as client:
            seen = 0
            async for chunk in client.generate_stream(PROMPT, sampling, rid="gone"):
                seen = len(chunk["output_ids"])
                if seen >= 3:
                    break  # the iterator is dropped: its connection closes
            await asyncio.sleep(0)
            return seen

    before = engine.stats()["generated_tokens"]
    assert asyncio.run(leave_early()) == 3
    wait_until(lambda: engine.is_idle(), "the engine to abort the abandoned request", timeout=30)
    assert engine.stats()["generated_tokens"] - before < 200  # it did not decode on for nobody
    # The rid is free again: the request was answered (aborted), not left decoding.
    status, _, answer = http_call(slow_server.url, "POST", "/generate",
                                  {"input_ids": PROMPT, "rid": "gone", "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and answer["meta_info"]["id"] == "gone"


def test_a_client_that_leaves_a_plain_request_gets_it_aborted(slow_server):
    engine = slow_server.engine
    body = json.dumps({"input_ids": PROMPT, "rid": "left", "sampling_params": {"max_new_tokens": 240,
                                                                                "ignore_eos": True}}).encode()
    before = engine.stats()["generated_tokens"]
    with socket.create_connection(slow_server.server_address) as client:
        client.sendall(b"POST /generate HTTP/1.1\r\nHost: x\r\nContent-Type: application/json\r\n"
                       b"Content-Length: %d\r\n\r\n%s" % (len(body), body))
        wait_until(lambda: engine.stats()["generated_tokens"] > before, "the request to start decoding")
    # 240 tokens at 5 ms or more each would take over a second more; the server notices the closed
    # connection within its poll interval and aborts.
    wait_until(lambda: engine.is_idle(), "the engine to abort the abandoned request", timeout=30)
    assert engine.stats()["generated_tokens"] - before < 200
    status, _, answer = http_call(slow_server.url, "POST", "/generate",
                                  {"input_ids": PROMPT, "rid": "left", "sampling_params": {"max_new_tokens": 2}})
    assert status == 200 and answer["meta_info"]["id"] == "left"  # the rid was answered and freed


def test_a_stream_cut_by_shutdown_ends_with_an_error_event_and_done(model_dirs: ModelDirs):
    server, thread = serve(model_dirs.a)
    before_every_forward(server.engine, lambda *_: time.sleep(0.005))
    events: list[str] = []
    body = {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 240, "ignore_eos": True}}
    reader = threading.Thread(target=lambda: events.extend(raw_events(server, body)[1]))
    reader.start()
    try:
        wait_until(lambda: server.engine.stats()["generated_tokens"] > 3, "the stream to start")
    finally:
        server.stop()
        reader.join(timeout=30)
        thread.join(timeout=10)
    assert events[-1] == "[DONE]"
    assert "shut down" in json.loads(events[-2])["error"]["message"]
    assert json.loads(events[0])["meta_info"]["finish_reason"] is None


def test_a_stream_whose_decode_step_fails_ends_with_an_error_event_and_done(model_dirs: ModelDirs, tmp_path):
    model = load_reference(model_dirs.a)
    for parameter in model.parameters():
        parameter.data.fill_(float("nan"))  # sampling from NaN logits raises inside the engine
    model.save_pretrained(tmp_path / "nan")
    with running_server(str(tmp_path / "nan")) as server:
        _, events = raw_events(server, {"input_ids": PROMPT, "sampling_params": {"max_new_tokens": 4}})
        assert events[-1] == "[DONE]" and len(events) == 2
        assert json.loads(events[0])["error"]["message"]
        assert http_call(server.url, "GET", "/health")[0] == 200  # the server serves on
