"""Bad input to the HTTP server gets a clear 4xx and costs nothing else, on a real server over real
sockets (the official `openai` client where it can send the body): JSON nested too deeply, a
conversation the chat template refuses, OpenAI's error envelope naming the field at fault, a body
over the size limit, and a huge body parsed off the event loop while /health and a decoding
request are answered."""

from __future__ import annotations

import http.client
import json
import socket
import threading
import time
from pathlib import Path
from urllib.parse import urlsplit

import pytest
import torch
from generation_helpers import before_every_forward, http_call, running_server, save_chat_model
from transformers import Qwen2Config, Qwen2ForCausalLM

from areal_flow.generation.http.bodies import MAX_REQUEST_BYTES
from areal_flow.generation.http.server import GenerationServer
from areal_flow.models.tokenizer import CHAT_TEMPLATE, build_char_tokenizer

openai = pytest.importorskip("openai")

LIMIT = MAX_REQUEST_BYTES
"""The test server's max_request_bytes, the default: a 10.5 MB message is under it, a body of LIMIT + 1
bytes over."""

NO_USER_QUERY = "No user query found in messages."
REFUSING_TEMPLATE = ("{% if not (messages | selectattr('role', 'equalto', 'user') | list) %}"
                     "{{ raise_exception('" + NO_USER_QUERY + "') }}{% endif %}" + CHAT_TEMPLATE)
"""The project's ChatML, refusing a conversation without a user turn as Qwen3's template does."""

DEEP = 100_000
OPENAI_ROUTES = ("/v1/chat/completions", "/v1/completions")
USER = [{"role": "user", "content": "What is 2+3?"}]


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory: pytest.TempPathFactory):
    path = tmp_path_factory.mktemp("chat_model")
    tokenizer = save_chat_model(path)
    tokenizer.chat_template = REFUSING_TEMPLATE
    tokenizer.save_pretrained(path)
    with running_server(str(path), max_request_bytes=LIMIT) as server:
        yield server


@pytest.fixture(scope="module")
def client(chat_server: GenerationServer):
    return openai.OpenAI(base_url=f"{chat_server.url}/v1", api_key="unused", max_retries=0, timeout=120)


def _model(server: GenerationServer) -> str:
    return server.tokenizer_path


def _still_serves(server: GenerationServer, client) -> None:
    assert client.chat.completions.create(model=_model(server), messages=USER, max_tokens=2).choices
    status, _, answer = http_call(server.url, "POST", "/generate", {"text": "ab", "sampling_params": {
        "max_new_tokens": 2}})
    assert status == 200, answer


# ---- 6: JSON nested 100,000 deep ----------------------------------------------------------------


@pytest.mark.parametrize("path", [*OPENAI_ROUTES, "/generate", "/abort_request"])
@pytest.mark.parametrize("shape", ["array", "field"])
def test_json_nested_100000_deep_is_a_400_and_the_server_goes_on(chat_server, client, path, shape):
    nested = "[" * DEEP + "]" * DEEP
    raw = nested if shape == "array" else '{"model": "m", "messages": ' + nested + "}"
    status, _, answer = http_call(chat_server.url, "POST", path, raw.encode())
    assert status == 400, answer
    assert "nested too deeply" in answer["error"]["message"]
    if path in OPENAI_ROUTES:  # OpenAI's envelope
        assert answer["error"]["type"] == "invalid_request_error"
    _still_serves(chat_server, client)


def test_a_tool_schema_nested_too_deeply_for_the_chat_template_is_a_400(chat_server, client):
    """500 levels parse as JSON, but rendering the chat template copies the schema recursively
    (transformers' _plain_template_data, two frames a level): deeper than Python recurses."""
    schema: dict = {}
    inner = schema
    for _ in range(500):
        inner["a"] = {}
        inner = inner["a"]
    tools = [{"type": "function", "function": {"name": "f", "parameters": {"type": "object", "properties": schema}}}]
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=_model(chat_server), messages=USER, max_tokens=2, tools=tools)
    assert "nested too deeply" in caught.value.body["message"]
    _still_serves(chat_server, client)


# ---- 7: a conversation the chat template refuses ---------------------------------------------------


