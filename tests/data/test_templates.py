"""Prompt templates: a format string over a row's fields and the tokenizer's chat template,
applied once to the prompt field, with errors that name what is missing."""

import pytest

from areal_flow.data.dataset import DatasetError
from areal_flow.data.templates import apply_templates, check_chat_template, template_fields
from areal_flow.models.tokenizer import build_char_tokenizer

ROWS = [{"id": "a", "prompt": "1+1=", "answer": "2", "level": "1"},
        {"id": "b", "prompt": "2+2=", "answer": "4", "level": "2"}]
CHAT = "{% for m in messages %}<{{ m.role }}>{{ m.content }}</{{ m.role }}>{% endfor %}" \
       "{% if add_generation_prompt %}<assistant>{% endif %}"


def chat_tokenizer():
    tok = build_char_tokenizer()
    tok.chat_template = CHAT
    return tok


def test_no_template_leaves_the_rows_as_they_are():
    assert apply_templates(ROWS, "prompt", "d.jsonl") == ROWS
    # chat_template without a tokenizer (the launcher's check before the model exists) applies nothing
    assert apply_templates(ROWS, "prompt", "d.jsonl", chat_template=True) == ROWS


def test_the_format_string_reads_the_row_fields_and_replaces_the_prompt_only():
    out = apply_templates(ROWS, "prompt", "d.jsonl", "Level {level}. Question: {prompt}\nAnswer:")
    assert [r["prompt"] for r in out] == ["Level 1. Question: 1+1=\nAnswer:", "Level 2. Question: 2+2=\nAnswer:"]
    assert [{k: v for k, v in r.items() if k != "prompt"} for r in out] == \
        [{k: v for k, v in r.items() if k != "prompt"} for r in ROWS]
    assert ROWS[0]["prompt"] == "1+1="  # the input rows are not changed


def test_literal_braces_are_doubled():
    out = apply_templates(ROWS[:1], "prompt", "d.jsonl", "{prompt} Put the answer in \\boxed{{}}.")
    assert out[0]["prompt"] == "1+1= Put the answer in \\boxed{}."


def test_a_field_the_row_lacks_is_named_with_the_dataset_and_row():
    with pytest.raises(DatasetError) as e:
        apply_templates(ROWS, "prompt", "d.jsonl", "{prompt} ({topic})")
    assert str(e.value) == ("d.jsonl: row 'a' has no field 'topic', which dataset.prompt_template names "
                            "(row has: id, prompt, answer, level)")


@pytest.mark.parametrize("template, problem", [
    ("{prompt", "not a valid format string"),
    ("Q: {}", "{} is positional; name a row field"),
    ("Q: {0}", "{0} is positional"),
])
def test_a_malformed_template_is_named(template, problem):
    with pytest.raises(DatasetError, match="^dataset.prompt_template: ") as e:
        apply_templates(ROWS, "prompt", "d.jsonl", template)
    assert problem in str(e.value)


def test_template_fields_takes_the_field_before_an_index_or_attribute():
    assert template_fields("{prompt} {meta[k]} {prompt!r} {x.y:>5}") == ["prompt", "meta", "x"]


def test_a_template_that_fails_on_a_row_names_the_row():
    with pytest.raises(DatasetError, match=r"^d.jsonl: row 'a': dataset.prompt_template .* fails \(TypeError"):
        apply_templates(ROWS, "prompt", "d.jsonl", "{prompt[x]}")


def test_the_chat_template_wraps_one_user_message_with_the_generation_prompt():
    out = apply_templates(ROWS, "prompt", "d.jsonl", chat_template=True, tokenizer=chat_tokenizer())
    assert out[0]["prompt"] == "<user>1+1=</user><assistant>"


def test_the_format_string_comes_before_the_chat_template():
    out = apply_templates(ROWS[:1], "prompt", "d.jsonl", "Q: {prompt}", chat_template=True, tokenizer=chat_tokenizer())
    assert out[0]["prompt"] == "<user>Q: 1+1=</user><assistant>"


def test_a_tokenizer_without_a_chat_template_is_an_error_naming_the_key():
    tok = build_char_tokenizer()
    with pytest.raises(DatasetError, match=r"^dataset.chat_template=true, but the tokenizer of my/model has no chat"):
        check_chat_template(tok, "my/model")
    with pytest.raises(DatasetError, match=r"^dataset.chat_template=true"):
        apply_templates(ROWS, "prompt", "d.jsonl", chat_template=True, tokenizer=tok)
