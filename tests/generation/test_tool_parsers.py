"""The tool-call parsers (generation/tool_parsers.py) on answers as each model family writes them:
one call, parallel calls, content before the calls, malformed calls and arguments that are not
objects (plain text: None); pythonic answers are read as literals and never run; `auto` picks the
parser from each family's chat template."""

from __future__ import annotations

import json
import os

import pytest

from areal_flow.generation import tool_parsers
from areal_flow.generation.tool_parsers import (
    for_template,
    parse_hermes,
    parse_llama3,
    parse_mistral,
    parse_pythonic,
    resolve,
    template_of,
)
from areal_flow.models.tokenizer import CHAT_TEMPLATE


def args(parsed) -> list[tuple[str, dict]]:
    """The calls as (name, decoded arguments): what an agent reads."""
    return [(c["name"], json.loads(c["arguments"])) for c in parsed[1]]


# ---- hermes: Hermes, Qwen2.5, Qwen3 ------------------------------------------------------------


def test_hermes_reads_qwen_blocks_with_the_content_before_them():
    qwen25 = ('<tool_call>\n{"name": "get_current_temperature", "arguments": {"location": "San Francisco, CA, USA", '
              '"unit": "celsius"}}\n</tool_call>')
    assert parse_hermes(qwen25)[0] is None
    assert args(parse_hermes(qwen25)) == [("get_current_temperature",
                                           {"location": "San Francisco, CA, USA", "unit": "celsius"})]
    qwen3 = ("<think>\nThe user wants the weather in two cities; I will call the tool twice.\n</think>\n\n"
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n'
             '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Tokyo"}}\n</tool_call>')
    content, _ = parse_hermes(qwen3)
    assert content.startswith("<think>") and content.endswith("</think>")
    assert args(parse_hermes(qwen3)) == [("get_weather", {"city": "Paris"}), ("get_weather", {"city": "Tokyo"})]


def test_hermes_ends_a_block_where_its_json_ends_not_at_a_tag_inside_a_string():
    answer = '<tool_call>\n{"name": "echo", "arguments": {"text": "say </tool_call> now"}}\n</tool_call>'
    assert args(parse_hermes(answer)) == [("echo", {"text": "say </tool_call> now"})]
    assert args(parse_hermes('<tool_call>\n{"name": "f", "arguments": {}}\n')) == [("f", {})]  # ended by eos
    assert args(parse_hermes('<tool_call>{"name": "f"}</tool_call>')) == [("f", {})]  # no arguments: none


@pytest.mark.parametrize("answer", [
    "The answer is 42.",
    '<tool_call>\n{"name": "f", "arguments": {"x": 1}\n</tool_call>',  # an unclosed brace
    '<tool_call>\n["f", {"x": 1}]\n</tool_call>',
    '<tool_call>\n{"arguments": {"x": 1}}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": [1, 2]}\n</tool_call>',  # arguments that are not an object
    '<tool_call>\n{"name": "f", "arguments": "x=1"}\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {}} and more\n</tool_call>',
    '<tool_call>\n{"name": "f", "arguments": {}}\n</tool_call><tool_call>not json</tool_call>',  # one bad: all text
    "<tool_call>" + "[" * 100_000,  # too deep to decode
])
def test_hermes_malformed_answers_are_text(answer):
    assert parse_hermes(answer) is None


def test_arguments_written_as_a_json_string_of_an_object_are_kept():
    answer = '<tool_call>\n{"name": "f", "arguments": "{\\"x\\": 1}"}\n</tool_call>'
    assert parse_hermes(answer)[1] == [{"name": "f", "arguments": '{"x": 1}'}]


# ---- llama3: Llama 3.1/3.2/3.3 JSON --------------------------------------------------------------


def test_llama3_reads_a_json_call_with_parameters_or_arguments():
    answer = '{"name": "get_current_conditions", "parameters": {"location": "San Francisco, CA", "unit": "Fahrenheit"}}'
    assert parse_llama3(answer) == (None, [{"name": "get_current_conditions",
                                            "arguments": '{"location": "San Francisco, CA", "unit": "Fahrenheit"}'}])
    assert args(parse_llama3('{"name": "f", "arguments": {"x": 1}}')) == [("f", {"x": 1})]


def test_llama3_parallel_calls_are_joined_by_semicolons_or_an_array():
    answer = ('<|python_tag|>{"name": "get_weather", "parameters": {"city": "Paris"}}; '
              '{"name": "get_time", "parameters": {"timezone": "Europe/Paris"}}')
    assert args(parse_llama3(answer)) == [("get_weather", {"city": "Paris"}),
                                          ("get_time", {"timezone": "Europe/Paris"})]
    array = '[{"name": "a", "parameters": {}}, {"name": "b", "parameters": {"k": [1, 2]}}]'
    assert args(parse_llama3(array)) == [("a", {}), ("b", {"k": [1, 2]})]