@pytest.mark.parametrize("messages", [
    [{"role": "system", "content": "Answer briefly."}],
    [{"role": "tool", "tool_call_id": "call_1", "content": "5"}],
], ids=["only a system message", "only a tool result"])
@pytest.mark.parametrize("stream", [False, True])
def test_a_conversation_the_template_refuses_is_a_400_naming_messages_and_why(chat_server, client, messages, stream):
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=_model(chat_server), messages=messages, max_tokens=2, stream=stream)
    error = caught.value.body
    assert error["param"] == "messages" and NO_USER_QUERY in error["message"], error
    _still_serves(chat_server, client)


# ---- 8: the error envelope names the field at fault -----------------------------------------------


@pytest.mark.parametrize("path,body,param", [
    ("/v1/completions", '{"model": "%s", "prompt": "def f(", "max_tokens": 2, "temperature": NaN}', "temperature"),
    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "temperature": NaN}',
     "temperature"),
    ("/v1/completions", '{"model": "%s", "prompt": "def f(", "max_tokens": 2, "top_p": NaN}', "top_p"),
    ("/v1/chat/completions", '{"model": "%s", "messages": [{"role": "user", "content": "hi"}], "top_p": Infinity}',
     "top_p"),
])
def test_a_number_that_is_not_finite_is_refused_naming_its_field(chat_server, client, path, body, param):
    """The openai client cannot send NaN (httpx refuses it); other clients do, and Python's json reads it."""
    status, _, answer = http_call(chat_server.url, "POST", path, (body % _model(chat_server)).encode())
    assert status == 400 and answer["error"]["param"] == param, answer
    assert "finite" in answer["error"]["message"]
    _still_serves(chat_server, client)


@pytest.mark.parametrize("chat", [True, False], ids=["chat", "completions"])
def test_a_seed_past_64_bits_is_refused_naming_seed(chat_server, client, chat):
    kw = dict(model=_model(chat_server), max_tokens=2, seed=2**64)
    with pytest.raises(openai.BadRequestError) as caught:
        if chat:
            client.chat.completions.create(messages=USER, **kw)
        else:
            client.completions.create(prompt="def f(", **kw)
    assert caught.value.body["param"] == "seed", caught.value.body


def test_the_last_64_bit_seed_with_n_choices_wraps_as_generate_does(chat_server, client):
    answer = client.completions.create(model=_model(chat_server), prompt="def f(", max_tokens=3, n=2,
                                       seed=2**64 - 1)
    assert len(answer.choices) == 2


@pytest.mark.parametrize("max_tokens", [None, 2])
def test_a_chat_over_the_context_names_messages_the_prompt_length_and_the_context(chat_server, client, max_tokens):
    messages = [{"role": "user", "content": "x" * 1100}]  # one token a character: over the context of 1024
    kw = {} if max_tokens is None else {"max_tokens": max_tokens}
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=_model(chat_server), messages=messages, **kw)
    error = caught.value.body
    text = chat_server.tokenizer.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    prompt = len(chat_server.tokenizer.encode(text, add_special_tokens=False))
    assert error["param"] == "messages" and error["code"] == "context_length_exceeded", error
    assert f"the prompt is {prompt} tokens" in error["message"] and "context is 1024 tokens" in error["message"]


def test_a_completion_prompt_over_the_context_names_prompt(chat_server, client):
    with pytest.raises(openai.BadRequestError) as caught:
        client.completions.create(model=_model(chat_server), prompt="x" * 1030)
    error = caught.value.body
    assert error["param"] == "prompt" and "the prompt is 1030 tokens" in error["message"], error


def _small_vocab_chat_model(path: Path) -> None:
    """A chat model of 7 tokens (<pad> <eos> <unk> a b and the two role markers)."""
    tokenizer = build_char_tokenizer("ab", chat=True)
    tokenizer.save_pretrained(path)
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=len(tokenizer), hidden_size=32, intermediate_size=64,
                                 num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                                 max_position_embeddings=1024, eos_token_id=tokenizer.eos_token_id,
                                 pad_token_id=tokenizer.pad_token_id)).save_pretrained(path)


