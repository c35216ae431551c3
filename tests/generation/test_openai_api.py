"""OpenAI's wire format on the embedded server (generation/http/openai_api.py), driven by the official
`openai` client: /v1/models, /v1/completions and /v1/chat/completions, streamed or not, the exact
tokens in the extension fields, tool definitions rendered and tool calls parsed, and every bad
request a 4xx naming its field while the server goes on serving."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from generation_helpers import generate_ok, running_server, save_chat_model

from areal_flow.generation.engine.generation_engine import GenerationResult
from areal_flow.generation.engine.sampling import SamplingParams
from areal_flow.generation.http.openai_answers import build_response, parse_tool_calls
from areal_flow.generation.http.openai_api import OpenAICall
from areal_flow.models.tokenizer import CODE_CHARS, build_char_tokenizer

# The dev extra installs it; the GPU image does not carry it (`pytest -m gpu` collects this module).
openai = pytest.importorskip("openai")

MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "What is 2+3?"}]
TOOLS = [{"type": "function", "function": {"name": "python", "description": "Run Python and read what it printed.",
                                           "parameters": {"type": "object",
                                                          "properties": {"code": {"type": "string"}}}}}]


@pytest.fixture(scope="module")
def chat_server(tmp_path_factory: pytest.TempPathFactory):
    """A server of a tiny model over the code task's character tokenizer, which has a chat template."""
    path = tmp_path_factory.mktemp("chat_model")
    tokenizer = save_chat_model(path)
    with running_server(str(path)) as server:
        yield server, tokenizer


@pytest.fixture(scope="module")
def client(chat_server):
    server, _ = chat_server
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def test_models_lists_the_served_model(chat_server, client):
    server, _ = chat_server
    (model,) = client.models.list().data
    assert model.id == server.tokenizer_path and model.model_extra["max_model_len"] == 1024


def test_a_chat_answer_carries_its_exact_tokens_and_matches_generate(chat_server, client):
    server, tokenizer = chat_server
    answer = client.chat.completions.create(model=server.tokenizer_path, messages=MESSAGES, max_tokens=12,
                                            temperature=0)
    (choice,) = answer.choices
    prompt = tokenizer.apply_chat_template(MESSAGES, add_generation_prompt=True, tokenize=False)
    prompt_ids = tokenizer.encode(prompt, add_special_tokens=False)
    assert answer.model_extra["prompt_token_ids"] == prompt_ids
    ids = choice.model_extra["token_ids"]
    assert len(ids) == len(choice.model_extra["output_token_logprobs"]) == len(choice.model_extra["output_token_versions"])
    assert choice.message.content == tokenizer.decode(ids, skip_special_tokens=True)
    assert choice.finish_reason in ("stop", "length") and answer.usage.completion_tokens == len(ids)
    assert answer.usage.prompt_tokens == len(prompt_ids)
    # The same prompt through SGLang's native /generate: the same greedy tokens.
    native = generate_ok(server, {"input_ids": prompt_ids, "sampling_params": {"max_new_tokens": 12, "temperature": 0}})
    assert native["output_ids"] == ids


def test_completions_take_text_or_ids_n_seeds_and_logprobs(chat_server, client):
    server, tokenizer = chat_server
    text = client.completions.create(model=server.tokenizer_path, prompt="def f(x):", max_tokens=6, n=3, seed=7,
                                     logprobs=2)
    assert len(text.choices) == 3 and all(c.logprobs.top_logprobs and len(c.logprobs.top_logprobs[0]) <= 2
                                           for c in text.choices)
    again = client.completions.create(model=server.tokenizer_path, prompt=tokenizer.encode("def f(x):"),
                                      max_tokens=6, n=3, seed=7)
    assert [c.text for c in again.choices] == [c.text for c in text.choices]  # seeded: reproducible
    assert len({tuple(c.model_extra["token_ids"]) for c in text.choices}) > 1  # choice i draws from seed + i


def test_a_streamed_chat_answer_joins_to_the_whole_one(chat_server, client):
    server, _ = chat_server
    kw = dict(model=server.tokenizer_path, messages=MESSAGES, max_tokens=16, temperature=0)
    whole = client.chat.completions.create(**kw)
    chunks = list(client.chat.completions.create(**kw, stream=True, stream_options={"include_usage": True}))
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == whole.choices[0].message.content
    last = [c for c in chunks if c.choices][-1].choices[0]
    assert last.finish_reason == whole.choices[0].finish_reason
    assert last.model_extra["token_ids"] == whole.choices[0].model_extra["token_ids"]
    assert chunks[-1].usage.completion_tokens == whole.usage.completion_tokens