def test_llama3_content_before_the_python_tag():
    answer = 'Let me look that up.<|python_tag|>{"name": "search", "parameters": {"query": "llama"}}'
    assert parse_llama3(answer)[0] == "Let me look that up." and args(parse_llama3(answer)) == [
        ("search", {"query": "llama"})]


@pytest.mark.parametrize("answer", [
    "Paris is sunny today.",
    '{"name": "Ada", "age": 36}',  # a JSON answer, no call: no parameters
    'Here you go: {"name": "f", "parameters": {}}',  # text first, no python tag
    '{"name": "f", "parameters": {}} I called it.',  # text after
    '{"name": "f", "parameters": {}}; {"name": "g", "parameters": ',  # the second cut short
    '{"name": "f", "parameters": [1]}',
    '{"name": 3, "parameters": {}}',
])
def test_llama3_malformed_answers_are_text(answer):
    assert parse_llama3(answer) is None


# ---- mistral ---------------------------------------------------------------------------------------


def test_mistral_reads_the_json_array_after_tool_calls():
    answer = ('[TOOL_CALLS] [{"name": "get_current_weather", "arguments": {"location": "Boston, MA", '
              '"unit": "fahrenheit"}}, {"name": "get_current_weather", "arguments": {"location": "Paris"}}]')
    assert args(parse_mistral(answer)) == [("get_current_weather", {"location": "Boston, MA", "unit": "fahrenheit"}),
                                           ("get_current_weather", {"location": "Paris"})]
    assert parse_mistral("I'll check.[TOOL_CALLS][" + '{"name": "f", "arguments": {}}]')[0] == "I'll check."


def test_mistral_reads_the_newer_name_args_form_one_marker_a_call():
    answer = '[TOOL_CALLS]get_weather[ARGS]{"city": "Paris"}[TOOL_CALLS]get_time[ARGS]{"tz": "CET"}'
    assert args(parse_mistral(answer)) == [("get_weather", {"city": "Paris"}), ("get_time", {"tz": "CET"})]
    with_id = 'Sure. [TOOL_CALLS]search[CALL_ID]a1B2c3D4e[ARGS]{"q": "mistral"}'
    assert parse_mistral(with_id)[0] == "Sure." and args(parse_mistral(with_id)) == [("search", {"q": "mistral"})]


def test_mistral_without_its_marker_reads_an_answer_that_is_only_the_array():
    # [TOOL_CALLS] is a special token: a decode that skips them leaves the array alone.
    assert args(parse_mistral('[{"name": "f", "arguments": {"x": 1}}]')) == [("f", {"x": 1})]
    assert parse_mistral('[{"name": "Ada"}]') is None  # a JSON answer without arguments is no call


@pytest.mark.parametrize("answer", [
    "No tools needed: 4.",
    '[TOOL_CALLS] [{"name": "f", "arguments": {}}',  # unclosed
    '[TOOL_CALLS] [{"name": "f", "arguments": "not json"}]',
    "[TOOL_CALLS] []",
    '[TOOL_CALLS]get_weather[ARGS]["Paris"]',
    "[TOOL_CALLS]get_weather",
    '[{"name": "f", "arguments": {}}] and then some',
])
def test_mistral_malformed_answers_are_text(answer):
    assert parse_mistral(answer) is None


# ---- pythonic: Llama 3.2 / Llama 4 -----------------------------------------------------------------


def test_pythonic_reads_a_list_of_calls_with_literal_keywords():
    answer = ('[get_weather(city="San Francisco", metric="celsius"), '
              'get_time(tz=\'PST\', offsets=[-8, +1.5], opts={"dst": True, "fallback": None})]')
    assert args(parse_pythonic(answer)) == [
        ("get_weather", {"city": "San Francisco", "metric": "celsius"}),
        ("get_time", {"tz": "PST", "offsets": [-8, 1.5], "opts": {"dst": True, "fallback": None}})]
    assert args(parse_pythonic("<|python_start|>[now()]<|python_end|>")) == [("now", {})]


def test_pythonic_content_on_lines_before_the_list():
    answer = "I need two lookups [first the weather].\n[get_weather(city='Oslo'), get_time(tz='CET')]"
    content, _ = parse_pythonic(answer)
    assert content == "I need two lookups [first the weather]."
    assert [name for name, _ in args(parse_pythonic(answer))] == ["get_weather", "get_time"]


