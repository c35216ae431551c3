"""Tool calls through the embedded server and the real `openai` client: `tool_choice` (auto, none,
required, a named function), `parallel_tool_calls: false`, the server's tool-call parser (auto from
the chat template, or set), and the 400s of a bad `tool_choice`.

The model is a real Qwen2 whose weights make it a bigram table: its layers add nothing to the
residual stream (zero output projections), each token's embedding is a one-hot vector, and the
unembedding maps each token to the next one of a script. Its greedy answer is the script, whatever
the prompt, so each test knows the text the parser reads; a script's pieces are whole tokens
(the character tokenizer's `words`), so that no token needs two successors."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch
from generation_helpers import http_call, running_server
from transformers import Qwen2Config, Qwen2ForCausalLM

from areal_flow.models.tokenizer import CODE_CHARS, build_char_tokenizer

openai = pytest.importorskip("openai")

INTRO = "Let me check."
CALL_F = '\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
CALL_G = '\n<tool_call>\n{"name": "get_time", "arguments": {"tz": "CET"}}\n</tool_call>'
PYTHONIC = "[get_weather(city='Paris'), get_time(tz='CET')]"
TOOLS = [{"type": "function", "function": {"name": name, "parameters": {"type": "object", "properties": {
    key: {"type": "string"}}}}} for name, key in (("get_weather", "city"), ("get_time", "tz"), ("get_date", "tz"))]
MESSAGES = [{"role": "user", "content": "Weather and time in Paris?"}]


def save_script_model(path: Path, script: tuple[str, ...]) -> str:
    """A model directory whose greedy chat answer is `script` joined, then eos (module docstring)."""
    tokenizer = build_char_tokenizer(CODE_CHARS, chat=True, words=script)
    tokenizer.save_pretrained(path)
    vocab = len(tokenizer)
    hidden = 8 * ((vocab + 7) // 8)
    config = Qwen2Config(vocab_size=vocab, hidden_size=hidden, intermediate_size=16, num_hidden_layers=1,
                         num_attention_heads=2, num_key_value_heads=1, max_position_embeddings=1024,
                         tie_word_embeddings=False, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = Qwen2ForCausalLM(config)
    ids = [tokenizer.convert_tokens_to_ids(piece) for piece in ("\n", *script)] + [tokenizer.eos_token_id]
    with torch.no_grad():
        for layer in model.model.layers:
            layer.self_attn.o_proj.weight.zero_()
            layer.mlp.down_proj.weight.zero_()
        model.model.embed_tokens.weight.copy_(torch.eye(vocab, hidden))
        model.lm_head.weight.zero_()
        for current, following in zip(ids, ids[1:]):  # the prompt ends "assistant\n": the script follows "\n"
            model.lm_head.weight[following, current] = 10.0
    model.save_pretrained(path)
    return str(path)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory):
    path = save_script_model(tmp_path_factory.mktemp("script_model"), (INTRO, CALL_F, CALL_G))
    with running_server(path) as served:
        yield served


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=f"{server.url}/v1", api_key="unused", max_retries=0)


def ask(server, client, **kw):
    return client.chat.completions.create(model=server.tokenizer_path, messages=MESSAGES, temperature=0,
                                          max_tokens=8, **kw).choices[0]


def calls(choice) -> list[tuple[str, dict]]:
    return [(c.function.name, json.loads(c.function.arguments)) for c in choice.message.tool_calls or []]


def test_the_model_answers_its_script_and_auto_reads_both_calls(server, client):
    plain = ask(server, client)  # no tools: the text as written
    assert plain.message.content == INTRO + CALL_F + CALL_G and plain.finish_reason == "stop"
    choice = ask(server, client, tools=TOOLS)
    assert choice.finish_reason == "tool_calls" and choice.message.content == INTRO
    assert calls(choice) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    assert len({c.id for c in choice.message.tool_calls}) == 2
    _, _, info = http_call(server.url, "GET", "/server_info")
    assert info["tool_call_parser"] == "hermes"  # auto: the character tokenizer's template is Qwen's


def test_parallel_tool_calls_false_keeps_the_first_call(server, client):
    choice = ask(server, client, tools=TOOLS, parallel_tool_calls=False)
    assert choice.finish_reason == "tool_calls" and calls(choice) == [("get_weather", {"city": "Paris"})]


def test_a_named_tool_choice_returns_only_calls_to_it(server, client):
    named = {"type": "function", "function": {"name": "get_time"}}
    choice = ask(server, client, tools=TOOLS, tool_choice=named)
    assert choice.finish_reason == "tool_calls" and calls(choice) == [("get_time", {"tz": "CET"})]
    # A function the answer does not call: no call is made up; the answer stays text.
    other = ask(server, client, tools=TOOLS, tool_choice={"type": "function", "function": {"name": "get_date"}})
    assert other.finish_reason == "stop" and other.message.tool_calls is None
    assert other.message.content == INTRO + CALL_F + CALL_G


def test_required_returns_the_calls_and_an_answer_without_one_stays_text(server, client):
    choice = ask(server, client, tools=TOOLS, tool_choice="required")
    assert choice.finish_reason == "tool_calls" and len(calls(choice)) == 2
    # No constrained decoding: an answer without a call (here cut before it) is text, finish stop.
    cut = ask(server, client, tools=TOOLS, tool_choice="required", stop=["\n<tool_call>"])
    assert cut.finish_reason == "stop" and cut.message.tool_calls is None and cut.message.content == INTRO


def test_none_reads_no_calls(server, client):
    choice = ask(server, client, tools=TOOLS, tool_choice="none")
    assert choice.finish_reason == "stop" and choice.message.tool_calls is None
    assert choice.message.content == INTRO + CALL_F + CALL_G


def test_a_streamed_answer_carries_the_same_chosen_calls(server, client):
    stream = client.chat.completions.create(model=server.tokenizer_path, messages=MESSAGES, temperature=0,
                                            max_tokens=8, tools=TOOLS, parallel_tool_calls=False, stream=True)
    chunks = [c.choices[0] for c in stream if c.choices]
    deltas = [call for c in chunks for call in c.delta.tool_calls or []]
    assert [d.function.name for d in deltas] == ["get_weather"] and chunks[-1].finish_reason == "tool_calls"


@pytest.mark.parametrize("kw,message", [
    ({"tool_choice": {"type": "function", "function": {"name": "get_stock"}}}, "'get_stock', which is not one of"),
    ({"tool_choice": "sometimes"}, "tool_choice must be auto, none, required or a function"),
    ({"tool_choice": {"type": "function"}}, "tool_choice must be auto, none, required or"),
    ({"tool_choice": {"type": "function", "function": {"name": "get_time"}}, "tools": None}, "requires tools"),
    ({"tool_choice": "required", "tools": None}, "requires tools"),
])
def test_a_bad_tool_choice_is_a_400_naming_it(server, client, kw, message):
    kw = {"tools": TOOLS, **kw}
    if kw["tools"] is None:
        del kw["tools"]
    with pytest.raises(openai.BadRequestError, match=message) as caught:
        ask(server, client, **kw)
    assert caught.value.body["param"] == "tool_choice"


def test_a_bad_parallel_tool_calls_is_a_400_naming_it(server, client):
    with pytest.raises(openai.BadRequestError) as caught:
        ask(server, client, tools=TOOLS, extra_body={"parallel_tool_calls": "yes"})
    assert caught.value.body["param"] == "parallel_tool_calls"


def test_the_server_reads_calls_in_the_format_it_is_set_to(tmp_path):
    path = save_script_model(tmp_path, (PYTHONIC,))
    for parser, expected in (("pythonic", [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]),
                             ("auto", [])):  # auto: the template's hermes, which reads no call here
        with running_server(path, tool_call_parser=parser) as served:
            client = openai.OpenAI(base_url=f"{served.url}/v1", api_key="unused", max_retries=0)
            choice = ask(served, client, tools=TOOLS)
        assert calls(choice) == expected
        assert choice.finish_reason == ("tool_calls" if expected else "stop")