def test_tools_are_rendered_into_the_prompt(chat_server, client):
    server, tokenizer = chat_server
    answer = client.chat.completions.create(model=server.tokenizer_path, messages=MESSAGES, tools=TOOLS,
                                            max_tokens=4, temperature=0)
    prompt = tokenizer.decode(answer.model_extra["prompt_token_ids"])
    assert "<tools>" in prompt and json.dumps(TOOLS[0]) in prompt and prompt.endswith("assistant\n")
    # A conversation that already called the tool renders the call and its result.
    history = [*MESSAGES, {"role": "assistant", "content": None, "tool_calls": [
        {"id": "call_1", "type": "function", "function": {"name": "python", "arguments": '{"code": "print(2+3)"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "5"}]
    answer = client.chat.completions.create(model=server.tokenizer_path, messages=history, tools=TOOLS, max_tokens=4)
    prompt = tokenizer.decode(answer.model_extra["prompt_token_ids"])
    assert '<tool_call>\n{"name": "python", "arguments": {"code": "print(2+3)"}}\n</tool_call>' in prompt
    assert "<tool_response>\n5\n</tool_response>" in prompt


def _answer(tokenizer, text: str, ids: list[int] | None = None, **call_kw) -> dict:
    """The chat response for an answer that decoded to `text` (or of the tokens `ids`), as the
    model ended it with eos."""
    ids = (ids or tokenizer.encode(text)) + [tokenizer.eos_token_id]
    result = GenerationResult(rid="r", prompt_tokens=3, output_ids=ids, output_logprobs=[-0.5] * len(ids),
                              output_versions=[2] * len(ids), finish_reason="stop",
                              matched_stop=tokenizer.eos_token_id, weight_version=2)
    call = OpenAICall(chat=True, model="m", prompt_ids=(1, 2, 3), params=SamplingParams(), n=1, stream=False,
                      logprobs=None, tools=True, echo_usage=False, **call_kw)
    return build_response(call, [result], tokenizer)["choices"][0]


def test_special_tokens_stay_in_the_text_when_asked_so_that_the_text_is_the_tokens():
    tokenizer = build_char_tokenizer(CODE_CHARS, chat=True)
    ids = tokenizer.encode("ab", add_special_tokens=False) + [tokenizer.unk_token_id] + tokenizer.encode("c")
    assert _answer(tokenizer, "", ids)["message"]["content"] == "abc"  # OpenAI's default: left out
    kept = _answer(tokenizer, "", ids, skip_special_tokens=False)["message"]["content"]
    assert kept == "ab<unk>c" and tokenizer.encode(kept, add_special_tokens=False) == ids  # the eos that ended it is not text


def test_tool_calls_are_parsed_and_malformed_ones_stay_text():
    tokenizer = build_char_tokenizer(CODE_CHARS, chat=True)
    call = 'Let me run it.<tool_call>\n{"name": "python", "arguments": {"code": "print(2+3)"}}\n</tool_call>'
    choice = _answer(tokenizer, call)
    assert choice["finish_reason"] == "tool_calls" and choice["message"]["content"] == "Let me run it."
    (tool,) = choice["message"]["tool_calls"]
    assert tool["function"] == {"name": "python", "arguments": '{"code": "print(2+3)"}'}
    assert tool["id"].startswith("call_") and choice["output_token_versions"][0] == 2
    for broken in ('<tool_call>{"name": "python", "arguments": </tool_call>', '<tool_call>["python"]</tool_call>',
                   '<tool_call>{"arguments": {}}</tool_call>'):
        choice = _answer(tokenizer, broken)
        assert choice["finish_reason"] == "stop" and choice["message"]["content"] == broken
        assert "tool_calls" not in choice["message"]
    assert parse_tool_calls("no call here") is None


@pytest.mark.parametrize("kw,status,param", [
    ({"model": "gpt-4o"}, 404, "model"),
    ({"messages": [{"role": "robot", "content": "hi"}]}, 400, "messages[0].role"),
    ({"messages": [{"role": "user"}]}, 400, "messages[0].content"),
    ({"messages": []}, 400, "messages"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, 400, "tools[0].function.name"),
    ({"tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "array"}}}]}, 400,
     "tools[0].function.parameters"),
    ({"n": 65}, 400, "n"),
    ({"max_tokens": 100_000}, 400, "max_tokens"),
    ({"temperature": 3}, 400, "temperature"),
    ({"stop": ["a", "b", "c", "d", "e"]}, 400, "stop"),
])
def test_bad_requests_get_a_4xx_naming_the_field_and_the_server_goes_on(chat_server, client, kw, status, param):
    server, _ = chat_server
    request = {"model": server.tokenizer_path, "messages": MESSAGES, "max_tokens": 2, **kw}
    with pytest.raises(openai.APIStatusError) as caught:
        client.chat.completions.create(**request)
    assert caught.value.status_code == status and caught.value.body["param"] == param
    assert client.chat.completions.create(model=server.tokenizer_path, messages=MESSAGES, max_tokens=2).choices


def test_unknown_fields_are_refused_by_name(chat_server, client):
    server, _ = chat_server
    with pytest.raises(openai.BadRequestError, match="Unrecognized request argument supplied: best_of"):
        client.completions.create(model=server.tokenizer_path, prompt="x", max_tokens=2, extra_body={"best_of": 2})
    # The fields OpenAI's clients send with their defaults are accepted.
    assert client.completions.create(model=server.tokenizer_path, prompt="x", max_tokens=2, user="me",
                                     presence_penalty=0).choices


def test_a_model_without_a_chat_template_says_to_use_completions(model_dirs):
    with running_server(model_dirs.a) as server:
        client = openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)
        with pytest.raises(openai.BadRequestError, match="no chat template"):
            client.chat.completions.create(model=Path(model_dirs.a).name, messages=MESSAGES, max_tokens=2)
        assert client.completions.create(model=model_dirs.a, prompt=[2, 3, 4], max_tokens=2).choices


def test_streamed_completions_keep_their_choices_apart(chat_server, client):
    server, _ = chat_server
    kw = dict(model=server.tokenizer_path, prompt="def g(", max_tokens=10, n=2, seed=3)
    whole = client.completions.create(**kw)
    texts = {0: "", 1: ""}
    for chunk in client.completions.create(**kw, stream=True):
        for c in chunk.choices:
            texts[c.index] += c.text
    assert [texts[0], texts[1]] == [c.text for c in whole.choices]