@pytest.mark.parametrize("answer", [
    "[f(x=__import__('os').system('id'))]",  # an attack: a call as an argument
    "[f(x=open('/etc/passwd').read())]",
    "[f(x=(lambda: 1)())]",
    "[f(x=y)]",  # a name
    "[f(x=1 + 1)]",
    "[f(**{'x': 1})]",
    "[f(1)]",  # positional: no argument names
    "[os.system(cmd='id')]",  # an attribute, not a function name
    "[f(x=1e999)]",  # not a JSON number
    "[f(x={1: 2})]",
    "[f(x=b'bytes')]",
    "[1, 2, 3]",
    "[]",
    "f(x=1)",
    "The list is [a, b].",
    "[f(x=" + "[" * 5000 + "]" * 5000 + ")]",
])
def test_pythonic_anything_but_literal_calls_is_text_and_nothing_runs(answer, monkeypatch):
    ran = []
    monkeypatch.setattr(os, "system", lambda *a: ran.append(a))
    assert parse_pythonic(answer) is None and not ran


# ---- choosing a parser ---------------------------------------------------------------------------


TEMPLATES = {
    # Excerpts of each family's chat template: the part that says how calls are written.
    "hermes": CHAT_TEMPLATE,
    "qwen3": ("{%- for tool in tools %}\\n{{- tool | tojson }}{%- endfor %}{{- \"\\n</tools>\\n\\nFor each function "
              "call, return a json object with function name and arguments within <tool_call></tool_call> XML "
              "tags:\\n<tool_call>\\n{\\\"name\\\": <function-name>, \\\"arguments\\\": <args-json-object>}\\n"
              "</tool_call><|im_end|>\\n\" }}"),
    "llama3": ("{{- 'Given the following functions, please respond with a JSON for a function call with its proper "
               "arguments that best answers the given prompt.\\n\\n' }}{{- 'Respond in the format {\"name\": function "
               "name, \"parameters\": dictionary of argument name and its value}.' }}{%- if builtin_tools is defined "
               "%}{{- '<|python_tag|>' + tool_call.name + '.call(' }}{%- endif %}"),
    "mistral": ("{%- if message.tool_calls is defined and message.tool_calls is not none %}{{- \"[TOOL_CALLS] [\" }}"
                "{%- for tool_call in message.tool_calls %}{{- tool_call.function|tojson }}{%- endfor %}"),
    "pythonic": ("{{- \"If you decide to invoke any of the function(s), you MUST put it in the format of "
                 "[func_name1(params_name1=params_value1, params_name2=params_value2...), func_name2(params)]\" }}"
                 "{{- \"<|python_start|>\" }}"),
}


@pytest.mark.parametrize("family,parser", [("hermes", "hermes"), ("qwen3", "hermes"), ("llama3", "llama3"),
                                           ("mistral", "mistral"), ("pythonic", "pythonic")])
def test_auto_picks_the_parser_from_the_chat_template(family, parser):
    assert for_template(TEMPLATES[family]) == parser == resolve("auto", TEMPLATES[family])


def test_auto_falls_back_to_hermes_and_aliases_name_the_same_parsers():
    assert for_template(None) == for_template("{{ messages }}") == "hermes"
    assert [resolve(n) for n in ("qwen25", "qwen", "llama3_json", "llama4_pythonic", "mistral")] == [
        "hermes", "hermes", "llama3", "pythonic", "mistral"]


def test_an_unknown_parser_is_an_error_naming_the_key():
    with pytest.raises(ValueError, match=r"generation.tool_call_parser='qwen3_coder' is not a tool-call parser"):
        resolve("qwen3_coder")
    with pytest.raises(ValueError, match="--tool-call-parser='x'"):
        resolve("x", key="--tool-call-parser")


def test_the_config_key_offers_the_parsers_names():
    import dataclasses

    from areal_flow.config.schema import GenerationConfig

    (field,) = [f for f in dataclasses.fields(GenerationConfig) if f.name == "tool_call_parser"]
    assert field.default == "auto" and field.metadata["choices"] == tool_parsers.NAMES


def test_template_of_reads_a_model_directory(tmp_path):
    assert template_of(str(tmp_path)) is None
    (tmp_path / "tokenizer_config.json").write_text(json.dumps({"chat_template": [
        {"name": "default", "template": "{{ messages }}"}, {"name": "tool_use", "template": TEMPLATES["mistral"]}]}))
    assert for_template(template_of(str(tmp_path))) == "mistral"
    (tmp_path / "tokenizer_config.json").write_text("{}")
    (tmp_path / "chat_template.jinja").write_text(TEMPLATES["llama3"])
    assert for_template(template_of(str(tmp_path))) == "llama3"