@pytest.fixture(scope="module")
def small_server(tmp_path_factory: pytest.TempPathFactory):
    """A chat model of 7 tokens on a server whose KV cache budget (200) is below the context (1024)."""
    path = tmp_path_factory.mktemp("small_model")
    _small_vocab_chat_model(path)
    with running_server(str(path), max_total_tokens=200) as server:
        yield server, openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_more_top_logprobs_than_the_vocabulary_names_top_logprobs(small_server):
    server, client = small_server
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=_model(server), messages=USER, max_tokens=2, logprobs=True,
                                       top_logprobs=10)
    assert caught.value.body["param"] == "top_logprobs" and "[0, 7]" in caught.value.body["message"]


def test_a_chat_without_max_tokens_answers_up_to_a_kv_budget_below_the_context(small_server):
    server, client = small_server
    answer = client.chat.completions.create(model=_model(server), messages=USER)
    assert answer.usage.prompt_tokens + answer.usage.completion_tokens <= 200
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=_model(server), messages=[{"role": "user", "content": "a" * 300}])
    error = caught.value.body
    assert error["param"] == "messages" and "KV cache budget (max_total_tokens) is 200 tokens" in error["message"]


def test_stop_strings_on_a_server_without_a_tokenizer_name_stop(tmp_path):
    torch.manual_seed(0)
    Qwen2ForCausalLM(Qwen2Config(vocab_size=18, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                 num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256,
                                 eos_token_id=1, pad_token_id=0)).save_pretrained(tmp_path)
    with running_server(str(tmp_path)) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError) as caught:
            client.completions.create(model=str(tmp_path), prompt=[2, 3], max_tokens=2, stop=["x"])
        assert caught.value.body["param"] == "stop", caught.value.body


# ---- 9: a body over the limit, and huge bodies parsed off the event loop ---------------------------


def _raw(port: int, request: bytes) -> bytes:
    """Send raw bytes and read the answer until the server closes the connection."""
    with socket.create_connection(("127.0.0.1", port), timeout=60) as sock:
        sock.sendall(request)
        answer = b""
        while chunk := sock.recv(65536):
            answer += chunk
        return answer


def _too_large(port: int, path: str) -> tuple[bytes, dict]:
    head = f"POST {path} HTTP/1.1\r\nHost: x\r\nContent-Length: {LIMIT + 1}\r\n\r\n".encode()
    answer = _raw(port, head)
    return answer, json.loads(answer.split(b"\r\n\r\n", 1)[1])


@pytest.mark.parametrize("path", [*OPENAI_ROUTES, "/generate"])
def test_a_body_over_the_limit_is_a_413_naming_the_limit_and_the_key(chat_server, client, path):
    answer, error = _too_large(chat_server.server_address[1], path)
    assert answer.startswith(b"HTTP/1.1 413 "), answer[:200]
    message = error["error"]["message"]
    assert str(LIMIT) in message and "generation.max_request_bytes" in message and "\n" not in message
    if path in OPENAI_ROUTES:
        assert error["error"]["type"] == "invalid_request_error"
    _still_serves(chat_server, client)


def test_the_limit_is_generation_max_request_bytes_through_the_server_command_line(model_dirs):
    from generation_helpers import server_process

    from areal_flow.config.schema import GenerationConfig, RunConfig
    from areal_flow.graph.placement import Proc
    from areal_flow.launchers.commands import server_command

    cfg = RunConfig(generation=GenerationConfig(max_request_bytes=1000))
    argv, _ = server_command(cfg, Proc("gen_server0", "gen_server", (0,)), model_dirs.a, 0)
    flag = argv[argv.index("--max-request-bytes"):][:2]
    assert flag == ["--max-request-bytes", "1000"]
    with server_process(model_dirs.a, *flag) as (_, url, _):
        status, _, answer = http_call(url, "POST", "/generate", {"input_ids": [2] * 400})  # 1,200 bytes
        assert status == 413 and "limit of 1000 bytes (generation.max_request_bytes" in answer["error"]["message"]
        status, _, answer = http_call(url, "POST", "/generate", {"input_ids": [2, 3], "sampling_params": {
            "max_new_tokens": 2}})
        assert status == 200, answer


@pytest.mark.slow  # tokenizing 10.5 MB takes seconds and some 4 GB
def test_health_and_a_decoding_request_are_answered_while_huge_and_deep_bodies_are_handled(chat_server, client,
                                                                                             monkeypatch):
    """A 10.5 MB chat message is tokenized (and refused: over the context) while a body over the limit,
    two 100,000-deep bodies, a streamed /generate decoding 600 tokens and /health probes come and go.
    The huge message's tokenization is held open until the others have been answered, so that they
    must be answered while it runs: on the event loop it would hold up every one of them."""
    server = chat_server
    port = server.server_address[1]
    tokenizer = server.tokenizer
    encode = tokenizer.encode
    tokenizing, release = threading.Event(), threading.Event()

    def held_encode(text, *args, **kw):
        if len(text) > 1 << 20:
            tokenizing.set()
            release.wait(timeout=20)
        return encode(text, *args, **kw)

    monkeypatch.setattr(tokenizer, "encode", held_encode)
    slow = threading.Event()
    slow.set()
    hook = before_every_forward(server.engine, lambda *_: time.sleep(0.02) if slow.is_set() else None)
    results: dict[str, object] = {}
    chunks: list[tuple[float, dict]] = []

    def normal() -> None:  # streamed, so that its tokens are seen arriving meanwhile
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=120)
        body = {"text": "def f(x):", "stream": True, "sampling_params": {"max_new_tokens": 600, "ignore_eos": True}}
        connection.request("POST", "/generate", json.dumps(body), {"Content-Type": "application/json"})
        response = connection.getresponse()
        while line := response.readline():
            if line.startswith(b"data: {"):
                chunks.append((time.monotonic(), json.loads(line[6:])))
        connection.close()

    def huge() -> None:
        try:
            client.chat.completions.create(model=_model(server), messages=[{"role": "user",
                                                                           "content": "ab " * 3_500_000}])
        except openai.APIStatusError as exc:
            results["huge"] = (exc.status_code, exc.body, time.monotonic())

    def deep(path: str) -> None:
        raw = ("[" * DEEP + "]" * DEEP).encode()
        results[path] = (*http_call(server.url, "POST", path, raw)[::2], time.monotonic())

    def over() -> None:
        answer, error = _too_large(port, "/v1/chat/completions")
        results["over"] = (answer[:12], error, time.monotonic())

    probes: list[float] = []

    def probe() -> None:
        start = time.monotonic()
        connection = http.client.HTTPConnection("127.0.0.1", port, timeout=5)
        try:
            connection.request("GET", "/health")
            assert connection.getresponse().status == 200
        finally:
            connection.close()
        probes.append(time.monotonic() - start)

    threads = [threading.Thread(target=normal)]
    try:
        threads[0].start()
        deadline = time.monotonic() + 30
        while len(chunks) < 5:
            assert time.monotonic() < deadline, "the normal request did not start decoding"
            time.sleep(0.01)
        threads.append(threading.Thread(target=huge))
        threads[-1].start()
        assert tokenizing.wait(timeout=30), "the huge message never reached its tokenization"
        held = time.monotonic()
        others = [threading.Thread(target=deep, args=(p,)) for p in ("/v1/chat/completions", "/generate")]
        others.append(threading.Thread(target=over))
        for thread in others:
            thread.start()
        while any(t.is_alive() for t in others) or time.monotonic() - held < 1.0:
            probe()
            assert time.monotonic() - held < 15, "the other requests were not answered while the huge one was held"
            time.sleep(0.05)
        for thread in others:
            thread.join()
        decoded_while_held = [c for t, c in chunks if t > held]
        release.set()
        while threads[1].is_alive():  # the real tokenization of 10.5 MB (seconds), then its refusal
            probe()
            time.sleep(0.05)
        threads[1].join()
    finally:
        release.set()
        slow.clear()
        for thread in threads:
            thread.join(timeout=120)
        hook.remove()
    assert max(probes) < 1.0, probes
    assert len(decoded_while_held) >= 5  # the normal request went on decoding meanwhile
    for path in ("/v1/chat/completions", "/generate"):
        status, answer, _ = results[path]
        assert status == 400 and "nested too deeply" in answer["error"]["message"], answer
    assert results["over"][0] == b"HTTP/1.1 413" and "generation.max_request_bytes" in str(results["over"][1])
    status, error, _ = results["huge"]
    assert status == 400 and error["param"] == "messages" and "the prompt is" in error["message"], error
    final = chunks[-1][1]
    assert final["meta_info"]["finish_reason"]["type"] == "length" and len(final["output_ids"]) == 600
